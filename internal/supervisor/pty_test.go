package supervisor

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/coder/websocket"

	api "github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"
)

// ptyServer is a supervisor on a real listener, with an audit log.
func ptyServer(t *testing.T, cfg Config) (*Server, *api.Client, string, string) {
	t.Helper()
	auditPath := filepath.Join(t.TempDir(), "audit.jsonl")
	audit, err := OpenAuditLog(auditPath)
	if err != nil {
		t.Fatal(err)
	}
	cfg.Audit = audit
	s := newServer(t, cfg)
	srv := httptest.NewServer(s)
	t.Cleanup(func() {
		srv.Close()
		audit.Close()
	})
	return s, api.NewClient(srv.URL, srv.Client()), srv.URL, auditPath
}

// term collects a session's output as it arrives.
type term struct {
	p    *api.PTY
	mu   sync.Mutex
	buf  bytes.Buffer
	more chan struct{}
	done chan error
}

func openTerm(t *testing.T, c *api.Client, req api.PTYRequest) *term {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	p, err := c.OpenPTY(ctx, req)
	if err != nil {
		t.Fatalf("OpenPTY(%+v): %v", req, err)
	}
	tm := &term{p: p, more: make(chan struct{}, 1), done: make(chan error, 1)}
	go func() {
		b := make([]byte, 4096)
		for {
			n, err := p.Read(b)
			tm.mu.Lock()
			tm.buf.Write(b[:n])
			tm.mu.Unlock()
			select {
			case tm.more <- struct{}{}:
			default:
			}
			if err != nil {
				if err == io.EOF {
					err = nil
				}
				tm.done <- err
				return
			}
		}
	}()
	t.Cleanup(func() { p.Close() })
	return tm
}

func (tm *term) output() string {
	tm.mu.Lock()
	defer tm.mu.Unlock()
	return tm.buf.String()
}

// expect waits for the output to contain want.
func (tm *term) expect(t *testing.T, want string) string {
	t.Helper()
	deadline := time.After(10 * time.Second)
	for {
		if out := tm.output(); strings.Contains(out, want) {
			return out
		}
		select {
		case <-tm.more:
		case <-deadline:
			t.Fatalf("terminal output %q does not contain %q", tm.output(), want)
		}
	}
}

func (tm *term) send(t *testing.T, s string) {
	t.Helper()
	if _, err := tm.p.Write([]byte(s)); err != nil {
		t.Fatalf("write %q: %v", s, err)
	}
}

// wait returns the exit once the output has been read to the end.
func (tm *term) wait(t *testing.T) *api.PTYExit {
	t.Helper()
	select {
	case err := <-tm.done:
		if err != nil {
			t.Fatalf("reading the terminal: %v (output %q)", err, tm.output())
		}
	case <-time.After(20 * time.Second):
		t.Fatalf("session did not end; output %q", tm.output())
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	exit, err := tm.p.Wait(ctx)
	if err != nil {
		t.Fatalf("Wait: %v", err)
	}
	return exit
}

func TestPTYRefusals(t *testing.T) {
	_, c, base, _ := ptyServer(t, Config{})
	ctx := context.Background()
	for _, tc := range []struct {
		req  api.PTYRequest
		code api.Code
	}{
		{api.PTYRequest{Command: []string{"no-such-program-here"}}, api.CodeNotFound},
		{api.PTYRequest{Cwd: "/no/such/dir"}, api.CodeNotFound},
		{api.PTYRequest{Env: map[string]string{"A\x00": "x"}}, api.CodeInvalidArgument},
	} {
		if _, err := c.OpenPTY(ctx, tc.req); api.CodeOf(err) != tc.code {
			t.Errorf("OpenPTY(%+v) = %v, want %s", tc.req, err, tc.code)
		}
	}
	for _, q := range []string{"cols=0", "rows=70000", "cols=x", "colour=1", "env=NOEQUALS", "cwd=a&cwd=b"} {
		_, _, err := websocket.Dial(ctx, base+api.PathPTY+"?"+q, &websocket.DialOptions{Subprotocols: []string{api.PTYSubprotocol}})
		if err == nil || !strings.Contains(err.Error(), "400") {
			t.Errorf("query %q: %v, want a 400 refusal", q, err)
		}
	}
	// Not a WebSocket request, or without the subprotocol.
	resp, err := http.Get(base + api.PathPTY)
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusUpgradeRequired || !strings.Contains(string(body), `"invalid_argument"`) {
		t.Errorf("plain GET: %d %s", resp.StatusCode, body)
	}
	_, resp, err = websocket.Dial(ctx, base+api.PathPTY, nil)
	if err == nil || resp == nil || resp.StatusCode != http.StatusBadRequest {
		t.Errorf("dial without the subprotocol: %v", err)
	}
}

// TestPTYShellOfTheImage opens terminals without a command in images
// with fewer shells: with sh but no bash the session runs sh, and with no
// shell at all (a distroless image) the terminal is refused at once with
// an error that says so, rather than a session that fails to start.
func TestPTYShellOfTheImage(t *testing.T) {
	shOnly := t.TempDir()
	hostSh, err := exec.LookPath("sh")
	if err != nil {
		t.Skip("no sh on this host")
	}
	if err := os.Symlink(hostSh, filepath.Join(shOnly, "sh")); err != nil {
		t.Fatal(err)
	}
	_, c, _, _ := ptyServer(t, Config{BaseEnv: map[string]string{"PATH": shOnly, "HOME": t.TempDir()}, PassEnv: []string{}})
	tm := openTerm(t, c, api.PTYRequest{})
	tm.send(t, "echo shell=$0\n")
	tm.expect(t, "shell=sh")
	tm.send(t, "exit 3\n")
	if exit := tm.wait(t); exit.ExitCode != 3 {
		t.Errorf("exit %+v, want 3", exit)
	}

	bare := t.TempDir()
	_, c, _, _ = ptyServer(t, Config{BaseEnv: map[string]string{"PATH": bare, "HOME": t.TempDir()}, PassEnv: []string{}})
	_, err = c.OpenPTY(context.Background(), api.PTYRequest{})
	var e *api.Error
	if !errors.As(err, &e) || e.Code != api.CodeNotFound || !strings.Contains(e.Message, "neither bash nor sh is on its PATH ("+bare+")") {
		t.Errorf("a terminal in an image without a shell: %v, want not_found saying neither bash nor sh is there", err)
	}
	// A command of its own still runs there.
	p, err := c.OpenPTY(context.Background(), api.PTYRequest{Command: []string{hostSh, "-c", "exit 0"}})
	if err != nil {
		t.Fatalf("a terminal with a command in an image without a shell: %v", err)
	}
	p.Close()
}

// A session counts against the concurrent-command limit for as long as
// it lasts.
func TestPTYConcurrencyLimit(t *testing.T) {
	_, c, _, _ := ptyServer(t, Config{MaxConcurrentCommands: 1})
	tm := openTerm(t, c, api.PTYRequest{Command: []string{"sh", "-c", "read x; echo got:$x"}})
	if _, err := c.OpenPTY(context.Background(), api.PTYRequest{Command: []string{"true"}}); api.CodeOf(err) != api.CodeResourceExhausted {
		t.Fatalf("second session: %v, want resource_exhausted", err)
	}
	if _, err := c.RunCommand(context.Background(), api.CommandRequest{Command: []string{"true"}}); api.CodeOf(err) != api.CodeResourceExhausted {
		t.Fatalf("command beside the session: %v, want resource_exhausted", err)
	}
	tm.send(t, "x\r")
	tm.expect(t, "got:x")
	if exit := tm.wait(t); exit.ExitCode != 0 {
		t.Fatalf("exit %+v", exit)
	}
	// The slot is free again once the handler has returned.
	waitFor(t, "the slot to be released", func() bool {
		_, err := c.RunCommand(context.Background(), api.CommandRequest{Command: []string{"true"}})
		return err == nil
	})
}

// The idle timeout hangs a quiet session up, and says so.
func TestPTYIdleTimeout(t *testing.T) {
	s, c, _, auditPath := ptyServer(t, Config{PTYIdleTimeout: 300 * time.Millisecond, ProcessKillGrace: 2 * time.Second})
	tm := openTerm(t, c, api.PTYRequest{Command: []string{"sh", "-c", "echo ready; sleep 100"}})
	tm.expect(t, "ready")
	start := time.Now()
	exit := tm.wait(t)
	t.Logf("idle session ended %s after its last output: %+v", time.Since(start), exit)
	if exit.Reason != api.PTYReasonIdle || exit.Signal != "SIGHUP" {
		t.Fatalf("exit %+v, want an idle hangup", exit)
	}
	// The audit line is written once the handler returns.
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := s.Wait(ctx); err != nil {
		t.Fatal(err)
	}
	entries := readAuditLines(t, auditPath)
	last := entries[len(entries)-1]
	if last.Tool != "pty_session" || last.HTTPStatus != http.StatusSwitchingProtocols || !last.TimedOut || last.Signal != "SIGHUP" {
		t.Fatalf("audit line %+v", last)
	}
}

// Terminate hangs sessions up (an interactive shell ignores the SIGTERM
// it sends to process groups), and refuses new ones.
func TestPTYTerminate(t *testing.T) {
	s, c, _, _ := ptyServer(t, Config{ProcessKillGrace: 2 * time.Second})
	tm := openTerm(t, c, api.PTYRequest{Command: []string{"sh", "-i"}})
	tm.send(t, "echo $((6*7))\r")
	tm.expect(t, "42")
	if n := s.Terminate(); n != 1 {
		t.Fatalf("Terminate signalled %d groups, want 1", n)
	}
	exit := tm.wait(t)
	if exit.Reason != api.PTYReasonShutdown || exit.Signal != "SIGHUP" {
		t.Fatalf("exit %+v, want a shutdown hangup", exit)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := s.Wait(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := c.OpenPTY(ctx, api.PTYRequest{}); api.CodeOf(err) != api.CodeUnavailable {
		t.Fatalf("session after Terminate: %v, want unavailable", err)
	}
}

// A control message that is not one ends the session with a reason; the
// client sees the close, and the processes are hung up.
func TestPTYBadControlMessage(t *testing.T) {
	_, _, base, _ := ptyServer(t, Config{ProcessKillGrace: 2 * time.Second})
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	q := api.PTYRequest{Command: []string{"sh", "-c", "echo $$; exec sleep 100"}}.Query()
	conn, _, err := websocket.Dial(ctx, base+api.PathPTY+"?"+q.Encode(), &websocket.DialOptions{Subprotocols: []string{api.PTYSubprotocol}})
	if err != nil {
		t.Fatal(err)
	}
	defer conn.CloseNow()
	_, data, err := conn.Read(ctx)
	if err != nil {
		t.Fatal(err)
	}
	pid, err := strconv.Atoi(strings.TrimSpace(string(data)))
	if err != nil {
		t.Fatalf("first output %q", data)
	}
	for _, msg := range []string{`{"type":"resize","cols":0,"rows":5}`} {
		if err := conn.Write(ctx, websocket.MessageText, []byte(msg)); err != nil {
			t.Fatal(err)
		}
	}
	for {
		_, _, err = conn.Read(ctx)
		if err != nil {
			break
		}
	}
	var ce websocket.CloseError
	if !errors.As(err, &ce) || ce.Code != websocket.StatusUnsupportedData || !strings.Contains(ce.Reason, "resize") {
		t.Fatalf("read after a bad resize: %v", err)
	}
	waitGone(t, pid, 5*time.Second)
}

// A resize reaches the process as SIGWINCH, and the new size is what the
// terminal reports.
func TestPTYResize(t *testing.T) {
	_, c, _, _ := ptyServer(t, Config{})
	tm := openTerm(t, c, api.PTYRequest{Command: []string{"sh", "-c", "trap 'stty size' WINCH; stty size; echo ready; while :; do sleep 0.05; done"}, Cols: 100, Rows: 30})
	tm.expect(t, "30 100\r\n")
	tm.expect(t, "ready")
	if err := tm.p.Resize(context.Background(), 150, 50); err != nil {
		t.Fatal(err)
	}
	tm.expect(t, "50 150\r\n")
}
