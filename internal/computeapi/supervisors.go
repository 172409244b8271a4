package computeapi

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	"github.com/agentbox/terraform-provider-agentbox/internal/pki"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"
	"sigs.k8s.io/controller-runtime/pkg/client"
)

// SupervisorDialer returns a client for the supervisor at endpoint that
// accepts only a server proving identity id (a SPIFFE ID).
type SupervisorDialer interface {
	Supervisor(endpoint, id string) (*supervisorapi.Client, error)
}

// SupervisorDialerFunc adapts a function to SupervisorDialer.
type SupervisorDialerFunc func(endpoint, id string) (*supervisorapi.Client, error)

// Supervisor calls f.
func (f SupervisorDialerFunc) Supervisor(endpoint, id string) (*supervisorapi.Client, error) {
	return f(endpoint, id)
}

// supervisorPoolIdle is how long an unused entry stays in a SupervisorPool.
// Sandboxes come and go (and their pod IPs are reused), so entries must not
// accumulate; an hour matches the default idle timeout after which a
// sandbox is stopped anyway.
const supervisorPoolIdle = time.Hour

// SupervisorPool is the SupervisorDialer of the control plane. The Server
// it is given to keeps the records its supervisors return with their
// answers (see supervisoraudit.go), also those of calls the controller
// makes through it; one Server per pool. It keeps one
// HTTP transport per (endpoint, identity), so consecutive calls to a
// sandbox reuse a verified connection instead of paying a TLS handshake
// each time. The identity is part of the key because a pod IP can be reused
// by another sandbox: a connection verified for one sandbox must never
// carry another's calls.
type SupervisorPool struct {
	clientCert func() (*tls.Certificate, error)
	roots      *x509.CertPool

	mu        sync.Mutex
	entries   map[poolKey]*poolEntry
	lastSweep time.Time
	now       func() time.Time

	// audit receives the records the supervisors return with their
	// answers; nil drops them.
	audit atomic.Pointer[supervisorAuditSink]
}

type poolKey struct{ endpoint, id string }

type poolEntry struct {
	client   *supervisorapi.Client
	lastUsed time.Time
}

// NewSupervisorPool returns a pool that presents the certificate
// clientCert returns (the control plane's) and verifies supervisors against
// roots (the platform CA). clientCert is asked on every handshake, so a
// certificate renewed in the meantime is used without a restart.
func NewSupervisorPool(clientCert func() (*tls.Certificate, error), roots *x509.CertPool) (*SupervisorPool, error) {
	if clientCert == nil {
		return nil, errors.New("supervisor pool: no client certificate")
	}
	if roots == nil {
		return nil, errors.New("supervisor pool: no CA")
	}
	return &SupervisorPool{clientCert: clientCert, roots: roots, entries: map[poolKey]*poolEntry{}, now: time.Now}, nil
}

// StaticCertificate returns a certificate source for NewSupervisorPool
// that never changes.
func StaticCertificate(cert tls.Certificate) func() (*tls.Certificate, error) {
	return func() (*tls.Certificate, error) { return &cert, nil }
}

// Supervisor implements SupervisorDialer.
func (p *SupervisorPool) Supervisor(endpoint, id string) (*supervisorapi.Client, error) {
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
func (p *SupervisorPool) auditTransport(base http.RoundTripper, id string) http.RoundTripper {
	return &supervisorapi.AuditTransport{
		Base: base,
		Record: func(req *http.Request, rec supervisorapi.AuditRecord, raw []byte) {
			if sink := p.audit.Load(); sink != nil {
				sink.record(req.Context(), id, rec, raw)
			}
		},
		Invalid: func(req *http.Request, err error) {
			if sink := p.audit.Load(); sink != nil {
				sink.invalid(req.Context(), id, err)
			}
		},
		RequestID: func(ctx context.Context) string {
			id, _ := ctx.Value(requestIDKey{}).(string)
			return id
		},
	}
}

// sweepLocked drops entries unused for supervisorPoolIdle. It runs at most
// once a minute so lookups stay cheap.
func (p *SupervisorPool) sweepLocked(now time.Time) {
	if now.Sub(p.lastSweep) < time.Minute {
		return
	}
	p.lastSweep = now
	for k, e := range p.entries {
		if now.Sub(e.lastUsed) > supervisorPoolIdle {
			e.client.HTTPClient.CloseIdleConnections()
			delete(p.entries, k)
		}
	}
}

// Close closes every idle connection; calls in flight finish normally.
func (p *SupervisorPool) Close() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for k, e := range p.entries {
		e.client.HTTPClient.CloseIdleConnections()
		delete(p.entries, k)
	}
}

var _ SupervisorDialer = (*SupervisorPool)(nil)

// dialSupervisor returns the client of sb's supervisor, which must prove
// the identity of the workload named in sb's status. Only the controller
// writes status (clients have no RBAC on it), so the name can be trusted
// as the identity to verify.
func (s *Server) dialSupervisor(sb *v1alpha1.Sandbox) (*supervisorapi.Client, error) {
	return s.supervisors.Supervisor(sb.Status.ServiceEndpoint, pki.SandboxID(s.trustDomain, sb.Namespace, sb.WorkloadName()).String())
}

// warmConnectionTimeout bounds warmConnection: a handshake takes tens of
// milliseconds, and one that takes longer is left to the first call.
const warmConnectionTimeout = 5 * time.Second

// maxWarmConnections bounds the warm-ups in flight. In a burst of claims,
// handshakes for all of them at once competed with the lease writes for
// the control plane's CPU and halved the claims per second (106/s to 51/s
// in make bench on 2 cores); past the bound, a claim leaves the handshake
// to its first call, as before.
const maxWarmConnections = 2

// warmConnection opens the verified connection to a sandbox just taken
// from a warm pool while its lease is being written, so that the holder's
// first call does not wait for a TLS handshake with a pod the control
// plane has not talked to yet. It is the fallback of warmConns, which
// usually has that connection open already (and then nothing is done).
// Failing, or skipping because maxWarmConnections are in flight, only
// means the first call dials for itself.
func (s *Server) warmConnection(sb *v1alpha1.Sandbox) {
	key := client.ObjectKeyFromObject(sb)
	if sb.Status.ServiceEndpoint == "" || s.conns.isOpen(key, time.Now()) {
		return
	}
	select {
	case s.warmSlots <- struct{}{}:
	default:
		return
	}
	done := make(chan struct{})
	if _, busy := s.warming.LoadOrStore(key, done); busy {
		// warmConns is opening it right now; the first call waits for
		// that one.
		<-s.warmSlots
		return
	}
	s.background.Go(func() {
		defer func() {
			s.warming.Delete(key)
			close(done)
			<-s.warmSlots
		}()
		s.callHealth(sb)
	})
}

// awaitWarmConnection waits for a warm-up of sb's connection still in
// flight, for at most as long as the warm-up may take. The holder's first
// call usually comes while the lease's warm-up is still in its handshake;
// without waiting, the call would dial a second connection alongside, and
// the two handshakes would share the same few cores with each other.
func (s *Server) awaitWarmConnection(ctx context.Context, sb *v1alpha1.Sandbox) {
	v, ok := s.warming.Load(client.ObjectKeyFromObject(sb))
	if !ok {
		return
	}
	select {
	case <-v.(chan struct{}):
	case <-ctx.Done():
	}
}
