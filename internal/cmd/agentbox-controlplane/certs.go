package main

import (
	"crypto/tls"
	"fmt"
	"sync"
	"time"

	"github.com/agentbox/terraform-provider-agentbox/internal/pki"
)

// renewingCert is a leaf certificate issued by the platform CA in this
// process and re-issued once two thirds of its lifetime have passed. The
// control plane runs for months, longer than its certificates live, and
// holds the CA key anyway, so it renews them itself instead of needing a
// restart.
type renewingCert struct {
	ca   *pki.CA
	opts pki.LeafOptions
	now  func() time.Time

	mu      sync.Mutex
	cert    *tls.Certificate
	renewAt time.Time
}

func newRenewingCert(ca *pki.CA, opts pki.LeafOptions) (*renewingCert, error) {
	r := &renewingCert{ca: ca, opts: opts, now: time.Now}
	if _, err := r.get(); err != nil {
		return nil, err
	}
	return r, nil
}

// get returns the current certificate, re-issuing it when due. If
// re-issuing fails, the old certificate is returned while it is still
// valid, so a transient failure does not break handshakes.
func (r *renewingCert) get() (*tls.Certificate, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	now := r.now()
	if r.cert != nil && now.Before(r.renewAt) {
		return r.cert, nil
	}
	leaf, err := r.ca.Issue(r.opts)
	if err == nil {
		var c tls.Certificate
		if c, err = leaf.TLSCertificate(); err == nil {
			c.Leaf = leaf.Cert
			r.cert = &c
			r.renewAt = leaf.Cert.NotBefore.Add(leaf.Cert.NotAfter.Sub(leaf.Cert.NotBefore) * 2 / 3)
			return r.cert, nil
		}
	}
	if r.cert != nil && now.Before(r.cert.Leaf.NotAfter) {
		return r.cert, nil
	}
	return nil, fmt.Errorf("issue certificate for %s: %w", r.opts.ID, err)
}

func (r *renewingCert) getClient() (*tls.Certificate, error) { return r.get() }

func (r *renewingCert) getServing(*tls.ClientHelloInfo) (*tls.Certificate, error) { return r.get() }
