package supervisors

import (
	"crypto/tls"
	"testing"
	"time"

	"github.com/agentbox/terraform-provider-agentbox/internal/pki"
)

func TestPoolKeysByEndpointAndIdentity(t *testing.T) {
	ca, err := pki.NewCA("test CA")
	if err != nil {
		t.Fatal(err)
	}
	p, err := NewPool(StaticCertificate(tls.Certificate{}), ca.Pool())
	if err != nil {
		t.Fatal(err)
	}
	now := time.Now()
	p.now = func() time.Time { return now }
	idA := pki.SandboxID("", "ns", "a").String()
	idB := pki.SandboxID("", "ns", "b").String()
	a1, _ := p.Supervisor("https://127.0.0.1:2", idA)
	a2, _ := p.Supervisor("https://127.0.0.1:2", idA)
	b, _ := p.Supervisor("https://127.0.0.1:2", idB)
	if a1 != a2 {
		t.Error("the same sandbox got a new client")
	}
	if a1 == b || a1.HTTPClient == b.HTTPClient {
		t.Error("a reused pod IP shares connections with the sandbox that had it before")
	}
	if _, err := p.Supervisor("https://127.0.0.1:2", "https://not-spiffe"); err == nil {
		t.Error("accepted an identity that is not a SPIFFE ID")
	}

	// Unused entries go; used ones stay.
	now = now.Add(poolIdle / 2)
	_, _ = p.Supervisor("https://127.0.0.1:2", idB)
	now = now.Add(poolIdle/2 + time.Minute)
	_, _ = p.Supervisor("https://127.0.0.1:2", idB)
	if _, ok := p.entries[poolKey{"https://127.0.0.1:2", idA}]; ok {
		t.Error("an entry unused for longer than the idle time was kept")
	}
	if len(p.entries) != 1 {
		t.Errorf("%d entries, want 1", len(p.entries))
	}
}
