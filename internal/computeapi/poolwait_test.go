package computeapi

import (
	"context"
	"net/http"
	"strings"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	api "github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
	"github.com/agentbox/terraform-provider-agentbox/internal/computeapi/holds"
)

func TestPoolLeaseWaitBounds(t *testing.T) {
	f := poolFixture(t, "w-1")
	c := f.client(t, adminToken)
	ctx := context.Background()
	for _, wait := range []int{-1, api.MaxPoolLeaseWaitSeconds + 1} {
		_, err := c.AcquirePoolLease(ctx, "team-a", "p", api.AcquireLeaseRequest{Holder: "h", RequestID: "r", WaitSeconds: wait})
		wantAPIError(t, err, api.CodeInvalidArgument, http.StatusBadRequest)
	}
	// An agent's own lease has nothing to wait for.
	_, err := c.AcquireLease(ctx, "agent-1", api.AcquireLeaseRequest{Holder: "h", RequestID: "r", WaitSeconds: 5})
	e := wantAPIError(t, err, api.CodeInvalidArgument, http.StatusBadRequest)
	if !strings.Contains(e.Message, "wait_seconds") {
		t.Errorf("agent lease with wait_seconds: %s", e.Message)
	}
}

// addWarm puts a ready sandbox into pool p, as the pool's controller would
// once a replacement is ready.
func (f *fixture) addWarm(t *testing.T, name string) {
	t.Helper()
	for _, o := range warmSandbox(name, 0, f.clock.Now()) {
		if err := f.kube.Create(context.Background(), o); err != nil {
			t.Fatal(err)
		}
	}
}

// TestPoolLeaseWaitsInTurn: with the pool drained, leases that may wait
// queue and get the sandboxes that become ready in the order they came;
// one that may not wait is refused rather than served ahead of them, and
// one whose wait runs out gets pool_exhausted.
func TestPoolLeaseWaitsInTurn(t *testing.T) {
	f := poolFixture(t, "w-1")
	c := f.client(t, adminToken)
	ctx := context.Background()
	if _, err := c.AcquirePoolLease(ctx, "team-a", "p", api.AcquireLeaseRequest{Holder: "first", RequestID: "r"}); err != nil {
		t.Fatal(err)
	}
	key := types.NamespacedName{Namespace: "team-a", Name: "p"}
	type result struct {
		l   *api.PoolLease
		err error
	}
	wait := func(holder string) chan result {
		ch := make(chan result, 1)
		go func() {
			l, err := c.AcquirePoolLease(ctx, "team-a", "p", api.AcquireLeaseRequest{Holder: holder, RequestID: "r", WaitSeconds: 60})
			ch <- result{l, err}
		}()
		return ch
	}
	a := wait("a")
	waitFor(t, "a to queue", func() bool { return f.services.holds.Waiting(key) == 1 })
	b := wait("b")
	waitFor(t, "b to queue", func() bool { return f.services.holds.Waiting(key) == 2 })

	_, err := c.AcquirePoolLease(ctx, "team-a", "p", api.AcquireLeaseRequest{Holder: "c", RequestID: "r"})
	e := wantAPIError(t, err, api.CodePoolExhausted, http.StatusServiceUnavailable)
	if !strings.Contains(e.Message, "2 leases are waiting") {
		t.Errorf("a lease behind two waiters: %s", e.Message)
	}

	f.addWarm(t, "w-2")
	r := <-a
	if r.err != nil || r.l.Sandbox != "w-2" || r.l.Holder != "a" {
		t.Fatalf("first waiter: %+v, %v", r.l, r.err)
	}
	select {
	case r := <-b:
		t.Fatalf("the second waiter was answered with no sandbox for it: %+v, %v", r.l, r.err)
	case <-time.After(300 * time.Millisecond):
	}
	f.addWarm(t, "w-3")
	if r := <-b; r.err != nil || r.l.Sandbox != "w-3" || r.l.Holder != "b" {
		t.Fatalf("second waiter: %+v, %v", r.l, r.err)
	}
	f.settled()

	_, err = c.AcquirePoolLease(ctx, "team-a", "p", api.AcquireLeaseRequest{Holder: "d", RequestID: "r", WaitSeconds: 1})
	e = wantAPIError(t, err, api.CodePoolExhausted, http.StatusServiceUnavailable)
	if !strings.Contains(e.Message, "within wait_seconds") {
		t.Errorf("a wait that ran out: %s", e.Message)
	}
	if n := f.services.holds.Waiting(key); n != 0 {
		t.Errorf("%d waiters left queued", n)
	}
}

// TestPoolLeaseColdStart: a drained pool with coldStartWhenExhausted
// starts a sandbox for a lease that may wait, born leased to it, and
// hands it out once ready; a retry gets the same lease, and a start that
// is not ready in time is picked up by a retry.
func TestPoolLeaseColdStart(t *testing.T) {
	f := poolFixture(t)
	ctx := context.Background()
	var pool v1alpha1.SandboxWarmPool
	if err := f.kube.Get(ctx, types.NamespacedName{Namespace: "team-a", Name: "p"}, &pool); err != nil {
		t.Fatal(err)
	}
	pool.Spec.ColdStartWhenExhausted = true
	if err := f.kube.Update(ctx, &pool); err != nil {
		t.Fatal(err)
	}
	if err := f.kube.Create(ctx, template("team-a", "python")); err != nil {
		t.Fatal(err)
	}
	c := f.client(t, adminToken)
	req := api.AcquireLeaseRequest{Holder: "run-1", RequestID: "req-1", TTLSeconds: 120}

	// Without a wait, still answered at once.
	_, err := c.AcquirePoolLease(ctx, "team-a", "p", req)
	wantAPIError(t, err, api.CodePoolExhausted, http.StatusServiceUnavailable)

	// Nothing brings it up yet: the wait runs out, naming the sandbox.
	req.WaitSeconds = 1
	_, err = c.AcquirePoolLease(ctx, "team-a", "p", req)
	e := wantAPIError(t, err, api.CodePoolExhausted, http.StatusServiceUnavailable)
	name, agentID := holds.ColdStartNames(&pool, "run-1", "req-1")
	if e.Details["sandbox"] != name {
		t.Errorf("pool_exhausted of a cold start in progress: %+v", e)
	}
	var sb v1alpha1.Sandbox
	if err := f.kube.Get(ctx, types.NamespacedName{Namespace: "team-a", Name: name}, &sb); err != nil {
		t.Fatal(err)
	}
	if !metav1.IsControlledBy(&sb, &pool) || !v1alpha1.PoolLeased(&sb) || sb.Annotations[v1alpha1.AnnotationPoolColdStart] != "true" ||
		sb.Labels[v1alpha1.LabelWarmPool] != "p" || sb.Spec.AgentID != agentID || !sb.Spec.Ephemeral || sb.Spec.TemplateRef.Name != "python" {
		t.Errorf("cold-started sandbox: labels %v, annotations %v, owners %v, spec %+v", sb.Labels, sb.Annotations, sb.OwnerReferences, sb.Spec)
	}

	// The retry, with the controller's stand-in at work, gets it.
	standIn(t, f)
	req.WaitSeconds = 30
	l, err := c.AcquirePoolLease(ctx, "team-a", "p", req)
	if err != nil {
		t.Fatal(err)
	}
	if l.Sandbox != name || l.AgentID != agentID || l.Holder != "run-1" || l.TTLSeconds != 120 {
		t.Fatalf("cold-started lease = %+v", l)
	}
	if lease := f.leaseNamed(t, name); lease.Annotations[v1alpha1.AnnotationLeaseID] != l.LeaseID {
		t.Errorf("the Lease holds %v, the caller was told %s", lease.Annotations, l.LeaseID)
	}
	again, err := c.AcquirePoolLease(ctx, "team-a", "p", req)
	if err != nil || again.LeaseID != l.LeaseID || again.Sandbox != name {
		t.Errorf("retry = %+v, %v; want %+v", again, err, l)
	}
	var list v1alpha1.SandboxList
	if err := f.kube.List(ctx, &list, client.MatchingLabels{v1alpha1.LabelWarmPool: "p"}); err != nil || len(list.Items) != 1 {
		t.Errorf("pool sandboxes after a cold start and its retries: %d, %v", len(list.Items), err)
	}

	// Another lease starts another sandbox.
	other, err := c.AcquirePoolLease(ctx, "team-a", "p", api.AcquireLeaseRequest{Holder: "run-2", RequestID: "req-2", WaitSeconds: 30})
	if err != nil || other.Sandbox == name {
		t.Errorf("second cold start = %+v, %v", other, err)
	}
}

// TestColdStartGraceCoversTheWait: the controller waits for a cold start's
// hold for as long as its lease may wait and then some.
func TestColdStartGraceCoversTheWait(t *testing.T) {
	if need := api.MaxPoolLeaseWaitSeconds*time.Second + v1alpha1.PoolLeaseGrace; v1alpha1.PoolColdStartGrace < need {
		t.Errorf("PoolColdStartGrace %s is shorter than the longest wait plus PoolLeaseGrace, %s", v1alpha1.PoolColdStartGrace, need)
	}
}
