package holds

import (
	"context"
	"errors"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	"github.com/agentbox/terraform-provider-agentbox/internal/store"
)

// Hold is a live hold on a sandbox.
type Hold struct {
	Holder, ID string
	Expires    time.Time
}

// Blocking returns the live hold on sb that keeps out a call presenting
// the hold ID presented (empty when it presents none), and false when
// no hold keeps it out: sb is free, or the call presents its hold's ID.
func (k *Keeper) Blocking(ctx context.Context, sb *v1alpha1.Sandbox, presented string) (Hold, bool) {
	h, held := k.current(ctx, sb, k.writer)
	if !held || h.ID == presented {
		return Hold{}, false
	}
	// Refusals are rare and the cache may be a moment behind a release
	// or a new hold: the Lease as the API server has it decides.
	h, held = k.current(ctx, sb, k.reader)
	if !held || h.ID == presented {
		return Hold{}, false
	}
	return h, true
}

// current returns the live hold on sb, reading its Lease through r. A
// sandbox of a warm pool may be held by a pool lease whose hold is not in
// the Lease yet: the store's take is its hold until the Lease shows the
// take was settled. Failures to read count as no hold: the call goes on,
// as it did before holds were enforced, and the failure is logged.
func (k *Keeper) current(ctx context.Context, sb *v1alpha1.Sandbox, r client.Reader) (Hold, bool) {
	now := k.clock.Now()
	var l coordinationv1.Lease
	if err := r.Get(ctx, ActivityLeaseKey(sb), &l); err != nil && !apierrors.IsNotFound(err) {
		k.log.Error(err, "read the sandbox's lease to check its hold", "lease", ActivityLeaseKey(sb).String())
		return Hold{}, false
	}
	if holder, expiry := v1alpha1.LeaseHoldExpiry(&l.Spec); holder != "" && now.Before(expiry) {
		return Hold{Holder: holder, ID: l.Annotations[v1alpha1.AnnotationLeaseID], Expires: expiry}, true
	}
	if k.store == nil || sb.Labels[v1alpha1.LabelWarmPool] == "" {
		return Hold{}, false
	}
	t, err := k.store.WarmTakeOf(ctx, string(sb.UID))
	if err != nil {
		if !errors.Is(err, store.ErrNotFound) {
			k.log.Error(err, "look up the pool lease of a warm sandbox", "sandbox", sb.Namespace+"/"+sb.Name)
		}
		return Hold{}, false
	}
	if t.Taker != store.WarmTakenByLease || settled(&l, t) {
		// Not a pool lease, or settled: the Lease said all there is.
		return Hold{}, false
	}
	expiry := t.TakenAt.Add(time.Duration(t.TTLSeconds) * time.Second)
	if !now.Before(expiry) {
		return Hold{}, false
	}
	return Hold{Holder: t.Holder, ID: t.LeaseID, Expires: expiry}, true
}

// settled reports whether l shows that the pool lease t was written into
// it: held under t's ID, or held and over already. A warm sandbox's Lease
// has no holds before its take, so these marks are this take's.
func settled(l *coordinationv1.Lease, t store.WarmTake) bool {
	return l.Annotations[v1alpha1.AnnotationLeaseID] == t.LeaseID ||
		l.Annotations[v1alpha1.AnnotationLeaseReleasedRequestID] == t.RequestID ||
		l.Annotations[v1alpha1.AnnotationLeaseExpiredHolder] == t.Holder
}
