package controller

import (
	"bytes"
	"crypto/rand"
	"crypto/sha256"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	"github.com/agentbox/terraform-provider-agentbox/internal/computeapi"
	apiclient "github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
	"github.com/agentbox/terraform-provider-agentbox/internal/store"
)

// TestComputeAPIOnCluster drives the Compute API's operations against a
// real gVisor sandbox on the cluster, with the controller, the real store
// and the archive snapshot driver behind them: commands (plain, streamed,
// 100 in flight at once, and an interactive PTY), another agent's token
// refused and audited, files in and out byte for byte, the sandboxed
// tools, /execute, status, a filespace push, terminate with a snapshot
// (then a call resumes the sandbox with its workspace), a staff console
// through the real CLI binary (and an expired one refused), the audit
// chain (and a record tampered with behind the store's back, found by the
// API and the CLI), and terminate without a snapshot (the sandbox is gone).
func TestComputeAPIOnCluster(t *testing.T) {
	t.Parallel()
	e, st, api, sbx := apiSandbox(t, "ops", nil)
	agent := sbx.Spec.AgentID
	if !e.workspaceWritable(t, e.supervisor(t, sbx)) {
		t.Skip("the operations write the workspace")
	}
	ctx := e.ctx

	res, err := api.RunCommand(ctx, agent, apiclient.RunCommandRequest{Command: []string{"sh", "-c", "echo out; echo err >&2; exit 3"}})
	if err != nil || res.ExitCode != 3 || res.Stdout != "out\n" || res.Stderr != "err\n" {
		t.Fatalf("run_command: %+v, %v", res, err)
	}

	var streamed strings.Builder
	res, err = api.RunCommandStream(ctx, agent, apiclient.RunCommandRequest{Command: []string{"sh", "-c", "echo a; echo b"}},
		func(ev apiclient.CommandEvent) error {
			streamed.WriteString(ev.Data)
			return nil
		})
	if err != nil || res.ExitCode != 0 || streamed.String() != "a\nb\n" {
		t.Fatalf("run_command_stream: %+v, %v, streamed %q", res, err, streamed.String())
	}

	agentAPI, otherAPI := agentClients(e, api, agent)
	concurrentRunCommands(t, agentAPI, agent, 100)
	agentScope(t, api, otherAPI, agent)
	agentPTY(t, agentAPI, agent)

	// A binary file in and out, byte for byte.
	data := make([]byte, 1<<20)
	_, _ = rand.Read(data)
	if fi, err := api.PutFile(ctx, agent, "data/in.bin", bytes.NewReader(data), 0o640); err != nil || fi.Size != int64(len(data)) {
		t.Fatalf("put_file: %+v, %v", fi, err)
	}
	body, err := api.GetFile(ctx, agent, "data/in.bin")
	must(t, err)
	back, err := io.ReadAll(body)
	body.Close()
	must(t, err)
	if !bytes.Equal(back, data) {
		t.Fatalf("get_file returned %d bytes, not the %d put", len(back), len(data))
	}
	codedFiles(t, e, api, agentAPI, agent)

	// The sandboxed tools and /execute.
	if _, err := api.ToolRequest(ctx, agent, "create_file", map[string]any{"path": "notes.txt", "content": "hello"}); err != nil {
		t.Fatalf("create_file: %v", err)
	}
	raw, err := api.ToolRequest(ctx, agent, "python_exec", map[string]any{"code": "print(open('notes.txt').read() * 2)"})
	if err != nil || !strings.Contains(string(raw), `hellohello\n`) {
		t.Fatalf("python_exec: %s, %v", raw, err)
	}
	raw, err = api.Execute(ctx, agent, map[string]any{
		"code":  "print(open('in.txt').read().upper()); open('out.txt','w').write('made')",
		"files": map[string][]byte{"in.txt": []byte("inline")},
	})
	must(t, err)
	var ex struct {
		Status        string            `json:"status"`
		Output        string            `json:"output"`
		FilesProduced map[string][]byte `json:"files_produced"`
	}
	if err := json.Unmarshal(raw, &ex); err != nil || ex.Status != "success" || ex.Output != "INLINE\n" || string(ex.FilesProduced["out.txt"]) != "made" {
		t.Fatalf("execute: %s (%v)", raw, err)
	}
	must(t, api.DeleteFile(ctx, agent, "notes.txt", false))
	if _, err := api.GetFile(ctx, agent, "notes.txt"); apiclient.CodeOf(err) != apiclient.CodeFileNotFound {
		t.Errorf("get_file after delete_file: %v, want file_not_found", err)
	}

	status, err := api.Status(ctx, agent)
	if err != nil || status.Phase != string(v1alpha1.SandboxPhaseRunning) {
		t.Fatalf("status: %+v, %v", status, err)
	}
	sum, err := api.SyncFilespace(ctx, agent, apiclient.SyncPush)
	if err != nil || sum.Pushed == 0 {
		t.Fatalf("sync_filespace push: %+v, %v", sum, err)
	}
	if n, err := st.GetFile(ctx, agent, "data/in.bin"); err != nil || n.SizeBytes != int64(len(data)) || n.Mode != 0o640 {
		t.Errorf("data/in.bin in the filespace: %+v, %v", n, err)
	}

	// Terminate with a snapshot stops the sandbox; the next call resumes
	// it with its workspace.
	term, err := api.Terminate(ctx, agent, apiclient.TerminateRequest{Reason: "test: stop with a snapshot", Snapshot: true})
	if err != nil {
		t.Fatalf("terminate with a snapshot: %v", err)
	}
	t.Logf("terminate with a snapshot: %s (%s)", term.Action, term.Status.Phase)
	e.waitPhase("ops", v1alpha1.SandboxPhaseStopped, v1alpha1.ReasonStopped)
	res, err = api.RunCommand(ctx, agent, apiclient.RunCommandRequest{Command: []string{"sha256sum", "data/in.bin"}})
	if err != nil || res.ExitCode != 0 {
		t.Fatalf("run_command after the stop: %+v, %v", res, err)
	}
	if want := fmt.Sprintf("%x  data/in.bin\n", sha256.Sum256(data)); res.Stdout != want {
		t.Errorf("after the resume: %q, want %q", res.Stdout, want)
	}
	var resumed v1alpha1.Sandbox
	must(t, e.get("ops", &resumed))
	if resumed.Status.Phase != v1alpha1.SandboxPhaseRunning {
		t.Errorf("after the call that resumed it, the sandbox is %s", resumed.Status.Phase)
	}

	// A staff console through the CLI, now that the sandbox has a
	// snapshot to record.
	cli := goBuild(t, "../cmd/agentbox", "agentbox")
	cliConsole(t, e, cli, api, agent, resumed.Status.Snapshot)

	// The audit chain holds every call and verifies.
	page, err := api.QueryAudit(ctx, url.Values{"agent_id": {agent}, "limit": {"1000"}})
	must(t, err)
	ops := map[string]bool{}
	for _, r := range page.Records {
		ops[r.Operation] = true
	}
	for _, op := range []string{"run_command", "run_command_stream", "run_command_pty", "put_file", "get_file", "tool_request", "execute", "delete_file", "status", "sync_filespace", "terminate"} {
		if !ops[op] {
			t.Errorf("no audit record of %s (have %v)", op, ops)
		}
	}
	if v, err := api.VerifyAudit(ctx); err != nil || !v.OK {
		t.Errorf("audit verify: %+v, %v", v, err)
	}
	tamperedAuditIsFound(t, e, cli, api, page)

	// Terminate without a snapshot deletes the sandbox.
	if _, err := api.Terminate(ctx, agent, apiclient.TerminateRequest{Reason: "test: done"}); err != nil {
		t.Fatalf("terminate: %v", err)
	}
	e.gone(&v1alpha1.Sandbox{}, "ops")
	if _, err := api.Status(ctx, agent); !errors.Is(err, &apiclient.Error{Code: apiclient.CodeSandboxNotFound}) {
		t.Errorf("status after terminate: %v, want sandbox_not_found", err)
	}
}

// agentClients mints a token for agent and one for another agent, and
// returns clients that use them.
func agentClients(e *clusterEnv, admin *apiclient.Client, agent string) (own, other *apiclient.Client) {
	e.t.Helper()
	var clients []*apiclient.Client
	for _, id := range []string{agent, agent + "-other"} {
		tok, err := admin.CreateToken(e.ctx, apiclient.CreateTokenRequest{Kind: apiclient.TokenKindAgent, AgentID: id})
		must(e.t, err)
		clients = append(clients, e.apiClient(admin.Endpoint(), tok.Token))
	}
	return clients[0], clients[1]
}

// codedFiles moves text, which compresses, through the API with the
// coding negotiated (the default client, which has learned from earlier
// answers that the API takes it) and without (a client with
// DisableCompression), each reading back what the other wrote, byte for
// byte; a raw download that asks for the coding gets it, and one that
// does not gets the file as it is.
func codedFiles(t *testing.T, e *clusterEnv, coded, own *apiclient.Client, agent string) {
	t.Helper()
	ctx := t.Context()
	var text bytes.Buffer
	for i := 0; text.Len() < 4<<20; i++ {
		fmt.Fprintf(&text, "func handler%d(w http.ResponseWriter, r *http.Request) { serve(w, r, %d) }\n", i, i*7)
	}
	plain := e.apiClient(own.Endpoint(), own.Token())
	plain.DisableCompression = true
	for _, c := range []struct {
		name     string
		put, get *apiclient.Client
	}{{"coded up, plain down", coded, plain}, {"plain up, coded down", plain, coded}} {
		if fi, err := c.put.PutFile(ctx, agent, "data/text.go", bytes.NewReader(text.Bytes()), 0o600); err != nil || fi.Size != int64(text.Len()) {
			t.Fatalf("%s: put_file: %+v, %v", c.name, fi, err)
		}
		body, err := c.get.GetFile(ctx, agent, "data/text.go")
		must(t, err)
		back, err := io.ReadAll(body)
		body.Close()
		if err != nil || !bytes.Equal(back, text.Bytes()) {
			t.Fatalf("%s: get_file returned %d bytes (%v), not the %d put", c.name, len(back), err, text.Len())
		}
	}
	for _, accept := range []string{"s2", "zstd", ""} {
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, own.Endpoint()+apiclient.PathFile(agent, "data/text.go"), nil)
		must(t, err)
		req.Header.Set("Authorization", "Bearer "+own.Token())
		req.Header.Set("Accept-Encoding", accept)
		resp, err := own.HTTPClient().Do(req)
		must(t, err)
		n, _ := io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		switch got := resp.Header.Get("Content-Encoding"); {
		case resp.StatusCode != http.StatusOK:
			t.Errorf("Accept-Encoding %q: status %d", accept, resp.StatusCode)
		case accept != "" && (got != accept || n >= int64(text.Len())/2):
			t.Errorf("Accept-Encoding %s: Content-Encoding %q, %d bytes for %d", accept, got, n, text.Len())
		case accept == "" && (got != "" || n != int64(text.Len())):
			t.Errorf("no Accept-Encoding: Content-Encoding %q, %d bytes for %d", got, n, text.Len())
		}
	}
	must(t, coded.DeleteFile(ctx, agent, "data/text.go", false))
}

// concurrentRunCommands sends n run_command calls at once with the
// agent's own token: every one is answered with its own output, although
// the supervisor runs only a few at a time (the rest wait their turn).
func concurrentRunCommands(t *testing.T, api *apiclient.Client, agent string, n int) {
	t.Helper()
	ctx := t.Context()
	errs := make(chan error, n)
	start := time.Now()
	var wg sync.WaitGroup
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			res, err := api.RunCommand(ctx, agent, apiclient.RunCommandRequest{Command: []string{"echo", strconv.Itoa(i)}})
			switch {
			case err != nil:
				errs <- fmt.Errorf("call %d: %w", i, err)
			case res.ExitCode != 0 || res.Stdout != strconv.Itoa(i)+"\n":
				errs <- fmt.Errorf("call %d: %+v", i, res)
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	t.Logf("%d concurrent run_command calls answered in %s", n, time.Since(start).Round(time.Millisecond))
}

// agentScope: another agent's token is refused the sandbox with the same
// answer as for an agent that has none, and the attempts are audited.
func agentScope(t *testing.T, admin, other *apiclient.Client, agent string) {
	t.Helper()
	ctx := t.Context()
	var answers []string
	for _, target := range []string{agent, "no-such-agent"} {
		_, err := other.RunCommand(ctx, target, apiclient.RunCommandRequest{Command: []string{"true"}})
		var apiErr *apiclient.Error
		if !errors.As(err, &apiErr) || apiErr.Code != apiclient.CodePermissionDenied {
			t.Fatalf("another agent's token on %s: %v, want permission_denied", target, err)
		}
		answers = append(answers, strings.ReplaceAll(apiErr.Message, target, "AGENT"))
	}
	if answers[0] != answers[1] {
		t.Errorf("the refusals differ, which tells whether the sandbox exists: %q vs %q", answers[0], answers[1])
	}
	// The audit log is written in batches behind the calls.
	denied := 0
	for deadline := time.Now().Add(10 * time.Second); denied == 0 && time.Now().Before(deadline); time.Sleep(50 * time.Millisecond) {
		page, err := admin.QueryAudit(ctx, url.Values{"agent_id": {agent}, "operation": {"run_command"}, "limit": {"1000"}})
		must(t, err)
		for _, r := range page.Records {
			if r.Result == string(apiclient.CodePermissionDenied) && r.CallerKind == "agent" {
				denied++
			}
		}
	}
	if denied != 1 {
		t.Errorf("%d audited refusals of another agent's token, want 1", denied)
	}
}

// agentPTY opens the agent's own terminal in the gVisor sandbox.
func agentPTY(t *testing.T, api *apiclient.Client, agent string) {
	t.Helper()
	ctx := t.Context()
	p, err := api.OpenPTY(ctx, agent, apiclient.PTYOptions{
		Command: []string{"sh", "-c", "stty size; tty; read x; echo got-$x; exit 2"}, Cols: 90, Rows: 20,
	})
	must(t, err)
	defer p.Close()
	_, err = p.Write([]byte("typed\n"))
	must(t, err)
	out, err := io.ReadAll(p)
	must(t, err)
	exit, err := p.Wait(ctx)
	if err != nil || exit.ExitCode != 2 {
		t.Fatalf("pty exit %+v, %v", exit, err)
	}
	for _, want := range []string{"20 90", "/dev/pts/", "got-typed"} {
		if !strings.Contains(string(out), want) {
			t.Errorf("terminal output %q lacks %q", out, want)
		}
	}
}

// cliConsole runs "agentbox console" (the real CLI binary) with a staff
// token and checks the record; then an expired session is refused.
func cliConsole(t *testing.T, e *clusterEnv, cli string, admin *apiclient.Client, agent string, snapshot *v1alpha1.SandboxSnapshot) {
	t.Helper()
	ctx := t.Context()
	staff, err := admin.CreateToken(ctx, apiclient.CreateTokenRequest{Kind: apiclient.TokenKindStaff, Subject: "dana@ops"})
	must(t, err)
	cmd := exec.CommandContext(ctx, cli, "console", "--reason", "ticket 7: check the workspace", "--ttl", "5m", agent)
	cmd.Env = e.cliEnv(admin.Endpoint(), staff.Token)
	cmd.Stdin = strings.NewReader("ls data; echo console-$((40+2)); exit 4\n")
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err = cmd.Run()
	var exitErr *exec.ExitError
	if !errors.As(err, &exitErr) || exitErr.ExitCode() != 4 || !strings.Contains(stdout.String(), "console-42") ||
		!strings.Contains(stdout.String(), "in.bin") {
		t.Fatalf("agentbox console: %v\nstdout %q\nstderr %q", err, stdout.String(), stderr.String())
	}
	id := strings.Fields(strings.TrimPrefix(stderr.String(), "console session "))[0]
	var rec *apiclient.ConsoleSession
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		rec, err = admin.GetConsoleSession(ctx, id)
		must(t, err)
		if rec.DisconnectedAt != nil || time.Now().After(deadline) {
			break
		}
	}
	if rec.StaffID != "dana@ops" || rec.AgentID != agent || rec.Reason != "ticket 7: check the workspace" ||
		rec.ConnectedAt == nil || rec.DisconnectedAt == nil || !bytes.Contains(rec.Transcript, []byte("console-42")) {
		t.Errorf("recorded console session %+v, transcript %q", rec, rec.Transcript)
	}
	if snapshot == nil || rec.SnapshotID != snapshot.Name {
		t.Errorf("console session recorded snapshot %q, the sandbox's is %+v", rec.SnapshotID, snapshot)
	}

	staffAPI := e.apiClient(admin.Endpoint(), staff.Token)
	short, err := staffAPI.CreateConsoleSession(ctx, apiclient.CreateConsoleSessionRequest{AgentID: agent, Reason: "expires", TTLSeconds: 1})
	must(t, err)
	time.Sleep(time.Until(short.ExpiresAt) + 100*time.Millisecond)
	if _, err := staffAPI.OpenConsole(ctx, short.ID, 0, 0); apiclient.CodeOf(err) != apiclient.CodeConsoleExpired {
		t.Errorf("an expired console session: %v, want console_session_expired", err)
	}
}

// tamperedAuditIsFound turns a refused call's record into a success in the
// database, behind the store's back, and expects verification (the API's
// and "agentbox audit verify") to name that record.
func tamperedAuditIsFound(t *testing.T, e *clusterEnv, cli string, admin *apiclient.Client, page *apiclient.AuditPage) {
	t.Helper()
	ctx := t.Context()
	var seq int64
	for _, r := range page.Records {
		if r.Result == string(apiclient.CodePermissionDenied) {
			seq = r.Seq
			break
		}
	}
	if seq == 0 {
		t.Fatal("no refused call in the audit log to tamper with")
	}
	// The control plane writes to the same file meanwhile (audit, leases),
	// so this connection waits for the write lock as the store's own do,
	// instead of failing at once with SQLITE_BUSY.
	db, err := sql.Open("sqlite", e.storePath+"?_pragma=busy_timeout(10000)")
	must(t, err)
	defer db.Close()
	// The append-only trigger refuses the store's own connections; someone
	// with the database's DDL rights can drop it, and the chain is what
	// still tells.
	for _, stmt := range []string{`DROP TRIGGER audit_log_no_update`, `UPDATE audit_log SET result = 'ok', status = 200 WHERE seq = ?`} {
		args := []any{}
		if strings.Contains(stmt, "?") {
			args = append(args, seq)
		}
		if _, err := db.ExecContext(ctx, stmt, args...); err != nil {
			t.Fatalf("tamper with audit record %d: %s: %v", seq, stmt, err)
		}
	}
	v, err := admin.VerifyAudit(ctx)
	if err != nil || v.OK || v.Break == nil || v.Break.Seq != seq {
		t.Fatalf("verify after tampering with record %d: %+v, %v", seq, v, err)
	}
	cmd := exec.CommandContext(ctx, cli, "audit", "verify")
	cmd.Env = e.cliEnv(admin.Endpoint(), admin.Token())
	out, err := cmd.CombinedOutput()
	var exitErr *exec.ExitError
	if !errors.As(err, &exitErr) || exitErr.ExitCode() != 3 || !strings.Contains(string(out), strconv.FormatInt(seq, 10)) {
		t.Errorf("agentbox audit verify after tampering with record %d: %v\n%s", seq, err, out)
	}
}

// apiSandbox starts the platform of platformEnv with the Compute API in
// front of it (an admin client is returned), and a sandbox named name of
// the real sandbox image (a template "tpl" that idles for an hour, then
// configure), and waits for it to run. It skips without the image: the
// supervisor is what the API talks to.
func apiSandbox(t *testing.T, name string, configure func(*v1alpha1.SandboxTemplate)) (*clusterEnv, *store.Store, *apiclient.Client, *v1alpha1.Sandbox) {
	t.Helper()
	image := os.Getenv(EnvSandboxImage)
	if image == "" {
		t.Skipf("%s is not set: the Compute API needs the real sandbox image's supervisor", EnvSandboxImage)
	}
	e, st, api := apiTemplate(t, image, configure)
	e.sandbox(name, "tpl")
	sbx, _ := e.waitPhase(name, v1alpha1.SandboxPhaseRunning, v1alpha1.ReasonRunning)
	return e, st, api, sbx
}

// apiTemplate is platformEnv with the Compute API in front of it (its
// options changed by options) and the template "tpl" of image (idle
// timeout an hour, so that only setActivity makes a sandbox idle),
// changed by configure.
func apiTemplate(t *testing.T, image string, configure func(*v1alpha1.SandboxTemplate),
	options ...func(*clusterEnv, *computeapi.Options)) (*clusterEnv, *store.Store, *apiclient.Client) {
	t.Helper()
	e, st, pool := platformEnv(t)
	api := e.computeAPIWithStore(pool, st, func(o *computeapi.Options) {
		for _, opt := range options {
			opt(e, o)
		}
	})
	e.template("tpl", func(tpl *v1alpha1.SandboxTemplate) {
		tpl.Spec.Image = image
		tpl.Spec.IdleTimeout = metav1.Duration{Duration: time.Hour}
		if configure != nil {
			configure(tpl)
		}
	})
	return e, st, api
}
