package computeapi

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	dto "github.com/prometheus/client_model/go"

	api "github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
	"github.com/agentbox/terraform-provider-agentbox/internal/store"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor"
)

// settableClock is a store clock a test moves back to backdate records.
type settableClock struct {
	mu sync.Mutex
	at time.Time // zero: the wall clock
}

func (c *settableClock) now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.at.IsZero() {
		return time.Now()
	}
	return c.at
}

func (c *settableClock) set(at time.Time) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.at = at
}

// The run sweeper deletes the runs that finished before the retention, and
// neither the live runs nor the recently finished ones, and counts them.
func TestRunRetentionDeletesExpiredRuns(t *testing.T) {
	clk := &settableClock{}
	st, err := store.OpenSQLite(context.Background(), filepath.Join(t.TempDir(), "agentbox.db"), store.Options{Now: clk.now})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	ctx := context.Background()
	create := func() store.Run {
		t.Helper()
		r, created, err := st.CreateRun(ctx, store.Run{Caller: "agent agent-1", Mode: store.RunModeAgent, AgentID: "agent-1",
			Command: store.RunCommand{Argv: []string{"true"}, TimeoutSeconds: 30}})
		if err != nil || !created {
			t.Fatalf("create run: %v, %v", created, err)
		}
		return r
	}

	// Ten days ago: one run succeeded, one was cancelled while queued,
	// one was queued (the sweeper fails it as lost, so it ends inside the
	// retention), and one still runs (its executor heartbeats it now, so
	// the sweeper leaves it alone).
	clk.set(time.Now().Add(-10 * 24 * time.Hour))
	oldDone := create()
	if _, err := st.StartRunAttempt(ctx, oldDone.ID, "replica-x", "team-a/sb-1"); err != nil {
		t.Fatal(err)
	}
	if _, err := st.FinishRun(ctx, oldDone.ID, store.RunResult{Status: store.RunSucceeded}); err != nil {
		t.Fatal(err)
	}
	oldCancelled := create()
	if _, err := st.RequestRunCancel(ctx, oldCancelled.ID, "user-1"); err != nil {
		t.Fatal(err)
	}
	oldQueued := create()
	oldRunning := create()
	if _, err := st.StartRunAttempt(ctx, oldRunning.ID, "replica-x", "team-a/sb-1"); err != nil {
		t.Fatal(err)
	}
	// An hour ago, inside the retention: a failed run.
	clk.set(time.Now().Add(-time.Hour))
	recentDone := create()
	if _, err := st.FinishRun(ctx, recentDone.ID, store.RunResult{Status: store.RunFailed, Reason: "Test"}); err != nil {
		t.Fatal(err)
	}
	clk.set(time.Time{})
	if _, err := st.HeartbeatRun(ctx, oldRunning.ID, "replica-x"); err != nil {
		t.Fatal(err)
	}

	deleted := testutil.ToFloat64(metricRunsDeleted)
	lost := testutil.ToFloat64(metricRunsFinished.WithLabelValues("failed", "agent"))
	runsAPI(t, st, t.TempDir(), func(o *Options) {
		o.RunSweepInterval = 20 * time.Millisecond
		o.RunRetention = 24 * time.Hour
	})
	deadline := time.Now().Add(30 * time.Second)
	for {
		_, err1 := st.GetRun(ctx, oldDone.ID)
		_, err2 := st.GetRun(ctx, oldCancelled.ID)
		if errors.Is(err1, store.ErrNotFound) && errors.Is(err2, store.ErrNotFound) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the expired runs are still there after 30s: %v, %v", err1, err2)
		}
		time.Sleep(20 * time.Millisecond)
	}
	for _, id := range []string{oldQueued.ID, oldRunning.ID, recentDone.ID} {
		if _, err := st.GetRun(ctx, id); err != nil {
			t.Errorf("run %s was deleted: %v", id, err)
		}
	}
	if got := testutil.ToFloat64(metricRunsDeleted) - deleted; got != 2 {
		t.Errorf("agentbox_runs_deleted_total grew by %v, want 2", got)
	}
	// The queued run was failed as lost in the same sweep, before the
	// deletion, and counted as finished.
	if got := testutil.ToFloat64(metricRunsFinished.WithLabelValues("failed", "agent")) - lost; got != 1 {
		t.Errorf("agentbox_runs_finished_total{status=failed} grew by %v, want 1 (the lost queued run)", got)
	}
}

// Without a retention the sweeper deletes nothing.
func TestRunRetentionZeroKeepsRuns(t *testing.T) {
	clk := &settableClock{}
	st, err := store.OpenSQLite(context.Background(), filepath.Join(t.TempDir(), "agentbox.db"), store.Options{Now: clk.now})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	ctx := context.Background()
	clk.set(time.Now().Add(-1000 * 24 * time.Hour))
	old, _, err := st.CreateRun(ctx, store.Run{Caller: "agent agent-1", Mode: store.RunModeAgent, AgentID: "agent-1",
		Command: store.RunCommand{Argv: []string{"true"}, TimeoutSeconds: 30}})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := st.RequestRunCancel(ctx, old.ID, "user-1"); err != nil {
		t.Fatal(err)
	}
	clk.set(time.Time{})
	var srv *Server
	realSupervisorAPIWith(t, apiSetup{store: st, pushDelay: -1, server: func(s *Server) { srv = s },
		options: func(o *Options) { o.RunSweepInterval = 10 * time.Millisecond }})
	// Sweeps run meanwhile; then ask for one more deliberately and look.
	time.Sleep(100 * time.Millisecond)
	srv.pruneRuns(time.Now(), srv.log)
	if _, err := st.GetRun(ctx, old.ID); err != nil {
		t.Errorf("with no retention, a run finished long ago was deleted: %v", err)
	}
}

func histogramCount(t *testing.T, h *prometheus.HistogramVec, labels ...string) uint64 {
	t.Helper()
	var m dto.Metric
	if err := h.WithLabelValues(labels...).(prometheus.Metric).Write(&m); err != nil {
		t.Fatal(err)
	}
	return m.GetHistogram().GetSampleCount()
}

// A run through the API moves the run metrics: started, attempts,
// finished by status, the duration, and the open event streams while a
// follower reads.
func TestRunMetrics(t *testing.T) {
	st := tempStore(t)
	ws := t.TempDir()
	// Without the contract check, whose recorder would hold the event
	// stream until it ends.
	c := realSupervisorAPIWith(t, apiSetup{store: st, pushDelay: -1, noContract: true,
		configure: func(cfg *supervisor.Config) { cfg.Workspace = ws }})("agent-token:agent-1")
	ctx := context.Background()
	started := testutil.ToFloat64(metricRunsStarted.WithLabelValues("agent"))
	attempts := testutil.ToFloat64(metricRunAttempts.WithLabelValues("agent"))
	succeeded := testutil.ToFloat64(metricRunsFinished.WithLabelValues("succeeded", "agent"))
	failed := testutil.ToFloat64(metricRunsFinished.WithLabelValues("failed", "agent"))
	durations := histogramCount(t, metricRunSeconds, "agent")
	streams := testutil.ToFloat64(metricRunEventStreams)

	req := api.StartRunRequest{AgentID: "agent-1", Command: []string{"echo", "hi"}, Cwd: ws, RequestID: "req-1"}
	run, _, err := c.StartRun(ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	waitRun(t, c, run.ID)
	// A repeat of the request id is the same run, not another start.
	if _, created, err := c.StartRun(ctx, req); err != nil || created {
		t.Fatalf("repeat: created %v, %v", created, err)
	}
	bad, _, err := c.StartRun(ctx, api.StartRunRequest{AgentID: "agent-1", Command: []string{"false"}, Cwd: ws})
	if err != nil {
		t.Fatal(err)
	}
	waitRun(t, c, bad.ID)
	// The executor counts a run's end just after recording it.
	waitFor(t, "count of the runs' ends", func() bool {
		return testutil.ToFloat64(metricRunsFinished.WithLabelValues("failed", "agent")) == failed+1 &&
			testutil.ToFloat64(metricRunsFinished.WithLabelValues("succeeded", "agent")) == succeeded+1
	})
	if got := testutil.ToFloat64(metricRunsStarted.WithLabelValues("agent")) - started; got != 2 {
		t.Errorf("agentbox_runs_started_total{mode=agent} grew by %v, want 2", got)
	}
	if got := testutil.ToFloat64(metricRunAttempts.WithLabelValues("agent")) - attempts; got != 2 {
		t.Errorf("agentbox_run_attempts_total{mode=agent} grew by %v, want 2", got)
	}
	if got := histogramCount(t, metricRunSeconds, "agent") - durations; got != 2 {
		t.Errorf("agentbox_run_duration_seconds{mode=agent} observed %d runs, want 2", got)
	}
	// The samples carry the run as their exemplar: the start, the start
	// of its attempt, its end and its duration name the failing run, the
	// last of each.
	wantExemplar := map[string]string{"run_id": bad.ID, "agent": "agent-1"}
	for name, m := range map[string]prometheus.Metric{
		"agentbox_runs_started_total":                 metricRunsStarted.WithLabelValues("agent").(prometheus.Metric),
		"agentbox_run_attempts_total":                 metricRunAttempts.WithLabelValues("agent").(prometheus.Metric),
		"agentbox_runs_finished_total{status=failed}": metricRunsFinished.WithLabelValues("failed", "agent").(prometheus.Metric),
		"agentbox_run_duration_seconds":               metricRunSeconds.WithLabelValues("agent").(prometheus.Metric),
	} {
		var d dto.Metric
		if err := m.Write(&d); err != nil {
			t.Fatal(err)
		}
		ex := d.GetCounter().GetExemplar()
		if h := d.GetHistogram(); h != nil {
			for _, b := range h.GetBucket() {
				if e := b.GetExemplar(); e != nil && (ex == nil || e.GetTimestamp().AsTime().After(ex.GetTimestamp().AsTime())) {
					ex = e
				}
			}
		}
		got := map[string]string{}
		for _, l := range ex.GetLabel() {
			got[l.GetName()] = l.GetValue()
		}
		if len(got) != len(wantExemplar) || got["run_id"] != wantExemplar["run_id"] || got["agent"] != wantExemplar["agent"] {
			t.Errorf("%s exemplar %v, want %v", name, got, wantExemplar)
		}
	}

	// A run cancelled while queued (recorded, its executor not started)
	// ends, and is counted, at the cancel.
	queued, _, err := st.CreateRun(ctx, store.Run{Caller: "agent agent-1", Mode: store.RunModeAgent, AgentID: "agent-1",
		Command: store.RunCommand{Argv: []string{"true"}, TimeoutSeconds: 30}})
	if err != nil {
		t.Fatal(err)
	}
	cancelledRuns := testutil.ToFloat64(metricRunsFinished.WithLabelValues("cancelled", "agent"))
	if r, err := c.CancelRun(ctx, queued.ID); err != nil || r.Status != api.RunCancelled {
		t.Fatalf("cancel a queued run: %+v, %v", r, err)
	}
	if got := testutil.ToFloat64(metricRunsFinished.WithLabelValues("cancelled", "agent")) - cancelledRuns; got != 1 {
		t.Errorf("agentbox_runs_finished_total{status=cancelled} grew by %v, want 1", got)
	}

	// While a follower reads, its stream is counted; once it has ended,
	// no more. The run waits for the follower to let it end, so that the
	// stream is still open when its first event arrives.
	gate := filepath.Join(ws, "go")
	waiting, _, err := c.StartRun(ctx, api.StartRunRequest{AgentID: "agent-1", Cwd: ws, TimeoutSeconds: 60,
		Command: []string{"sh", "-c", "while [ ! -e " + gate + " ]; do sleep 0.05; done"}})
	if err != nil {
		t.Fatal(err)
	}
	open := -1.0
	if err := c.FollowRun(ctx, waiting.ID, 0, func(api.RunEvent) error {
		if open < 0 {
			open = testutil.ToFloat64(metricRunEventStreams)
			return os.WriteFile(gate, nil, 0o600)
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	if open != streams+1 {
		t.Errorf("agentbox_run_event_streams while following: %v, want %v", open, streams+1)
	}
	waitFor(t, "uncounting of the ended stream", func() bool { return testutil.ToFloat64(metricRunEventStreams) == streams })
}

// An exemplar holds at most 128 runes of label names and values, and the
// client panics past it: a label that does not fit is left out, the run
// id always stays.
func TestRunExemplarFits(t *testing.T) {
	long := strings.Repeat("a", 200)
	got := runExemplar(store.Run{ID: "run-0123456789abcdef0123", AgentID: long, RequestID: "req-1"})
	if len(got) != 2 || got["run_id"] != "run-0123456789abcdef0123" || got["request_id"] != "req-1" {
		t.Errorf("exemplar %v: want the run id and the request id, without the 200-rune agent", got)
	}
	c := prometheus.NewCounterVec(prometheus.CounterOpts{Name: "exemplar_fit_total", Help: "test"}, []string{"mode"})
	countRun(c, store.Run{ID: "run-0123456789abcdef0123", AgentID: long, RequestID: long}, "agent")
	if v := testutil.ToFloat64(c.WithLabelValues("agent")); v != 1 {
		t.Errorf("counter %v after one run with long labels, want 1", v)
	}
}
