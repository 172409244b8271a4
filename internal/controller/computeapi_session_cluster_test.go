package controller

import (
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	"github.com/agentbox/terraform-provider-agentbox/internal/computeapi"
	apiclient "github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
	"github.com/agentbox/terraform-provider-agentbox/internal/store"
)

// TestOpenCallsKeepSandboxActiveOnCluster: on the real cluster, a sandbox
// whose idle timeout is short stays Running while an agent's terminal,
// then a streamed command, stays open well past that timeout, and is
// idle-stopped once nothing is open. The API renews activity every 3 s
// here (30 s in the control plane), so that a 15 s idle timeout is
// enough to tell.
func TestOpenCallsKeepSandboxActiveOnCluster(t *testing.T) {
	t.Parallel()
	image := os.Getenv(EnvSandboxImage)
	if image == "" {
		t.Skipf("%s is not set: a terminal needs the real sandbox image's supervisor", EnvSandboxImage)
	}
	const (
		renew = 3 * time.Second
		idle  = 15 * time.Second
	)
	e, st, pool := platformEnv(t)
	api := e.computeAPIWithStore(pool, st, func(o *computeapi.Options) { o.LeaseRenewInterval = renew })
	e.template("tpl", func(tpl *v1alpha1.SandboxTemplate) {
		tpl.Spec.Image = image
		// The short timeout is the Sandbox's, set once it runs, so that
		// a slow start does not count as idleness.
		tpl.Spec.IdleTimeout = metav1.Duration{Duration: time.Hour}
	})
	e.sandbox("busy", "tpl")
	sbx, _ := e.waitPhase("busy", v1alpha1.SandboxPhaseRunning, v1alpha1.ReasonRunning)
	agent := sbx.Spec.AgentID
	ctx := e.ctx

	pty, err := api.OpenPTY(ctx, agent, apiclient.PTYOptions{Command: []string{"sh", "-c", "read x; echo got-$x"}})
	must(t, err)
	defer pty.Close()
	var s v1alpha1.Sandbox
	must(t, e.get("busy", &s))
	patch := client.MergeFrom(s.DeepCopy())
	s.Spec.IdleTimeout = &metav1.Duration{Duration: idle}
	must(t, e.c.Patch(ctx, &s, patch))

	// staysRunning watches the sandbox for d and fails if it leaves
	// Running; it expects the activity clock to have moved along.
	staysRunning := func(what string, d time.Duration) {
		t.Helper()
		renewed := map[time.Time]bool{}
		for end := time.Now().Add(d); time.Now().Before(end); time.Sleep(time.Second) {
			var s v1alpha1.Sandbox
			must(t, e.get("busy", &s))
			if s.Status.Phase != v1alpha1.SandboxPhaseRunning {
				t.Fatalf("with %s the sandbox went %s (%s)", what, s.Status.Phase, readyReason(&s))
			}
			var l coordinationv1.Lease
			must(t, e.get(ActivityClockName("busy"), &l))
			renewed[l.Spec.RenewTime.Time] = true
		}
		if len(renewed) < 3 {
			t.Errorf("with %s open for %s the activity clock read only %d times: %v", what, d, len(renewed), renewed)
		}
		t.Logf("with %s open for %s (idle timeout %s) the sandbox stayed Running; %d activity renewals seen", what, d, idle, len(renewed))
	}

	staysRunning("a terminal", 2*idle+5*time.Second)
	_, err = pty.Write([]byte("bye\n"))
	must(t, err)
	out, err := io.ReadAll(pty)
	must(t, err)
	if exit, err := pty.Wait(ctx); err != nil || exit.ExitCode != 0 || !strings.Contains(string(out), "got-bye") {
		t.Fatalf("terminal: exit %+v, %v, output %q", exit, err, out)
	}

	started := make(chan struct{})
	type result struct {
		res *apiclient.CommandResult
		out string
		err error
	}
	done := make(chan result, 1)
	go func() {
		var out strings.Builder
		res, err := api.RunCommandStream(ctx, agent, apiclient.RunCommandRequest{
			Command: []string{"sh", "-c", "echo started; sleep 40; echo finished"}, TimeoutSeconds: 120,
		}, func(ev apiclient.CommandEvent) error {
			if out.Len() == 0 {
				close(started)
			}
			out.WriteString(ev.Data)
			return nil
		})
		done <- result{res, out.String(), err}
	}()
	select {
	case <-started:
	case r := <-done:
		t.Fatalf("the streamed command ended early: %+v, %v", r.res, r.err)
	}
	staysRunning("a streamed command", 2*idle)
	r := <-done
	if r.err != nil || r.res.ExitCode != 0 || r.out != "started\nfinished\n" {
		t.Fatalf("streamed command: %+v, %v, output %q", r.res, r.err, r.out)
	}

	// Nothing open: the sandbox idles out and is stopped.
	closed := time.Now()
	e.waitPhase("busy", v1alpha1.SandboxPhaseStopped, v1alpha1.ReasonStopped)
	if took := time.Since(closed); took < idle-renew-time.Second {
		t.Errorf("stopped %s after the last call ended, sooner than the idle timeout %s allows", took, idle)
	}
	t.Logf("stopped %s after the last call ended", time.Since(closed).Round(time.Second))
}

// TestExclusiveLeaseOnCluster: on the real cluster, while an agent's
// sandbox is leased, the holder's calls are served and another token's
// are refused with lease_held naming the holder and the expiry (through
// the Go client and the CLI); the staff console still gets in and its
// audit record says whose hold it passed; after the release, and after
// an expiry, the other token's calls are served again.
func TestExclusiveLeaseOnCluster(t *testing.T) {
	t.Parallel()
	e, st, admin, sbx := apiSandbox(t, "excl", nil)
	agent := sbx.Spec.AgentID
	ctx := e.ctx
	holder, _ := agentClients(e, admin, agent)
	other := admin
	run := func(c *apiclient.Client) (string, error) {
		res, err := c.RunCommand(ctx, agent, apiclient.RunCommandRequest{Command: []string{"sh", "-c", "echo ran"}})
		if err != nil {
			return "", err
		}
		return res.Stdout, nil
	}
	wantHeld := func(what string, err error, by string, until time.Time) {
		t.Helper()
		h, exp, ok := apiclient.LeaseHeldBy(err)
		var apiErr *apiclient.Error
		if !ok || h != by || !exp.Equal(until) || !errors.As(err, &apiErr) || apiErr.Status != http.StatusConflict {
			t.Errorf("%s: %v, want lease_held (409) by %q until %v", what, err, by, until)
		}
	}

	l, err := holder.AcquireLease(ctx, agent, apiclient.AcquireLeaseRequest{Holder: "run-1", RequestID: "req-1", TTLSeconds: 300})
	must(t, err)
	if out, err := run(holder); err != nil || out != "ran\n" {
		t.Fatalf("the holder's command: %q, %v", out, err)
	}
	pty, err := holder.OpenPTY(ctx, agent, apiclient.PTYOptions{Command: []string{"echo", "holder-pty"}})
	must(t, err)
	out, _ := io.ReadAll(pty)
	pty.Close()
	if !strings.Contains(string(out), "holder-pty") {
		t.Errorf("the holder's terminal printed %q", out)
	}

	// The refused side: the lease as it is now (the holder's calls moved
	// its expiry along).
	var lease coordinationv1.Lease
	must(t, e.get(ActivityClockName("excl"), &lease))
	_, until := v1alpha1.LeaseHoldExpiry(&lease.Spec)
	_, err = run(other)
	wantHeld("another token's command", err, "run-1", until)
	_, err = other.OpenPTY(ctx, agent, apiclient.PTYOptions{})
	wantHeld("another token's terminal", err, "run-1", until)
	_, err = other.PutFile(ctx, agent, "not-mine.txt", strings.NewReader("x"), 0)
	wantHeld("another token's upload", err, "run-1", until)
	if st, err := other.Status(ctx, agent); err != nil || st.Phase != string(v1alpha1.SandboxPhaseRunning) {
		t.Errorf("status of the held sandbox: %+v, %v", st, err)
	}

	// The CLI says who holds it until when, and serves the holder's lease
	// ID.
	cli := goBuild(t, "../cmd/agentbox", "agentbox")
	cmd := exec.CommandContext(ctx, cli, "exec", agent, "--", "echo", "hi")
	cmd.Env = e.cliEnv(admin.Endpoint(), admin.Token())
	cliOut, err := cmd.CombinedOutput()
	var exitErr *exec.ExitError
	if !errors.As(err, &exitErr) || exitErr.ExitCode() != 1 || !strings.Contains(string(cliOut), "lease_held, HTTP 409") ||
		!strings.Contains(string(cliOut), `held by "run-1" until `) {
		t.Errorf("agentbox exec on the held sandbox: %v\n%s", err, cliOut)
	}
	cmd = exec.CommandContext(ctx, cli, "exec", "--lease-id", l.LeaseID, agent, "--", "echo", "hi")
	cmd.Env = e.cliEnv(admin.Endpoint(), admin.Token())
	if cliOut, err := cmd.CombinedOutput(); err != nil || !strings.HasPrefix(string(cliOut), "hi\n") {
		t.Errorf("agentbox exec --lease-id: %v\n%s", err, cliOut)
	}

	// The staff console passes the hold, and the audit log says so.
	staffTok, err := admin.CreateToken(ctx, apiclient.CreateTokenRequest{Kind: apiclient.TokenKindStaff, Subject: "erin@ops"})
	must(t, err)
	staff := e.apiClient(admin.Endpoint(), staffTok.Token)
	sess, err := staff.CreateConsoleSession(ctx, apiclient.CreateConsoleSessionRequest{AgentID: agent, Reason: "held sandbox check", TTLSeconds: 300})
	must(t, err)
	console, err := staff.OpenConsole(ctx, sess.ID, 0, 0)
	if err != nil {
		t.Fatalf("the staff console on the held sandbox: %v", err)
	}
	_, err = console.Write([]byte("echo staff-$((6*7)); exit 0\n"))
	must(t, err)
	out, _ = io.ReadAll(console)
	console.Close()
	if !strings.Contains(string(out), "staff-42") {
		t.Errorf("the console printed %q", out)
	}
	var detail string
	for deadline := time.Now().Add(10 * time.Second); detail == "" && time.Now().Before(deadline); time.Sleep(100 * time.Millisecond) {
		page, err := st.QueryAudit(ctx, store.AuditQuery{AgentID: agent, Operation: "console_pty"})
		must(t, err)
		for _, r := range page.Records {
			detail = r.Detail
		}
	}
	var note struct {
		Bypassed map[string]string `json:"lease_bypassed"`
	}
	if err := json.Unmarshal([]byte(detail), &note); err != nil || note.Bypassed["holder"] != "run-1" || note.Bypassed["expires_at"] == "" {
		t.Errorf("the console's audit detail %q (%v)", detail, err)
	}
	t.Logf("the console's audit detail: %s", detail)

	// Released: the other token is served again.
	must(t, holder.ReleaseLease(ctx, agent, apiclient.ReleaseLeaseRequest{Holder: "run-1", LeaseID: l.LeaseID}))
	if out, err := run(other); err != nil || out != "ran\n" {
		t.Errorf("another token after the release: %q, %v", out, err)
	}

	// Expired: the same without a release.
	l, err = holder.AcquireLease(ctx, agent, apiclient.AcquireLeaseRequest{Holder: "run-2", RequestID: "req-2", TTLSeconds: 3})
	must(t, err)
	_, err = run(other)
	wantHeld("another token while run-2 holds it", err, "run-2", l.ExpiresAt)
	time.Sleep(time.Until(l.ExpiresAt) + time.Second)
	if out, err := run(other); err != nil || out != "ran\n" {
		t.Errorf("another token after the expiry: %q, %v", out, err)
	}
}

// TestConsoleTranscriptOnCluster: on the real cluster, a staff console
// records what was typed and what the terminal showed, told apart, and
// the stored transcript holds neither a fake API key nor a fake platform
// token that were typed (each split across keystroke frames) and echoed,
// while the terminal itself showed them. The audit log keeps them out of
// what callers put into it (a request ID, a path's agent ID), and the
// agent's own command output is left as the command produced it.
func TestConsoleTranscriptOnCluster(t *testing.T) {
	t.Parallel()
	e, st, admin, sbx := apiSandbox(t, "transcript", nil)
	agent := sbx.Spec.AgentID
	ctx := e.ctx
	apiKey := "sk-proj-" + strings.Repeat("T3st", 10)
	platform := "abx_" + strings.Repeat("RmFr", 10) + "ZTk"

	staffTok, err := admin.CreateToken(ctx, apiclient.CreateTokenRequest{Kind: apiclient.TokenKindStaff, Subject: "frank@ops"})
	must(t, err)
	staff := e.apiClient(admin.Endpoint(), staffTok.Token)
	sess, err := staff.CreateConsoleSession(ctx, apiclient.CreateConsoleSessionRequest{AgentID: agent, Reason: "transcript check", TTLSeconds: 300})
	must(t, err)
	console, err := staff.OpenConsole(ctx, sess.ID, 0, 0)
	must(t, err)
	for _, frame := range []string{
		"export OPENAI_API_KEY=" + apiKey[:11], apiKey[11:] + "; echo key=$OPENAI_API_KEY; echo tok=" + platform[:20],
		platform[20:] + "; echo typed-$((40+2)); exit 0\n",
	} {
		_, err := console.Write([]byte(frame))
		must(t, err)
	}
	shown, err := io.ReadAll(console)
	must(t, err)
	console.Close()
	for _, want := range []string{"key=" + apiKey, "tok=" + platform, "typed-42"} {
		if !bytes.Contains(shown, []byte(want)) {
			t.Errorf("the staff member's terminal lacks %q: %q", want, shown)
		}
	}

	// Read back, from the API and from the store itself.
	var rec *apiclient.ConsoleSession
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(100 * time.Millisecond) {
		rec, err = staff.GetConsoleSession(ctx, sess.ID)
		must(t, err)
		if rec.DisconnectedAt != nil || time.Now().After(deadline) {
			break
		}
	}
	stored, err := st.GetConsoleSession(ctx, sess.ID)
	must(t, err)
	var typed, echoed []byte
	for i, r := range rec.TranscriptRecords {
		switch r.Direction {
		case apiclient.TranscriptInput:
			typed = append(typed, r.Data...)
		case apiclient.TranscriptOutput:
			echoed = append(echoed, r.Data...)
		}
		if i >= len(stored.Records) || !bytes.Equal(stored.Records[i].Data, r.Data) || string(stored.Records[i].Direction) != r.Direction {
			t.Errorf("record %d from the API differs from the store's", i)
		}
	}
	t.Logf("stored transcript: %d records; typed %q", len(rec.TranscriptRecords), typed)
	wantTyped := "export OPENAI_API_KEY=[REDACTED:sk_api_key]; echo key=$OPENAI_API_KEY; echo tok=[REDACTED:agentbox_token]; echo typed-$((40+2)); exit 0\n"
	if string(typed) != wantTyped {
		t.Errorf("recorded input %q, want %q", typed, wantTyped)
	}
	for _, want := range []string{"key=[REDACTED:sk_api_key]", "tok=[REDACTED:agentbox_token]", "typed-42"} {
		if !bytes.Contains(echoed, []byte(want)) {
			t.Errorf("recorded output lacks %q: %q", want, echoed)
		}
	}
	for _, part := range []string{apiKey[11:], platform[20:], apiKey[:20], platform[:24]} {
		for name, b := range map[string][]byte{"input": typed, "output": echoed, "transcript": rec.Transcript} {
			if bytes.Contains(b, []byte(part)) {
				t.Errorf("the stored %s holds %q: %q", name, part, b)
			}
		}
	}

	// The agent gets its command's output as it is.
	res, err := admin.RunCommand(ctx, agent, apiclient.RunCommandRequest{Command: []string{"echo", apiKey}})
	if err != nil || res.Stdout != apiKey+"\n" {
		t.Errorf("the command's own output: %+v, %v", res, err)
	}
	// What callers put into the audit log is redacted there: a request ID
	// and an agent ID (a token pasted where the agent goes).
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, admin.Endpoint()+apiclient.PathAgent(agent, "status"), nil)
	must(t, err)
	req.Header.Set("Authorization", "Bearer "+admin.Token())
	req.Header.Set(computeapi.HeaderRequestID, apiKey)
	resp, err := admin.HTTPClient().Do(req)
	must(t, err)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK || resp.Header.Get(computeapi.HeaderRequestID) != apiKey {
		t.Errorf("status with a request ID of the caller's: %d, answered ID %q", resp.StatusCode, resp.Header.Get(computeapi.HeaderRequestID))
	}
	if _, err := admin.Status(ctx, platform); apiclient.CodeOf(err) != apiclient.CodeSandboxNotFound {
		t.Errorf("status of a token as an agent ID: %v", err)
	}
	var found []string
	for deadline := time.Now().Add(10 * time.Second); len(found) < 2 && time.Now().Before(deadline); time.Sleep(100 * time.Millisecond) {
		found = nil
		page, err := st.QueryAudit(ctx, store.AuditQuery{Operation: "status", Limit: 1000})
		must(t, err)
		for _, r := range page.Records {
			for _, secret := range []string{apiKey, platform} {
				if strings.Contains(r.RequestID+r.AgentID+r.Detail, secret) {
					t.Fatalf("audit record %d holds a secret: %+v", r.Seq, r)
				}
			}
			if r.RequestID == "[REDACTED:sk_api_key]" && r.AgentID == agent {
				found = append(found, "request id")
			}
			if r.AgentID == "[REDACTED:agentbox_token]" && r.Result == string(apiclient.CodeSandboxNotFound) {
				found = append(found, "agent id")
			}
		}
	}
	if len(found) != 2 {
		t.Errorf("redacted audit records found: %v, want the request ID's and the agent ID's", found)
	}
	if v, err := admin.VerifyAudit(ctx); err != nil || !v.OK {
		t.Errorf("audit verify: %+v, %v", v, err)
	}
	q := url.Values{"agent_id": {agent}, "operation": {"console_pty"}}
	if page, err := admin.QueryAudit(ctx, q); err != nil || len(page.Records) != 1 || page.Records[0].Result != "ok" {
		t.Errorf("the console's audit record: %+v, %v", page, err)
	}
}
