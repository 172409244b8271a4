package computeapi

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/url"
	"strings"
	"testing"
	"time"

	clocktesting "k8s.io/utils/clock/testing"
	"sigs.k8s.io/controller-runtime/pkg/client"

	api "github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
)

// wantLeaseHeld checks that err is lease_held (409) naming holder and
// expiry.
func wantLeaseHeld(t *testing.T, what string, err error, holder string, expiry time.Time) {
	t.Helper()
	e := wantAPIError(t, err, api.CodeLeaseHeld, http.StatusConflict)
	gotHolder, gotExpiry, ok := api.LeaseHeldBy(e)
	if !ok || gotHolder != holder || !gotExpiry.Equal(expiry) {
		t.Errorf("%s: lease_held names %q until %v, want %q until %v (%v)", what, gotHolder, gotExpiry, holder, expiry, e)
	}
}

// TestLeaseIsExclusive: while an agent's sandbox is held, only calls that
// present the hold's lease ID reach it, whatever their token; everyone
// else gets lease_held with the holder and the expiry, on every kind of
// call (commands, streams, terminals, files, tools, MCP, deploy,
// terminate). Status is still answered, the staff console still gets in
// and its audit record says whose hold it passed, and after the release
// or the expiry the others' calls are served again.
func TestLeaseIsExclusive(t *testing.T) {
	var clk *clocktesting.FakeClock
	st := tempStore(t)
	clients := realSupervisorAPIWith(t, apiSetup{store: st, pushDelay: -1,
		started: func(_ client.Client, c *clocktesting.FakeClock) { clk = c }})
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	holder := clients("agent-token:agent-1")
	other := clients(adminToken)

	l, err := holder.AcquireLease(ctx, "agent-1", api.AcquireLeaseRequest{Holder: "run-1", RequestID: "req-1", TTLSeconds: 60})
	if err != nil {
		t.Fatal(err)
	}
	run := func(c *api.Client) error {
		_, err := c.RunCommand(ctx, "agent-1", api.RunCommandRequest{Command: []string{"echo", "hi"}})
		return err
	}

	// The holder's client presents its lease on every kind of call.
	if err := run(holder); err != nil {
		t.Fatalf("the holder's command: %v", err)
	}
	if _, err := holder.RunCommandStream(ctx, "agent-1", api.RunCommandRequest{Command: []string{"true"}}, func(api.CommandEvent) error { return nil }); err != nil {
		t.Errorf("the holder's streamed command: %v", err)
	}
	if _, err := holder.PutFile(ctx, "agent-1", "held.txt", strings.NewReader("mine"), 0); err != nil {
		t.Errorf("the holder's upload: %v", err)
	}
	pty, err := holder.OpenPTY(ctx, "agent-1", api.PTYOptions{Command: []string{"true"}})
	if err != nil {
		t.Errorf("the holder's terminal: %v", err)
	} else {
		pty.Close()
	}
	cs, err := connectMCP(ctx, holder, "agent-1")
	if err != nil {
		t.Fatal(err)
	}
	if res := callTool(t, cs, "run_command", map[string]any{"shell": "echo via-mcp"}, nil); res.IsError || !strings.Contains(toolText(res), "via-mcp") {
		t.Errorf("the holder's MCP tool call: %s", toolText(res))
	}
	cs.Close()

	// Anyone else, the admin included, is refused everywhere but status.
	refused := map[string]func() error{
		"run_command": func() error { return run(other) },
		"run_command_stream": func() error {
			_, err := other.RunCommandStream(ctx, "agent-1", api.RunCommandRequest{Command: []string{"true"}}, func(api.CommandEvent) error { return nil })
			return err
		},
		"pty":      func() error { _, err := other.OpenPTY(ctx, "agent-1", api.PTYOptions{}); return err },
		"get_file": func() error { _, err := other.GetFile(ctx, "agent-1", "held.txt"); return err },
		"put_file": func() error {
			_, err := other.PutFile(ctx, "agent-1", "held.txt", strings.NewReader("theirs"), 0)
			return err
		},
		"tool_request": func() error {
			_, err := other.ToolRequest(ctx, "agent-1", "view", map[string]any{"path": "held.txt"})
			return err
		},
		"deploy_or_resume": func() error { _, err := other.DeployOrResume(ctx, "agent-1", api.DeployRequest{}); return err },
		"terminate": func() error {
			_, err := other.Terminate(ctx, "agent-1", api.TerminateRequest{Reason: "not mine"})
			return err
		},
	}
	for op, call := range refused {
		wantLeaseHeld(t, op, call(), "run-1", l.ExpiresAt)
	}
	cs, err = connectMCP(ctx, other, "agent-1")
	if err != nil {
		t.Fatal(err)
	}
	if res := callTool(t, cs, "run_command", map[string]any{"shell": "echo no"}, nil); !res.IsError || !strings.Contains(toolText(res), "lease_held") {
		t.Errorf("another caller's MCP tool call: %s", toolText(res))
	}
	cs.Close()
	if st, err := other.Status(ctx, "agent-1"); err != nil || st.Phase != "Running" {
		t.Errorf("status of a held sandbox: %+v, %v", st, err)
	}
	// A wrong lease ID is no better than none; the right one, handed on,
	// is as good as the holder's own client.
	other.UseLease("agent-1", "0123456789abcdef")
	wantLeaseHeld(t, "a wrong lease ID", run(other), "run-1", l.ExpiresAt)
	other.UseLease("agent-1", l.LeaseID)
	if err := run(other); err != nil {
		t.Errorf("a call with the lease ID handed on: %v", err)
	}
	other.UseLease("agent-1", "")
	if data, err := holder.GetFile(ctx, "agent-1", "held.txt"); err != nil {
		t.Errorf("the holder's download: %v", err)
	} else {
		var b bytes.Buffer
		_, _ = b.ReadFrom(data)
		data.Close()
		if b.String() != "mine" {
			t.Errorf("the file the refused upload would have replaced holds %q", b.String())
		}
	}

	// The staff console passes the hold, and its audit record says so.
	staffTok, err := other.CreateToken(ctx, api.CreateTokenRequest{Kind: api.TokenKindStaff, Subject: "alice@ops"})
	if err != nil {
		t.Fatal(err)
	}
	staff := clients(staffTok.Token)
	sess, err := staff.CreateConsoleSession(ctx, api.CreateConsoleSessionRequest{AgentID: "agent-1", Reason: "held, but stuck"})
	if err != nil {
		t.Fatal(err)
	}
	console, err := staff.OpenConsole(ctx, sess.ID, 0, 0)
	if err != nil {
		t.Fatalf("the staff console on a held sandbox: %v", err)
	}
	if _, err := console.Write([]byte("exit 0\n")); err != nil {
		t.Fatal(err)
	}
	if _, err := io.ReadAll(console); err != nil {
		t.Fatal(err)
	}
	if _, err := console.Wait(ctx); err != nil {
		t.Fatal(err)
	}
	console.Close()
	var detail string
	for deadline := time.Now().Add(5 * time.Second); detail == "" && time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		// The console's path names no agent; its record does.
		page, err := other.QueryAudit(ctx, url.Values{"operation": {"console_pty"}, "agent_id": {"agent-1"}})
		if err != nil {
			t.Fatal(err)
		}
		for _, r := range page.Records {
			detail = r.Detail
		}
	}
	var note struct {
		Bypassed map[string]string `json:"lease_bypassed"`
	}
	if err := json.Unmarshal([]byte(detail), &note); err != nil || note.Bypassed["holder"] != "run-1" ||
		note.Bypassed["expires_at"] != l.ExpiresAt.UTC().Format(time.RFC3339Nano) {
		t.Errorf("the console's audit detail %q (%v)", detail, err)
	}
	// The refusals were audited as such, the MCP tool's as its REST
	// operation.
	page, err := other.QueryAudit(ctx, url.Values{"operation": {"run_command"}, "caller": {"admin"}})
	if err != nil {
		t.Fatal(err)
	}
	held := 0
	for _, r := range page.Records {
		if r.Result == string(api.CodeLeaseHeld) && r.Status == http.StatusConflict {
			held++
		}
	}
	if held != 3 {
		t.Errorf("%d audited lease_held refusals of run_command, want 3", held)
	}

	// Released: everyone's calls are served again.
	if err := holder.ReleaseLease(ctx, "agent-1", api.ReleaseLeaseRequest{Holder: "run-1", LeaseID: l.LeaseID}); err != nil {
		t.Fatal(err)
	}
	if err := run(other); err != nil {
		t.Errorf("another caller after the release: %v", err)
	}

	// Expired: the same, without a release.
	l, err = holder.AcquireLease(ctx, "agent-1", api.AcquireLeaseRequest{Holder: "run-2", RequestID: "req-2", TTLSeconds: 5})
	if err != nil {
		t.Fatal(err)
	}
	wantLeaseHeld(t, "a new hold", run(other), "run-2", l.ExpiresAt)
	clk.Step(5 * time.Second)
	if err := run(other); err != nil {
		t.Errorf("another caller after the expiry: %v", err)
	}
	// The holder whose lease expired is served too: nobody holds it.
	if err := run(holder); err != nil {
		t.Errorf("the former holder after the expiry: %v", err)
	}
}

// A pool lease is exclusive from the moment its caller is answered,
// before the hold is written into the sandbox's Lease, and after.
func TestPoolLeaseIsExclusive(t *testing.T) {
	ctx := context.Background()
	f := servedPoolFixture(t)
	taker, other := f.client(t, adminToken), f.client(t, adminToken)
	unblock := f.blockSettles()
	l, err := taker.AcquirePoolLease(ctx, "team-a", "p", api.AcquireLeaseRequest{Holder: "run-1", RequestID: "req-1", TTLSeconds: 60})
	if err != nil {
		t.Fatal(err)
	}
	run := func(c *api.Client) error {
		_, err := c.RunCommand(ctx, l.AgentID, api.RunCommandRequest{Command: []string{"echo", "hi"}})
		return err
	}
	if h := f.leaseNamed(t, "w-1").Spec.HolderIdentity; h != nil {
		t.Fatalf("the hold was written before the test could look: %q", *h)
	}
	wantLeaseHeld(t, "before the hold is written", run(other), "run-1", l.ExpiresAt)
	if err := run(taker); err != nil {
		t.Errorf("the taker before the hold is written: %v", err)
	}
	unblock()
	f.settled()
	if h := f.leaseNamed(t, "w-1").Spec.HolderIdentity; h == nil || *h != "run-1" {
		t.Fatalf("the hold was not written: %v", h)
	}
	wantLeaseHeld(t, "after the hold is written", run(other), "run-1", l.ExpiresAt)
	if err := run(taker); err != nil {
		t.Errorf("the taker after the hold is written: %v", err)
	}
	if err := taker.ReleaseLease(ctx, l.AgentID, api.ReleaseLeaseRequest{Holder: "run-1", LeaseID: l.LeaseID}); err != nil {
		t.Fatal(err)
	}
	// Released: the take is still in the store until the pool's controller
	// deletes the sandbox, but it no longer holds it.
	if err := run(other); err != nil {
		t.Errorf("another caller after the release: %v", err)
	}
}
