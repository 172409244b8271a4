package main

import (
	"context"
	"net"
	"syscall"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/client/fake"
	"sigs.k8s.io/controller-runtime/pkg/client/interceptor"

	"github.com/agentbox/terraform-provider-agentbox/internal/pki"
)

func TestRenewingCertRenewsAfterTwoThirds(t *testing.T) {
	ca, err := pki.NewCA("test CA")
	if err != nil {
		t.Fatal(err)
	}
	opts := pki.LeafOptions{ID: pki.ControlPlaneID("", "ns"), Usage: pki.UsageServer, Lifetime: 3 * time.Hour,
		DNSNames: serviceDNSNames("agentbox-api", "ns"), IPAddresses: []net.IP{net.IPv4(127, 0, 0, 1)}}
	r, err := newRenewingCert(ca, opts)
	if err != nil {
		t.Fatal(err)
	}
	first, _ := r.get()
	if err := first.Leaf.VerifyHostname("agentbox-api.ns.svc"); err != nil {
		t.Error(err)
	}
	if err := first.Leaf.VerifyHostname("127.0.0.1"); err != nil {
		t.Error(err)
	}
	now := time.Now()
	r.now = func() time.Time { return now.Add(time.Hour) }
	if c, _ := r.get(); c != first {
		t.Error("renewed after a third of the lifetime")
	}
	r.now = func() time.Time { return now.Add(2*time.Hour + time.Minute) }
	c, err := r.get()
	if err != nil {
		t.Fatal(err)
	}
	if c == first || c.Leaf.SerialNumber.Cmp(first.Leaf.SerialNumber) == 0 {
		t.Error("not renewed after two thirds of the lifetime")
	}
}

// TestServiceClusterIPsWaitsForTheAPIServer: a replica that starts while the
// API server restarts must still name the Service's ClusterIP in its
// serving certificate, so the lookup retries until the API server answers;
// a missing Service is an answer and is not retried.
func TestServiceClusterIPsWaitsForTheAPIServer(t *testing.T) {
	defer func(b, i time.Duration) { serviceLookupBound, serviceLookupInterval = b, i }(serviceLookupBound, serviceLookupInterval)
	serviceLookupBound, serviceLookupInterval = 5*time.Second, 10*time.Millisecond
	svc := &corev1.Service{ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: "agentbox-api"},
		Spec: corev1.ServiceSpec{ClusterIP: "198.19.0.7", ClusterIPs: []string{"198.19.0.7"}}}
	failures := 3
	calls := 0
	r := fake.NewClientBuilder().WithObjects(svc).WithInterceptorFuncs(interceptor.Funcs{
		Get: func(ctx context.Context, c client.WithWatch, key client.ObjectKey, obj client.Object, opts ...client.GetOption) error {
			calls++
			if calls <= failures {
				return &net.OpError{Op: "dial", Net: "tcp", Err: syscall.ECONNREFUSED}
			}
			return c.Get(ctx, key, obj, opts...)
		},
	}).Build()
	ips, err := serviceClusterIPs(context.Background(), r, "ns", "agentbox-api")
	if err != nil || len(ips) != 1 || !ips[0].Equal(net.ParseIP("198.19.0.7")) {
		t.Fatalf("after %d refused connections: %v, %v", failures, ips, err)
	}
	if calls != failures+1 {
		t.Errorf("%d lookups, want %d", calls, failures+1)
	}

	calls, failures = 0, 0
	if _, err := serviceClusterIPs(context.Background(), r, "ns", "missing"); !apierrors.IsNotFound(err) {
		t.Errorf("missing Service: %v, want not found", err)
	}
	if calls != 1 {
		t.Errorf("a missing Service was looked up %d times, want once", calls)
	}
}
