package computeapi

import (
	"context"
	"encoding/json"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/coder/websocket"

	api "github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
	"github.com/agentbox/terraform-provider-agentbox/internal/store"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"
)

// TestSupervisorRecordsJoinTheAuditChain: the real supervisor's record of
// each call it served (a command, a stream, files, a PTY session) comes
// back with its answer and is appended right after the API's own record of
// the call, with the same caller, agent and request ID; the supervisor was
// sent that request ID and holds it in its record. The PTY session's
// record is kept, not relayed to the client. A supervisor call no API call
// made (the controller's, a background push) is recorded as the control
// plane's, for the agent whose sandbox it is. The chain verifies.
func TestSupervisorRecordsJoinTheAuditChain(t *testing.T) {
	st := tempStore(t)
	var srv *Server
	clients := realSupervisorAPIWith(t, apiSetup{store: st, pushDelay: -1, server: func(s *Server) { srv = s }})
	c := clients("agent-token:agent-1")
	ctx := context.Background()

	if res, err := c.RunCommand(ctx, "agent-1", api.RunCommandRequest{Command: []string{"sh", "-c", "exit 7"}}); err != nil || res.ExitCode != 7 {
		t.Fatalf("run_command: %+v, %v", res, err)
	}
	if _, err := c.RunCommandStream(ctx, "agent-1", api.RunCommandRequest{Command: []string{"echo", "hi"}}, func(api.CommandEvent) error { return nil }); err != nil {
		t.Fatal(err)
	}
	if _, err := c.PutFile(ctx, "agent-1", "notes.txt", strings.NewReader("hello"), 0); err != nil {
		t.Fatal(err)
	}
	if err := c.DeleteFile(ctx, "agent-1", "notes.txt", false); err != nil {
		t.Fatal(err)
	}

	// A PTY session through the API, its frames read raw: no audit
	// message reaches the client.
	u := strings.Replace(c.Endpoint(), "https://", "wss://", 1) + api.PathAgentPTY("agent-1") + "?" +
		supervisorapi.PTYRequest{Command: []string{"sh", "-c", "exit 4"}}.Query().Encode()
	conn, _, err := websocket.Dial(ctx, u, &websocket.DialOptions{HTTPClient: c.MCPHTTPClient(), Subprotocols: []string{supervisorapi.PTYSubprotocol}})
	if err != nil {
		t.Fatal(err)
	}
	var sawExit bool
	for {
		typ, data, err := conn.Read(ctx)
		if err != nil {
			break
		}
		if typ == websocket.MessageText {
			var m supervisorapi.PTYMessage
			_ = json.Unmarshal(data, &m)
			if m.Type == supervisorapi.PTYMessageExit {
				sawExit = true
			} else {
				t.Errorf("the client got the control message %s", data)
			}
		}
	}
	if !sawExit {
		t.Error("no exit message")
	}

	// The controller's kind of call: the pool, outside any API call.
	sb, apiErr := srv.agentSandbox(ctx, "agent-1")
	if apiErr != nil {
		t.Fatal(apiErr)
	}
	sup, err := srv.conns.For(sb)
	if err != nil {
		t.Fatal(err)
	}
	if err := sup.Flush(ctx); err != nil {
		t.Fatal(err)
	}

	admin := clients(adminToken)
	want := []struct{ op, sup string }{
		{"run_command", "supervisor:run_command"}, {"run_command_stream", "supervisor:run_command_stream"},
		{"put_file", "supervisor:write_file"}, {"delete_file", "supervisor:delete_file"},
		{"run_command_pty", "supervisor:pty_session"},
	}
	var recs []api.AuditRecord
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		page, err := admin.QueryAudit(ctx, url.Values{"limit": {"1000"}})
		if err != nil {
			t.Fatal(err)
		}
		recs = page.Records
		if len(recs) >= 2*len(want)+1 || time.Now().After(deadline) {
			break
		}
	}
	bySeq := map[int64]api.AuditRecord{}
	for _, r := range recs {
		bySeq[r.Seq] = r
	}
	for _, w := range want {
		var call *api.AuditRecord
		for i := range recs {
			if recs[i].Operation == w.op {
				call = &recs[i]
			}
		}
		if call == nil {
			t.Errorf("no record of %s", w.op)
			continue
		}
		next, ok := bySeq[call.Seq+1]
		if !ok || next.Operation != w.sup {
			t.Errorf("after %s (seq %d): %+v, want the supervisor's %s", w.op, call.Seq, next, w.sup)
			continue
		}
		if next.Caller != call.Caller || next.CallerKind != call.CallerKind || next.AgentID != "agent-1" || next.RequestID != call.RequestID {
			t.Errorf("%s: caller %s/%s agent %q request %q, want the call's %s/%s agent-1 %q",
				w.sup, next.Caller, next.CallerKind, next.AgentID, next.RequestID, call.Caller, call.CallerKind, call.RequestID)
		}
		var rec supervisorapi.AuditRecord
		if err := json.Unmarshal([]byte(next.Detail), &rec); err != nil {
			t.Errorf("%s: detail %q: %v", w.sup, next.Detail, err)
			continue
		}
		if rec.RequestID != call.RequestID || "supervisor:"+rec.Tool != w.sup || rec.ParamsSHA256 != next.ParamsHash {
			t.Errorf("%s: the supervisor's record %+v does not match the stored one %+v", w.sup, rec, next)
		}
		switch w.op {
		case "run_command":
			if rec.ExitCode == nil || *rec.ExitCode != 7 {
				t.Errorf("run_command's supervisor record %+v, want exit code 7", rec)
			}
		case "run_command_pty":
			if rec.ExitCode == nil || *rec.ExitCode != 4 {
				t.Errorf("the PTY session's supervisor record %+v, want exit code 4", rec)
			}
		}
	}
	var flush *api.AuditRecord
	for i := range recs {
		if recs[i].Operation == "supervisor:flush" {
			flush = &recs[i]
		}
	}
	if flush == nil || flush.Caller != controlPlaneCaller || flush.CallerKind != callerKindSystem || flush.AgentID != "agent-1" || flush.Status != 204 {
		t.Errorf("the control plane's own supervisor call: %+v", flush)
	}
	v, err := admin.VerifyAudit(ctx)
	if err != nil || !v.OK {
		t.Errorf("verify: %+v, %v", v, err)
	}
}

// Text that a sandbox sends is cut to what the store's columns take, and a
// hash that is not one is left out, so that one record cannot hold up the
// audit log.
func TestSupervisorEntryCleansWhatTheSandboxSent(t *testing.T) {
	r := supervisorRecord{rec: supervisorapi.AuditRecord{Tool: "x\x00" + strings.Repeat("y", 500) + "\xff", ParamsSHA256: "not a hash",
		ErrorCode: "e\x00", HTTPStatus: 500, DurationMS: -5}, raw: []byte(`{}`), at: time.Now()}
	e := supervisorEntry(store.AuditEntry{Caller: "c", Operation: "o"}, r)
	if strings.ContainsAny(e.Operation, "\x00\xff") || len(e.Operation) > len(supervisorOpPrefix)+maxSupervisorField ||
		e.ParamsHash != "" || e.Result != "e" || e.Duration != 0 {
		t.Errorf("entry %+v", e)
	}
}
