package store_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/agentbox/terraform-provider-agentbox/internal/store"
)

// TestRunModes is the suite of pool and job runs' records (attempts, the
// job options, the run's own TTL), run against both backends.
func TestRunModes(t *testing.T) {
	cases := []struct {
		name string
		run  func(t *testing.T, b backend)
	}{
		{"JobOptions", testRunJobOptions},
		{"AttemptHistory", testRunAttemptHistory},
		{"Place", testRunPlace},
		{"TTL", testRunTTL},
	}
	for _, b := range backends {
		t.Run(b.name, func(t *testing.T) {
			for _, c := range cases {
				t.Run(c.name, func(t *testing.T) { c.run(t, b) })
			}
		})
	}
}

func jobRun(caller string) store.Run {
	return store.Run{Caller: caller, Mode: store.RunModeJob, Template: "ns/tpl",
		Command: store.RunCommand{Argv: []string{"true"}}}
}

func intp(v int) *int { return &v }

// testRunJobOptions: a job run takes its own id as its agent id and keeps
// its options; the options out of range, or on a mode without retries,
// are refused.
func testRunJobOptions(t *testing.T, b backend) {
	ctx := context.Background()
	s := open(t, b.newDSN(t), store.Options{})
	r := jobRun("tok-1")
	r.BackoffLimit, r.ActiveDeadlineSeconds, r.TTLSecondsAfterFinished = 3, 120, intp(0)
	got := mustCreateRun(t, s, r)
	if got.AgentID != got.ID || got.BackoffLimit != 3 || got.ActiveDeadlineSeconds != 120 ||
		got.TTLSecondsAfterFinished == nil || *got.TTLSecondsAfterFinished != 0 || got.ExpiresAt != nil {
		t.Fatalf("created job run %+v", got)
	}
	read, err := s.GetRun(ctx, got.ID)
	if err != nil {
		t.Fatal(err)
	}
	sameRun(t, "job run read back", read, got)
	// Without a TTL, none is read back.
	plain := mustCreateRun(t, s, jobRun("tok-1"))
	if read, err := s.GetRun(ctx, plain.ID); err != nil || read.TTLSecondsAfterFinished != nil {
		t.Fatalf("job run without a TTL read back %+v, %v", read, err)
	}

	for name, mod := range map[string]func(*store.Run){
		"backoff over the bound": func(r *store.Run) { r.BackoffLimit = store.MaxRunBackoffLimit + 1 },
		"negative backoff":       func(r *store.Run) { r.BackoffLimit = -1 },
		"negative deadline":      func(r *store.Run) { r.ActiveDeadlineSeconds = -1 },
		"negative ttl":           func(r *store.Run) { r.TTLSecondsAfterFinished = intp(-1) },
		"agent run with retries": func(r *store.Run) {
			r.Mode, r.Template, r.AgentID, r.BackoffLimit = store.RunModeAgent, "", "agent-1", 1
		},
		"pool run with retries": func(r *store.Run) { r.Mode, r.Template, r.Pool, r.BackoffLimit = store.RunModePool, "", "ns/pool", 1 },
	} {
		r := jobRun("tok-1")
		mod(&r)
		if _, _, err := s.CreateRun(ctx, r); !errors.Is(err, store.ErrInvalid) {
			t.Errorf("%s: %v, want ErrInvalid", name, err)
		}
	}
}

// testRunAttemptHistory: every attempt is recorded with its sandbox,
// times and end; a retried attempt is closed by FinishRunAttempt, the last
// one by the run's end, and an attempt left by a lost executor by the
// next start or the sweep.
func testRunAttemptHistory(t *testing.T, b backend) {
	ctx := context.Background()
	clk := newClock()
	s := open(t, b.newDSN(t), store.Options{Now: clk.Now})
	r := jobRun("tok-1")
	r.BackoffLimit = 2
	r = mustCreateRun(t, s, r)
	if a, err := s.ListRunAttempts(ctx, r.ID); err != nil || len(a) != 0 {
		t.Fatalf("queued run's attempts: %+v, %v", a, err)
	}
	if err := s.FinishRunAttempt(ctx, r.ID, 1, store.RunResult{Status: store.RunFailed}); !errors.Is(err, store.ErrConflict) {
		t.Fatalf("finish an attempt never started: %v", err)
	}
	started := mustStartRun(t, s, r.ID, "replica-a")
	clk.Advance(time.Second)
	if err := s.FinishRunAttempt(ctx, r.ID, started.Attempts, store.RunResult{Status: store.RunFailed, ExitCode: exitCode(3),
		Reason: "NonZeroExit", Message: "exit 3", OutputBytes: 10}); err != nil {
		t.Fatal(err)
	}
	if err := s.FinishRunAttempt(ctx, r.ID, started.Attempts, store.RunResult{Status: store.RunFailed}); !errors.Is(err, store.ErrConflict) {
		t.Fatalf("finish an attempt twice: %v", err)
	}
	if err := s.FinishRunAttempt(ctx, r.ID, 1, store.RunResult{Status: store.RunRunning}); !errors.Is(err, store.ErrInvalid) {
		t.Fatalf("finish an attempt running: %v", err)
	}
	clk.Advance(2 * time.Second)
	second := mustStartRun(t, s, r.ID, "replica-a")
	clk.Advance(time.Second)
	ended, err := s.FinishRun(ctx, r.ID, store.RunResult{Status: store.RunSucceeded, ExitCode: exitCode(0), OutputBytes: 25})
	if err != nil {
		t.Fatal(err)
	}
	if err := s.FinishRunAttempt(ctx, r.ID, second.Attempts, store.RunResult{Status: store.RunFailed}); !errors.Is(err, store.ErrRunFinished) {
		t.Fatalf("finish an attempt of an ended run: %v", err)
	}
	got, err := s.ListRunAttempts(ctx, r.ID)
	if err != nil || len(got) != 2 {
		t.Fatalf("attempts: %+v, %v", got, err)
	}
	a1, a2 := got[0], got[1]
	if a1.Attempt != 1 || a1.Status != store.RunFailed || a1.ExitCode == nil || *a1.ExitCode != 3 || a1.Reason != "NonZeroExit" ||
		a1.OutputBytes != 10 || a1.Sandbox != "ns/sb-1" || a1.FinishedAt == nil || a1.FinishedAt.Sub(a1.StartedAt) != time.Second {
		t.Errorf("first attempt %+v", a1)
	}
	if a2.Attempt != 2 || a2.Status != store.RunSucceeded || a2.ExitCode == nil || *a2.ExitCode != 0 || a2.OutputBytes != 15 ||
		a2.FinishedAt == nil || !a2.FinishedAt.Equal(*ended.FinishedAt) || a2.StartedAt.Sub(*a1.FinishedAt) != 2*time.Second {
		t.Errorf("second attempt %+v (run ended %v)", a2, ended.FinishedAt)
	}

	// A takeover closes the lost executor's attempt; the sweep closes the
	// last one.
	lost := mustCreateRun(t, s, agentRun("tok-1", ""))
	mustStartRun(t, s, lost.ID, "replica-a")
	mustStartRun(t, s, lost.ID, "replica-b")
	clk.Advance(time.Minute)
	if _, err := s.FailStaleRuns(ctx, clk.Now(), "ExecutorLost", "lost"); err != nil {
		t.Fatal(err)
	}
	got, err = s.ListRunAttempts(ctx, lost.ID)
	if err != nil || len(got) != 2 || got[0].Status != store.RunFailed || got[0].Reason != "ExecutorLost" ||
		got[1].Status != store.RunFailed || got[1].Reason != "ExecutorLost" || got[1].FinishedAt == nil {
		t.Fatalf("attempts of a run taken over and then lost: %+v, %v", got, err)
	}
	// They go with the run.
	if _, err := s.DeleteFinishedRuns(ctx, clk.Now().Add(time.Hour)); err != nil {
		t.Fatal(err)
	}
	if got, err := s.ListRunAttempts(ctx, lost.ID); err != nil || len(got) != 0 {
		t.Fatalf("attempts of a deleted run: %+v, %v", got, err)
	}
}

// testRunPlace: a pool run's sandbox and agent are recorded once leased,
// only by its executor and only while it runs.
func testRunPlace(t *testing.T, b backend) {
	ctx := context.Background()
	s := open(t, b.newDSN(t), store.Options{})
	r := mustCreateRun(t, s, store.Run{Caller: "tok-1", Mode: store.RunModePool, Pool: "ns/pool",
		Command: store.RunCommand{Argv: []string{"true"}}})
	if _, err := s.PlaceRun(ctx, r.ID, "replica-a", "warm-1", "ns/warm-1"); !errors.Is(err, store.ErrConflict) {
		t.Fatalf("place a queued run: %v", err)
	}
	if _, err := s.StartRunAttempt(ctx, r.ID, "replica-a", ""); err != nil {
		t.Fatal(err)
	}
	if _, err := s.PlaceRun(ctx, r.ID, "replica-b", "warm-1", "ns/warm-1"); !errors.Is(err, store.ErrConflict) {
		t.Fatalf("place by another executor: %v", err)
	}
	if _, err := s.PlaceRun(ctx, r.ID, "replica-a", "warm-1", "not-a-ref"); !errors.Is(err, store.ErrInvalid) {
		t.Fatalf("place in a malformed sandbox: %v", err)
	}
	placed, err := s.PlaceRun(ctx, r.ID, "replica-a", "warm-1", "ns/warm-1")
	if err != nil || placed.AgentID != "warm-1" || placed.Sandbox != "ns/warm-1" {
		t.Fatalf("place: %+v, %v", placed, err)
	}
	if a, err := s.ListRunAttempts(ctx, r.ID); err != nil || len(a) != 1 || a[0].Sandbox != "ns/warm-1" {
		t.Fatalf("placed run's attempt: %+v, %v", a, err)
	}
	if _, err := s.FinishRun(ctx, r.ID, store.RunResult{Status: store.RunSucceeded}); err != nil {
		t.Fatal(err)
	}
	if _, err := s.PlaceRun(ctx, r.ID, "replica-a", "warm-1", "ns/warm-1"); !errors.Is(err, store.ErrRunFinished) {
		t.Fatalf("place an ended run: %v", err)
	}
}

// testRunTTL: a run with a TTL of its own expires that long after it
// ends, however it ends, and goes then whatever the retention; the
// retention leaves it alone.
func testRunTTL(t *testing.T, b backend) {
	ctx := context.Background()
	clk := newClock()
	s := open(t, b.newDSN(t), store.Options{Now: clk.Now})
	withTTL := func(ttl int) store.Run {
		r := jobRun("tok-1")
		r.TTLSecondsAfterFinished = intp(ttl)
		return mustCreateRun(t, s, r)
	}
	finished := withTTL(60)
	ended, err := s.FinishRun(ctx, finished.ID, store.RunResult{Status: store.RunFailed})
	if err != nil || ended.ExpiresAt == nil || !ended.ExpiresAt.Equal(ended.FinishedAt.Add(time.Minute)) {
		t.Fatalf("finished run with a TTL: %+v, %v", ended, err)
	}
	if read, err := s.GetRun(ctx, finished.ID); err != nil || read.ExpiresAt == nil || !read.ExpiresAt.Equal(*ended.ExpiresAt) {
		t.Fatalf("expiry read back: %+v, %v", read, err)
	}
	cancelled := withTTL(0)
	if r, err := s.RequestRunCancel(ctx, cancelled.ID, "user-1"); err != nil || r.ExpiresAt == nil || !r.ExpiresAt.Equal(*r.FinishedAt) {
		t.Fatalf("queued run with a TTL cancelled: %+v, %v", r, err)
	}
	lost := withTTL(30)
	mustStartRun(t, s, lost.ID, "replica-a")
	live := withTTL(0)
	mustStartRun(t, s, live.ID, "replica-b")
	clk.Advance(time.Second)
	swept, err := s.FailStaleRuns(ctx, clk.Now(), "ExecutorLost", "lost")
	if err != nil || len(swept) != 2 {
		t.Fatalf("sweep: %+v, %v", swept, err)
	}
	for _, r := range swept {
		if r.ExpiresAt == nil {
			t.Errorf("swept run %s has no expiry", r.ID)
		}
	}
	// live was swept too (its heartbeat is as old); make another that is.
	still := withTTL(0)
	mustStartRun(t, s, still.ID, "replica-b")
	plain := mustCreateRun(t, s, jobRun("tok-1"))
	if _, err := s.FinishRun(ctx, plain.ID, store.RunResult{Status: store.RunSucceeded}); err != nil {
		t.Fatal(err)
	}

	// Retention does not touch runs with a TTL of their own.
	if n, err := s.DeleteFinishedRuns(ctx, clk.Now().Add(time.Hour)); err != nil || n != 1 {
		t.Fatalf("retention deleted %d, %v; want the run without a TTL only", n, err)
	}
	// At now: the TTL-0 cancelled and swept ones.
	if n, err := s.DeleteExpiredRuns(ctx, clk.Now()); err != nil || n != 2 {
		t.Fatalf("delete expired runs now: %d, %v; want 2", n, err)
	}
	clk.Advance(30 * time.Second)
	if n, err := s.DeleteExpiredRuns(ctx, clk.Now()); err != nil || n != 1 {
		t.Fatalf("delete expired runs after 30s: %d, %v; want 1 (the lost one)", n, err)
	}
	clk.Advance(time.Minute)
	if n, err := s.DeleteExpiredRuns(ctx, clk.Now()); err != nil || n != 1 {
		t.Fatalf("delete expired runs after 90s: %d, %v; want 1 (the finished one)", n, err)
	}
	for _, id := range []string{finished.ID, cancelled.ID, lost.ID, live.ID, plain.ID} {
		if _, err := s.GetRun(ctx, id); !errors.Is(err, store.ErrNotFound) {
			t.Errorf("run %s is still there: %v", id, err)
		}
	}
	// A live run never expires.
	if _, err := s.GetRun(ctx, still.ID); err != nil {
		t.Errorf("live run with a TTL: %v", err)
	}
}
