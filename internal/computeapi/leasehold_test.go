package computeapi

import (
	"context"
	"encoding/pem"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/client/interceptor"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	api "github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
)

func (f *fixture) lease(t *testing.T) *coordinationv1.Lease {
	t.Helper()
	var l coordinationv1.Lease
	if err := f.kube.Get(context.Background(), types.NamespacedName{Namespace: "team-a", Name: "sb-1"}, &l); err != nil {
		t.Fatal(err)
	}
	return &l
}

func acquire(t *testing.T, c *api.Client, holder, requestID string, ttl int) *api.Lease {
	t.Helper()
	l, err := c.AcquireLease(context.Background(), "agent-1", api.AcquireLeaseRequest{Holder: holder, RequestID: requestID, TTLSeconds: ttl})
	if err != nil {
		t.Fatalf("acquire by %s/%s: %v", holder, requestID, err)
	}
	return l
}

func TestLeaseAcquireHeartbeatRelease(t *testing.T) {
	f := newFixture(t, "")
	c := f.client(t, adminToken)
	ctx := context.Background()
	t0 := f.clock.Now()

	got := acquire(t, c, "user-a", "req-1", 30)
	if got.Holder != "user-a" || got.RequestID != "req-1" || got.TTLSeconds != 30 || len(got.LeaseID) != 32 ||
		!got.AcquiredAt.Equal(t0) || !got.RenewedAt.Equal(t0) || !got.ExpiresAt.Equal(t0.Add(30*time.Second)) {
		t.Fatalf("acquired lease = %+v", got)
	}
	l := f.lease(t)
	if ptr.Deref(l.Spec.HolderIdentity, "") != "user-a" || ptr.Deref(l.Spec.LeaseDurationSeconds, 0) != 30 ||
		!l.Spec.AcquireTime.Time.Equal(t0) || !l.Spec.RenewTime.Time.Equal(t0) ||
		l.Annotations[v1alpha1.AnnotationLeaseRequestID] != "req-1" || l.Annotations[v1alpha1.AnnotationLeaseID] != got.LeaseID {
		t.Fatalf("Lease after acquire: spec %+v annotations %v", l.Spec, l.Annotations)
	}

	// A retry of the same acquire gets the same hold back, unchanged.
	f.clock.Step(5 * time.Second)
	again := acquire(t, c, "user-a", "req-1", 30)
	if *again != *got {
		t.Errorf("re-acquire with the same request ID = %+v, want %+v", again, got)
	}

	// Anyone else, and the same holder under another request, is refused
	// with who holds it until when.
	for _, req := range []api.AcquireLeaseRequest{{Holder: "user-b", RequestID: "req-1"}, {Holder: "user-a", RequestID: "req-2"}} {
		_, err := c.AcquireLease(ctx, "agent-1", req)
		wantAPIError(t, err, api.CodeLeaseHeld, http.StatusConflict)
		if !errors.Is(err, api.ErrLeaseHeld) {
			t.Errorf("%v does not match ErrLeaseHeld", err)
		}
		holder, until, ok := api.LeaseHeldBy(err)
		if !ok || holder != "user-a" || !until.Equal(got.ExpiresAt) {
			t.Errorf("LeaseHeldBy = %q, %s, %v; want user-a until %s", holder, until, ok, got.ExpiresAt)
		}
	}

	// A heartbeat moves the expiry to TTL from now.
	f.clock.Step(20 * time.Second)
	hb, err := c.HeartbeatLease(ctx, "agent-1", api.HeartbeatLeaseRequest{Holder: "user-a", LeaseID: got.LeaseID})
	if err != nil {
		t.Fatal(err)
	}
	if want := f.clock.Now().Add(30 * time.Second); !hb.ExpiresAt.Equal(want) || hb.LeaseID != got.LeaseID || !hb.AcquiredAt.Equal(t0) {
		t.Errorf("after heartbeat: %+v, want expiry %s", hb, want)
	}
	for _, bad := range []api.HeartbeatLeaseRequest{{Holder: "user-a", LeaseID: "0123"}, {Holder: "user-b", LeaseID: got.LeaseID}} {
		_, err := c.HeartbeatLease(ctx, "agent-1", bad)
		wantAPIError(t, err, api.CodeLeaseNotHeld, http.StatusConflict)
	}
	_, err = c.AcquireLease(ctx, "agent-1", api.AcquireLeaseRequest{Holder: "user-b", RequestID: "req-9"})
	if !errors.Is(err, api.ErrLeaseHeld) {
		t.Fatalf("acquire 25s after the first, 5s after a heartbeat: %v, want lease_held", err)
	}

	// Release frees it; a repeated release is harmless; the old hold is gone.
	if err := c.ReleaseLease(ctx, "agent-1", api.ReleaseLeaseRequest{Holder: "user-b", LeaseID: got.LeaseID}); !errors.Is(err, api.ErrLeaseNotHeld) {
		t.Errorf("release by another holder: %v, want lease_not_held", err)
	}
	if err := c.ReleaseLease(ctx, "agent-1", api.ReleaseLeaseRequest{Holder: "user-a", LeaseID: got.LeaseID}); err != nil {
		t.Fatal(err)
	}
	l = f.lease(t)
	if l.Spec.HolderIdentity != nil || l.Spec.LeaseDurationSeconds != nil || l.Spec.AcquireTime != nil ||
		l.Annotations[v1alpha1.AnnotationLeaseID] != "" || l.Annotations[v1alpha1.AnnotationLeaseRequestID] != "" {
		t.Errorf("Lease after release: spec %+v annotations %v", l.Spec, l.Annotations)
	}
	if !l.Spec.RenewTime.Time.Equal(f.clock.Now()) {
		t.Errorf("renewTime after release = %s, want the release's time (it is activity)", l.Spec.RenewTime)
	}
	if err := c.ReleaseLease(ctx, "agent-1", api.ReleaseLeaseRequest{Holder: "user-a", LeaseID: got.LeaseID}); err != nil {
		t.Errorf("second release: %v", err)
	}
	if _, err := c.HeartbeatLease(ctx, "agent-1", api.HeartbeatLeaseRequest{Holder: "user-a", LeaseID: got.LeaseID}); !errors.Is(err, api.ErrLeaseNotHeld) {
		t.Errorf("heartbeat after release: %v, want lease_not_held", err)
	}
	next := acquire(t, c, "user-b", "req-9", 0)
	if next.TTLSeconds != api.DefaultLeaseTTLSeconds || next.LeaseID == got.LeaseID {
		t.Errorf("acquire after release = %+v, want a new lease with the default TTL", next)
	}
	if n := ptr.Deref(f.lease(t).Spec.LeaseTransitions, 0); n != 2 {
		t.Errorf("leaseTransitions = %d, want 2", n)
	}
}

func TestExpiredLeaseCanBeTakenOver(t *testing.T) {
	f := newFixture(t, "")
	c := f.client(t, adminToken)
	ctx := context.Background()
	old := acquire(t, c, "user-a", "req-1", 10)
	f.clock.Step(10 * time.Second)

	// The holder is too late to heartbeat...
	_, err := c.HeartbeatLease(ctx, "agent-1", api.HeartbeatLeaseRequest{Holder: "user-a", LeaseID: old.LeaseID})
	wantAPIError(t, err, api.CodeLeaseExpired, http.StatusConflict)
	// ...and a retry of its old acquire does not revive the hold: it is a
	// new hold, since the old one may already have been reclaimed.
	revived := acquire(t, c, "user-a", "req-1", 10)
	if revived.LeaseID == old.LeaseID {
		t.Errorf("an expired hold was returned as if alive: %+v", revived)
	}
	f.clock.Step(11 * time.Second)

	// Someone else takes the expired hold without waiting for the
	// controller's reclaim; the mark of an earlier reclaim goes with the
	// new hold.
	l := f.lease(t)
	l.Annotations[v1alpha1.AnnotationLeaseExpiredHolder] = "user-z"
	if err := f.kube.Update(ctx, l); err != nil {
		t.Fatal(err)
	}
	taken := acquire(t, c, "user-b", "req-7", 60)
	if h, ok := f.lease(t).Annotations[v1alpha1.AnnotationLeaseExpiredHolder]; ok {
		t.Errorf("expired-holder annotation %q survived a new acquire", h)
	}
	if taken.Holder != "user-b" || !taken.AcquiredAt.Equal(f.clock.Now()) {
		t.Errorf("takeover = %+v", taken)
	}
	for _, id := range []string{old.LeaseID, revived.LeaseID} {
		if err := c.ReleaseLease(ctx, "agent-1", api.ReleaseLeaseRequest{Holder: "user-a", LeaseID: id}); !errors.Is(err, api.ErrLeaseNotHeld) {
			t.Errorf("release of a taken-over hold: %v, want lease_not_held", err)
		}
	}
	if h := ptr.Deref(f.lease(t).Spec.HolderIdentity, ""); h != "user-b" {
		t.Errorf("holder = %q after the old holder's release attempts, want user-b", h)
	}
}

// TestConcurrentAcquireHasOneWinner relies on the fake client refusing an
// update whose resourceVersion is stale, as the API server does; the
// envtest variant below checks the same against a real API server.
func TestConcurrentAcquireHasOneWinner(t *testing.T) {
	f := newFixture(t, "")
	checkOneWinner(t, f.client(t, adminToken), func() string { return ptr.Deref(f.lease(t).Spec.HolderIdentity, "") })
}

func checkOneWinner(t *testing.T, c *api.Client, currentHolder func() string) {
	t.Helper()
	const n = 8
	var wg sync.WaitGroup
	start := make(chan struct{})
	winners := make(chan string, n)
	held := make(chan string, n)
	errs := make(chan error, n)
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			holder := fmt.Sprintf("user-%d", i)
			_, err := c.AcquireLease(context.Background(), "agent-1", api.AcquireLeaseRequest{Holder: holder, RequestID: "req"})
			if err == nil {
				winners <- holder
				return
			}
			if h, _, ok := api.LeaseHeldBy(err); ok {
				held <- h
				return
			}
			errs <- err
		}()
	}
	close(start)
	wg.Wait()
	close(winners)
	close(held)
	close(errs)
	for err := range errs {
		t.Errorf("acquire failed other than with lease_held: %v", err)
	}
	var won []string
	for w := range winners {
		won = append(won, w)
	}
	if len(won) != 1 {
		t.Fatalf("%d acquires won (%v), want exactly 1", len(won), won)
	}
	for h := range held {
		if h != won[0] {
			t.Errorf("a refused acquire was told %q holds the lease, want the winner %q", h, won[0])
		}
	}
	if h := currentHolder(); h != won[0] {
		t.Errorf("the Lease's holder is %q, want the winner %q", h, won[0])
	}
}

func TestActivityRenewalKeepsTheHolder(t *testing.T) {
	f := newFixture(t, "")
	c := f.client(t, adminToken)
	got := acquire(t, c, "user-a", "req-1", 60)
	// Within the throttle interval of the acquire's own renewal: no write.
	f.clock.Step(10 * time.Second)
	if _, err := c.RunCommand(context.Background(), "agent-1", api.RunCommandRequest{Command: []string{"true"}}); err != nil {
		t.Fatal(err)
	}
	if n := f.patches.Load(); n != 0 {
		t.Errorf("%d activity renewals 10s after an acquire, want 0", n)
	}
	f.clock.Step(30 * time.Second)
	if _, err := c.RunCommand(context.Background(), "agent-1", api.RunCommandRequest{Command: []string{"true"}}); err != nil {
		t.Fatal(err)
	}
	l := f.lease(t)
	if !l.Spec.RenewTime.Time.Equal(f.clock.Now()) {
		t.Errorf("renewTime = %s, want the activity at %s", l.Spec.RenewTime, f.clock.Now())
	}
	if ptr.Deref(l.Spec.HolderIdentity, "") != "user-a" || l.Annotations[v1alpha1.AnnotationLeaseID] != got.LeaseID ||
		ptr.Deref(l.Spec.LeaseDurationSeconds, 0) != 60 {
		t.Errorf("the activity renewal changed the hold: spec %+v annotations %v", l.Spec, l.Annotations)
	}
	if _, err := c.HeartbeatLease(context.Background(), "agent-1", api.HeartbeatLeaseRequest{Holder: "user-a", LeaseID: got.LeaseID}); err != nil {
		t.Errorf("heartbeat after activity: %v", err)
	}
}

func TestLeaseBadRequests(t *testing.T) {
	f := newFixture(t, "", readySandbox("team-a", "sb-nolease", "agent-nolease", "https://127.0.0.1:1"))
	c := f.client(t, adminToken)
	ctx := context.Background()
	for name, req := range map[string]api.AcquireLeaseRequest{
		"no holder":     {RequestID: "r"},
		"no request ID": {Holder: "h"},
		"negative TTL":  {Holder: "h", RequestID: "r", TTLSeconds: -1},
		"TTL too long":  {Holder: "h", RequestID: "r", TTLSeconds: api.MaxLeaseTTLSeconds + 1},
		"long holder":   {Holder: strings.Repeat("h", 254), RequestID: "r"},
	} {
		_, err := c.AcquireLease(ctx, "agent-1", req)
		if api.CodeOf(err) != api.CodeInvalidArgument {
			t.Errorf("%s: %v, want invalid_argument", name, err)
		}
	}
	if _, err := c.HeartbeatLease(ctx, "agent-1", api.HeartbeatLeaseRequest{Holder: "h"}); api.CodeOf(err) != api.CodeInvalidArgument {
		t.Errorf("heartbeat without lease ID: %v, want invalid_argument", err)
	}
	if acquire(t, c, "h", "r", api.MaxLeaseTTLSeconds).TTLSeconds != api.MaxLeaseTTLSeconds {
		t.Error("the maximum TTL was not kept")
	}

	_, err := c.AcquireLease(ctx, "agent-404", api.AcquireLeaseRequest{Holder: "h", RequestID: "r"})
	wantAPIError(t, err, api.CodeSandboxNotFound, http.StatusNotFound)
	_, err = c.AcquireLease(ctx, "agent-nolease", api.AcquireLeaseRequest{Holder: "h", RequestID: "r"})
	if e := wantAPIError(t, err, api.CodeSandboxNotReady, http.StatusConflict); e.Details["reason"] != "LeaseMissing" {
		t.Errorf("details = %v, want reason LeaseMissing", e.Details)
	}

	req, _ := http.NewRequest(http.MethodGet, f.api.URL+api.PathLease("agent-1"), nil)
	req.Header.Set("Authorization", "Bearer "+adminToken)
	resp, err := f.api.Client().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusMethodNotAllowed || resp.Header.Get("Allow") != "POST, DELETE" {
		t.Errorf("GET lease: %d, Allow %q", resp.StatusCode, resp.Header.Get("Allow"))
	}
}

func TestAgentMayNotLeaseAnotherAgentsSandbox(t *testing.T) {
	f := newFixture(t, "")
	srv, err := NewServer(Options{Sandboxes: f.kube, Leases: f.kube, Authenticator: agentToken{},
		Supervisors: f.services.supervisors, Clock: f.clock})
	if err != nil {
		t.Fatal(err)
	}
	ts := httptest.NewTLSServer(srv.Handler())
	defer ts.Close()
	caPEM := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: ts.Certificate().Raw})
	c, err := api.New(ts.URL, "agent-token:agent-2", caPEM)
	if err != nil {
		t.Fatal(err)
	}
	defer c.CloseIdleConnections()
	_, err = c.AcquireLease(context.Background(), "agent-1", api.AcquireLeaseRequest{Holder: "h", RequestID: "r"})
	wantAPIError(t, err, api.CodePermissionDenied, http.StatusForbidden)
	_, err = c.HeartbeatLease(context.Background(), "agent-1", api.HeartbeatLeaseRequest{Holder: "h", LeaseID: "x"})
	wantAPIError(t, err, api.CodePermissionDenied, http.StatusForbidden)
	err = c.ReleaseLease(context.Background(), "agent-1", api.ReleaseLeaseRequest{Holder: "h", LeaseID: "x"})
	wantAPIError(t, err, api.CodePermissionDenied, http.StatusForbidden)
	if h := f.lease(t).Spec.HolderIdentity; h != nil {
		t.Errorf("holder %q was written by another agent", *h)
	}
}

// A lease call reads the Lease through Leases (the manager's cache in the
// control plane) first. When that copy is behind, the write conflicts and
// the retry reads directly, so the call still succeeds.
func TestChangeLeaseStaleFirstRead(t *testing.T) {
	f := newFixture(t, "")
	ctx := context.Background()
	key := types.NamespacedName{Namespace: "team-a", Name: "sb-1"}
	var stale coordinationv1.Lease
	if err := f.kube.Get(ctx, key, &stale); err != nil {
		t.Fatal(err)
	}
	// Another writer moves the Lease on after the cached copy was taken.
	moved := stale.DeepCopy()
	moved.Annotations = map[string]string{"other-writer": "yes"}
	if err := f.kube.Update(ctx, moved); err != nil {
		t.Fatal(err)
	}
	var cacheReads, directReads atomic.Int32
	cache := interceptor.NewClient(f.kube.(client.WithWatch), interceptor.Funcs{Get: func(ctx context.Context, c client.WithWatch, k client.ObjectKey, obj client.Object, opts ...client.GetOption) error {
		if l, ok := obj.(*coordinationv1.Lease); ok && k == key {
			cacheReads.Add(1)
			stale.DeepCopyInto(l)
			return nil
		}
		return c.Get(ctx, k, obj, opts...)
	}})
	direct := interceptor.NewClient(f.kube.(client.WithWatch), interceptor.Funcs{Get: func(ctx context.Context, c client.WithWatch, k client.ObjectKey, obj client.Object, opts ...client.GetOption) error {
		directReads.Add(1)
		return c.Get(ctx, k, obj, opts...)
	}})
	s, err := NewServer(Options{Sandboxes: f.kube, Leases: cache, LeaseReader: direct, Supervisors: f.services.supervisors,
		Authenticator: f.services.auth, TrustDomain: testTrustDomain, Clock: f.clock})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	sb := f.sandboxNamed(t, "sb-1")
	v, apiErr := s.holds.Acquire(ctx, sb, api.AcquireLeaseRequest{Holder: "run-1", RequestID: "req-1", TTLSeconds: 30})
	if apiErr != nil {
		t.Fatal(apiErr)
	}
	if l := f.leaseNamed(t, "sb-1"); v.Holder != "run-1" || ptr.Deref(l.Spec.HolderIdentity, "") != "run-1" || l.Annotations["other-writer"] != "yes" {
		t.Errorf("hold wrote %+v %v; want run-1's hold on top of the other writer's change", l.Spec, l.Annotations)
	}
	if cacheReads.Load() != 1 || directReads.Load() != 1 {
		t.Errorf("%d reads through the cache and %d direct; want 1 and 1 (the retry after the conflict)", cacheReads.Load(), directReads.Load())
	}
	if got := f.leaseNamed(t, "sb-1"); ptr.Deref(got.Spec.HolderIdentity, "") != "run-1" {
		t.Errorf("stored Lease holder %v", got.Spec.HolderIdentity)
	}
}
