package computeapi

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"reflect"
	"slices"
	"testing"
	"time"

	api "github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
	"github.com/agentbox/terraform-provider-agentbox/internal/store"
)

// collectAgentEvents follows agentID's events after after until want of
// them came, and returns them.
func collectAgentEvents(t *testing.T, c *api.Client, agentID string, after int64, want int) []api.AgentEvent {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var evs []api.AgentEvent
	errEnough := errors.New("enough")
	err := c.FollowAgentEvents(ctx, agentID, after, func(e api.AgentEvent) error {
		evs = append(evs, e)
		if len(evs) == want {
			return errEnough
		}
		return nil
	})
	if !errors.Is(err, errEnough) {
		t.Fatalf("follow agent %s after %d: %v; got %+v", agentID, after, err, evs)
	}
	return evs
}

// An agent's stream carries its commands, run_command's and a run's, with
// their exit codes and the run's id, and the sandbox's events as the
// controller records them; a follower resumes with no gap and no
// duplicate, by the header or the query.
func TestAgentEvents(t *testing.T) {
	var srv *Server
	// No contract check: it reads a whole response, and this stream does
	// not end by itself.
	clients := realSupervisorAPIWith(t, apiSetup{store: tempStore(t), pushDelay: -1, noContract: true,
		server: func(s *Server) { srv = s }})
	admin, a1 := clients(adminToken), clients("agent-token:agent-1")
	ctx := context.Background()
	srv.agentEvents.Record(api.AgentEvent{Type: api.AgentEventReady, Agent: "agent-1", Namespace: "team-a", Sandbox: "sb-1",
		Pod: "sb-1-pod", Reason: "SandboxReady", Message: "sandbox is running"})
	if _, err := a1.RunCommand(ctx, "agent-1", api.RunCommandRequest{Command: []string{"sh", "-c", "exit 3"}}); err != nil {
		t.Fatal(err)
	}
	run, _, err := a1.StartRun(ctx, api.StartRunRequest{AgentID: "agent-1", Command: []string{"true"}})
	if err != nil {
		t.Fatal(err)
	}
	waitRun(t, a1, run.ID)
	evs := collectAgentEvents(t, a1, "agent-1", 0, 5)
	for i, e := range evs {
		if e.ID != int64(i+1) || e.Agent != "agent-1" || e.Namespace != "team-a" || e.Sandbox != "sb-1" || e.Time.IsZero() {
			t.Fatalf("event %d: %+v", i, e)
		}
	}
	if e := evs[0]; e.Type != api.AgentEventReady || e.Pod != "sb-1-pod" || e.Reason != "SandboxReady" {
		t.Errorf("ready: %+v", e)
	}
	started, ended := evs[1], evs[2]
	if started.Type != api.AgentEventCommandStarted || fmt.Sprint(started.Command) != "[sh -c exit 3]" || started.RunID != "" ||
		ended.Type != api.AgentEventCommandEnded || ended.CommandID != started.CommandID || ended.ExitCode == nil || *ended.ExitCode != 3 {
		t.Errorf("run_command: %+v %+v", started, ended)
	}
	started, ended = evs[3], evs[4]
	if started.Type != api.AgentEventCommandStarted || started.RunID != run.ID || ended.Type != api.AgentEventCommandEnded ||
		ended.RunID != run.ID || ended.CommandID != started.CommandID || ended.ExitCode == nil || *ended.ExitCode != 0 {
		t.Errorf("run: %+v %+v", started, ended)
	}
	// The admin sees the agent's events too, from any id.
	if got := collectAgentEvents(t, admin, "agent-1", 3, 2); got[0].ID != 4 || got[1].ID != 5 {
		t.Errorf("admin after 3: %+v", got)
	}
	// A live event reaches a follower at once (in process, no poll).
	live := make(chan api.AgentEvent, 1)
	fctx, stop := context.WithCancel(ctx)
	defer stop()
	go func() {
		_ = a1.FollowAgentEvents(fctx, "agent-1", 5, func(e api.AgentEvent) error {
			live <- e
			return errors.New("one is enough")
		})
	}()
	time.Sleep(100 * time.Millisecond) // the follower is connected
	srv.agentEvents.Record(api.AgentEvent{Type: api.AgentEventIdleStopping, Agent: "agent-1", Namespace: "team-a", Sandbox: "sb-1"})
	select {
	case e := <-live:
		if e.ID != 6 || e.Type != api.AgentEventIdleStopping {
			t.Errorf("live: %+v", e)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the live event did not arrive")
	}
	// Resume after each id, by the header and by the query: exactly the
	// rest, read off a stream the follower leaves.
	checkResumes(t, srv.Handler(), api.PathAgentEvents("agent-1"), "agent-token:agent-1", 6, 300*time.Millisecond)
}

// Another agent's token may not follow the agent; bad ids are
// invalid_argument; without a store the stream is unavailable.
func TestAgentEventsRefusals(t *testing.T) {
	var srv *Server
	clients := realSupervisorAPIWith(t, apiSetup{store: tempStore(t), pushDelay: -1, server: func(s *Server) { srv = s }})
	ctx := context.Background()
	err := clients("agent-token:agent-2").FollowAgentEvents(ctx, "agent-1", 0, func(api.AgentEvent) error { return nil })
	wantAPIError(t, err, api.CodePermissionDenied, http.StatusForbidden)
	for _, q := range []string{"x", "-1", "1.5"} {
		req := httptest.NewRequest(http.MethodGet, api.PathAgentEvents("agent-1")+"?after="+q, nil)
		req.Header.Set("Authorization", "Bearer agent-token:agent-1")
		rec := httptest.NewRecorder()
		srv.Handler().ServeHTTP(rec, req)
		if rec.Code != http.StatusBadRequest {
			t.Errorf("after=%s: %d %s", q, rec.Code, rec.Body)
		}
	}
	// Raw: the client retries an unavailable API.
	var noStore *Server
	realSupervisorAPIWith(t, apiSetup{pushDelay: -1, server: func(s *Server) { noStore = s }})
	req := httptest.NewRequest(http.MethodGet, api.PathAgentEvents("agent-1"), nil)
	req.Header.Set("Authorization", "Bearer "+adminToken)
	rec := httptest.NewRecorder()
	noStore.Handler().ServeHTTP(rec, req)
	var body api.ErrorBody
	if _ = json.Unmarshal(rec.Body.Bytes(), &body); rec.Code != http.StatusServiceUnavailable || body.Error == nil || body.Error.Code != api.CodeUnavailable {
		t.Errorf("without a store: %d %s", rec.Code, rec.Body)
	}
}

// The sweeper's pruning deletes agent events past the run retention.
func TestAgentEventsRetention(t *testing.T) {
	st := tempStore(t)
	srv := &Server{store: st, runRetention: time.Hour}
	old := time.Now().Add(-2 * time.Hour)
	if _, err := st.AppendAgentEvents(context.Background(), "agent-1",
		store.AgentEvent{Type: "ready", Data: "{}", At: old}, store.AgentEvent{Type: "stopped", Data: "{}"}); err != nil {
		t.Fatal(err)
	}
	srv.pruneAgentEvents(time.Now(), srv.log)
	evs, err := st.ListAgentEvents(context.Background(), "agent-1", 0, 0)
	if err != nil || len(evs) != 1 || evs[0].Seq != 2 {
		t.Fatalf("after pruning: %+v, %v", evs, err)
	}
}

// TestAgentEventMatchesOpenAPI checks the document's AgentEvent against
// the Go type both ways (every field a property, every field always sent
// required) and its type enum against the client's types.
func TestAgentEventMatchesOpenAPI(t *testing.T) {
	c := loadContract(t)
	schema := c.doc["components"].(map[string]any)["schemas"].(map[string]any)["AgentEvent"].(map[string]any)
	props := schema["properties"].(map[string]any)
	var required []string
	for _, r := range schema["required"].([]any) {
		required = append(required, r.(string))
	}
	ours := jsonFields(reflect.TypeFor[api.AgentEvent]())
	for name, omitempty := range ours {
		if _, ok := props[name]; !ok {
			t.Errorf("the OpenAPI AgentEvent has no property %q, which the API sends", name)
		}
		if !omitempty && !slices.Contains(required, name) {
			t.Errorf("the OpenAPI AgentEvent does not require %q, which the API always sends", name)
		}
	}
	for name := range props {
		if _, ok := ours[name]; !ok {
			t.Errorf("the OpenAPI AgentEvent has property %q, which the API's type does not have", name)
		}
	}
	var enum []string
	for _, v := range props["type"].(map[string]any)["enum"].([]any) {
		enum = append(enum, v.(string))
	}
	if !slices.Equal(enum, api.AgentEventTypes) {
		t.Errorf("the OpenAPI AgentEvent types %v, the client's %v", enum, api.AgentEventTypes)
	}
}
