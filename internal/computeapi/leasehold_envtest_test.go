package computeapi

import (
	"context"
	"encoding/pem"
	"errors"
	"net/http/httptest"
	"testing"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"k8s.io/utils/clock"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/client/interceptor"
	"sigs.k8s.io/controller-runtime/pkg/envtest"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	api "github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
	"github.com/agentbox/terraform-provider-agentbox/internal/testenv"
)

// TestLeaseHoldsAgainstAPIServer runs the lease calls against a real
// kube-apiserver (envtest: etcd and apiserver on loopback, no node), whose
// resourceVersion checks are what makes one concurrent acquire win. The
// sandbox is still looked up in the fake client: only Leases matter here.
func TestLeaseHoldsAgainstAPIServer(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a kube-apiserver")
	}
	env := &envtest.Environment{BinaryAssetsDirectory: testenv.EnvtestAssets(t)}
	cfg, err := env.Start()
	if err != nil {
		t.Fatalf("start envtest: %v", err)
	}
	t.Cleanup(func() { _ = env.Stop() })
	scheme := runtime.NewScheme()
	if err := clientgoscheme.AddToScheme(scheme); err != nil {
		t.Fatal(err)
	}
	kube, err := client.NewWithWatch(cfg, client.Options{Scheme: scheme})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	if err := kube.Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "team-a"}}); err != nil {
		t.Fatal(err)
	}
	if err := kube.Create(ctx, lease("team-a", "sb-1", time.Now().Add(-time.Hour))); err != nil {
		t.Fatal(err)
	}
	getLease := func() *coordinationv1.Lease {
		var l coordinationv1.Lease
		if err := kube.Get(ctx, types.NamespacedName{Namespace: "team-a", Name: "sb-1"}, &l); err != nil {
			t.Fatal(err)
		}
		return &l
	}

	f := newFixture(t, "")
	auth, err := NewAdminTokenAuthenticator(HashToken(adminToken))
	if err != nil {
		t.Fatal(err)
	}
	// serve starts one control-plane replica's API writing Leases through
	// leases.
	serve := func(leases client.Client) *api.Client {
		srv, err := NewServer(Options{Sandboxes: f.kube, Leases: leases, Supervisors: f.services.supervisors,
			Authenticator: auth, TrustDomain: testTrustDomain, Clock: clock.RealClock{}})
		if err != nil {
			t.Fatal(err)
		}
		ts := httptest.NewTLSServer(srv.Handler())
		t.Cleanup(ts.Close)
		c, err := api.New(ts.URL, adminToken, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: ts.Certificate().Raw}))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(c.CloseIdleConnections)
		return c
	}
	c := serve(kube)

	checkOneWinner(t, c, func() string { return ptr.Deref(getLease().Spec.HolderIdentity, "") })

	l := getLease()
	holder := *l.Spec.HolderIdentity
	id := l.Annotations[v1alpha1.AnnotationLeaseID]
	again, err := c.AcquireLease(ctx, "agent-1", api.AcquireLeaseRequest{Holder: holder, RequestID: "req"})
	if err != nil || again.LeaseID != id {
		t.Fatalf("re-acquire by the winner: %+v, %v; want lease %s", again, err, id)
	}
	// An activity renewal goes in between a heartbeat's read and write
	// only by chance; here it just must leave the hold alone.
	if _, err := c.RunCommand(ctx, "agent-1", api.RunCommandRequest{Command: []string{"true"}}); err != nil {
		t.Fatal(err)
	}
	hb, err := c.HeartbeatLease(ctx, "agent-1", api.HeartbeatLeaseRequest{Holder: holder, LeaseID: id})
	if err != nil || hb.Holder != holder {
		t.Fatalf("heartbeat: %+v, %v", hb, err)
	}
	if err := c.ReleaseLease(ctx, "agent-1", api.ReleaseLeaseRequest{Holder: holder, LeaseID: id}); err != nil {
		t.Fatal(err)
	}
	if l := getLease(); l.Spec.HolderIdentity != nil || l.Annotations[v1alpha1.AnnotationLeaseID] != "" {
		t.Errorf("Lease after release: spec %+v annotations %v", l.Spec, l.Annotations)
	}
	if _, err := c.HeartbeatLease(ctx, "agent-1", api.HeartbeatLeaseRequest{Holder: holder, LeaseID: id}); !errors.Is(err, api.ErrLeaseNotHeld) {
		t.Errorf("heartbeat after release: %v, want lease_not_held", err)
	}

	// A replica killed between its write and its answer: the claim is in
	// the Lease, the agent saw an error, and its retry of the same request
	// on another replica must get that claim back, not find it taken.
	killed := serve(interceptor.NewClient(kube, interceptor.Funcs{
		Update: func(ctx context.Context, c client.WithWatch, obj client.Object, opts ...client.UpdateOption) error {
			if err := c.Update(ctx, obj, opts...); err != nil {
				return err
			}
			return errors.New("control plane killed after its write")
		},
	}))
	claim := api.AcquireLeaseRequest{Holder: "run-9", RequestID: "req-9"}
	if _, err := killed.AcquireLease(ctx, "agent-1", claim); err == nil {
		t.Fatal("acquire through the killed replica answered")
	}
	written := getLease()
	if h := ptr.Deref(written.Spec.HolderIdentity, ""); h != "run-9" {
		t.Fatalf("holder after the killed acquire = %q; the write should have landed", h)
	}
	retried, err := c.AcquireLease(ctx, "agent-1", claim)
	if err != nil || retried.LeaseID != written.Annotations[v1alpha1.AnnotationLeaseID] || retried.Holder != "run-9" {
		t.Fatalf("retry on another replica: %+v, %v; want the lease the killed one wrote (%s)", retried, err, written.Annotations[v1alpha1.AnnotationLeaseID])
	}
	if _, err := c.AcquireLease(ctx, "agent-1", api.AcquireLeaseRequest{Holder: "run-10", RequestID: "req-10"}); !errors.Is(err, api.ErrLeaseHeld) {
		t.Errorf("another holder's acquire after the retry: %v, want lease_held", err)
	}
}
