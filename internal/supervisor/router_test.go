package supervisor

import (
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	api "github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"
)

// TestRouteRefusals checks what the route table answers a method a path
// does not take, or a path nobody serves: the status, the Allow header,
// and the operation the call is recorded as.
func TestRouteRefusals(t *testing.T) {
	s := newServer(t, Config{Workspace: t.TempDir()})
	for _, c := range []struct {
		method, path string
		status       int
		allow, op    string
	}{
		{http.MethodGet, api.PathCommands, http.StatusMethodNotAllowed, "POST", "run_command"},
		{http.MethodGet, api.PathCommandsStream, http.StatusMethodNotAllowed, "POST", "run_command_stream"},
		{http.MethodPut, api.PathProcesses, http.StatusMethodNotAllowed, "GET, HEAD, POST", "list_processes"},
		{http.MethodPatch, api.PathProcesses + "/p-1", http.StatusMethodNotAllowed, "GET, HEAD, DELETE", "get_process"},
		{http.MethodPut, api.PathEnvs, http.StatusMethodNotAllowed, "GET, HEAD, POST", "list_envs"},
		{http.MethodPost, api.PathTools, http.StatusMethodNotAllowed, "GET, HEAD", "list_tools"},
		{http.MethodPost, api.PathManifest + "x", http.StatusMethodNotAllowed, "GET, HEAD", "file_manifest"},
		{http.MethodPost, api.PathPTY, http.StatusMethodNotAllowed, "GET", "pty_session"},
		{http.MethodGet, api.PathFlush, http.StatusMethodNotAllowed, "POST", "flush"},
		{http.MethodPatch, api.PathFiles + "a", http.StatusMethodNotAllowed, "GET, HEAD, PUT, DELETE", "unknown"},
		{http.MethodPost, api.PathStat + "a", http.StatusMethodNotAllowed, "GET, HEAD", "stat_file"},
		{http.MethodGet, "/mcp", http.StatusNotFound, "", "mcp_status"},
		{http.MethodGet, "/nope", http.StatusNotFound, "", "unknown"},
	} {
		rec := httptest.NewRecorder()
		s.ServeHTTP(rec, httptest.NewRequest(c.method, c.path, strings.NewReader("{}")))
		if rec.Code != c.status || rec.Header().Get("Allow") != c.allow {
			t.Errorf("%s %s: %d, Allow %q; want %d, %q", c.method, c.path, rec.Code, rec.Header().Get("Allow"), c.status, c.allow)
		}
		e, _, err := api.DecodeAuditRecord(rec.Header().Get(api.HeaderAudit))
		if err != nil || e.Tool != c.op {
			t.Errorf("%s %s: recorded as %q (%v), want %q", c.method, c.path, e.Tool, err, c.op)
		}
	}
	// Health checks are refused alike, and never recorded.
	rec := httptest.NewRecorder()
	s.ServeHTTP(rec, httptest.NewRequest(http.MethodPost, api.PathHealth, nil))
	if rec.Code != http.StatusMethodNotAllowed || rec.Header().Get("Allow") != "GET, HEAD" || rec.Header().Get(api.HeaderAudit) != "" {
		t.Errorf("POST %s: %d, Allow %q, record %q", api.PathHealth, rec.Code, rec.Header().Get("Allow"), rec.Header().Get(api.HeaderAudit))
	}
}
