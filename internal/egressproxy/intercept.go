package egressproxy

// TLS interception for destinations with a credential (see credentials.go).

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httputil"
	"net/netip"
	"net/url"
	"sync"
	"time"

	"github.com/agentbox/terraform-provider-agentbox/internal/pki"
)

const (
	// leafLifetime is how long an issued leaf is valid; leafRenewBefore
	// is how long before its end the cache issues a new one, so that a
	// long keep-alive connection never meets an expired certificate.
	leafLifetime    = 7 * 24 * time.Hour
	leafRenewBefore = 24 * time.Hour
	// leafCacheMax bounds the cache; the hosts are those with a credential,
	// so reaching it means wildcard patterns met many subdomains, and the
	// whole cache is dropped rather than tracking use.
	leafCacheMax = 1024
	// tlsHandshakeTimeout bounds the sandbox's handshake with the proxy.
	tlsHandshakeTimeout = 10 * time.Second
)

// leafCache issues and keeps a leaf certificate per destination host.
type leafCache struct {
	ca *pki.CA
	mu sync.Mutex
	m  map[string]*tls.Certificate
}

func newLeafCache(ca *pki.CA) *leafCache {
	return &leafCache{ca: ca, m: map[string]*tls.Certificate{}}
}

// get returns a leaf for host, issuing one when none is cached or the
// cached one nears its end. Issuing holds the lock: it takes well under a
// millisecond (one P-256 key and signature) and happens once per host.
func (c *leafCache) get(host string) (*tls.Certificate, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if cert, ok := c.m[host]; ok && time.Until(cert.Leaf.NotAfter) > leafRenewBefore {
		return cert, nil
	}
	opts := pki.LeafOptions{
		// The URI names what the certificate is for; no platform peer
		// accepts it as an identity of its own.
		ID:         &url.URL{Scheme: "spiffe", Host: pki.DefaultTrustDomain, Path: "/egress-intercept/" + host},
		Usage:      pki.UsageServer,
		Lifetime:   leafLifetime,
		CommonName: host,
	}
	if a, err := netip.ParseAddr(host); err == nil {
		opts.IPAddresses = []net.IP{a.AsSlice()}
	} else {
		opts.DNSNames = []string{host}
	}
	leaf, err := c.ca.Issue(opts)
	if err != nil {
		return nil, fmt.Errorf("issue certificate for %s: %w", host, err)
	}
	cert, err := leaf.TLSCertificate()
	if err != nil {
		return nil, err
	}
	cert.Leaf = leaf.Cert
	if len(c.m) >= leafCacheMax {
		clear(c.m)
	}
	c.m[host] = &cert
	return &cert, nil
}

// newInterceptForwarder is the reverse proxy for requests read from an
// intercepted tunnel: it opens its own TLS connection to the destination
// (inside a CONNECT tunnel of the upstream proxy, when one is configured)
// and verifies it against roots (nil: the system's).
func (p *Proxy) newInterceptForwarder(roots *x509.CertPool) *httputil.ReverseProxy {
	t := &http.Transport{
		Proxy:       nil, // see newDirectTransport
		DialContext: p.dialChecked,
		// MinVersion as for any client of today's APIs; ServerName
		// comes from the URL, which is the checked host.
		TLSClientConfig:     &tls.Config{RootCAs: roots, MinVersion: tls.VersionTLS12},
		TLSHandshakeTimeout: tlsHandshakeTimeout,
		ForceAttemptHTTP2:   true,
		DisableCompression:  true,
		MaxIdleConns:        100,
		MaxIdleConnsPerHost: 100,
		IdleConnTimeout:     90 * time.Second,
	}
	if p.upstream != nil {
		// The tunnel is opened by the same code as a sandbox's own
		// CONNECT, not by the transport's Proxy support: that reports an
		// upstream's 407 as a bare error string (logged as a dial error
		// rather than upstream_auth), accepts no 2xx but 200, and bounds
		// its handshake by a minute of its own, not DialTimeout. The
		// transport then speaks TLS to the destination inside the
		// tunnel, as it would over a direct connection.
		t.DialContext = func(ctx context.Context, _, address string) (net.Conn, error) {
			host, port, err := net.SplitHostPort(address)
			if err != nil {
				return nil, err
			}
			c, r, err := p.connectViaUpstream(ctx, normalizeHost(host), port)
			if err != nil {
				return nil, err
			}
			if r != io.Reader(c) {
				c = &bufferedConn{Conn: c, r: r}
			}
			return c, nil
		}
	}
	p.interceptTransport = t
	return &httputil.ReverseProxy{
		Rewrite: func(pr *httputil.ProxyRequest) {
			pr.Out.Host = "" // see newForwarder
			p.injectCredential(pr.In, pr.Out)
		},
		BufferPool:    copyBuffers,
		Transport:     t,
		FlushInterval: 5 * time.Millisecond,
		ErrorHandler:  p.forwardError,
		ErrorLog:      slog.NewLogLogger(p.log.Handler(), slog.LevelWarn),
	}
}

// serveIntercepted answers a CONNECT to host:port, which has a
// credential, by terminating the sandbox's TLS with a leaf for host and
// serving the HTTP requests inside. Each request is checked, forwarded and
// logged like a plain HTTP one, to https://host:port.
func (p *Proxy) serveIntercepted(w http.ResponseWriter, r *http.Request, e *entry, agent, host, port string) {
	// Issue (or fetch) the certificate before answering 200, so that a
	// failure is an HTTP error the client can read.
	cert, err := p.leaves.get(host)
	if err != nil {
		e.set("error", ReasonInterceptError)
		http.Error(w, "agentbox egress proxy: "+err.Error(), http.StatusInternalServerError)
		return
	}
	client, buf, err := http.NewResponseController(w).Hijack()
	if err != nil {
		e.set("error", "hijack")
		http.Error(w, "agentbox egress proxy: cannot tunnel on this connection", http.StatusInternalServerError)
		return
	}
	e.set("allow", "")
	e.mu.Lock()
	e.status = http.StatusOK
	e.intercepted = true
	e.mu.Unlock()
	if _, err := io.WriteString(client, "HTTP/1.1 200 Connection established\r\n\r\n"); err != nil {
		client.Close()
		e.set("error", "client_gone")
		return
	}
	var raw net.Conn = client
	if buf.Reader.Buffered() > 0 {
		raw = &bufferedConn{Conn: client, r: buf.Reader}
	}
	tlsConn := tls.Server(raw, &tls.Config{
		Certificates: []tls.Certificate{*cert},
		// HTTP/1.1 only towards the sandbox: every HTTP client speaks it,
		// and one request at a time keeps each under its own log line.
		NextProtos: []string{"http/1.1"},
		MinVersion: tls.VersionTLS12,
	})
	hctx, cancel := context.WithTimeout(r.Context(), tlsHandshakeTimeout)
	err = tlsConn.HandshakeContext(hctx)
	cancel()
	if err != nil {
		// Most often the sandbox does not trust the proxy's CA; say so in
		// the log, as the client only sees a failed handshake.
		tlsConn.Close()
		e.set("error", ReasonClientTLS)
		p.log.Warn("egress TLS handshake with the client failed; does the sandbox trust the proxy's CA?",
			"host", host, "agent", agent, "error", err.Error())
		return
	}
	p.metrics.tunnels.Inc()
	defer p.metrics.tunnels.Dec()

	target := host
	if port != "443" {
		target = net.JoinHostPort(host, port)
	}
	pol := p.policyFor(r.Context())
	creds := p.credentialsFor(r)
	inner := &http.Server{
		Handler: http.HandlerFunc(func(w http.ResponseWriter, ir *http.Request) {
			start := time.Now()
			ie := &entry{intercepted: true}
			cw := &countingWriter{ResponseWriter: w}
			ctx := context.WithValue(ir.Context(), entryKey{}, ie)
			ctx = context.WithValue(ctx, policyKey{}, pol)
			ctx = context.WithValue(ctx, credsKey{}, creds)
			ir = ir.WithContext(ctx)
			// Whatever the request line or Host header say, the request
			// goes to the host the CONNECT asked for and the policy
			// checked, and so does the credential.
			ir.URL.Scheme, ir.URL.Host = "https", target
			p.forwardChecked(cw, ir, ie, host, p.interceptFwd)
			p.logAccess(ir, agent, host, port, ie, cw, start)
		}),
		ReadHeaderTimeout: 10 * time.Second,
		IdleTimeout:       2 * time.Minute,
		ErrorLog:          slog.NewLogLogger(p.log.Handler(), slog.LevelWarn),
	}
	ln := newOneConnListener(tlsConn)
	inner.Serve(ln)
}

// bufferedConn reads what was already buffered before the connection: a
// TLS ClientHello the sandbox sent right behind its CONNECT, or bytes the
// upstream proxy sent right behind its answer to ours.
type bufferedConn struct {
	net.Conn
	r io.Reader
}

func (c *bufferedConn) Read(b []byte) (int, error) { return c.r.Read(b) }

// oneConnListener hands an http.Server one connection, then blocks until
// that connection is closed, so that Serve returns when the tunnel ends.
type oneConnListener struct {
	conn   net.Conn
	once   sync.Once
	closed chan struct{}
	given  bool
}

func newOneConnListener(c net.Conn) *oneConnListener {
	l := &oneConnListener{closed: make(chan struct{})}
	l.conn = &closeNotifyConn{Conn: c, l: l}
	return l
}

func (l *oneConnListener) Accept() (net.Conn, error) {
	if !l.given {
		l.given = true
		return l.conn, nil
	}
	<-l.closed
	return nil, net.ErrClosed
}

func (l *oneConnListener) Close() error {
	l.once.Do(func() { close(l.closed) })
	return nil
}

func (l *oneConnListener) Addr() net.Addr { return l.conn.LocalAddr() }

type closeNotifyConn struct {
	net.Conn
	l *oneConnListener
}

func (c *closeNotifyConn) Close() error {
	err := c.Conn.Close()
	c.l.Close()
	return err
}

// upstreamTLSError reports whether err is the destination's certificate
// failing verification.
func upstreamTLSError(err error) bool {
	var verr *tls.CertificateVerificationError
	var uerr x509.UnknownAuthorityError
	var herr x509.HostnameError
	var cerr x509.CertificateInvalidError
	return errors.As(err, &verr) || errors.As(err, &uerr) || errors.As(err, &herr) || errors.As(err, &cerr)
}
