package supervisorapi_test

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor"
	api "github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"
)

func newClient(t *testing.T) *api.Client {
	t.Helper()
	s, err := supervisor.New(supervisor.Config{
		DefaultCwd: t.TempDir(),
		Version:    "v1.2.3",
		Logger:     slog.New(slog.NewTextHandler(io.Discard, nil)),
	})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(s)
	t.Cleanup(srv.Close)
	return api.NewClient(srv.URL+"/", srv.Client())
}

func TestClientRunCommand(t *testing.T) {
	c := newClient(t)
	ctx := context.Background()
	h, err := c.Health(ctx)
	if err != nil || h.Status != "ok" || h.Version != "v1.2.3" {
		t.Fatalf("Health = %+v, %v", h, err)
	}
	res, err := c.RunCommand(ctx, api.CommandRequest{Command: []string{"sh", "-c", "cat; echo oops >&2; exit 4"}, Stdin: "in"})
	if err != nil {
		t.Fatal(err)
	}
	if res.Stdout != "in" || res.Stderr != "oops\n" || res.ExitCode != 4 {
		t.Fatalf("unexpected result %+v", res)
	}
	res, err = c.RunCommand(ctx, api.CommandRequest{Command: []string{"sleep", "5"}, TimeoutSeconds: 1})
	if err != nil || !res.TimedOut || res.Signal != "SIGKILL" {
		t.Fatalf("timeout: %+v, %v; a timeout is a result, not an error", res, err)
	}
}

func TestClientTypedErrors(t *testing.T) {
	c := newClient(t)
	ctx := context.Background()
	_, err := c.RunCommand(ctx, api.CommandRequest{Command: []string{"agentbox-no-such-program"}})
	var e *api.Error
	if !errors.As(err, &e) {
		t.Fatalf("error %v (%T) is not a *supervisorapi.Error", err, err)
	}
	if e.Code != api.CodeNotFound || e.Status != http.StatusNotFound || !strings.Contains(e.Message, "agentbox-no-such-program") {
		t.Fatalf("unexpected error %+v", e)
	}
	if !errors.Is(err, &api.Error{Code: api.CodeNotFound}) || errors.Is(err, &api.Error{Code: api.CodeInternal}) {
		t.Fatal("errors.Is does not match by code")
	}
	if api.CodeOf(err) != api.CodeNotFound {
		t.Fatalf("CodeOf = %q", api.CodeOf(err))
	}

	_, err = c.RunCommand(ctx, api.CommandRequest{})
	if api.CodeOf(err) != api.CodeInvalidArgument {
		t.Fatalf("empty command: %v, want invalid_argument", err)
	}

	cctx, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
	defer cancel()
	_, err = c.RunCommand(cctx, api.CommandRequest{Command: []string{"sleep", "5"}})
	if !errors.Is(err, context.DeadlineExceeded) || api.CodeOf(err) != "" {
		t.Fatalf("cancelled call: %v, want the context's error and no API code", err)
	}
}

// Something between the client and the supervisor may answer with a body
// that is not ours; the client still reports a typed error.
func TestClientForeignErrorBody(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		http.Error(w, "upstream connect error", http.StatusBadGateway)
	}))
	defer srv.Close()
	_, err := api.NewClient(srv.URL, srv.Client()).Health(context.Background())
	var e *api.Error
	if !errors.As(err, &e) || e.Code != api.CodeUnknown || e.Status != http.StatusBadGateway || e.Message != "upstream connect error" {
		t.Fatalf("got %#v", err)
	}
}

func TestCodeHTTPStatus(t *testing.T) {
	for code, status := range map[api.Code]int{
		api.CodeInvalidArgument: 400, api.CodePermissionDenied: 403, api.CodeNotFound: 404,
		api.CodeMethodNotAllowed: 405, api.CodePayloadTooLarge: 413, api.CodeResourceExhausted: 429,
		api.CodeInternal: 500, api.CodeUnavailable: 503, api.CodeTimeout: 504,
		api.CodePathEscapesWorkspace: 403, api.CodeIsADirectory: 409, api.CodeNotADirectory: 409,
		api.CodeWorkspaceFull: 507,
	} {
		if got := code.HTTPStatus(); got != status {
			t.Errorf("%s.HTTPStatus() = %d, want %d", code, got, status)
		}
	}
	if got := api.FilePath(api.PathFiles, "a dir/x?y#z%/../b"); got != "/v1/files/a%20dir/x%3Fy%23z%25/../b" {
		t.Errorf("FilePath = %s", got)
	}
	for in, want := range map[string]int{"0644": 0o644, "755": 0o755, "0": 0} {
		if got, err := api.ParseMode(in); err != nil || int(got) != want {
			t.Errorf("ParseMode(%q) = %o, %v", in, got, err)
		}
	}
	for _, in := range []string{"", "0x1ff", "4755", "999", "-1"} {
		if _, err := api.ParseMode(in); err == nil {
			t.Errorf("ParseMode(%q) accepted", in)
		}
	}
	if got := api.PodURL("fd00::7"); got != "https://[fd00::7]:8443" {
		t.Errorf("PodURL = %s", got)
	}
}

func TestClientFlush(t *testing.T) {
	ctx := context.Background()
	s, err := supervisor.New(supervisor.Config{
		Workspace: t.TempDir(),
		Logger:    slog.New(slog.NewTextHandler(io.Discard, nil)),
	})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(s)
	t.Cleanup(srv.Close)
	if err := api.NewClient(srv.URL, srv.Client()).Flush(ctx); err != nil {
		t.Fatalf("Flush with a workspace: %v", err)
	}
	// Without a workspace there is nothing to flush, and saying so beats
	// a silent success the controller would take for a durable volume.
	err = newClient(t).Flush(ctx)
	if api.CodeOf(err) != api.CodeNotFound {
		t.Fatalf("Flush without a workspace = %v, want code %s", err, api.CodeNotFound)
	}
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, srv.URL+api.PathFlush, nil)
	resp, err := srv.Client().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusMethodNotAllowed {
		t.Fatalf("GET %s = %d, want 405", api.PathFlush, resp.StatusCode)
	}
}

func TestClientRunPython(t *testing.T) {
	python, err := exec.LookPath("python3")
	if err != nil {
		t.Skip("python3 is not installed on this host; python_exec cannot be tested")
	}
	out, err := exec.Command(python, "-c", "import sys; print(sys.executable)").Output()
	if err != nil {
		t.Skipf("python3 at %s does not run: %v", python, err)
	}
	s, err := supervisor.New(supervisor.Config{
		DefaultCwd: t.TempDir(),
		Python:     strings.TrimSpace(string(out)),
		Logger:     slog.New(slog.NewTextHandler(io.Discard, nil)),
	})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(s)
	t.Cleanup(srv.Close)
	c := api.NewClient(srv.URL, srv.Client())
	ctx := context.Background()
	res, err := c.RunPython(ctx, api.PythonRequest{Code: "import sys; print(sys.stdin.read()[::-1]); sys.exit(2)", Stdin: "abc"})
	if err != nil || res.Stdout != "cba\n" || res.ExitCode != 2 {
		t.Fatalf("RunPython = %+v, %v", res, err)
	}
	_, err = c.RunPython(ctx, api.PythonRequest{Code: "pass", TimeoutSeconds: api.MaxPythonTimeoutSeconds + 1})
	if api.CodeOf(err) != api.CodeInvalidArgument {
		t.Fatalf("timeout above the maximum: %v, want invalid_argument", err)
	}
}

// A body wrapped in Sized goes out with its Content-Length instead of
// chunked, so the supervisor can check the count; a body that falls short
// of it changes nothing.
func TestClientPutFileSized(t *testing.T) {
	ws := t.TempDir()
	s, err := supervisor.New(supervisor.Config{Workspace: ws, DefaultCwd: ws, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	var lengths []int64
	var chunked []bool
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method == http.MethodPut {
			lengths = append(lengths, r.ContentLength)
			chunked = append(chunked, len(r.TransferEncoding) > 0)
		}
		s.ServeHTTP(w, r)
	}))
	defer srv.Close()
	c := api.NewClient(srv.URL, srv.Client())
	ctx := context.Background()
	// A reader http cannot take the length of.
	body := func(s string) io.Reader { return io.MultiReader(strings.NewReader(s)) }

	if _, err := c.PutFile(ctx, "a.txt", api.Sized(body("hello"), 5), 0); err != nil {
		t.Fatal(err)
	}
	if _, err := c.PutFile(ctx, "b.txt", body("plain"), 0); err != nil {
		t.Fatal(err)
	}
	if _, err := c.PutFile(ctx, "a.txt", api.Sized(body("abc"), 5), 0); err == nil {
		t.Error("a body shorter than its declared size was accepted")
	}
	if got, err := os.ReadFile(filepath.Join(ws, "a.txt")); err != nil || string(got) != "hello" {
		t.Errorf("a.txt after the short write: %q, %v", got, err)
	}
	if len(lengths) < 2 || lengths[0] != 5 || chunked[0] || lengths[1] != -1 || !chunked[1] {
		t.Errorf("Content-Length seen %v, chunked %v; want 5 then -1 (chunked)", lengths, chunked)
	}
}
