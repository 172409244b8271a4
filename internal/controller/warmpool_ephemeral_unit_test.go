package controller

import (
	"context"
	"strings"
	"testing"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
)

// lease marks a warm sandbox as taken from its pool, as the Compute API's
// first write does.
func (w *warmEnv) lease(name, holder, request string) {
	w.t.Helper()
	s := w.sandbox(name)
	s.Annotations[v1alpha1.AnnotationPoolLeaseHolder] = holder
	s.Annotations[v1alpha1.AnnotationPoolLeaseRequestID] = request
	s.Annotations[v1alpha1.AnnotationPoolLeasedAt] = w.clock.Now().UTC().Format(time.RFC3339Nano)
	must(w.t, w.c.Update(context.Background(), s))
}

// changeLease edits a sandbox's Lease as the Compute API would.
func (w *warmEnv) changeLease(name string, edit func(*coordinationv1.Lease)) {
	w.t.Helper()
	var l coordinationv1.Lease
	must(w.t, w.c.Get(context.Background(), types.NamespacedName{Namespace: unitNS, Name: ActivityClockName(name)}, &l))
	if l.Annotations == nil {
		l.Annotations = map[string]string{}
	}
	edit(&l)
	must(w.t, w.c.Update(context.Background(), &l))
}

// hold gives the Lease the hold of the acquire with this holder and request.
func (w *warmEnv) hold(name, holder, request string, ttl time.Duration) {
	w.changeLease(name, func(l *coordinationv1.Lease) {
		now := metav1.NewMicroTime(w.clock.Now())
		l.Spec.HolderIdentity = ptr.To(holder)
		l.Spec.LeaseDurationSeconds = ptr.To(int32(ttl / time.Second))
		l.Spec.AcquireTime, l.Spec.RenewTime = &now, &now
		l.Annotations[v1alpha1.AnnotationLeaseRequestID] = request
		l.Annotations[v1alpha1.AnnotationLeaseID] = "id-" + request
	})
}

// recycled reports whether the sandbox has been deleted (it keeps its
// finalizer, so it may still exist with a deletion time).
func (w *warmEnv) recycled(name string) bool {
	w.t.Helper()
	var s v1alpha1.Sandbox
	return !w.exists(&s, name) || !s.DeletionTimestamp.IsZero()
}

// TestUnitEphemeralLease walks the three ways an ephemeral run ends —
// release, expiry, and an acquire that died before holding — and checks
// what the pool does meanwhile: it replaces a leased sandbox at once,
// reports it, and neither a template roll nor adoption touches it.
func TestUnitEphemeralLease(t *testing.T) {
	w, names := readyPool(t, 3)
	released, expired, abandoned := names[0], names[1], names[2]
	for i, n := range names {
		w.lease(n, "run-"+n, "req-"+string(rune('a'+i)))
	}
	w.reconcilePool("p")
	p := w.getPool("p")
	if p.Status.Replicas != 3 || p.Status.LeasedReplicas != 3 {
		t.Fatalf("pool with 3 leased: replicas %d, leased %d; want 3 replacements under way and 3 leased", p.Status.Replicas, p.Status.LeasedReplicas)
	}
	if got := len(w.warm("p")); got != 6 {
		t.Fatalf("%d sandboxes in the pool, want 3 leased and 3 replacements", got)
	}

	// Adoption never takes a leased sandbox.
	var tpl v1alpha1.SandboxTemplate
	must(t, w.c.Get(context.Background(), types.NamespacedName{Namespace: unitNS, Name: "t"}, &tpl))
	if ok, err := w.r.adoptable(context.Background(), w.sandbox(released), v1alpha1.TemplateHash(&tpl.Spec)); err != nil || ok {
		t.Errorf("a leased sandbox is adoptable (%v, %v)", ok, err)
	}

	// Taken but not yet held: within the grace it stays, and the
	// controller comes back when the grace ends.
	res := w.reconcile(released)
	if w.recycled(released) || res.RequeueAfter <= 0 || res.RequeueAfter > v1alpha1.PoolLeaseGrace {
		t.Fatalf("before its hold: recycled %v, requeue %s", w.recycled(released), res.RequeueAfter)
	}
	w.hold(released, "run-"+released, "req-a", time.Minute)
	w.hold(expired, "run-"+expired, "req-b", 10*time.Second)
	w.reconcile(released)
	w.reconcile(expired)
	if w.recycled(released) || w.recycled(expired) {
		t.Fatal("a held ephemeral sandbox was deleted")
	}

	// A template roll replaces idle warm sandboxes only.
	tpl.Spec.Image = "agentbox/agentbox-sandbox:rolled"
	must(t, w.c.Update(context.Background(), &tpl))
	w.reconcilePool("p")
	for _, n := range names {
		if w.recycled(n) {
			t.Fatalf("the template roll deleted leased sandbox %s", n)
		}
	}

	// Release: deleted at once.
	w.changeLease(released, func(l *coordinationv1.Lease) {
		l.Spec.HolderIdentity, l.Spec.LeaseDurationSeconds, l.Spec.AcquireTime = nil, nil, nil
		delete(l.Annotations, v1alpha1.AnnotationLeaseRequestID)
		delete(l.Annotations, v1alpha1.AnnotationLeaseID)
		l.Annotations[v1alpha1.AnnotationLeaseReleasedRequestID] = "req-a"
	})
	w.reconcile(released)
	if !w.recycled(released) {
		t.Error("a released ephemeral sandbox was kept")
	}

	// Expiry: the holder went quiet; deleted rather than handed on.
	w.clock.Step(11 * time.Second)
	w.reconcile(expired)
	if !w.recycled(expired) {
		t.Error("an ephemeral sandbox whose lease expired was kept")
	}

	// Never held: deleted once the grace is over.
	if w.reconcile(abandoned); w.recycled(abandoned) {
		t.Fatal("deleted inside the grace")
	}
	w.clock.Step(v1alpha1.PoolLeaseGrace)
	w.reconcile(abandoned)
	if !w.recycled(abandoned) {
		t.Error("a sandbox taken by an acquire that never held it was kept")
	}
	if evs := strings.Join(w.drainEvents(), "\n"); strings.Count(evs, EventEphemeralRecycled) != 3 ||
		!strings.Contains(evs, "released its lease") || !strings.Contains(evs, "expired") {
		t.Errorf("events %q, want three EphemeralRecycled naming release, expiry and the grace", evs)
	}
}

// TestUnitColdStartGrace: a sandbox the Compute API started for a pool
// lease is held only once it is ready, so it is kept without a hold for
// PoolColdStartGrace rather than PoolLeaseGrace, and then deleted.
func TestUnitColdStartGrace(t *testing.T) {
	w, names := readyPool(t, 1)
	cold := names[0]
	w.lease(cold, "run-1", "req-1")
	s := w.sandbox(cold)
	s.Annotations[v1alpha1.AnnotationPoolColdStart] = "true"
	must(t, w.c.Update(context.Background(), s))

	w.clock.Step(v1alpha1.PoolLeaseGrace + time.Second)
	res := w.reconcile(cold)
	if w.recycled(cold) || res.RequeueAfter <= 0 || res.RequeueAfter > v1alpha1.PoolColdStartGrace-v1alpha1.PoolLeaseGrace {
		t.Fatalf("a cold start past PoolLeaseGrace: recycled %v, requeue %s", w.recycled(cold), res.RequeueAfter)
	}
	w.clock.Step(v1alpha1.PoolColdStartGrace - v1alpha1.PoolLeaseGrace)
	w.reconcile(cold)
	if !w.recycled(cold) {
		t.Error("a cold start nobody took up was kept past PoolColdStartGrace")
	}
}
