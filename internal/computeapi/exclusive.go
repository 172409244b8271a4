package computeapi

import (
	"context"
	"errors"
	"net/http"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	api "github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
	"github.com/agentbox/terraform-provider-agentbox/internal/store"
)

// The exclusive lease is enforced on every call that reaches a sandbox:
// while a hold is live (its holder set and its expiry ahead), a call is
// served only if it names the hold's lease ID in the api.HeaderLeaseID
// header, whoever's token it carries; any other call gets lease_held with
// the holder and the expiry. The lease ID is the proof, not the token or
// the holder name: one token often serves several runs (an admin token,
// an orchestrator's), holder names are the caller's to choose, and the
// lease ID is unguessable and given only to the acquirer, which may hand
// it on to whatever acts for it. A call that names a lease that is no
// longer held is served like any other call on a free sandbox: the holder
// learns from its heartbeat that the hold is gone.
//
// Exempt are the lease calls themselves, status (which reads the Sandbox
// only and never wakes it), and the staff console, which passes a hold
// and says so in its audit record. A pool lease is a hold too, from the
// moment the store records the take, before the hold is written into the
// sandbox's Lease (settleSoon).

// heldHold is a live hold on a sandbox.
type heldHold struct {
	holder, leaseID string
	expires         time.Time
}

type leaseIDKey struct{}

// withPresentedLease puts the lease ID a call presents into its context.
func withPresentedLease(r *http.Request) *http.Request {
	id := r.Header.Get(api.HeaderLeaseID)
	if id == "" {
		return r
	}
	return r.WithContext(context.WithValue(r.Context(), leaseIDKey{}, id))
}

func presentedLease(ctx context.Context) string {
	id, _ := ctx.Value(leaseIDKey{}).(string)
	return id
}

type holdBypassKey struct{}

// withHoldBypass marks a call that a hold does not keep out (the staff
// console); checkHold records in its audit entry that it passed one.
func withHoldBypass(ctx context.Context) context.Context {
	return context.WithValue(ctx, holdBypassKey{}, true)
}

// checkHold refuses the call of ctx on sb with lease_held while someone
// holds sb's lease and the call does not present that hold's lease ID.
func (s *Server) checkHold(ctx context.Context, sb *v1alpha1.Sandbox) *api.Error {
	presented := presentedLease(ctx)
	h, held := s.currentHold(ctx, sb, s.leaseWriter)
	if !held || h.leaseID == presented {
		return nil
	}
	// Refusals are rare and the cache may be a moment behind a release
	// or a new hold: the Lease as the API server has it decides.
	h, held = s.currentHold(ctx, sb, s.leaseReader)
	if !held || h.leaseID == presented {
		return nil
	}
	expires := h.expires.UTC().Format(time.RFC3339Nano)
	if bypass, _ := ctx.Value(holdBypassKey{}).(bool); bypass {
		noteAudit(ctx, "lease_bypassed", map[string]string{"holder": h.holder, "expires_at": expires})
		return nil
	}
	e := api.Errorf(api.CodeLeaseHeld, "the sandbox of agent %q is leased by %q until %s; only calls that present that lease's ID (header %s) are served",
		sb.Spec.AgentID, h.holder, h.expires.UTC().Format(time.RFC3339), api.HeaderLeaseID)
	e.Details = map[string]string{"holder": h.holder, "expires_at": expires}
	return e
}

// currentHold returns the live hold on sb, reading its Lease through r.
// A sandbox of a warm pool may be held by a pool lease whose hold is not
// in the Lease yet: the store's take is its hold until the Lease shows the
// take was settled. Failures to read count as no hold: the call goes on,
// as it did before holds were enforced, and the failure is logged.
func (s *Server) currentHold(ctx context.Context, sb *v1alpha1.Sandbox, r client.Reader) (heldHold, bool) {
	now := s.clock.Now()
	var l coordinationv1.Lease
	if err := r.Get(ctx, LeaseKey(sb), &l); err != nil && !apierrors.IsNotFound(err) {
		s.log.Error(err, "read the sandbox's lease to check its hold", "lease", LeaseKey(sb).String())
		return heldHold{}, false
	}
	if holder, expiry := v1alpha1.LeaseHoldExpiry(&l.Spec); holder != "" && now.Before(expiry) {
		return heldHold{holder: holder, leaseID: l.Annotations[v1alpha1.AnnotationLeaseID], expires: expiry}, true
	}
	if s.store == nil || sb.Labels[v1alpha1.LabelWarmPool] == "" {
		return heldHold{}, false
	}
	t, err := s.store.WarmTakeOf(ctx, string(sb.UID))
	if err != nil {
		if !errors.Is(err, store.ErrNotFound) {
			s.log.Error(err, "look up the pool lease of a warm sandbox", "sandbox", sb.Namespace+"/"+sb.Name)
		}
		return heldHold{}, false
	}
	if t.Taker != store.WarmTakenByLease || l.Annotations[v1alpha1.AnnotationLeaseID] == t.LeaseID ||
		l.Annotations[v1alpha1.AnnotationLeaseReleasedRequestID] == t.RequestID || l.Annotations[v1alpha1.AnnotationLeaseExpiredHolder] == t.Holder {
		// Not a pool lease, or settled: the Lease said all there is.
		return heldHold{}, false
	}
	expiry := t.TakenAt.Add(time.Duration(t.TTLSeconds) * time.Second)
	if !now.Before(expiry) {
		return heldHold{}, false
	}
	return heldHold{holder: t.Holder, leaseID: t.LeaseID, expires: expiry}, true
}
