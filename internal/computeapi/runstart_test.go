package computeapi

import (
	"context"
	"errors"
	"strings"
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

// TestStartRunInProcessModes: a schedule's pool and job runs, started in
// process, are checked as POST /v1/runs checks them (the same messages),
// recorded with their mode and options, and bounded by the schedule's
// namespace: a pool or template of another namespace is refused.
func TestStartRunInProcessModes(t *testing.T) {
	ctx := context.Background()
	f := servedPoolFixture(t)
	c := f.client(t, adminToken)
	srv := f.services
	base := InProcessRun{Caller: "schedule:team-a/nightly", Schedule: "team-a/nightly", Namespace: "team-a", Command: []string{"true"}}

	pool := base
	pool.RequestID, pool.Mode, pool.Pool = "schedule-20261122T100000Z", api.RunModePool, "team-a/p"
	run, created, err := srv.StartRunInProcess(ctx, pool)
	if err != nil || !created || run.Mode != "pool" || run.Pool != "team-a/p" || run.Schedule != "team-a/nightly" || run.Caller != base.Caller {
		t.Fatalf("start pool run: %+v, created %v, %v", run, created, err)
	}
	if done := waitRun(t, c, run.ID); done.Sandbox != "team-a/w-1" || done.Schedule != "team-a/nightly" {
		t.Errorf("pool run ended %+v, want it in the pool's sandbox", done)
	}

	ttl := 600
	job := base
	job.RequestID, job.Mode, job.Template = "schedule-20261122T100100Z", api.RunModeJob, "team-a/nope"
	job.BackoffLimit, job.ActiveDeadlineSeconds, job.TTLSecondsAfterFinished = 2, 300, &ttl
	run, created, err = srv.StartRunInProcess(ctx, job)
	if err != nil || !created || run.Mode != "job" || run.Template != "team-a/nope" || run.BackoffLimit != 2 ||
		run.ActiveDeadlineSeconds != 300 || run.TTLSecondsAfterFinished == nil || *run.TTLSecondsAfterFinished != 600 {
		t.Fatalf("start job run: %+v, created %v, %v", run, created, err)
	}
	if done := waitRun(t, c, run.ID); done.Status != api.RunFailed || done.Reason != "InvalidArgument" || done.Schedule != "team-a/nightly" {
		t.Errorf("job run of a missing template ended %+v", done)
	}

	for _, bad := range []struct {
		name, want string
		mutate     func(*InProcessRun)
	}{
		{"pool of another namespace", `pool team-b/p is in namespace "team-b", not "team-a"`,
			func(r *InProcessRun) { r.Mode, r.Pool = api.RunModePool, "team-b/p" }},
		{"template of another namespace", `template team-b/t is in namespace "team-b", not "team-a"`,
			func(r *InProcessRun) { r.Mode, r.Template = api.RunModeJob, "team-b/t" }},
		{"backoff limit of a pool run", `backoff_limit does not apply to a run of mode "pool"`,
			func(r *InProcessRun) { r.Mode, r.Pool, r.BackoffLimit = api.RunModePool, "team-a/p", 1 }},
		{"backoff limit out of range", "backoff_limit must be between 0 and 10, got 11",
			func(r *InProcessRun) { r.Mode, r.Template, r.BackoffLimit = api.RunModeJob, "team-a/t", 11 }},
		{"agent of a job run", `agent_id does not apply to a run of mode "job"`,
			func(r *InProcessRun) { r.Mode, r.Template, r.AgentID = api.RunModeJob, "team-a/t", "agent-1" }},
		{"no agent", "agent ID must not be empty", func(r *InProcessRun) {}},
		{"negative deadline", "active_deadline_seconds must not be negative",
			func(r *InProcessRun) { r.Mode, r.Template, r.ActiveDeadlineSeconds = api.RunModeJob, "team-a/t", -1 }},
	} {
		req := base
		req.RequestID = "schedule-bad"
		bad.mutate(&req)
		if _, _, err := srv.StartRunInProcess(ctx, req); !errors.Is(err, store.ErrInvalid) || !strings.Contains(err.Error(), bad.want) {
			t.Errorf("%s: %v, want ErrInvalid saying %q", bad.name, err, bad.want)
		}
	}
	// The same checks as the API's: its answer to the same request says
	// the same.
	_, _, err = c.StartRun(ctx, api.StartRunRequest{Mode: api.RunModePool, Pool: "team-a/p", BackoffLimit: 1, Command: []string{"true"}})
	if api.CodeOf(err) != api.CodeInvalidArgument || !strings.Contains(err.Error(), `backoff_limit does not apply to a run of mode "pool"`) {
		t.Errorf("POST /v1/runs of the same request: %v", err)
	}
}
