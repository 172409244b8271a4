package computeapi

import (
	"context"
	"encoding/pem"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	api "github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
	"github.com/agentbox/terraform-provider-agentbox/internal/computeapi/holds"
	"github.com/agentbox/terraform-provider-agentbox/internal/pki"
	"github.com/agentbox/terraform-provider-agentbox/internal/store"
)

// warmSandbox is a ready sandbox of warm pool "p" in team-a, created age
// ago, with its Lease.
func warmSandbox(name string, age time.Duration, now time.Time) []client.Object {
	s := readySandbox("team-a", name, "warm.p."+name, "https://127.0.0.1:1")
	s.Labels[v1alpha1.LabelWarmPool] = "p"
	s.UID = types.UID("uid-" + name)
	s.CreationTimestamp = metav1.NewTime(now.Add(-age))
	s.OwnerReferences = []metav1.OwnerReference{{APIVersion: v1alpha1.GroupVersion.String(), Kind: "SandboxWarmPool",
		Name: "p", UID: "uid-p", Controller: ptr.To(true)}}
	return []client.Object{s, lease("team-a", name, now.Add(-age))}
}

func poolFixture(t *testing.T, names ...string) *fixture {
	t.Helper()
	now := time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC) // the fixture's clock
	objs := []client.Object{&v1alpha1.SandboxWarmPool{ObjectMeta: metav1.ObjectMeta{Namespace: "team-a", Name: "p", UID: "uid-p"},
		Spec: v1alpha1.SandboxWarmPoolSpec{TemplateRef: v1alpha1.LocalObjectReference{Name: "python"}, Replicas: int32(len(names))}}}
	for i, n := range names {
		objs = append(objs, warmSandbox(n, time.Duration(len(names)-i)*time.Minute, now)...)
	}
	return newFixtureWith(t, tempStore(t), "", objs...)
}

// settled waits until the API has written what its pool leases decided
// into the Sandboxes and Leases.
func (f *fixture) settled() {
	f.services.background.Wait()
	f.services.conns.WaitWarmUps()
	f.services.holds.Drain()
}

func (f *fixture) sandboxNamed(t *testing.T, name string) *v1alpha1.Sandbox {
	t.Helper()
	var s v1alpha1.Sandbox
	if err := f.kube.Get(context.Background(), types.NamespacedName{Namespace: "team-a", Name: name}, &s); err != nil {
		t.Fatal(err)
	}
	return &s
}

func (f *fixture) leaseNamed(t *testing.T, name string) *coordinationv1.Lease {
	t.Helper()
	var l coordinationv1.Lease
	if err := f.kube.Get(context.Background(), types.NamespacedName{Namespace: "team-a", Name: name}, &l); err != nil {
		t.Fatal(err)
	}
	return &l
}

func TestPoolLease(t *testing.T) {
	f := poolFixture(t, "w-old", "w-new")
	c := f.client(t, adminToken)
	ctx := context.Background()
	req := api.AcquireLeaseRequest{Holder: "run-1", RequestID: "req-1", TTLSeconds: 30}

	got, err := c.AcquirePoolLease(ctx, "team-a", "p", req)
	if err != nil {
		t.Fatal(err)
	}
	// Oldest first: the longest-warmed sandbox goes out.
	if got.Sandbox != "w-old" || got.AgentID != "warm.p.w-old" || got.Namespace != "team-a" || got.Holder != "run-1" ||
		got.TTLSeconds != 30 || len(got.LeaseID) != 32 {
		t.Fatalf("pool lease = %+v", got)
	}
	f.settled()
	s := f.sandboxNamed(t, "w-old")
	if s.Annotations[v1alpha1.AnnotationPoolLeaseHolder] != "run-1" || s.Annotations[v1alpha1.AnnotationPoolLeaseRequestID] != "req-1" ||
		s.Annotations[v1alpha1.AnnotationPoolLeasedAt] != f.clock.Now().UTC().Format(time.RFC3339Nano) {
		t.Errorf("taken sandbox annotations %v", s.Annotations)
	}
	if l := f.leaseNamed(t, "w-old"); ptr.Deref(l.Spec.HolderIdentity, "") != "run-1" || l.Annotations[v1alpha1.AnnotationLeaseID] != got.LeaseID {
		t.Errorf("Lease after the pool acquire: %+v %v", l.Spec, l.Annotations)
	} else if v := holds.View(l); v != got.Lease {
		t.Errorf("the Lease says %+v; the caller was told %+v", v, got.Lease)
	}

	// A retry gets the same sandbox and hold back.
	f.clock.Step(time.Second)
	again, err := c.AcquirePoolLease(ctx, "team-a", "p", req)
	if err != nil || *again != *got {
		t.Fatalf("retried acquire = %+v, %v; want %+v", again, err, got)
	}

	second, err := c.AcquirePoolLease(ctx, "team-a", "p", api.AcquireLeaseRequest{Holder: "run-2", RequestID: "req-2"})
	if err != nil || second.Sandbox != "w-new" {
		t.Fatalf("second acquire = %+v, %v", second, err)
	}
	_, err = c.AcquirePoolLease(ctx, "team-a", "p", api.AcquireLeaseRequest{Holder: "run-3", RequestID: "req-3"})
	e := wantAPIError(t, err, api.CodePoolExhausted, http.StatusServiceUnavailable)
	if e.Details["retry_after_seconds"] == "" {
		t.Errorf("pool_exhausted without retry_after_seconds: %+v", e)
	}

	// The run ends through the agent path; the release leaves the mark the
	// controller deletes the sandbox on.
	if err := c.ReleaseLease(ctx, got.AgentID, api.ReleaseLeaseRequest{Holder: "run-1", LeaseID: got.LeaseID}); err != nil {
		t.Fatal(err)
	}
	if l := f.leaseNamed(t, "w-old"); l.Spec.HolderIdentity != nil || l.Annotations[v1alpha1.AnnotationLeaseReleasedRequestID] != "req-1" {
		t.Errorf("Lease after release: %+v %v", l.Spec, l.Annotations)
	}

	_, err = c.AcquirePoolLease(ctx, "team-a", "nope", api.AcquireLeaseRequest{Holder: "run-4", RequestID: "req-4"})
	wantAPIError(t, err, api.CodePoolNotFound, http.StatusNotFound)
	_, err = c.AcquirePoolLease(ctx, "team-a", "p", api.AcquireLeaseRequest{Holder: "run-4"})
	wantAPIError(t, err, api.CodeInvalidArgument, http.StatusBadRequest)
}

// servedPoolFixture is a pool of one warm sandbox, w-1, whose supervisor
// is the fixture's fake one.
func servedPoolFixture(t *testing.T) *fixture {
	t.Helper()
	now := time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC) // the fixture's clock
	f := newFixtureWith(t, tempStore(t), pki.SandboxID(testTrustDomain, "team-a", "w-1").String(), warmSandbox("w-1", time.Minute, now)...)
	sb := f.sandboxNamed(t, "w-1")
	sb.Status.ServiceEndpoint = f.sup.srv.URL
	if err := f.kube.Status().Update(context.Background(), sb); err != nil {
		t.Fatal(err)
	}
	return f
}

// A pool lease opens the verified connection to the leased sandbox's
// supervisor while it writes the lease, so that the holder's first command
// waits neither for a TLS handshake nor for an API-server write.
func TestPoolLeaseWarmsConnection(t *testing.T) {
	ctx := context.Background()
	f := servedPoolFixture(t)
	c := f.client(t, adminToken)
	// The Lease and Sandbox writes are held back, so that the command
	// below comes first, as it may in production.
	unblock := f.blockSettles()
	defer unblock()
	l, err := c.AcquirePoolLease(ctx, "team-a", "p", api.AcquireLeaseRequest{Holder: "run-1", RequestID: "req-1"})
	if err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(10 * time.Second); f.sup.handshakes.Load() == 0; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("no connection to the leased sandbox's supervisor 10 s after the lease")
		}
	}
	patches := f.patches.Load()
	res, err := c.RunCommand(ctx, l.AgentID, api.RunCommandRequest{Command: []string{"echo", "hi"}})
	if err != nil || res.ExitCode != 0 {
		t.Fatalf("first command: %+v, %v", res, err)
	}
	if n := f.sup.handshakes.Load(); n != 1 {
		t.Errorf("%d TLS handshakes with the supervisor; the first command should reuse the one the lease opened", n)
	}
	// Nor for an activity renewal: the acquire was the activity.
	if n := f.patches.Load() - patches; n != 0 {
		t.Errorf("the first command after the lease made %d API-server writes; want none", n)
	}
}

// The settle waits its grace before it writes, so that the holder's
// first command, which follows the answer at once, does not share the
// node with the settle's writes and the replacement sandbox they start;
// the writes come after it.
func TestPoolLeaseSettlesAfterTheFirstCommand(t *testing.T) {
	ctx := context.Background()
	f := servedPoolFixture(t)
	// Long enough that the command below surely comes first; Drain then
	// waits it out.
	f.services.holds.SetSettleGrace(2 * time.Second)
	c := f.client(t, adminToken)
	before := f.patches.Load()
	l, err := c.AcquirePoolLease(ctx, "team-a", "p", api.AcquireLeaseRequest{Holder: "run-1", RequestID: "req-1"})
	if err != nil {
		t.Fatal(err)
	}
	res, err := c.RunCommand(ctx, l.AgentID, api.RunCommandRequest{Command: []string{"echo", "hi"}})
	if err != nil || res.ExitCode != 0 {
		t.Fatalf("first command: %+v, %v", res, err)
	}
	if n := f.patches.Load() - before; n != 0 {
		t.Errorf("%d Sandbox patches before the first command's answer; want none", n)
	}
	if held := f.leaseNamed(t, l.Sandbox); held.Spec.HolderIdentity != nil {
		t.Errorf("the Lease was written before the first command's answer: %+v", held.Spec)
	}
	f.settled()
	if held := f.leaseNamed(t, l.Sandbox); ptr.Deref(held.Spec.HolderIdentity, "") != "run-1" {
		t.Errorf("the Lease after the settle: %+v", held.Spec)
	}
	if s := f.sandboxNamed(t, l.Sandbox); !v1alpha1.PoolLeased(s) {
		t.Errorf("%s is not marked leased after the settle: %v", l.Sandbox, s.Annotations)
	}
}

// The holder's first command, sent while the lease's warm-up is still in
// its handshake, waits for that connection rather than opening a second
// one alongside it.
func TestPoolLeaseFirstCommandWaitsForTheWarmUp(t *testing.T) {
	f := servedPoolFixture(t)
	f.sup.handshakeDelay.Store(int64(300 * time.Millisecond))
	leaseAndRun(t, f)
	if n := f.sup.handshakes.Load(); n != 1 {
		t.Errorf("%d TLS handshakes with the supervisor; the first command should have waited for the lease's", n)
	}
}

// TestPoolLeaseRace sends more concurrent acquires than the pool has
// sandboxes: each sandbox goes to exactly one caller, the rest are told the
// pool is exhausted.
func TestPoolLeaseRace(t *testing.T) {
	names := []string{"w-0", "w-1", "w-2"}
	f := poolFixture(t, names...)
	c := f.client(t, adminToken)
	const callers = 12
	var (
		wg        sync.WaitGroup
		mu        sync.Mutex
		winners   = map[string]string{}
		exhausted int
	)
	for i := range callers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			l, err := c.AcquirePoolLease(context.Background(), "team-a", "p",
				api.AcquireLeaseRequest{Holder: fmt.Sprintf("run-%d", i), RequestID: "r"})
			mu.Lock()
			defer mu.Unlock()
			switch {
			case err == nil:
				if prev, dup := winners[l.Sandbox]; dup {
					t.Errorf("sandbox %s went to %s and %s", l.Sandbox, prev, l.Holder)
				}
				winners[l.Sandbox] = l.Holder
			case errors.Is(err, &api.Error{Code: api.CodePoolExhausted}):
				exhausted++
			default:
				t.Errorf("acquire: %v", err)
			}
		}()
	}
	wg.Wait()
	f.settled()
	if len(winners) != len(names) || exhausted != callers-len(names) {
		t.Fatalf("%d winners %v, %d exhausted; want %d and %d", len(winners), winners, exhausted, len(names), callers-len(names))
	}
	for _, n := range names {
		s := f.sandboxNamed(t, n)
		if l := f.leaseNamed(t, n); ptr.Deref(l.Spec.HolderIdentity, "") != winners[n] || s.Annotations[v1alpha1.AnnotationPoolLeaseHolder] != winners[n] {
			t.Errorf("%s: marked for %q, held by %q, won by %q", n, s.Annotations[v1alpha1.AnnotationPoolLeaseHolder],
				ptr.Deref(l.Spec.HolderIdentity, ""), winners[n])
		}
	}
}

func TestPoolLeaseNeedsAdmin(t *testing.T) {
	f := poolFixture(t, "w-0")
	srv, err := NewServer(Options{Sandboxes: f.kube, Leases: f.kube, Authenticator: agentToken{},
		Supervisors: f.services.supervisors, Clock: f.clock})
	if err != nil {
		t.Fatal(err)
	}
	ts := httptest.NewTLSServer(srv.Handler())
	defer ts.Close()
	c, err := api.New(ts.URL, "agent-token:agent-1", pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: ts.Certificate().Raw}))
	if err != nil {
		t.Fatal(err)
	}
	defer c.CloseIdleConnections()
	for _, pool := range []string{"p", "nope"} {
		_, err = c.AcquirePoolLease(context.Background(), "team-a", pool, api.AcquireLeaseRequest{Holder: "h", RequestID: "r"})
		wantAPIError(t, err, api.CodePermissionDenied, http.StatusForbidden)
	}
	if s := f.sandboxNamed(t, "w-0"); v1alpha1.PoolLeased(s) {
		t.Error("a refused acquire marked the sandbox")
	}
}

// TestPoolLeaseBurst: as many claims at once as there are ready sandboxes
// must all succeed, and without one write conflict between them: claims
// of one replica no longer all race for the oldest sandbox.
func TestPoolLeaseBurst(t *testing.T) {
	const n = 16
	var names []string
	for i := range n {
		names = append(names, fmt.Sprintf("w-%02d", i))
	}
	f := poolFixture(t, names...)
	c := f.client(t, adminToken)
	before := f.patches.Load()
	var wg sync.WaitGroup
	got := make([]string, n)
	for i := range n {
		wg.Go(func() {
			l, err := c.AcquirePoolLease(context.Background(), "team-a", "p",
				api.AcquireLeaseRequest{Holder: fmt.Sprintf("run-%d", i), RequestID: "r"})
			if err != nil {
				t.Errorf("claim %d: %v", i, err)
				return
			}
			got[i] = l.Sandbox
		})
	}
	wg.Wait()
	f.settled()
	seen := map[string]bool{}
	for i, s := range got {
		if s != "" && seen[s] {
			t.Errorf("claim %d got %s, which another claim got too", i, s)
		}
		seen[s] = true
	}
	if patches := f.patches.Load() - before; patches != n {
		t.Errorf("%d claims patched sandboxes %d times; want one patch each, no conflicts", n, patches)
	}
}

// blockSettles keeps the API from writing its pool leases' holds and
// annotations in the background until the returned func is called, as if
// the API server were slow or the replica had died after answering.
func (f *fixture) blockSettles() (unblock func()) {
	return f.services.holds.PauseSettles()
}

// A pool lease is answered once the store has decided, before the Lease
// and the Sandbox say so. A lease call made before they do finds the hold
// it was given, and a retried acquire gets the same one, written.
func TestPoolLeaseAnsweredBeforeTheWrites(t *testing.T) {
	f := poolFixture(t, "w-0", "w-1")
	c := f.client(t, adminToken)
	ctx := context.Background()
	unblock := f.blockSettles()
	before := f.patches.Load()
	first, err := c.AcquirePoolLease(ctx, "team-a", "p", api.AcquireLeaseRequest{Holder: "run-1", RequestID: "req-1", TTLSeconds: 60})
	if err != nil {
		t.Fatal(err)
	}
	second, err := c.AcquirePoolLease(ctx, "team-a", "p", api.AcquireLeaseRequest{Holder: "run-2", RequestID: "req-2", TTLSeconds: 60})
	if err != nil {
		t.Fatal(err)
	}
	if first.Sandbox == second.Sandbox {
		t.Fatalf("both acquires got %s", first.Sandbox)
	}
	if n := f.patches.Load() - before; n != 0 {
		t.Errorf("%d Sandbox patches before the answers; want none", n)
	}
	for _, l := range []*api.PoolLease{first, second} {
		if s := f.sandboxNamed(t, l.Sandbox); v1alpha1.PoolLeased(s) {
			t.Errorf("%s is marked leased while the settles are held back", l.Sandbox)
		}
		if held := f.leaseNamed(t, l.Sandbox); held.Spec.HolderIdentity != nil {
			t.Errorf("%s's Lease is held while the settles are held back: %+v", l.Sandbox, held.Spec)
		}
	}

	// The heartbeat writes the hold it renews.
	f.clock.Step(10 * time.Second)
	hb, err := c.HeartbeatLease(ctx, first.AgentID, api.HeartbeatLeaseRequest{Holder: "run-1", LeaseID: first.LeaseID})
	if err != nil {
		t.Fatalf("heartbeat before the hold was written: %v", err)
	}
	if hb.LeaseID != first.LeaseID || !hb.AcquiredAt.Equal(first.AcquiredAt) || !hb.ExpiresAt.Equal(f.clock.Now().Add(time.Minute)) {
		t.Errorf("heartbeat = %+v; acquired %+v", hb, first.Lease)
	}
	if s := f.sandboxNamed(t, first.Sandbox); s.Annotations[v1alpha1.AnnotationPoolLeaseRequestID] != "req-1" {
		t.Errorf("after the heartbeat %s is not marked leased: %v", first.Sandbox, s.Annotations)
	}

	// The retried acquire is answered with the hold as written.
	again, err := c.AcquirePoolLease(ctx, "team-a", "p", api.AcquireLeaseRequest{Holder: "run-2", RequestID: "req-2", TTLSeconds: 60})
	if err != nil || again.Sandbox != second.Sandbox || again.LeaseID != second.LeaseID {
		t.Fatalf("retried acquire = %+v, %v; want %+v", again, err, second)
	}
	if l := f.leaseNamed(t, second.Sandbox); l.Annotations[v1alpha1.AnnotationLeaseID] != second.LeaseID {
		t.Errorf("the retry did not write the hold: %v", l.Annotations)
	}

	// The background settles then find nothing left to write.
	patches := f.patches.Load()
	unblock()
	f.settled()
	if n := f.patches.Load() - patches; n != 0 {
		t.Errorf("the background settles patched %d times after the lease calls had written everything", n)
	}
	// The release is final: nothing writes the hold back.
	if err := c.ReleaseLease(ctx, first.AgentID, api.ReleaseLeaseRequest{Holder: "run-1", LeaseID: first.LeaseID}); err != nil {
		t.Fatal(err)
	}
	if _, apiErr := f.services.holds.Settle(ctx, f.sandboxNamed(t, first.Sandbox), mustTake(t, f, first.Sandbox)); apiErr != nil {
		t.Fatal(apiErr)
	}
	if l := f.leaseNamed(t, first.Sandbox); l.Spec.HolderIdentity != nil {
		t.Errorf("a settle after the release held the Lease again: %+v", l.Spec)
	}
}

func mustTake(t *testing.T, f *fixture, sandbox string) store.WarmTake {
	t.Helper()
	tk, err := f.services.store.WarmTakeOf(context.Background(), string(f.sandboxNamed(t, sandbox).UID))
	if err != nil {
		t.Fatal(err)
	}
	return tk
}

// A sandbox the store gave to someone else (an adopting Sandbox, the
// pool's own scale-down) is not leased even while its annotations do not
// say so yet.
func TestPoolLeaseSkipsSandboxesTakenElsewhere(t *testing.T) {
	f := poolFixture(t, "w-old", "w-new")
	old := f.sandboxNamed(t, "w-old")
	if _, ok, err := f.services.store.TakeWarm(context.Background(), store.WarmTake{SandboxUID: string(old.UID), Namespace: "team-a",
		Pool: "p", Sandbox: "w-old", Taker: store.WarmTakenByAdoption, Holder: "new-sandbox"}); err != nil || !ok {
		t.Fatalf("adoption's take: %v, %v", ok, err)
	}
	c := f.client(t, adminToken)
	got, err := c.AcquirePoolLease(context.Background(), "team-a", "p", api.AcquireLeaseRequest{Holder: "run-1", RequestID: "req-1"})
	if err != nil || got.Sandbox != "w-new" {
		t.Fatalf("acquire = %+v, %v; want w-new", got, err)
	}
	_, err = c.AcquirePoolLease(context.Background(), "team-a", "p", api.AcquireLeaseRequest{Holder: "run-2", RequestID: "req-2"})
	wantAPIError(t, err, api.CodePoolExhausted, http.StatusServiceUnavailable)
	f.settled()
	if s := f.sandboxNamed(t, "w-old"); v1alpha1.PoolLeased(s) {
		t.Errorf("the adopted sandbox was marked leased: %v", s.Annotations)
	}
}

// The API keeps a verified connection open to every ready, free sandbox of
// a warm pool it hears of from the Sandbox informer, before any lease: the
// holder's first command then neither waits for a handshake nor makes one,
// and the claim-time warm-up is skipped. Keeping the connection open reuses
// it, and a sandbox that is no longer free is let go.
func TestWarmPoolConnectionsOpenBeforeTheLease(t *testing.T) {
	f := servedPoolFixture(t)
	f.services.conns.SetKeepAlive(100 * time.Millisecond)
	events := f.services.WarmPoolEvents()
	// A sandbox of no pool is not kept.
	loner := readySandbox("team-a", "loner", "loner", f.sup.srv.URL)
	events.OnAdd(loner, true)
	events.OnAdd(f.sandboxNamed(t, "w-1"), true)
	waitFor(t, "three health calls to the warm sandbox", func() bool { return f.sup.healthCalls.Load() >= 3 })
	if n := f.sup.handshakes.Load(); n != 1 {
		t.Errorf("%d TLS handshakes for three health calls; the kept connection should carry them all", n)
	}
	if f.services.conns.IsOpen(client.ObjectKeyFromObject(loner), time.Now()) {
		t.Error("a connection is kept for a sandbox of no warm pool")
	}

	// Held still for the lease: as the informer has not seen the lease yet.
	f.services.conns.SetKeepAlive(time.Hour)
	waitFor(t, "the keeper to pick up the longer period", func() bool {
		before := f.sup.healthCalls.Load()
		time.Sleep(300 * time.Millisecond)
		return f.sup.healthCalls.Load() == before
	})
	health := f.sup.healthCalls.Load()
	leaseAndRun(t, f)
	f.settled()
	if n := f.sup.handshakes.Load(); n != 1 {
		t.Errorf("%d TLS handshakes; the first command should have used the kept connection", n)
	}
	if n := f.sup.healthCalls.Load() - health; n != 0 {
		t.Errorf("%d health calls at the lease; with a connection kept open the claim-time warm-up should be skipped", n)
	}

	// The informer sees the lease: the sandbox is no longer kept.
	leased := f.sandboxNamed(t, "w-1")
	if !v1alpha1.PoolLeased(leased) {
		t.Fatalf("w-1 after the settle: annotations %v", leased.Annotations)
	}
	events.OnUpdate(leased, leased)
	if f.services.conns.IsOpen(client.ObjectKeyFromObject(leased), time.Now()) {
		t.Error("the connection of a leased sandbox is still kept")
	}
}

// A lease that takes a sandbox while the keeper of warm connections
// (supervisors.Conns) is still in its handshake with it neither starts a
// second warm-up nor lets the first command dial alongside: one handshake
// in all.
func TestWarmPoolConnectionInFlightAtTheLease(t *testing.T) {
	f := servedPoolFixture(t)
	f.sup.handshakeDelay.Store(int64(300 * time.Millisecond))
	f.services.WarmPoolEvents().OnAdd(f.sandboxNamed(t, "w-1"), true)
	waitFor(t, "handshake from the keeper", func() bool { return f.sup.handshakes.Load() == 1 })
	leaseAndRun(t, f)
	f.settled()
	if n := f.sup.handshakes.Load(); n != 1 {
		t.Errorf("%d TLS handshakes; the lease and its first command should have waited for the keeper's", n)
	}
	if n := f.sup.healthCalls.Load(); n != 1 {
		t.Errorf("%d health calls; the lease should not have started a warm-up of its own", n)
	}
}

// leaseAndRun leases the pool's sandbox for run-1 and runs its first
// command.
func leaseAndRun(t *testing.T, f *fixture) {
	t.Helper()
	ctx := context.Background()
	c := f.client(t, adminToken)
	l, err := c.AcquirePoolLease(ctx, "team-a", "p", api.AcquireLeaseRequest{Holder: "run-1", RequestID: "req-1"})
	if err != nil {
		t.Fatal(err)
	}
	res, err := c.RunCommand(ctx, l.AgentID, api.RunCommandRequest{Command: []string{"echo", "hi"}})
	if err != nil || res.ExitCode != 0 {
		t.Fatalf("first command: %+v, %v", res, err)
	}
}

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); !cond(); time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("no %s after 10 s", what)
		}
	}
}
