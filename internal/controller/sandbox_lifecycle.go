package controller

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"strconv"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/controller/controllerutil"
	logf "sigs.k8s.io/controller-runtime/pkg/log"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	"github.com/agentbox/terraform-provider-agentbox/internal/filespace"
	"github.com/agentbox/terraform-provider-agentbox/internal/pki"
	"github.com/agentbox/terraform-provider-agentbox/internal/snapshot"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"
)

// The idle-stop and resume cycle.
//
// The cycle keeps almost no state of its own. A sandbox should be running
// exactly when it is not idle, and idleness is read from the activity Lease
// the Compute API renews: a stop starts when the Lease has not moved for the
// idle timeout, and a renew on a stopped sandbox is the wake-up signal. What
// must survive a restart of the control plane mid-way lives in objects: the
// snapshot being taken in status.pendingSnapshot, a workspace claim still
// to be filled from a snapshot in its restore-from annotation, and the
// backoff of stops that could not be taken in status.idleStopRetry.
//
// A stop never leaves a sandbox that cannot serve. Until its snapshot is
// ready it deletes nothing, so it can be undone: activity that arrives
// meanwhile calls it off (the sandbox is no longer idle, and the call is
// served by the running pod at once rather than after a stop and a
// resume), and a snapshot that cannot be started or fails abandons it (the
// sandbox stays Running with an IdleStopBlocked condition, and the stop is
// tried again with exponential backoff). Stops are not begun at all while
// the control plane's check of the snapshot driver fails.

// AnnotationRestoreFrom marks a workspace claim created for a resume whose
// contents the snapshot driver has yet to restore through the supervisor.
// The controller removes it once the restore is done; until then the
// sandbox stays Resuming and takes no calls.
const AnnotationRestoreFrom = v1alpha1.GroupName + "/restore-from"

// DefaultIdleTimeout applies when neither the Sandbox nor its template (nor
// the template's API default) sets one.
const DefaultIdleTimeout = time.Hour

// Event reasons of the cycle.
const (
	EventIdleStopping   = "IdleStopping"
	EventIdleStopped    = "IdleStopped"
	EventSnapshotFailed = "SnapshotFailed"
	EventResuming       = "Resuming"
	EventResumed        = "Resumed"
	EventRestoreFailed  = "RestoreFailed"
	EventSyncFailed     = "SyncFailed"
	// EventFilespacePulled says what a pull brought into a workspace
	// before the sandbox served; a pull with nothing to bring is silent.
	EventFilespacePulled = "FilespacePulled"
)

// Event reasons of idle stops that do not happen, and of resumes that
// cannot.
const (
	// EventIdleStopCancelled (Normal): activity arrived during the stop,
	// which was called off before it had deleted anything.
	EventIdleStopCancelled = "IdleStopCancelled"
	// EventIdleStopAbandoned (Warning): the snapshot could not be taken;
	// the sandbox keeps serving and the stop is tried again later.
	EventIdleStopAbandoned = "IdleStopAbandoned"
	// EventIdleStopBlocked (Warning): the sandbox is idle but no stop is
	// begun while the snapshot driver's check fails.
	EventIdleStopBlocked = "IdleStopBlocked"
	// EventSnapshotDriverChanged (Warning): the snapshot to resume from
	// was taken by another driver than the platform runs now.
	EventSnapshotDriverChanged = "SnapshotDriverChanged"
)

// snapshotPoll is how often a snapshot that is not ready yet is looked at
// again. A VolumeSnapshot's readiness does wake the sandbox through no
// watch (the sandbox does not own it through this controller's cache).
const snapshotPoll = 2 * time.Second

// Backoff of idle stops that could not be taken: the wait before the next
// attempt doubles with each one abandoned in a row, from idleStopRetryBase
// up to idleStopRetryMax.
const (
	idleStopRetryBase = 30 * time.Second
	idleStopRetryMax  = 30 * time.Minute
)

// heldBackRecheck is how often an idle sandbox whose stop the snapshot
// check holds back looks at the check again; the check itself runs about
// as often.
const heldBackRecheck = time.Minute

// SnapshotHealth tells whether the snapshot driver can work now; the
// control plane's SnapshotCheck is one. Problem returns nil when it can, or
// when that is not known yet.
type SnapshotHealth interface {
	Problem() *snapshot.Problem
}

// supervisorCallTimeout bounds the flush. The snapshot and restore streams
// have no fixed bound: they last as long as the workspace takes to copy.
const supervisorCallTimeout = 30 * time.Second

// SupervisorDialer returns a client for the supervisor at endpoint that
// accepts only a server proving identity id. The Compute API's supervisor
// pool satisfies it, so both share connections.
type SupervisorDialer interface {
	Supervisor(endpoint, id string) (*supervisorapi.Client, error)
}

// FilespaceSyncer runs one sync of a workspace with its agent's filespace;
// filespace.Syncer, bound to the control plane's store, is one.
type FilespaceSyncer interface {
	Sync(ctx context.Context, ws filespace.Workspace, opts filespace.Options) (*filespace.Summary, error)
}

// activity is what the Lease says about a sandbox's use.
type activity struct {
	last    time.Time     // the Lease's renewTime; zero when unknown
	timeout time.Duration // the sandbox's idle timeout
	idleFor time.Duration
}

func (a activity) idle() bool { return !a.last.IsZero() && a.idleFor >= a.timeout }

// untilIdle is how long until the sandbox turns idle, for the requeue that
// stops it: nothing else wakes the controller when a sandbox goes quiet.
func (a activity) untilIdle() time.Duration {
	if a.last.IsZero() || a.idle() {
		return 0
	}
	return a.timeout - a.idleFor
}

func (r *SandboxReconciler) activityOf(sbx *v1alpha1.Sandbox, tpl *v1alpha1.SandboxTemplate, lease *coordinationv1.Lease) activity {
	a := activity{timeout: DefaultIdleTimeout}
	switch {
	case sbx.Spec.IdleTimeout != nil && sbx.Spec.IdleTimeout.Duration > 0:
		a.timeout = sbx.Spec.IdleTimeout.Duration
	case tpl != nil && tpl.Spec.IdleTimeout.Duration > 0:
		a.timeout = tpl.Spec.IdleTimeout.Duration
	}
	if lease != nil && lease.Spec.RenewTime != nil {
		a.last = lease.Spec.RenewTime.Time
		a.idleFor = r.now().Sub(a.last)
	}
	return a
}

// recordActivity mirrors the Lease's renewTime into status.lastActivityTime.
// Renewals come every 30 s on a busy sandbox; mirroring each would double
// the API writes of busy sandboxes for a field people read in minutes, so
// the status moves only when it is a minute behind or on a phase change.
func recordActivity(prevPhase v1alpha1.SandboxPhase, sbx *v1alpha1.Sandbox, a activity) {
	if a.last.IsZero() {
		return
	}
	t := metav1.NewTime(a.last.Truncate(time.Second))
	prev := sbx.Status.LastActivityTime
	if prev == nil || prevPhase != sbx.Status.Phase || t.Sub(prev.Time) >= time.Minute || t.Before(prev) {
		sbx.Status.LastActivityTime = &t
	}
}

// snapshotName names the snapshot of the stop that begins after the
// activity at last, after attempt earlier stops were abandoned. It is
// derived, not random, so that a pass that runs again before its status
// write is visible picks the same name; the attempt keeps a retry clear of
// what the abandoned attempt may still be cleaning up (a VolumeSnapshot
// being deleted).
func snapshotName(sandbox string, last time.Time, attempt int32) string {
	suffix := "-" + strconv.FormatInt(last.Unix(), 10)
	if attempt > 0 {
		suffix += "-" + strconv.FormatInt(int64(attempt), 10)
	}
	// VolumeSnapshot names are DNS subdomains of at most 253 characters.
	const maxName = 253
	if len(sandbox)+len(suffix) <= maxName {
		return sandbox + suffix
	}
	sum := sha256.Sum256([]byte(sandbox))
	hash := "-" + hex.EncodeToString(sum[:4])
	return sandbox[:maxName-len(suffix)-len(hash)] + hash + suffix
}

// stopping reports whether this pass belongs to an idle stop: one under
// way (it is always finished, so that a snapshot started is never left
// half-recorded), or a running sandbox that has just turned idle.
func (r *SandboxReconciler) stopping(sbx *v1alpha1.Sandbox, tpl *v1alpha1.SandboxTemplate, a activity, havePod bool) bool {
	if sbx.Status.Phase == v1alpha1.SandboxPhaseIdleStopping {
		return r.Snapshots != nil || sbx.Spec.Ephemeral
	}
	// Without its template a stopped sandbox could not start again; one
	// that still runs keeps running. A warm sandbox has no agent to be idle
	// for: it waits to be adopted, and stopping it would defeat the pool.
	if !a.idle() || !havePod || tpl == nil || isWarm(sbx) {
		return false
	}
	if r.Snapshots == nil && !sbx.Spec.Ephemeral {
		// No driver to keep the workspace in: the sandbox keeps running,
		// as it would with an infinite idle timeout.
		return false
	}
	return sbx.Status.Phase == v1alpha1.SandboxPhaseRunning
}

// parked reports whether the sandbox is meant to stay without a pod: idle
// after a stop, or after a failed one. A stop that failed after the pod
// was gone (its sync or its snapshot) waits, like a finished one, for the
// next activity: the sandbox is still idle, so a pod started without it
// would only be stopped again at once.
func parked(sbx *v1alpha1.Sandbox, a activity) bool {
	if !a.idle() {
		return false
	}
	switch sbx.Status.Phase {
	case v1alpha1.SandboxPhaseStopped:
		return true
	case v1alpha1.SandboxPhaseError:
		return v1alpha1.ErrorResumesOnActivity(readyReason(sbx))
	}
	return false
}

// idleStop runs one step of the stop: flush, snapshot, and once the
// snapshot is ready, delete the pod and the claim and record the snapshot.
// It is called again until the stop is over.
func (r *SandboxReconciler) idleStop(ctx context.Context, prevReason string, sbx *v1alpha1.Sandbox, tpl *v1alpha1.SandboxTemplate, a activity, pod *corev1.Pod) (ctrl.Result, error) {
	name, err := r.beginStop(ctx, prevReason, sbx, a, pod)
	if err != nil {
		return ctrl.Result{}, err
	}
	started := readyTransition(sbx)
	if tpl == nil {
		// Deleted during the stop; the driver reads only the workspace
		// settings, whose defaults are the zero values.
		tpl = &v1alpha1.SandboxTemplate{}
	}

	if sbx.Spec.Ephemeral {
		if err := r.deleteWorkload(ctx, sbx, pod, true); err != nil {
			return ctrl.Result{}, err
		}
		sbx.Status.Snapshot = nil
		r.finishStop(sbx, pod, started, "the ephemeral sandbox's pod and workspace were deleted; the next activity starts it afresh")
		return ctrl.Result{}, nil
	}

	sup, synced, err := r.syncServingPod(ctx, sbx, pod)
	if err != nil || !synced {
		return ctrl.Result{}, err
	}
	state, res, done, err := r.takeSnapshot(ctx, sbx, tpl, pod, name, sup)
	if err != nil || done {
		return res, err
	}
	if state.Failed != "" {
		return ctrl.Result{}, r.failStop(ctx, sbx, pod, name, state.Failed)
	}
	if !state.Ready {
		r.setPhase(sbx, v1alpha1.SandboxPhaseIdleStopping, metav1.ConditionFalse, v1alpha1.ReasonIdleTimeout,
			fmt.Sprintf("waiting for snapshot %s of the workspace to become ready (%s driver)", name, snapshot.ID(r.Snapshots)))
		return ctrl.Result{RequeueAfter: snapshotPoll}, nil
	}
	return ctrl.Result{}, r.completeStop(ctx, sbx, pod, name, state, started)
}

// beginStop starts a stop that is not under way yet: it names the snapshot
// to take (none for an ephemeral sandbox), records it in
// status.pendingSnapshot and sets the sandbox IdleStopping. It returns the
// snapshot's name, also for a stop already under way.
func (r *SandboxReconciler) beginStop(ctx context.Context, prevReason string, sbx *v1alpha1.Sandbox, a activity, pod *corev1.Pod) (string, error) {
	name := sbx.Status.PendingSnapshot
	if sbx.Status.Phase == v1alpha1.SandboxPhaseIdleStopping && name != "" {
		return name, nil
	}
	if name != "" && r.Snapshots != nil {
		// Left by a stop that was called off and whose snapshot could
		// not be deleted then.
		if err := r.Snapshots.Delete(ctx, sbx, name); err != nil {
			return "", fmt.Errorf("delete snapshot %s of an abandoned stop: %w", name, err)
		}
	}
	if !sbx.Spec.Ephemeral {
		var attempt int32
		if sbx.Status.IdleStopRetry != nil {
			attempt = sbx.Status.IdleStopRetry.Failures
		}
		name = snapshotName(sbx.Name, a.last, attempt)
	}
	sbx.Status.PendingSnapshot = name
	msg := fmt.Sprintf("idle since %s (idle timeout %s); ", a.last.UTC().Format(time.RFC3339), a.timeout)
	if sbx.Spec.Ephemeral {
		msg += "the sandbox is ephemeral, so its pod and workspace are deleted without a snapshot"
	} else {
		msg += fmt.Sprintf("snapshotting the workspace into %s with the %s driver", name, snapshot.ID(r.Snapshots))
	}
	r.setPhase(sbx, v1alpha1.SandboxPhaseIdleStopping, metav1.ConditionFalse, v1alpha1.ReasonIdleTimeout, msg)
	r.eventOnNewReason(prevReason, sbx, pod, corev1.EventTypeNormal, EventIdleStopping, "Stop", msg)
	return name, nil
}

// syncServingPod syncs the workspace of a pod that still serves before
// its snapshot (see syncBeforeStop), and returns its supervisor, nil when
// no pod serves. It reports false when the sync failed and the stop ended
// without a snapshot.
func (r *SandboxReconciler) syncServingPod(ctx context.Context, sbx *v1alpha1.Sandbox, pod *corev1.Pod) (*supervisorapi.Client, bool, error) {
	if pod == nil || !pod.DeletionTimestamp.IsZero() || !podReady(pod) || pod.Status.PodIP == "" {
		return nil, true, nil
	}
	sup, err := r.supervisor(sbx, pod)
	if err != nil {
		return nil, false, err
	}
	if err := r.syncBeforeStop(ctx, sbx, sup); err != nil {
		// Retried once already: the pod stops and the sandbox is marked
		// Error. The claim keeps the data (no snapshot is taken of a
		// volume whose last writes may not have reached it), and the
		// next activity, not sooner, starts the pod on it (parked).
		if err := r.deleteWorkload(ctx, sbx, pod, false); err != nil {
			return nil, false, err
		}
		sbx.Status.PendingSnapshot = ""
		msg := fmt.Sprintf("syncing the workspace before the snapshot failed twice (%v); the pod is stopped without a snapshot, the workspace claim %s is kept, and the next activity starts the sandbox again",
			err, WorkspaceClaimName(workloadName(sbx)))
		r.setNotServing(sbx, v1alpha1.SandboxPhaseError, v1alpha1.ReasonSyncFailed, msg)
		r.event(sbx, pod, corev1.EventTypeWarning, EventSyncFailed, "Sync", msg)
		return nil, false, nil
	}
	return sup, true, nil
}

// takeSnapshot starts, or looks at, the stop's snapshot. A snapshot that
// cannot be taken, or failed, while nothing is deleted yet abandons the
// stop: it reports done, and the result to return.
func (r *SandboxReconciler) takeSnapshot(ctx context.Context, sbx *v1alpha1.Sandbox, tpl *v1alpha1.SandboxTemplate, pod *corev1.Pod, name string, sup *supervisorapi.Client) (snapshot.State, ctrl.Result, bool, error) {
	state, err := r.Snapshots.Take(ctx, snapshot.Request{
		Sandbox: sbx, Template: tpl, ClaimName: WorkspaceClaimName(workloadName(sbx)), Name: name, Supervisor: sup,
	})
	if err == nil && state.Failed == "" {
		return state, ctrl.Result{}, false, nil
	}
	// Nothing is deleted yet: the stop is undone, and the sandbox
	// serves on, rather than be stopped without its workspace kept.
	reason, cause := v1alpha1.ReasonSnapshotFailed, ""
	var problem *snapshot.Problem
	switch {
	case errors.As(err, &problem):
		reason, cause = problem.Reason, "could not be taken: "+problem.Message
	case err != nil:
		cause = "could not be taken: " + err.Error()
	default:
		cause = "failed: " + state.Failed
	}
	res, undone, uerr := r.abandonStop(ctx, sbx, pod, name, reason, cause)
	if uerr != nil || undone {
		return state, res, true, uerr
	}
	if err != nil {
		// Past the point of no return (the claim is going): retried.
		return state, ctrl.Result{}, true, fmt.Errorf("snapshot %s: %w", name, err)
	}
	return state, ctrl.Result{}, false, nil
}

// failStop ends a stop whose snapshot failed after its claim began to go,
// so that it cannot be undone. What is left of the claim is kept: without
// a new snapshot it may hold the only copy of the newest data. The pod
// goes, as the stop asked.
func (r *SandboxReconciler) failStop(ctx context.Context, sbx *v1alpha1.Sandbox, pod *corev1.Pod, name, failed string) error {
	if err := r.deleteWorkload(ctx, sbx, pod, false); err != nil {
		return err
	}
	if err := r.Snapshots.Delete(ctx, sbx, name); err != nil {
		logf.FromContext(ctx).Error(err, "delete failed snapshot", "snapshot", name)
	}
	sbx.Status.PendingSnapshot = ""
	msg := fmt.Sprintf("snapshot %s failed: %s; the pod is stopped, the workspace claim %s and the last good snapshot are kept, and the next activity starts the sandbox again",
		name, failed, WorkspaceClaimName(workloadName(sbx)))
	if sbx.Status.Snapshot == nil {
		msg = fmt.Sprintf("snapshot %s failed: %s; the pod is stopped, the workspace claim %s is kept, and the next activity starts the sandbox again",
			name, failed, WorkspaceClaimName(workloadName(sbx)))
	}
	r.setNotServing(sbx, v1alpha1.SandboxPhaseError, v1alpha1.ReasonSnapshotFailed, msg)
	r.event(sbx, nil, corev1.EventTypeWarning, EventSnapshotFailed, "Snapshot", msg)
	metricSnapshots.WithLabelValues(r.Snapshots.Name(), "failed").Inc()
	return nil
}

// completeStop ends a stop whose snapshot is ready: the pod and the claim
// go, the snapshot is recorded and the one it supersedes deleted.
func (r *SandboxReconciler) completeStop(ctx context.Context, sbx *v1alpha1.Sandbox, pod *corev1.Pod, name string, state snapshot.State, started time.Time) error {
	if done, err := r.stopRecorded(ctx, sbx, name); err != nil || done {
		// A pass from a cache that has not seen the stop's status yet (the
		// pod and claim it deleted woke it): the stop is over, and
		// finishing it again would repeat its event and metrics.
		return err
	}
	if err := r.deleteWorkload(ctx, sbx, pod, true); err != nil {
		return err
	}
	readyAt := metav1.NewTime(r.now().Truncate(time.Second))
	if !state.ReadyTime.IsZero() {
		readyAt = metav1.NewTime(state.ReadyTime.Truncate(time.Second))
	}
	prev := sbx.Status.Snapshot
	sbx.Status.Snapshot = &v1alpha1.SandboxSnapshot{Name: name, SizeBytes: state.SizeBytes, ReadyTime: &readyAt, Driver: snapshot.ID(r.Snapshots)}
	sbx.Status.PendingSnapshot = ""
	sbx.Status.IdleStopRetry = nil
	meta.RemoveStatusCondition(&sbx.Status.Conditions, v1alpha1.ConditionIdleStopBlocked)
	if prev != nil && prev.Name != name {
		// Only after the new one is ready, so a stop never leaves the
		// sandbox without a snapshot. A failure here leaks storage, not
		// data, so it does not hold the stop up.
		if err := r.Snapshots.Delete(ctx, sbx, prev.Name); err != nil {
			logf.FromContext(ctx).Error(err, "delete superseded snapshot", "snapshot", prev.Name)
		}
	}
	metricSnapshots.WithLabelValues(r.Snapshots.Name(), "ready").Inc()
	if !started.IsZero() {
		metricSnapshotSeconds.WithLabelValues(r.Snapshots.Name()).Observe(r.now().Sub(started).Seconds())
	}
	r.finishStop(sbx, pod, started, fmt.Sprintf("the workspace is in snapshot %s (%s, %s driver); the next activity resumes the sandbox",
		name, formatBytes(state.SizeBytes), snapshot.ID(r.Snapshots)))
	return nil
}

// stopRecorded reports whether the Sandbox as stored, not as cached, is
// already Stopped with snapshot name: an earlier pass finished this stop.
func (r *SandboxReconciler) stopRecorded(ctx context.Context, sbx *v1alpha1.Sandbox, name string) (bool, error) {
	reader := r.APIReader
	if reader == nil {
		reader = r.Client
	}
	var live v1alpha1.Sandbox
	if err := reader.Get(ctx, client.ObjectKeyFromObject(sbx), &live); err != nil {
		return false, fmt.Errorf("read sandbox %s before finishing its stop: %w", sbx.Name, err)
	}
	return live.UID == sbx.UID && live.Status.Phase == v1alpha1.SandboxPhaseStopped &&
		live.Status.Snapshot != nil && live.Status.Snapshot.Name == name, nil
}

// idleStopBackoff is the wait after failures stops abandoned in a row.
func idleStopBackoff(failures int32) time.Duration {
	d := idleStopRetryBase
	for i := int32(1); i < failures && d < idleStopRetryMax; i++ {
		d *= 2
	}
	return min(d, idleStopRetryMax)
}

// stopHeldBack reports whether an idle, running sandbox must not begin a
// stop now, and when to look again: an earlier stop was abandoned and the
// backoff has not run out, or the snapshot driver's check fails. The
// sandbox then keeps running and serving.
func (r *SandboxReconciler) stopHeldBack(sbx *v1alpha1.Sandbox, a activity) (time.Duration, bool) {
	if sbx.Status.Phase != v1alpha1.SandboxPhaseRunning || sbx.Spec.Ephemeral {
		return 0, false
	}
	if retry := sbx.Status.IdleStopRetry; retry != nil {
		if wait := retry.NextAttemptTime.Sub(r.now()); wait > 0 {
			return wait, true
		}
	}
	if r.SnapshotHealth == nil {
		return 0, false
	}
	p := r.SnapshotHealth.Problem()
	if p == nil {
		return 0, false
	}
	msg := fmt.Sprintf("idle since %s (idle timeout %s), but not stopped: the platform's %s snapshot driver cannot work: %s; the sandbox keeps running and serving calls, and stops once the control plane's snapshot check passes",
		a.last.UTC().Format(time.RFC3339), a.timeout, snapshot.ID(r.Snapshots), p.Message)
	if prev := meta.FindStatusCondition(sbx.Status.Conditions, v1alpha1.ConditionIdleStopBlocked); prev == nil || prev.Reason != p.Reason {
		r.event(sbx, nil, corev1.EventTypeWarning, EventIdleStopBlocked, "Stop", msg)
	}
	r.setIdleStopBlocked(sbx, p.Reason, msg)
	return heldBackRecheck, true
}

// clearPassedCheck removes an IdleStopBlocked condition that the snapshot
// check put there once the check passes, also on a sandbox that is busy
// now and so not about to stop; one left by abandoned stops (which set
// idleStopRetry) stays until a stop succeeds.
func (r *SandboxReconciler) clearPassedCheck(sbx *v1alpha1.Sandbox) {
	c := meta.FindStatusCondition(sbx.Status.Conditions, v1alpha1.ConditionIdleStopBlocked)
	if c == nil || sbx.Status.IdleStopRetry != nil || r.SnapshotHealth == nil || r.SnapshotHealth.Problem() != nil {
		return
	}
	meta.RemoveStatusCondition(&sbx.Status.Conditions, v1alpha1.ConditionIdleStopBlocked)
}

// setIdleStopBlocked records why idle stops of the sandbox do not happen.
func (r *SandboxReconciler) setIdleStopBlocked(sbx *v1alpha1.Sandbox, reason, msg string) {
	setCondition(&sbx.Status.Conditions, v1alpha1.ConditionIdleStopBlocked, sbx.Generation, r.now(), metav1.ConditionTrue, reason, msg)
}

// undoStop takes back an idle stop in progress that has deleted nothing
// yet: the workspace claim is there and not going. The snapshot being
// taken is discarded (an archive upload is cancelled, a VolumeSnapshot
// deleted), and the sandbox is Running again on its pod, or, when the pod
// is not serving, Pending until the rest of the pass brings it back on
// the kept claim. It reports false, and changes nothing, when the claim is
// already going: the stop is past undoing and finishes.
func (r *SandboxReconciler) undoStop(ctx context.Context, sbx *v1alpha1.Sandbox, pod *corev1.Pod) (bool, error) {
	var claim corev1.PersistentVolumeClaim
	found, err := r.getChild(ctx, sbx, WorkspaceClaimName(workloadName(sbx)), &claim)
	if err != nil {
		return false, err
	}
	if !found || !claim.DeletionTimestamp.IsZero() {
		return false, nil
	}
	if name := sbx.Status.PendingSnapshot; name != "" && r.Snapshots != nil {
		if err := r.Snapshots.Delete(ctx, sbx, name); err != nil {
			// Kept in pendingSnapshot: the next stop, or the finalizer,
			// deletes it.
			logf.FromContext(ctx).Error(err, "delete the snapshot of an undone stop", "snapshot", name)
		} else {
			sbx.Status.PendingSnapshot = ""
		}
	}
	if pod != nil && pod.DeletionTimestamp.IsZero() && podReady(pod) && pod.Status.PodIP != "" {
		sbx.Status.PodName, sbx.Status.PodIP = pod.Name, pod.Status.PodIP
		sbx.Status.ServiceEndpoint = v1alpha1.SupervisorEndpoint(pod.Status.PodIP)
		// The message observePod writes, so that the next pass changes
		// nothing.
		r.setPhase(sbx, v1alpha1.SandboxPhaseRunning, metav1.ConditionTrue, v1alpha1.ReasonRunning,
			fmt.Sprintf("pod %s is ready; the supervisor listens on %s", pod.Name, sbx.Status.ServiceEndpoint))
		return true, nil
	}
	r.setNotServing(sbx, v1alpha1.SandboxPhasePending, v1alpha1.ReasonCreating,
		fmt.Sprintf("an idle stop was undone; the sandbox starts again on its workspace claim %s", claim.Name))
	return true, nil
}

// callOffStop ends an idle stop because activity arrived: the sandbox is no
// longer idle, and serving the call from the running pod beats finishing
// the stop only to resume at once. It reports whether the sandbox serves
// again from its pod, so that the pass is done.
func (r *SandboxReconciler) callOffStop(ctx context.Context, sbx *v1alpha1.Sandbox, pod *corev1.Pod, a activity) (bool, error) {
	name := sbx.Status.PendingSnapshot
	undone, err := r.undoStop(ctx, sbx, pod)
	if err != nil || !undone {
		return false, err
	}
	r.event(sbx, pod, corev1.EventTypeNormal, EventIdleStopCancelled, "Stop",
		fmt.Sprintf("activity at %s during the idle stop: the stop is called off and snapshot %s discarded; the sandbox serves again",
			a.last.UTC().Format(time.RFC3339), name))
	return sbx.Status.Phase == v1alpha1.SandboxPhaseRunning, nil
}

// abandonStop undoes a stop whose snapshot could not be taken, and sets
// the backoff of the next attempt. It reports false when the stop is past
// undoing.
func (r *SandboxReconciler) abandonStop(ctx context.Context, sbx *v1alpha1.Sandbox, pod *corev1.Pod, name, reason, cause string) (ctrl.Result, bool, error) {
	undone, err := r.undoStop(ctx, sbx, pod)
	if err != nil || !undone {
		return ctrl.Result{}, false, err
	}
	failures := int32(1)
	if sbx.Status.IdleStopRetry != nil {
		failures = sbx.Status.IdleStopRetry.Failures + 1
	}
	wait := idleStopBackoff(failures)
	next := metav1.NewTime(r.now().Add(wait).Truncate(time.Second))
	sbx.Status.IdleStopRetry = &v1alpha1.IdleStopRetry{Failures: failures, NextAttemptTime: next}
	msg := fmt.Sprintf("idle stop abandoned: snapshot %s with the %s driver %s; the sandbox keeps running and serving calls, and the stop is tried again after %s (%d attempts failed in a row)",
		name, snapshot.ID(r.Snapshots), cause, next.UTC().Format(time.RFC3339), failures)
	r.setIdleStopBlocked(sbx, reason, msg)
	r.event(sbx, pod, corev1.EventTypeWarning, EventIdleStopAbandoned, "Stop", msg)
	metricSnapshots.WithLabelValues(r.Snapshots.Name(), "failed").Inc()
	res := ctrl.Result{RequeueAfter: wait}
	if sbx.Status.Phase != v1alpha1.SandboxPhaseRunning {
		// No pod serves: the next pass brings one back on the claim.
		res.RequeueAfter = time.Second
	}
	return res, true, nil
}

// snapshotDriverChangedError says that the snapshot a sandbox would resume
// from was taken by another driver than the one the platform runs.
type snapshotDriverChangedError struct {
	snapshot, took, now string
}

func (e *snapshotDriverChangedError) Error() string {
	return fmt.Sprintf("cannot resume: snapshot %s was taken by the %s snapshot driver, but the platform now runs %s, which cannot restore it; "+
		"configure the platform's snapshot driver back to %s to resume the sandbox with its workspace, or delete the Sandbox to start afresh without it",
		e.snapshot, e.took, e.now, e.took)
}

// checkSnapshotDriver returns a snapshotDriverChangedError when the
// sandbox would be resumed from a snapshot the current driver did not
// take. Snapshots that recorded no driver predate the record and are
// tried.
func (r *SandboxReconciler) checkSnapshotDriver(sbx *v1alpha1.Sandbox, name string) error {
	snap := sbx.Status.Snapshot
	if snap == nil || snap.Name != name || snap.Driver == "" || r.Snapshots == nil {
		return nil
	}
	if now := snapshot.ID(r.Snapshots); now != snap.Driver {
		return &snapshotDriverChangedError{snapshot: snap.Name, took: snap.Driver, now: now}
	}
	return nil
}

// syncRetryDelay spaces the two sync attempts of an idle stop.
var syncRetryDelay = time.Second

// syncBeforeStop pushes the workspace into the agent's filespace and then
// makes the workspace's last writes durable before it is snapshotted,
// retrying once: a failure that persists stops the sandbox without a
// snapshot (SyncFailed). The push comes first because it writes
// the sync baseline into the workspace, which the snapshot must hold.
func (r *SandboxReconciler) syncBeforeStop(ctx context.Context, sbx *v1alpha1.Sandbox, sup *supervisorapi.Client) error {
	var err error
	for attempt := range 2 {
		if attempt > 0 {
			select {
			case <-ctx.Done():
				return ctx.Err()
			case <-time.After(syncRetryDelay):
			}
		}
		if err = r.pushFilespace(ctx, sbx, sup); err != nil {
			continue
		}
		fctx, cancel := context.WithTimeout(ctx, supervisorCallTimeout)
		err = sup.Flush(fctx)
		cancel()
		if err == nil {
			return nil
		}
	}
	return err
}

func (r *SandboxReconciler) pushFilespace(ctx context.Context, sbx *v1alpha1.Sandbox, sup *supervisorapi.Client) error {
	sum, err := r.syncFilespace(ctx, sbx, sup, filespace.Push)
	if err != nil || sum == nil {
		return err
	}
	logf.FromContext(ctx).Info("filespace pushed before the idle stop", "pushed", sum.Pushed, "deleted", sum.Deleted, "bytes", sum.Bytes)
	return nil
}

// pullFilespace brings the agent's filespace into a workspace that is about
// to serve: a new one (the agent's files outlive its sandboxes) or one just
// restored from a snapshot (the filespace may be newer). A sync is
// idempotent, so running it again after a crash or an error is safe.
func (r *SandboxReconciler) pullFilespace(ctx context.Context, sbx *v1alpha1.Sandbox, pod *corev1.Pod) error {
	if r.Filespaces == nil || isWarm(sbx) {
		return nil
	}
	sup, err := r.supervisor(sbx, pod)
	if err != nil {
		return err
	}
	sum, err := r.syncFilespace(ctx, sbx, sup, filespace.Pull)
	if err != nil || sum == nil {
		return err
	}
	if sum.Pulled+sum.Deleted > 0 {
		r.event(sbx, pod, corev1.EventTypeNormal, EventFilespacePulled, "Sync",
			fmt.Sprintf("pulled %d files (%s) and %d deletions from the agent's filespace into the workspace", sum.Pulled, formatBytes(sum.Bytes), sum.Deleted))
	}
	return nil
}

// syncFilespace runs one sync of sbx's workspace with its agent's
// filespace, or nothing (nil, nil) without a syncer or for a warm sandbox,
// which has no agent yet and pulls once it is adopted.
func (r *SandboxReconciler) syncFilespace(ctx context.Context, sbx *v1alpha1.Sandbox, sup *supervisorapi.Client, dir filespace.Direction) (*filespace.Summary, error) {
	if r.Filespaces == nil || isWarm(sbx) {
		return nil, nil
	}
	sctx, cancel := context.WithTimeout(ctx, filespace.Timeout)
	defer cancel()
	sum, err := r.Filespaces.Sync(sctx, sup, filespace.Options{AgentID: sbx.Spec.AgentID, Direction: dir, Now: r.now})
	if err != nil {
		return nil, fmt.Errorf("%s between the workspace and the agent's filespace: %w", dir, err)
	}
	return sum, nil
}

// serving reports whether a sandbox whose Ready condition had reason was
// already taking calls.
func serving(reason string) bool {
	return reason == v1alpha1.ReasonRunning || reason == v1alpha1.ReasonAdoptedFromWarmPool
}

func (r *SandboxReconciler) finishStop(sbx *v1alpha1.Sandbox, pod *corev1.Pod, started time.Time, msg string) {
	took := ""
	if !started.IsZero() {
		took = fmt.Sprintf(" in %s", r.now().Sub(started).Round(time.Millisecond))
	}
	r.setNotServing(sbx, v1alpha1.SandboxPhaseStopped, v1alpha1.ReasonStopped, msg)
	r.event(sbx, pod, corev1.EventTypeNormal, EventIdleStopped, "Stop", "stopped"+took+": "+msg)
	metricIdleStops.Inc()
}

// deleteWorkload deletes the sandbox's pod, and its workspace claim when
// withClaim. Both are gone, or going, when it returns without error.
func (r *SandboxReconciler) deleteWorkload(ctx context.Context, sbx *v1alpha1.Sandbox, pod *corev1.Pod, withClaim bool) error {
	if pod != nil && pod.DeletionTimestamp.IsZero() {
		if err := r.Delete(ctx, pod, client.Preconditions{UID: &pod.UID}); err != nil && !apierrors.IsNotFound(err) && !apierrors.IsConflict(err) {
			return fmt.Errorf("delete pod %s: %w", pod.Name, err)
		}
	}
	// A pod the controller removed is not one lost with its node.
	sbx.Status.NodeName = ""
	if !withClaim {
		return nil
	}
	var pvc corev1.PersistentVolumeClaim
	found, err := r.getChild(ctx, sbx, WorkspaceClaimName(workloadName(sbx)), &pvc)
	if err != nil || !found || !pvc.DeletionTimestamp.IsZero() {
		return err
	}
	if err := r.Delete(ctx, &pvc, client.Preconditions{UID: &pvc.UID}); err != nil && !apierrors.IsNotFound(err) && !apierrors.IsConflict(err) {
		return fmt.Errorf("delete workspace claim %s: %w", pvc.Name, err)
	}
	return nil
}

// stayStopped keeps a parked sandbox without a pod. A pod can only appear
// here if a pass working from a stale cache created it; it is removed, and
// so is the claim of a stopped (not failed) sandbox, whose data is in the
// snapshot.
func (r *SandboxReconciler) stayStopped(ctx context.Context, sbx *v1alpha1.Sandbox, pod *corev1.Pod) error {
	stopped := sbx.Status.Phase == v1alpha1.SandboxPhaseStopped
	if err := r.deleteWorkload(ctx, sbx, pod, stopped && sbx.Status.Snapshot != nil); err != nil {
		return err
	}
	sbx.Status.PodName, sbx.Status.PodIP, sbx.Status.ServiceEndpoint = "", "", ""
	return nil
}

// prepareRestore makes a new workspace claim start from the latest snapshot,
// when there is one to resume from.
func (r *SandboxReconciler) prepareRestore(sbx *v1alpha1.Sandbox, claim *corev1.PersistentVolumeClaim) {
	snap := sbx.Status.Snapshot
	if snap == nil || sbx.Spec.Ephemeral || r.Snapshots == nil {
		return
	}
	r.Snapshots.PrepareClaim(snap, claim)
	if claim.Annotations == nil {
		claim.Annotations = map[string]string{}
	}
	claim.Annotations[AnnotationRestoreFrom] = snap.Name
}

// restoring returns the snapshot a sandbox's claim still waits for.
func restoring(claim *corev1.PersistentVolumeClaim) string {
	if claim == nil {
		return ""
	}
	return claim.Annotations[AnnotationRestoreFrom]
}

// finishRestore fills the workspace of a resumed sandbox whose pod is
// ready, then removes the claim's restore-from mark. It reports whether the
// sandbox may serve.
func (r *SandboxReconciler) finishRestore(ctx context.Context, sbx *v1alpha1.Sandbox, pod *corev1.Pod, claim *corev1.PersistentVolumeClaim) (bool, error) {
	name := restoring(claim)
	snap := sbx.Status.Snapshot
	if snap == nil || snap.Name != name {
		// The status that named it is not visible yet, or was lost; the
		// snapshot is still addressable by name.
		snap = &v1alpha1.SandboxSnapshot{Name: name}
	}
	if r.Snapshots == nil {
		return false, fmt.Errorf("workspace claim %s waits for snapshot %s to be restored, but no snapshot driver is configured", claim.Name, name)
	}
	if err := r.checkSnapshotDriver(sbx, name); err != nil {
		return false, err
	}
	sup, err := r.supervisor(sbx, pod)
	if err != nil {
		return false, err
	}
	start := r.now()
	err = r.Snapshots.Restore(ctx, snapshot.RestoreRequest{Sandbox: sbx, Snapshot: snap, Supervisor: sup})
	if errors.Is(err, snapshot.ErrNotFound) {
		msg := fmt.Sprintf("cannot restore the workspace from snapshot %s: %v; the sandbox takes no calls rather than serve an empty workspace; delete the Sandbox to start afresh", name, err)
		if snap.Driver == "" {
			// Taken before snapshots recorded their driver, perhaps by
			// another one: the chart's default was volumesnapshot then.
			msg += fmt.Sprintf("; the snapshot does not record which driver took it, and the platform now runs %s: if it was taken by another (volumesnapshot was the chart's default before archive), configure that driver again to resume the sandbox",
				snapshot.ID(r.Snapshots))
		}
		r.setPhase(sbx, v1alpha1.SandboxPhaseError, metav1.ConditionFalse, v1alpha1.ReasonRestoreFailed, msg)
		r.event(sbx, claim, corev1.EventTypeWarning, EventRestoreFailed, "Restore", msg)
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("restore the workspace from snapshot %s: %w", name, err)
	}
	metricRestoreSeconds.WithLabelValues(r.Snapshots.Name()).Observe(r.now().Sub(start).Seconds())
	patch := client.MergeFrom(claim.DeepCopy())
	delete(claim.Annotations, AnnotationRestoreFrom)
	if err := r.Patch(ctx, claim, patch); err != nil {
		// The restore runs again on the next pass, into the same
		// workspace: extraction overwrites, and no call was served in
		// between, so nothing of the agent's is lost.
		return false, fmt.Errorf("mark workspace claim %s restored: %w", claim.Name, err)
	}
	return true, nil
}

func (r *SandboxReconciler) supervisor(sbx *v1alpha1.Sandbox, pod *corev1.Pod) (*supervisorapi.Client, error) {
	if r.Supervisors == nil {
		return nil, errors.New("no supervisor dialer configured")
	}
	if pod.Status.PodIP == "" {
		return nil, fmt.Errorf("pod %s has no IP yet", pod.Name)
	}
	sup, err := r.Supervisors.Supervisor(v1alpha1.SupervisorEndpoint(pod.Status.PodIP),
		pki.SandboxID(r.TrustDomain, sbx.Namespace, workloadName(sbx)).String())
	if err != nil {
		return nil, fmt.Errorf("dial the supervisor of pod %s: %w", pod.Name, err)
	}
	return sup, nil
}

// readyTransition is when the Ready condition last changed: for a sandbox
// in IdleStopping, when the stop began.
func readyTransition(sbx *v1alpha1.Sandbox) time.Time {
	for _, c := range sbx.Status.Conditions {
		if c.Type == v1alpha1.ConditionReady {
			return c.LastTransitionTime.Time
		}
	}
	return time.Time{}
}

func formatBytes(n int64) string {
	if n <= 0 {
		return "size not reported"
	}
	const unit = 1024
	if n < unit {
		return fmt.Sprintf("%d B", n)
	}
	div, exp := int64(unit), 0
	for m := n / unit; m >= unit; m /= unit {
		div *= unit
		exp++
	}
	return fmt.Sprintf("%.1f %ciB", float64(n)/float64(div), "KMGTPE"[exp])
}

// ensureFinalizer puts the finalizer on every sandbox that can be
// snapshotted. An archive lives in an object store, out of reach of owner
// references, so the sandbox must not go before its snapshots do. It is put
// on at the first pass rather than at the first stop: a stop's snapshot
// exists in the store before the status that names it is written.
func (r *SandboxReconciler) ensureFinalizer(ctx context.Context, sbx *v1alpha1.Sandbox) error {
	if r.Snapshots == nil || sbx.Spec.Ephemeral || controllerutil.ContainsFinalizer(sbx, v1alpha1.Finalizer) {
		return nil
	}
	patch := client.MergeFromWithOptions(sbx.DeepCopy(), client.MergeFromWithOptimisticLock{})
	controllerutil.AddFinalizer(sbx, v1alpha1.Finalizer)
	if err := r.Patch(ctx, sbx, patch); err != nil {
		return fmt.Errorf("add finalizer to sandbox %s: %w", sbx.Name, err)
	}
	return nil
}

// finalize deletes a deleted sandbox's snapshots, the last good one and one
// an interrupted stop may have left, and then lets the sandbox go.
func (r *SandboxReconciler) finalize(ctx context.Context, sbx *v1alpha1.Sandbox) error {
	if !controllerutil.ContainsFinalizer(sbx, v1alpha1.Finalizer) {
		return nil
	}
	names := []string{sbx.Status.PendingSnapshot}
	if sbx.Status.Snapshot != nil {
		names = append(names, sbx.Status.Snapshot.Name)
	}
	for _, name := range names {
		if name == "" {
			continue
		}
		if r.Snapshots == nil {
			// The control plane runs without a driver now: waiting would
			// hold the sandbox forever, so it goes and says what is left.
			r.event(sbx, nil, corev1.EventTypeWarning, EventSnapshotFailed, "Delete",
				fmt.Sprintf("snapshot %s was not deleted: the control plane has no snapshot driver", name))
			continue
		}
		if err := r.Snapshots.Delete(ctx, sbx, name); err != nil && !errors.Is(err, snapshot.ErrNotFound) {
			return fmt.Errorf("delete snapshot %s of deleted sandbox %s: %w", name, sbx.Name, err)
		}
	}
	patch := client.MergeFromWithOptions(sbx.DeepCopy(), client.MergeFromWithOptimisticLock{})
	controllerutil.RemoveFinalizer(sbx, v1alpha1.Finalizer)
	if err := r.Patch(ctx, sbx, patch); err != nil {
		return fmt.Errorf("remove finalizer from sandbox %s: %w", sbx.Name, err)
	}
	return nil
}
