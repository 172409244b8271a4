package testenv

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"syscall"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/agentbox/terraform-provider-agentbox/internal/testenv/loopvol"
)

// hostPathPVRoot is where kube-controller-manager's hostPath provisioner
// puts volumes. It is fixed in kube-controller-manager.
const hostPathPVRoot = "/tmp/hostpath_pv/"

// teardown stops every process of the cluster and undoes its host changes.
// Each step runs even if an earlier one failed, and each is a no-op when
// there is nothing left to undo, so calling it twice is safe.
func teardown(ctx context.Context, st *state, log io.Writer) error {
	logf := func(format string, args ...any) { fmt.Fprintf(log, "testenv: "+format+"\n", args...) }
	var errs []error
	var pvDirs []string
	if st.Node {
		pvDirs = drainNode(ctx, st, logf)
	}
	stopProcesses(ctx, st, logf)
	if err := unmountUnder(st.Dir); err != nil {
		errs = append(errs, err)
	}
	// The volumes' loop devices (package loopvol) go with their last mounts;
	// one a crashed provisioner left attached without a mount is found by
	// its image, which lives below the state folder like everything else.
	// The images go with the folder's data below.
	detachStart := time.Now()
	devs, err := loopvol.DetachUnder(st.Dir, 10*time.Second)
	if err != nil {
		errs = append(errs, err)
	}
	if len(devs) > 0 {
		logf("detached %d loop device(s) left attached (%s)", len(devs), time.Since(detachStart).Round(time.Millisecond))
	}
	if st.Cgroups {
		if err := removeCgroupRootRetrying(); err != nil {
			errs = append(errs, err)
		}
	}
	errs = append(errs, undoHostNetwork(ctx, st, pvDirs, logf)...)
	return errors.Join(append(errs, removeData(st.Dir)...)...)
}

// stopProcesses stops the cluster's processes in reverse start order (the
// node before the control plane it reports to), then what containerd left.
func stopProcesses(ctx context.Context, st *state, logf func(string, ...any)) {
	for i := len(st.Procs) - 1; i >= 0; i-- {
		p := st.Procs[i]
		if p.Name == "containerd" {
			killContainers(ctx, st)
		}
		if alive(p.PID) {
			stopPID(p.PID, 10*time.Second)
			logf("stopped %s (pid %d)", p.Name, p.PID)
		}
	}
	// Shims and gVisor sandboxes are containerd's children, not ours; they
	// carry our state directory on their command lines.
	for _, pid := range pidsMentioning(st.Dir) {
		stopPID(pid, 2*time.Second)
		logf("stopped leftover pid %d", pid)
	}
}

// removeCgroupRootRetrying removes the pods' cgroup root: a killed
// sandbox's cgroup can hold its exiting tasks for a moment.
func removeCgroupRootRetrying() error {
	var err error
	for range 50 {
		if err = removeCgroupRoot(); err == nil {
			return nil
		}
		time.Sleep(100 * time.Millisecond)
	}
	return err
}

// undoHostNetwork removes the fence, the node address and the hostPath
// volume folders, and restores ip_forward.
func undoHostNetwork(ctx context.Context, st *state, pvDirs []string, logf func(string, ...any)) []error {
	var errs []error
	if st.Node || st.Fence {
		if err := cleanNetwork(ctx, st, logf); err != nil {
			errs = append(errs, err)
		}
		for _, d := range pvDirs {
			if err := os.RemoveAll(d); err != nil {
				errs = append(errs, err)
			}
		}
	}
	if st.LoAddr {
		if err := exec.CommandContext(ctx, "ip", "addr", "del", st.NodeIP+"/32", "dev", "lo").Run(); err == nil {
			logf("removed %s from lo", st.NodeIP)
		}
	}
	if st.IPForward != "" {
		if err := os.WriteFile(ipForwardPath, []byte(st.IPForward), 0o644); err != nil {
			errs = append(errs, fmt.Errorf("restore ip_forward: %w", err))
		}
	}
	return errs
}

// removeData empties the state folder but for the logs, kept for a
// post-mortem.
func removeData(dir string) []error {
	var errs []error
	entries, _ := os.ReadDir(dir)
	for _, e := range entries {
		if !strings.HasSuffix(e.Name(), ".log") {
			if err := os.RemoveAll(filepath.Join(dir, e.Name())); err != nil {
				errs = append(errs, err)
			}
		}
	}
	return errs
}

// drainNode deletes the node's pods while kubelet still runs, so that it
// tears down their mounts and network namespaces itself, and returns the
// hostPath volume folders to remove once nothing uses them.
func drainNode(ctx context.Context, st *state, logf func(string, ...any)) []string {
	if p := st.proc("kube-apiserver"); p == nil || !alive(p.PID) {
		return nil
	}
	cfg, err := clientcmd.BuildConfigFromFlags("", st.Kubeconfig)
	if err != nil {
		return nil
	}
	cfg.Timeout = 5 * time.Second
	cs, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return nil
	}
	var dirs []string
	if pvs, err := cs.CoreV1().PersistentVolumes().List(ctx, metav1.ListOptions{}); err == nil {
		for _, pv := range pvs.Items {
			if hp := pv.Spec.HostPath; hp != nil && strings.HasPrefix(hp.Path, hostPathPVRoot) {
				dirs = append(dirs, hp.Path)
			}
		}
	}
	if k := st.proc("kubelet"); k == nil || !alive(k.PID) {
		return dirs
	}
	sel := metav1.ListOptions{FieldSelector: "spec.nodeName=" + NodeName}
	zero := int64(0)
	pods, err := cs.CoreV1().Pods("").List(ctx, sel)
	if err != nil || len(pods.Items) == 0 {
		return dirs
	}
	for _, p := range pods.Items {
		_ = cs.CoreV1().Pods(p.Namespace).Delete(ctx, p.Name, metav1.DeleteOptions{GracePeriodSeconds: &zero})
	}
	deadline := time.Now().Add(60 * time.Second)
	for time.Now().Before(deadline) {
		pods, err := cs.CoreV1().Pods("").List(ctx, sel)
		if err != nil || len(pods.Items) == 0 {
			break
		}
		time.Sleep(250 * time.Millisecond)
	}
	logf("drained node %s", NodeName)
	return dirs
}

// killContainers stops whatever tasks kubelet did not, through containerd
// itself, while it still runs.
func killContainers(ctx context.Context, st *state) {
	ctr := filepath.Join(st.BinDir, "ctr")
	sock := filepath.Join(st.Dir, "containerd", "containerd.sock")
	if _, err := os.Stat(sock); err != nil {
		return
	}
	cctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	base := []string{"-a", sock, "-n", "k8s.io"}
	out, err := exec.CommandContext(cctx, ctr, append(base, "tasks", "ls", "-q")...).Output()
	if err != nil {
		return
	}
	for _, id := range strings.Fields(string(out)) {
		_ = exec.CommandContext(cctx, ctr, append(base, "tasks", "kill", "-s", "SIGKILL", id)...).Run()
	}
	out, _ = exec.CommandContext(cctx, ctr, append(base, "containers", "ls", "-q")...).Output()
	for _, id := range strings.Fields(string(out)) {
		_ = exec.CommandContext(cctx, ctr, append(base, "tasks", "rm", "-f", id)...).Run()
		_ = exec.CommandContext(cctx, ctr, append(base, "containers", "rm", id)...).Run()
	}
}

// unmountUnder unmounts every mount point below dir, deepest first. The
// kubelet's volumes, containerd's overlay snapshots, the pods' network
// namespaces and the provisioners' loop-mounted volumes all live there.
func unmountUnder(dir string) error {
	var errs []error
	for attempt := 0; attempt < 3; attempt++ {
		mounts, err := mountsUnder(dir)
		if err != nil || len(mounts) == 0 {
			return err
		}
		errs = errs[:0]
		for _, m := range mounts {
			if err := syscall.Unmount(m, 0); err != nil {
				if err2 := syscall.Unmount(m, syscall.MNT_DETACH); err2 != nil {
					errs = append(errs, fmt.Errorf("unmount %s: %w", m, err2))
				}
			}
		}
	}
	return errors.Join(errs...)
}

func mountsUnder(dir string) ([]string, error) {
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return nil, err
	}
	defer f.Close()
	prefix := strings.TrimSuffix(dir, "/") + "/"
	var mounts []string
	s := bufio.NewScanner(f)
	for s.Scan() {
		fields := strings.Fields(s.Text())
		if len(fields) < 5 {
			continue
		}
		mp := unescapeMount(fields[4])
		if strings.HasPrefix(mp, prefix) {
			mounts = append(mounts, mp)
		}
	}
	sort.Slice(mounts, func(i, j int) bool { return len(mounts[i]) > len(mounts[j]) })
	return mounts, s.Err()
}

// unescapeMount undoes the octal escapes mountinfo uses for spaces and tabs.
func unescapeMount(s string) string {
	r := strings.NewReplacer(`\040`, " ", `\011`, "\t", `\012`, "\n", `\134`, `\`)
	return r.Replace(s)
}

// cleanNetwork removes the bridge, the iptables chains that kubelet,
// kube-proxy, the CNI plugins and the NetworkPolicy enforcer made, and the
// enforcer's ipsets. Only chains and sets with their prefixes are touched.
func cleanNetwork(ctx context.Context, st *state, logf func(string, ...any)) error {
	var errs []error
	if exec.CommandContext(ctx, "ip", "link", "show", Bridge).Run() == nil {
		if err := run(ctx, "ip", "link", "del", Bridge); err != nil {
			errs = append(errs, err)
		} else {
			logf("deleted bridge %s", Bridge)
		}
	}
	if proxy := filepath.Join(st.BinDir, "kube-proxy"); fileExists(proxy) {
		cctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		_ = exec.CommandContext(cctx, proxy, "--cleanup").Run()
		cancel()
	}
	for _, ipt := range []string{"iptables", "ip6tables"} {
		if _, err := exec.LookPath(ipt); err != nil {
			continue
		}
		n, err := removeChains(ctx, ipt)
		if err != nil {
			errs = append(errs, err)
		}
		if n > 0 {
			logf("removed %d %s chains", n, ipt)
		}
	}
	// The sets go with every node cluster, enforcing or not: only
	// kube-router makes sets of these names, and a stale run whose state
	// lost track of its enforcer still gets them removed.
	n, err := removeIPSets(ctx)
	if err != nil {
		errs = append(errs, err)
	}
	if n > 0 {
		logf("removed %d ipsets", n)
	}
	return errors.Join(errs...)
}

var ownedChainPrefixes = []string{"KUBE-", "CNI-", "AGENTBOX-"}

func ownedChain(name string) bool {
	for _, p := range ownedChainPrefixes {
		if strings.HasPrefix(name, p) {
			return true
		}
	}
	return false
}

// removeChains deletes the jumps into owned chains from the built-in
// chains, then flushes and deletes the owned chains.
func removeChains(ctx context.Context, ipt string) (int, error) {
	removed := 0
	var errs []error
	for _, table := range []string{"filter", "nat", "mangle"} {
		out, err := exec.CommandContext(ctx, ipt, "-w", "-t", table, "-S").Output()
		if err != nil {
			continue
		}
		var chains []string
		for _, line := range strings.Split(string(out), "\n") {
			f := splitRule(line)
			switch {
			case len(f) >= 2 && f[0] == "-N" && ownedChain(f[1]):
				chains = append(chains, f[1])
			case len(f) >= 2 && f[0] == "-A" && !ownedChain(f[1]) && jumpsToOwned(f):
				args := append([]string{"-w", "-t", table, "-D"}, f[1:]...)
				if err := exec.CommandContext(ctx, ipt, args...).Run(); err != nil {
					errs = append(errs, fmt.Errorf("%s -t %s -D %s: %w", ipt, table, strings.Join(f[1:], " "), err))
				}
			}
		}
		for _, ch := range chains {
			_ = exec.CommandContext(ctx, ipt, "-w", "-t", table, "-F", ch).Run()
		}
		for _, ch := range chains {
			if err := exec.CommandContext(ctx, ipt, "-w", "-t", table, "-X", ch).Run(); err != nil {
				errs = append(errs, fmt.Errorf("%s -t %s -X %s: %w", ipt, table, ch, err))
			} else {
				removed++
			}
		}
	}
	return removed, errors.Join(errs...)
}

func jumpsToOwned(f []string) bool {
	for i := 0; i+1 < len(f); i++ {
		if (f[i] == "-j" || f[i] == "-g") && ownedChain(f[i+1]) {
			return true
		}
	}
	return false
}

func fileExists(p string) bool { _, err := os.Stat(p); return err == nil }

// splitRule splits a line of `iptables -S` into arguments, keeping quoted
// comments such as "kubernetes service portals" as one argument.
func splitRule(line string) []string {
	var args []string
	var cur strings.Builder
	inQuote, have := false, false
	for i := 0; i < len(line); i++ {
		ch := line[i]
		switch {
		case ch == '\\' && inQuote && i+1 < len(line):
			i++
			cur.WriteByte(line[i])
		case ch == '"':
			inQuote, have = !inQuote, true
		case (ch == ' ' || ch == '\t') && !inQuote:
			if have {
				args = append(args, cur.String())
				cur.Reset()
				have = false
			}
		default:
			cur.WriteByte(ch)
			have = true
		}
	}
	if have {
		args = append(args, cur.String())
	}
	return args
}
