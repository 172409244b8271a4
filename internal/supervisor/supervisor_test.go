package supervisor

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
	"unicode/utf8"

	api "github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"
)

func newServer(t testing.TB, cfg Config) *Server {
	t.Helper()
	if cfg.DefaultCwd == "" {
		cfg.DefaultCwd = t.TempDir()
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.NewTextHandler(io.Discard, nil))
	}
	s, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// post sends body (a value to encode, or a string sent as is) to
// /v1/commands and decodes the answer.
func post(t testing.TB, h http.Handler, body any) (int, *api.CommandResult, *api.Error) {
	t.Helper()
	var raw []byte
	switch b := body.(type) {
	case string:
		raw = []byte(b)
	default:
		var err error
		if raw, err = json.Marshal(b); err != nil {
			t.Fatal(err)
		}
	}
	req := httptest.NewRequest(http.MethodPost, api.PathCommands, bytes.NewReader(raw))
	req.Header.Set("Content-Type", "application/json")
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, req)
	return decode(t, rec.Code, rec.Body.Bytes())
}

func decode(t testing.TB, status int, data []byte) (int, *api.CommandResult, *api.Error) {
	t.Helper()
	if status != http.StatusOK {
		var eb api.ErrorBody
		if err := json.Unmarshal(data, &eb); err != nil || eb.Error == nil {
			t.Fatalf("status %d with a body that is not an error: %q", status, data)
		}
		eb.Error.Status = status
		return status, nil, eb.Error
	}
	var res api.CommandResult
	if err := json.Unmarshal(data, &res); err != nil {
		t.Fatalf("decode result: %v (%q)", err, data)
	}
	return status, &res, nil
}

func mustRun(t testing.TB, h http.Handler, req api.CommandRequest) *api.CommandResult {
	t.Helper()
	_, res, e := post(t, h, req)
	if e != nil {
		t.Fatalf("%v: %v", req.Command, e)
	}
	return res
}

func TestEchoAndHealth(t *testing.T) {
	s := newServer(t, Config{Version: "v-test"})
	res := mustRun(t, s, api.CommandRequest{Command: []string{"echo", "hello", "world"}})
	if res.Stdout != "hello world\n" || res.Stderr != "" || res.ExitCode != 0 || res.Signal != "" || res.TimedOut || res.Truncated {
		t.Fatalf("unexpected result %+v", res)
	}

	rec := httptest.NewRecorder()
	s.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, api.PathHealth, nil))
	var h api.Health
	if err := json.Unmarshal(rec.Body.Bytes(), &h); err != nil || rec.Code != 200 || h.Status != "ok" || h.Version != "v-test" {
		t.Fatalf("healthz: %d %q", rec.Code, rec.Body.String())
	}
}

func TestExitCodeAndStreams(t *testing.T) {
	s := newServer(t, Config{})
	res := mustRun(t, s, api.CommandRequest{Command: []string{"sh", "-c", "echo out; echo err >&2; exit 3"}})
	if res.ExitCode != 3 || res.Stdout != "out\n" || res.Stderr != "err\n" || res.Signal != "" {
		t.Fatalf("unexpected result %+v", res)
	}
}

func TestSignal(t *testing.T) {
	s := newServer(t, Config{})
	res := mustRun(t, s, api.CommandRequest{Command: []string{"sh", "-c", "echo before; kill -TERM $$; echo after"}})
	if res.ExitCode != -1 || res.Signal != "SIGTERM" || res.TimedOut || res.Stdout != "before\n" {
		t.Fatalf("unexpected result %+v", res)
	}
	res = mustRun(t, s, api.CommandRequest{Command: []string{"sh", "-c", "kill -SEGV $$"}})
	if res.Signal != "SIGSEGV" {
		t.Fatalf("signal = %q, want SIGSEGV", res.Signal)
	}
}

func TestStdin(t *testing.T) {
	s := newServer(t, Config{})
	res := mustRun(t, s, api.CommandRequest{Command: []string{"cat"}, Stdin: "line 1\nline 2\n"})
	if res.Stdout != "line 1\nline 2\n" {
		t.Fatalf("stdout = %q", res.Stdout)
	}
	// A command that ignores a large stdin must not hang or fail.
	big := strings.Repeat("x", 4<<20)
	res = mustRun(t, s, api.CommandRequest{Command: []string{"true"}, Stdin: big})
	if res.ExitCode != 0 {
		t.Fatalf("true with unread stdin: %+v", res)
	}
	res = mustRun(t, s, api.CommandRequest{Command: []string{"wc", "-c"}, Stdin: big})
	if strings.TrimSpace(res.Stdout) != strconv.Itoa(len(big)) {
		t.Fatalf("wc -c = %q, want %d", res.Stdout, len(big))
	}
	// No stdin means /dev/null, so a reader sees EOF at once.
	res = mustRun(t, s, api.CommandRequest{Command: []string{"cat"}})
	if res.Stdout != "" || res.ExitCode != 0 {
		t.Fatalf("cat without stdin: %+v", res)
	}
}

func TestEnvIsolation(t *testing.T) {
	t.Setenv("AGENTBOX_TEST_SECRET", "s3cret")
	t.Setenv("HTTPS_PROXY", "http://egress:3128")
	s := newServer(t, Config{})
	res := mustRun(t, s, api.CommandRequest{Command: []string{"env"}, Env: map[string]string{"FOO": "bar", "LANG": "en_US.UTF-8"}})
	got := map[string]string{}
	for _, line := range strings.Split(strings.TrimSpace(res.Stdout), "\n") {
		k, v, _ := strings.Cut(line, "=")
		got[k] = v
	}
	want := map[string]string{
		"PATH": DefaultPath, "HOME": s.DefaultCwd(), "LANG": "en_US.UTF-8", "FOO": "bar",
		"HTTPS_PROXY": "http://egress:3128",
	}
	for k, v := range want {
		if got[k] != v {
			t.Errorf("%s = %q, want %q", k, got[k], v)
		}
	}
	if strings.Contains(res.Stdout, "s3cret") {
		t.Errorf("the supervisor's environment leaked into the command:\n%s", res.Stdout)
	}
	for k := range got {
		if _, ok := want[k]; !ok && k != "PWD" && k != "SHLVL" && k != "_" {
			t.Errorf("unexpected variable %s=%s", k, got[k])
		}
	}
}

// With PassAllEnv (what the controller configures) a command gets the
// supervisor's whole environment, the image's ENV among it, but never the
// supervisor's configuration, its GODEBUG or the API server's address that
// kubelet injects; an explicit list may name neither, nor PassAllEnv
// beside other names.
func TestEnvPassAll(t *testing.T) {
	path := "/opt/java/bin:" + os.Getenv("PATH")
	for k, v := range map[string]string{
		"NODE_VERSION": "22.11.0", "JAVA_HOME": "/opt/java", "HOME": "/home/app", "HTTPS_PROXY": "http://egress:3128",
		"AGENTBOX_TEST_SECRET": "s3cret", "GODEBUG": "profstackdepth=0",
		"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443", "KUBERNETES_SERVICE_PORT_HTTPS": "443",
		"KUBERNETES_PORT": "tcp://10.96.0.1:443", "KUBERNETES_PORT_443_TCP_ADDR": "10.96.0.1",
		"PATH": path,
	} {
		t.Setenv(k, v)
	}
	s := newServer(t, Config{PassEnv: []string{PassAllEnv}})
	res := mustRun(t, s, api.CommandRequest{Command: []string{"env"}})
	got := map[string]string{}
	for _, line := range strings.Split(strings.TrimSpace(res.Stdout), "\n") {
		k, v, _ := strings.Cut(line, "=")
		got[k] = v
	}
	for k, v := range map[string]string{
		"NODE_VERSION": "22.11.0", "JAVA_HOME": "/opt/java", "HOME": "/home/app", "HTTPS_PROXY": "http://egress:3128",
		"PATH": path, "LANG": "C.UTF-8",
	} {
		if got[k] != v {
			t.Errorf("%s = %q, want %q", k, got[k], v)
		}
	}
	for k := range got {
		if NotPassed(k) {
			t.Errorf("%s=%s reached the command", k, got[k])
		}
	}
	for _, k := range []string{"AGENTBOX_TEST_SECRET", "GODEBUG", "KUBERNETES_SERVICE_HOST", "KUBERNETES_PORT", "KUBERNETES_PORT_443_TCP_ADDR"} {
		if !NotPassed(k) {
			t.Errorf("NotPassed(%s) = false", k)
		}
	}

	// An environment without PATH, or with an empty one, leaves the
	// default.
	t.Setenv("PATH", "")
	s = newServer(t, Config{PassEnv: []string{PassAllEnv}})
	if got := s.runner.BaseEnv()["PATH"]; got != DefaultPath {
		t.Errorf("with an empty PATH: %q, want the default %q", got, DefaultPath)
	}

	for _, names := range [][]string{{"GODEBUG"}, {"AGENTBOX_TLS_DIR"}, {PassAllEnv, "FOO"}} {
		if err := CheckPassEnv(names); err == nil {
			t.Errorf("CheckPassEnv(%q) accepted it", names)
		}
		if _, err := New(Config{PassEnv: names}); err == nil {
			t.Errorf("New with PassEnv %q accepted it", names)
		}
	}
	if got := PassedEnv([]string{"A", "C"}, []string{"A=1", "B=2", "C=", "=x", "junk"}); len(got) != 2 || got["A"] != "1" || got["C"] != "" {
		t.Errorf("PassedEnv of a list: %v, want A=1 and C empty", got)
	}
}

// The executable is looked up in the command's PATH, not the supervisor's.
func TestLookupUsesRequestPath(t *testing.T) {
	bin := t.TempDir()
	script := filepath.Join(bin, "agentbox-hello")
	if err := os.WriteFile(script, []byte("#!/bin/sh\necho hi from $0\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	s := newServer(t, Config{})
	res := mustRun(t, s, api.CommandRequest{Command: []string{"agentbox-hello"}, Env: map[string]string{"PATH": bin + ":/usr/bin:/bin"}})
	if res.Stdout != "hi from "+script+"\n" {
		t.Fatalf("stdout = %q", res.Stdout)
	}
	_, _, e := post(t, s, api.CommandRequest{Command: []string{"agentbox-hello"}})
	if e == nil || e.Code != api.CodeNotFound || e.Status != http.StatusNotFound {
		t.Fatalf("without the PATH entry: %v, want not_found", e)
	}
	// A relative path is relative to the cwd.
	res = mustRun(t, s, api.CommandRequest{Command: []string{"./agentbox-hello"}, Cwd: bin})
	if res.ExitCode != 0 {
		t.Fatalf("relative path: %+v", res)
	}
}

func TestCwd(t *testing.T) {
	s := newServer(t, Config{})
	if err := os.Mkdir(filepath.Join(s.DefaultCwd(), "sub"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(s.DefaultCwd(), "file"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct{ cwd, want string }{
		{"", s.DefaultCwd()},
		{"sub", filepath.Join(s.DefaultCwd(), "sub")},
		{"/", "/"},
	} {
		res := mustRun(t, s, api.CommandRequest{Command: []string{"pwd"}, Cwd: tc.cwd})
		if strings.TrimSpace(res.Stdout) != tc.want {
			t.Errorf("cwd %q: pwd = %q, want %q", tc.cwd, res.Stdout, tc.want)
		}
	}
	if _, _, e := post(t, s, api.CommandRequest{Command: []string{"pwd"}, Cwd: "/does/not/exist"}); e == nil || e.Code != api.CodeNotFound {
		t.Errorf("missing cwd: %v, want not_found", e)
	}
	if _, _, e := post(t, s, api.CommandRequest{Command: []string{"pwd"}, Cwd: "file"}); e == nil || e.Code != api.CodeInvalidArgument {
		t.Errorf("cwd is a file: %v, want invalid_argument", e)
	}

	if _, err := New(Config{DefaultCwd: "/does/not/exist"}); err == nil {
		t.Error("New accepted a default cwd that does not exist")
	}
}

func TestOutputCap(t *testing.T) {
	s := newServer(t, Config{})
	const threeMiB = 3 << 20
	start := time.Now()
	res := mustRun(t, s, api.CommandRequest{Command: []string{"sh", "-c", "yes 0123456789abcdef | head -c " + strconv.Itoa(threeMiB)}})
	if len(res.Stdout) != DefaultMaxOutputBytes || !res.Truncated || res.ExitCode != 0 || res.Signal != "" {
		t.Fatalf("3 MiB of output: len(stdout) = %d, truncated %v, exit %d, signal %q; want %d, true, 0", len(res.Stdout), res.Truncated, res.ExitCode, res.Signal, DefaultMaxOutputBytes)
	}
	if !strings.HasPrefix(res.Stdout, "0123456789abcdef\n0123") {
		t.Fatalf("output does not start with the first bytes written: %q", res.Stdout[:32])
	}
	t.Logf("3 MiB written, %d bytes kept, %s", len(res.Stdout), time.Since(start))

	// The cap is on both streams together.
	res = mustRun(t, s, api.CommandRequest{
		Command:        []string{"sh", "-c", "yes out | head -c 100000 & yes err | head -c 100000 >&2; wait"},
		MaxOutputBytes: 50000,
	})
	if n := len(res.Stdout) + len(res.Stderr); n != 50000 || !res.Truncated {
		t.Fatalf("combined output %d bytes (truncated %v), want 50000 (true)", n, res.Truncated)
	}

	// Exactly the cap is not truncation.
	res = mustRun(t, s, api.CommandRequest{Command: []string{"printf", "12345"}, MaxOutputBytes: 5})
	if res.Stdout != "12345" || res.Truncated {
		t.Fatalf("output equal to the cap: %+v", res)
	}
}

func TestOutputUTF8(t *testing.T) {
	s := newServer(t, Config{})
	// "é" is two bytes; a cap of 5 cuts the third one in half.
	res := mustRun(t, s, api.CommandRequest{Command: []string{"printf", "ééé"}, MaxOutputBytes: 5})
	if res.Stdout != "éé" || !res.Truncated {
		t.Fatalf("cut rune: stdout %q, truncated %v; want \"éé\", true", res.Stdout, res.Truncated)
	}
	res = mustRun(t, s, api.CommandRequest{Command: []string{"printf", `a\377b`}})
	if res.Stdout != "a\uFFFDb" || !utf8.ValidString(res.Stdout) {
		t.Fatalf("invalid byte: stdout %q, want %q", res.Stdout, "a\uFFFDb")
	}
}

// procStat reads a process's state and parent from /proc/<pid>/stat; the
// command name before them is in parentheses and may hold anything.
func procStat(pid int) (state byte, ppid int, ok bool) {
	data, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return 0, 0, false
	}
	i := bytes.LastIndexByte(data, ')')
	if i < 0 {
		return 0, 0, false
	}
	f := bytes.Fields(data[i+1:])
	if len(f) < 2 || len(f[0]) != 1 {
		return 0, 0, false
	}
	ppid, err = strconv.Atoi(string(f[1]))
	return f[0][0], ppid, err == nil
}

// processGone reports whether pid has exited. A zombie counts as gone: it
// has stopped running and only waits for its parent to collect it.
func processGone(pid int) bool {
	state, _, ok := procStat(pid)
	return !ok || state == 'Z'
}

func waitGone(t *testing.T, pid int, within time.Duration) {
	t.Helper()
	deadline := time.Now().Add(within)
	for !processGone(pid) {
		if time.Now().After(deadline) {
			t.Fatalf("process %d still running after %s", pid, within)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func TestTimeoutKillsProcessGroup(t *testing.T) {
	s := newServer(t, Config{})
	start := time.Now()
	res := mustRun(t, s, api.CommandRequest{Command: []string{"sh", "-c", "sleep 100 & echo $!; sleep 100"}, TimeoutSeconds: 1})
	elapsed := time.Since(start)
	if !res.TimedOut || res.Signal != "SIGKILL" || res.ExitCode != -1 {
		t.Fatalf("unexpected result %+v", res)
	}
	if elapsed > 3*time.Second {
		t.Fatalf("request took %s with a 1 s timeout", elapsed)
	}
	pid, err := strconv.Atoi(strings.TrimSpace(res.Stdout))
	if err != nil {
		t.Fatalf("grandchild PID: %v (stdout %q)", err, res.Stdout)
	}
	waitGone(t, pid, 2*time.Second)
	t.Logf("timed out after %s (duration_ms %d); grandchild %d killed", elapsed, res.DurationMS, pid)
}

// When the client goes away the command's process group is killed at once
// rather than running on until its timeout.
func TestClientGoneKillsProcessGroup(t *testing.T) {
	s := newServer(t, Config{})
	srv := httptest.NewServer(s)
	defer srv.Close()
	pidFile := filepath.Join(t.TempDir(), "pid")
	body, _ := json.Marshal(api.CommandRequest{
		Command:        []string{"sh", "-c", `sleep 100 & echo $! > "$1"; echo $$ >> "$1"; sleep 100`, "sh", pidFile},
		TimeoutSeconds: 300,
	})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		req, _ := http.NewRequestWithContext(ctx, http.MethodPost, srv.URL+api.PathCommands, bytes.NewReader(body))
		resp, err := srv.Client().Do(req)
		if err == nil {
			resp.Body.Close()
		}
		done <- err
	}()
	var pids []int
	deadline := time.Now().Add(5 * time.Second)
	for len(pids) < 2 {
		if time.Now().After(deadline) {
			t.Fatal("the command did not start")
		}
		time.Sleep(20 * time.Millisecond)
		data, _ := os.ReadFile(pidFile)
		pids = pids[:0]
		for _, f := range strings.Fields(string(data)) {
			if p, err := strconv.Atoi(f); err == nil {
				pids = append(pids, p)
			}
		}
	}
	cancel()
	if err := <-done; !errors.Is(err, context.Canceled) {
		t.Fatalf("client error = %v, want context.Canceled", err)
	}
	for _, p := range pids {
		waitGone(t, p, 3*time.Second)
	}
	if err := s.Wait(context.Background()); err != nil {
		t.Fatal(err)
	}
}

// A background job that keeps stdout open must not hold the request until
// it ends; it is left running, as it would be after a shell command.
func TestBackgroundJobDoesNotHoldRequest(t *testing.T) {
	s := newServer(t, Config{WaitDelay: 300 * time.Millisecond})
	start := time.Now()
	res := mustRun(t, s, api.CommandRequest{Command: []string{"sh", "-c", "sleep 30 & echo $!"}})
	elapsed := time.Since(start)
	pid, err := strconv.Atoi(strings.TrimSpace(res.Stdout))
	if err != nil {
		t.Fatalf("background PID: %v (%+v)", err, res)
	}
	defer func() { _ = syscall.Kill(pid, syscall.SIGKILL) }()
	if res.ExitCode != 0 || elapsed > 2*time.Second {
		t.Fatalf("exit %d after %s, want 0 within about the 300ms wait delay", res.ExitCode, elapsed)
	}
	if processGone(pid) {
		t.Fatal("the background job was killed although the command exited normally")
	}
}

func TestInvalidInput(t *testing.T) {
	s := newServer(t, Config{MaxTimeout: time.Minute, MaxRequestBytes: 1024})
	plain := filepath.Join(t.TempDir(), "data.txt")
	garbage := filepath.Join(t.TempDir(), "garbage")
	if err := os.WriteFile(plain, []byte("#!/bin/sh\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(garbage, []byte{0, 1, 2, 3, 4, 5, 6, 7}, 0o755); err != nil {
		t.Fatal(err)
	}
	cases := []struct {
		name     string
		body     any
		code     api.Code
		status   int
		contains string
	}{
		{"empty command", api.CommandRequest{}, api.CodeInvalidArgument, 400, "command must not be empty"},
		{"empty program", api.CommandRequest{Command: []string{""}}, api.CodeInvalidArgument, 400, "command[0]"},
		{"NUL in argument", api.CommandRequest{Command: []string{"echo", "a\x00b"}}, api.CodeInvalidArgument, 400, "NUL"},
		{"negative timeout", api.CommandRequest{Command: []string{"true"}, TimeoutSeconds: -1}, api.CodeInvalidArgument, 400, "timeout_seconds"},
		{"timeout over the maximum", api.CommandRequest{Command: []string{"true"}, TimeoutSeconds: 61}, api.CodeInvalidArgument, 400, "maximum of 60"},
		{"fractional timeout", `{"command":["true"],"timeout_seconds":1.5}`, api.CodeInvalidArgument, 400, "timeout_seconds"},
		{"negative output cap", api.CommandRequest{Command: []string{"true"}, MaxOutputBytes: -1}, api.CodeInvalidArgument, 400, "max_output_bytes"},
		{"output cap over the limit", api.CommandRequest{Command: []string{"true"}, MaxOutputBytes: 2 << 20}, api.CodeInvalidArgument, 400, "limit"},
		{"env name with =", api.CommandRequest{Command: []string{"true"}, Env: map[string]string{"A=B": "c"}}, api.CodeInvalidArgument, 400, "env"},
		{"empty env name", api.CommandRequest{Command: []string{"true"}, Env: map[string]string{"": "c"}}, api.CodeInvalidArgument, 400, "env"},
		{"malformed JSON", `{"command": [`, api.CodeInvalidArgument, 400, "invalid JSON"},
		{"wrong type", `{"command": "ls -l"}`, api.CodeInvalidArgument, 400, "invalid JSON"},
		{"trailing data", `{"command":["true"]} {"command":["false"]}`, api.CodeInvalidArgument, 400, "after the JSON object"},
		{"empty body", ``, api.CodeInvalidArgument, 400, "empty request body"},
		{"body too large", api.CommandRequest{Command: []string{"true"}, Stdin: strings.Repeat("x", 2048)}, api.CodePayloadTooLarge, 413, "1024"},
		{"unknown program", api.CommandRequest{Command: []string{"agentbox-no-such-program"}}, api.CodeNotFound, 404, "not found"},
		{"not executable", api.CommandRequest{Command: []string{plain}}, api.CodePermissionDenied, 403, "permission denied"},
		{"not an executable format", api.CommandRequest{Command: []string{garbage}}, api.CodeInvalidArgument, 400, "executable format"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			status, res, e := post(t, s, tc.body)
			if e == nil {
				t.Fatalf("got a result %+v, want error %s", res, tc.code)
			}
			if e.Code != tc.code || status != tc.status || !strings.Contains(e.Message, tc.contains) {
				t.Fatalf("got %d %s %q, want %d %s containing %q", status, e.Code, e.Message, tc.status, tc.code, tc.contains)
			}
		})
	}

	for _, tc := range []struct {
		method, path string
		status       int
		code         api.Code
	}{
		{http.MethodGet, api.PathCommands, 405, api.CodeMethodNotAllowed},
		{http.MethodPost, api.PathHealth, 405, api.CodeMethodNotAllowed},
		{http.MethodGet, "/v1/nope", 404, api.CodeNotFound},
	} {
		rec := httptest.NewRecorder()
		s.ServeHTTP(rec, httptest.NewRequest(tc.method, tc.path, nil))
		_, _, e := decode(t, rec.Code, rec.Body.Bytes())
		if e == nil || rec.Code != tc.status || e.Code != tc.code {
			t.Errorf("%s %s: %d %v, want %d %s", tc.method, tc.path, rec.Code, e, tc.status, tc.code)
		}
	}

	req := httptest.NewRequest(http.MethodPost, api.PathCommands, strings.NewReader(`{"command":["true"]}`))
	req.Header.Set("Content-Type", "text/plain")
	rec := httptest.NewRecorder()
	s.ServeHTTP(rec, req)
	if rec.Code != http.StatusBadRequest {
		t.Errorf("text/plain body: status %d, want 400", rec.Code)
	}
}

func TestConcurrencyLimit(t *testing.T) {
	s := newServer(t, Config{MaxConcurrentCommands: 1, MaxQueuedCommands: -1})
	wait := occupySlot(t, s)
	_, _, e := post(t, s, api.CommandRequest{Command: []string{"true"}})
	if e == nil || e.Code != api.CodeResourceExhausted || e.Status != http.StatusTooManyRequests {
		t.Fatalf("second command: %v, want resource_exhausted", e)
	}
	wait()
	mustRun(t, s, api.CommandRequest{Command: []string{"true"}})
}

// occupySlot runs a one-second command and returns once it holds a
// command slot; wait waits for it to end.
func occupySlot(t *testing.T, s *Server) (wait func()) {
	t.Helper()
	done := make(chan struct{})
	go func() {
		defer close(done)
		if _, _, e := post(t, s, api.CommandRequest{Command: []string{"sleep", "1"}}); e != nil {
			t.Error(e)
		}
	}()
	for len(s.slots) == 0 {
		time.Sleep(5 * time.Millisecond)
	}
	return func() { <-done }
}

// A burst larger than the slots waits its turn: every command runs, and
// never more than the slots at once.
func TestCommandQueue(t *testing.T) {
	dir := t.TempDir()
	s := newServer(t, Config{MaxConcurrentCommands: 2})
	const n = 24
	var wg sync.WaitGroup
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			// Each command records how many ran beside it: a file per
			// running command, counted while it runs.
			script := `touch "$1/$2"; sleep 0.05; ls "$1" | wc -l; rm "$1/$2"`
			_, res, e := post(t, s, api.CommandRequest{Command: []string{"sh", "-c", script, "sh", dir, strconv.Itoa(i)}})
			if e != nil {
				t.Errorf("command %d: %v", i, e)
				return
			}
			if got, _ := strconv.Atoi(strings.TrimSpace(res.Stdout)); got < 1 || got > 2 {
				t.Errorf("command %d saw %q running", i, res.Stdout)
			}
		}()
	}
	wg.Wait()
}

func TestCommandQueueBounds(t *testing.T) {
	s := newServer(t, Config{MaxConcurrentCommands: 1, MaxQueuedCommands: 1, CommandQueueWait: 300 * time.Millisecond})
	wait := occupySlot(t, s)
	// One waits (and gives up after CommandQueueWait); with it waiting,
	// the queue is full and the next is refused at once.
	waited := make(chan *api.Error, 1)
	go func() {
		_, _, e := post(t, s, api.CommandRequest{Command: []string{"true"}})
		waited <- e
	}()
	for s.queued.Load() == 0 {
		time.Sleep(5 * time.Millisecond)
	}
	_, _, e := post(t, s, api.CommandRequest{Command: []string{"true"}})
	if e == nil || e.Code != api.CodeResourceExhausted || !strings.Contains(e.Message, "more are waiting") {
		t.Errorf("past the queue: %v, want resource_exhausted", e)
	}
	if e := <-waited; e == nil || e.Code != api.CodeResourceExhausted || !strings.Contains(e.Message, "waited") {
		t.Errorf("past the queue wait: %v, want resource_exhausted", e)
	}
	wait()
}

func TestRequestLog(t *testing.T) {
	var buf bytes.Buffer
	s := newServer(t, Config{Logger: slog.New(slog.NewJSONHandler(&buf, nil))})
	mustRun(t, s, api.CommandRequest{Command: []string{"sh", "-c", "exit 2"}, Env: map[string]string{"TOKEN": "hunter2"}})
	post(t, s, api.CommandRequest{})
	lines := strings.Split(strings.TrimSpace(buf.String()), "\n")
	if len(lines) != 2 {
		t.Fatalf("want one line per request, got:\n%s", buf.String())
	}
	var first, second map[string]any
	if err := json.Unmarshal([]byte(lines[0]), &first); err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal([]byte(lines[1]), &second); err != nil {
		t.Fatal(err)
	}
	if first["method"] != "POST" || first["path"] != api.PathCommands || first["status"] != float64(200) ||
		first["exit_code"] != float64(2) || first["program"] != "sh" {
		t.Errorf("unexpected log line %s", lines[0])
	}
	if _, ok := first["duration_ms"]; !ok {
		t.Errorf("log line lacks duration_ms: %s", lines[0])
	}
	if strings.Contains(buf.String(), "hunter2") || strings.Contains(buf.String(), "exit 2") {
		t.Errorf("log exposes arguments or environment:\n%s", buf.String())
	}
	if second["status"] != float64(400) || second["error_code"] != string(api.CodeInvalidArgument) {
		t.Errorf("unexpected log line %s", lines[1])
	}
}

// With the reaper running, orphans are collected instead of lingering as
// zombies, and the package's own children still report their exit status.
func TestReaper(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	if err := StartReaper(ctx, nil); err != nil {
		t.Fatal(err)
	}
	s := newServer(t, Config{MaxConcurrentCommands: 32})
	res := mustRun(t, s, api.CommandRequest{Command: []string{"sh", "-c", "sleep 0.2 </dev/null >/dev/null 2>&1 & echo $!"}})
	pid, err := strconv.Atoi(strings.TrimSpace(res.Stdout))
	if err != nil {
		t.Fatalf("orphan PID: %v (%+v)", err, res)
	}
	deadline := time.Now().Add(5 * time.Second)
	for {
		if _, _, ok := procStat(pid); !ok {
			break
		}
		if time.Now().After(deadline) {
			state, ppid, _ := procStat(pid)
			t.Fatalf("orphan %d still present (state %c, parent %d; we are %d)", pid, state, ppid, os.Getpid())
		}
		time.Sleep(20 * time.Millisecond)
	}

	var wg sync.WaitGroup
	errs := make(chan string, 32)
	for i := 0; i < 32; i++ {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			want := i % 7
			_, res, e := post(t, s, api.CommandRequest{Command: []string{"sh", "-c", "sleep 0.0$1 & exit $2", "sh", strconv.Itoa(i % 10), strconv.Itoa(want)}})
			if e != nil {
				errs <- e.Error()
			} else if res.ExitCode != want {
				errs <- "exit code " + strconv.Itoa(res.ExitCode) + ", want " + strconv.Itoa(want)
			}
		}(i)
	}
	wg.Wait()
	close(errs)
	for e := range errs {
		t.Error(e)
	}
}

func BenchmarkRunCommandTrue(b *testing.B) {
	s := newServer(b, Config{})
	body, _ := json.Marshal(api.CommandRequest{Command: []string{"true"}})
	b.ReportAllocs()
	for b.Loop() {
		req := httptest.NewRequest(http.MethodPost, api.PathCommands, bytes.NewReader(body))
		rec := httptest.NewRecorder()
		s.ServeHTTP(rec, req)
		if rec.Code != http.StatusOK {
			b.Fatalf("status %d: %s", rec.Code, rec.Body.String())
		}
	}
}
