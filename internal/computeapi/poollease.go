package computeapi

import (
	"context"
	"fmt"
	"net/http"
	"sort"
	"strconv"
	"sync"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
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
// run (seeds 001 and 003). Two writes, in this order:
//
//  1. take the sandbox: annotate it with the holder, request ID and time,
//     with optimistic locking, so that of the callers (and new Sandboxes
//     adopting from the pool) racing for it exactly one wins. From then on
//     the pool replaces it and adoption skips it.
//  2. hold its Lease for the caller, as an agent's lease would be held.
//
// A retry with the same holder and request ID finds the sandbox step 1
// took and repeats step 2, which is itself idempotent. If the caller never
// retries after a failure between the steps, the controller deletes the
// taken sandbox once v1alpha1.PoolLeaseGrace has passed without a hold.
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
	sb, apiErr := s.takeFromPool(r.Context(), ns, pool, req)
	if apiErr != nil {
		if apiErr.Code == api.CodePoolExhausted {
			w.Header().Set("Retry-After", strconv.Itoa(int(poolExhaustedRetry/time.Second)))
		}
		fail(apiErr)
		return
	}
	log = log.WithValues("sandbox", sb.Name)
	s.warmConnection(sb)
	l, apiErr := s.hold(r.Context(), sb, req)
	if apiErr != nil {
		fail(apiErr)
		return
	}
	log.V(1).Info("pool lease acquired", "holder", req.Holder, "request_id", req.RequestID)
	s.recordLease(r.Context(), store.LeaseAcquire, sb, l)
	writeJSON(w, http.StatusOK, api.PoolLease{Lease: leaseView(l), AgentID: sb.Spec.AgentID, Namespace: sb.Namespace, Sandbox: sb.Name})
}

// takeFromPool returns the sandbox an earlier try of this acquire took, or
// takes a ready, free one of the pool, oldest first.
func (s *Server) takeFromPool(ctx context.Context, ns, pool string, req api.AcquireLeaseRequest) (*v1alpha1.Sandbox, *api.Error) {
	var list v1alpha1.SandboxList
	if err := s.sandboxes.List(ctx, &list, client.InNamespace(ns), client.MatchingLabels{v1alpha1.LabelWarmPool: pool}); err != nil {
		s.log.Error(err, "list warm sandboxes", "namespace", ns, "pool", pool)
		return nil, api.Errorf(api.CodeInternal, "could not list the sandboxes of warm pool %s/%s", ns, pool)
	}
	var free []*v1alpha1.Sandbox
	for i := range list.Items {
		sb := &list.Items[i]
		if !inPool(sb, pool) {
			continue
		}
		if sb.Annotations[v1alpha1.AnnotationPoolLeaseHolder] == req.Holder &&
			sb.Annotations[v1alpha1.AnnotationPoolLeaseRequestID] == req.RequestID {
			return sb, nil
		}
		if takeable(sb) {
			free = append(free, sb)
		}
	}
	sort.SliceStable(free, func(i, j int) bool {
		return free[i].CreationTimestamp.Before(&free[j].CreationTimestamp)
	})
	var lastErr error
	for _, sb := range free {
		key := client.ObjectKeyFromObject(sb)
		if !s.poolTakes.reserve(key, s.clock.Now()) {
			// Another request of this replica is taking it, or took it
			// and the cache has not caught up: trying too would only
			// cost both a conflict.
			continue
		}
		took, err := s.take(ctx, sb, req)
		s.poolTakes.settle(key, took, s.clock.Now())
		if err != nil {
			// One sandbox that cannot be written (a slow or failing API
			// server) need not fail the claim while others are free.
			s.log.Error(err, "take warm sandbox", "namespace", ns, "sandbox", sb.Name)
			lastErr = err
			continue
		}
		if took {
			return sb, nil
		}
	}
	if lastErr != nil {
		return nil, api.Errorf(api.CodeInternal, "could not lease a sandbox of warm pool %s/%s", ns, pool)
	}
	if len(list.Items) == 0 {
		var p v1alpha1.SandboxWarmPool
		err := s.sandboxes.Get(ctx, types.NamespacedName{Namespace: ns, Name: pool}, &p)
		if apierrors.IsNotFound(err) {
			return nil, api.Errorf(api.CodePoolNotFound, "warm pool %s/%s does not exist", ns, pool)
		}
		if err != nil {
			s.log.Error(err, "get warm pool", "namespace", ns, "pool", pool)
			return nil, api.Errorf(api.CodeInternal, "could not look up warm pool %s/%s", ns, pool)
		}
	}
	e := api.Errorf(api.CodePoolExhausted, "warm pool %s/%s has no ready sandbox free (%d sandboxes, none ready and unleased); retry shortly",
		ns, pool, len(list.Items))
	e.Details = map[string]string{"retry_after_seconds": strconv.Itoa(int(poolExhaustedRetry / time.Second))}
	return nil, e
}

// take marks sb as leased for req. It reports false when someone else got
// it first (or it went away); the caller then tries the next one.
func (s *Server) take(ctx context.Context, sb *v1alpha1.Sandbox, req api.AcquireLeaseRequest) (bool, error) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), leaseWriteTimeout)
	defer cancel()
	for range 2 {
		patch := client.MergeFromWithOptions(sb.DeepCopy(), client.MergeFromWithOptimisticLock{})
		if sb.Annotations == nil {
			sb.Annotations = map[string]string{}
		}
		sb.Annotations[v1alpha1.AnnotationPoolLeaseHolder] = req.Holder
		sb.Annotations[v1alpha1.AnnotationPoolLeaseRequestID] = req.RequestID
		sb.Annotations[v1alpha1.AnnotationPoolLeasedAt] = s.clock.Now().UTC().Format(time.RFC3339Nano)
		err := s.leaseWriter.Patch(ctx, sb, patch)
		switch {
		case err == nil:
			return true, nil
		case apierrors.IsNotFound(err):
			return false, nil
		case !apierrors.IsConflict(err):
			return false, fmt.Errorf("mark sandbox %s leased: %w", sb.Name, err)
		}
		// A conflict may only mean the cached copy is behind (a status
		// write moved the resourceVersion): look once more, directly.
		fresh := &v1alpha1.Sandbox{}
		if err := s.leaseReader.Get(ctx, client.ObjectKeyFromObject(sb), fresh); err != nil {
			return false, client.IgnoreNotFound(err)
		}
		if !takeable(fresh) {
			return false, nil
		}
		*sb = *fresh
	}
	return false, nil
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
// free sandbox, and each would pay a conflict per sandbox taken before
// it: a burst of n claims cost O(n²) API writes. Across replicas the
// optimistic lock in take still decides; this only keeps one replica's
// requests out of each other's way. The zero value is ready to use.
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
