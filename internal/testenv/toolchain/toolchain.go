// Package toolchain builds the binaries of a real local Kubernetes node
// (etcd, the Kubernetes components, containerd and gVisor) from the Go module
// proxy into a versioned cache, and installs the few Debian packages the node
// needs. Nothing is downloaded as a prebuilt binary: every component is a
// small wrapper module whose go.mod is embedded here.
package toolchain

import (
	"bytes"
	"context"
	"crypto/sha256"
	"embed"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"syscall"
	"time"

	"github.com/agentbox/terraform-provider-agentbox/internal/progress"
)

// Layout is the cache format version. Bump it when the directory layout
// changes so that an old cache is never half-reused.
const Layout = "v1"

// Versions of what the node runs. They are part of every component's stamp,
// so changing one rebuilds exactly that component.
const (
	EtcdVersion       = "v3.6.16"
	KubernetesVersion = "v1.34.4"
	ContainerdVersion = "v2.1.5"
	GVisorVersion     = "v0.0.0-20260905035102-160fafc42237"
)

// ClusterPackages are the Debian packages a cluster needs, installed with
// apt when missing: the OCI runtime, the netfilter tools kube-proxy and the
// CNI plugins drive, the CNI plugins themselves, busybox for the test
// images, and the tools that give every volume of the node a filesystem of
// its size on a loop device (internal/testenv/loopvol): mkfs.ext4 and
// debugfs (e2fsprogs), mount and umount (mount).
var ClusterPackages = []string{"runc", "iptables", "containernetworking-plugins", "busybox-static", "e2fsprogs", "mount"}

// TestPackages are needed by the tests alone: PostgreSQL, which the store's
// tests start as a real server (internal/testenv/postgres), and ipset,
// through which the NetworkPolicy enforcer (kube-router) matches pods.
var TestPackages = []string{"postgresql", "ipset"}

//go:embed wrappers
var wrappers embed.FS

// RestoreShim is the runsc shim that can start a pod's containers from a
// sandbox checkpoint (wrappers/gvisor-restore-shim/main.go).
const RestoreShim = "containerd-shim-agentbox-runsc-v1"

// wrapperSources are a wrapper's own Go files: a component whose main
// package is not in its dependencies keeps it beside its go.mod, behind a
// "go:build ignore" line so that this module never builds it.
func wrapperSources(name string) (map[string][]byte, error) {
	entries, err := wrappers.ReadDir("wrappers/" + name)
	if err != nil {
		return nil, err
	}
	srcs := map[string][]byte{}
	for _, e := range entries {
		if !strings.HasSuffix(e.Name(), ".go") {
			continue
		}
		b, err := wrappers.ReadFile("wrappers/" + name + "/" + e.Name())
		if err != nil {
			return nil, err
		}
		const ignore = "//go:build ignore\n"
		if !bytes.HasPrefix(b, []byte(ignore)) {
			return nil, fmt.Errorf("wrapper %s/%s must start with %q", name, e.Name(), ignore)
		}
		srcs[e.Name()] = b[len(ignore):]
	}
	return srcs, nil
}

type binary struct {
	out string // file name under bin/
	pkg string // import path of the main package
}

type component struct {
	name string
	// testOnly components serve tests that start them themselves; a
	// cluster, and so the quickstart, runs without them.
	testOnly bool
	// spike components serve research spikes (build tags of their own)
	// and are built only when the Builder asks for Spikes.
	spike   bool
	binary  []binary
	ldflags string
	tags    string
	// vendor builds from a vendored tree, so that patch can change a file of
	// a dependency without committing any of its source.
	vendor bool
	patch  func(dir string) error
	// files copies what the component ships besides binaries (CRDs) out of
	// its resolved modules into the cache, after the build; produces lists
	// those files, relative to the cache, so that a missing one is rebuilt
	// and reported.
	files    func(ctx context.Context, b *Builder, src string) error
	produces []string
}

func components() []component {
	kv := strings.TrimPrefix(KubernetesVersion, "v")
	parts := strings.SplitN(kv, ".", 3)
	k8sLD := fmt.Sprintf("-s -w -X k8s.io/component-base/version.gitVersion=%s -X k8s.io/component-base/version.gitMajor=%s -X k8s.io/component-base/version.gitMinor=%s -X k8s.io/component-base/version.gitTreeState=clean",
		KubernetesVersion, parts[0], parts[1])
	return []component{
		{name: "etcd", binary: []binary{
			{"etcd", "go.etcd.io/etcd/server/v3"},
			{"etcdctl", "go.etcd.io/etcd/etcdctl/v3"},
		}, ldflags: "-s -w"},
		{name: "k8s", binary: []binary{
			{"kube-apiserver", "k8s.io/kubernetes/cmd/kube-apiserver"},
			{"kube-controller-manager", "k8s.io/kubernetes/cmd/kube-controller-manager"},
			{"kube-scheduler", "k8s.io/kubernetes/cmd/kube-scheduler"},
			{"kube-proxy", "k8s.io/kubernetes/cmd/kube-proxy"},
			{"kubelet", "k8s.io/kubernetes/cmd/kubelet"},
		}, ldflags: k8sLD},
		{name: "containerd", binary: []binary{
			{"containerd", "github.com/containerd/containerd/v2/cmd/containerd"},
			{"containerd-shim-runc-v2", "github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2"},
			{"ctr", "github.com/containerd/containerd/v2/cmd/ctr"},
		}, ldflags: "-s -w", tags: "no_btrfs no_devmapper no_zfs"},
		{name: "gvisor", binary: []binary{
			{"runsc", "gvisor.dev/gvisor/runsc"},
			{"containerd-shim-runsc-v1", "gvisor.dev/gvisor/shim"},
		}, ldflags: "-s -w", vendor: true, patch: patchGVisorShimOOM},
		// The runsc shim with the restore from memory (the suspend with
		// memory research): its own component, so that its cache entry
		// never replaces the stock shim's. Only the test env's restoring
		// runtime handler uses it. Built only on request (Spikes): no test
		// in CI starts it, and a second gVisor build would add minutes to
		// a cold CI run.
		{name: "gvisor-restore-shim", testOnly: true, spike: true, binary: []binary{
			{RestoreShim, "agentbox.local/testenv/gvisor-restore-shim"},
		}, ldflags: "-s -w", vendor: true, patch: patchGVisorShimOOM},
		// The S3-compatible store the archive snapshot driver is tested
		// against.
		{name: "versitygw", testOnly: true, binary: []binary{
			{"versitygw", "github.com/versity/versitygw/cmd/versitygw"},
		}, ldflags: "-s -w"},
		snapshotController(),
		csiProvisioner(),
		kubeRouter(),
	}
}

// patchGVisorShimOOM makes the runsc shim tolerate a host without
// CAP_SYS_RESOURCE. The shim lowers its own oom_score_adj and treats EPERM as
// fatal, so on such hosts every gVisor pod fails to start. Losing the OOM
// preference is harmless for a test node.
func patchGVisorShimOOM(dir string) error {
	file := filepath.Join(dir, "vendor", "gvisor.dev", "gvisor", "pkg", "shim", "v1", "manager.go")
	src, err := os.ReadFile(file)
	if err != nil {
		return fmt.Errorf("patch gVisor shim: %w", err)
	}
	const marker = "failed to set OOM Score on shim"
	i := bytes.Index(src, []byte(marker))
	if i < 0 {
		return fmt.Errorf("patch gVisor shim: %q not found in %s; the upstream code changed, update the patch", marker, file)
	}
	// The check guarding that error is the last "err != nil {" before it.
	j := bytes.LastIndex(src[:i], []byte("err != nil {"))
	if j < 0 {
		return fmt.Errorf("patch gVisor shim: no error check before %q in %s", marker, file)
	}
	patched := string(src[:j]) + "err != nil && !os.IsPermission(err) {" + string(src[j+len("err != nil {"):])
	if !strings.Contains(patched, `"os"`) {
		return fmt.Errorf("patch gVisor shim: %s does not import os", file)
	}
	return os.WriteFile(file, []byte(patched), 0o644)
}

// DefaultDir is where the cache lives unless AGENTBOX_TESTENV_DIR says otherwise.
func DefaultDir() (string, error) {
	if d := os.Getenv("AGENTBOX_TESTENV_DIR"); d != "" {
		return filepath.Abs(d)
	}
	c, err := os.UserCacheDir()
	if err != nil {
		return "", fmt.Errorf("no cache directory (set AGENTBOX_TESTENV_DIR): %w", err)
	}
	return filepath.Join(c, "agentbox", "testenv", Layout), nil
}

// BinDir is the folder holding the built binaries.
func BinDir(dir string) string { return filepath.Join(dir, "bin") }

// Builder builds the toolchain into Dir and reports progress to Out.
type Builder struct {
	Dir string
	Out io.Writer
	// SkipPackages leaves the Debian packages alone (for hosts managed otherwise).
	SkipPackages bool
	// ClusterOnly builds what a cluster runs and nothing that only tests
	// start (the S3 server, the snapshot and CSI sidecars, PostgreSQL): what
	// the quickstart needs. A later full build reuses all of it.
	ClusterOnly bool
	// Spikes also builds the components only research spikes use (the
	// restoring runsc shim).
	Spikes bool
}

// Build builds every missing or outdated component. A second run with
// nothing to do only checks stamps and finishes in well under a second.
//
// Components are resolved one ahead of the one being compiled: fetching
// modules waits on the network and compiling on the CPU, so the two
// overlap.
func (b *Builder) Build(ctx context.Context) error {
	start := time.Now()
	if err := os.MkdirAll(BinDir(b.Dir), 0o755); err != nil {
		return fmt.Errorf("create %s: %w", BinDir(b.Dir), err)
	}
	what := "the cluster and the tests"
	if b.ClusterOnly {
		what = "the cluster (the tests' own servers are built by `make testenv`)"
	}
	unlock, err := b.lockCache(ctx)
	if err != nil {
		return err
	}
	defer unlock()
	b.logf("testenv cache: %s; building what %s need", b.Dir, what)
	if !b.SkipPackages {
		if err := b.debianPackages(ctx); err != nil {
			return err
		}
	}
	var todo []component
	for _, c := range components() {
		if (!c.testOnly || !b.ClusterOnly) && (!c.spike || b.Spikes) {
			todo = append(todo, c)
		}
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	type resolved struct {
		c   component
		src string
		err error
	}
	next := make(chan resolved)
	go func() {
		defer close(next)
		for _, c := range todo {
			src, err := b.resolve(ctx, c)
			select {
			case next <- resolved{c, src, err}:
			case <-ctx.Done():
				return
			}
			if err != nil {
				return
			}
		}
	}()
	for r := range next {
		if r.err == nil && r.src != "" {
			r.err = b.compile(ctx, r.c, r.src)
		}
		if r.err != nil {
			return fmt.Errorf("component %s: %w", r.c.name, r.err)
		}
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	if err := b.buildOwnTools(ctx); err != nil {
		return err
	}
	if err := b.buildImages(ctx); err != nil {
		return fmt.Errorf("images: %w", err)
	}
	b.logf("testenv ready in %s", time.Since(start).Round(time.Millisecond))
	return nil
}

// lockCache takes the cache's build lock, and waits while another build
// (a second `make testenv`, one in another checkout) holds it: two builds
// writing one component's sources and binaries at once break each other.
// The lock goes with the process, so a killed build never leaves it held.
func (b *Builder) lockCache(ctx context.Context) (unlock func(), err error) {
	path := filepath.Join(b.Dir, "build.lock")
	f, err := os.OpenFile(path, os.O_CREATE|os.O_RDWR, 0o644)
	if err != nil {
		return nil, fmt.Errorf("open the build lock: %w", err)
	}
	told := false
	for {
		err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB)
		if err == nil {
			return func() { f.Close() }, nil
		}
		if !errors.Is(err, syscall.EWOULDBLOCK) {
			f.Close()
			return nil, fmt.Errorf("take the build lock %s: %w", path, err)
		}
		if !told {
			b.logf("another build of the test env is writing %s; waiting for it to finish", b.Dir)
			told = true
		}
		select {
		case <-ctx.Done():
			f.Close()
			return nil, ctx.Err()
		case <-time.After(500 * time.Millisecond):
		}
	}
}

func (b *Builder) logf(format string, args ...any) {
	fmt.Fprintf(b.Out, "==> "+format+"\n", args...)
}

// cmd runs commands for one component with progress reports.
func (b *Builder) cmd(label, dir string, env []string) progress.Cmd {
	return progress.Cmd{Dir: dir, Env: env, Logf: b.logf, Label: label}
}

func (b *Builder) debianPackages(ctx context.Context) error {
	want := ClusterPackages
	if !b.ClusterOnly {
		want = append(slices.Clone(ClusterPackages), TestPackages...)
	}
	var missing []string
	for _, p := range want {
		out, err := exec.CommandContext(ctx, "dpkg-query", "-W", "-f=${Status}", p).Output()
		if err != nil || !strings.Contains(string(out), "install ok installed") {
			missing = append(missing, p)
		}
	}
	if len(missing) == 0 {
		b.logf("debian packages: %s (installed)", strings.Join(want, " "))
		return nil
	}
	t := time.Now()
	b.logf("debian packages: installing %s", strings.Join(missing, " "))
	if os.Geteuid() != 0 {
		return fmt.Errorf("debian packages %s are missing and installing them needs root", strings.Join(missing, " "))
	}
	c := b.cmd("debian packages", "", append(os.Environ(), "DEBIAN_FRONTEND=noninteractive"))
	// apt prints a line per package it fetches, unpacks and sets up; the
	// last one says where it is.
	last := func(s *progress.Step, text string) {
		if text = strings.TrimSpace(text); text != "" {
			s.Set("%s", text)
		}
	}
	if err := c.Run(ctx, "apt-get update", last, "apt-get", "update", "-q"); err != nil {
		return fmt.Errorf("apt-get update: %w", err)
	}
	args := append([]string{"install", "-y", "-q", "--no-install-recommends"}, missing...)
	if err := c.Run(ctx, "apt-get install", last, "apt-get", args...); err != nil {
		return fmt.Errorf("apt-get install %s: %w", strings.Join(missing, " "), err)
	}
	b.logf("debian packages: done in %s", time.Since(t).Round(time.Second))
	return nil
}

// stamp identifies everything that goes into a component's binaries.
func (c component) stamp() (string, error) {
	gomod, err := wrappers.ReadFile("wrappers/" + c.name + "/go.mod.txt")
	if err != nil {
		return "", err
	}
	h := sha256.New()
	fmt.Fprintf(h, "%s\n%s\n%s\n%s\n%v\n", gomod, c.ldflags, c.tags, runtime.Version(), c.vendor)
	if gosum, err := wrappers.ReadFile("wrappers/" + c.name + "/go.sum.txt"); err == nil {
		fmt.Fprintf(h, "go.sum:%s\n", gosum)
	}
	for _, bin := range c.binary {
		fmt.Fprintf(h, "%s=%s\n", bin.out, bin.pkg)
	}
	srcs, err := wrapperSources(c.name)
	if err != nil {
		return "", err
	}
	for _, name := range slices.Sorted(maps.Keys(srcs)) {
		fmt.Fprintf(h, "src:%s:%x\n", name, sha256.Sum256(srcs[name]))
	}
	for _, f := range c.produces {
		fmt.Fprintf(h, "file:%s\n", f)
	}
	if c.patch != nil {
		// The patch is code; its identity is the function's name plus the
		// layout version, bumped by hand when the patch changes.
		fmt.Fprintf(h, "patch:%s:%s\n", c.name, Layout)
	}
	return hex.EncodeToString(h.Sum(nil))[:16], nil
}

func (c component) names() []string {
	names := make([]string, len(c.binary))
	for i, bin := range c.binary {
		names[i] = bin.out
	}
	return names
}

func (c component) env() []string {
	return append(os.Environ(), "CGO_ENABLED=0", "GOFLAGS=-buildvcs=false", "GOWORK=off")
}

func (b *Builder) stampFile(c component) string { return filepath.Join(b.Dir, "stamps", c.name) }

// resolve writes a component's wrapper module and resolves (and for a
// vendored build, vendors and patches) its dependencies. It returns "" when
// the cache already holds the component as its stamp describes.
func (b *Builder) resolve(ctx context.Context, c component) (string, error) {
	stamp, err := c.stamp()
	if err != nil {
		return "", err
	}
	if got, err := os.ReadFile(b.stampFile(c)); err == nil && string(got) == stamp && b.allPresent(c) {
		b.logf("%s: %s (cached)", c.name, strings.Join(c.names(), " "))
		return "", nil
	}
	t := time.Now()
	src := filepath.Join(b.Dir, "src", c.name)
	if err := os.RemoveAll(src); err != nil {
		return "", err
	}
	if err := os.MkdirAll(src, 0o755); err != nil {
		return "", err
	}
	gomod, _ := wrappers.ReadFile("wrappers/" + c.name + "/go.mod.txt")
	if err := os.WriteFile(filepath.Join(src, "go.mod"), gomod, 0o644); err != nil {
		return "", err
	}
	// A wrapper's go.sum.txt holds hashes of modules the checksum database
	// does not answer for, taken from a go.sum it did verify.
	if gosum, err := wrappers.ReadFile("wrappers/" + c.name + "/go.sum.txt"); err == nil {
		if err := os.WriteFile(filepath.Join(src, "go.sum"), gosum, 0o644); err != nil {
			return "", err
		}
	}
	srcs, err := wrapperSources(c.name)
	if err != nil {
		return "", err
	}
	for name, data := range srcs {
		if err := os.WriteFile(filepath.Join(src, name), data, 0o644); err != nil {
			return "", err
		}
	}
	cmd := b.cmd(c.name, src, c.env())
	if err := cmd.GoModules(ctx, "go", "mod", "tidy"); err != nil {
		return "", fmt.Errorf("go mod tidy: %w", err)
	}
	if c.vendor {
		if err := cmd.GoModules(ctx, "go", "mod", "vendor"); err != nil {
			return "", fmt.Errorf("go mod vendor: %w", err)
		}
	}
	if c.patch != nil {
		if err := c.patch(src); err != nil {
			return "", err
		}
	}
	b.logf("%s: modules resolved in %s", c.name, time.Since(t).Round(time.Second))
	return src, nil
}

// compile builds a resolved component's binaries in one go build, so that
// they share one package graph and link side by side.
func (b *Builder) compile(ctx context.Context, c component, src string) error {
	t := time.Now()
	b.logf("%s: building %s", c.name, strings.Join(c.names(), " "))
	out := filepath.Join(src, "bin")
	if err := os.MkdirAll(out, 0o755); err != nil {
		return err
	}
	flags := []string{"-trimpath", "-ldflags", c.ldflags}
	if c.tags != "" {
		flags = append(flags, "-tags", c.tags)
	}
	if c.vendor {
		flags = append(flags, "-mod=vendor")
	}
	pkgs := make([]string, len(c.binary))
	for i, bin := range c.binary {
		pkgs[i] = bin.pkg
	}
	if err := b.cmd(c.name, src, c.env()).GoBuild(ctx, progress.GoBuild{Flags: flags, Out: out + string(filepath.Separator), Packages: pkgs}); err != nil {
		return fmt.Errorf("go build: %w", err)
	}
	for _, bin := range c.binary {
		if err := os.Rename(filepath.Join(out, progress.DefaultBinaryName(bin.pkg)), filepath.Join(BinDir(b.Dir), bin.out)); err != nil {
			return fmt.Errorf("install %s: %w", bin.out, err)
		}
	}
	if c.files != nil {
		if err := c.files(ctx, b, src); err != nil {
			return err
		}
	}
	if err := os.MkdirAll(filepath.Dir(b.stampFile(c)), 0o755); err != nil {
		return err
	}
	stamp, err := c.stamp()
	if err != nil {
		return err
	}
	if err := os.WriteFile(b.stampFile(c), []byte(stamp), 0o644); err != nil {
		return err
	}
	b.logf("%s: built in %s", c.name, time.Since(t).Round(time.Second))
	return nil
}

func (b *Builder) allPresent(c component) bool {
	for _, bin := range c.binary {
		if fi, err := os.Stat(filepath.Join(BinDir(b.Dir), bin.out)); err != nil || fi.Size() == 0 {
			return false
		}
	}
	for _, f := range c.produces {
		if !fileExists(filepath.Join(b.Dir, f)) {
			return false
		}
	}
	return true
}

// Missing lists what a cluster needs that is not in dir, so that callers
// can say "run make testenv" instead of failing on a missing file. The
// tests' own servers are not listed: the tests that start them skip with
// their own message.
func Missing(dir string) []string {
	var missing []string
	for _, c := range components() {
		if c.testOnly {
			continue
		}
		for _, bin := range c.binary {
			if !fileExists(filepath.Join(BinDir(dir), bin.out)) {
				missing = append(missing, bin.out)
			}
		}
		for _, f := range c.produces {
			if !fileExists(filepath.Join(dir, f)) {
				missing = append(missing, f)
			}
		}
	}
	if !fileExists(filepath.Join(BinDir(dir), LocalPathProvisioner)) {
		missing = append(missing, LocalPathProvisioner)
	}
	for _, img := range []string{"pause.tar", "busybox.tar"} {
		if !fileExists(filepath.Join(ImageDir(dir), img)) {
			missing = append(missing, "images/"+img)
		}
	}
	return missing
}
