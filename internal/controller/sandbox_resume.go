package controller

import (
	"context"
	"errors"
	"fmt"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	"github.com/agentbox/terraform-provider-agentbox/internal/snapshot"
)

// The resume: a workspace claim created from the last snapshot, and the
// restore through the supervisor once the new pod is ready.

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
