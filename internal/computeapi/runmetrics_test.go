package computeapi

import (
	"context"
	"errors"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/agentbox/terraform-provider-agentbox/internal/store"
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
	// one is still queued, and one still runs (its executor heartbeats it
	// now, so the sweeper does not fail it as lost).
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
