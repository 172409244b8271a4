package testenv

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
)

// CgroupRoot is the cgroup under which the node's kubelet puts its pods
// (its cgroupRoot). A dedicated subtree, rather than the hierarchy's root,
// lets teardown remove exactly what the node made, and keeps the pods'
// cgroups apart from containerd's own.
const CgroupRoot = "/agentbox-testenv"

// PodPidsLimit is the node's podPidsLimit. Kubernetes has no per-pod
// field for it, so a node pool's kubelet sets it. It is the backstop that
// keeps the rest of the node's PIDs: a gVisor sandbox that meets it dies
// whole (its kernel cannot make threads), so the supervisor's own,
// smaller limit on commands is what a fork bomb meets first.
const PodPidsLimit = 4096

const cgroupFS = "/sys/fs/cgroup"

// cgroupV1Hierarchies lists the mounted cgroup v1 hierarchies, by the path
// of their mount point. The kubelet needs its cgroupRoot to exist in each.
func cgroupV1Hierarchies() ([]string, error) {
	data, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return nil, err
	}
	var dirs []string
	for _, line := range strings.Split(string(data), "\n") {
		// mountinfo: ID parent major:minor root mountpoint options ... - fstype source superoptions
		pre, post, ok := strings.Cut(line, " - ")
		if !ok {
			continue
		}
		f, g := strings.Fields(pre), strings.Fields(post)
		if len(f) < 5 || len(g) < 1 || g[0] != "cgroup" {
			continue
		}
		if mp := unescapeMount(f[4]); strings.HasPrefix(mp, cgroupFS+"/") {
			dirs = append(dirs, mp)
		}
	}
	slices.Sort(dirs)
	return slices.Compact(dirs), nil
}

// makeCgroupRoot creates CgroupRoot in every hierarchy. cpuset cgroups
// start with no CPUs or memory nodes, and a task cannot join one until
// both are set, so they are copied from the parent.
func makeCgroupRoot() error {
	hs, err := cgroupV1Hierarchies()
	if err != nil {
		return fmt.Errorf("list cgroup hierarchies: %w", err)
	}
	if len(hs) == 0 {
		return errors.New("no cgroup v1 hierarchies are mounted under " + cgroupFS)
	}
	for _, h := range hs {
		dir := filepath.Join(h, CgroupRoot)
		if err := os.Mkdir(dir, 0o755); err != nil && !errors.Is(err, fs.ErrExist) {
			return fmt.Errorf("create cgroup %s: %w", dir, err)
		}
		for _, f := range []string{"cpuset.cpus", "cpuset.mems"} {
			v, err := os.ReadFile(filepath.Join(h, f))
			if errors.Is(err, fs.ErrNotExist) {
				continue
			} else if err != nil {
				return err
			}
			if err := os.WriteFile(filepath.Join(dir, f), v, 0o644); err != nil {
				return fmt.Errorf("set %s of %s: %w", f, dir, err)
			}
		}
	}
	return nil
}

// removeCgroupRoot removes CgroupRoot and every cgroup under it, deepest
// first (a cgroup directory can only be removed once it has no children
// and no tasks). It is a no-op when there is nothing to remove.
func removeCgroupRoot() error {
	hs, err := cgroupV1Hierarchies()
	if err != nil {
		return fmt.Errorf("list cgroup hierarchies: %w", err)
	}
	var errs []error
	for _, h := range hs {
		root := filepath.Join(h, CgroupRoot)
		var dirs []string
		_ = filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
			if err == nil && d.IsDir() {
				dirs = append(dirs, p)
			}
			return nil
		})
		// WalkDir visits parents before children.
		for _, d := range slices.Backward(dirs) {
			if err := os.Remove(d); err != nil && !errors.Is(err, fs.ErrNotExist) {
				errs = append(errs, fmt.Errorf("remove cgroup %s: %w", d, err))
			}
		}
	}
	return errors.Join(errs...)
}
