package controller

import (
	"context"
	"fmt"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
)

// EventLeaseExpired is recorded on a Sandbox when the controller removes an
// exclusive hold whose holder stopped heartbeating.
const EventLeaseExpired = "LeaseExpired"

// reconcileHold reports the agent's hold on the sandbox (an exclusive
// hold, written into the activity clock; the API calls it a lease) in the
// Leased condition and reclaims it once it has expired, so that a holder
// that crashed cannot leave the sandbox busy for ever. It returns how long
// until the current hold expires, or 0 when there is none, so that the
// caller requeues at that moment: nothing else would wake the controller
// when a holder simply goes quiet.
func (r *SandboxReconciler) reconcileHold(ctx context.Context, sbx *v1alpha1.Sandbox, activityClock *coordinationv1.Lease) (time.Duration, error) {
	now := r.now()
	holder, expiry := v1alpha1.LeaseHoldExpiry(&activityClock.Spec)
	if holder == "" {
		// After a reclaim the hold is gone too; Expired says more than
		// Released until the next holder comes. It is read from the activity clock,
		// not from the sandbox's previous status, which the cache may not
		// show yet when the reclaim's own update of it wakes this pass.
		if expired := activityClock.Annotations[v1alpha1.AnnotationLeaseExpiredHolder]; expired != "" {
			r.setLeased(sbx, metav1.ConditionFalse, v1alpha1.ReasonLeaseExpired, expiredMessage(expired))
		} else {
			r.setLeased(sbx, metav1.ConditionFalse, v1alpha1.ReasonLeaseReleased, "nobody holds the sandbox's lease")
		}
		return 0, nil
	}
	if now.Before(expiry) {
		// The message leaves out the expiry: it moves with every heartbeat,
		// and putting it here would turn each heartbeat into a status write.
		msg := fmt.Sprintf("held by %q", holder)
		if activityClock.Spec.AcquireTime != nil {
			msg += " since " + activityClock.Spec.AcquireTime.UTC().Format(time.RFC3339)
		}
		r.setLeased(sbx, metav1.ConditionTrue, v1alpha1.ReasonLeaseHeld, msg)
		return expiry.Sub(now), nil
	}

	// The update carries the resourceVersion read, so a heartbeat that
	// lands first makes it fail with a conflict; Reconcile then retries from
	// the renewed activity clock and finds the hold alive. renewTime, the
	// activity itself, is left alone: a holder going quiet is not activity.
	activityClock.Spec.HolderIdentity = nil
	activityClock.Spec.LeaseDurationSeconds = nil
	activityClock.Spec.AcquireTime = nil
	delete(activityClock.Annotations, v1alpha1.AnnotationLeaseRequestID)
	delete(activityClock.Annotations, v1alpha1.AnnotationLeaseID)
	if activityClock.Annotations == nil {
		activityClock.Annotations = map[string]string{}
	}
	activityClock.Annotations[v1alpha1.AnnotationLeaseExpiredHolder] = holder
	if err := r.Update(ctx, activityClock); err != nil {
		return 0, fmt.Errorf("reclaim expired hold on Lease %s: %w", activityClock.Name, err)
	}
	r.setLeased(sbx, metav1.ConditionFalse, v1alpha1.ReasonLeaseExpired, expiredMessage(holder))
	r.event(sbx, activityClock, corev1.EventTypeWarning, EventLeaseExpired, "Reclaim",
		fmt.Sprintf("the lease held by %q expired at %s without a heartbeat; the hold was removed and the sandbox is free again",
			holder, expiry.UTC().Format(time.RFC3339)))
	return 0, nil
}

// expiredMessage is the Leased message after a reclaim. It carries no
// time, so that every pass until the next acquire writes the same one.
func expiredMessage(holder string) string {
	return fmt.Sprintf("the lease held by %q expired without a heartbeat and was reclaimed; the sandbox is free", holder)
}

func (r *SandboxReconciler) setLeased(sbx *v1alpha1.Sandbox, status metav1.ConditionStatus, reason, msg string) {
	setCondition(&sbx.Status.Conditions, v1alpha1.ConditionLeased, sbx.Generation, r.now(), status, reason, msg)
}
