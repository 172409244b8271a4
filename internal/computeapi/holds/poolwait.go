package holds

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"strings"
	"sync"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	api "github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
	"github.com/agentbox/terraform-provider-agentbox/internal/computeapi/sandboxstate"
	"github.com/agentbox/terraform-provider-agentbox/internal/store"
)

// A pool lease that finds no ready sandbox free answers pool_exhausted at
// once, unless it brings wait_seconds. Then, on a pool with
// coldStartWhenExhausted, it creates a sandbox of the pool for itself
// (coldStart); on other pools it queues (awaitPoolSandbox). The queue is
// this replica's: its waiters are served first come, first served, and a
// pool lease arriving while it is not empty takes nothing ahead of them.
// Across replicas there is no order: each replica's first waiter tries
// for every sandbox that becomes ready, and the store gives each sandbox
// to exactly one of them.

// leaseFromPool leases a sandbox of the pool for req: a free one now, or,
// with req.WaitSeconds, one that becomes ready (or is started for it)
// within that time. fresh is false when the pool lease must be settled
// before the answer: a retry of an earlier acquire, or a cold start.
func (k *Keeper) leaseFromPool(ctx context.Context, ns, pool string, req api.AcquireLeaseRequest, envKey string) (*v1alpha1.Sandbox, store.WarmTake, bool, *api.Error) {
	key := types.NamespacedName{Namespace: ns, Name: pool}
	if waiting := k.poolWaiters.queued(key); waiting > 0 {
		// Free sandboxes are the waiters' first; only a retry of an
		// acquire that got one already is answered ahead of them.
		if sb, t, apiErr := k.earlierPoolLease(ctx, ns, pool, req); sb != nil || apiErr != nil {
			return sb, t, false, apiErr
		}
		if req.WaitSeconds == 0 {
			return nil, store.WarmTake{}, false, poolExhausted("warm pool %s/%s has no ready sandbox free, and %d leases are waiting for one; retry shortly",
				ns, pool, waiting)
		}
	} else {
		sb, t, fresh, apiErr := k.claimFromPool(ctx, ns, pool, req, envKey)
		if apiErr == nil || apiErr.Code != api.CodePoolExhausted || req.WaitSeconds == 0 {
			return sb, t, fresh, apiErr
		}
	}
	var p v1alpha1.SandboxWarmPool
	if err := k.sandboxes.Get(ctx, key, &p); apierrors.IsNotFound(err) {
		return nil, store.WarmTake{}, false, api.Errorf(api.CodePoolNotFound, "warm pool %s/%s does not exist", ns, pool)
	} else if err != nil {
		k.log.Error(err, "get warm pool", "namespace", ns, "pool", pool)
		return nil, store.WarmTake{}, false, api.Errorf(api.CodeInternal, "could not look up warm pool %s/%s", ns, pool)
	}
	deadline := time.Now().Add(time.Duration(req.WaitSeconds) * time.Second)
	if p.Spec.ColdStartWhenExhausted {
		return k.coldStart(ctx, &p, req, deadline)
	}
	return k.awaitPoolSandbox(ctx, key, req, envKey, deadline)
}

// claimFromPool is takeFromPool, counted as a claim being decided (which
// background settles yield to).
func (k *Keeper) claimFromPool(ctx context.Context, ns, pool string, req api.AcquireLeaseRequest, envKey string) (*v1alpha1.Sandbox, store.WarmTake, bool, *api.Error) {
	k.claiming.Add(1)
	defer k.claiming.Add(-1)
	return k.takeFromPool(ctx, ns, pool, req, envKey)
}

// earlierPoolLease returns the sandbox an earlier try of req leased from
// the pool, if there was one.
func (k *Keeper) earlierPoolLease(ctx context.Context, ns, pool string, req api.AcquireLeaseRequest) (*v1alpha1.Sandbox, store.WarmTake, *api.Error) {
	if k.store == nil {
		return nil, store.WarmTake{}, nil
	}
	t, err := k.store.FindWarmLease(ctx, ns, pool, req.Holder, req.RequestID)
	if errors.Is(err, store.ErrNotFound) {
		return nil, store.WarmTake{}, nil
	}
	if err != nil {
		k.log.Error(err, "find earlier pool lease", "namespace", ns, "pool", pool)
		return nil, store.WarmTake{}, api.Errorf(api.CodeInternal, "could not lease a sandbox of warm pool %s/%s", ns, pool)
	}
	var sb v1alpha1.Sandbox
	if err := k.sandboxes.Get(ctx, types.NamespacedName{Namespace: ns, Name: t.Sandbox}, &sb); err != nil || string(sb.UID) != t.SandboxUID {
		return nil, store.WarmTake{}, api.Errorf(api.CodeSandboxNotFound,
			"the sandbox an earlier try of request %q took from warm pool %s/%s (%s) no longer exists", req.RequestID, ns, pool, t.Sandbox)
	}
	return &sb, t, nil
}

// awaitPoolSandbox queues req behind this replica's other waiters for the
// pool and, once first, takes the next sandbox that becomes ready, until
// deadline.
func (k *Keeper) awaitPoolSandbox(ctx context.Context, key types.NamespacedName, req api.AcquireLeaseRequest, envKey string, deadline time.Time) (*v1alpha1.Sandbox, store.WarmTake, bool, *api.Error) {
	w := k.poolWaiters.join(key)
	defer k.poolWaiters.leave(key, w)
	timeout := time.NewTimer(time.Until(deadline))
	defer timeout.Stop()
	gaveUp := func() *api.Error {
		return poolExhausted("no sandbox of warm pool %s became free within wait_seconds (%d s); retry, or raise the pool's replicas",
			key, req.WaitSeconds)
	}
	select {
	case <-w.turn:
	case <-ctx.Done():
		return nil, store.WarmTake{}, false, gaveUp()
	case <-timeout.C:
		return nil, store.WarmTake{}, false, gaveUp()
	}
	// The cache shows what becomes ready without API requests, so it is
	// polled; the store is asked only when a sandbox looks free.
	tick := time.NewTicker(sandboxstate.PollInterval)
	defer tick.Stop()
	for {
		if k.poolHasFree(ctx, key) {
			sb, t, fresh, apiErr := k.claimFromPool(ctx, key.Namespace, key.Name, req, envKey)
			if apiErr == nil || apiErr.Code != api.CodePoolExhausted {
				return sb, t, fresh, apiErr
			}
		}
		select {
		case <-ctx.Done():
			return nil, store.WarmTake{}, false, gaveUp()
		case <-timeout.C:
			return nil, store.WarmTake{}, false, gaveUp()
		case <-tick.C:
		}
	}
}

// poolHasFree reports whether the cache shows a ready, free sandbox of the
// pool. A sandbox this replica has just taken may still look free.
func (k *Keeper) poolHasFree(ctx context.Context, key types.NamespacedName) bool {
	var list v1alpha1.SandboxList
	// Read only: the cache's objects, not copies (see poolSandboxes).
	if err := k.sandboxes.List(ctx, &list, client.InNamespace(key.Namespace), client.MatchingLabels{v1alpha1.LabelWarmPool: key.Name},
		client.UnsafeDisableDeepCopy); err != nil {
		return false
	}
	for i := range list.Items {
		if sb := &list.Items[i]; inPool(sb, key.Name) && Takeable(sb) {
			return true
		}
	}
	return false
}

// coldStart creates a sandbox of the pool for req, waits until deadline
// for it to be ready, and takes it for req through the store as a pool
// lease takes a warm one. Its name derives from the pool, the holder and
// the request ID, so a retry of the acquire finds the sandbox started for
// it instead of starting another. It is born with the pool lease
// annotations: the pool never counts it, nobody else can take it, and the
// controller deletes it when the pool lease ends, or when nobody takes it
// up within v1alpha1.PoolColdStartGrace.
func (k *Keeper) coldStart(ctx context.Context, pool *v1alpha1.SandboxWarmPool, req api.AcquireLeaseRequest, deadline time.Time) (*v1alpha1.Sandbox, store.WarmTake, bool, *api.Error) {
	none := store.WarmTake{}
	if k.store == nil {
		return nil, none, false, api.Errorf(api.CodeInternal, "warm pool leases need the control plane's store, and this API runs without one")
	}
	poolID := pool.Namespace + "/" + pool.Name
	var tpl v1alpha1.SandboxTemplate
	if err := k.sandboxes.Get(ctx, types.NamespacedName{Namespace: pool.Namespace, Name: pool.Spec.TemplateRef.Name}, &tpl); apierrors.IsNotFound(err) {
		return nil, none, false, poolExhausted("warm pool %s has no ready sandbox free, and cannot start one: its SandboxTemplate %s does not exist",
			poolID, pool.Spec.TemplateRef.Name)
	} else if err != nil {
		k.log.Error(err, "get sandbox template", "namespace", pool.Namespace, "template", pool.Spec.TemplateRef.Name)
		return nil, none, false, api.Errorf(api.CodeInternal, "could not look up the template of warm pool %s", poolID)
	}
	name, agentID := ColdStartNames(pool, req.Holder, req.RequestID)
	sb := &v1alpha1.Sandbox{
		ObjectMeta: metav1.ObjectMeta{
			Namespace: pool.Namespace,
			Name:      name,
			Labels: map[string]string{
				v1alpha1.LabelWarmPool:    pool.Name,
				v1alpha1.LabelTemplate:    tpl.Name,
				v1alpha1.LabelAgentIDHash: v1alpha1.AgentIDHash(agentID),
			},
			Annotations: map[string]string{
				v1alpha1.AnnotationTemplateHash:       v1alpha1.TemplateHash(&tpl.Spec),
				v1alpha1.AnnotationPoolColdStart:      "true",
				v1alpha1.AnnotationPoolLeaseHolder:    req.Holder,
				v1alpha1.AnnotationPoolLeaseRequestID: req.RequestID,
				v1alpha1.AnnotationPoolLeasedAt:       k.clock.Now().UTC().Format(time.RFC3339Nano),
			},
			OwnerReferences: []metav1.OwnerReference{*metav1.NewControllerRef(pool, v1alpha1.GroupVersion.WithKind("SandboxWarmPool"))},
		},
		Spec: v1alpha1.SandboxSpec{AgentID: agentID, TemplateRef: pool.Spec.TemplateRef, Ephemeral: true},
	}
	if apiErr := k.createColdStart(ctx, sb, req); apiErr != nil {
		return nil, none, false, apiErr
	}
	key := client.ObjectKeyFromObject(sb)

	timeout := time.NewTimer(time.Until(deadline))
	defer timeout.Stop()
	tick := time.NewTicker(sandboxstate.PollInterval)
	defer tick.Stop()
	var last *v1alpha1.Sandbox
	for {
		var cur v1alpha1.Sandbox
		err := k.sandboxes.Get(ctx, key, &cur)
		switch {
		case err == nil && !cur.DeletionTimestamp.IsZero(), apierrors.IsNotFound(err) && last != nil:
			return nil, none, false, api.Errorf(api.CodeSandboxNotFound,
				"the sandbox %s started for request %q of warm pool %s was deleted before it was ready", name, req.RequestID, poolID)
		case err == nil && sandboxstate.Serving(&cur):
			return k.takeColdStart(ctx, &cur, req)
		case err == nil:
			last = &cur
		case !apierrors.IsNotFound(err):
			k.log.Error(err, "get cold-started sandbox", "sandbox", key.String())
		}
		select {
		case <-ctx.Done():
		case <-timeout.C:
		case <-tick.C:
			continue
		}
		state := "not created yet"
		if last != nil {
			state = "phase " + sandboxstate.Phase(last)
			if r := sandboxstate.ReadyReason(last); r != "" {
				state += ", reason " + r
			}
		}
		e := poolExhausted("warm pool %s had no ready sandbox free; the one started for this request (%s, %s) was not ready "+
			"within wait_seconds (%d s): retry with the same holder and request_id to get it once it is", poolID, name, state, req.WaitSeconds)
		e.Details["sandbox"] = name
		return nil, none, false, e
	}
}

// createColdStart creates sb, or finds the one an earlier try of req
// created.
func (k *Keeper) createColdStart(ctx context.Context, sb *v1alpha1.Sandbox, req api.AcquireLeaseRequest) *api.Error {
	wctx, cancel := writeContext(ctx)
	defer cancel()
	err := k.writer.Create(wctx, sb)
	if err == nil {
		k.onColdStart()
		return nil
	}
	if !apierrors.IsAlreadyExists(err) {
		k.log.Error(err, "create cold-start sandbox", "sandbox", sb.Namespace+"/"+sb.Name)
		return api.Errorf(api.CodeInternal, "could not start a sandbox for warm pool %s/%s", sb.Namespace, sb.Labels[v1alpha1.LabelWarmPool])
	}
	var got v1alpha1.Sandbox
	if err := k.reader.Get(wctx, client.ObjectKeyFromObject(sb), &got); err != nil && !apierrors.IsNotFound(err) {
		k.log.Error(err, "get cold-start sandbox", "sandbox", sb.Namespace+"/"+sb.Name)
		return api.Errorf(api.CodeInternal, "could not look up the sandbox started for request %q", req.RequestID)
	}
	if got.Annotations[v1alpha1.AnnotationPoolLeaseHolder] != req.Holder || got.Annotations[v1alpha1.AnnotationPoolLeaseRequestID] != req.RequestID ||
		!got.DeletionTimestamp.IsZero() {
		// Gone or going: the run it was started for is over (a retry of a
		// finished acquire), or the name belongs to someone else.
		return api.Errorf(api.CodeSandboxNotFound, "the sandbox %s/%s an earlier try of request %q started no longer exists",
			sb.Namespace, sb.Name, req.RequestID)
	}
	return nil
}

// takeColdStart takes a ready cold-started sandbox for req through the
// store. If an earlier try of req has meanwhile leased another sandbox of
// the pool, that pool lease stands and the cold-started one is deleted.
func (k *Keeper) takeColdStart(ctx context.Context, sb *v1alpha1.Sandbox, req api.AcquireLeaseRequest) (*v1alpha1.Sandbox, store.WarmTake, bool, *api.Error) {
	holdID, err := newHoldID()
	if err != nil {
		k.log.Error(err, "create lease ID")
		return nil, store.WarmTake{}, false, api.Errorf(api.CodeInternal, "could not create a lease ID")
	}
	pool := sb.Labels[v1alpha1.LabelWarmPool]
	t := store.WarmTake{SandboxUID: string(sb.UID), Namespace: sb.Namespace, Pool: pool, Sandbox: sb.Name,
		Taker: store.WarmTakenByLease, Holder: req.Holder, RequestID: req.RequestID, LeaseID: holdID,
		TTLSeconds: req.TTLSeconds, TakenAt: k.clock.Now().UTC().Truncate(time.Microsecond)}
	got, _, err := k.store.TakeWarm(ctx, t)
	if err != nil {
		k.log.Error(err, "take cold-started sandbox", "sandbox", sb.Namespace+"/"+sb.Name)
		return nil, store.WarmTake{}, false, api.Errorf(api.CodeInternal, "could not lease a sandbox of warm pool %s/%s", sb.Namespace, pool)
	}
	if got.Taker != store.WarmTakenByLease || got.Holder != req.Holder || got.RequestID != req.RequestID {
		// Only a pool lease of this request can have taken it: it was
		// born leased.
		k.log.Error(nil, "cold-started sandbox taken by someone else", "sandbox", sb.Namespace+"/"+sb.Name, "taker", string(got.Taker), "holder", got.Holder)
		return nil, store.WarmTake{}, false, api.Errorf(api.CodeInternal, "the sandbox started for request %q was taken by another", req.RequestID)
	}
	if got.SandboxUID == string(sb.UID) {
		return sb, got, false, nil
	}
	uid := sb.UID
	if err := k.writer.Delete(ctx, sb, client.Preconditions{UID: &uid}); client.IgnoreNotFound(err) != nil {
		// The controller deletes it anyway once its grace is over.
		k.log.Error(err, "delete unneeded cold-started sandbox", "sandbox", sb.Namespace+"/"+sb.Name)
	}
	other, t, apiErr := k.earlierPoolLease(ctx, sb.Namespace, pool, req)
	if other == nil && apiErr == nil {
		apiErr = api.Errorf(api.CodeInternal, "could not find the earlier lease of request %q", req.RequestID)
	}
	return other, t, false, apiErr
}

// maxColdStartPrefix bounds the readable part of a cold-started
// sandbox's name, as the API's own sandbox names are bounded.
const maxColdStartPrefix = 30

// ColdStartNames are the name and placeholder agent ID of the sandbox a
// pool lease starts: derived from the pool, the holder and the request
// ID, so that every try of one acquire names the same sandbox. The agent
// ID is a warm sandbox's kind (see the pool controller's warmAgentID):
// addressed only through the pool lease, by an admin.
func ColdStartNames(pool *v1alpha1.SandboxWarmPool, holder, requestID string) (name, agentID string) {
	sum := sha256.Sum256([]byte(pool.Namespace + "/" + pool.Name + "\x00" + holder + "\x00" + requestID))
	h := hex.EncodeToString(sum[:])
	prefix := pool.Name
	if len(prefix) > maxColdStartPrefix {
		// A subdomain's parts may not end in "-" or ".".
		prefix = strings.TrimRight(prefix[:maxColdStartPrefix], "-.")
	}
	const maxAgentID = 253
	p := pool.Name
	if room := maxAgentID - len("warm..cold-") - 32; len(p) > room {
		p = p[:room]
	}
	return prefix + "-cold-" + h[:12], "warm." + p + ".cold-" + h[:32]
}

// poolWaiters queues, per pool, this replica's pool leases waiting for a
// ready sandbox. The zero value is ready to use.
type poolWaiters struct {
	mu     sync.Mutex
	queues map[types.NamespacedName][]*poolWaiter
}

// poolWaiter is one queued pool lease; turn is closed when it is first.
type poolWaiter struct{ turn chan struct{} }

func (p *poolWaiters) join(key types.NamespacedName) *poolWaiter {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.queues == nil {
		p.queues = map[types.NamespacedName][]*poolWaiter{}
	}
	w := &poolWaiter{turn: make(chan struct{})}
	p.queues[key] = append(p.queues[key], w)
	if len(p.queues[key]) == 1 {
		close(w.turn)
	}
	return w
}

// leave takes w out of the queue, and gives the turn to the next waiter
// if w had it.
func (p *poolWaiters) leave(key types.NamespacedName, w *poolWaiter) {
	p.mu.Lock()
	defer p.mu.Unlock()
	q := p.queues[key]
	for i, x := range q {
		if x != w {
			continue
		}
		q = append(q[:i:i], q[i+1:]...)
		if i == 0 && len(q) > 0 {
			close(q[0].turn)
		}
		break
	}
	if len(q) == 0 {
		delete(p.queues, key)
	} else {
		p.queues[key] = q
	}
}

func (p *poolWaiters) queued(key types.NamespacedName) int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.queues[key])
}

// Waiting is how many pool leases of this replica wait for a ready
// sandbox of the pool key.
func (k *Keeper) Waiting(key types.NamespacedName) int { return k.poolWaiters.queued(key) }
