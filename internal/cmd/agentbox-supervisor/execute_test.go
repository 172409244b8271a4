package main

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/agentbox/terraform-provider-agentbox/internal/pki"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/pyenv/pyenvtest"
	api "github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"
)

func TestParseEnvOptions(t *testing.T) {
	getenv := func(string) string { return "" }
	o, err := parseOptions(nil, getenv, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	c := executeConfig(o)
	if c.Envs == nil || c.Envs.Dir != filepath.Join(os.TempDir(), "agentbox-envs") || c.Envs.MaxEnvs != 8 || c.Envs.MaxBytes != 2<<30 ||
		c.Envs.CreateTimeout != 5*time.Minute || c.Envs.IndexURL != "" || c.UV != "uv" {
		t.Errorf("defaults: %+v %+v", c, c.Envs)
	}
	o, err = parseOptions([]string{"-env-dir", "/x", "-env-max-count", "2", "-env-max-size", "500MiB", "-env-create-timeout", "1m",
		"-python-index", "http://127.0.0.1:1/simple/", "-python-extra-indexes", "http://127.0.0.1:2/simple/, http://127.0.0.1:3/simple/",
		"-python-allowed-packages", "numpy, pandas", "-python-trusted-hosts", "mirror.internal, 10.0.0.5:8080", "-uv", ""}, getenv, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	c = executeConfig(o)
	if c.Envs.Dir != "/x" || c.Envs.MaxEnvs != 2 || c.Envs.MaxBytes != 500<<20 || c.Envs.CreateTimeout != time.Minute || c.UV != "" ||
		len(c.Envs.ExtraIndexURLs) != 2 || c.Envs.ExtraIndexURLs[1] != "http://127.0.0.1:3/simple/" || !slices.Equal(c.Envs.AllowedPackages, []string{"numpy", "pandas"}) ||
		!slices.Equal(c.Envs.TrustedHosts, []string{"mirror.internal", "10.0.0.5:8080"}) {
		t.Errorf("explicit: %+v %+v", c, c.Envs)
	}
	env := map[string]string{"AGENTBOX_ENV_DIR": "/from/env", "AGENTBOX_PYTHON_ALLOWED_PACKAGES": "a,b"}
	o, err = parseOptions(nil, func(k string) string { return env[k] }, io.Discard)
	if err != nil || executeConfig(o).Envs.Dir != "/from/env" || len(executeConfig(o).Envs.AllowedPackages) != 2 {
		t.Errorf("from the environment: %+v, %v", o, err)
	}
	if o, err := parseOptions([]string{"-env-dir", ""}, getenv, io.Discard); err != nil || executeConfig(o).Envs != nil {
		t.Errorf("-env-dir empty turns the cache off: %+v, %v", o, err)
	}
	for _, bad := range [][]string{{"-env-max-size", "0"}, {"-env-max-count", "0"}, {"-env-create-timeout", "0s"}} {
		if _, err := parseOptions(bad, getenv, io.Discard); err == nil {
			t.Errorf("%v accepted", bad)
		}
	}
}

// supervisorPython skips the test unless the python3 that the supervisor's
// commands find can make virtual environments, as the sandbox image's can.
func supervisorPython(t *testing.T) string {
	t.Helper()
	for _, dir := range filepath.SplitList(supervisor.DefaultPath) {
		p := filepath.Join(dir, "python3")
		if _, err := os.Stat(p); err != nil {
			continue
		}
		if out, err := exec.Command(p, "-c", "import venv, ensurepip").CombinedOutput(); err != nil {
			t.Skipf("%s cannot make virtual environments (on Debian: apt-get install python3-venv): %v %s", p, err, out)
		}
		return p
	}
	t.Skipf("no python3 in %s", supervisor.DefaultPath)
	return ""
}

func module(src string) map[string][]byte {
	name := strings.SplitN(src, "\n", 2)[0]
	return map[string][]byte{strings.TrimPrefix(name, "# ") + ".py": []byte(src)}
}

func randomBytes(t *testing.T, n int) []byte {
	t.Helper()
	b := make([]byte, n)
	if _, err := rand.Read(b); err != nil {
		t.Fatal(err)
	}
	return b
}

// envDirs lists the environment directories on disk, the manager's own
// files (.lock, .installer) left out.
func envDirs(t *testing.T, dir string) []string {
	t.Helper()
	entries, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, e := range entries {
		if !strings.HasPrefix(e.Name(), ".") {
			out = append(out, e.Name())
		}
	}
	return out
}

func envNames(list []api.EnvInfo) []string {
	var out []string
	for _, e := range list {
		out = append(out, e.Name)
	}
	return out
}

// processesMentioning lists the PIDs whose command line contains s.
func processesMentioning(s string) []int {
	var out []int
	entries, _ := os.ReadDir("/proc")
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil || gone(pid) {
			continue
		}
		cmdline, _ := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
		if bytes.Contains(cmdline, []byte(s)) {
			out = append(out, pid)
		}
	}
	return out
}

// TestSupervisorProcessExecute is /v1/execute and /v1/envs through
// the real binary over mTLS, installing real wheels with the real pip
// from a package index the test serves on loopback.
func TestSupervisorProcessExecute(t *testing.T) {
	supervisorPython(t)
	bin := buildSupervisor(t)
	ix := pyenvtest.NewIndex(t,
		pyenvtest.Package{Name: "agentbox-greet", Version: "1.0", Files: module("# agentbox_greet\ndef hello(who):\n    return 'hello ' + who\n")},
		pyenvtest.Package{Name: "agentbox-other", Version: "2.5", Files: module("# agentbox_other\nVALUE = 42\n")},
		pyenvtest.Package{Name: "agentbox-needy", Version: "1.0", Files: module("# agentbox_needy\n"), Requires: []string{"agentbox-forbidden-dep"}},
		pyenvtest.Package{Name: "agentbox-forbidden-dep", Version: "1.0", Files: module("# agentbox_forbidden_dep\n")},
		pyenvtest.Package{Name: "agentbox-forbidden", Version: "1.0", Files: module("# agentbox_forbidden\n")},
	)

	ca, err := pki.NewCA("agentbox-test-ca")
	if err != nil {
		t.Fatal(err)
	}
	sandboxID := pki.SandboxID("", "agents", "sb-1").String()
	tlsDir := writeTLSDir(t, ca, issue(t, ca, sandboxID, pki.UsageServer))
	controlPlane := issue(t, ca, pki.ControlPlaneID("", "platform").String(), pki.UsageClient)
	workdir, envDir, runDir := t.TempDir(), t.TempDir(), t.TempDir()
	p := startSupervisor(t, bin, []string{
		// -reap-orphans: builds and runs must keep their exit statuses from
		// the reaper, as they do when the supervisor is PID 1.
		"-listen", "127.0.0.1:0", "-tls-dir", tlsDir, "-workdir", workdir, "-max-concurrent", "6", "-reap-orphans",
		"-env-dir", envDir, "-env-max-count", "3", "-python-index", ix.URL,
		"-python-allowed-packages", "agentbox-greet, Agentbox_Other,agentbox-needy,agentbox-missing",
	}, []string{"AGENTBOX_NAMESPACE=platform", "PATH=" + os.Getenv("PATH"), "TMPDIR=" + runDir})
	client := clientFor(t, p.addr, controlPlane, ca, sandboxID)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()

	// First run: the environment is built, the code imports the package
	// and turns inline files into produced ones.
	data := randomBytes(t, 64<<10)
	req := api.ExecuteRequest{
		ToolName:     api.ToolPythonExecute,
		Requirements: []string{"agentbox-greet==1.0"},
		EnvName:      "greet",
		Code: `import agentbox_greet, hashlib, os, sys
data = open('data.bin', 'rb').read()
open('result/digest.bin', 'wb').write(hashlib.sha256(data).digest()) if os.path.isdir('result') else None
os.makedirs('result', exist_ok=True)
open('result/reversed.bin', 'wb').write(data[::-1])
open('notes.txt', 'a').write('+run')
print(agentbox_greet.hello('sandbox'), sys.prefix == os.environ['VIRTUAL_ENV'])`,
		Files: map[string][]byte{"data.bin": data, "notes.txt": []byte("start"), "keep.txt": []byte("untouched")},
	}
	start := time.Now()
	first, err := client.Execute(ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	firstWall := time.Since(start)
	if first.Status != api.ExecuteSuccess || first.Output != "hello sandbox True\n" || first.Env == nil || !first.Env.Created || first.Env.Name != "greet" {
		t.Fatalf("first run: %+v (stderr %q)", first, first.Stderr)
	}
	if !slices.Equal(first.Env.Packages, []string{"agentbox-greet==1.0"}) || !strings.HasPrefix(first.Env.PythonVersion, "3.") {
		t.Errorf("environment %+v", first.Env)
	}
	if len(first.FilesProduced) != 2 || !bytes.Equal(first.FilesProduced["result/reversed.bin"], reverse(data)) ||
		string(first.FilesProduced["notes.txt"]) != "start+run" {
		t.Errorf("files produced: %d files, reversed ok %v, notes %q", len(first.FilesProduced),
			bytes.Equal(first.FilesProduced["result/reversed.bin"], reverse(data)), first.FilesProduced["notes.txt"])
	}

	// Second run: the same environment, cached.
	start = time.Now()
	second, err := client.Execute(ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	secondWall := time.Since(start)
	if second.Status != api.ExecuteSuccess || second.Env == nil || second.Env.Created {
		t.Fatalf("second run: %+v", second)
	}
	if n := ix.Downloads("agentbox-greet"); n != 1 {
		t.Errorf("the wheel was downloaded %d times, want once", n)
	}
	t.Logf("first call %s (env setup %d ms, run %d ms); second call %s (env setup %d ms, run %d ms)",
		firstWall.Round(time.Millisecond), first.EnvSetupMS, first.ExecutionTimeMS,
		secondWall.Round(time.Millisecond), second.EnvSetupMS, second.ExecutionTimeMS)
	if left, _ := os.ReadDir(filepath.Join(runDir, "agentbox-runs")); len(left) != 0 {
		t.Errorf("run directories left: %v", left)
	}

	list, err := client.ListEnvs(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(list.Environments) != 1 || list.Count != 1 || list.MaxCount != 3 || list.Installer != "pip" {
		t.Fatalf("ListEnvs = %+v", list)
	}
	g := list.Environments[0]
	if g.Name != "greet" || !slices.Equal(g.Requirements, []string{"agentbox-greet==1.0"}) || g.SizeBytes <= 0 || g.InUse != 0 ||
		g.CreatedAt.IsZero() || g.LastUsedAt.Before(g.CreatedAt) || list.TotalBytes != g.SizeBytes {
		t.Errorf("environment %+v", g)
	}
	t.Logf("environment greet: %d bytes on disk, python %s", g.SizeBytes, g.PythonVersion)

	// Health, under both names, with the routing fields beside the old ones.
	h, err := client.Health(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if h.Status != "ok" || h.Version != "test-build" || h.State != api.StateIdle || h.Capacity != 6 || h.CurrentLoad != 0 ||
		len(h.Environments) != 1 || h.Environments[0].Name != "greet" || h.EnvCache == nil || h.EnvCache.Count != 1 {
		t.Errorf("Health = %+v", h)
	}
	resp, err := client.HTTPClient.Get("https://" + p.addr + api.PathHealthShort)
	if err != nil {
		t.Fatal(err)
	}
	var seedHealth map[string]any
	err = json.NewDecoder(resp.Body).Decode(&seedHealth)
	resp.Body.Close()
	if err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("GET /health: %d, %v", resp.StatusCode, err)
	}
	for _, k := range []string{"status", "state", "environments", "capacity", "current_load", "uptime_seconds"} {
		if _, ok := seedHealth[k]; !ok {
			t.Errorf("GET /health has no %q: %v", k, seedHealth)
		}
	}

	// The allowlist: a name not on it is refused before anything is
	// fetched; a dependency not on it is found after the install, and the
	// environment is removed.
	_, err = client.Execute(ctx, api.ExecuteRequest{Code: "pass", Requirements: []string{"agentbox-greet", "Agentbox.Forbidden>=1"}})
	if api.CodeOf(err) != api.CodePermissionDenied || !strings.Contains(err.Error(), `"agentbox-forbidden" is not on this sandbox's allowlist`) {
		t.Fatalf("forbidden requirement: %v", err)
	}
	if n := ix.PageRequests("agentbox-forbidden"); n != 0 {
		t.Errorf("the index was asked for the forbidden package %d times", n)
	}
	_, err = client.EnsureEnv(ctx, api.EnvRequest{Name: "needy", Requirements: []string{"agentbox-needy"}})
	if api.CodeOf(err) != api.CodePermissionDenied || !strings.Contains(err.Error(), "agentbox-forbidden-dep") {
		t.Fatalf("forbidden dependency: %v", err)
	}
	t.Logf("forbidden dependency: %v", err)

	// A requirement no index satisfies: pip's own error, and nothing left.
	_, err = client.Execute(ctx, api.ExecuteRequest{Code: "pass", EnvName: "broken", Requirements: []string{"agentbox-missing==1.0"}})
	if api.CodeOf(err) != api.CodeEnvBuildFailed || !strings.Contains(err.Error(), "agentbox-missing") {
		t.Fatalf("missing requirement: %v", err)
	}
	t.Logf("missing requirement: %v", err)
	if dirs := envDirs(t, envDir); len(dirs) != 1 || !strings.HasPrefix(dirs[0], "greet.") {
		t.Errorf("environment directories after the failures: %v, want greet's only", dirs)
	}
	if _, err := client.Execute(ctx, api.ExecuteRequest{Code: "pass", EnvName: "broken"}); api.CodeOf(err) != api.CodeNotFound {
		t.Errorf("a failed environment by name: %v, want not_found", err)
	}

	// A timeout kills the run's whole process group; a run that exits
	// leaves no background process either.
	res, err := client.Execute(ctx, api.ExecuteRequest{EnvName: "greet", TimeoutSeconds: 1, Code: `import subprocess, time
child = subprocess.Popen(['sleep', '300'])
print(child.pid, flush=True)
time.sleep(300)`})
	if err != nil {
		t.Fatal(err)
	}
	if res.Status != api.ExecuteTimeout || !res.TimedOut || res.Signal != "SIGKILL" {
		t.Fatalf("timed-out run: %+v", res)
	}
	checkGone(t, res.Output)
	res, err = client.Execute(ctx, api.ExecuteRequest{Code: `import subprocess
print(subprocess.Popen(['sleep', '300']).pid)`})
	if err != nil || res.Status != api.ExecuteSuccess {
		t.Fatalf("run leaving a background process: %+v, %v", res, err)
	}
	checkGone(t, res.Output)

	// Concurrent runs asking for one requirement set share one build.
	const concurrent = 4
	var wg sync.WaitGroup
	results := make([]*api.ExecuteResult, concurrent)
	errs := make([]error, concurrent)
	for i := range concurrent {
		wg.Add(1)
		go func() {
			defer wg.Done()
			results[i], errs[i] = client.Execute(ctx, api.ExecuteRequest{Code: "import agentbox_other; print(agentbox_other.VALUE)", Requirements: []string{"agentbox_other"}})
		}()
	}
	wg.Wait()
	created, sharedName := 0, ""
	for i := range concurrent {
		if errs[i] != nil {
			t.Fatalf("concurrent run %d: %v", i, errs[i])
		}
		if results[i].Output != "42\n" || results[i].Env == nil {
			t.Fatalf("concurrent run %d: %+v", i, results[i])
		}
		if results[i].Env.Created {
			created++
		}
		if sharedName == "" {
			sharedName = results[i].Env.Name
		} else if results[i].Env.Name != sharedName {
			t.Errorf("concurrent runs used %q and %q", sharedName, results[i].Env.Name)
		}
	}
	if created != 1 || ix.Downloads("agentbox-other") != 1 {
		t.Errorf("%d concurrent runs: %d reported building, %d downloads; want 1 and 1", concurrent, created, ix.Downloads("agentbox-other"))
	}
	t.Logf("%d concurrent runs shared environment %s", concurrent, sharedName)

	// LRU by count (the limit is 3): greet is used again, so creating a
	// fourth environment evicts the shared one, used least recently.
	if _, err := client.Execute(ctx, api.ExecuteRequest{EnvName: "greet", Code: "pass"}); err != nil {
		t.Fatal(err)
	}
	if r, err := client.EnsureEnv(ctx, api.EnvRequest{Name: "e1"}); err != nil || !r.Created || r.Name != "e1" {
		t.Fatalf("EnsureEnv e1: %+v, %v", r, err)
	}
	if r, err := client.EnsureEnv(ctx, api.EnvRequest{Name: "e1"}); err != nil || r.Created {
		t.Fatalf("EnsureEnv e1 again: %+v, %v", r, err)
	}
	if _, err := client.EnsureEnv(ctx, api.EnvRequest{Name: "e2"}); err != nil {
		t.Fatal(err)
	}
	list, err = client.ListEnvs(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if names := envNames(list.Environments); !slices.Equal(names, []string{"e1", "e2", "greet"}) {
		t.Fatalf("after a fourth environment: %v, want [e1 e2 greet] (%s evicted)", names, sharedName)
	}
	if dirs := envDirs(t, envDir); len(dirs) != 3 || slices.ContainsFunc(dirs, func(d string) bool { return strings.HasPrefix(d, sharedName) }) {
		t.Errorf("directories after eviction: %v", dirs)
	}

	// DELETE.
	deleted, err := client.DeleteEnv(ctx, "greet")
	if err != nil || deleted.Name != "greet" {
		t.Fatalf("DeleteEnv: %+v, %v", deleted, err)
	}
	if _, err := client.DeleteEnv(ctx, "greet"); api.CodeOf(err) != api.CodeNotFound {
		t.Errorf("second delete: %v, want not_found", err)
	}
	if _, err := client.Execute(ctx, api.ExecuteRequest{EnvName: "greet", Code: "pass"}); api.CodeOf(err) != api.CodeNotFound {
		t.Errorf("run in a deleted environment: %v, want not_found", err)
	}
	if dirs := envDirs(t, envDir); slices.ContainsFunc(dirs, func(d string) bool { return strings.HasPrefix(d, "greet.") }) {
		t.Errorf("greet's directory remains: %v", dirs)
	}
}

func reverse(b []byte) []byte {
	out := make([]byte, len(b))
	for i, c := range b {
		out[len(b)-1-i] = c
	}
	return out
}

// checkGone waits for the process whose PID a run printed to be gone.
func checkGone(t *testing.T, output string) {
	t.Helper()
	pid, err := strconv.Atoi(strings.TrimSpace(output))
	if err != nil {
		t.Fatalf("run printed %q, not a PID", output)
	}
	waitFor(t, fmt.Sprintf("process %d of the run to be gone", pid), 5*time.Second, func() bool { return gone(pid) })
}

// Eviction by total size on disk, an environment larger than the whole
// cache, and a build that runs out of time, through the real binary.
func TestSupervisorProcessEnvLimits(t *testing.T) {
	supervisorPython(t)
	bin := buildSupervisor(t)
	const mib = 1 << 20
	ix := pyenvtest.NewIndex(t,
		pyenvtest.Package{Name: "agentbox-big", Version: "1.0", Files: map[string][]byte{"agentbox_big/blob.bin": randomBytes(t, 3*mib)}},
		pyenvtest.Package{Name: "agentbox-huge", Version: "1.0", Files: map[string][]byte{"agentbox_huge/blob.bin": randomBytes(t, 8*mib)}},
		pyenvtest.Package{Name: "agentbox-slow", Version: "1.0", Files: module("# agentbox_slow\n"), Stall: time.Minute},
	)
	envDir := t.TempDir()
	p := startSupervisor(t, bin, []string{"-insecure-listen", "127.0.0.1:0", "-workdir", t.TempDir(),
		"-env-dir", envDir, "-env-max-size", "7MiB", "-python-index", ix.URL},
		[]string{"PATH=" + os.Getenv("PATH"), "TMPDIR=" + t.TempDir()})
	client := api.NewClient("http://"+p.addr, nil)
	ctx := context.Background()

	for _, name := range []string{"big1", "big2"} {
		r, err := client.EnsureEnv(ctx, api.EnvRequest{Name: name, Requirements: []string{"agentbox-big"}})
		if err != nil {
			t.Fatal(err)
		}
		t.Logf("%s: %d bytes on disk, built in %d ms", name, r.SizeBytes, r.DurationMS)
	}
	if _, err := client.Execute(ctx, api.ExecuteRequest{EnvName: "big1", Code: "import agentbox_big"}); err != nil {
		t.Fatal(err)
	}
	// big2 is now the least recently used; a third pushes the total past
	// 7 MiB.
	if _, err := client.EnsureEnv(ctx, api.EnvRequest{Name: "big3", Requirements: []string{"agentbox-big"}}); err != nil {
		t.Fatal(err)
	}
	list, err := client.ListEnvs(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if names := envNames(list.Environments); !slices.Equal(names, []string{"big1", "big3"}) || list.TotalBytes > 7*mib {
		t.Fatalf("after the third: %v, %d bytes; want [big1 big3] within 7 MiB", names, list.TotalBytes)
	}
	if dirs := envDirs(t, envDir); len(dirs) != 2 {
		t.Errorf("directories: %v", dirs)
	}

	// Larger than the cache on its own: refused, removed, and nothing else
	// evicted for it.
	_, err = client.EnsureEnv(ctx, api.EnvRequest{Name: "huge", Requirements: []string{"agentbox-huge"}})
	if api.CodeOf(err) != api.CodeResourceExhausted || !strings.Contains(err.Error(), "more than the cache's") {
		t.Fatalf("huge environment: %v", err)
	}
	if list, _ := client.ListEnvs(ctx); !slices.Equal(envNames(list.Environments), []string{"big1", "big3"}) {
		t.Errorf("after the huge one: %v", envNames(list.Environments))
	}

	resp, err := http.Get("http://" + p.addr + api.PathEnvs + "/big1")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK || !strings.Contains(string(body), `"name":"big1"`) {
		t.Errorf("GET /v1/envs/big1: %d %s", resp.StatusCode, body)
	}

	// A build that outlasts -env-create-timeout (another supervisor, with
	// a short one): its installer's process group is killed and its
	// directory removed.
	envDir = t.TempDir()
	p = startSupervisor(t, bin, []string{"-insecure-listen", "127.0.0.1:0", "-workdir", t.TempDir(),
		"-env-dir", envDir, "-env-create-timeout", "15s", "-python-index", ix.URL},
		[]string{"PATH=" + os.Getenv("PATH"), "TMPDIR=" + t.TempDir()})
	client = api.NewClient("http://"+p.addr, nil)
	start := time.Now()
	_, err = client.Execute(ctx, api.ExecuteRequest{Code: "pass", Requirements: []string{"agentbox-slow"}})
	if api.CodeOf(err) != api.CodeTimeout {
		t.Fatalf("slow build: %v, want timeout", err)
	}
	t.Logf("slow build refused after %s: %v", time.Since(start).Round(time.Millisecond), err)
	if dirs := envDirs(t, envDir); len(dirs) != 0 {
		t.Errorf("directories after the timeout: %v", dirs)
	}
	// 15 s is ample for pip to get to the download, where the index holds
	// it until it is killed.
	if n := ix.Downloads("agentbox-slow"); n != 1 {
		t.Errorf("the slow wheel was asked for %d times before the timeout, want once", n)
	}
	// The supervisor's own command line names the directory too.
	if pids := slices.DeleteFunc(processesMentioning(envDir), func(pid int) bool { return pid == p.cmd.Process.Pid }); len(pids) != 0 {
		t.Errorf("processes of the timed-out build still running: %v", pids)
	}
	h, err := client.Health(ctx)
	if err != nil || h.EnvCache == nil || h.EnvCache.Building != 0 || h.EnvCache.Count != 0 || h.State != api.StateIdle {
		t.Errorf("health after the timeout: %+v, %v", h, err)
	}
}
