package controller

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"
	// The control plane's image may have no zone database; the schedule's
	// time zone must resolve all the same.
	_ "time/tzdata"

	"github.com/robfig/cron/v3"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/tools/events"
	"k8s.io/utils/clock"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/builder"
	"sigs.k8s.io/controller-runtime/pkg/client"
	logf "sigs.k8s.io/controller-runtime/pkg/log"
	"sigs.k8s.io/controller-runtime/pkg/predicate"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	"github.com/agentbox/terraform-provider-agentbox/internal/store"
)

// RunScheduleControllerName names the schedule controller, and its events'
// reporter.
const RunScheduleControllerName = "agentbox-runschedule"

// Event reasons of the schedule controller.
const (
	EventRunStarted      = "RunStarted"
	EventRunSkipped      = "RunSkipped"
	EventRunReplaced     = "RunReplaced"
	EventInvalidSchedule = "InvalidSchedule"
)

const (
	// scheduleActiveRecheck is how often a schedule with live runs looks
	// at them again: how a run ended is in the store, which has no watch,
	// and the last run's status and the history limits follow it.
	scheduleActiveRecheck = 10 * time.Second
	// scheduleLateBy is how long after a due time the pass for it runs,
	// so that a clock a little behind the requeue's still finds it due.
	scheduleLateBy = 100 * time.Millisecond
	// maxDueSteps bounds the walk over due times missed since the last
	// one acted on (a long-suspended, frequent schedule).
	maxDueSteps = 10000

	defaultSuccessfulRunsHistory = 3
	defaultFailedRunsHistory     = 1
)

// ScheduledRun is a run a schedule starts.
type ScheduledRun struct {
	// Caller is recorded as the run's caller: "schedule:<namespace>/<name>".
	Caller string
	// RequestID is derived from the schedule and the due time, so that a
	// restarted or second controller starting the same time gets the run
	// started first.
	RequestID string
	// Schedule is the schedule's namespace/name, recorded on the run.
	Schedule string
	// Namespace is the schedule's: the agent's sandbox, the pool or the
	// template must be there.
	Namespace string
	// Mode is the run mode the target picks: agent with AgentID, pool
	// with Pool, job with Template and the job's options.
	Mode    store.RunMode
	AgentID string
	// Pool and Template are namespace/name, in the schedule's namespace.
	Pool                    string
	Template                string
	BackoffLimit            int
	ActiveDeadlineSeconds   int
	TTLSecondsAfterFinished *int
	Command                 []string
	Env                     map[string]string
	Cwd                     string
	TimeoutSeconds          int
}

// RunStarter starts and cancels runs, as the Compute API does. The control
// plane wires it to its Compute API, so that a schedule's run executes on
// the replica that starts it.
type RunStarter interface {
	// StartRun records and starts a run and returns its record; a request
	// id that started a run before returns that run. Input the API refuses
	// wraps store.ErrInvalid.
	StartRun(ctx context.Context, run ScheduledRun) (store.Run, error)
	// CancelRun asks for a run to be cancelled on behalf of by; a finished
	// run is no error.
	CancelRun(ctx context.Context, id, by string) error
}

// RunRecords reads and prunes the run records of schedules: the store.
type RunRecords interface {
	ListRuns(ctx context.Context, f store.RunFilter) ([]store.Run, string, error)
	GetRun(ctx context.Context, id string) (store.Run, error)
	PruneScheduleRuns(ctx context.Context, schedule string, keepSucceeded, keepFailed int) (int64, error)
}

// RunScheduleReconciler starts the runs of RunSchedules at their cron
// times. It runs on the leader only, as every reconciler does; each due
// time starts at most one run, whatever restarts, since the run's request
// id is derived from the time.
type RunScheduleReconciler struct {
	client.Client
	Scheme *runtime.Scheme
	// Recorder receives events about schedules; SetupWithManager fills it
	// from the manager when nil.
	Recorder events.EventRecorder
	// Clock is the controller's notion of now; nil means the real clock.
	Clock clock.PassiveClock
	// Runs starts runs; Records reads them. Both nil (a control plane
	// without a store) leaves every schedule RunsUnavailable.
	Runs    RunStarter
	Records RunRecords
	// Namespaces are the namespaces the platform serves; a schedule
	// elsewhere starts nothing. Empty serves every namespace.
	Namespaces ServedNamespaces
}

// SetupWithManager registers the reconciler with mgr.
func (r *RunScheduleReconciler) SetupWithManager(mgr ctrl.Manager) error {
	fillFromManager(mgr, RunScheduleControllerName, &r.Client, &r.Scheme, &r.Recorder)
	return ctrl.NewControllerManagedBy(mgr).
		Named(RunScheduleControllerName).
		// Time, not the object's own status writes, drives the passes: a
		// pass requeues itself for the next due time.
		For(&v1alpha1.RunSchedule{}, builder.WithPredicates(predicate.GenerationChangedPredicate{})).
		Complete(r)
}

func (r *RunScheduleReconciler) now() time.Time { return nowOf(r.Clock) }

// Reconcile acts on a schedule's latest due time, if one passed since the
// last it acted on, keeps its run history within the limits, reports its
// runs, and requeues itself for the next due time.
func (r *RunScheduleReconciler) Reconcile(ctx context.Context, req ctrl.Request) (ctrl.Result, error) {
	var rs v1alpha1.RunSchedule
	if live, err := fetchLive(ctx, r, req, &rs); !live {
		if err != nil {
			return ctrl.Result{}, err
		}
		return ctrl.Result{}, r.cancelRunsOfDeleted(ctx, req.NamespacedName.String())
	}
	if !r.Namespaces.Serves(rs.Namespace) {
		return r.refuseNamespace(ctx, &rs)
	}
	base := rs.DeepCopy()
	result, err := r.reconcileSchedule(ctx, readyReasonOf(base.Status.Conditions), &rs)
	if err != nil {
		r.setReady(&rs, metav1.ConditionFalse, v1alpha1.ReasonReconcileError, err.Error())
	}
	if serr := patchStatusIfChanged(ctx, r.Client, base, &rs, base.Status, rs.Status, "run schedule"); serr != nil {
		return ctrl.Result{}, errors.Join(err, serr)
	}
	return result, err
}

// cancelRunsOfDeleted cancels the live runs of a schedule that is gone
// or going, as deleting a CronJob removes its Jobs: nobody is left to
// follow them. Their records stay, under the run retention. The store is
// this platform's own, so a schedule of another platform that shares the
// name has no runs here. A deletion that happens while no controller runs
// is not seen; such runs end on their own, within their timeout.
func (r *RunScheduleReconciler) cancelRunsOfDeleted(ctx context.Context, key string) error {
	if r.Records == nil || r.Runs == nil {
		return nil
	}
	live, _, err := r.Records.ListRuns(ctx, store.RunFilter{Schedule: key, Live: true, Limit: 500})
	if err != nil {
		return fmt.Errorf("list the live runs of deleted schedule %s: %w", key, err)
	}
	for _, run := range live {
		if err := r.Runs.CancelRun(ctx, run.ID, "schedule:"+key); err != nil {
			return fmt.Errorf("cancel run %s of deleted schedule %s: %w", run.ID, key, err)
		}
		logf.FromContext(ctx).Info("cancelled a run of a deleted schedule", "run", run.ID, "schedule", key)
	}
	return nil
}

// refuseNamespace reports a schedule in a namespace the platform does not
// serve, once no other platform has taken it up (notServedNow).
func (r *RunScheduleReconciler) refuseNamespace(ctx context.Context, rs *v1alpha1.RunSchedule) (ctrl.Result, error) {
	if tell, wait := notServedNow(rs.CreationTimestamp, rs.Status.Conditions, r.now()); !tell {
		return ctrl.Result{RequeueAfter: wait}, nil
	}
	base := rs.DeepCopy()
	rs.Status.ObservedGeneration = rs.Generation
	msg := r.Namespaces.notServedMessage("RunSchedule", rs.Namespace)
	r.setReady(rs, metav1.ConditionFalse, v1alpha1.ReasonNamespaceNotServed, msg)
	r.event(rs, corev1.EventTypeWarning, EventNamespaceNotServed, "Wait", msg)
	return ctrl.Result{}, patchStatusIfChanged(ctx, r.Client, base, rs, base.Status, rs.Status, "run schedule")
}

// cronParser reads standard five-field cron and the @hourly-style
// descriptors, as a Kubernetes CronJob does; @every and seconds are not
// cron, and a TZ= prefix would fight spec.timeZone.
var cronParser = cron.NewParser(cron.Minute | cron.Hour | cron.Dom | cron.Month | cron.Dow | cron.Descriptor)

// parseSchedule reads a schedule's cron expression and time zone; on
// failure it returns the Ready reason and message that say what is wrong.
func parseSchedule(spec *v1alpha1.RunScheduleSpec) (cron.Schedule, *time.Location, string, string) {
	loc := time.UTC
	if spec.TimeZone != "" {
		l, err := time.LoadLocation(spec.TimeZone)
		// LoadLocation also takes "Local" and paths; a zone is an IANA name.
		if err != nil || spec.TimeZone == "Local" || strings.HasPrefix(spec.TimeZone, "/") {
			return nil, nil, v1alpha1.ReasonInvalidTimeZone,
				fmt.Sprintf("spec.timeZone %q is not an IANA time zone name such as Europe/Berlin or America/New_York", spec.TimeZone)
		}
		loc = l
	}
	expr := strings.TrimSpace(spec.Schedule)
	if strings.Contains(expr, "TZ=") || strings.HasPrefix(expr, "@every") {
		return nil, nil, v1alpha1.ReasonInvalidSchedule,
			fmt.Sprintf("spec.schedule %q: use five cron fields (or @hourly, @daily, ...) and spec.timeZone", spec.Schedule)
	}
	sched, err := cronParser.Parse(expr)
	if err != nil {
		return nil, nil, v1alpha1.ReasonInvalidSchedule, fmt.Sprintf("spec.schedule %q is not a cron schedule: %v", spec.Schedule, err)
	}
	return sched, loc, "", ""
}

// latestDue returns the latest due time after since and at or before now,
// in loc, or the zero time if none passed.
func latestDue(sched cron.Schedule, loc *time.Location, since, now time.Time) time.Time {
	var last time.Time
	t := sched.Next(since.In(loc))
	for steps := 0; !t.IsZero() && !t.After(now); steps++ {
		if steps == maxDueSteps {
			// So frequent and so long missed that the walk from since is
			// long: the latest is within the last two days unless the
			// schedule is rarer than that, and then the walk was short.
			if from := now.Add(-48 * time.Hour); from.After(since) {
				return latestDue(sched, loc, from, now)
			}
		}
		last = t
		t = sched.Next(t)
	}
	return last
}

// scheduleKey is how runs name a schedule: namespace/name.
func scheduleKey(rs *v1alpha1.RunSchedule) string { return rs.Namespace + "/" + rs.Name }

// scheduleRequestID is the request id of a schedule's run for a due time:
// the same time always gives the same id, and the caller names the
// schedule.
func scheduleRequestID(due time.Time) string {
	return "schedule-" + due.UTC().Format("20060102T150405Z")
}

func (r *RunScheduleReconciler) reconcileSchedule(ctx context.Context, prevReason string, rs *v1alpha1.RunSchedule) (ctrl.Result, error) {
	rs.Status.ObservedGeneration = rs.Generation
	sched, loc, reason, msg := parseSchedule(&rs.Spec)
	if reason != "" {
		rs.Status.NextScheduleTime = nil
		r.setReady(rs, metav1.ConditionFalse, reason, msg)
		if readyReasonIsNew(rs.Status.Conditions, prevReason) {
			r.event(rs, corev1.EventTypeWarning, EventInvalidSchedule, "Parse", msg)
		}
		// Nothing to retry: a spec change (a new generation) comes back.
		return ctrl.Result{}, nil
	}
	if r.Runs == nil || r.Records == nil {
		rs.Status.NextScheduleTime = nil
		r.setReady(rs, metav1.ConditionFalse, v1alpha1.ReasonRunsUnavailable,
			"the control plane runs without a store (neither --store-dsn nor --data-dir), which runs are recorded in, so it starts none")
		return ctrl.Result{}, nil
	}
	now := r.now()
	key := scheduleKey(rs)
	live, err := r.refreshRuns(ctx, rs)
	if err != nil {
		return ctrl.Result{}, err
	}
	since := rs.CreationTimestamp.Time
	if rs.Status.LastScheduleTime != nil {
		since = rs.Status.LastScheduleTime.Time
	}
	if due := latestDue(sched, loc, since, now); !due.IsZero() && !rs.Spec.Suspend {
		if live, err = r.actOn(ctx, rs, due, now, live); err != nil {
			return ctrl.Result{}, err
		}
	}
	keepOK, keepFailed := historyLimits(&rs.Spec)
	if _, err := r.Records.PruneScheduleRuns(ctx, key, keepOK, keepFailed); err != nil {
		return ctrl.Result{}, fmt.Errorf("delete runs beyond the history limits: %w", err)
	}

	var result ctrl.Result
	if len(live) > 0 {
		result.RequeueAfter = scheduleActiveRecheck
	}
	if rs.Spec.Suspend {
		rs.Status.NextScheduleTime = nil
		r.setReady(rs, metav1.ConditionFalse, v1alpha1.ReasonSuspended, "spec.suspend is set: no run starts; live runs go on")
		return result, nil
	}
	next := sched.Next(now.In(loc))
	if next.IsZero() {
		// A date that never comes, such as 30 February.
		rs.Status.NextScheduleTime = nil
		r.setReady(rs, metav1.ConditionFalse, v1alpha1.ReasonInvalidSchedule,
			fmt.Sprintf("spec.schedule %q has no time in the next five years", rs.Spec.Schedule))
		return result, nil
	}
	rs.Status.NextScheduleTime = &metav1.Time{Time: next.UTC()}
	zone := "UTC"
	if rs.Spec.TimeZone != "" {
		zone = rs.Spec.TimeZone
	}
	r.setReady(rs, metav1.ConditionTrue, v1alpha1.ReasonScheduled,
		fmt.Sprintf("starts a run %s at the times of %q (%s)", targetDescription(&rs.Spec.Target), rs.Spec.Schedule, zone))
	result.RequeueAfter = minPositive(result.RequeueAfter, next.Sub(now)+scheduleLateBy)
	return result, nil
}

// scheduledRun is the run rs starts for the request id reqID, in the mode
// its target picks; pools and templates are those of its namespace.
func scheduledRun(rs *v1alpha1.RunSchedule, reqID string) ScheduledRun {
	key := scheduleKey(rs)
	t := &rs.Spec.Target
	run := ScheduledRun{
		Caller: "schedule:" + key, RequestID: reqID, Schedule: key, Namespace: rs.Namespace,
		Mode: store.RunModeAgent, AgentID: t.AgentID, Command: rs.Spec.Command.Argv, Env: rs.Spec.Command.Env,
		Cwd: rs.Spec.Command.Cwd, TimeoutSeconds: int(rs.Spec.Command.TimeoutSeconds),
	}
	switch {
	case t.Pool != "":
		run.Mode, run.Pool = store.RunModePool, rs.Namespace+"/"+t.Pool
	case t.Template != "":
		run.Mode, run.Template = store.RunModeJob, rs.Namespace+"/"+t.Template
		if j := t.Job; j != nil {
			if j.BackoffLimit != nil {
				run.BackoffLimit = int(*j.BackoffLimit)
			}
			if j.ActiveDeadlineSeconds != nil {
				run.ActiveDeadlineSeconds = int(*j.ActiveDeadlineSeconds)
			}
			if j.TTLSecondsAfterFinished != nil {
				ttl := int(*j.TTLSecondsAfterFinished)
				run.TTLSecondsAfterFinished = &ttl
			}
		}
	}
	// Several targets set at once (an object written before the CRD's
	// rule, or with it bypassed) are not picked from: the agent ID stays
	// with a pool or template mode, and the Compute API refuses the run.
	return run
}

// targetDescription says where a schedule's runs execute, for its Ready
// condition.
func targetDescription(t *v1alpha1.RunScheduleTarget) string {
	switch {
	case t.Pool != "":
		return fmt.Sprintf("in a sandbox leased from warm pool %q (mode pool)", t.Pool)
	case t.Template != "":
		backoff := int32(0)
		if t.Job != nil && t.Job.BackoffLimit != nil {
			backoff = *t.Job.BackoffLimit
		}
		return fmt.Sprintf("in a sandbox made from template %q for the run (mode job, backoffLimit %d)", t.Template, backoff)
	}
	return fmt.Sprintf("in agent %q's sandbox", t.AgentID)
}

// historyLimits are the schedule's run history limits, with the CRD's
// defaults for an object the API server did not default.
func historyLimits(spec *v1alpha1.RunScheduleSpec) (int, int) {
	ok, failed := defaultSuccessfulRunsHistory, defaultFailedRunsHistory
	if spec.SuccessfulRunsHistoryLimit != nil {
		ok = int(*spec.SuccessfulRunsHistoryLimit)
	}
	if spec.FailedRunsHistoryLimit != nil {
		failed = int(*spec.FailedRunsHistoryLimit)
	}
	return ok, failed
}

// refreshRuns reports the schedule's live runs and its last run's status
// as the store has them, and returns the live runs.
func (r *RunScheduleReconciler) refreshRuns(ctx context.Context, rs *v1alpha1.RunSchedule) ([]store.Run, error) {
	live, _, err := r.Records.ListRuns(ctx, store.RunFilter{Schedule: scheduleKey(rs), Live: true, Limit: 500})
	if err != nil {
		return nil, fmt.Errorf("list the schedule's live runs: %w", err)
	}
	rs.Status.Active = runIDs(live)
	if id := rs.Status.LastRunID; id != "" {
		run, err := r.Records.GetRun(ctx, id)
		switch {
		case errors.Is(err, store.ErrNotFound):
			// Deleted by retention; its last known status stands.
		case err != nil:
			return nil, fmt.Errorf("read run %s: %w", id, err)
		default:
			rs.Status.LastRunStatus = string(run.Status)
		}
	}
	return live, nil
}

func runIDs(runs []store.Run) []string {
	var ids []string
	for _, run := range runs {
		ids = append(ids, run.ID)
	}
	return ids
}

// actOn starts a run for due, or skips it, by the starting deadline and
// the concurrency policy, and records which; it returns the live runs
// after.
func (r *RunScheduleReconciler) actOn(ctx context.Context, rs *v1alpha1.RunSchedule, due, now time.Time, live []store.Run) ([]store.Run, error) {
	key := scheduleKey(rs)
	reqID := scheduleRequestID(due)
	// A run for this time may have started in a pass whose status write
	// was lost: the start is idempotent, and the checks below must not
	// skip a time that has its run.
	latest, _, err := r.Records.ListRuns(ctx, store.RunFilter{Schedule: key, Limit: 1})
	if err != nil {
		return live, fmt.Errorf("read the schedule's latest run: %w", err)
	}
	started := len(latest) == 1 && latest[0].RequestID == reqID
	if !started {
		if d := rs.Spec.StartingDeadlineSeconds; d != nil && now.Sub(due) > time.Duration(*d)*time.Second {
			r.skip(rs, due, v1alpha1.SkipMissedDeadline, corev1.EventTypeWarning,
				fmt.Sprintf("the due time %s was found %s late, past startingDeadlineSeconds (%ds)",
					due.UTC().Format(time.RFC3339), now.Sub(due).Round(time.Second), *d))
			return live, nil
		}
		if len(live) > 0 {
			switch rs.Spec.ConcurrencyPolicy {
			case v1alpha1.ConcurrencyAllow:
			case v1alpha1.ConcurrencyReplace:
				for _, run := range live {
					if err := r.Runs.CancelRun(ctx, run.ID, "schedule:"+key); err != nil {
						return live, fmt.Errorf("cancel run %s to replace it: %w", run.ID, err)
					}
					r.event(rs, corev1.EventTypeNormal, EventRunReplaced, "Cancel",
						fmt.Sprintf("cancelled run %s (concurrencyPolicy Replace) for the due time %s", run.ID, due.UTC().Format(time.RFC3339)))
				}
				// A queued run ended at once; a running one ends when its
				// executor has stopped it.
				if live, err = r.refreshRuns(ctx, rs); err != nil {
					return live, err
				}
			default:
				// Forbid, also for an object the API server did not default.
				r.skip(rs, due, v1alpha1.SkipForbid, corev1.EventTypeNormal,
					fmt.Sprintf("run %s of this schedule was still %s (concurrencyPolicy Forbid)", live[0].ID, live[0].Status))
				return live, nil
			}
		}
	}
	run, err := r.Runs.StartRun(ctx, scheduledRun(rs, reqID))
	if errors.Is(err, store.ErrInvalid) {
		r.skip(rs, due, v1alpha1.SkipRefused, corev1.EventTypeWarning, "the run was refused: "+err.Error())
		return live, nil
	}
	if err != nil {
		return live, fmt.Errorf("start the run for %s: %w", due.UTC().Format(time.RFC3339), err)
	}
	rs.Status.LastScheduleTime = &metav1.Time{Time: due.UTC()}
	rs.Status.LastRunID, rs.Status.LastRunStatus = run.ID, string(run.Status)
	if !run.Status.Terminal() && !containsRun(live, run.ID) {
		live = append([]store.Run{run}, live...)
		rs.Status.Active = runIDs(live)
	}
	if !started {
		r.event(rs, corev1.EventTypeNormal, EventRunStarted, "Start",
			fmt.Sprintf("started run %s for the due time %s", run.ID, due.UTC().Format(time.RFC3339)))
	}
	return live, nil
}

func containsRun(runs []store.Run, id string) bool {
	for _, run := range runs {
		if run.ID == id {
			return true
		}
	}
	return false
}

// skip records that due started no run, and why.
func (r *RunScheduleReconciler) skip(rs *v1alpha1.RunSchedule, due time.Time, reason, eventType, msg string) {
	at := metav1.Time{Time: due.UTC()}
	rs.Status.LastScheduleTime = &at
	rs.Status.LastSkipped = &v1alpha1.RunScheduleSkip{Time: at, Reason: reason, Message: truncateMessage(msg)}
	r.event(rs, eventType, EventRunSkipped, "Skip", fmt.Sprintf("skipped the due time %s (%s): %s", due.UTC().Format(time.RFC3339), reason, msg))
}

func (r *RunScheduleReconciler) setReady(rs *v1alpha1.RunSchedule, status metav1.ConditionStatus, reason, msg string) {
	setCondition(&rs.Status.Conditions, v1alpha1.ConditionReady, rs.Generation, r.now(), status, reason, msg)
}

func (r *RunScheduleReconciler) event(rs *v1alpha1.RunSchedule, eventType, reason, action, note string) {
	recordEvent(r.Recorder, rs, nil, eventType, reason, action, note)
}
