package computeapi

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"net/http"
	"time"

	"github.com/go-logr/logr"
	coordinationv1 "k8s.io/api/coordination/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/util/retry"
	"k8s.io/utils/ptr"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	api "github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
	"github.com/agentbox/terraform-provider-agentbox/internal/store"
)

// The exclusive lease lives in the sandbox's activity Lease:
// spec.holderIdentity and leaseDurationSeconds say who holds it for how
// long, acquireTime when the hold began, and the annotations
// v1alpha1.AnnotationLeaseRequestID and AnnotationLeaseID which acquire
// started it. Every change is a read followed by an update carrying the
// resourceVersion read, so of two concurrent acquires the API server lets
// exactly one write; the other re-reads, finds the lease held and gets
// CodeLeaseHeld. The controller reclaims holds that expire. While a hold
// is live, calls on the sandbox that do not present its lease ID are
// refused (checkHold, exclusive.go).

// maxLeaseField bounds holder names, request and lease IDs: they are stored
// in the Lease, and a megabyte of holder name is a mistake, not a name.
const maxLeaseField = 253

// leaseIDBytes is 128 bits: a lease ID must not be guessable by another
// caller who knows the holder name.
const leaseIDBytes = 16

// leaseChange decides, from the Lease as read and the time, what a lease
// call does: it edits l in place and reports whether to write it, or
// returns the error to answer with.
type leaseChange func(l *coordinationv1.Lease, now time.Time) (write bool, apiErr *api.Error)

func (s *Server) acquireLease(w http.ResponseWriter, r *http.Request) {
	var req api.AcquireLeaseRequest
	sb, log, apiErr := s.leaseRequest(w, r, "acquire_lease", &req)
	if apiErr == nil {
		apiErr = validateAcquire(&req)
	}
	if apiErr == nil && req.WaitSeconds != 0 {
		apiErr = api.Errorf(api.CodeInvalidArgument, "wait_seconds applies to pool leases only")
	}
	if apiErr != nil {
		s.logFailure(log, apiErr, nil)
		writeError(w, apiErr)
		return
	}
	l, apiErr := s.hold(r.Context(), sb, req)
	if apiErr != nil {
		s.logFailure(log, apiErr, nil)
		writeError(w, apiErr)
		return
	}
	log.V(1).Info("lease acquired", "holder", req.Holder, "request_id", req.RequestID)
	s.recordLease(r.Context(), store.LeaseAcquire, sb, leaseView(l))
	writeJSON(w, http.StatusOK, leaseView(l))
}

// recordLease appends to the store's lease history (the record of who
// held which sandbox when). The Lease object is the truth; a failed
// record is logged, not returned, so that history never blocks a hold.
func (s *Server) recordLease(ctx context.Context, kind store.LeaseEventKind, sb *v1alpha1.Sandbox, v api.Lease) {
	if s.store == nil {
		return
	}
	e := store.LeaseEvent{LeaseID: v.LeaseID, AgentID: sb.Spec.AgentID, Holder: v.Holder, RequestID: v.RequestID, Event: kind}
	if !v.ExpiresAt.IsZero() {
		e.ExpiresAt = &v.ExpiresAt
	}
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), leaseWriteTimeout)
	defer cancel()
	if _, _, err := s.store.RecordLeaseEvent(ctx, e); err != nil {
		s.log.Error(err, "record lease history", "agent", sb.Spec.AgentID, "event", string(kind))
	}
}

// validateAcquire checks an acquire's fields and fills in the default TTL.
func validateAcquire(req *api.AcquireLeaseRequest) *api.Error {
	if apiErr := validateLeaseFields(map[string]string{"holder": req.Holder, "request_id": req.RequestID}); apiErr != nil {
		return apiErr
	}
	if req.TTLSeconds < 0 || req.TTLSeconds > api.MaxLeaseTTLSeconds {
		return api.Errorf(api.CodeInvalidArgument, "ttl_seconds must be between 1 and %d (0 means %d), got %d",
			api.MaxLeaseTTLSeconds, api.DefaultLeaseTTLSeconds, req.TTLSeconds)
	}
	if req.TTLSeconds == 0 {
		req.TTLSeconds = api.DefaultLeaseTTLSeconds
	}
	return nil
}

// hold takes the exclusive hold on sb's Lease for a checked acquire, or
// returns the hold an earlier try of the same acquire got.
func (s *Server) hold(ctx context.Context, sb *v1alpha1.Sandbox, req api.AcquireLeaseRequest) (*coordinationv1.Lease, *api.Error) {
	leaseID, err := newLeaseID()
	if err != nil {
		s.log.Error(err, "create lease ID")
		return nil, api.Errorf(api.CodeInternal, "could not create a lease ID")
	}
	return s.changeLease(ctx, sb, func(l *coordinationv1.Lease, now time.Time) (bool, *api.Error) {
		holder, expiry := v1alpha1.LeaseHoldExpiry(&l.Spec)
		if holder != "" && now.Before(expiry) {
			if holder == req.Holder && l.Annotations[v1alpha1.AnnotationLeaseRequestID] == req.RequestID {
				// A retry of the acquire that got this hold.
				return false, nil
			}
			// The same holder with another request ID is refused too: the
			// lease is exclusive per acquire (one run at a time), not per
			// holder name.
			e := api.Errorf(api.CodeLeaseHeld, "the sandbox of agent %q is leased by %q until %s",
				sb.Spec.AgentID, holder, expiry.UTC().Format(time.RFC3339))
			e.Details = map[string]string{"holder": holder, "expires_at": expiry.UTC().Format(time.RFC3339Nano)}
			return false, e
		}
		// Free, released or expired (and not yet reclaimed): a new hold.
		applyHold(l, req.Holder, req.RequestID, leaseID, req.TTLSeconds, now)
		// Acquiring is activity too, and starts the TTL.
		l.Spec.RenewTime = ptr.To(metav1.NewMicroTime(now))
		return true, nil
	})
}

// applyHold makes l say that holder holds it under leaseID for ttlSeconds
// from at, for the acquire request requestID. The activity clock
// (renewTime) is left to the caller.
func applyHold(l *coordinationv1.Lease, holder, requestID, leaseID string, ttlSeconds int, at time.Time) {
	if prev, _ := v1alpha1.LeaseHoldExpiry(&l.Spec); prev != holder {
		l.Spec.LeaseTransitions = ptr.To(ptr.Deref(l.Spec.LeaseTransitions, 0) + 1)
	}
	t := metav1.NewMicroTime(at)
	l.Spec.HolderIdentity = ptr.To(holder)
	l.Spec.LeaseDurationSeconds = ptr.To(int32(ttlSeconds))
	l.Spec.AcquireTime = &t
	if l.Annotations == nil {
		l.Annotations = map[string]string{}
	}
	l.Annotations[v1alpha1.AnnotationLeaseRequestID] = requestID
	l.Annotations[v1alpha1.AnnotationLeaseID] = leaseID
	delete(l.Annotations, v1alpha1.AnnotationLeaseExpiredHolder)
	delete(l.Annotations, v1alpha1.AnnotationLeaseReleasedRequestID)
}

func (s *Server) heartbeatLease(w http.ResponseWriter, r *http.Request) {
	var req api.HeartbeatLeaseRequest
	sb, log, apiErr := s.leaseRequest(w, r, "heartbeat_lease", &req)
	if apiErr == nil {
		apiErr = validateLeaseFields(map[string]string{"holder": req.Holder, "lease_id": req.LeaseID})
	}
	if apiErr != nil {
		s.logFailure(log, apiErr, nil)
		writeError(w, apiErr)
		return
	}
	l, apiErr := s.changeLease(r.Context(), sb, func(l *coordinationv1.Lease, now time.Time) (bool, *api.Error) {
		holder, expiry := v1alpha1.LeaseHoldExpiry(&l.Spec)
		if apiErr := checkHold(sb, l, holder, req.Holder, req.LeaseID); apiErr != nil {
			return false, apiErr
		}
		if !now.Before(expiry) {
			// Reviving it would race the controller's reclaim, and the
			// sandbox may already have been handed to someone else and
			// back; the holder must acquire again.
			return false, api.Errorf(api.CodeLeaseExpired, "lease %s on the sandbox of agent %q expired at %s",
				req.LeaseID, sb.Spec.AgentID, expiry.UTC().Format(time.RFC3339))
		}
		l.Spec.RenewTime = ptr.To(metav1.NewMicroTime(now))
		return true, nil
	})
	if apiErr != nil {
		s.logFailure(log, apiErr, nil)
		writeError(w, apiErr)
		return
	}
	s.recordLease(r.Context(), store.LeaseHeartbeat, sb, leaseView(l))
	writeJSON(w, http.StatusOK, leaseView(l))
}

func (s *Server) releaseLease(w http.ResponseWriter, r *http.Request) {
	var req api.ReleaseLeaseRequest
	sb, log, apiErr := s.leaseRequest(w, r, "release_lease", &req)
	if apiErr == nil {
		apiErr = validateLeaseFields(map[string]string{"holder": req.Holder, "lease_id": req.LeaseID})
	}
	if apiErr != nil {
		s.logFailure(log, apiErr, nil)
		writeError(w, apiErr)
		return
	}
	var released *coordinationv1.Lease
	_, apiErr = s.changeLease(r.Context(), sb, func(l *coordinationv1.Lease, now time.Time) (bool, *api.Error) {
		holder, _ := v1alpha1.LeaseHoldExpiry(&l.Spec)
		if holder == "" {
			// Already released or reclaimed: a retried release succeeds.
			return false, nil
		}
		if apiErr := checkHold(sb, l, holder, req.Holder, req.LeaseID); apiErr != nil {
			return false, apiErr
		}
		released = l.DeepCopy()
		request := l.Annotations[v1alpha1.AnnotationLeaseRequestID]
		clearHold(l)
		// Kept until the next acquire: it tells the controller that a
		// sandbox leased from its pool has finished its run.
		l.Annotations[v1alpha1.AnnotationLeaseReleasedRequestID] = request
		// renewTime stays the activity clock: the release is activity.
		l.Spec.RenewTime = ptr.To(metav1.NewMicroTime(now))
		return true, nil
	})
	if apiErr != nil {
		s.logFailure(log, apiErr, nil)
		writeError(w, apiErr)
		return
	}
	if released != nil {
		s.recordLease(r.Context(), store.LeaseRelease, sb, leaseView(released))
	}
	log.V(1).Info("lease released", "holder", req.Holder)
	w.Header().Set("Cache-Control", "no-store")
	w.WriteHeader(http.StatusNoContent)
}

// leaseRequest does what every lease call starts with: authorize, decode
// the body and find the agent's sandbox. The sandbox need not be running:
// a stopped sandbox can be reserved before its first command resumes it.
func (s *Server) leaseRequest(w http.ResponseWriter, r *http.Request, op string, into any) (*v1alpha1.Sandbox, logr.Logger, *api.Error) {
	agentID := r.PathValue("agent_id")
	log := s.callLog(r, op).WithValues("agent", agentID)
	if apiErr := s.authorize(r, agentID); apiErr != nil {
		return nil, log, apiErr
	}
	if apiErr := s.decode(w, r, into); apiErr != nil {
		return nil, log, apiErr
	}
	sb, apiErr := s.agentSandbox(r.Context(), agentID)
	if apiErr != nil {
		return nil, log, apiErr
	}
	log = log.WithValues("sandbox", sb.Namespace+"/"+sb.Name)
	if apiErr := s.settlePending(r.Context(), sb); apiErr != nil {
		return nil, log, apiErr
	}
	return sb, log, nil
}

// changeLease applies change to the sandbox's Lease as the API server has
// it now, and writes the result with the resourceVersion it read, retrying
// from a fresh read when another writer (a concurrent acquire, an activity
// renewal, the controller's reclaim) got there first.
func (s *Server) changeLease(ctx context.Context, sb *v1alpha1.Sandbox, change leaseChange) (*coordinationv1.Lease, *api.Error) {
	key := LeaseKey(sb)
	// Like activity renewals, a lease write must not be cut short by a
	// client that hangs up: the hold would then be written or not at
	// random, and the caller would retry anyway.
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), leaseWriteTimeout)
	defer cancel()
	var (
		lease  coordinationv1.Lease
		apiErr *api.Error
		now    time.Time
		wrote  bool
	)
	// The first read is through Leases, the manager's cache in the control
	// plane: a claim then makes two API round trips, not three. The write
	// carries the resourceVersion read, so a cache that was behind costs a
	// conflict, and the retries read directly.
	direct := false
	get := func(l *coordinationv1.Lease) error {
		if !direct {
			if err := s.leaseWriter.Get(ctx, key, l); !apierrors.IsNotFound(err) {
				return err
			}
			// Maybe only not in the cache yet.
		}
		return s.leaseReader.Get(ctx, key, l)
	}
	err := retry.RetryOnConflict(retry.DefaultBackoff, func() error {
		apiErr, wrote = nil, false
		lease = coordinationv1.Lease{}
		if err := get(&lease); err != nil {
			return fmt.Errorf("get lease %s: %w", key, err)
		}
		// Microseconds are what a Lease stores; truncating here makes the
		// times written equal the times read back.
		now = s.clock.Now().Truncate(time.Microsecond)
		var write bool
		write, apiErr = change(&lease, now)
		if apiErr != nil || !write {
			return nil
		}
		if err := s.leaseWriter.Update(ctx, &lease); err != nil {
			direct = true
			return fmt.Errorf("update lease %s: %w", key, err)
		}
		wrote = true
		return nil
	})
	switch {
	case apierrors.IsNotFound(err):
		// The controller creates the Lease with the sandbox's other
		// children; until then there is nothing to hold.
		e := api.Errorf(api.CodeSandboxNotReady, "the sandbox of agent %q has no lease yet; retry shortly", sb.Spec.AgentID)
		phase := sb.Status.Phase
		if phase == "" {
			phase = v1alpha1.SandboxPhasePending
		}
		e.Details = map[string]string{"phase": string(phase), "reason": "LeaseMissing"}
		return nil, e
	case err != nil:
		s.log.Error(err, "change sandbox lease", "lease", key.String())
		return nil, api.Errorf(api.CodeInternal, "could not update the lease of agent %q's sandbox", sb.Spec.AgentID)
	case apiErr != nil:
		return nil, apiErr
	}
	if wrote && lease.Spec.RenewTime != nil && lease.Spec.RenewTime.Time.Equal(now) {
		// The write moved the activity clock; the throttled renewal of the
		// next command need not do it again.
		s.leases.noteRenewed(key, now)
	}
	return &lease, nil
}

// checkHold checks that the caller names the current hold.
func checkHold(sb *v1alpha1.Sandbox, l *coordinationv1.Lease, holder, wantHolder, wantID string) *api.Error {
	if holder == "" || holder != wantHolder || l.Annotations[v1alpha1.AnnotationLeaseID] != wantID {
		// Who holds it instead is not said: the caller's hold is gone, and
		// that is all it needs to know.
		return api.Errorf(api.CodeLeaseNotHeld, "lease %s of %q is not the current lease on the sandbox of agent %q",
			wantID, wantHolder, sb.Spec.AgentID)
	}
	return nil
}

// clearHold removes the hold from l, leaving renewTime (the activity
// clock) to the caller.
func clearHold(l *coordinationv1.Lease) {
	l.Spec.HolderIdentity = nil
	l.Spec.LeaseDurationSeconds = nil
	l.Spec.AcquireTime = nil
	delete(l.Annotations, v1alpha1.AnnotationLeaseRequestID)
	delete(l.Annotations, v1alpha1.AnnotationLeaseID)
}

func leaseView(l *coordinationv1.Lease) api.Lease {
	holder, expiry := v1alpha1.LeaseHoldExpiry(&l.Spec)
	v := api.Lease{
		LeaseID:    l.Annotations[v1alpha1.AnnotationLeaseID],
		Holder:     holder,
		RequestID:  l.Annotations[v1alpha1.AnnotationLeaseRequestID],
		TTLSeconds: int(ptr.Deref(l.Spec.LeaseDurationSeconds, 0)),
		ExpiresAt:  expiry.UTC(),
	}
	if l.Spec.AcquireTime != nil {
		v.AcquiredAt = l.Spec.AcquireTime.UTC()
	}
	if l.Spec.RenewTime != nil {
		v.RenewedAt = l.Spec.RenewTime.UTC()
	}
	return v
}

func validateLeaseFields(fields map[string]string) *api.Error {
	for _, name := range []string{"holder", "request_id", "lease_id"} {
		v, ok := fields[name]
		if !ok {
			continue
		}
		if v == "" {
			return api.Errorf(api.CodeInvalidArgument, "%s must not be empty", name)
		}
		if len(v) > maxLeaseField {
			return api.Errorf(api.CodeInvalidArgument, "%s is longer than %d bytes", name, maxLeaseField)
		}
	}
	return nil
}

func newLeaseID() (string, error) {
	b := make([]byte, leaseIDBytes)
	if _, err := rand.Read(b); err != nil {
		return "", fmt.Errorf("read random lease ID: %w", err)
	}
	return hex.EncodeToString(b), nil
}
