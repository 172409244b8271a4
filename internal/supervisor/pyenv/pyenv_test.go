package pyenv

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/pyenv/pyenvtest"
)

func TestParseRequirement(t *testing.T) {
	for in, want := range map[string]Requirement{
		"pandas":                               {"pandas", "pandas"},
		"Pandas >= 2.0":                        {"pandas", "pandas>=2.0"},
		"numpy==1.26.4":                        {"numpy", "numpy==1.26.4"},
		"Foo.Bar_baz[Socks, a ,security]~=1.2": {"foo-bar-baz", "foo-bar-baz[a,security,socks]~=1.2"},
		"x>=1,<2 ; python_version >= '3.8'":    {"x", "x>=1,<2; python_version >= '3.8'"},
		"a-b":                                  {"a-b", "a-b"},
		"zope.interface!=5.*":                  {"zope-interface", "zope-interface!=5.*"},
	} {
		got, err := ParseRequirement(in)
		if err != nil || got != want {
			t.Errorf("ParseRequirement(%q) = %+v, %v; want %+v", in, got, err, want)
		}
	}
	for _, in := range []string{
		"", " ", "-r requirements.txt", "--index-url=http://x", "-e .", "pkg @ https://example.invalid/pkg.whl",
		"./local/dir", "/abs/path.whl", "http://example.invalid/x.whl", "pkg>=1 --hash=sha256:00", "a b", "pkg; os.system('x')\n",
		"pkg==1\nother", "_leading", "trailing-", "pkg[", "pkg>=", "pkg\x00", strings.Repeat("a", MaxRequirementLength+1),
	} {
		if r, err := ParseRequirement(in); err == nil {
			t.Errorf("ParseRequirement(%q) = %+v, want an error", in, r)
		}
	}
	_, err := ParseRequirement("pkg @ https://example.invalid/pkg.whl")
	if err == nil || !strings.Contains(err.Error(), "not URLs or paths") {
		t.Errorf("direct reference: %v", err)
	}

	reqs, err := ParseRequirements([]string{"b", "A>=1", "b", "a >= 1"})
	if err != nil || len(reqs) != 2 || reqs[0].String != "a>=1" || reqs[1].String != "b" {
		t.Errorf("ParseRequirements = %+v, %v", reqs, err)
	}
	if _, err := ParseRequirements(make([]string, MaxRequirements+1)); err == nil {
		t.Error("too many requirements accepted")
	}
}

func TestValidName(t *testing.T) {
	for _, ok := range []string{"data-analysis", "a", "A.b_c-1", strings.Repeat("x", MaxNameLength)} {
		if err := ValidName(ok); err != nil {
			t.Errorf("ValidName(%q): %v", ok, err)
		}
	}
	for _, bad := range []string{"", ".installer", ".lock", "-x", "a/b", "..", "a b", "a\x00", strings.Repeat("x", MaxNameLength+1)} {
		if ValidName(bad) == nil {
			t.Errorf("ValidName(%q) accepted", bad)
		}
	}
}

// execRunner runs build steps as the supervisor does: own process group,
// killed whole when ctx ends.
func execRunner(ctx context.Context, argv, env []string, dir string, stdout, stderr io.Writer) (int, error) {
	cmd := exec.CommandContext(ctx, argv[0], argv[1:]...)
	cmd.Env, cmd.Dir, cmd.Stdout, cmd.Stderr = env, dir, stdout, stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	cmd.Cancel = func() error { return syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL) }
	cmd.WaitDelay = time.Second
	err := cmd.Run()
	var exitErr *exec.ExitError
	if errors.As(err, &exitErr) {
		return exitErr.ExitCode(), nil
	}
	if err != nil {
		return -1, err
	}
	return 0, nil
}

// hostPython is the system python3 with the venv module, or the test is
// skipped.
func hostPython(t *testing.T) string {
	t.Helper()
	for _, p := range []string{"/usr/bin/python3", "/usr/local/bin/python3"} {
		if exec.Command(p, "-c", "import venv, ensurepip").Run() == nil {
			return p
		}
	}
	t.Skip("no python3 with venv and ensurepip (on Debian: apt-get install python3-venv)")
	return ""
}

func newTestManager(t *testing.T, cfg Config) *Manager {
	t.Helper()
	if cfg.Dir == "" {
		cfg.Dir = t.TempDir()
	}
	if cfg.Python == "" {
		cfg.Python = hostPython(t)
	}
	cfg.Run = execRunner
	cfg.Env = append([]string{"PATH=/usr/bin:/bin", "HOME=" + t.TempDir(), "LANG=C.UTF-8"}, cfg.Env...)
	cfg.Logger = slog.New(slog.NewTextHandler(io.Discard, nil))
	m, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m.Close() })
	return m
}

var greet = pyenvtest.Package{Name: "agentbox-greet", Version: "1.0", Files: map[string][]byte{
	"agentbox_greet/__init__.py": []byte("def hello(who):\n    return 'hello ' + who\n"),
}}

// The manager alone, with a base interpreter that has no pip (a venv made
// --without-pip): it makes its installer environment once with ensurepip
// and builds with it; a second manager on the same directory is refused,
// and a new one after it finds the environment again.
func TestManagerInstallerEnvironmentAndReload(t *testing.T) {
	base := hostPython(t)
	nopip := filepath.Join(t.TempDir(), "nopip")
	if out, err := exec.Command(base, "-m", "venv", "--without-pip", nopip).CombinedOutput(); err != nil {
		t.Fatalf("venv: %v\n%s", err, out)
	}
	ix := pyenvtest.NewIndex(t, greet)
	dir := t.TempDir()
	m := newTestManager(t, Config{Dir: dir, Python: filepath.Join(nopip, "bin", "python"), IndexURL: ix.URL})

	start := time.Now()
	l, created, err := m.Ensure(context.Background(), Request{Name: "g", Requirements: []string{"agentbox-greet"}})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("first build, installer environment included: %s", time.Since(start))
	if !created || l.Name() != "g" {
		t.Fatalf("created %v, name %q", created, l.Name())
	}
	out, err := exec.Command(l.Python(), "-c", "import agentbox_greet, sys; print(agentbox_greet.hello('x')); print('pip' in sys.modules)").Output()
	if err != nil || string(out) != "hello x\nFalse\n" {
		t.Fatalf("import from the environment: %q, %v", out, err)
	}
	if _, err := exec.Command(l.Python(), "-c", "import pip").Output(); err == nil {
		t.Error("the environment has pip; it should hold only what was asked for")
	}
	if _, err := os.Stat(filepath.Join(dir, installerDir, "bin", "python")); err != nil {
		t.Errorf("no installer environment: %v", err)
	}
	info := l.Info()
	if info.InUse != 1 || len(info.Packages) != 1 || info.Packages[0] != "agentbox-greet==1.0" || info.SizeBytes <= 0 || info.PythonVersion == "" {
		t.Errorf("info %+v", info)
	}
	l.Release()
	l.Release() // idempotent

	if _, err := New(Config{Dir: dir, Run: execRunner}); err == nil || !strings.Contains(err.Error(), "in use by another process") {
		t.Fatalf("second manager on the same directory: %v", err)
	}
	// An unfinished build left by a crash is removed on start.
	if err := os.MkdirAll(filepath.Join(dir, "half.1234", "bin"), 0o700); err != nil {
		t.Fatal(err)
	}
	m.Close()
	m2 := newTestManager(t, Config{Dir: dir, Python: filepath.Join(nopip, "bin", "python"), IndexURL: ix.URL})
	if list := m2.List(); len(list) != 1 || list[0].Name != "g" || list[0].Packages[0] != "agentbox-greet==1.0" {
		t.Fatalf("reloaded list %+v", list)
	}
	if _, err := os.Stat(filepath.Join(dir, "half.1234")); !os.IsNotExist(err) {
		t.Errorf("unfinished build left in place: %v", err)
	}
	l, created, err = m2.Ensure(context.Background(), Request{Name: "g"})
	if err != nil || created {
		t.Fatalf("reloaded environment by name: created %v, %v", created, err)
	}
	l.Release()
	if _, _, err := m2.Ensure(context.Background(), Request{Name: "nope"}); KindOf(err) != KindNotFound {
		t.Errorf("unknown name without requirements: %v", err)
	}
	if downloads := ix.Downloads("agentbox-greet"); downloads != 1 {
		t.Errorf("%d downloads of the wheel, want 1", downloads)
	}
}

// Pins keep environments from eviction and deletion; the limits are
// enforced again when they are released.
func TestManagerPinsHoldOffEviction(t *testing.T) {
	ix := pyenvtest.NewIndex(t, greet)
	m := newTestManager(t, Config{IndexURL: ix.URL, MaxEnvs: 1})
	ctx := context.Background()
	a, _, err := m.Ensure(ctx, Request{Name: "a", CreateEmpty: true})
	if err != nil {
		t.Fatal(err)
	}
	b, _, err := m.Ensure(ctx, Request{Name: "b", CreateEmpty: true})
	if err != nil {
		t.Fatal(err)
	}
	// a is in use, so it stays although the limit is one.
	if n := len(m.List()); n != 2 {
		t.Fatalf("%d environments while both are held, want 2", n)
	}
	info, err := m.Delete("a")
	if err != nil || info.InUse != 1 {
		t.Fatalf("Delete in use: %+v, %v", info, err)
	}
	if _, err := os.Stat(a.Dir()); err != nil {
		t.Fatalf("a deleted while in use lost its directory: %v", err)
	}
	a.Release()
	if _, err := os.Stat(a.Dir()); !os.IsNotExist(err) {
		t.Fatalf("a's directory outlived its last user: %v", err)
	}
	b.Release()
	c, _, err := m.Ensure(ctx, Request{Name: "c", CreateEmpty: true})
	if err != nil {
		t.Fatal(err)
	}
	c.Release()
	if list := m.List(); len(list) != 1 || list[0].Name != "c" {
		t.Fatalf("after c: %+v, want only c", list)
	}
	if _, err := os.Stat(b.Dir()); !os.IsNotExist(err) {
		t.Fatalf("evicted b's directory remains: %v", err)
	}
}

// The uv path, where uv is installed (it is not a Debian package, so the
// project's machines usually lack it).
func TestManagerWithUV(t *testing.T) {
	uv, err := exec.LookPath("uv")
	if err != nil {
		t.Skip("uv is not installed; environments are built with venv and pip")
	}
	ix := pyenvtest.NewIndex(t, greet)
	m := newTestManager(t, Config{UV: uv, IndexURL: ix.URL})
	l, created, err := m.Ensure(context.Background(), Request{Requirements: []string{"agentbox-greet"}})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Release()
	out, err := exec.Command(l.Python(), "-c", "import agentbox_greet; print(agentbox_greet.hello('uv'))").Output()
	if !created || err != nil || string(out) != "hello uv\n" || m.Stats().Installer != "uv" {
		t.Fatalf("created %v, output %q, %v, stats %+v", created, out, err, m.Stats())
	}
}

// insecureIndex is the test index as a sandbox reaches an internal mirror:
// by a host name that is not loopback (pip and uv trust loopback over
// plain HTTP anyway), through an HTTP proxy (the egress proxy). The proxy
// is the loopback index itself, which serves the absolute-URI requests a
// proxy gets as it serves direct ones, so nothing leaves 127.0.0.1 and
// the name is never resolved.
func insecureIndex(t *testing.T) (ix *pyenvtest.Index, indexURL, host string, env []string) {
	ix = pyenvtest.NewIndex(t, greet)
	host = "mirror.agentbox.invalid:8080"
	env = []string{"http_proxy=" + strings.TrimSuffix(ix.URL, "/simple/"), "HTTP_PROXY=" + strings.TrimSuffix(ix.URL, "/simple/"), "no_proxy=", "NO_PROXY="}
	return ix, "http://" + host + "/simple/", host, env
}

// A plain-HTTP index is refused by the installer unless its host is
// trusted, and used when it is: trustedHosts reach pip as --trusted-host.
func TestManagerTrustedHostsPip(t *testing.T) {
	testTrustedHosts(t, "")
}

// The same with uv (--allow-insecure-host), where uv is installed.
func TestManagerTrustedHostsUV(t *testing.T) {
	uv, err := exec.LookPath("uv")
	if err != nil {
		t.Skip("uv is not installed; environments are built with venv and pip")
	}
	testTrustedHosts(t, uv)
}

func testTrustedHosts(t *testing.T, uv string) {
	ix, indexURL, host, env := insecureIndex(t)
	ctx := context.Background()

	plain := newTestManager(t, Config{UV: uv, IndexURL: indexURL, Env: env})
	_, _, err0 := plain.Ensure(ctx, Request{Name: "g", Requirements: []string{"agentbox-greet"}})
	if KindOf(err0) != KindBuildFailed {
		t.Fatalf("install from an untrusted plain-HTTP index: %v, want a failed build", err0)
	}
	// The installer ignored the index rather than failed to reach it.
	if n := ix.PageRequests("agentbox-greet"); n != 0 {
		t.Fatalf("%d page requests to the untrusted index, want 0", n)
	}

	trusted := newTestManager(t, Config{UV: uv, IndexURL: indexURL, TrustedHosts: []string{host}, Env: env})
	l, created, err := trusted.Ensure(ctx, Request{Name: "g", Requirements: []string{"agentbox-greet"}})
	if err != nil {
		t.Fatalf("install from a trusted plain-HTTP index: %v", err)
	}
	defer l.Release()
	out, err := exec.Command(l.Python(), "-c", "import agentbox_greet; print(agentbox_greet.hello('mirror'))").Output()
	if !created || err != nil || string(out) != "hello mirror\n" {
		t.Fatalf("created %v, output %q, %v", created, out, err)
	}
	if n := ix.Downloads("agentbox-greet"); n != 1 || ix.PageRequests("agentbox-greet") == 0 {
		t.Errorf("%d downloads through the proxy, want 1 (and the project page read)", n)
	}
}

// Trusted hosts are host or host:port, nothing an installer could read
// as an option.
func TestConfigRefusesBadTrustedHosts(t *testing.T) {
	for _, bad := range []string{"", "-x", "--index-url=http://x", "http://a.test", "a.test/simple", "a b", "a.test:", "a.test:123456"} {
		if _, err := New(Config{Dir: t.TempDir(), Run: execRunner, TrustedHosts: []string{bad}}); err == nil || !strings.Contains(err.Error(), "trusted host") {
			t.Errorf("trusted host %q: %v", bad, err)
		}
	}
	for _, ok := range []string{"mirror.internal", "10.0.0.5:8080", "pypi"} {
		m, err := New(Config{Dir: t.TempDir(), Run: execRunner, TrustedHosts: []string{ok}})
		if err != nil {
			t.Errorf("trusted host %q: %v", ok, err)
			continue
		}
		m.Close()
	}
}

// Requests are checked against the configuration before anything runs.
func TestManagerRefusesBeforeBuilding(t *testing.T) {
	m := newTestManager(t, Config{
		Python: "/nonexistent/python3", IndexURL: "http://127.0.0.1:9/simple/", ExtraIndexURLs: []string{"http://127.0.0.1:10/simple/"},
		AllowedPackages: []string{"Numpy", "pandas"},
	})
	ctx := context.Background()
	for name, tc := range map[string]struct {
		r    Request
		kind Kind
	}{
		"unlisted package":   {Request{Requirements: []string{"numpy", "requests"}}, KindNotAllowed},
		"normalised name ok": {Request{Name: "x"}, KindNotFound},
		"other index":        {Request{Requirements: []string{"numpy"}, IndexURL: "http://127.0.0.1:11/simple/"}, KindNotAllowed},
		"index not http":     {Request{Requirements: []string{"numpy"}, IndexURL: "file:///srv/wheels"}, KindInvalid},
		"nothing asked":      {Request{}, KindInvalid},
		"bad name":           {Request{Name: "a/b", Requirements: []string{"numpy"}}, KindInvalid},
		"bad requirement":    {Request{Requirements: []string{"numpy @ http://127.0.0.1:9/x.whl"}}, KindInvalid},
	} {
		if _, _, err := m.Ensure(ctx, tc.r); KindOf(err) != tc.kind {
			t.Errorf("%s: %v, want kind %d", name, err, tc.kind)
		}
	}
	// An allowed request with the extra index as its own gets as far as the
	// build, which fails for want of an interpreter, and leaves nothing.
	_, _, err := m.Ensure(ctx, Request{Requirements: []string{"NUMPY"}, IndexURL: "http://127.0.0.1:10/simple/"})
	if KindOf(err) != KindBuildFailed {
		t.Fatalf("build without an interpreter: %v", err)
	}
	if entries, _ := os.ReadDir(m.Dir()); len(entries) != 0 {
		t.Errorf("left in the directory: %v", entries)
	}
	if _, err := New(Config{Dir: t.TempDir(), Run: execRunner, IndexURL: "ftp://x"}); err == nil {
		t.Error("New accepted an index that is not http(s)")
	}
}

// Concurrent requests for one environment share one build, and a caller
// that stops waiting does not stop it.
func TestManagerConcurrentEnsure(t *testing.T) {
	ix := pyenvtest.NewIndex(t, greet)
	m := newTestManager(t, Config{IndexURL: ix.URL})
	req := Request{Requirements: []string{"agentbox-greet"}}
	impatient, cancel := context.WithCancel(context.Background())
	cancel()
	if _, _, err := m.Ensure(impatient, req); !errors.Is(err, context.Canceled) {
		t.Fatalf("cancelled caller: %v", err)
	}
	const n = 6
	errs := make(chan error, n)
	createdCount := make(chan bool, n)
	for range n {
		go func() {
			l, created, err := m.Ensure(context.Background(), req)
			if err == nil {
				l.Release()
			}
			errs <- err
			createdCount <- created
		}()
	}
	built := 0
	for range n {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
		if <-createdCount {
			built++
		}
	}
	// The cancelled caller started the build; the others all waited for it
	// or found it done.
	if built != 0 || ix.Downloads("agentbox-greet") != 1 || len(m.List()) != 1 {
		t.Fatalf("%d callers built, %d downloads, %d environments; want 0, 1, 1", built, ix.Downloads("agentbox-greet"), len(m.List()))
	}
}

// fakeClock is the manager's clock in tests of the time-to-live.
type fakeClock struct {
	mu  sync.Mutex
	now time.Time
}

func (c *fakeClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

func (c *fakeClock) Set(t time.Time) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.now = t
}

// The time-to-live removes idle environments unused for longer than it,
// never one in use; the last use is recorded in the environment's
// directory, so that it holds for a manager started on the same directory
// (a supervisor resumed from an idle stop), whose environments are checked
// against the interpreter before their first use.
func TestManagerTTLAndRestart(t *testing.T) {
	ix := pyenvtest.NewIndex(t, greet)
	dir := t.TempDir()
	const ttl = time.Hour
	m := newTestManager(t, Config{Dir: dir, IndexURL: ix.URL, TTL: ttl})
	t0 := time.Now()
	clock := &fakeClock{now: t0}
	m.now = clock.Now
	ctx := context.Background()
	ensure := func(m *Manager, r Request) (*Pin, bool) {
		t.Helper()
		p, created, err := m.Ensure(ctx, r)
		if err != nil {
			t.Fatal(err)
		}
		return p, created
	}
	a, _ := ensure(m, Request{Name: "a", CreateEmpty: true})
	a.Release()
	clock.Set(t0.Add(50 * time.Minute))
	b, _ := ensure(m, Request{Name: "b", Requirements: []string{"agentbox-greet"}})
	b.Release()

	clock.Set(t0.Add(70 * time.Minute))
	m.expire()
	if list := m.List(); len(list) != 1 || list[0].Name != "b" || list[0].State != StateReady {
		t.Fatalf("after a's time-to-live: %+v, want b alone, ready", list)
	}
	if _, err := os.Stat(a.Dir()); !os.IsNotExist(err) {
		t.Fatalf("expired a's directory remains: %v", err)
	}
	if st := m.Stats(); st.TTL != ttl {
		t.Errorf("stats %+v", st)
	}

	// In use past its time-to-live: kept, and its use starts a new one.
	b, _ = ensure(m, Request{Name: "b"})
	clock.Set(t0.Add(3 * time.Hour))
	m.expire()
	if len(m.List()) != 1 {
		t.Fatal("an environment in use was removed for its time-to-live")
	}
	b.Release()
	m.expire()
	if len(m.List()) != 1 {
		t.Fatal("an environment just released was removed for its time-to-live")
	}
	m.Close()

	// A new manager on the directory: b's last use is the one recorded.
	m2 := newTestManager(t, Config{Dir: dir, IndexURL: ix.URL, TTL: ttl})
	list := m2.List()
	if len(list) != 1 || list[0].State != StateUnverified || !list[0].LastUsedAt.Equal(t0.Add(3*time.Hour)) {
		t.Fatalf("reloaded: %+v, want b unverified, last used at %s", list, t0.Add(3*time.Hour))
	}
	b, created := ensure(m2, Request{Requirements: nil, Name: "b"})
	if created || b.Info().State != StateReady {
		t.Fatalf("reloaded b: created %v, %+v", created, b.Info())
	}
	out, err := exec.Command(b.Python(), "-c", "import agentbox_greet; print(agentbox_greet.hello('again'))").Output()
	if err != nil || string(out) != "hello again\n" {
		t.Fatalf("reloaded b: %q, %v", out, err)
	}
	b.Release()
	m2.Close()

	// Built for another Python (as after a sandbox image changed between
	// an idle stop and the resume): rebuilt from its requirements at its
	// first use, by name alone too, not served broken.
	metaPath := filepath.Join(b.Dir(), metaFile)
	data, err := os.ReadFile(metaPath)
	if err != nil {
		t.Fatal(err)
	}
	var md meta
	if err := json.Unmarshal(data, &md); err != nil {
		t.Fatal(err)
	}
	md.PythonVersion = "2.7.18"
	if data, err = json.Marshal(md); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(metaPath, data, 0o600); err != nil {
		t.Fatal(err)
	}
	m3 := newTestManager(t, Config{Dir: dir, IndexURL: ix.URL, TTL: ttl})
	b3, created := ensure(m3, Request{Name: "b"})
	defer b3.Release()
	info := b3.Info()
	if !created || b3.Dir() == b.Dir() || info.PythonVersion == "2.7.18" || len(info.Packages) != 1 || info.State != StateReady {
		t.Fatalf("environment of another Python: created %v, %+v", created, info)
	}
	if _, err := os.Stat(b.Dir()); !os.IsNotExist(err) {
		t.Fatalf("the stale environment's directory remains: %v", err)
	}
	if n := ix.Downloads("agentbox-greet"); n != 2 {
		t.Errorf("%d downloads, want 2 (the first build and the rebuild)", n)
	}
}

// Environments restored into the directory of a running manager (an idle
// stop's snapshot is extracted through the supervisor after it started on
// the empty workspace) are taken in when they are next listed or asked
// for, checked before their first use, and not rebuilt.
func TestManagerAdoptsRestoredEnvironments(t *testing.T) {
	ix := pyenvtest.NewIndex(t, greet)
	ctx := context.Background()
	built := newTestManager(t, Config{IndexURL: ix.URL})
	p, _, err := built.Ensure(ctx, Request{Requirements: []string{"agentbox-greet"}})
	if err != nil {
		t.Fatal(err)
	}
	p.Release()
	src := p.Dir()
	built.Close()

	dir := t.TempDir()
	m := newTestManager(t, Config{Dir: dir, IndexURL: ix.URL})
	if len(m.List()) != 0 {
		t.Fatal("a fresh manager lists environments")
	}
	// cp -a, as the restore does: links as links, modes kept.
	if out, err := exec.Command("cp", "-a", src, filepath.Join(dir, filepath.Base(src))).CombinedOutput(); err != nil {
		t.Fatalf("cp: %v: %s", err, out)
	}
	// An unfinished directory beside it is left alone: it may be a build.
	if err := os.MkdirAll(filepath.Join(dir, "half.5678"), 0o700); err != nil {
		t.Fatal(err)
	}
	list := m.List()
	if len(list) != 1 || list[0].State != StateUnverified || list[0].Packages[0] != "agentbox-greet==1.0" {
		t.Fatalf("after the restore: %+v", list)
	}
	if _, err := os.Stat(filepath.Join(dir, "half.5678")); err != nil {
		t.Errorf("an unknown directory was removed: %v", err)
	}
	p, created, err := m.Ensure(ctx, Request{Requirements: []string{"agentbox-greet"}})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Release()
	if created || p.Info().State != StateReady || ix.Downloads("agentbox-greet") != 1 {
		t.Fatalf("restored environment: created %v, %+v, %d downloads", created, p.Info(), ix.Downloads("agentbox-greet"))
	}
	out, err := exec.Command(p.Python(), "-c", "import agentbox_greet; print(agentbox_greet.hello('restored'))").Output()
	if err != nil || string(out) != "hello restored\n" {
		t.Fatalf("restored environment: %q, %v", out, err)
	}
}

// The manager leaves the directory to its first build: it lives on the
// workspace volume, which an agent that builds nothing must find empty.
func TestDirectoryMadeByTheFirstBuild(t *testing.T) {
	parent := t.TempDir()
	dir := filepath.Join(parent, ".agentbox", "envs")
	m, err := New(Config{Dir: dir, Run: execRunner, Python: "/nonexistent/python3"})
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	if entries, _ := os.ReadDir(parent); len(entries) != 0 {
		t.Fatalf("New made %v", entries)
	}
	if got := m.List(); len(got) != 0 {
		t.Fatalf("List on no directory: %v", got)
	}
	if _, _, err := m.Ensure(context.Background(), Request{Requirements: []string{"numpy"}}); KindOf(err) != KindBuildFailed {
		t.Fatalf("build without an interpreter: %v", err)
	}
	if st, err := os.Stat(dir); err != nil || !st.IsDir() || st.Mode().Perm() != 0o700 {
		t.Fatalf("the build did not make the private directory: %v, %v", st, err)
	}
	if _, err := New(Config{Dir: dir, Run: execRunner}); err == nil || !strings.Contains(err.Error(), "in use by another process") {
		t.Errorf("a second manager on the directory: %v", err)
	}
}
