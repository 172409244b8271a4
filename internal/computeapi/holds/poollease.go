package holds

import (
	"context"
	"errors"
	"fmt"
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
	"github.com/agentbox/terraform-provider-agentbox/internal/computeapi/sandboxstate"
	"github.com/agentbox/terraform-provider-agentbox/internal/store"
)

// PoolExhaustedRetry is the Retry-After of pool_exhausted: about how long
// a pool takes to notice a leased sandbox and start its replacement is not
// enough (the replacement must also become ready), but a caller polling
// faster than this only loads the API.
const PoolExhaustedRetry = 2 * time.Second

// PoolLease is a pool lease as its acquire got it.
type PoolLease struct {
	Sandbox *v1alpha1.Sandbox
	// Lease is the hold the pool lease is.
	Lease api.Lease
	// Settled says whether the hold was written into the sandbox before
	// the answer (a retried acquire, a cold start), rather than after it.
	Settled bool
	// Routing is how the sandbox was chosen for a lease that named an
	// environment; nil for one that named none.
	Routing *api.PoolLeaseRouting
}

// AcquirePoolLease leases a ready sandbox of a warm pool for one
// ephemeral run, for a checked acquire (ValidateAcquire). warm is called
// with a sandbox taken fresh, to open the connection its holder's first
// call will use.
//
// The store decides which caller gets which sandbox: one row insert
// (store.WarmTake), which adoptions by new Sandboxes and the pool's own
// deletions go through too, so exactly one of them gets each sandbox. The
// caller is answered as soon as that row is in; the Kubernetes objects
// are then made to say so by Settle, in the background:
//
//  1. the sandbox's Lease gets the hold, as an agent's hold would;
//  2. the sandbox gets the pool-lease annotations, from which its pool
//     replaces it and the controller recycles it when the hold ends.
//
// Waiting for those two API-server writes was most of a claim's time
// (two sequential writes of 30-90 ms each on the test machine, and a
// burst's claims queued behind each other's). Any hold call for the
// sandbox that finds them missing writes them first (SettlePending), and
// the pool's controller writes the annotations of a take left without
// them, so a replica that dies after answering loses nothing.
func (k *Keeper) AcquirePoolLease(ctx context.Context, ns, pool string, req api.AcquireLeaseRequest, warm func(*v1alpha1.Sandbox)) (PoolLease, *api.Error) {
	if apiErr := ValidatePoolEnv(req); apiErr != nil {
		return PoolLease{}, apiErr
	}
	envKey := k.poolEnvKey(ctx, ns, pool, req)
	sb, take, fresh, apiErr := k.leaseFromPool(ctx, ns, pool, req, envKey)
	if apiErr != nil {
		return PoolLease{}, apiErr
	}
	var routing *api.PoolLeaseRouting
	if envKey != "" {
		routing = &api.PoolLeaseRouting{Result: EnvRouting(sb, envKey), EnvKey: envKey}
	}
	view := takeView(take)
	if fresh {
		warm(sb)
		// The settle writes the take's time as renewTime: the holder's
		// first command need not renew the activity clock itself, which
		// would put an API-server write before it after all.
		k.activity.NoteRenewed(ActivityLeaseKey(sb), take.TakenAt)
		k.settleSoon(sb, take)
	} else {
		// A retry: its first try may have been answered by a replica
		// that died before settling, and the caller is about to use the
		// hold, so it is settled before the answer. (So is a cold start:
		// its call has waited for a pod already.)
		l, apiErr := k.Settle(ctx, sb, take)
		if apiErr != nil {
			return PoolLease{}, apiErr
		}
		if l != nil {
			view = View(l)
		}
	}
	k.record(ctx, store.LeaseAcquire, sb, view)
	return PoolLease{Sandbox: sb, Lease: view, Settled: !fresh, Routing: routing}, nil
}

// takeFromPool takes a ready, free sandbox of the pool, oldest first
// (after those holding or building the environment envKey, if any), or
// returns the one an earlier try of this acquire took (fresh false).
func (k *Keeper) takeFromPool(ctx context.Context, ns, pool string, req api.AcquireLeaseRequest, envKey string) (*v1alpha1.Sandbox, store.WarmTake, bool, *api.Error) {
	none := store.WarmTake{}
	list, apiErr := k.poolSandboxes(ctx, ns, pool)
	if apiErr != nil {
		return nil, none, false, apiErr
	}
	if k.store == nil {
		return nil, none, false, api.Errorf(api.CodeInternal,
			"warm pool leases need the control plane's store, and this API runs without one")
	}
	byUID, free := freeOldestFirst(list, pool)
	free = RouteByEnv(free, envKey)
	holdID, err := newHoldID()
	if err != nil {
		k.log.Error(err, "create lease ID")
		return nil, none, false, api.Errorf(api.CodeInternal, "could not create a lease ID")
	}
	// Microseconds are what a Lease stores, so the hold written later
	// says exactly what the caller is told now.
	now := k.clock.Now().UTC().Truncate(time.Microsecond)
	want := store.WarmTake{Namespace: ns, Pool: pool, Taker: store.WarmTakenByLease, Holder: req.Holder,
		RequestID: req.RequestID, LeaseID: holdID, TTLSeconds: req.TTLSeconds, TakenAt: now}
	retried := func(t store.WarmTake) (*v1alpha1.Sandbox, store.WarmTake, bool, *api.Error) {
		if sb := byUID[types.UID(t.SandboxUID)]; sb != nil {
			return sb.DeepCopy(), t, false, nil
		}
		return nil, none, false, api.Errorf(api.CodeSandboxNotFound,
			"the sandbox an earlier try of request %q took from warm pool %s/%s (%s) no longer exists", req.RequestID, ns, pool, t.Sandbox)
	}
	sb, got, done, lastErr := k.takeFirstFree(ctx, free, want)
	switch {
	case done && sb != nil:
		return sb.DeepCopy(), got, true, nil
	case done:
		return retried(got)
	case lastErr != nil:
		return nil, none, false, api.Errorf(api.CodeInternal, "could not lease a sandbox of warm pool %s/%s", ns, pool)
	}
	// Nothing free, or nothing free was tried: a retry of an acquire that
	// took the last one still gets it.
	if t, err := k.store.FindWarmLease(ctx, ns, pool, req.Holder, req.RequestID); err == nil {
		return retried(t)
	} else if !errors.Is(err, store.ErrNotFound) {
		k.log.Error(err, "find earlier pool lease", "namespace", ns, "pool", pool)
		return nil, none, false, api.Errorf(api.CodeInternal, "could not lease a sandbox of warm pool %s/%s", ns, pool)
	}
	return nil, none, false, poolExhausted("warm pool %s/%s has no ready sandbox free (%d sandboxes, none ready and unleased); retry shortly",
		ns, pool, len(list.Items))
}

// poolSandboxes lists the sandboxes of the pool; a pool without any must
// exist. The items are the cache's own, not copies: every pool lease lists
// the whole pool, and copying hundreds of sandboxes to take one was most
// of a lease's CPU. They are read only; what leaves takeFromPool is a
// copy.
func (k *Keeper) poolSandboxes(ctx context.Context, ns, pool string) (*v1alpha1.SandboxList, *api.Error) {
	var list v1alpha1.SandboxList
	if err := k.sandboxes.List(ctx, &list, client.InNamespace(ns), client.MatchingLabels{v1alpha1.LabelWarmPool: pool},
		client.UnsafeDisableDeepCopy); err != nil {
		k.log.Error(err, "list warm sandboxes", "namespace", ns, "pool", pool)
		return nil, api.Errorf(api.CodeInternal, "could not list the sandboxes of warm pool %s/%s", ns, pool)
	}
	if len(list.Items) == 0 {
		var p v1alpha1.SandboxWarmPool
		err := k.sandboxes.Get(ctx, types.NamespacedName{Namespace: ns, Name: pool}, &p)
		if apierrors.IsNotFound(err) {
			return nil, api.Errorf(api.CodePoolNotFound, "warm pool %s/%s does not exist", ns, pool)
		}
		if err != nil {
			k.log.Error(err, "get warm pool", "namespace", ns, "pool", pool)
			return nil, api.Errorf(api.CodeInternal, "could not look up warm pool %s/%s", ns, pool)
		}
	}
	return &list, nil
}

// freeOldestFirst indexes the pool's sandboxes in list by UID, and lists
// those free to take, the longest-warmed first.
func freeOldestFirst(list *v1alpha1.SandboxList, pool string) (map[types.UID]*v1alpha1.Sandbox, []*v1alpha1.Sandbox) {
	byUID := map[types.UID]*v1alpha1.Sandbox{}
	var free []*v1alpha1.Sandbox
	for i := range list.Items {
		sb := &list.Items[i]
		if !inPool(sb, pool) {
			continue
		}
		byUID[sb.UID] = sb
		if Takeable(sb) {
			free = append(free, sb)
		}
	}
	sort.SliceStable(free, func(i, j int) bool {
		return free[i].CreationTimestamp.Before(&free[j].CreationTimestamp)
	})
	return byUID, free
}

// takeFirstFree tries to take the free sandboxes in turn for want. done
// is true when one was taken (sb is it) or when the store answered with
// an earlier take of the same acquire (sb is nil, got is that take);
// lastErr is the last failure of the store, if any.
func (k *Keeper) takeFirstFree(ctx context.Context, free []*v1alpha1.Sandbox, want store.WarmTake) (sb *v1alpha1.Sandbox, got store.WarmTake, done bool, lastErr error) {
	ours := func(t store.WarmTake) bool {
		return t.Taker == store.WarmTakenByLease && t.Holder == want.Holder && t.RequestID == want.RequestID
	}
	for _, sb := range k.poolTakes.notTaken(free, want.TakenAt) {
		key := client.ObjectKeyFromObject(sb)
		if !k.poolTakes.reserve(key, want.TakenAt) {
			// Another request of this replica is taking it, or it was
			// taken and the cache has not caught up.
			continue
		}
		t := want
		t.SandboxUID, t.Sandbox = string(sb.UID), sb.Name
		got, took, err := k.store.TakeWarm(ctx, t)
		// Taken by anyone, it is not free again: remember it either way.
		// (A retried acquire is answered with its earlier take, and this
		// one stays free.)
		k.poolTakes.settle(key, (err == nil && got.SandboxUID == t.SandboxUID) || errors.Is(err, store.ErrConflict), want.TakenAt)
		switch {
		case errors.Is(err, store.ErrConflict):
			continue
		case err != nil:
			// One failed insert (a store under load) need not fail the
			// claim while others are free.
			k.log.Error(err, "take warm sandbox", "namespace", want.Namespace, "sandbox", sb.Name)
			lastErr = err
			continue
		case took:
			return sb, got, true, nil
		case ours(got):
			return nil, got, true, nil
		}
	}
	return nil, store.WarmTake{}, false, lastErr
}

// poolExhausted is a CodePoolExhausted error with the retry hint.
func poolExhausted(format string, args ...any) *api.Error {
	e := api.Errorf(api.CodePoolExhausted, format, args...)
	e.Details = map[string]string{"retry_after_seconds": strconv.Itoa(int(PoolExhaustedRetry / time.Second))}
	return e
}

// takeView is the hold a pool take gives its caller: the hold Settle
// writes.
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
// bookkeeping a moment later (any hold call settles first anyway).
const settleYield = 250 * time.Millisecond

// settleGrace is how long a settle waits before it starts, so that the
// holder's first command, which usually follows the answer within a few
// milliseconds, runs before the settle's writes and the replacement sandbox
// the pool starts when they land: on the two cores of make bench's node
// they ran together, and the first echo after a claim took 34 ms where
// the second took 17 (15 ms against 9 of it in the sandbox, by the
// supervisor's clock), while in a sandbox nothing else was starting beside
// the first echo was within 2 ms of the tenth. With the grace the first
// took 12 ms and the second 10 (8 and 7 in the sandbox).
const settleGrace = 100 * time.Millisecond

// settleSoon runs Settle in the background, retrying a failure a few
// times; past that, the next hold call for the sandbox or the pool's
// controller settles it.
func (k *Keeper) settleSoon(sb *v1alpha1.Sandbox, t store.WarmTake) {
	deadline := time.Now().Add(time.Duration(k.grace.Load()) + settleYield)
	k.settles.Go(func() {
		// The grace outside the slot, so that it delays this settle and
		// no other.
		time.Sleep(time.Duration(k.grace.Load()))
		// The slot first: under a steady stream of leases thousands of
		// settles queue, and only those about to write may poll for a
		// pause in the claims; the rest wait without waking.
		k.settleSlots <- struct{}{}
		defer func() { <-k.settleSlots }()
		for k.claiming.Load() > 0 && time.Now().Before(deadline) {
			time.Sleep(5 * time.Millisecond)
		}
		backoff := 100 * time.Millisecond
		var apiErr *api.Error
		for range 4 {
			ctx, cancel := context.WithTimeout(context.Background(), WriteTimeout)
			_, apiErr = k.Settle(ctx, sb, t)
			cancel()
			if apiErr == nil || apiErr.Code == api.CodeLeaseHeld {
				break
			}
			time.Sleep(backoff)
			backoff *= 4
		}
		if apiErr != nil {
			k.log.Info("could not write a pool lease into its sandbox; its holder's next lease call or the pool's controller will",
				"sandbox", sb.Namespace+"/"+sb.Name, "holder", t.Holder, "request_id", t.RequestID, "error", apiErr.Message)
		}
	})
}

// SettlePending settles the pool lease of a warm sandbox before a hold
// call reads its Lease: the caller may hold a pool lease the Lease does
// not carry yet. The annotations do not tell: the pool's controller writes
// them for a take whose replica died, before anyone wrote the hold. A
// settled lease costs a store read and a cached Lease read.
func (k *Keeper) SettlePending(ctx context.Context, sb *v1alpha1.Sandbox) *api.Error {
	if k.store == nil || sb.Labels[v1alpha1.LabelWarmPool] == "" {
		return nil
	}
	t, err := k.store.WarmTakeOf(ctx, string(sb.UID))
	if errors.Is(err, store.ErrNotFound) {
		return nil
	}
	if err != nil {
		k.log.Error(err, "look up warm take", "sandbox", sb.Namespace+"/"+sb.Name)
		return api.Errorf(api.CodeInternal, "could not look up the pool lease of agent %q's sandbox", sb.Spec.AgentID)
	}
	if t.Taker != store.WarmTakenByLease {
		return nil
	}
	_, apiErr := k.Settle(ctx, sb, t)
	return apiErr
}

// Settle writes what the store decided into the Kubernetes
// objects: the hold on the sandbox's Lease, then the pool-lease
// annotations on the sandbox. In that order, so that the controller never
// sees a leased sandbox whose hold is still to come and recycles it. Each
// step is skipped when it is done, so any number of callers may race
// through it. It returns the Lease when it had to look at it.
func (k *Keeper) Settle(ctx context.Context, sb *v1alpha1.Sandbox, t store.WarmTake) (*coordinationv1.Lease, *api.Error) {
	settledBefore := false
	l, apiErr := k.change(ctx, sb, func(l *coordinationv1.Lease, now time.Time) (bool, *api.Error) {
		settledBefore = true
		if settled(l, t) {
			return false, nil
		}
		if holder, expiry := v1alpha1.LeaseHoldExpiry(&l.Spec); holder != "" && now.Before(expiry) {
			// Someone got the agent hold of a sandbox that was in the
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
		if err := k.reader.Get(ctx, client.ObjectKeyFromObject(sb), fresh); err == nil {
			sb = fresh
		} else if apierrors.IsNotFound(err) {
			return l, nil
		}
	}
	if err := k.annotatePoolLease(ctx, sb, t); err != nil {
		k.log.Error(err, "annotate pool lease", "sandbox", sb.Namespace+"/"+sb.Name)
		return l, api.Errorf(api.CodeInternal, "could not record the pool lease on agent %q's sandbox", sb.Spec.AgentID)
	}
	return l, nil
}

// annotatePoolLease puts the pool-lease annotations on sb unless they are
// there. No optimistic lock: the store has decided, and the patch touches
// only these keys.
func (k *Keeper) annotatePoolLease(ctx context.Context, sb *v1alpha1.Sandbox, t store.WarmTake) error {
	if sb.Annotations[v1alpha1.AnnotationPoolLeaseRequestID] == t.RequestID {
		return nil
	}
	ctx, cancel := writeContext(ctx)
	defer cancel()
	target := sb.DeepCopy()
	patch := client.MergeFrom(sb.DeepCopy())
	if target.Annotations == nil {
		target.Annotations = map[string]string{}
	}
	target.Annotations[v1alpha1.AnnotationPoolLeaseHolder] = t.Holder
	target.Annotations[v1alpha1.AnnotationPoolLeaseRequestID] = t.RequestID
	target.Annotations[v1alpha1.AnnotationPoolLeasedAt] = t.TakenAt.UTC().Format(time.RFC3339Nano)
	if err := k.writer.Patch(ctx, target, patch); err != nil && !apierrors.IsNotFound(err) {
		return fmt.Errorf("mark sandbox %s leased: %w", sb.Name, err)
	}
	return nil
}

// inPool reports whether sb is a live sandbox controlled by the named pool.
func inPool(sb *v1alpha1.Sandbox, pool string) bool {
	owner := metav1.GetControllerOf(sb)
	return owner != nil && owner.Kind == "SandboxWarmPool" && owner.Name == pool && sb.DeletionTimestamp.IsZero()
}

// Takeable reports whether a pool sandbox is ready and nobody has it: not
// leased, not claimed by an adopting Sandbox, not taken over already, and
// done building its pool's python environments (v1alpha1.PrewarmSettled).
func Takeable(sb *v1alpha1.Sandbox) bool {
	return sb.DeletionTimestamp.IsZero() && !v1alpha1.PoolLeased(sb) && sb.Annotations[v1alpha1.AnnotationAdoptedBy] == "" &&
		sb.Status.Workload == "" && sandboxstate.Serving(sb) && v1alpha1.PrewarmSettled(sb)
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
	// swept is when m was last rid of what it need not remember: at a
	// thousand leases a second it holds tens of thousands of takes, too
	// many to walk on every attempt.
	swept time.Time
}

// takesSweep is how often the remembered takes are swept.
const takesSweep = time.Second

// notTaken returns those of free this replica is neither taking nor took
// within takenMemory, in order: the sandboxes it has just leased still
// look free in the cache until their settles land, and under a steady
// stream of leases that is hundreds of them.
func (p *poolTakes) notTaken(free []*v1alpha1.Sandbox, now time.Time) []*v1alpha1.Sandbox {
	p.mu.Lock()
	defer p.mu.Unlock()
	out := make([]*v1alpha1.Sandbox, 0, len(free))
	for _, sb := range free {
		at, known := p.m[client.ObjectKeyFromObject(sb)]
		if !known || (!at.IsZero() && now.Sub(at) > takenMemory) {
			out = append(out, sb)
		}
	}
	return out
}

// reserve claims key for one take attempt; false if this replica is
// already taking it or took it within takenMemory.
func (p *poolTakes) reserve(key types.NamespacedName, now time.Time) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.m == nil {
		p.m = map[types.NamespacedName]time.Time{}
	}
	if now.Sub(p.swept) >= takesSweep || now.Before(p.swept) {
		for k, at := range p.m {
			if !at.IsZero() && now.Sub(at) > takenMemory {
				delete(p.m, k)
			}
		}
		p.swept = now
	}
	if at, busy := p.m[key]; busy && (at.IsZero() || now.Sub(at) <= takenMemory) {
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
