package supervisor

import (
	"net/http"
	"net/http/httptest"
	"path"
	"strings"
	"testing"

	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/httpcall"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/runner"
	api "github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"
)

// The seed corpora live in testdata/fuzz/<FuzzName>; the f.Add seeds are
// the cases worth keeping even if those files are pruned.

// FuzzDecodeCommand feeds arbitrary bodies to the command decoder and the
// validation after it. Nothing may panic, and a request that passes
// validation must be one the process launcher can take.
func FuzzDecodeCommand(f *testing.F) {
	f.Add(`{"command":["echo","hi"]}`)
	f.Add(`{"command":["sh","-c","exit 3"],"cwd":"sub","env":{"A":"b"},"stdin":"x","timeout_seconds":5,"max_output_bytes":10}`)
	f.Add(`{"command":[]}`)
	f.Add(`{"command":["a\u0000b"]}`)
	f.Add(`{"command":["x"],"env":{"A=B":"c"}}`)
	f.Add(`{"command":["x"],"timeout_seconds":-1}`)
	f.Add(`{"command":["x"]} {}`)
	f.Add(`[`)
	s := newServer(f, Config{MaxRequestBytes: 1 << 16})
	f.Fuzz(func(t *testing.T, body string) {
		var req api.CommandRequest
		if e := httpcall.DecodeJSON(httptest.NewRecorder(), jsonRequest(api.PathCommands, body), s.cfg.MaxRequestBytes, &req); e != nil {
			checkTypedError(t, e)
			return
		}
		spec, e := s.runner.Prepare(&req, s.cfg.DefaultTimeout, s.cfg.MaxTimeout)
		if e != nil {
			checkTypedError(t, e)
			return
		}
		checkSpec(t, s, spec)
	})
}

// FuzzDecodePython does the same for python_exec, whose code ends up as a
// single argument of the interpreter.
func FuzzDecodePython(f *testing.F) {
	f.Add(`{"code":"print(1)"}`)
	f.Add(`{"code":"import sys\nprint(sys.stdin.read())","stdin":"in","env":{"K":"v"},"timeout_seconds":120}`)
	f.Add(`{"code":"pass","timeout_seconds":121}`)
	f.Add(`{"code":"  "}`)
	f.Add(`{"code":"\u0000"}`)
	f.Add(`{"code":1}`)
	f.Add(`{"code":"x","unknown":true}`)
	s := newServer(f, Config{MaxRequestBytes: 1 << 16, Python: "sh"})
	f.Fuzz(func(t *testing.T, body string) {
		var req api.PythonRequest
		if e := httpcall.DecodeJSON(httptest.NewRecorder(), jsonRequest(api.PathPython, body), s.cfg.MaxRequestBytes, &req); e != nil {
			checkTypedError(t, e)
			return
		}
		spec, e := s.exec.PreparePython(&req)
		if e != nil {
			checkTypedError(t, e)
			return
		}
		checkSpec(t, s, spec)
		if len(spec.Argv) != 4 || spec.Argv[3] != req.Code || spec.Argv[1] != "-u" || spec.Argv[2] != "-c" {
			t.Fatalf("argv %q does not carry the code as one argument", spec.Argv)
		}
		if spec.Timeout > s.cfg.PythonMaxTimeout {
			t.Fatalf("timeout %s above the python maximum", spec.Timeout)
		}
	})
}

// FuzzFilePath goes further than FuzzRelPath (files_test.go): an accepted
// path must also be clean and NUL-free, and the same path sent through the
// HTTP route, where os.Root resolves it, must answer with a typed error or
// success, never a panic or a 500.
func FuzzFilePath(f *testing.F) {
	for _, p := range []string{"a/b.txt", ".", "", "..", "../x", "a/../../x", "/etc/passwd", "a//b/./c/", "x\x00y", "...", "a/..", "/"} {
		f.Add(p)
	}
	ws := f.TempDir()
	s := newServer(f, Config{Workspace: ws, DefaultCwd: ws})
	f.Add(s.Workspace() + "/a/../b")
	f.Add(s.Workspace() + "/../" + path.Base(s.Workspace()) + "x")
	f.Fuzz(func(t *testing.T, p string) {
		rel, e := s.ws.RelPath(p)
		if e != nil {
			checkTypedError(t, e)
			return
		}
		if strings.IndexByte(p, 0) >= 0 {
			t.Fatalf("relPath(%q) accepted a NUL", p)
		}
		switch {
		case strings.IndexByte(rel, 0) >= 0:
			t.Fatalf("relPath(%q) = %q keeps a NUL", p, rel)
		case path.IsAbs(rel):
			t.Fatalf("relPath(%q) = %q is absolute", p, rel)
		case rel == ".." || strings.HasPrefix(rel, "../"):
			t.Fatalf("relPath(%q) = %q climbs out", p, rel)
		case path.Clean(rel) != rel:
			t.Fatalf("relPath(%q) = %q is not clean", p, rel)
		}
		rec := httptest.NewRecorder()
		req := httptest.NewRequest(http.MethodGet, api.PathStat, nil)
		req.URL.Path = api.PathStat + p
		s.ServeHTTP(rec, req)
		if rec.Code >= 500 {
			t.Fatalf("stat %q: status %d: %s", p, rec.Code, rec.Body)
		}
	})
}

func jsonRequest(target, body string) *http.Request {
	r := httptest.NewRequest(http.MethodPost, target, strings.NewReader(body))
	r.Header.Set("Content-Type", "application/json")
	return r
}

func checkTypedError(t *testing.T, e *api.Error) {
	t.Helper()
	if e.Code == "" || e.Code == api.CodeInternal || e.Status < 400 || e.Status > 599 {
		t.Fatalf("untyped or internal error for client input: %+v", e)
	}
}

func checkSpec(t *testing.T, s *Server, spec *runner.Spec) {
	t.Helper()
	if len(spec.Argv) == 0 || spec.Path == "" || spec.Dir == "" {
		t.Fatalf("incomplete spec %+v", spec)
	}
	for _, a := range append(append([]string{}, spec.Argv...), spec.Env...) {
		if strings.IndexByte(a, 0) >= 0 {
			t.Fatalf("NUL reached the process: %q", a)
		}
	}
	for _, kv := range spec.Env {
		if k, _, ok := strings.Cut(kv, "="); !ok || k == "" {
			t.Fatalf("malformed environment entry %q", kv)
		}
	}
	if spec.Timeout <= 0 || spec.Timeout > s.cfg.MaxTimeout || spec.MaxOutput <= 0 || spec.MaxOutput > s.cfg.MaxOutputBytesLimit {
		t.Fatalf("limits out of range: timeout %s, output %d", spec.Timeout, spec.MaxOutput)
	}
}
