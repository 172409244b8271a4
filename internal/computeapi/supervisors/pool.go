// Package supervisors keeps the Compute API's connections to sandbox
// supervisors: a pool of mutual-TLS clients, one per supervisor endpoint
// and verified identity, and connections kept warm to the ready, free
// sandboxes of warm pools so that a pool lease's first call finds one.
package supervisors

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	"github.com/agentbox/terraform-provider-agentbox/internal/pki"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"
)

// Dialer returns a client for the supervisor at endpoint that accepts
// only a server proving identity id (a SPIFFE ID).
type Dialer interface {
	Supervisor(endpoint, id string) (*supervisorapi.Client, error)
}

// DialerFunc adapts a function to Dialer.
type DialerFunc func(endpoint, id string) (*supervisorapi.Client, error)

// Supervisor calls f.
func (f DialerFunc) Supervisor(endpoint, id string) (*supervisorapi.Client, error) {
	return f(endpoint, id)
}

// poolIdle is how long an unused entry stays in a Pool. Sandboxes come and
// go (and their pod IPs are reused), so entries must not accumulate; an
// hour matches the default idle timeout after which a sandbox is stopped
// anyway.
const poolIdle = time.Hour

// Pool is the Dialer of the control plane. The API server it is given to
// keeps the records its supervisors return with their answers (see
// AuditSink), also those of calls the controller makes through it; one
// API server per pool. It keeps one HTTP transport per (endpoint,
// identity), so consecutive calls to a sandbox reuse a verified
// connection instead of paying a TLS handshake each time. The identity is
// part of the key because a pod IP can be reused by another sandbox: a
// connection verified for one sandbox must never carry another's calls.
type Pool struct {
	clientCert func() (*tls.Certificate, error)
	roots      *x509.CertPool

	mu        sync.Mutex
	entries   map[poolKey]*poolEntry
	lastSweep time.Time
	now       func() time.Time

	// audit receives the records the supervisors return with their
	// answers; nil drops them.
	audit atomic.Pointer[AuditSink]
}

type poolKey struct{ endpoint, id string }

type poolEntry struct {
	client   *supervisorapi.Client
	lastUsed time.Time
}

// AuditSink receives the records of a Pool's calls.
type AuditSink struct {
	// Record gets a record of the supervisor whose verified identity is
	// peer, with the context of the call that it answers.
	Record func(ctx context.Context, peer string, rec supervisorapi.AuditRecord, raw []byte)
	// Invalid gets a record that could not be read.
	Invalid func(ctx context.Context, peer string, err error)
}

// NewPool returns a pool that presents the certificate clientCert returns
// (the control plane's) and verifies supervisors against roots (the
// platform CA). clientCert is asked on every handshake, so a certificate
// renewed in the meantime is used without a restart.
func NewPool(clientCert func() (*tls.Certificate, error), roots *x509.CertPool) (*Pool, error) {
	if clientCert == nil {
		return nil, errors.New("supervisor pool: no client certificate")
	}
	if roots == nil {
		return nil, errors.New("supervisor pool: no CA")
	}
	return &Pool{clientCert: clientCert, roots: roots, entries: map[poolKey]*poolEntry{}, now: time.Now}, nil
}

// StaticCertificate returns a certificate source for NewPool that never
// changes.
func StaticCertificate(cert tls.Certificate) func() (*tls.Certificate, error) {
	return func() (*tls.Certificate, error) { return &cert, nil }
}

// SetAudit makes sink the receiver of the supervisors' records.
func (p *Pool) SetAudit(sink *AuditSink) { p.audit.Store(sink) }

// ClearAudit stops handing records to sink, unless another sink has
// replaced it since.
func (p *Pool) ClearAudit(sink *AuditSink) { p.audit.CompareAndSwap(sink, nil) }

// Supervisor implements Dialer.
func (p *Pool) Supervisor(endpoint, id string) (*supervisorapi.Client, error) {
	if _, err := pki.ParseID(id); err != nil {
		return nil, err
	}
	now := p.now()
	p.mu.Lock()
	defer p.mu.Unlock()
	p.sweepLocked(now)
	key := poolKey{endpoint, id}
	e := p.entries[key]
	if e == nil {
		cfg := pki.ClientTLS(tls.Certificate{}, p.roots, id)
		cfg.Certificates = nil
		cfg.GetClientCertificate = func(*tls.CertificateRequestInfo) (*tls.Certificate, error) { return p.clientCert() }
		// Resumption saves the public-key work when a connection is
		// re-established after the transport dropped an idle one; pki's
		// VerifyConnection checks resumed sessions too.
		cfg.ClientSessionCache = tls.NewLRUClientSessionCache(4)
		hc := supervisorapi.NewHTTPClient(cfg)
		hc.Transport = p.auditTransport(hc.Transport, id)
		e = &poolEntry{client: supervisorapi.NewClient(endpoint, hc)}
		p.entries[key] = e
	}
	e.lastUsed = now
	return e.client, nil
}

// auditTransport hands the records that the supervisor with identity id
// returns to the pool's audit sink, and sends it the calls' request IDs,
// which it puts in its records.
func (p *Pool) auditTransport(base http.RoundTripper, id string) http.RoundTripper {
	return &supervisorapi.AuditTransport{
		Base: base,
		Record: func(req *http.Request, rec supervisorapi.AuditRecord, raw []byte) {
			if sink := p.audit.Load(); sink != nil {
				sink.Record(req.Context(), id, rec, raw)
			}
		},
		Invalid: func(req *http.Request, err error) {
			if sink := p.audit.Load(); sink != nil {
				sink.Invalid(req.Context(), id, err)
			}
		},
		RequestID: RequestID,
	}
}

type requestIDKey struct{}

// WithRequestID gives ctx the request ID of the API call it serves, which
// the supervisor calls made in it carry to the supervisor.
func WithRequestID(ctx context.Context, id string) context.Context {
	return context.WithValue(ctx, requestIDKey{}, id)
}

// RequestID is the request ID WithRequestID put in ctx, or "".
func RequestID(ctx context.Context) string {
	id, _ := ctx.Value(requestIDKey{}).(string)
	return id
}

// sweepLocked drops entries unused for poolIdle. It runs at most once a
// minute so lookups stay cheap.
func (p *Pool) sweepLocked(now time.Time) {
	if now.Sub(p.lastSweep) < time.Minute {
		return
	}
	p.lastSweep = now
	for k, e := range p.entries {
		if now.Sub(e.lastUsed) > poolIdle {
			e.client.HTTPClient.CloseIdleConnections()
			delete(p.entries, k)
		}
	}
}

// Close closes every idle connection; calls in flight finish normally.
func (p *Pool) Close() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for k, e := range p.entries {
		e.client.HTTPClient.CloseIdleConnections()
		delete(p.entries, k)
	}
}

var _ Dialer = (*Pool)(nil)
