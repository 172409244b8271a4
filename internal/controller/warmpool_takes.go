package controller

import (
	"context"
	"errors"
	"fmt"
	"time"

	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	"github.com/agentbox/terraform-provider-agentbox/internal/store"
)

// WarmTakes decides who gets each ready warm sandbox (store.WarmTake): the
// Compute API's pool leases, adoptions by new Sandboxes and the pool's own
// deletions each take a sandbox through it before writing anything, so
// exactly one of them gets it, with one store write instead of an
// optimistic-lock write to the API server. The control plane passes its
// store. Without one (nil), the Compute API leases nothing from pools, and
// adoption and deletion fall back to the Sandbox's resourceVersion alone.
type WarmTakes interface {
	TakeWarm(ctx context.Context, t store.WarmTake) (store.WarmTake, bool, error)
	ListWarmTakes(ctx context.Context, namespace, pool string) ([]store.WarmTake, error)
	ForgetWarmTake(ctx context.Context, sandboxUID string) error
}

// warmTakeSettle is how long a take may go without the annotations that
// say it on its sandbox before the pool's controller writes them itself.
// Whoever took it writes them within milliseconds; a take still without
// them this long after means that taker died in between.
const warmTakeSettle = 30 * time.Second

// warmTakeForget is how long after its sandbox has gone a take is kept: a
// cache behind the store may not show a sandbox that was just taken.
const warmTakeForget = 2 * time.Minute

// takeWarm takes w for taker through takes, and reports whether the caller
// has it: a new take, or one this same taker made before (a retried pass).
func takeWarm(ctx context.Context, takes WarmTakes, w *v1alpha1.Sandbox, taker store.WarmTaker, holder, request string) (bool, error) {
	got, took, err := takes.TakeWarm(ctx, store.WarmTake{SandboxUID: string(w.UID), Namespace: w.Namespace,
		Pool: w.Labels[v1alpha1.LabelWarmPool], Sandbox: w.Name, Taker: taker, Holder: holder, RequestID: request})
	switch {
	case errors.Is(err, store.ErrConflict):
		return false, nil
	case err != nil:
		return false, fmt.Errorf("take warm sandbox %s: %w", w.Name, err)
	}
	return took || (got.Taker == taker && got.Holder == holder && got.RequestID == request), nil
}

// poolTakes returns the takes of the pool's sandboxes by sandbox UID, and
// forgets those whose sandbox has been gone a while.
func (r *SandboxWarmPoolReconciler) poolTakes(ctx context.Context, pool *v1alpha1.SandboxWarmPool, live map[types.UID]bool) (map[types.UID]store.WarmTake, error) {
	if r.WarmTakes == nil {
		return nil, nil
	}
	list, err := r.WarmTakes.ListWarmTakes(ctx, pool.Namespace, pool.Name)
	if err != nil {
		return nil, fmt.Errorf("list the takes of warm pool %s: %w", pool.Name, err)
	}
	now := r.now()
	takes := make(map[types.UID]store.WarmTake, len(list))
	for _, t := range list {
		uid := types.UID(t.SandboxUID)
		if !live[uid] {
			if now.Sub(t.TakenAt) > warmTakeForget {
				if err := r.WarmTakes.ForgetWarmTake(ctx, t.SandboxUID); err != nil {
					return nil, fmt.Errorf("forget the take of gone warm sandbox %s: %w", t.Sandbox, err)
				}
			}
			continue
		}
		takes[uid] = t
	}
	return takes, nil
}

// settleTake finishes a retirement the pool took, and writes the
// annotations of another take whose taker has not, once warmTakeSettle has
// passed; before that, it tells when to look again.
// From then on the sandbox is handled as any leased or claimed one: a pool
// lease without its hold is recycled after v1alpha1.PoolLeaseGrace, a
// claim whose adopter has gone is dropped.
func (r *SandboxWarmPoolReconciler) settleTake(ctx context.Context, pool *v1alpha1.SandboxWarmPool, s *v1alpha1.Sandbox, t store.WarmTake) (time.Duration, error) {
	if t.Taker == store.WarmTakenByRetirement {
		// The pool's own take (this controller runs on the leader only):
		// nobody else is still writing, so the deletion is finished now.
		return 0, r.deleteTaken(ctx, pool, s, "its pool retired it")
	}
	if wait := warmTakeSettle - r.now().Sub(t.TakenAt); wait > 0 {
		return wait, nil
	}
	patch := client.MergeFrom(s.DeepCopy())
	if s.Annotations == nil {
		s.Annotations = map[string]string{}
	}
	switch t.Taker {
	case store.WarmTakenByLease:
		s.Annotations[v1alpha1.AnnotationPoolLeaseHolder] = t.Holder
		s.Annotations[v1alpha1.AnnotationPoolLeaseRequestID] = t.RequestID
		s.Annotations[v1alpha1.AnnotationPoolLeasedAt] = t.TakenAt.UTC().Format(time.RFC3339Nano)
	case store.WarmTakenByAdoption:
		s.Annotations[v1alpha1.AnnotationAdoptedBy] = t.Holder
	}
	if err := r.Patch(ctx, s, patch); client.IgnoreNotFound(err) != nil {
		return 0, fmt.Errorf("record the %s take of warm sandbox %s: %w", t.Taker, s.Name, err)
	}
	return 0, nil
}

// retireWarm deletes an unassigned warm sandbox that the pool no longer
// wants, unless someone took it first.
func (r *SandboxWarmPoolReconciler) retireWarm(ctx context.Context, pool *v1alpha1.SandboxWarmPool, s *v1alpha1.Sandbox, why string) error {
	if r.WarmTakes == nil {
		return r.deleteWarm(ctx, pool, s, why)
	}
	ok, err := takeWarm(ctx, r.WarmTakes, s, store.WarmTakenByRetirement, "", "")
	if err != nil || !ok {
		return err
	}
	return r.deleteTaken(ctx, pool, s, why)
}

// deleteTaken deletes a warm sandbox the pool has taken for itself. The
// take is what keeps it from adopters and leases, so unlike deleteWarm it
// does not also need the resourceVersion read, which a status write may
// since have moved.
func (r *SandboxWarmPoolReconciler) deleteTaken(ctx context.Context, pool *v1alpha1.SandboxWarmPool, s *v1alpha1.Sandbox, why string) error {
	uid := s.UID
	return r.deleteWarmWith(ctx, pool, s, why, client.Preconditions{UID: &uid})
}
