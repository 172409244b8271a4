package controller

import (
	"context"
	"path/filepath"
	"strings"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	k8sruntime "k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/tools/events"
	clocktesting "k8s.io/utils/clock/testing"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client/fake"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	"github.com/agentbox/terraform-provider-agentbox/internal/store"
)

// storeStarter records runs in a real store as the Compute API would, and
// executes none: the due-time logic is what these tests are about.
type storeStarter struct{ st *store.Store }

func (s storeStarter) StartRun(ctx context.Context, run ScheduledRun) (store.Run, error) {
	r, _, err := s.st.CreateRun(ctx, store.Run{Caller: run.Caller, RequestID: run.RequestID, Schedule: run.Schedule,
		Mode: run.Mode, AgentID: run.AgentID, Pool: run.Pool, Template: run.Template, BackoffLimit: run.BackoffLimit,
		ActiveDeadlineSeconds: run.ActiveDeadlineSeconds, TTLSecondsAfterFinished: run.TTLSecondsAfterFinished,
		Command: store.RunCommand{Argv: run.Command}})
	return r, err
}

func (s storeStarter) CancelRun(ctx context.Context, id, by string) error {
	_, err := s.st.RequestRunCancel(ctx, id, by)
	return err
}

type scheduleEnv struct {
	t     *testing.T
	r     *RunScheduleReconciler
	clock *clocktesting.FakeClock
	st    *store.Store
}

func newScheduleEnv(t *testing.T, rs *v1alpha1.RunSchedule) *scheduleEnv {
	t.Helper()
	scheme := k8sruntime.NewScheme()
	must(t, clientgoscheme.AddToScheme(scheme))
	must(t, v1alpha1.AddToScheme(scheme))
	c := fake.NewClientBuilder().WithScheme(scheme).WithStatusSubresource(&v1alpha1.RunSchedule{}).WithObjects(rs).Build()
	st, err := store.Open(context.Background(), filepath.Join(t.TempDir(), "agentbox.db"), store.Options{})
	must(t, err)
	t.Cleanup(func() { st.Close() })
	clk := clocktesting.NewFakeClock(rs.CreationTimestamp.Add(10 * time.Second))
	r := &RunScheduleReconciler{Client: c, Scheme: scheme, Recorder: events.NewFakeRecorder(100), Clock: clk,
		Runs: storeStarter{st}, Records: st}
	return &scheduleEnv{t: t, r: r, clock: clk, st: st}
}

func (e *scheduleEnv) reconcile() (ctrl.Result, *v1alpha1.RunSchedule) {
	e.t.Helper()
	key := types.NamespacedName{Namespace: unitNS, Name: "every-minute"}
	res, err := e.r.Reconcile(context.Background(), ctrl.Request{NamespacedName: key})
	must(e.t, err)
	var rs v1alpha1.RunSchedule
	must(e.t, e.r.Get(context.Background(), key, &rs))
	return res, &rs
}

func unitSchedule(created time.Time, mutate func(*v1alpha1.RunSchedule)) *v1alpha1.RunSchedule {
	rs := &v1alpha1.RunSchedule{
		ObjectMeta: metav1.ObjectMeta{Name: "every-minute", Namespace: unitNS, Generation: 1, CreationTimestamp: metav1.NewTime(created)},
		Spec: v1alpha1.RunScheduleSpec{Schedule: "* * * * *", Target: v1alpha1.RunScheduleTarget{AgentID: "agent-1"},
			Command: v1alpha1.RunScheduleCommand{Argv: []string{"true"}}, ConcurrencyPolicy: v1alpha1.ConcurrencyForbid},
	}
	if mutate != nil {
		mutate(rs)
	}
	return rs
}

// TestRunScheduleDueTimes: with an injected clock, a schedule waits for its
// first due time (requeueing for it), starts one run for it however often
// it is reconciled, skips the next while that run is live (Forbid), and a
// time found later than the starting deadline is skipped as missed.
func TestRunScheduleDueTimes(t *testing.T) {
	created := time.Date(2026, 11, 22, 10, 0, 30, 0, time.UTC)
	e := newScheduleEnv(t, unitSchedule(created, func(rs *v1alpha1.RunSchedule) {
		rs.Spec.StartingDeadlineSeconds = new(int64(30))
	}))

	res, rs := e.reconcile()
	first := created.Truncate(time.Minute).Add(time.Minute)
	if rs.Status.NextScheduleTime == nil || !rs.Status.NextScheduleTime.Time.Equal(first) || rs.Status.LastScheduleTime != nil {
		t.Fatalf("before the first due time: %+v", rs.Status)
	}
	if want := first.Sub(e.clock.Now()) + scheduleLateBy; res.RequeueAfter != want {
		t.Errorf("requeue after %s, want %s", res.RequeueAfter, want)
	}
	if c := readyCond(rs); c.Reason != v1alpha1.ReasonScheduled || c.Status != metav1.ConditionTrue {
		t.Errorf("Ready %+v", c)
	}

	e.clock.SetTime(first.Add(scheduleLateBy))
	_, rs = e.reconcile()
	if rs.Status.LastScheduleTime == nil || !rs.Status.LastScheduleTime.Time.Equal(first) || rs.Status.LastRunID == "" ||
		len(rs.Status.Active) != 1 || rs.Status.Active[0] != rs.Status.LastRunID || rs.Status.LastRunStatus != string(store.RunQueued) {
		t.Fatalf("at the first due time: %+v", rs.Status)
	}
	runID := rs.Status.LastRunID
	run, err := e.st.GetRun(context.Background(), runID)
	must(t, err)
	if run.Schedule != unitNS+"/every-minute" || run.Caller != "schedule:"+unitNS+"/every-minute" ||
		run.RequestID != "schedule-20261122T100100Z" {
		t.Errorf("run %+v", run)
	}
	// Reconciled again at the same time: the same run, no second.
	_, rs = e.reconcile()
	if runs, _, err := e.st.ListRuns(context.Background(), store.RunFilter{Schedule: unitNS + "/every-minute"}); err != nil || len(runs) != 1 {
		t.Fatalf("runs after a second pass: %d, %v", len(runs), err)
	}

	// The run is still queued at the next time: Forbid skips it.
	second := first.Add(time.Minute)
	e.clock.SetTime(second.Add(time.Second))
	res, rs = e.reconcile()
	if s := rs.Status.LastSkipped; s == nil || s.Reason != v1alpha1.SkipForbid || !s.Time.Time.Equal(second) ||
		!rs.Status.LastScheduleTime.Time.Equal(second) || rs.Status.LastRunID != runID {
		t.Fatalf("Forbid: %+v", rs.Status)
	}
	if res.RequeueAfter != scheduleActiveRecheck {
		t.Errorf("with a live run, requeue after %s, want %s", res.RequeueAfter, scheduleActiveRecheck)
	}

	// The run ends; the pass after finds the third time 40 s late, past
	// the 30 s deadline.
	_, err = e.st.FinishRun(context.Background(), runID, store.RunResult{Status: store.RunSucceeded})
	must(t, err)
	third := second.Add(time.Minute)
	e.clock.SetTime(third.Add(40 * time.Second))
	_, rs = e.reconcile()
	if s := rs.Status.LastSkipped; s == nil || s.Reason != v1alpha1.SkipMissedDeadline || !s.Time.Time.Equal(third) ||
		len(rs.Status.Active) != 0 || rs.Status.LastRunStatus != string(store.RunSucceeded) {
		t.Fatalf("missed deadline: %+v", rs.Status)
	}
}

// TestRunScheduleInvalid: a schedule or time zone the controller cannot
// read is a Ready condition that says so, with no requeue, not an error.
func TestRunScheduleInvalid(t *testing.T) {
	created := time.Date(2026, 11, 22, 10, 0, 30, 0, time.UTC)
	for _, c := range []struct {
		mutate func(*v1alpha1.RunSchedule)
		reason string
	}{
		{func(rs *v1alpha1.RunSchedule) { rs.Spec.Schedule = "61 * * * *" }, v1alpha1.ReasonInvalidSchedule},
		{func(rs *v1alpha1.RunSchedule) { rs.Spec.Schedule = "@every 1m" }, v1alpha1.ReasonInvalidSchedule},
		{func(rs *v1alpha1.RunSchedule) { rs.Spec.Schedule = "0 0 30 2 *" }, v1alpha1.ReasonInvalidSchedule},
		{func(rs *v1alpha1.RunSchedule) { rs.Spec.TimeZone = "Mars/Olympus" }, v1alpha1.ReasonInvalidTimeZone},
		{func(rs *v1alpha1.RunSchedule) { rs.Spec.TimeZone = "Local" }, v1alpha1.ReasonInvalidTimeZone},
	} {
		e := newScheduleEnv(t, unitSchedule(created, c.mutate))
		res, rs := e.reconcile()
		if cond := readyCond(rs); cond.Reason != c.reason || cond.Status != metav1.ConditionFalse || res.RequeueAfter != 0 ||
			rs.Status.NextScheduleTime != nil {
			t.Errorf("%q in %q: Ready %+v, requeue %s", rs.Spec.Schedule, rs.Spec.TimeZone, cond, res.RequeueAfter)
		}
	}
}

// TestLatestDue reads due times in the schedule's time zone, across a
// daylight saving change, and finds the latest of many missed ones.
func TestLatestDue(t *testing.T) {
	berlin, err := time.LoadLocation("Europe/Berlin")
	must(t, err)
	daily, err := cronParser.Parse("30 2 * * *")
	must(t, err)
	// 02:30 Berlin is 00:30 UTC in summer and 01:30 UTC in winter.
	since := time.Date(2026, 7, 1, 0, 0, 0, 0, time.UTC)
	if got, want := latestDue(daily, berlin, since, time.Date(2026, 7, 1, 0, 45, 0, 0, time.UTC)), time.Date(2026, 7, 1, 0, 30, 0, 0, time.UTC); !got.Equal(want) {
		t.Errorf("summer: %s, want %s", got, want)
	}
	winter := time.Date(2026, 12, 1, 0, 0, 0, 0, time.UTC)
	if got := latestDue(daily, berlin, winter, time.Date(2026, 12, 1, 1, 0, 0, 0, time.UTC)); !got.IsZero() {
		t.Errorf("winter, before 01:30 UTC: %s, want none", got)
	}
	minutely, err := cronParser.Parse("* * * * *")
	must(t, err)
	now := time.Date(2026, 11, 22, 10, 0, 30, 0, time.UTC)
	if got, want := latestDue(minutely, time.UTC, now.AddDate(-1, 0, 0), now), now.Truncate(time.Minute); !got.Equal(want) {
		t.Errorf("a year of missed minutes: %s, want %s", got, want)
	}
}

func readyCond(rs *v1alpha1.RunSchedule) metav1.Condition {
	for _, c := range rs.Status.Conditions {
		if c.Type == v1alpha1.ConditionReady {
			return c
		}
	}
	return metav1.Condition{}
}

// TestRunScheduleConcurrencyPolicies: at a due time with a live run,
// Replace cancels it and starts the new run, Allow starts the new one
// beside it.
func TestRunScheduleConcurrencyPolicies(t *testing.T) {
	created := time.Date(2026, 11, 22, 10, 0, 30, 0, time.UTC)
	first := created.Truncate(time.Minute).Add(time.Minute)
	for _, policy := range []v1alpha1.ConcurrencyPolicy{v1alpha1.ConcurrencyReplace, v1alpha1.ConcurrencyAllow} {
		e := newScheduleEnv(t, unitSchedule(created, func(rs *v1alpha1.RunSchedule) { rs.Spec.ConcurrencyPolicy = policy }))
		e.clock.SetTime(first.Add(time.Second))
		_, rs := e.reconcile()
		firstRun := rs.Status.LastRunID
		e.clock.SetTime(first.Add(time.Minute + time.Second))
		_, rs = e.reconcile()
		if rs.Status.LastRunID == firstRun || rs.Status.LastSkipped != nil {
			t.Fatalf("%s: status %+v", policy, rs.Status)
		}
		old, err := e.st.GetRun(context.Background(), firstRun)
		must(t, err)
		switch policy {
		case v1alpha1.ConcurrencyReplace:
			if old.Status != store.RunCancelled || old.CancelledBy != "schedule:"+unitNS+"/every-minute" ||
				len(rs.Status.Active) != 1 || rs.Status.Active[0] != rs.Status.LastRunID {
				t.Errorf("Replace: the first run is %s (by %q), want cancelled by the schedule; active %v", old.Status, old.CancelledBy, rs.Status.Active)
			}
		case v1alpha1.ConcurrencyAllow:
			if old.Status != store.RunQueued || len(rs.Status.Active) != 2 {
				t.Errorf("Allow: the first run is %s, active %v; want both live", old.Status, rs.Status.Active)
			}
		}
	}
}

// Deleting a schedule cancels its live runs, and only its own: a finished
// run and another schedule's live run are left as they are.
func TestRunScheduleDeletionCancelsItsLiveRuns(t *testing.T) {
	created := time.Date(2026, 11, 22, 10, 0, 30, 0, time.UTC)
	first := created.Truncate(time.Minute).Add(time.Minute)
	e := newScheduleEnv(t, unitSchedule(created, func(rs *v1alpha1.RunSchedule) { rs.Spec.ConcurrencyPolicy = v1alpha1.ConcurrencyAllow }))
	ctx := context.Background()
	e.clock.SetTime(first.Add(time.Second))
	_, rs := e.reconcile()
	done := rs.Status.LastRunID
	code := 0
	_, err := e.st.FinishRun(ctx, done, store.RunResult{Status: store.RunSucceeded, ExitCode: &code})
	must(t, err)
	e.clock.SetTime(first.Add(time.Minute + time.Second))
	_, rs = e.reconcile()
	live := rs.Status.LastRunID
	other, _, err := e.st.CreateRun(ctx, store.Run{Caller: "schedule:" + unitNS + "/other", RequestID: "x", Schedule: unitNS + "/other",
		Mode: store.RunModeAgent, AgentID: "agent-1", Command: store.RunCommand{Argv: []string{"true"}}})
	must(t, err)

	must(t, e.r.Delete(ctx, rs))
	key := types.NamespacedName{Namespace: unitNS, Name: "every-minute"}
	if _, err := e.r.Reconcile(ctx, ctrl.Request{NamespacedName: key}); err != nil {
		t.Fatalf("reconcile of the deleted schedule: %v", err)
	}
	for id, want := range map[string]store.RunStatus{live: store.RunCancelled, done: store.RunSucceeded, other.ID: store.RunQueued} {
		run, err := e.st.GetRun(ctx, id)
		must(t, err)
		if run.Status != want {
			t.Errorf("run %s is %s, want %s", id, run.Status, want)
		}
		if id == live && run.CancelledBy != "schedule:"+key.String() {
			t.Errorf("run %s cancelled by %q, want the schedule", id, run.CancelledBy)
		}
	}
}

// TestRunScheduleTargets: a schedule starts its runs in the mode its target
// picks, with the pool or template of its own namespace and the job's
// options, and its Ready condition says where its runs go.
func TestRunScheduleTargets(t *testing.T) {
	created := time.Date(2026, 11, 22, 10, 0, 30, 0, time.UTC)
	for _, tc := range []struct {
		name   string
		target v1alpha1.RunScheduleTarget
		ready  string
		check  func(store.Run) bool
	}{
		{"agent", v1alpha1.RunScheduleTarget{AgentID: "agent-1"}, `in agent "agent-1"'s sandbox`,
			func(r store.Run) bool { return r.Mode == store.RunModeAgent && r.AgentID == "agent-1" && r.Pool == "" }},
		{"pool", v1alpha1.RunScheduleTarget{Pool: "py"}, `leased from warm pool "py"`,
			func(r store.Run) bool {
				return r.Mode == store.RunModePool && r.Pool == unitNS+"/py" && r.Template == ""
			}},
		{"job", v1alpha1.RunScheduleTarget{Template: "standard", Job: &v1alpha1.RunScheduleJob{
			BackoffLimit: new(int32(2)), ActiveDeadlineSeconds: new(int64(300)), TTLSecondsAfterFinished: new(int32(600))}},
			`made from template "standard" for the run (mode job, backoffLimit 2)`,
			func(r store.Run) bool {
				return r.Mode == store.RunModeJob && r.Template == unitNS+"/standard" && r.BackoffLimit == 2 &&
					r.ActiveDeadlineSeconds == 300 && r.TTLSecondsAfterFinished != nil && *r.TTLSecondsAfterFinished == 600
			}},
		{"job without options", v1alpha1.RunScheduleTarget{Template: "standard"}, "backoffLimit 0",
			func(r store.Run) bool {
				return r.Mode == store.RunModeJob && r.BackoffLimit == 0 && r.ActiveDeadlineSeconds == 0 && r.TTLSecondsAfterFinished == nil
			}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newScheduleEnv(t, unitSchedule(created, func(rs *v1alpha1.RunSchedule) { rs.Spec.Target = tc.target }))
			e.clock.SetTime(created.Truncate(time.Minute).Add(time.Minute + scheduleLateBy))
			_, rs := e.reconcile()
			if c := readyCond(rs); c.Reason != v1alpha1.ReasonScheduled || !strings.Contains(c.Message, tc.ready) {
				t.Errorf("Ready %+v, want a message saying %q", c, tc.ready)
			}
			run, err := e.st.GetRun(context.Background(), rs.Status.LastRunID)
			must(t, err)
			if !tc.check(run) || run.Schedule != unitNS+"/every-minute" {
				t.Errorf("run %+v", run)
			}
		})
	}
}
