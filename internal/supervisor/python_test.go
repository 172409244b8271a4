package supervisor

import (
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"net/http/httptest"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/pyenv"
	api "github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"
)

// pythonInterpreter returns the host's python3 as the interpreter itself,
// not a wrapper such as a version manager's shim, which would need
// environment that commands do not get.
func pythonInterpreter(t testing.TB) string {
	t.Helper()
	p, err := exec.LookPath("python3")
	if err != nil {
		t.Skip("python3 is not installed on this host; python_exec cannot be tested")
	}
	out, err := exec.Command(p, "-c", "import sys; print(sys.executable)").Output()
	if err != nil {
		t.Skipf("python3 at %s does not run: %v", p, err)
	}
	return strings.TrimSpace(string(out))
}

func postPython(t testing.TB, h http.Handler, body any) (int, *api.CommandResult, *api.Error) {
	t.Helper()
	raw, ok := body.(string)
	if !ok {
		b, err := json.Marshal(body)
		if err != nil {
			t.Fatal(err)
		}
		raw = string(b)
	}
	req := httptest.NewRequest(http.MethodPost, api.PathPython, strings.NewReader(raw))
	req.Header.Set("Content-Type", "application/json")
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, req)
	return decode(t, rec.Code, rec.Body.Bytes())
}

func TestPython(t *testing.T) {
	s := newServer(t, Config{Python: pythonInterpreter(t)})
	_, res, e := postPython(t, s, api.PythonRequest{
		Code:  "import os, sys\nprint(sys.stdin.read().upper())\nprint(os.environ['GREETING'], os.getcwd() == os.environ['HOME'])",
		Stdin: "shout",
		Env:   map[string]string{"GREETING": "hello"},
	})
	if e != nil {
		t.Fatal(e)
	}
	if res.ExitCode != 0 || res.Stdout != "SHOUT\nhello True\n" || res.Stderr != "" {
		t.Fatalf("unexpected result %+v", res)
	}

	// An exception is a result: exit status 1 and the traceback, which
	// names the code as <string> rather than some file on the host.
	_, res, e = postPython(t, s, api.PythonRequest{Code: "print('before')\nraise ValueError('boom')"})
	if e != nil {
		t.Fatal(e)
	}
	if res.ExitCode != 1 || res.Stdout != "before\n" || !strings.Contains(res.Stderr, `File "<string>", line 2`) || !strings.Contains(res.Stderr, "ValueError: boom") {
		t.Fatalf("exception: %+v", res)
	}

	_, res, e = postPython(t, s, api.PythonRequest{Code: "import sys; sys.exit(5)"})
	if e != nil || res.ExitCode != 5 {
		t.Fatalf("sys.exit(5): %+v, %v", res, e)
	}
}

func TestPythonOutputCap(t *testing.T) {
	s := newServer(t, Config{Python: pythonInterpreter(t)})
	_, res, e := postPython(t, s, api.PythonRequest{Code: "import sys\nfor _ in range(64): sys.stdout.write('x' * 65536)"})
	if e != nil {
		t.Fatal(e)
	}
	if !res.Truncated || len(res.Stdout) != api.DefaultMaxOutputBytes || res.ExitCode != 0 {
		t.Fatalf("4 MiB of output: truncated %v, %d bytes kept, exit %d; want the 1 MiB cap", res.Truncated, len(res.Stdout), res.ExitCode)
	}
	_, res, e = postPython(t, s, api.PythonRequest{Code: "print('y' * 100)", MaxOutputBytes: 10})
	if e != nil || !res.Truncated || res.Stdout != strings.Repeat("y", 10) {
		t.Fatalf("max_output_bytes 10: %+v, %v", res, e)
	}
	_, _, e = postPython(t, s, api.PythonRequest{Code: "pass", MaxOutputBytes: api.DefaultMaxOutputBytes + 1})
	if e == nil || e.Code != api.CodeInvalidArgument {
		t.Fatalf("max_output_bytes above the limit: %v", e)
	}
}

func TestPythonTimeouts(t *testing.T) {
	py := pythonInterpreter(t)
	s := newServer(t, Config{Python: py, PythonDefaultTimeout: time.Second})
	start := time.Now()
	// Unbuffered output: what was printed before the kill is returned.
	_, res, e := postPython(t, s, api.PythonRequest{Code: "import time\nprint('started')\ntime.sleep(30)"})
	if e != nil {
		t.Fatal(e)
	}
	if !res.TimedOut || res.Signal != "SIGKILL" || res.Stdout != "started\n" || time.Since(start) > 10*time.Second {
		t.Fatalf("default timeout: %+v after %s", res, time.Since(start))
	}

	// The limits by default: 30 s unless asked, 120 s at most, and a
	// request for more is refused, not clamped.
	s = newServer(t, Config{Python: py})
	if s.cfg.PythonDefaultTimeout != 30*time.Second || s.cfg.PythonMaxTimeout != 120*time.Second {
		t.Fatalf("python timeouts %s / %s, want 30s / 2m0s", s.cfg.PythonDefaultTimeout, s.cfg.PythonMaxTimeout)
	}
	_, res, e = postPython(t, s, api.PythonRequest{Code: "print('ok')", TimeoutSeconds: api.MaxPythonTimeoutSeconds})
	if e != nil || res.Stdout != "ok\n" {
		t.Fatalf("timeout at the maximum: %+v, %v", res, e)
	}
	_, _, e = postPython(t, s, api.PythonRequest{Code: "print('ok')", TimeoutSeconds: api.MaxPythonTimeoutSeconds + 1})
	if e == nil || e.Code != api.CodeInvalidArgument || !strings.Contains(e.Message, "exceeds the maximum of 120") {
		t.Fatalf("timeout above the maximum: %v, want invalid_argument", e)
	}
	// A supervisor whose commands may run less than 120 s caps python_exec
	// there too: it would not wait longer to write the response.
	s = newServer(t, Config{Python: py, DefaultTimeout: 30 * time.Second, MaxTimeout: 45 * time.Second})
	if s.cfg.PythonMaxTimeout != 45*time.Second {
		t.Fatalf("python max timeout %s with a 45s command maximum", s.cfg.PythonMaxTimeout)
	}
	if _, err := New(Config{DefaultCwd: t.TempDir(), PythonDefaultTimeout: time.Minute, PythonMaxTimeout: 30 * time.Second}); err == nil {
		t.Fatal("New accepted a python default timeout above the maximum")
	}
}

func TestPythonInvalidRequests(t *testing.T) {
	s := newServer(t, Config{Python: pythonInterpreter(t)})
	for name, body := range map[string]any{
		"empty code":       api.PythonRequest{Code: " \n"},
		"NUL in code":      api.PythonRequest{Code: "print(1)\x00"},
		"code too long":    api.PythonRequest{Code: strings.Repeat("#", api.MaxPythonCodeBytes+1)},
		"negative timeout": api.PythonRequest{Code: "pass", TimeoutSeconds: -1},
		"bad env":          api.PythonRequest{Code: "pass", Env: map[string]string{"A=B": "c"}},
		"not JSON":         "print(1)",
		"two values":       `{"code":"pass"} {}`,
		"wrong type":       `{"code":1}`,
	} {
		status, _, e := postPython(t, s, body)
		if e == nil || e.Code != api.CodeInvalidArgument || status != http.StatusBadRequest {
			t.Errorf("%s: status %d, %v; want invalid_argument", name, status, e)
		}
	}
	// The longest code accepted does reach the interpreter.
	code := "print('edge')#" + strings.Repeat("#", api.MaxPythonCodeBytes-len("print('edge')#"))
	if _, res, e := postPython(t, s, api.PythonRequest{Code: code}); e != nil || res.Stdout != "edge\n" {
		t.Fatalf("code of exactly %d bytes: %+v, %v", len(code), res, e)
	}
	if _, _, e := postPython(t, s, api.PythonRequest{Code: "pass", Cwd: "no-such-dir"}); e == nil || e.Code != api.CodeNotFound {
		t.Errorf("missing cwd: %v, want not_found", e)
	}
	rec := httptest.NewRecorder()
	s.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, api.PathPython, nil))
	if rec.Code != http.StatusMethodNotAllowed || rec.Header().Get("Allow") != "POST" {
		t.Errorf("GET %s: %d", api.PathPython, rec.Code)
	}

	noPython := newServer(t, Config{Python: "agentbox-no-such-python"})
	if _, _, e := postPython(t, noPython, api.PythonRequest{Code: "pass"}); e == nil || e.Code != api.CodeNotFound {
		t.Errorf("missing interpreter: %v, want not_found", e)
	}
}

// python_exec shares the command slots: it cannot be used to run more
// processes at once than the supervisor allows.
func TestPythonSharesCommandSlots(t *testing.T) {
	s := newServer(t, Config{Python: pythonInterpreter(t), MaxConcurrentCommands: 1, MaxQueuedCommands: -1})
	done := make(chan struct{})
	go func() {
		defer close(done)
		mustRun(t, s, api.CommandRequest{Command: []string{"sleep", "1"}})
	}()
	time.Sleep(200 * time.Millisecond)
	_, _, e := postPython(t, s, api.PythonRequest{Code: "pass"})
	<-done
	if e == nil || e.Code != api.CodeResourceExhausted {
		t.Fatalf("python_exec while the only slot is taken: %v, want resource_exhausted", e)
	}
}

// TestPythonWithoutInterpreter runs python_exec and /v1/execute in a
// sandbox whose image has no python3 (node, busybox): each answers at once
// with an error that names the missing interpreter and the PATH searched,
// never an internal error, and an environment is not even begun without
// the base interpreter pip builds it from. A call that brings its own PATH
// with a python3 on it is served.
func TestPythonWithoutInterpreter(t *testing.T) {
	bare := t.TempDir()
	f := newFileServer(t, Config{
		BaseEnv: map[string]string{"PATH": bare, "LANG": "C.UTF-8"}, PassEnv: []string{},
		Execute: ExecuteConfig{RunDir: t.TempDir(), Envs: &pyenv.Config{Dir: t.TempDir()}},
	})
	check := func(how string, e *api.Error, status int, tool string) {
		t.Helper()
		want := tool + " needs python3 on the sandbox image's PATH (" + bare + "), and the image has none"
		if e == nil || e.Code != api.CodeNotFound || !strings.Contains(e.Message, want) {
			t.Errorf("%s: %v, want not_found saying %q", how, e, want)
		}
		if status != 0 && status != http.StatusNotFound {
			t.Errorf("%s: status %d, want 404", how, status)
		}
	}
	status, _, e := postPython(t, f.s, api.PythonRequest{Code: "print(1)"})
	check("python_exec", e, status, api.ToolPythonExec)
	check("tool python_exec", call(t, f.client, api.ToolPythonExec, api.PythonRequest{Code: "print(1)"}, nil), 0, api.ToolPythonExec)
	status, _, e = postExecute(t, f.s, api.ExecuteRequest{Code: "print(1)"})
	check("execute", e, status, api.ToolPythonExecute)
	status, _, e = postExecute(t, f.s, api.ExecuteRequest{Code: "print(1)", Requirements: []string{"agentbox-greet"}})
	check("execute in an environment", e, status, api.ToolPythonExecute)
	_, err := f.client.EnsureEnv(context.Background(), api.EnvRequest{Requirements: []string{"agentbox-greet"}})
	var ee *api.Error
	if !errors.As(err, &ee) {
		t.Fatalf("EnsureEnv without an interpreter: %v", err)
	}
	check("building an environment", ee, 0, "building a Python environment")
	// The code is still checked first.
	if _, _, e := postPython(t, f.s, api.PythonRequest{Code: " "}); e == nil || e.Code != api.CodeInvalidArgument {
		t.Errorf("empty code without an interpreter: %v, want invalid_argument", e)
	}

	py := pythonInterpreter(t)
	path := filepath.Dir(py) + ":" + bare
	_, res, e := postPython(t, f.s, api.PythonRequest{Code: "print(6 * 7)", Env: map[string]string{"PATH": path}})
	if e != nil || res.Stdout != "42\n" {
		t.Errorf("python_exec with a PATH of its own: %+v, %v", res, e)
	}
}
