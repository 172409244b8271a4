package execute

import (
	"io/fs"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/httpcall"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/pyenv"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/runner"
	api "github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"
)

// FuzzDecodeExecute feeds arbitrary bodies to the /v1/execute decoder and
// the checks after it. Nothing may panic; a request that passes must have
// requirements no installer reads as an option, and inline files that,
// once written, all lie inside the run's directory.
func FuzzDecodeExecute(f *testing.F) {
	f.Add(`{"tool_name":"python_execute","code":"print(1)","requirements":["pandas>=2.0","numpy"],"env_name":"data-analysis","timeout_seconds":30,"files":{"data.csv":"YSxiCjEsMgo="},"python_index":"https://pypi.org/simple/"}`)
	f.Add(`{"code":"pass","files":{"../x":""}}`)
	f.Add(`{"code":"pass","files":{"a":"","a/b":""}}`)
	f.Add(`{"code":"pass","requirements":["-r /etc/passwd"]}`)
	f.Add(`{"code":"pass","requirements":["x @ file:///etc"]}`)
	f.Add(`{"code":"pass","env_name":".installer"}`)
	f.Add(`{"code":"pass","files":{"a":"not base64!"}}`)
	f.Add(`{"code":"pass","tool_name":"other"}`)
	rn := runner.New(runner.Config{
		BaseEnv: map[string]string{"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}, DefaultCwd: f.TempDir(),
		DefaultMaxOutputBytes: api.DefaultMaxOutputBytes, MaxOutputBytesLimit: api.DefaultMaxOutputBytes,
		WaitDelay: time.Second, Log: slog.New(slog.DiscardHandler),
	})
	s := New(Config{RunDir: f.TempDir()}, Options{
		Runner: rn, Python: "sh", DefaultTimeout: 30 * time.Second, MaxTimeout: 120 * time.Second,
		MaxRequestBytes: 1 << 16, Log: slog.New(slog.DiscardHandler),
	})
	f.Fuzz(func(t *testing.T, body string) {
		var req api.ExecuteRequest
		if e := httpcall.DecodeJSON(httptest.NewRecorder(), jsonRequest(api.PathExecute, body), s.opts.MaxRequestBytes, &req); e != nil {
			checkTypedError(t, e)
			return
		}
		if e := s.checkExecute(&req); e != nil {
			checkTypedError(t, e)
			return
		}
		reqs, err := pyenv.ParseRequirements(req.Requirements)
		if err != nil {
			t.Fatalf("requirements %q passed the check but do not parse: %v", req.Requirements, err)
		}
		for _, r := range reqs {
			if strings.HasPrefix(r.String, "-") || strings.ContainsAny(r.String, "@/\\\n\x00") {
				t.Fatalf("requirement %q could reach the installer as something other than a name", r.String)
			}
		}
		dir, root, e := s.newRun(req.Files)
		if root != nil {
			defer root.Close()
		}
		if dir == "" {
			t.Fatalf("no run directory: %v", e)
		}
		defer os.RemoveAll(dir)
		if e != nil {
			checkTypedError(t, e)
			return
		}
		n := 0
		err = filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
			if err != nil {
				return err
			}
			if rel, err := filepath.Rel(dir, p); err != nil || !filepath.IsLocal(rel) && rel != "." {
				t.Fatalf("%s is outside the run directory %s", p, dir)
			}
			if d.Type().IsRegular() {
				n++
			}
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
		if n != len(req.Files) {
			t.Fatalf("%d files written for %d sent", n, len(req.Files))
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
