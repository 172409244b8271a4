package main

import (
	"context"
	"encoding/json"
	"io"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/creack/pty"

	"github.com/agentbox/terraform-provider-agentbox/internal/computeapi/apitest"
	"github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
	"github.com/agentbox/terraform-provider-agentbox/internal/store"
)

func TestShellTypesPipedInputAndExitsWithTheProcessCode(t *testing.T) {
	s, env := realAgentAPI(t, apitest.Options{})
	a := s.AgentID

	// Piped input is typed into the shell, which sees a default-sized
	// terminal.
	r := runCLI(t, env, "stty size; echo shell-$((40+2)); exit 3\n", "shell", a)
	if r.code != 3 || !strings.Contains(r.stdout, "24 80") || !strings.Contains(r.stdout, "shell-42") {
		t.Errorf("shell: code %d, stdout %q, stderr %q", r.code, r.stdout, r.stderr)
	}
	// After the input, ^D ends a program reading it.
	r = runCLI(t, env, "one\ntwo\n", "shell", "--env", "SUFFIX=!", a, "--", "sh", "-c", `n=0; while read l; do n=$((n+1)); done; echo "lines=$n$SUFFIX"`)
	if r.code != 0 || !strings.Contains(r.stdout, "lines=2!") {
		t.Errorf("shell with a command: code %d, stdout %q, stderr %q", r.code, r.stdout, r.stderr)
	}
	r = runCLI(t, env, "", "shell", a, "--", "sh", "-c", "kill -TERM $$")
	if r.code != 128+15 {
		t.Errorf("killed by SIGTERM: code %d, stderr %q", r.code, r.stderr)
	}

	r = runCLI(t, env, "", "shell", "agent-2")
	if r.code != exitAPIError || !strings.Contains(r.stderr, "permission_denied") {
		t.Errorf("other agent: code %d, stderr %q", r.code, r.stderr)
	}
	r = runCLI(t, env, "", "shell")
	if r.code != exitUsage || !strings.Contains(r.stderr, "missing AGENT_ID") {
		t.Errorf("no agent: code %d, stderr %q", r.code, r.stderr)
	}
}

// On a real terminal the shell command passes the local window's size and
// leaves echoing to the remote terminal (raw mode locally).
func TestShellOnATerminal(t *testing.T) {
	s, env := realAgentAPI(t, apitest.Options{})
	ptmx, tty, err := pty.Open()
	if err != nil {
		t.Skipf("no pseudo-terminal: %v", err)
	}
	defer ptmx.Close()
	if err := pty.Setsize(ptmx, &pty.Winsize{Rows: 33, Cols: 111}); err != nil {
		t.Fatal(err)
	}
	seen := make(chan []byte)
	go func() {
		out, _ := io.ReadAll(ptmx) // ends with EIO once the tty is closed
		seen <- out
	}()
	code := run(context.Background(), []string{"shell", s.AgentID, "--", "sh", "-c", "stty size; exit 6"},
		func(k string) string { return env[k] }, tty, tty, tty)
	tty.Close()
	// The CLI's input goroutine still blocks in a read of the tty, which
	// keeps it open until a key arrives (the CLI would exit instead).
	_, _ = ptmx.Write([]byte("\n"))
	out := string(<-seen)
	if code != 6 || !strings.Contains(out, "33 111") {
		t.Errorf("code %d, terminal output %q", code, out)
	}
}

func TestConsoleRecordsTheSession(t *testing.T) {
	st, err := store.OpenSQLite(context.Background(), filepath.Join(t.TempDir(), "agentbox.db"), store.Options{})
	if err != nil {
		t.Fatal(err)
	}
	// Registered first so that it runs last: the API writes its last
	// audit records into the store when it closes.
	t.Cleanup(func() { st.Close() })
	s, env := realAgentAPI(t, apitest.Options{Store: st})
	ctx := context.Background()
	admin, err := s.Client(s.AdminToken)
	if err != nil {
		t.Fatal(err)
	}
	staff, err := admin.CreateToken(ctx, client.CreateTokenRequest{Kind: client.TokenKindStaff, Subject: "carol@ops"})
	if err != nil {
		t.Fatal(err)
	}
	env = with(env, "AGENTBOX_TOKEN", staff.Token)

	r := runCLI(t, env, "", "console", s.AgentID)
	if r.code != exitUsage || !strings.Contains(r.stderr, "--reason is required") {
		t.Errorf("no reason: code %d, stderr %q", r.code, r.stderr)
	}
	r = runCLI(t, env, "echo console-$((40+2)); exit 5\n", "console", "--reason", "ticket 99", "--ttl", "2m", s.AgentID)
	if r.code != 5 || !strings.Contains(r.stdout, "console-42") {
		t.Fatalf("console: code %d, stdout %q, stderr %q", r.code, r.stdout, r.stderr)
	}
	m := regexp.MustCompile(`console session (\S+) on agent`).FindStringSubmatch(r.stderr)
	if m == nil {
		t.Fatalf("stderr %q names no session", r.stderr)
	}
	var rec *client.ConsoleSession
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		if rec, err = admin.GetConsoleSession(ctx, m[1]); err != nil {
			t.Fatal(err)
		}
		if rec.DisconnectedAt != nil || time.Now().After(deadline) {
			break
		}
	}
	if rec.StaffID != "carol@ops" || rec.Reason != "ticket 99" || rec.ExpiresAt.Sub(rec.CreatedAt) != 2*time.Minute ||
		rec.ConnectedAt == nil || rec.DisconnectedAt == nil || !strings.Contains(string(rec.Transcript), "console-42") {
		t.Errorf("recorded session %+v, transcript %q", rec, rec.Transcript)
	}
	// The staff member reads it back, both directions told apart.
	r = runCLI(t, env, "", "audit", "console", m[1])
	for _, want := range []string{"reason:          ticket 99\n", "staff:           carol@ops\n",
		` in  "echo console-$((40+2)); exit 5\n`, ` out "`, "console-42"} {
		if r.code != 0 || !strings.Contains(r.stdout, want) {
			t.Errorf("audit console: code %d, stdout lacks %q:\n%s\nstderr %q", r.code, want, r.stdout, r.stderr)
		}
	}
	r = runCLI(t, env, "", "audit", "console", "--json", m[1])
	var back client.ConsoleSession
	if err := json.Unmarshal([]byte(r.stdout), &back); err != nil || r.code != 0 || len(back.TranscriptRecords) < 2 {
		t.Errorf("audit console --json: code %d, %v, stdout %q", r.code, err, r.stdout)
	}

	// An agent token cannot open a console.
	r = runCLI(t, with(env, "AGENTBOX_TOKEN", s.AgentToken), "", "console", "--reason", "x", s.AgentID)
	if r.code != exitAPIError || !strings.Contains(r.stderr, "permission_denied") {
		t.Errorf("agent token: code %d, stderr %q", r.code, r.stderr)
	}
}
