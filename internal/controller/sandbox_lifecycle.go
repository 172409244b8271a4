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

// The idle-stop and resume cycle (DESIGN.md, "Sandbox lifecycle").
//
// The cycle keeps almost no state of its own. A sandbox should be running
// exactly when it is not idle, and idleness is read from the activity Lease
// the Compute API renews: a stop starts when the Lease has not moved for the
// idle timeout, and a renew on a stopped sandbox is the wake-up signal. What
// must survive a restart of the control plane mid-way lives in objects: the
// snapshot being taken in status.pendingSnapshot, and a workspace claim still
// to be filled from a snapshot in its restore-from annotation.

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

// snapshotPoll is how often a snapshot that is not ready yet is looked at
// again. A VolumeSnapshot's readiness does wake the sandbox through no
// watch (the sandbox does not own it through this controller's cache).
const snapshotPoll = 2 * time.Second

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
// activity at last. It is derived, not random, so that a pass that runs
// again before its status write is visible picks the same name.
func snapshotName(sandbox string, last time.Time) string {
	suffix := "-" + strconv.FormatInt(last.Unix(), 10)
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
// after a stop, or after a failed one.
func parked(sbx *v1alpha1.Sandbox, a activity) bool {
	if !a.idle() {
		return false
	}
	switch sbx.Status.Phase {
	case v1alpha1.SandboxPhaseStopped:
		return true
	case v1alpha1.SandboxPhaseError:
		return readyReason(sbx) == v1alpha1.ReasonSnapshotFailed
	}
	return false
}

// idleStop runs one step of the stop: flush, snapshot, and once the
// snapshot is ready, delete the pod and the claim and record the snapshot.
// It is called again until the stop is over.
func (r *SandboxReconciler) idleStop(ctx context.Context, prevReason string, sbx *v1alpha1.Sandbox, tpl *v1alpha1.SandboxTemplate, a activity, pod *corev1.Pod) (ctrl.Result, error) {
	log := logf.FromContext(ctx)
	name := sbx.Status.PendingSnapshot
	if sbx.Status.Phase != v1alpha1.SandboxPhaseIdleStopping || name == "" {
		if !sbx.Spec.Ephemeral {
			name = snapshotName(sbx.Name, a.last)
		}
		sbx.Status.PendingSnapshot = name
		msg := fmt.Sprintf("idle since %s (idle timeout %s); ", a.last.UTC().Format(time.RFC3339), a.timeout)
		if sbx.Spec.Ephemeral {
			msg += "the sandbox is ephemeral, so its pod and workspace are deleted without a snapshot"
		} else {
			msg += fmt.Sprintf("snapshotting the workspace into %s with the %s driver", name, r.Snapshots.Name())
		}
		r.setPhase(sbx, v1alpha1.SandboxPhaseIdleStopping, metav1.ConditionFalse, v1alpha1.ReasonIdleTimeout, msg)
		r.eventOnNewReason(prevReason, sbx, pod, corev1.EventTypeNormal, EventIdleStopping, "Stop", msg)
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

	var sup *supervisorapi.Client
	if pod != nil && pod.DeletionTimestamp.IsZero() && podReady(pod) && pod.Status.PodIP != "" {
		var err error
		if sup, err = r.supervisor(sbx, pod); err != nil {
			return ctrl.Result{}, err
		}
		if err := r.syncBeforeStop(ctx, sbx, sup); err != nil {
			// Seed 000's sync failure: retried once already; the pod stops
			// and the sandbox is marked Error. The claim keeps the data (no
			// snapshot is taken of a volume whose last writes may not have
			// reached it), and the next activity starts the pod on it.
			if err := r.deleteWorkload(ctx, sbx, pod, false); err != nil {
				return ctrl.Result{}, err
			}
			sbx.Status.PendingSnapshot = ""
			msg := fmt.Sprintf("syncing the workspace before the snapshot failed twice (%v); the pod is stopped without a snapshot, the workspace claim %s is kept, and the next activity starts the sandbox again",
				err, WorkspaceClaimName(workloadName(sbx)))
			r.setNotServing(sbx, v1alpha1.SandboxPhaseError, v1alpha1.ReasonSyncFailed, msg)
			r.event(sbx, pod, corev1.EventTypeWarning, EventSyncFailed, "Sync", msg)
			return ctrl.Result{}, nil
		}
	}

	state, err := r.Snapshots.Take(ctx, snapshot.Request{
		Sandbox: sbx, Template: tpl, ClaimName: WorkspaceClaimName(workloadName(sbx)), Name: name, Supervisor: sup,
	})
	if err != nil {
		return ctrl.Result{}, fmt.Errorf("snapshot %s: %w", name, err)
	}
	if state.Failed != "" {
		// Keep the claim: without a new snapshot it holds the only copy of
		// the newest data. The pod goes, as the stop asked.
		if err := r.deleteWorkload(ctx, sbx, pod, false); err != nil {
			return ctrl.Result{}, err
		}
		if err := r.Snapshots.Delete(ctx, sbx, name); err != nil {
			log.Error(err, "delete failed snapshot", "snapshot", name)
		}
		sbx.Status.PendingSnapshot = ""
		msg := fmt.Sprintf("snapshot %s failed: %s; the pod is stopped, the workspace claim %s and the last good snapshot are kept, and the next activity starts the sandbox again",
			name, state.Failed, WorkspaceClaimName(workloadName(sbx)))
		if sbx.Status.Snapshot == nil {
			msg = fmt.Sprintf("snapshot %s failed: %s; the pod is stopped, the workspace claim %s is kept, and the next activity starts the sandbox again",
				name, state.Failed, WorkspaceClaimName(workloadName(sbx)))
		}
		r.setNotServing(sbx, v1alpha1.SandboxPhaseError, v1alpha1.ReasonSnapshotFailed, msg)
		r.event(sbx, nil, corev1.EventTypeWarning, EventSnapshotFailed, "Snapshot", msg)
		metricSnapshots.WithLabelValues(r.Snapshots.Name(), "failed").Inc()
		return ctrl.Result{}, nil
	}
	if !state.Ready {
		r.setPhase(sbx, v1alpha1.SandboxPhaseIdleStopping, metav1.ConditionFalse, v1alpha1.ReasonIdleTimeout,
			fmt.Sprintf("waiting for snapshot %s of the workspace to become ready (%s driver)", name, r.Snapshots.Name()))
		return ctrl.Result{RequeueAfter: snapshotPoll}, nil
	}

	if err := r.deleteWorkload(ctx, sbx, pod, true); err != nil {
		return ctrl.Result{}, err
	}
	readyAt := metav1.NewTime(r.now().Truncate(time.Second))
	if !state.ReadyTime.IsZero() {
		readyAt = metav1.NewTime(state.ReadyTime.Truncate(time.Second))
	}
	prev := sbx.Status.Snapshot
	sbx.Status.Snapshot = &v1alpha1.SandboxSnapshot{Name: name, SizeBytes: state.SizeBytes, ReadyTime: &readyAt}
	sbx.Status.PendingSnapshot = ""
	if prev != nil && prev.Name != name {
		// Only after the new one is ready, so a stop never leaves the
		// sandbox without a snapshot. A failure here leaks storage, not
		// data, so it does not hold the stop up.
		if err := r.Snapshots.Delete(ctx, sbx, prev.Name); err != nil {
			log.Error(err, "delete superseded snapshot", "snapshot", prev.Name)
		}
	}
	metricSnapshots.WithLabelValues(r.Snapshots.Name(), "ready").Inc()
	if !started.IsZero() {
		metricSnapshotSeconds.WithLabelValues(r.Snapshots.Name()).Observe(r.now().Sub(started).Seconds())
	}
	r.finishStop(sbx, pod, started, fmt.Sprintf("the workspace is in snapshot %s (%s); the next activity resumes the sandbox",
		name, formatBytes(state.SizeBytes)))
	return ctrl.Result{}, nil
}

// syncRetryDelay spaces the two sync attempts of an idle stop.
var syncRetryDelay = time.Second

// syncBeforeStop pushes the workspace into the agent's filespace and then
// makes the workspace's last writes durable before it is snapshotted,
// retrying once as seed 000 asks. The push comes first because it writes
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
	sup, err := r.supervisor(sbx, pod)
	if err != nil {
		return false, err
	}
	start := r.now()
	err = r.Snapshots.Restore(ctx, snapshot.RestoreRequest{Sandbox: sbx, Snapshot: snap, Supervisor: sup})
	if errors.Is(err, snapshot.ErrNotFound) {
		msg := fmt.Sprintf("cannot restore the workspace from snapshot %s: %v; the sandbox takes no calls rather than serve an empty workspace; delete the Sandbox to start afresh", name, err)
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
