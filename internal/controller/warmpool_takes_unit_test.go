package controller

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	"github.com/agentbox/terraform-provider-agentbox/internal/store"
)

// leaseTake takes the warm sandbox name for a pool lease, as the Compute
// API does, without writing anything to it.
func (w *warmEnv) leaseTake(name, holder string) store.WarmTake {
	w.t.Helper()
	s := w.sandbox(name)
	t, ok, err := w.store.TakeWarm(context.Background(), store.WarmTake{SandboxUID: string(s.UID), Namespace: s.Namespace,
		Pool: s.Labels[v1alpha1.LabelWarmPool], Sandbox: s.Name, Taker: store.WarmTakenByLease, Holder: holder,
		RequestID: "req-" + holder, LeaseID: "lease-" + holder, TTLSeconds: 60})
	if err != nil || !ok {
		w.t.Fatalf("lease take of %s: %v, %v", name, ok, err)
	}
	return t
}

// A sandbox a pool lease took through the store, whose annotations are not
// written yet, is no longer the pool's: adoption passes it by, a
// scale-down leaves it, the pool replaces it at once, and writes the
// annotations itself if the taker never does.
func TestUnitWarmTakeDecides(t *testing.T) {
	w, _ := readyPool(t, 2, unitSandbox("x", "t"))
	// The sandbox adoption would pick first goes to a pool lease.
	order, err := w.r.listWarm(context.Background(), w.sandbox("x"))
	must(t, err)
	leased, other := order[0].Name, order[1].Name
	take := w.leaseTake(leased, "run-1")

	// The new sandbox adopts the other one, though the leased one is
	// older and its annotations say nothing.
	w.reconcile("x")
	if got := w.sandbox("x").Status.Workload; got != other {
		t.Fatalf("x adopted %q; want %s (the leased %s is taken)", got, other, leased)
	}
	if by := w.sandbox(leased).Annotations[v1alpha1.AnnotationAdoptedBy]; by != "" {
		t.Errorf("the leased sandbox was claimed by %q", by)
	}

	// The pool counts it as leased and replaces it (and the adopted one)
	// at once; it does not write the taker's annotations while the taker
	// may still be writing them.
	res := w.reconcilePool("p")
	if p := w.getPool("p"); p.Status.LeasedReplicas != 1 {
		t.Errorf("pool status %+v; want 1 leased", p.Status)
	}
	if n := len(w.warm("p")); n != 3 {
		t.Errorf("%d warm sandboxes after the take; want the leased one and 2 replacements", n)
	}
	if res.RequeueAfter <= 0 || res.RequeueAfter > warmTakeSettle {
		t.Errorf("requeue after %v; want within %v, to settle the take", res.RequeueAfter, warmTakeSettle)
	}
	if v1alpha1.PoolLeased(w.sandbox(leased)) {
		t.Error("the pool wrote the lease annotations before the taker had its chance")
	}

	// Scaled down to nothing, the pool deletes what is its own and leaves
	// the taken one.
	p := w.getPool("p")
	p.Spec.Replicas = 0
	must(t, w.c.Update(context.Background(), p))
	w.reconcilePool("p")
	if !w.exists(&v1alpha1.Sandbox{}, leased) {
		t.Fatal("the scale-down deleted a sandbox a pool lease had taken")
	}

	// The taker never wrote its annotations: the pool does, from the take.
	w.clock.Step(warmTakeSettle + time.Second)
	w.reconcilePool("p")
	s := w.sandbox(leased)
	if s.Annotations[v1alpha1.AnnotationPoolLeaseHolder] != "run-1" || s.Annotations[v1alpha1.AnnotationPoolLeaseRequestID] != "req-run-1" ||
		s.Annotations[v1alpha1.AnnotationPoolLeasedAt] != take.TakenAt.UTC().Format(time.RFC3339Nano) {
		t.Fatalf("annotations after the settle: %v", s.Annotations)
	}
	// With no hold on its Lease past the grace, the sandbox controller
	// recycles it, as any pool lease whose holder went away.
	w.clock.Step(v1alpha1.PoolLeaseGrace)
	w.reconcile(leased)
	if w.exists(&v1alpha1.Sandbox{}, leased) {
		t.Error("a pool lease never held was not recycled")
	}
	// Once its sandbox has been gone a while, the take is forgotten.
	w.clock.Step(warmTakeForget + time.Second)
	w.reconcilePool("p")
	if _, err := w.store.WarmTakeOf(context.Background(), take.SandboxUID); !errors.Is(err, store.ErrNotFound) {
		t.Errorf("the take of a deleted sandbox: %v; want it forgotten", err)
	}
}

// A retirement the pool's pass took but did not carry out (the control
// plane died in between) keeps the sandbox from everyone else, and the next
// pass deletes it.
func TestUnitWarmRetirement(t *testing.T) {
	w, names := readyPool(t, 1, unitSandbox("x", "t"))
	ok, err := takeWarm(context.Background(), w.store, w.sandbox(names[0]), store.WarmTakenByRetirement, "", "")
	if err != nil || !ok {
		t.Fatalf("retire take: %v, %v", ok, err)
	}
	w.reconcile("x")
	if got := w.sandbox("x").Status.Workload; got != "" {
		t.Fatalf("x adopted %q, which its pool was retiring", got)
	}
	w.drainEvents()
	w.reconcilePool("p")
	if w.exists(&v1alpha1.Sandbox{}, names[0]) && w.sandbox(names[0]).DeletionTimestamp.IsZero() {
		t.Error("the pool did not finish retiring its sandbox")
	}
	if evs := strings.Join(w.drainEvents(), "\n"); !strings.Contains(evs, EventWarmSandboxDeleted) {
		t.Errorf("events %q lack %s", evs, EventWarmSandboxDeleted)
	}
}
