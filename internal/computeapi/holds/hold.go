package holds

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/util/retry"
	"k8s.io/utils/ptr"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	api "github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
	"github.com/agentbox/terraform-provider-agentbox/internal/store"
)

// A hold lives in the sandbox's activity clock, its Kubernetes Lease:
// spec.holderIdentity and leaseDurationSeconds say who holds it for how
// long, acquireTime when the hold began, and the annotations
// v1alpha1.AnnotationLeaseRequestID and AnnotationLeaseID which acquire
// started it (the hold's ID is the wire's lease ID). Every change is a
// read followed by an update carrying the resourceVersion read, so of two
// concurrent acquires the API server lets exactly one write; the other
// re-reads, finds the sandbox held and gets CodeLeaseHeld. The controller
// reclaims holds that expire. While a hold is live, calls on the sandbox
// that do not present its ID are refused (Blocking).

// maxHoldField bounds holder names, request and lease IDs: they are
// stored in the Lease, and a megabyte of holder name is a mistake, not a
// name.
const maxHoldField = 253

// holdIDBytes is 128 bits: a hold's ID must not be guessable by another
// caller who knows the holder name.
const holdIDBytes = 16

// leaseChange decides, from the Lease as read and the time, what a hold
// call does: it edits l in place and reports whether to write it, or
// returns the error to answer with.
type leaseChange func(l *coordinationv1.Lease, now time.Time) (write bool, apiErr *api.Error)

// ValidateAcquire checks an acquire's fields and fills in the default TTL.
func ValidateAcquire(req *api.AcquireLeaseRequest) *api.Error {
	if apiErr := ValidateFields(map[string]string{"holder": req.Holder, "request_id": req.RequestID}); apiErr != nil {
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

// ValidateFields checks the hold fields present in fields (holder,
// request_id, lease_id): none empty, none too long.
func ValidateFields(fields map[string]string) *api.Error {
	for _, name := range []string{"holder", "request_id", "lease_id"} {
		v, ok := fields[name]
		if !ok {
			continue
		}
		if v == "" {
			return api.Errorf(api.CodeInvalidArgument, "%s must not be empty", name)
		}
		if len(v) > maxHoldField {
			return api.Errorf(api.CodeInvalidArgument, "%s is longer than %d bytes", name, maxHoldField)
		}
	}
	return nil
}

// Acquire takes the hold on sb for a checked acquire (ValidateAcquire),
// or returns the hold an earlier try of the same acquire got.
func (k *Keeper) Acquire(ctx context.Context, sb *v1alpha1.Sandbox, req api.AcquireLeaseRequest) (api.Lease, *api.Error) {
	holdID, err := newHoldID()
	if err != nil {
		k.log.Error(err, "create lease ID")
		return api.Lease{}, api.Errorf(api.CodeInternal, "could not create a lease ID")
	}
	l, apiErr := k.change(ctx, sb, func(l *coordinationv1.Lease, now time.Time) (bool, *api.Error) {
		holder, expiry := v1alpha1.LeaseHoldExpiry(&l.Spec)
		if holder != "" && now.Before(expiry) {
			if holder == req.Holder && l.Annotations[v1alpha1.AnnotationLeaseRequestID] == req.RequestID {
				// A retry of the acquire that got this hold.
				return false, nil
			}
			// The same holder with another request ID is refused too: the
			// hold is exclusive per acquire (one run at a time), not per
			// holder name.
			e := api.Errorf(api.CodeLeaseHeld, "the sandbox of agent %q is leased by %q until %s",
				sb.Spec.AgentID, holder, expiry.UTC().Format(time.RFC3339))
			e.Details = map[string]string{"holder": holder, "expires_at": expiry.UTC().Format(time.RFC3339Nano)}
			return false, e
		}
		// Free, released or expired (and not yet reclaimed): a new hold.
		applyHold(l, req.Holder, req.RequestID, holdID, req.TTLSeconds, now)
		// Acquiring is activity too, and starts the TTL.
		l.Spec.RenewTime = ptr.To(metav1.NewMicroTime(now))
		return true, nil
	})
	return k.recorded(ctx, store.LeaseAcquire, sb, l, apiErr)
}

// Heartbeat extends the hold holder has on sb under holdID by its TTL.
func (k *Keeper) Heartbeat(ctx context.Context, sb *v1alpha1.Sandbox, holder, holdID string) (api.Lease, *api.Error) {
	l, apiErr := k.change(ctx, sb, func(l *coordinationv1.Lease, now time.Time) (bool, *api.Error) {
		current, expiry := v1alpha1.LeaseHoldExpiry(&l.Spec)
		if apiErr := namesHold(sb, l, current, holder, holdID); apiErr != nil {
			return false, apiErr
		}
		if !now.Before(expiry) {
			// Reviving it would race the controller's reclaim, and the
			// sandbox may already have been handed to someone else and
			// back; the holder must acquire again.
			return false, api.Errorf(api.CodeLeaseExpired, "lease %s on the sandbox of agent %q expired at %s",
				holdID, sb.Spec.AgentID, expiry.UTC().Format(time.RFC3339))
		}
		l.Spec.RenewTime = ptr.To(metav1.NewMicroTime(now))
		return true, nil
	})
	return k.recorded(ctx, store.LeaseHeartbeat, sb, l, apiErr)
}

// Release ends the hold holder has on sb under holdID. Releasing a hold
// that is already gone succeeds.
func (k *Keeper) Release(ctx context.Context, sb *v1alpha1.Sandbox, holder, holdID string) *api.Error {
	var released *coordinationv1.Lease
	_, apiErr := k.change(ctx, sb, func(l *coordinationv1.Lease, now time.Time) (bool, *api.Error) {
		current, _ := v1alpha1.LeaseHoldExpiry(&l.Spec)
		if current == "" {
			// Already released or reclaimed: a retried release succeeds.
			return false, nil
		}
		if apiErr := namesHold(sb, l, current, holder, holdID); apiErr != nil {
			return false, apiErr
		}
		released = l.DeepCopy()
		endHold(l)
		// renewTime stays the activity clock: the release is activity.
		l.Spec.RenewTime = ptr.To(metav1.NewMicroTime(now))
		return true, nil
	})
	if apiErr != nil {
		return apiErr
	}
	if released != nil {
		k.record(ctx, store.LeaseRelease, sb, View(released))
	}
	return nil
}

// EndForStop ends sb's hold, if there is one, as a release does, and sets
// its activity clock back by a second more than idle, sb's idle timeout,
// so that the controller stops it at once.
func (k *Keeper) EndForStop(ctx context.Context, sb *v1alpha1.Sandbox, idle time.Duration) *api.Error {
	// A pool lease not written to the Lease yet would come back after the
	// release below.
	if apiErr := k.SettlePending(ctx, sb); apiErr != nil {
		return apiErr
	}
	var released *coordinationv1.Lease
	_, apiErr := k.change(ctx, sb, func(l *coordinationv1.Lease, now time.Time) (bool, *api.Error) {
		if holder, _ := v1alpha1.LeaseHoldExpiry(&l.Spec); holder != "" {
			released = l.DeepCopy()
			endHold(l)
		}
		// A second past the timeout, so that the controller's comparison
		// (idle for at least the timeout) holds at once.
		l.Spec.RenewTime = ptr.To(metav1.NewMicroTime(now.Add(-idle - time.Second)))
		return true, nil
	})
	if apiErr != nil {
		return apiErr
	}
	if released != nil {
		k.record(ctx, store.LeaseRelease, sb, View(released))
	}
	return nil
}

// recorded records the hold l carries after a change of kind that ended
// in apiErr, and returns it as the API answers it.
func (k *Keeper) recorded(ctx context.Context, kind store.LeaseEventKind, sb *v1alpha1.Sandbox, l *coordinationv1.Lease, apiErr *api.Error) (api.Lease, *api.Error) {
	if apiErr != nil {
		return api.Lease{}, apiErr
	}
	v := View(l)
	k.record(ctx, kind, sb, v)
	return v, nil
}

// record appends to the store's hold history (the record of who held
// which sandbox when). The Lease object is the truth; a failed record is
// logged, not returned, so that history never blocks a hold.
func (k *Keeper) record(ctx context.Context, kind store.LeaseEventKind, sb *v1alpha1.Sandbox, v api.Lease) {
	if k.store == nil {
		return
	}
	e := store.LeaseEvent{LeaseID: v.LeaseID, AgentID: sb.Spec.AgentID, Holder: v.Holder, RequestID: v.RequestID, Event: kind}
	if !v.ExpiresAt.IsZero() {
		e.ExpiresAt = &v.ExpiresAt
	}
	ctx, cancel := writeContext(ctx)
	defer cancel()
	if _, _, err := k.store.RecordLeaseEvent(ctx, e); err != nil {
		k.log.Error(err, "record lease history", "agent", sb.Spec.AgentID, "event", string(kind))
	}
}

// applyHold makes l say that holder holds it under holdID for ttlSeconds
// from at, for the acquire request requestID. The activity clock
// (renewTime) is left to the caller.
func applyHold(l *coordinationv1.Lease, holder, requestID, holdID string, ttlSeconds int, at time.Time) {
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
	l.Annotations[v1alpha1.AnnotationLeaseID] = holdID
	delete(l.Annotations, v1alpha1.AnnotationLeaseExpiredHolder)
	delete(l.Annotations, v1alpha1.AnnotationLeaseReleasedRequestID)
}

// endHold removes the hold from l as its release does, leaving renewTime
// (the activity clock) to the caller. The released request's ID is kept
// until the next acquire: it tells the controller that a sandbox leased
// from its pool has finished its run.
func endHold(l *coordinationv1.Lease) {
	request := l.Annotations[v1alpha1.AnnotationLeaseRequestID]
	l.Spec.HolderIdentity = nil
	l.Spec.LeaseDurationSeconds = nil
	l.Spec.AcquireTime = nil
	delete(l.Annotations, v1alpha1.AnnotationLeaseRequestID)
	delete(l.Annotations, v1alpha1.AnnotationLeaseID)
	l.Annotations[v1alpha1.AnnotationLeaseReleasedRequestID] = request
}

// namesHold checks that the caller names the current hold.
func namesHold(sb *v1alpha1.Sandbox, l *coordinationv1.Lease, holder, wantHolder, wantID string) *api.Error {
	if holder == "" || holder != wantHolder || l.Annotations[v1alpha1.AnnotationLeaseID] != wantID {
		// Who holds it instead is not said: the caller's hold is gone, and
		// that is all it needs to know.
		return api.Errorf(api.CodeLeaseNotHeld, "lease %s of %q is not the current lease on the sandbox of agent %q",
			wantID, wantHolder, sb.Spec.AgentID)
	}
	return nil
}

// View is the hold l carries, as the API answers it.
func View(l *coordinationv1.Lease) api.Lease {
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

func newHoldID() (string, error) {
	b := make([]byte, holdIDBytes)
	if _, err := rand.Read(b); err != nil {
		return "", fmt.Errorf("read random lease ID: %w", err)
	}
	return hex.EncodeToString(b), nil
}

// change applies change to the sandbox's Lease as the API server has it
// now, and writes the result with the resourceVersion it read, retrying
// from a fresh read when another writer (a concurrent acquire, an
// activity renewal, the controller's reclaim) got there first.
func (k *Keeper) change(ctx context.Context, sb *v1alpha1.Sandbox, change leaseChange) (*coordinationv1.Lease, *api.Error) {
	key := ActivityLeaseKey(sb)
	// Like activity renewals, a hold write must not be cut short by a
	// client that hangs up: the hold would then be written or not at
	// random, and the caller would retry anyway.
	ctx, cancel := writeContext(ctx)
	defer cancel()
	var (
		lease  coordinationv1.Lease
		apiErr *api.Error
		now    time.Time
		wrote  bool
	)
	// The first read is through Writer, the manager's cache in the control
	// plane: a claim then makes two API round trips, not three. The write
	// carries the resourceVersion read, so a cache that was behind costs a
	// conflict, and the retries read directly.
	direct := false
	get := func(l *coordinationv1.Lease) error {
		if !direct {
			if err := k.writer.Get(ctx, key, l); !apierrors.IsNotFound(err) {
				return err
			}
			// Maybe only not in the cache yet.
		}
		return k.reader.Get(ctx, key, l)
	}
	err := retry.RetryOnConflict(retry.DefaultBackoff, func() error {
		apiErr, wrote = nil, false
		lease = coordinationv1.Lease{}
		if err := get(&lease); err != nil {
			return fmt.Errorf("get lease %s: %w", key, err)
		}
		// Microseconds are what a Lease stores; truncating here makes the
		// times written equal the times read back.
		now = k.clock.Now().Truncate(time.Microsecond)
		var write bool
		write, apiErr = change(&lease, now)
		if apiErr != nil || !write {
			return nil
		}
		if err := k.writer.Update(ctx, &lease); err != nil {
			direct = true
			return fmt.Errorf("update lease %s: %w", key, err)
		}
		wrote = true
		return nil
	})
	if apiErr := k.changeError(sb, key.String(), err, apiErr); apiErr != nil {
		return nil, apiErr
	}
	if wrote && lease.Spec.RenewTime != nil && lease.Spec.RenewTime.Time.Equal(now) {
		// The write moved the activity clock; the throttled renewal of the
		// next command need not do it again.
		k.activity.NoteRenewed(key, now)
	}
	return &lease, nil
}

// changeError is the API's error for a change of sb's Lease that ended in
// err (from the API server) or apiErr (the change's own), or nil.
func (k *Keeper) changeError(sb *v1alpha1.Sandbox, lease string, err error, apiErr *api.Error) *api.Error {
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
		return e
	case err != nil:
		k.log.Error(err, "change sandbox lease", "lease", lease)
		return api.Errorf(api.CodeInternal, "could not update the lease of agent %q's sandbox", sb.Spec.AgentID)
	}
	return apiErr
}
