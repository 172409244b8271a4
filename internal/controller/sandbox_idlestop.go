package controller

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"strconv"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	logf "sigs.k8s.io/controller-runtime/pkg/log"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	"github.com/agentbox/terraform-provider-agentbox/internal/snapshot"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"
)

// The idle stop (see sandbox_lifecycle.go for the cycle): beginning it,
// syncing and snapshotting the workspace, and then completing, failing,
// abandoning or calling off the stop.

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
	return boundedSnapshotName(sandbox, suffix)
}

// boundedSnapshotName is sandbox followed by suffix, with the sandbox's
// name shortened and hashed when the whole would be too long.
func boundedSnapshotName(sandbox, suffix string) string {
	// VolumeSnapshot names are DNS subdomains of at most 253 characters.
	const maxName = 253
	if len(sandbox)+len(suffix) <= maxName {
		return sandbox + suffix
	}
	sum := sha256.Sum256([]byte(sandbox))
	hash := "-" + hex.EncodeToString(sum[:4])
	return sandbox[:maxName-len(suffix)-len(hash)] + hash + suffix
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
	// A stop deletes the pod, so it begins only from the sandbox as
	// stored. A pass woken by the pod's deletion can read a cache that has
	// not yet seen the status this controller wrote as the last stop ended
	// (SyncFailed, say): to it the sandbox still looks Running and idle,
	// and it would stop it again.
	if err := r.confirmStored(ctx, sbx); err != nil {
		return "", err
	}
	// The stop's snapshot supersedes a checkpoint under way.
	if err := r.dropPendingCheckpoint(ctx, sbx); err != nil {
		return "", err
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
	r.recordStopSnapshot(ctx, sbx, name, state)
	sbx.Status.PendingSnapshot = ""
	sbx.Status.IdleStopRetry = nil
	meta.RemoveStatusCondition(&sbx.Status.Conditions, v1alpha1.ConditionIdleStopBlocked)
	metricSnapshots.WithLabelValues(r.Snapshots.Name(), "ready").Inc()
	if !started.IsZero() {
		metricSnapshotSeconds.WithLabelValues(r.Snapshots.Name()).Observe(r.now().Sub(started).Seconds())
	}
	r.snapshotCut(sbx, EventIdleStopping, name, state.SizeBytes, fmt.Sprintf("snapshot %s of the workspace is ready (%s, %s driver)",
		name, formatBytes(state.SizeBytes), snapshot.ID(r.Snapshots)))
	r.finishStop(sbx, pod, started, fmt.Sprintf("the workspace is in snapshot %s (%s, %s driver); the next activity resumes the sandbox",
		name, formatBytes(state.SizeBytes), snapshot.ID(r.Snapshots)))
	return nil
}

// snapshotRecord is what status records of ready snapshot name.
func (r *SandboxReconciler) snapshotRecord(name string, state snapshot.State) v1alpha1.SandboxSnapshot {
	readyAt := metav1.NewTime(r.now().Truncate(time.Second))
	if !state.ReadyTime.IsZero() {
		readyAt = metav1.NewTime(state.ReadyTime.Truncate(time.Second))
	}
	return v1alpha1.SandboxSnapshot{Name: name, SizeBytes: state.SizeBytes, ReadyTime: &readyAt, Driver: snapshot.ID(r.Snapshots)}
}

// recordStopSnapshot makes a stop's ready snapshot the sandbox's, and
// deletes what it supersedes: the previous snapshot and every checkpoint.
// Only after the new one is ready, so a stop never leaves the sandbox
// without a snapshot. A failed delete leaks storage, not data, so it is
// logged and does not hold the stop up.
func (r *SandboxReconciler) recordStopSnapshot(ctx context.Context, sbx *v1alpha1.Sandbox, name string, state snapshot.State) {
	var stale []string
	if prev := sbx.Status.Snapshot; prev != nil && prev.Name != name && !prev.Checkpoint {
		// A checkpoint is in status.checkpoints too.
		stale = append(stale, prev.Name)
	}
	for _, c := range sbx.Status.Checkpoints {
		if c.Name != name {
			stale = append(stale, c.Name)
		}
	}
	rec := r.snapshotRecord(name, state)
	sbx.Status.Snapshot = &rec
	sbx.Status.Checkpoints = nil
	r.deleteSnapshots(ctx, sbx, stale)
}

// deleteSnapshots deletes superseded snapshots, logging what fails.
func (r *SandboxReconciler) deleteSnapshots(ctx context.Context, sbx *v1alpha1.Sandbox, names []string) {
	for _, n := range names {
		if err := r.Snapshots.Delete(ctx, sbx, n); err != nil && !errors.Is(err, snapshot.ErrNotFound) {
			logf.FromContext(ctx).Error(err, "delete superseded snapshot", "snapshot", n)
		}
	}
}

// confirmStored returns a conflict, which sends the pass round again on a
// fresh read, when the Sandbox as stored is newer than the cached one the
// pass works from.
func (r *SandboxReconciler) confirmStored(ctx context.Context, sbx *v1alpha1.Sandbox) error {
	var live v1alpha1.Sandbox
	if err := r.apiReader().Get(ctx, client.ObjectKeyFromObject(sbx), &live); err != nil {
		return fmt.Errorf("read sandbox %s before beginning its stop: %w", sbx.Name, err)
	}
	if live.ResourceVersion != sbx.ResourceVersion {
		return apierrors.NewConflict(v1alpha1.GroupVersion.WithResource("sandboxes").GroupResource(), sbx.Name,
			fmt.Errorf("the cache holds resourceVersion %s, the API server %s", sbx.ResourceVersion, live.ResourceVersion))
	}
	return nil
}

// stopRecorded reports whether the Sandbox as stored, not as cached, is
// already Stopped with snapshot name: an earlier pass finished this stop.
func (r *SandboxReconciler) stopRecorded(ctx context.Context, sbx *v1alpha1.Sandbox, name string) (bool, error) {
	var live v1alpha1.Sandbox
	if err := r.apiReader().Get(ctx, client.ObjectKeyFromObject(sbx), &live); err != nil {
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
