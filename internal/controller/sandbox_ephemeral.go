package controller

import (
	"context"
	"fmt"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
)

// EventEphemeralRecycled is recorded on a warm sandbox deleted because its
// ephemeral lease ended; its pool has already made the replacement.
const EventEphemeralRecycled = "EphemeralRecycled"

// recycleEphemeral deletes a sandbox leased from its pool (see
// v1alpha1.AnnotationPoolLeaseRequestID) once its run is over: the hold of
// the acquire that took it was released, expired, or was never taken
// within PoolLeaseGrace. Deleting rather than cleaning is what makes the
// run ephemeral: the pod, the workspace claim and the activity clock all go with
// the Sandbox, and the next run gets a fresh one from the pool.
//
// It reports whether the sandbox was deleted, and otherwise when to look
// again (the hold's expiry or the end of the grace), because nothing else
// wakes the controller when a holder simply goes quiet.
func (r *SandboxReconciler) recycleEphemeral(ctx context.Context, sbx *v1alpha1.Sandbox, activityClock *coordinationv1.Lease) (bool, time.Duration, error) {
	if !isWarm(sbx) || !v1alpha1.PoolLeased(sbx) || sbx.Annotations[v1alpha1.AnnotationPoolReset] != "" {
		// Not leased, or its lease has ended and it is being reset
		// (continuePoolReset).
		return false, 0, nil
	}
	now := r.now()
	holder, expiry := v1alpha1.LeaseHoldExpiry(&activityClock.Spec)
	request := sbx.Annotations[v1alpha1.AnnotationPoolLeaseRequestID]
	ours := holder != "" && holder == sbx.Annotations[v1alpha1.AnnotationPoolLeaseHolder] &&
		activityClock.Annotations[v1alpha1.AnnotationLeaseRequestID] == request
	var why string
	switch {
	case ours && now.Before(expiry):
		return false, expiry.Sub(now), nil
	case ours:
		why = fmt.Sprintf("the lease of %q expired at %s without a heartbeat", holder, expiry.UTC().Format(time.RFC3339))
	case activityClock.Annotations[v1alpha1.AnnotationLeaseReleasedRequestID] == request:
		why = fmt.Sprintf("%q released its lease", sbx.Annotations[v1alpha1.AnnotationPoolLeaseHolder])
	default:
		grace := v1alpha1.PoolLeaseGrace
		if sbx.Annotations[v1alpha1.AnnotationPoolColdStart] == "true" {
			// Made for its lease, which holds it only once it is ready.
			grace = v1alpha1.PoolColdStartGrace
		}
		taken, err := time.Parse(time.RFC3339Nano, sbx.Annotations[v1alpha1.AnnotationPoolLeasedAt])
		if err == nil && now.Sub(taken) < grace {
			// The acquire that took it may not have written the hold yet.
			return false, grace - now.Sub(taken), nil
		}
		why = fmt.Sprintf("the lease of %q was not held within %s of taking the sandbox, or was taken over",
			sbx.Annotations[v1alpha1.AnnotationPoolLeaseHolder], grace)
	}
	if r.reusedByPool(ctx, sbx) {
		return false, poolResetRecheck, r.beginPoolReset(ctx, sbx, why)
	}
	uid := sbx.UID
	if err := r.Delete(ctx, sbx, client.Preconditions{UID: &uid}); err != nil && !apierrors.IsNotFound(err) {
		return false, 0, fmt.Errorf("delete ephemeral sandbox %s: %w", sbx.Name, err)
	}
	metricEphemeralRecycled.Inc()
	r.event(sbx, nil, corev1.EventTypeNormal, EventEphemeralRecycled, "Delete",
		fmt.Sprintf("%s; the ephemeral sandbox was deleted with its workspace so that no state reaches the next run", why))
	return true, 0, nil
}
