package computeapi

import (
	"bytes"
	"context"
	"io"
	"net/http"
	"net/url"
	"strings"
	"testing"
	"time"

	api "github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
)

// TestAgentPTY: an agent's own interactive terminal through the API, to a
// real supervisor: the process has a terminal of the asked size, reads
// what is typed, sees resizes, and its exit code comes back. Another
// agent is refused before anything is started, and both are audited.
func TestAgentPTY(t *testing.T) {
	st := tempStore(t)
	clients := realSupervisorAPI(t, st, nil)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	agent := clients("agent-token:agent-1")

	pty, err := agent.OpenPTY(ctx, "agent-1", api.PTYOptions{
		Command: []string{"sh", "-c", `stty size; echo "ready $GREETING"; read line; stty size; echo "got-$line"; exit 4`},
		Env:     map[string]string{"GREETING": "hi"},
		Cols:    100, Rows: 30,
	})
	if err != nil {
		t.Fatal(err)
	}
	defer pty.Close()
	var out bytes.Buffer
	waitFor := func(want string) {
		t.Helper()
		buf := make([]byte, 4096)
		for !strings.Contains(out.String(), want) {
			n, err := pty.Read(buf)
			out.Write(buf[:n])
			if err != nil {
				t.Fatalf("waiting for %q: %v; terminal so far %q", want, err, out.String())
			}
		}
	}
	waitFor("ready hi")
	if err := pty.Resize(ctx, 120, 40); err != nil {
		t.Fatal(err)
	}
	if _, err := pty.Write([]byte("typed\n")); err != nil {
		t.Fatal(err)
	}
	rest, err := io.ReadAll(pty)
	if err != nil {
		t.Fatal(err)
	}
	out.Write(rest)
	exit, err := pty.Wait(ctx)
	if err != nil || exit.ExitCode != 4 {
		t.Fatalf("exit %+v, %v", exit, err)
	}
	for _, want := range []string{"30 100", "40 120", "got-typed"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("terminal output %q lacks %q", out.String(), want)
		}
	}

	// Refusals answer before the upgrade, as plain API errors.
	_, err = clients("agent-token:agent-2").OpenPTY(ctx, "agent-1", api.PTYOptions{})
	wantAPIError(t, err, api.CodePermissionDenied, http.StatusForbidden)
	_, err = agent.OpenPTY(ctx, "agent-1", api.PTYOptions{Command: []string{"/no/such/program"}})
	wantAPIError(t, err, api.CodeInvalidArgument, http.StatusBadRequest)
	_, err = agent.OpenPTY(ctx, "agent-1", api.PTYOptions{Env: map[string]string{"": "x"}})
	wantAPIError(t, err, api.CodeInvalidArgument, http.StatusBadRequest)

	// The session's record is written when the relay ends, just after
	// the client saw the exit.
	results := map[string]int{}
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		page, err := clients(adminToken).QueryAudit(ctx, url.Values{"operation": {"run_command_pty"}})
		if err != nil {
			t.Fatal(err)
		}
		clear(results)
		for _, rec := range page.Records {
			results[rec.AgentID+" "+rec.Result]++
		}
		if len(page.Records) >= 4 || time.Now().After(deadline) {
			break
		}
	}
	// The missing program and the bad env are both invalid_argument.
	want := map[string]int{"agent-1 ok": 1, "agent-1 permission_denied": 1, "agent-1 invalid_argument": 2}
	for k, n := range want {
		if results[k] != n {
			t.Errorf("audited PTY calls by agent and result: %v, want %v", results, want)
			break
		}
	}
}
