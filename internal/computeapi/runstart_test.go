package computeapi

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	api "github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
	"github.com/agentbox/terraform-provider-agentbox/internal/store"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor"
)

// TestStartRunInProcess: a schedule's run, started in process, is recorded
// with the schedule as caller and name, executes in the agent's sandbox, is
// listed by schedule, and a repeated request id returns it; a schedule of
// another namespace than the sandbox's is refused; an in-process cancel
// stops a running run.
func TestStartRunInProcess(t *testing.T) {
	st := tempStore(t)
	ws := t.TempDir()
	var srv *Server
	c := realSupervisorAPIWith(t, apiSetup{
		store: st, configure: func(cfg *supervisor.Config) { cfg.Workspace = ws }, pushDelay: -1,
		server: func(s *Server) { srv = s },
	})(adminToken)
	ctx := context.Background()
	started := testutil.ToFloat64(metricRunsStarted.WithLabelValues("agent"))
	req := InProcessRun{Caller: "schedule:team-a/nightly", RequestID: "schedule-20261122T100000Z", Schedule: "team-a/nightly",
		Namespace: "team-a", AgentID: "agent-1", Command: []string{"sh", "-c", "echo $GREETING"}, Env: map[string]string{"GREETING": "hi"}}
	run, created, err := srv.StartRunInProcess(ctx, req)
	if err != nil || !created || run.Schedule != "team-a/nightly" || run.Caller != req.Caller {
		t.Fatalf("start: %+v, created %v, %v", run, created, err)
	}
	done := waitRun(t, c, run.ID)
	if done.Status != api.RunSucceeded || done.Schedule != "team-a/nightly" || done.OutputBytes != int64(len("hi\n")) {
		t.Fatalf("run ended %+v", done)
	}
	again, created, err := srv.StartRunInProcess(ctx, req)
	if err != nil || created || again.ID != run.ID {
		t.Errorf("repeated start: %+v, created %v, %v", again, created, err)
	}
	// Counted as started once, as POST /v1/runs counts.
	if got := testutil.ToFloat64(metricRunsStarted.WithLabelValues("agent")) - started; got != 1 {
		t.Errorf("agentbox_runs_started_total{mode=agent} grew by %v, want 1", got)
	}
	list, err := c.ListRuns(ctx, api.RunFilter{Schedule: "team-a/nightly"})
	if err != nil || len(list.Runs) != 1 || list.Runs[0].ID != run.ID {
		t.Errorf("runs of the schedule: %+v, %v", list, err)
	}
	if list, err := c.ListRuns(ctx, api.RunFilter{Schedule: "team-a/other"}); err != nil || len(list.Runs) != 0 {
		t.Errorf("runs of another schedule: %+v, %v", list, err)
	}

	other := req
	other.Namespace, other.RequestID = "team-b", "schedule-20261122T100100Z"
	if _, _, err := srv.StartRunInProcess(ctx, other); !errors.Is(err, store.ErrInvalid) {
		t.Errorf("a schedule of another namespace: %v, want ErrInvalid", err)
	}

	long := req
	long.RequestID, long.Command, long.TimeoutSeconds = "schedule-20261122T100200Z", []string{"sleep", "60"}, 120
	run, _, err = srv.StartRunInProcess(ctx, long)
	if err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		r, err := st.GetRun(ctx, run.ID)
		if err != nil {
			t.Fatal(err)
		}
		if r.Status == store.RunRunning {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("run never ran: %+v", r)
		}
	}
	if _, err := srv.CancelRunInProcess(ctx, run.ID, "schedule:team-a/nightly"); err != nil {
		t.Fatal(err)
	}
	if r := waitRun(t, c, run.ID); r.Status != api.RunCancelled || r.CancelledBy != "schedule:team-a/nightly" {
		t.Errorf("cancelled run ended %+v", r)
	}
	if _, err := srv.CancelRunInProcess(ctx, run.ID, "someone"); err != nil {
		t.Errorf("cancel of a finished run: %v", err)
	}

	// A run cancelled while queued ends there, and is counted, as
	// through the API.
	queued, _, err := st.CreateRun(ctx, store.Run{Caller: "schedule:team-a/nightly", Mode: store.RunModeAgent, AgentID: "agent-1",
		Command: store.RunCommand{Argv: []string{"true"}, TimeoutSeconds: 30}})
	if err != nil {
		t.Fatal(err)
	}
	cancelledRuns := testutil.ToFloat64(metricRunsFinished.WithLabelValues("cancelled", "agent"))
	if r, err := srv.CancelRunInProcess(ctx, queued.ID, "schedule:team-a/nightly"); err != nil || r.Status != store.RunCancelled {
		t.Fatalf("cancel a queued run in process: %+v, %v", r, err)
	}
	if got := testutil.ToFloat64(metricRunsFinished.WithLabelValues("cancelled", "agent")) - cancelledRuns; got != 1 {
		t.Errorf("agentbox_runs_finished_total{status=cancelled} grew by %v, want 1", got)
	}
}
