package computeapi

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"sort"
	"strconv"
	"sync"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	api "github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
	"github.com/agentbox/terraform-provider-agentbox/internal/store"
)

// poolExhaustedRetry is the Retry-After of pool_exhausted: about how long a
// pool takes to notice a leased sandbox and start its replacement is not
// enough (the replacement must also become ready), but a caller polling
// faster than this only loads the API.
const poolExhaustedRetry = 2 * time.Second

// acquirePoolLease leases a ready sandbox of a warm pool for one ephemeral
// run.
//
// The store decides which caller gets which sandbox: one row insert
// (store.WarmTake), which adoptions by new Sandboxes and the pool's own
// deletions go through too, so exactly one of them gets each sandbox. The
// caller is answered as soon as that row is in; the Kubernetes objects
// are then made to say so by settleWarmLease, in the background:
//
//  1. the sandbox's Lease gets the hold, as an agent's lease would;
//  2. the sandbox gets the pool-lease annotations, from which its pool
//     replaces it and the controller recycles it when the hold ends.
//
// Waiting for those two API-server writes was most of a claim's time
// (two sequential writes of 30-90 ms each on the test machine, and a
// burst's claims queued behind each other's). Any lease call for the
// sandbox that finds them missing writes them first (settlePending), and
// the pool's controller writes the annotations of a take left without
// them, so a replica that dies after answering loses nothing.
func (s *Server) acquirePoolLease(w http.ResponseWriter, r *http.Request) {
	ns, pool := r.PathValue("namespace"), r.PathValue("pool")
	log := s.callLog(r, "acquire_pool_lease").WithValues("namespace", ns, "pool", pool)
	fail := func(apiErr *api.Error) {
		s.logFailure(log, apiErr, nil)
		writeError(w, apiErr)
	}
	if p := PrincipalFrom(r.Context()); p == nil || !p.AllAgents {
		// Pool sandboxes belong to no agent until leased, so only a
		// principal that may address every agent can lease them.
		fail(api.Errorf(api.CodePermissionDenied, "leasing from a warm pool needs an admin token"))
		return
	}
	var req api.AcquireLeaseRequest
	if apiErr := s.decode(w, r, &req); apiErr != nil {
		fail(apiErr)
		return
	}
	if apiErr := validateAcquire(&req); apiErr != nil {
		fail(apiErr)
		return
	}
	if req.WaitSeconds < 0 || req.WaitSeconds > api.MaxPoolLeaseWaitSeconds {
		fail(api.Errorf(api.CodeInvalidArgument, "wait_seconds must be between 0 and %d, got %d", api.MaxPoolLeaseWaitSeconds, req.WaitSeconds))
		return
	}
	sb, take, fresh, apiErr := s.leaseFromPool(r.Context(), ns, pool, req)
	if apiErr != nil {
		if apiErr.Code == api.CodePoolExhausted {
			w.Header().Set("Retry-After", strconv.Itoa(int(poolExhaustedRetry/time.Second)))
		}
		fail(apiErr)
		return
	}
	log = log.WithValues("sandbox", sb.Name)
	view := takeView(take)
	if fresh {
		s.warmConnection(sb)
		// The settle writes the take's time as renewTime: the holder's
		// first command need not renew the activity clock itself, which
		// would put an API-server write before it after all.
		s.leases.noteRenewed(LeaseKey(sb), take.TakenAt)
		s.settleSoon(sb, take)
	} else {
		// A retry: its first try may have been answered by a replica
		// that died before settling, and the caller is about to use the
		// hold, so it is settled before the answer. (So is a cold start:
		// its call has waited for a pod already.)
		l, apiErr := s.settleWarmLease(r.Context(), sb, take)
		if apiErr != nil {
			fail(apiErr)
			return
		}
		if l != nil {
			view = leaseView(l)
		}
	}
	log.V(1).Info("pool lease acquired", "holder", req.Holder, "request_id", req.RequestID, "settled", !fresh)
	s.recordLease(r.Context(), store.LeaseAcquire, sb, view)
	writeJSON(w, http.StatusOK, api.PoolLease{Lease: view, AgentID: sb.Spec.AgentID, Namespace: sb.Namespace, Sandbox: sb.Name})
}

// takeFromPool takes a ready, free sandbox of the pool, oldest first, or
// returns the one an earlier try of this acquire took (fresh false).
func (s *Server) takeFromPool(ctx context.Context, ns, pool string, req api.AcquireLeaseRequest) (*v1alpha1.Sandbox, store.WarmTake, bool, *api.Error) {
	var list v1alpha1.SandboxList
	if err := s.sandboxes.List(ctx, &list, client.InNamespace(ns), client.MatchingLabels{v1alpha1.LabelWarmPool: pool}); err != nil {
		s.log.Error(err, "list warm sandboxes", "namespace", ns, "pool", pool)
		return nil, store.WarmTake{}, false, api.Errorf(api.CodeInternal, "could not list the sandboxes of warm pool %s/%s", ns, pool)
	}
	if len(list.Items) == 0 {
		var p v1alpha1.SandboxWarmPool
		err := s.sandboxes.Get(ctx, types.NamespacedName{Namespace: ns, Name: pool}, &p)
		if apierrors.IsNotFound(err) {
			return nil, store.WarmTake{}, false, api.Errorf(api.CodePoolNotFound, "warm pool %s/%s does not exist", ns, pool)
		}
		if err != nil {
			s.log.Error(err, "get warm pool", "namespace", ns, "pool", pool)
			return nil, store.WarmTake{}, false, api.Errorf(api.CodeInternal, "could not look up warm pool %s/%s", ns, pool)
		}
	}
	if s.store == nil {
		return nil, store.WarmTake{}, false, api.Errorf(api.CodeInternal,
			"warm pool leases need the control plane's store, and this API runs without one")
	}
	byUID := map[types.UID]*v1alpha1.Sandbox{}
	var free []*v1alpha1.Sandbox
	for i := range list.Items {
		sb := &list.Items[i]
		if !inPool(sb, pool) {
			continue
		}
		byUID[sb.UID] = sb
		if takeable(sb) {
			free = append(free, sb)
		}
	}
	sort.SliceStable(free, func(i, j int) bool {
		return free[i].CreationTimestamp.Before(&free[j].CreationTimestamp)
	})
	leaseID, err := newLeaseID()
	if err != nil {
		s.log.Error(err, "create lease ID")
		return nil, store.WarmTake{}, false, api.Errorf(api.CodeInternal, "could not create a lease ID")
	}
	// Microseconds are what a Lease stores, so the hold written later
	// says exactly what the caller is told now.
	now := s.clock.Now().UTC().Truncate(time.Microsecond)
	want := store.WarmTake{Namespace: ns, Pool: pool, Taker: store.WarmTakenByLease, Holder: req.Holder,
		RequestID: req.RequestID, LeaseID: leaseID, TTLSeconds: req.TTLSeconds, TakenAt: now}
	ours := func(t store.WarmTake) bool {
		return t.Taker == store.WarmTakenByLease && t.Holder == req.Holder && t.RequestID == req.RequestID
	}
	retried := func(t store.WarmTake) (*v1alpha1.Sandbox, store.WarmTake, bool, *api.Error) {
		if sb := byUID[types.UID(t.SandboxUID)]; sb != nil {
			return sb, t, false, nil
		}
		return nil, store.WarmTake{}, false, api.Errorf(api.CodeSandboxNotFound,
			"the sandbox an earlier try of request %q took from warm pool %s/%s (%s) no longer exists", req.RequestID, ns, pool, t.Sandbox)
	}
	var lastErr error
	for _, sb := range free {
		key := client.ObjectKeyFromObject(sb)
		if !s.poolTakes.reserve(key, now) {
			// Another request of this replica is taking it, or it was
			// taken and the cache has not caught up.
			continue
		}
		t := want
		t.SandboxUID, t.Sandbox = string(sb.UID), sb.Name
		got, took, err := s.store.TakeWarm(ctx, t)
		// Taken by anyone, it is not free again: remember it either way.
		// (A retried acquire is answered with its earlier take, and this
		// one stays free.)
		s.poolTakes.settle(key, (err == nil && got.SandboxUID == t.SandboxUID) || errors.Is(err, store.ErrConflict), now)
		switch {
		case errors.Is(err, store.ErrConflict):
			continue
		case err != nil:
			// One failed insert (a store under load) need not fail the
			// claim while others are free.
			s.log.Error(err, "take warm sandbox", "namespace", ns, "sandbox", sb.Name)
			lastErr = err
			continue
		case took:
			return sb, got, true, nil
		case ours(got):
			return retried(got)
		}
	}
	if lastErr != nil {
		return nil, store.WarmTake{}, false, api.Errorf(api.CodeInternal, "could not lease a sandbox of warm pool %s/%s", ns, pool)
	}
	// Nothing free, or nothing free was tried: a retry of an acquire that
	// took the last one still gets it.
	if t, err := s.store.FindWarmLease(ctx, ns, pool, req.Holder, req.RequestID); err == nil {
		return retried(t)
	} else if !errors.Is(err, store.ErrNotFound) {
		s.log.Error(err, "find earlier pool lease", "namespace", ns, "pool", pool)
		return nil, store.WarmTake{}, false, api.Errorf(api.CodeInternal, "could not lease a sandbox of warm pool %s/%s", ns, pool)
	}
	return nil, store.WarmTake{}, false, poolExhausted("warm pool %s/%s has no ready sandbox free (%d sandboxes, none ready and unleased); retry shortly",
		ns, pool, len(list.Items))
}

// poolExhausted is a CodePoolExhausted error with the retry hint.
func poolExhausted(format string, args ...any) *api.Error {
	e := api.Errorf(api.CodePoolExhausted, format, args...)
	e.Details = map[string]string{"retry_after_seconds": strconv.Itoa(int(poolExhaustedRetry / time.Second))}
	return e
}

// takeView is the lease a pool take gives its caller: the hold
// settleWarmLease writes.
func takeView(t store.WarmTake) api.Lease {
	return api.Lease{LeaseID: t.LeaseID, Holder: t.Holder, RequestID: t.RequestID, TTLSeconds: t.TTLSeconds,
		AcquiredAt: t.TakenAt, RenewedAt: t.TakenAt, ExpiresAt: t.TakenAt.Add(time.Duration(t.TTLSeconds) * time.Second)}
}

// maxSettles bounds the background settles in flight: a burst of claims
// is answered at once, and its Lease and Sandbox writes then go to the
// API server a few at a time rather than all together.
const maxSettles = 8

// settleYield is how long a settle may wait for the pool leases being
// decided to be answered. A settle's writes, and the replacements the
// pool starts when they land, compete for the same few cores as the
// claims still queued behind it; the callers come first, and the
// bookkeeping a moment later (any lease call settles first anyway).
const settleYield = 250 * time.Millisecond

// settleSoon runs settleWarmLease in the background, retrying a failure a
// few times; past that, the next lease call for the sandbox or the pool's
// controller settles it.
func (s *Server) settleSoon(sb *v1alpha1.Sandbox, t store.WarmTake) {
	s.background.Go(func() {
		for deadline := time.Now().Add(settleYield); s.claiming.Load() > 0 && time.Now().Before(deadline); {
			time.Sleep(5 * time.Millisecond)
		}
		s.settleSlots <- struct{}{}
		defer func() { <-s.settleSlots }()
		backoff := 100 * time.Millisecond
		var apiErr *api.Error
		for range 4 {
			ctx, cancel := context.WithTimeout(context.Background(), leaseWriteTimeout)
			_, apiErr = s.settleWarmLease(ctx, sb, t)
			cancel()
			if apiErr == nil || apiErr.Code == api.CodeLeaseHeld {
				break
			}
			time.Sleep(backoff)
			backoff *= 4
		}
		if apiErr != nil {
			s.log.Info("could not write a pool lease into its sandbox; its holder's next lease call or the pool's controller will",
				"sandbox", sb.Namespace+"/"+sb.Name, "holder", t.Holder, "request_id", t.RequestID, "error", apiErr.Message)
		}
	})
}

// settlePending settles the pool lease of a warm sandbox before a lease
// call reads its Lease: the caller may hold a lease the Lease does not
// carry yet. The annotations do not tell: the pool's controller writes
// them for a take whose replica died, before anyone wrote the hold. A
// settled lease costs a store read and a cached Lease read.
func (s *Server) settlePending(ctx context.Context, sb *v1alpha1.Sandbox) *api.Error {
	if s.store == nil || sb.Labels[v1alpha1.LabelWarmPool] == "" {
		return nil
	}
	t, err := s.store.WarmTakeOf(ctx, string(sb.UID))
	if errors.Is(err, store.ErrNotFound) {
		return nil
	}
	if err != nil {
		s.log.Error(err, "look up warm take", "sandbox", sb.Namespace+"/"+sb.Name)
		return api.Errorf(api.CodeInternal, "could not look up the pool lease of agent %q's sandbox", sb.Spec.AgentID)
	}
	if t.Taker != store.WarmTakenByLease {
		return nil
	}
	_, apiErr := s.settleWarmLease(ctx, sb, t)
	return apiErr
}

// settleWarmLease writes what the store decided into the Kubernetes
// objects: the hold on the sandbox's Lease, then the pool-lease
// annotations on the sandbox. In that order, so that the controller never
// sees a leased sandbox whose hold is still to come and recycles it. Each
// step is skipped when it is done, so any number of callers may race
// through it. It returns the Lease when it had to look at it.
func (s *Server) settleWarmLease(ctx context.Context, sb *v1alpha1.Sandbox, t store.WarmTake) (*coordinationv1.Lease, *api.Error) {
	settledBefore := false
	l, apiErr := s.changeLease(ctx, sb, func(l *coordinationv1.Lease, now time.Time) (bool, *api.Error) {
		settledBefore = true
		if l.Annotations[v1alpha1.AnnotationLeaseID] == t.LeaseID ||
			l.Annotations[v1alpha1.AnnotationLeaseReleasedRequestID] == t.RequestID ||
			l.Annotations[v1alpha1.AnnotationLeaseExpiredHolder] == t.Holder {
			// Held, or held and over already. A warm sandbox's Lease has no
			// holds before its take, so these marks are this take's.
			return false, nil
		}
		if holder, expiry := v1alpha1.LeaseHoldExpiry(&l.Spec); holder != "" && now.Before(expiry) {
			// Someone got the agent lease of a sandbox that was in the
			// pool: only an admin addressing the warm agent ID can.
			return false, api.Errorf(api.CodeLeaseHeld, "the sandbox of agent %q is leased by %q until %s",
				sb.Spec.AgentID, holder, expiry.UTC().Format(time.RFC3339))
		}
		settledBefore = false
		applyHold(l, t.Holder, t.RequestID, t.LeaseID, t.TTLSeconds, t.TakenAt)
		if l.Spec.RenewTime == nil || l.Spec.RenewTime.Time.Before(t.TakenAt) {
			l.Spec.RenewTime = ptr.To(metav1.NewMicroTime(t.TakenAt))
		}
		return true, nil
	})
	if apiErr != nil {
		return nil, apiErr
	}
	if settledBefore && !v1alpha1.PoolLeased(sb) {
		// Someone else wrote the hold, and so probably the annotations
		// too, which sb (read before) cannot show: look again rather than
		// patch for nothing.
		fresh := &v1alpha1.Sandbox{}
		if err := s.leaseReader.Get(ctx, client.ObjectKeyFromObject(sb), fresh); err == nil {
			sb = fresh
		} else if apierrors.IsNotFound(err) {
			return l, nil
		}
	}
	if err := s.annotatePoolLease(ctx, sb, t); err != nil {
		s.log.Error(err, "annotate pool lease", "sandbox", sb.Namespace+"/"+sb.Name)
		return l, api.Errorf(api.CodeInternal, "could not record the pool lease on agent %q's sandbox", sb.Spec.AgentID)
	}
	return l, nil
}

// annotatePoolLease puts the pool-lease annotations on sb unless they are
// there. No optimistic lock: the store has decided, and the patch touches
// only these keys.
func (s *Server) annotatePoolLease(ctx context.Context, sb *v1alpha1.Sandbox, t store.WarmTake) error {
	if sb.Annotations[v1alpha1.AnnotationPoolLeaseRequestID] == t.RequestID {
		return nil
	}
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), leaseWriteTimeout)
	defer cancel()
	target := sb.DeepCopy()
	patch := client.MergeFrom(sb.DeepCopy())
	if target.Annotations == nil {
		target.Annotations = map[string]string{}
	}
	target.Annotations[v1alpha1.AnnotationPoolLeaseHolder] = t.Holder
	target.Annotations[v1alpha1.AnnotationPoolLeaseRequestID] = t.RequestID
	target.Annotations[v1alpha1.AnnotationPoolLeasedAt] = t.TakenAt.UTC().Format(time.RFC3339Nano)
	if err := s.leaseWriter.Patch(ctx, target, patch); err != nil && !apierrors.IsNotFound(err) {
		return fmt.Errorf("mark sandbox %s leased: %w", sb.Name, err)
	}
	return nil
}

// inPool reports whether sb is a live sandbox controlled by the named pool.
func inPool(sb *v1alpha1.Sandbox, pool string) bool {
	owner := metav1.GetControllerOf(sb)
	return owner != nil && owner.Kind == "SandboxWarmPool" && owner.Name == pool && sb.DeletionTimestamp.IsZero()
}

// takeable reports whether a pool sandbox is ready and nobody has it: not
// leased, not claimed by an adopting Sandbox, not taken over already.
func takeable(sb *v1alpha1.Sandbox) bool {
	return sb.DeletionTimestamp.IsZero() && !v1alpha1.PoolLeased(sb) && sb.Annotations[v1alpha1.AnnotationAdoptedBy] == "" &&
		sb.Status.Workload == "" && serving(sb)
}

// takenMemory is how long a replica remembers a sandbox it took, so that
// its next claims skip it until the cache shows the lease annotation. A
// leased pool sandbox never becomes takeable again, so remembering it too
// long costs nothing but memory.
const takenMemory = 30 * time.Second

// poolTakes are the pool sandboxes this replica is taking or has just
// taken. Claims arriving together would otherwise all pick the oldest
// free sandbox, and each would pay a lost insert per sandbox taken before
// it: a burst of n claims cost O(n²) store writes. Across replicas the
// store still decides; this only keeps one replica's requests out of each
// other's way. The zero value is ready to use.
type poolTakes struct {
	mu sync.Mutex
	// m holds the time a take succeeded, or the zero time while one is
	// in flight.
	m map[types.NamespacedName]time.Time
}

// reserve claims key for one take attempt; false if this replica is
// already taking it or took it within takenMemory.
func (p *poolTakes) reserve(key types.NamespacedName, now time.Time) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.m == nil {
		p.m = map[types.NamespacedName]time.Time{}
	}
	for k, at := range p.m {
		if !at.IsZero() && now.Sub(at) > takenMemory {
			delete(p.m, k)
		}
	}
	if _, busy := p.m[key]; busy {
		return false
	}
	p.m[key] = time.Time{}
	return true
}

// settle ends the attempt reserve allowed: a taken sandbox is remembered,
// one that could not be taken is released at once.
func (p *poolTakes) settle(key types.NamespacedName, took bool, now time.Time) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if took {
		p.m[key] = now
	} else {
		delete(p.m, key)
	}
}
