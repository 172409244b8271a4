package client

import (
	"context"
	"encoding/json"
	"encoding/pem"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"
)

func newTLSServer(t *testing.T, h http.HandlerFunc) (*httptest.Server, []byte) {
	t.Helper()
	srv := httptest.NewTLSServer(h)
	t.Cleanup(srv.Close)
	return srv, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: srv.Certificate().Raw})
}

func TestRunCommand(t *testing.T) {
	srv, caPEM := newTLSServer(t, func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodPost || r.Header.Get("Authorization") != "Bearer tok" ||
			r.Header.Get("Content-Type") != "application/json" {
			t.Errorf("request %s %s, headers %v", r.Method, r.URL, r.Header)
		}
		// The agent ID arrives escaped and decodes to itself.
		if r.URL.EscapedPath() != "/prefix/v1/agents/user@example.com:1%2Fx/run_command" || r.URL.Path != "/prefix/v1/agents/user@example.com:1/x/run_command" {
			t.Errorf("path %q (escaped %q)", r.URL.Path, r.URL.EscapedPath())
		}
		var req RunCommandRequest
		if err := json.NewDecoder(r.Body).Decode(&req); err != nil {
			t.Error(err)
		}
		_ = json.NewEncoder(w).Encode(CommandResult{Stdout: strings.Join(req.Command, " "), ExitCode: 2, DurationMS: 5})
	})
	c, err := New(srv.URL+"/prefix/", "tok", caPEM)
	if err != nil {
		t.Fatal(err)
	}
	res, err := c.RunCommand(context.Background(), "user@example.com:1/x", RunCommandRequest{Command: []string{"ls", "-l"}})
	if err != nil {
		t.Fatal(err)
	}
	if res.Stdout != "ls -l" || res.ExitCode != 2 || res.DurationMS != 5 {
		t.Errorf("result %+v", res)
	}
}

func TestErrors(t *testing.T) {
	srv, caPEM := newTLSServer(t, func(w http.ResponseWriter, r *http.Request) {
		switch {
		case strings.Contains(r.URL.Path, "/typed/"):
			w.WriteHeader(http.StatusConflict)
			_, _ = w.Write([]byte(`{"error":{"code":"sandbox_not_ready","message":"phase Pending","details":{"phase":"Pending"}}}`))
		case strings.Contains(r.URL.Path, "/html/"):
			w.WriteHeader(http.StatusBadGateway)
			_, _ = w.Write([]byte("<html>bad gateway</html>"))
		case strings.Contains(r.URL.Path, "/slow/"):
			// HTTP/1.1 servers notice a client going away only once the
			// body has been read.
			_, _ = io.Copy(io.Discard, r.Body)
			<-r.Context().Done()
		}
	})
	c, err := New(srv.URL, "tok", caPEM)
	if err != nil {
		t.Fatal(err)
	}
	_, err = c.RunCommand(context.Background(), "typed", RunCommandRequest{Command: []string{"x"}})
	var e *Error
	if !errors.As(err, &e) || e.Code != CodeSandboxNotReady || e.Status != 409 || e.Details["phase"] != "Pending" {
		t.Errorf("typed error: %#v", err)
	}
	if !errors.Is(err, &Error{Code: CodeSandboxNotReady}) || CodeOf(err) != CodeSandboxNotReady {
		t.Errorf("errors.Is/CodeOf do not match the code: %v", err)
	}

	_, err = c.RunCommand(context.Background(), "html", RunCommandRequest{Command: []string{"x"}})
	if !errors.As(err, &e) || e.Code != CodeUnknown || e.Status != 502 || !strings.Contains(e.Message, "bad gateway") {
		t.Errorf("untyped error: %#v", err)
	}

	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	_, err = c.RunCommand(ctx, "slow", RunCommandRequest{Command: []string{"x"}})
	if !errors.Is(err, context.DeadlineExceeded) || CodeOf(err) != "" {
		t.Errorf("cancelled call: %v", err)
	}
}

func TestTLSIsVerified(t *testing.T) {
	srv, _ := newTLSServer(t, func(http.ResponseWriter, *http.Request) {})
	// Without the CA the system roots are used, which do not trust the
	// test server's certificate.
	c, err := New(srv.URL, "tok", nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.RunCommand(context.Background(), "a", RunCommandRequest{Command: []string{"x"}}); err == nil || CodeOf(err) != "" {
		t.Errorf("call to an untrusted server: %v", err)
	}
}

func TestNewValidates(t *testing.T) {
	for _, tc := range []struct{ endpoint, token, ca string }{
		{"ftp://x", "t", ""},
		{"https://", "t", ""},
		{"https://x?y=1", "t", ""},
		{"https://x", "", ""},
		{"https://x", "t", "not a PEM"},
	} {
		if _, err := New(tc.endpoint, tc.token, []byte(tc.ca)); err == nil {
			t.Errorf("New(%q, %q, %q) succeeded", tc.endpoint, tc.token, tc.ca)
		}
	}
}

func TestCodeStatuses(t *testing.T) {
	for code, status := range map[Code]int{
		CodeInvalidArgument: 400, CodeUnauthenticated: 401, CodePermissionDenied: 403,
		CodeSandboxNotFound: 404, CodeSandboxNotReady: 409, CodeTimeout: 504,
		CodeSupervisorUnavailable: 502, CodeInternal: 500,
	} {
		if got := code.HTTPStatus(); got != status {
			t.Errorf("%s: status %d, want %d", code, got, status)
		}
	}
}

// The client presents a lease ID on the calls to its agent's sandbox only,
// whatever the path looks like (escaped, behind a prefix, through the MCP
// transport), and stops once the lease is released.
func TestLeasePresented(t *testing.T) {
	seen := map[string]string{}
	srv, caPEM := newTLSServer(t, func(w http.ResponseWriter, r *http.Request) {
		seen[r.URL.EscapedPath()] = r.Header.Get(HeaderLeaseID)
		switch {
		case strings.HasSuffix(r.URL.Path, "/lease") && r.Method == http.MethodPost:
			_ = json.NewEncoder(w).Encode(Lease{LeaseID: "lease-1", Holder: "h"})
		case strings.HasSuffix(r.URL.Path, "/lease"):
			w.WriteHeader(http.StatusNoContent)
		default:
			_ = json.NewEncoder(w).Encode(CommandResult{})
		}
	})
	c, err := New(srv.URL+"/prefix", "tok", caPEM)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	agent := "user@example.com:1/x"
	if _, err := c.AcquireLease(ctx, agent, AcquireLeaseRequest{Holder: "h", RequestID: "r"}); err != nil {
		t.Fatal(err)
	}
	if _, err := c.RunCommand(ctx, agent, RunCommandRequest{Command: []string{"true"}}); err != nil {
		t.Fatal(err)
	}
	if _, err := c.RunCommand(ctx, "other", RunCommandRequest{Command: []string{"true"}}); err != nil {
		t.Fatal(err)
	}
	resp, err := c.MCPHTTPClient().Post(c.Endpoint()+PathMCP(agent), "application/json", strings.NewReader("{}"))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	escaped := "/prefix/v1/agents/user@example.com:1%2Fx"
	for path, want := range map[string]string{
		escaped + "/run_command": "lease-1", escaped + "/mcp": "lease-1", "/prefix/v1/agents/other/run_command": "",
	} {
		if got, ok := seen[path]; !ok || got != want {
			t.Errorf("%s presented lease %q (sent: %v), want %q", path, got, ok, want)
		}
	}
	if err := c.ReleaseLease(ctx, agent, ReleaseLeaseRequest{Holder: "h", LeaseID: "lease-1"}); err != nil {
		t.Fatal(err)
	}
	if _, err := c.RunCommand(ctx, agent, RunCommandRequest{Command: []string{"true"}}); err != nil {
		t.Fatal(err)
	}
	if got := seen[escaped+"/run_command"]; got != "" {
		t.Errorf("after the release the client still presents %q", got)
	}
	c.UseLease(agent, "handed-on")
	if _, err := c.RunCommand(ctx, agent, RunCommandRequest{Command: []string{"true"}}); err != nil {
		t.Fatal(err)
	}
	if got := seen[escaped+"/run_command"]; got != "handed-on" {
		t.Errorf("UseLease: presented %q", got)
	}
}
