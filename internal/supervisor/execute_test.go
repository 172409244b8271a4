package supervisor

import (
	"bytes"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/pyenv"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/pyenv/pyenvtest"
	api "github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"
)

func postExecute(t testing.TB, h http.Handler, body any) (int, *api.ExecuteResult, *api.Error) {
	t.Helper()
	raw, ok := body.(string)
	if !ok {
		b, err := json.Marshal(body)
		if err != nil {
			t.Fatal(err)
		}
		raw = string(b)
	}
	req := httptest.NewRequest(http.MethodPost, api.PathExecute, strings.NewReader(raw))
	req.Header.Set("Content-Type", "application/json")
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, req)
	if rec.Code != http.StatusOK {
		var eb api.ErrorBody
		if err := json.Unmarshal(rec.Body.Bytes(), &eb); err != nil || eb.Error == nil {
			t.Fatalf("status %d with a body that is not an error: %q", rec.Code, rec.Body)
		}
		return rec.Code, nil, eb.Error
	}
	var res api.ExecuteResult
	if err := json.Unmarshal(rec.Body.Bytes(), &res); err != nil {
		t.Fatalf("decode: %v (%q)", err, rec.Body)
	}
	return rec.Code, &res, nil
}

// allBytes is every byte value, twice, so that a round trip that is not
// binary-safe shows.
func allBytes() []byte {
	b := make([]byte, 512)
	for i := range b {
		b[i] = byte(i)
	}
	return b
}

// The sandbox's own python3, no environment: inline files in, produced
// files out, binary-safe, and the run's directory gone afterwards.
func TestExecuteFilesWithoutEnvironment(t *testing.T) {
	runs := t.TempDir()
	s := newServer(t, Config{Python: pythonInterpreter(t), Execute: ExecuteConfig{RunDir: runs}})
	bin := allBytes()
	_, res, e := postExecute(t, s, api.ExecuteRequest{
		ToolName: api.ToolPythonExecute,
		Code: `import os
data = open('in/data.bin', 'rb').read()
open('out.bin', 'wb').write(data[::-1])
os.makedirs('deep/er', exist_ok=True)
open('deep/er/note.txt', 'w').write('new')
open('changed.txt', 'a').write(' and more')
os.symlink('/etc/passwd', 'link')
print(os.getcwd().startswith(os.environ['RUNS']), len(data))`,
		Env:   map[string]string{"RUNS": runs},
		Files: map[string][]byte{"in/data.bin": bin, "changed.txt": []byte("before"), "same.txt": []byte("unchanged")},
	})
	if e != nil {
		t.Fatal(e)
	}
	if res.Status != api.ExecuteSuccess || res.ExitCode != 0 || res.Output != "True 512\n" || res.Env != nil {
		t.Fatalf("result %+v", res)
	}
	want := map[string][]byte{"out.bin": reversed(bin), "deep/er/note.txt": []byte("new"), "changed.txt": []byte("before and more")}
	if len(res.FilesProduced) != len(want) {
		t.Errorf("files produced: %v, want %v", keys(res.FilesProduced), keys(want))
	}
	for k, v := range want {
		if !bytes.Equal(res.FilesProduced[k], v) {
			t.Errorf("%s = %q, want %q", k, res.FilesProduced[k], v)
		}
	}
	if len(res.FilesOmitted) != 1 || res.FilesOmitted[0].Path != "link" || res.FilesOmitted[0].Reason != "not_regular" {
		t.Errorf("omitted %+v, want the symlink", res.FilesOmitted)
	}
	if left, _ := os.ReadDir(runs); len(left) != 0 {
		t.Errorf("run directories left behind: %v", left)
	}

	_, res, e = postExecute(t, s, api.ExecuteRequest{Code: "import sys; print('oops', file=sys.stderr); sys.exit(3)"})
	if e != nil || res.Status != api.ExecuteError || res.ExitCode != 3 || res.Stderr != "oops\n" || len(res.FilesProduced) != 0 {
		t.Fatalf("failing run: %+v, %v", res, e)
	}
	if res.FilesProduced == nil {
		t.Error("files_produced is null; the contract has an object")
	}
}

func reversed(b []byte) []byte {
	out := make([]byte, len(b))
	for i, c := range b {
		out[len(b)-1-i] = c
	}
	return out
}

func keys(m map[string][]byte) []string {
	var out []string
	for k := range m {
		out = append(out, k)
	}
	return out
}

// Produced files past the caps are listed, not returned, in path order.
func TestExecuteFileCaps(t *testing.T) {
	s := newServer(t, Config{Python: pythonInterpreter(t), Execute: ExecuteConfig{RunDir: t.TempDir(), MaxFileBytes: 1000, MaxFilesBytes: 1000}})
	_, res, e := postExecute(t, s, api.ExecuteRequest{Code: `
for name, size in [('a', 600), ('b', 1001), ('c', 600), ('d', 300)]:
    open(name, 'wb').write(b'x' * size)`})
	if e != nil {
		t.Fatal(e)
	}
	if len(res.FilesProduced) != 2 || len(res.FilesProduced["a"]) != 600 || len(res.FilesProduced["d"]) != 300 {
		t.Errorf("produced %v", keys(res.FilesProduced))
	}
	want := []api.OmittedFile{{Path: "b", SizeBytes: 1001, Reason: "file_too_large"}, {Path: "c", SizeBytes: 600, Reason: "total_too_large"}}
	if len(res.FilesOmitted) != 2 || res.FilesOmitted[0] != want[0] || res.FilesOmitted[1] != want[1] {
		t.Errorf("omitted %+v, want %+v", res.FilesOmitted, want)
	}
}

func TestExecuteInvalidRequests(t *testing.T) {
	s := newServer(t, Config{Python: pythonInterpreter(t), Execute: ExecuteConfig{RunDir: t.TempDir()}})
	for name, tc := range map[string]struct {
		body any
		code api.Code
	}{
		"other tool":          {api.ExecuteRequest{ToolName: "web_search", Code: "pass"}, api.CodeInvalidArgument},
		"empty code":          {api.ExecuteRequest{Code: "  "}, api.CodeInvalidArgument},
		"timeout over max":    {api.ExecuteRequest{Code: "pass", TimeoutSeconds: api.MaxPythonTimeoutSeconds + 1}, api.CodeInvalidArgument},
		"dotdot file":         {api.ExecuteRequest{Code: "pass", Files: map[string][]byte{"../x": nil}}, api.CodePathEscapesWorkspace},
		"absolute file":       {api.ExecuteRequest{Code: "pass", Files: map[string][]byte{"/etc/x": nil}}, api.CodePathEscapesWorkspace},
		"unclean file":        {api.ExecuteRequest{Code: "pass", Files: map[string][]byte{"a/./b": nil}}, api.CodeInvalidArgument},
		"empty file name":     {api.ExecuteRequest{Code: "pass", Files: map[string][]byte{"": nil}}, api.CodeInvalidArgument},
		"NUL in file name":    {api.ExecuteRequest{Code: "pass", Files: map[string][]byte{"a\x00": nil}}, api.CodeInvalidArgument},
		"file under a file":   {api.ExecuteRequest{Code: "pass", Files: map[string][]byte{"a": nil, "a/b": nil}}, api.CodeInvalidArgument},
		"URL requirement":     {api.ExecuteRequest{Code: "pass", Requirements: []string{"x @ https://example.invalid/x.whl"}}, api.CodeInvalidArgument},
		"option requirement":  {api.ExecuteRequest{Code: "pass", Requirements: []string{"--index-url=http://127.0.0.1:1/"}}, api.CodeInvalidArgument},
		"bad env name":        {api.ExecuteRequest{Code: "pass", EnvName: "../x"}, api.CodeInvalidArgument},
		"not base64":          {`{"code":"pass","files":{"a":"***"}}`, api.CodeInvalidArgument},
		"no cache configured": {api.ExecuteRequest{Code: "pass", Requirements: []string{"numpy"}}, api.CodeUnavailable},
	} {
		_, _, e := postExecute(t, s, tc.body)
		if e == nil || e.Code != tc.code {
			t.Errorf("%s: %v, want %s", name, e, tc.code)
		}
	}
	rec := httptest.NewRecorder()
	s.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, api.PathExecute, nil))
	if rec.Code != http.StatusMethodNotAllowed {
		t.Errorf("GET %s: %d", api.PathExecute, rec.Code)
	}
	rec = httptest.NewRecorder()
	s.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, api.PathEnvs, nil))
	if rec.Code != http.StatusServiceUnavailable {
		t.Errorf("GET %s without a cache: %d %s", api.PathEnvs, rec.Code, rec.Body)
	}
}

// /health is the short name of /healthz; both report load while a
// command runs.
func TestHealthStateAndLoad(t *testing.T) {
	s := newServer(t, Config{MaxConcurrentCommands: 3, Version: "v"})
	get := func(p string) api.Health {
		rec := httptest.NewRecorder()
		s.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, p, nil))
		var h api.Health
		if err := json.Unmarshal(rec.Body.Bytes(), &h); err != nil || rec.Code != http.StatusOK {
			t.Fatalf("%s: %d %s", p, rec.Code, rec.Body)
		}
		return h
	}
	for _, p := range []string{api.PathHealth, api.PathHealthShort} {
		h := get(p)
		if h.Status != "ok" || h.Version != "v" || h.State != api.StateIdle || h.Capacity != 3 || h.CurrentLoad != 0 || h.Environments != nil || h.EnvCache != nil {
			t.Errorf("%s idle: %+v", p, h)
		}
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		mustRun(t, s, api.CommandRequest{Command: []string{"sleep", "1"}})
	}()
	var busy api.Health
	for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		if busy = get(api.PathHealthShort); busy.CurrentLoad == 1 {
			break
		}
	}
	<-done
	if busy.State != api.StateBusy || busy.CurrentLoad != 1 {
		t.Errorf("while a command runs: %+v", busy)
	}
	if h := get(api.PathHealth); h.State != api.StateIdle || h.UptimeSeconds < 1 {
		t.Errorf("after: %+v", h)
	}
}

func TestExecuteRunDirDefault(t *testing.T) {
	s := newServer(t, Config{})
	if want := filepath.Join(os.TempDir(), "agentbox-runs"); s.exec.RunDir() != want {
		t.Errorf("run dir %q, want %q", s.exec.RunDir(), want)
	}
}

// In process, for the race detector: builds go through the server's spawn
// path, the run holds its environment, and health reports it.
func TestExecuteInEnvironment(t *testing.T) {
	py := pythonInterpreter(t)
	if exec.Command(py, "-c", "import venv").Run() != nil {
		t.Skip("python3 has no venv module (on Debian: apt-get install python3-venv)")
	}
	ix := pyenvtest.NewIndex(t, pyenvtest.Package{Name: "agentbox-greet", Version: "1.0", Files: map[string][]byte{
		"agentbox_greet.py": []byte("def hello(who):\n    return 'hello ' + who\n"),
	}})
	s := newServer(t, Config{Python: py, PassEnv: []string{}, Execute: ExecuteConfig{
		RunDir: t.TempDir(),
		Envs:   &pyenv.Config{Dir: t.TempDir(), IndexURL: ix.URL},
	}})
	t.Cleanup(func() { s.Close() })
	req := api.ExecuteRequest{Requirements: []string{"agentbox-greet"}, Code: "import agentbox_greet, os, sys\nprint(agentbox_greet.hello('x'), os.environ['PATH'].split(':')[0] == os.path.join(sys.prefix, 'bin'))"}
	for i, wantCreated := range []bool{true, false} {
		_, res, e := postExecute(t, s, req)
		if e != nil {
			t.Fatal(e)
		}
		if res.Output != "hello x True\n" || res.Env == nil || res.Env.Created != wantCreated {
			t.Fatalf("run %d: %+v (stderr %q)", i, res, res.Stderr)
		}
	}
	rec := httptest.NewRecorder()
	s.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, api.PathHealthShort, nil))
	var h api.Health
	if err := json.Unmarshal(rec.Body.Bytes(), &h); err != nil || len(h.Environments) != 1 || h.Environments[0].InUse != 0 ||
		h.EnvCache.Installer != "pip" || h.EnvCache.Count != 1 {
		t.Fatalf("health: %s", rec.Body)
	}
}
