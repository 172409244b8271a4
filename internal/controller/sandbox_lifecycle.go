package controller

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/controller/controllerutil"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	"github.com/agentbox/terraform-provider-agentbox/internal/filespace"
	"github.com/agentbox/terraform-provider-agentbox/internal/pki"
	"github.com/agentbox/terraform-provider-agentbox/internal/snapshot"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"
)

// The idle-stop and resume cycle.
//
// The cycle keeps almost no state of its own. A sandbox should be running
// exactly when it is not idle, and idleness is read from the activity clock
// (the sandbox's Lease, whose renewTime the Compute API moves on each call):
// a stop starts when the clock has not moved for the idle timeout, and a renew on a stopped sandbox is the wake-up signal. What
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

// activity is what the activity clock says about a sandbox's use.
type activity struct {
	last    time.Time     // the activity clock's renewTime; zero when unknown
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

func (r *SandboxReconciler) activityOf(sbx *v1alpha1.Sandbox, tpl *v1alpha1.SandboxTemplate, activityClock *coordinationv1.Lease) activity {
	a := activity{timeout: DefaultIdleTimeout}
	switch {
	case sbx.Spec.IdleTimeout != nil && sbx.Spec.IdleTimeout.Duration > 0:
		a.timeout = sbx.Spec.IdleTimeout.Duration
	case tpl != nil && tpl.Spec.IdleTimeout.Duration > 0:
		a.timeout = tpl.Spec.IdleTimeout.Duration
	}
	if activityClock != nil && activityClock.Spec.RenewTime != nil {
		a.last = activityClock.Spec.RenewTime.Time
		a.idleFor = r.now().Sub(a.last)
		// The last activity woke the sandbox, and the call that did waits
		// for it to serve: it is idle only a whole timeout after it began
		// to, however long the resume took.
		if v1alpha1.LeaseWoken(activityClock.Annotations, activityClock.Spec.RenewTime) {
			if since := servingSince(sbx); since.After(a.last) {
				a.idleFor = r.now().Sub(since)
			}
		}
	}
	return a
}

// servingSince is when the sandbox last began to serve; zero when it does
// not serve.
func servingSince(sbx *v1alpha1.Sandbox) time.Time {
	c := meta.FindStatusCondition(sbx.Status.Conditions, v1alpha1.ConditionReady)
	if sbx.Status.Phase != v1alpha1.SandboxPhaseRunning || c == nil || c.Status != metav1.ConditionTrue {
		return time.Time{}
	}
	return c.LastTransitionTime.Time
}

// recordActivity mirrors the activity clock's renewTime into
// status.lastActivityTime.
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

// serving reports whether a sandbox whose Ready condition had reason was
// already taking calls.
func serving(reason string) bool {
	return reason == v1alpha1.ReasonRunning || reason == v1alpha1.ReasonAdoptedFromWarmPool
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
	if !r.wantsFinalizer(sbx) {
		return nil
	}
	patch := client.MergeFromWithOptions(sbx.DeepCopy(), client.MergeFromWithOptimisticLock{})
	controllerutil.AddFinalizer(sbx, v1alpha1.Finalizer)
	if err := r.Patch(ctx, sbx, patch); err != nil {
		return fmt.Errorf("add finalizer to sandbox %s: %w", sbx.Name, err)
	}
	return nil
}

// wantsFinalizer reports whether sbx lacks the finalizer it should have.
func (r *SandboxReconciler) wantsFinalizer(sbx *v1alpha1.Sandbox) bool {
	return r.Snapshots != nil && !sbx.Spec.Ephemeral && !controllerutil.ContainsFinalizer(sbx, v1alpha1.Finalizer)
}

// finalize deletes a deleted sandbox's snapshots, the last good one, its
// checkpoints and one an interrupted stop or checkpoint may have left, and
// then lets the sandbox go.
func (r *SandboxReconciler) finalize(ctx context.Context, sbx *v1alpha1.Sandbox) error {
	if !controllerutil.ContainsFinalizer(sbx, v1alpha1.Finalizer) {
		return nil
	}
	names := []string{sbx.Status.PendingSnapshot, sbx.Status.PendingCheckpoint}
	if sbx.Status.Snapshot != nil {
		names = append(names, sbx.Status.Snapshot.Name)
	}
	for _, c := range sbx.Status.Checkpoints {
		names = append(names, c.Name)
	}
	slices.Sort(names)
	for _, name := range slices.Compact(names) {
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
