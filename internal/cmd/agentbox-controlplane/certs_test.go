package main

import (
	"net"
	"testing"
	"time"

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
