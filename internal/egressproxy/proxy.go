// Package egressproxy is the forward proxy every sandbox's traffic leaves
// through. It forwards plain HTTP requests and tunnels CONNECT, and lets a
// request out only when
//
//  1. its host is on the allowlist and not on the denylist, decided on the
//     name before anything is resolved or dialled, and
//  2. the address the name resolves to is outside the denied CIDRs (by
//     default every private, loopback, link-local and metadata range),
//     less the allowed CIDRs an operator opened in them (never loopback,
//     link-local or metadata; see Policy.AllowedCIDRs).
//
// The check in 2 and the connection use the same address: the proxy dials
// the IP it checked and never resolves the name again, so a DNS answer that
// changes between check and use (DNS rebinding) cannot reach a denied
// address.
//
// The core is net/http: httputil.ReverseProxy forwards plain HTTP (it
// already strips hop-by-hop headers, streams, and handles 1xx and protocol
// upgrades) and CONNECT is a hijacked connection joined with io.Copy. No
// proxy library is among the module's dependencies, and the policy hooks
// needed here (the dialer and the resolver) are plain net/http ones.
//
// With an upstream proxy configured (Config.Upstream), allowed requests
// leave through it instead of directly; see upstream.go for what is checked
// where. The policy can be replaced while the proxy runs (SetPolicy, and
// Reloader for files); each request uses the policy current when it
// arrived, and open tunnels are left alone.
package egressproxy

import (
	"context"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptrace"
	"net/http/httputil"
	"net/netip"
	"net/url"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/agentbox/terraform-provider-agentbox/internal/pki"
)

// Resolver looks up the addresses of a host; *net.Resolver is one. Tests
// substitute their own so no name ever reaches real DNS.
type Resolver interface {
	LookupNetIP(ctx context.Context, network, host string) ([]netip.Addr, error)
}

// DialFunc opens a connection. address is an IP and port, except for the
// connection to the configured upstream proxy, which is dialled by the name
// the operator gave.
type DialFunc func(ctx context.Context, network, address string) (net.Conn, error)

// Config configures a Proxy.
type Config struct {
	// Allow lists the hosts that may be reached: exact names, "*.example.com"
	// wildcards for every subdomain, IP literals, or "*" for any host. Empty
	// allows nothing.
	Allow []string
	// Deny lists hosts refused even when Allow matches them, same syntax.
	Deny []string
	// DeniedCIDRs are the addresses no request may reach, checked after
	// resolution. Nil means DefaultDeniedCIDRs; an empty, non-nil slice
	// denies no address (for tests against a local upstream).
	DeniedCIDRs []netip.Prefix
	// Resolver defaults to net.DefaultResolver.
	Resolver Resolver
	// Dial defaults to a net.Dialer.
	Dial DialFunc
	// DialTimeout bounds resolution plus connection; default 10s.
	DialTimeout time.Duration
	// Logger receives one access-log line per request; default slog.Default().
	Logger *slog.Logger
	// Agent names the agent this proxy serves, for the access log.
	Agent string
	// Upstream, if set, is an http:// proxy that allowed requests are sent
	// through ("http://host:port", no credentials in it).
	Upstream string
	// UpstreamUser and UpstreamPassword are sent to Upstream as Basic
	// Proxy-Authorization; empty user sends none. SetUpstreamCredentials
	// replaces them later.
	UpstreamUser, UpstreamPassword string
	// ClientCredentials, if non-nil, are the user:password pairs clients
	// must send as Basic Proxy-Authorization; the user name is logged as
	// the agent. See clientauth.go.
	ClientCredentials map[string]string
	// InterceptCA, if set, issues the certificates the proxy answers an
	// intercepted CONNECT with; Credentials need it. See credentials.go.
	InterceptCA *pki.CA
	// DestinationRoots verify the destinations of intercepted connections;
	// nil means the system roots.
	DestinationRoots *x509.CertPool
	// Credentials are added to requests bound for their hosts;
	// SetCredentials replaces them later.
	Credentials []Credential
}

// Proxy is an http.Handler serving forward-proxy requests.
type Proxy struct {
	// policy is swapped whole by SetPolicy, so a request never sees half
	// of an old policy and half of a new one.
	policy      atomic.Pointer[policy]
	agent       string
	metrics     *metrics
	upstream    *url.URL                    // nil: connect directly
	upAuth      atomic.Pointer[string]      // the Proxy-Authorization value, nil for none
	clientAuth  atomic.Pointer[clientCreds] // nil: clients need no credentials
	resolver    Resolver
	dial        DialFunc
	dialTimeout time.Duration
	log         *slog.Logger
	forward     *httputil.ReverseProxy
	transport   *http.Transport
	// Credential injection (credentials.go, intercept.go).
	creds              atomic.Pointer[credentialSet]
	leaves             *leafCache // nil: no interception CA
	interceptFwd       *httputil.ReverseProxy
	interceptTransport *http.Transport
}

// New checks cfg and returns a Proxy.
func New(cfg Config) (*Proxy, error) {
	pol, err := compilePolicy(Policy{Allow: cfg.Allow, Deny: cfg.Deny, DeniedCIDRs: cfg.DeniedCIDRs})
	if err != nil {
		return nil, err
	}
	p := &Proxy{
		agent:       cfg.Agent,
		metrics:     newMetrics(),
		resolver:    cfg.Resolver,
		dial:        cfg.Dial,
		dialTimeout: cfg.DialTimeout,
		log:         cfg.Logger,
	}
	p.policy.Store(pol)
	p.SetClientCredentials(cfg.ClientCredentials)
	if cfg.Upstream != "" {
		if p.upstream, err = parseUpstream(cfg.Upstream); err != nil {
			return nil, err
		}
		p.SetUpstreamCredentials(cfg.UpstreamUser, cfg.UpstreamPassword)
	}
	p.fillDefaults()
	p.transport = p.newDirectTransport()
	p.forward = p.newForwarder()
	if cfg.InterceptCA != nil {
		p.leaves = newLeafCache(cfg.InterceptCA)
	}
	p.interceptFwd = p.newInterceptForwarder(cfg.DestinationRoots)
	if err := p.SetCredentials(cfg.Credentials); err != nil {
		return nil, err
	}
	return p, nil
}

// fillDefaults sets what Config left zero.
func (p *Proxy) fillDefaults() {
	if p.resolver == nil {
		p.resolver = net.DefaultResolver
	}
	if p.dial == nil {
		p.dial = (&net.Dialer{KeepAlive: 30 * time.Second}).DialContext
	}
	if p.dialTimeout <= 0 {
		p.dialTimeout = 10 * time.Second
	}
	if p.log == nil {
		p.log = slog.Default()
	}
}

// newDirectTransport is the transport to origins, dialling through the
// denied-CIDR check.
func (p *Proxy) newDirectTransport() *http.Transport {
	return &http.Transport{
		// Proxy stays nil: honouring HTTP_PROXY from this process's
		// environment would send traffic around the policy. Chaining is
		// configured explicitly (Config.Upstream) and uses
		// newUpstreamTransport instead.
		Proxy:       nil,
		DialContext: p.dialChecked,
		// Bodies pass through as the origin sent them.
		DisableCompression: true,
		MaxIdleConns:       100,
		// As many per host as in all: sandboxes often call one API host
		// from many connections at once, and a lower cap closes the
		// surplus after every response and dials again for the next
		// (seen in squid_bench_test.go's profile at 16 clients).
		MaxIdleConnsPerHost: 100,
		IdleConnTimeout:     90 * time.Second,
	}
}

// newForwarder is the reverse proxy plain HTTP requests go through, to the
// origin or to the upstream proxy when one is configured.
func (p *Proxy) newForwarder() *httputil.ReverseProxy {
	transport := http.RoundTripper(p.transport)
	if p.upstream != nil {
		transport = p.newUpstreamTransport()
	}
	return &httputil.ReverseProxy{
		Rewrite: func(pr *httputil.ProxyRequest) {
			// Out.URL is already the absolute URL the policy checked. The
			// Host header is taken from it, so that a different Host
			// cannot pick a virtual host the policy never saw (RFC 9112,
			// 3.2.2).
			pr.Out.Host = ""
			// The client's own Proxy-Authorization is hop-by-hop and
			// already gone from Out; only the upstream's is added.
			if p.upstream != nil {
				if a := p.upAuth.Load(); a != nil {
					pr.Out.Header.Set("Proxy-Authorization", *a)
				}
			}
			p.injectCredential(pr.In, pr.Out)
		},
		ModifyResponse: p.checkUpstreamResponse,
		// Without a pool ReverseProxy allocates a fresh 32 KiB copy
		// buffer for every response, which was most of the proxy's
		// garbage with small responses.
		BufferPool: copyBuffers,
		Transport:  transport,
		// Streams without a length (chunked) and server-sent events are
		// flushed on every write anyway (ReverseProxy does that for
		// them). Anything else is flushed at most 5ms after it arrives,
		// so a slow body never waits for a buffer to fill. Not -1: that
		// starts a timer goroutine per request which flushes the headers
		// on their own, so even a small response took two writes
		// (measured in squid_bench_test.go).
		FlushInterval: 5 * time.Millisecond,
		ErrorHandler:  p.forwardError,
		ErrorLog:      slog.NewLogLogger(p.log.Handler(), slog.LevelWarn),
	}
}

// Close drops idle upstream connections.
func (p *Proxy) Close() {
	p.transport.CloseIdleConnections()
	if t, ok := p.forward.Transport.(*http.Transport); ok {
		t.CloseIdleConnections()
	}
	p.interceptTransport.CloseIdleConnections()
}

// SetPolicy replaces the allowlist, denylist and denied CIDRs for requests
// that arrive from now on. An invalid policy is refused and the old one
// stays. Requests in flight and open tunnels keep the policy they started
// with.
func (p *Proxy) SetPolicy(pol Policy) error {
	c, err := compilePolicy(pol)
	if err != nil {
		return err
	}
	p.policy.Store(c)
	// A pooled keep-alive connection was checked against the old denied
	// CIDRs; dropping idle ones makes the next request dial, and so check,
	// again. Busy connections finish their current request first.
	p.Close()
	return nil
}

// CurrentPolicy returns the policy new requests are checked against.
func (p *Proxy) CurrentPolicy() Policy { return p.policy.Load().src }

type policyKey struct{}

// policyFor returns the policy a request started with; the transport's
// dialer finds it in the request's context.
func (p *Proxy) policyFor(ctx context.Context) *policy {
	if pol, ok := ctx.Value(policyKey{}).(*policy); ok {
		return pol
	}
	return p.policy.Load()
}

// entry collects what the access log reports about one request.
type entry struct {
	mu       sync.Mutex
	decision string // allow, deny or error
	reason   string
	upstream string // the IP and port actually connected to
	bytesIn  int64  // client to upstream
	bytesOut int64  // upstream to client
	status   int
	// credential names the credential added to the request, if any.
	credential string
	// intercepted marks a CONNECT whose TLS the proxy terminated, and the
	// requests read from it.
	intercepted bool
}

func (e *entry) set(decision, reason string) {
	e.mu.Lock()
	e.decision, e.reason = decision, reason
	e.mu.Unlock()
}

func (e *entry) setUpstream(a string) {
	e.mu.Lock()
	e.upstream = a
	e.mu.Unlock()
}

type entryKey struct{}

func (p *Proxy) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	start := time.Now()
	e := &entry{}
	cw := &countingWriter{ResponseWriter: w}
	pol := p.policy.Load()
	ctx := context.WithValue(r.Context(), entryKey{}, e)
	ctx = context.WithValue(ctx, credsKey{}, p.creds.Load())
	r = r.WithContext(context.WithValue(ctx, policyKey{}, pol))

	agent := p.agent
	isProxy := r.Method == http.MethodConnect || r.URL.IsAbs()
	user, authed := "", true
	if isProxy {
		user, authed = p.authenticate(r)
	}
	if user != "" {
		agent = user
	}
	var host, port string
	switch {
	case !authed:
		host, port = normalizeHost(r.URL.Hostname()), r.URL.Port()
		if r.Method == http.MethodConnect {
			if h, pt, err := net.SplitHostPort(r.Host); err == nil {
				host, port = normalizeHost(h), pt
			}
		}
		askForAuth(cw, e)
	case r.Method == http.MethodConnect:
		host, port = p.serveConnect(cw, r, e, agent)
	case r.URL.IsAbs():
		host, port = p.serveForward(cw, r, e)
	case r.URL.Path == "/healthz" && (r.Method == http.MethodGet || r.Method == http.MethodHead):
		// Kubelet probes the proxy port directly; not an access.
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		io.WriteString(w, "ok\n")
		return
	default:
		e.set("deny", ReasonBadRequest)
		http.Error(cw, "agentbox egress proxy: not a proxy request (use an absolute URL or CONNECT)", http.StatusBadRequest)
	}
	p.logAccess(r, agent, host, port, e, cw, start)
}

// logAccess writes the access-log line for a request and counts it.
func (p *Proxy) logAccess(r *http.Request, agent, host, port string, e *entry, cw *countingWriter, start time.Time) {
	e.mu.Lock()
	defer e.mu.Unlock()
	status := e.status
	if status == 0 {
		status = cw.status
	}
	bytesOut := e.bytesOut
	if r.Method != http.MethodConnect {
		bytesOut = cw.bytes
	}
	level := slog.LevelInfo
	if e.decision != "allow" {
		level = slog.LevelWarn
	}
	duration := time.Since(start)
	p.metrics.observe(r.Method, e.decision, e.reason, e.bytesIn, bytesOut, duration)
	via := ""
	if p.upstream != nil && e.decision == "allow" {
		via = p.upstream.Host
	}
	// Request headers are never logged: Proxy-Authorization from the
	// client and the upstream's credentials must not reach the log.
	p.log.LogAttrs(r.Context(), level, "egress",
		slog.String("agent", agent),
		slog.String("method", r.Method),
		slog.String("host", host),
		slog.String("port", port),
		slog.String("decision", e.decision),
		slog.String("reason", e.reason),
		slog.Int("status", status),
		slog.Int64("bytes_in", e.bytesIn),
		slog.Int64("bytes_out", bytesOut),
		slog.Float64("duration_ms", float64(duration.Microseconds())/1000),
		slog.String("upstream", e.upstream),
		slog.String("via", via),
		slog.String("client", r.RemoteAddr),
		slog.String("credential", e.credential),
		slog.Bool("intercepted", e.intercepted),
	)
}

// deny answers 403 with the reason in a header so that a client's logs show
// why without access to the proxy's.
func deny(w http.ResponseWriter, e *entry, d *DeniedError) {
	e.set("deny", d.Reason)
	w.Header().Set("X-Agentbox-Egress-Denied", d.Reason)
	http.Error(w, "agentbox egress proxy: "+d.Error(), http.StatusForbidden)
}

func (p *Proxy) serveForward(w http.ResponseWriter, r *http.Request, e *entry) (host, port string) {
	host, port = normalizeHost(r.URL.Hostname()), r.URL.Port()
	if r.URL.Scheme != "http" {
		// An https:// URL here would mean the proxy makes the TLS
		// connection and sees the plaintext; clients use CONNECT for it.
		e.set("deny", ReasonBadRequest)
		http.Error(w, "agentbox egress proxy: only http:// URLs are forwarded; use CONNECT for "+r.URL.Scheme, http.StatusBadRequest)
		return host, port
	}
	if port == "" {
		port = "80"
	}
	p.forwardChecked(w, r, e, host, p.forward)
	return host, port
}

// forwardChecked applies the policy to host and, if it passes, forwards r
// through fwd.
func (p *Proxy) forwardChecked(w http.ResponseWriter, r *http.Request, e *entry, host string, fwd *httputil.ReverseProxy) {
	pol := p.policyFor(r.Context())
	if d := pol.checkHost(host); d != nil {
		deny(w, e, d)
		return
	}
	if p.upstream != nil {
		// The transport dials the upstream proxy, not the target, so the
		// address check happens here instead of in dialChecked.
		if _, err := p.resolveChecked(r.Context(), pol, host); err != nil {
			p.forwardError(w, r, err)
			return
		}
	}
	if r.Body != nil && r.Body != http.NoBody {
		r.Body = &countingBody{ReadCloser: r.Body, n: &e.bytesIn, mu: &e.mu}
	}
	trace := &httptrace.ClientTrace{
		GotConn: func(info httptrace.GotConnInfo) { e.setUpstream(info.Conn.RemoteAddr().String()) },
	}
	r = r.WithContext(httptrace.WithClientTrace(r.Context(), trace))
	e.set("allow", "")
	fwd.ServeHTTP(w, r)
}

func (p *Proxy) forwardError(w http.ResponseWriter, r *http.Request, err error) {
	e, _ := r.Context().Value(entryKey{}).(*entry)
	if d, ok := isDenied(err); ok {
		deny(w, e, d)
		return
	}
	reason := ReasonDialError
	var dnsErr *net.DNSError
	var upErr *UpstreamError
	switch {
	case errors.As(err, &dnsErr):
		reason = ReasonResolveError
	case errors.As(err, &upErr):
		reason = upErr.reason()
	case upstreamTLSError(err):
		reason = ReasonUpstreamTLS
	}
	if errors.Is(err, context.Canceled) {
		// The client went away; there is no one to answer.
		e.set("error", "client_gone")
		w.WriteHeader(499)
		return
	}
	e.set("error", reason)
	http.Error(w, "agentbox egress proxy: upstream: "+err.Error(), http.StatusBadGateway)
}

func (p *Proxy) serveConnect(w http.ResponseWriter, r *http.Request, e *entry, agent string) (host, port string) {
	h, port, err := net.SplitHostPort(r.Host)
	if err != nil || port == "" {
		e.set("deny", ReasonBadRequest)
		http.Error(w, "agentbox egress proxy: CONNECT needs host:port", http.StatusBadRequest)
		return r.Host, ""
	}
	host = normalizeHost(h)
	if d := p.policyFor(r.Context()).checkHost(host); d != nil {
		deny(w, e, d)
		return host, port
	}
	if p.leaves != nil && p.credentialsFor(r).lookup(host) != nil {
		p.serveIntercepted(w, r, e, agent, host, port)
		return host, port
	}
	var upstream net.Conn
	var fromUpstream io.Reader
	if p.upstream != nil {
		upstream, fromUpstream, err = p.connectViaUpstream(r.Context(), host, port)
	} else {
		upstream, err = p.dialChecked(r.Context(), "tcp", net.JoinHostPort(host, port))
		fromUpstream = upstream
	}
	if err != nil {
		p.forwardError(w, r, err)
		return host, port
	}
	defer upstream.Close()
	e.setUpstream(upstream.RemoteAddr().String())

	client, buf, err := http.NewResponseController(w).Hijack()
	if err != nil {
		e.set("error", "hijack")
		http.Error(w, "agentbox egress proxy: cannot tunnel on this connection", http.StatusInternalServerError)
		return host, port
	}
	defer client.Close()
	e.set("allow", "")
	e.mu.Lock()
	e.status = http.StatusOK
	e.mu.Unlock()
	if _, err := io.WriteString(client, "HTTP/1.1 200 Connection established\r\n\r\n"); err != nil {
		e.set("error", "client_gone")
		return host, port
	}

	// The client may have sent bytes (a TLS ClientHello) right behind the
	// CONNECT line; they sit in buf and go first.
	var fromClient io.Reader = client
	if n := buf.Reader.Buffered(); n > 0 {
		fromClient = io.MultiReader(io.LimitReader(buf.Reader, int64(n)), client)
	}
	p.metrics.tunnels.Inc()
	defer p.metrics.tunnels.Dec()
	var wg sync.WaitGroup
	var up, down int64
	wg.Add(1)
	go func() {
		defer wg.Done()
		down = pipe(client, fromUpstream, upstream)
	}()
	up = pipe(upstream, fromClient, client)
	wg.Wait()
	e.mu.Lock()
	e.bytesIn, e.bytesOut = up, down
	e.mu.Unlock()
	return host, port
}

// pipe copies src to dst. At EOF it half-closes dst so the other side sees
// the end while replies still flow back (TLS close_notify, HTTP/1.0); on an
// error it closes both connections, which ends the other direction too.
func pipe(dst net.Conn, src io.Reader, srcConn net.Conn) int64 {
	n, err := io.Copy(dst, src)
	if err != nil {
		dst.Close()
		srcConn.Close()
		return n
	}
	if cw, ok := dst.(interface{ CloseWrite() error }); ok {
		cw.CloseWrite()
	} else {
		dst.Close()
	}
	return n
}

// dialChecked resolves host once, drops addresses in denied ranges and
// dials what remains by IP. It is also the direct transport's dialer, so no
// connection of this proxy is ever made to an unchecked address.
func (p *Proxy) dialChecked(ctx context.Context, network, address string) (net.Conn, error) {
	h, portStr, err := net.SplitHostPort(address)
	if err != nil {
		return nil, err
	}
	host := normalizeHost(h)
	pol := p.policyFor(ctx)
	port, err := strconv.ParseUint(portStr, 10, 16)
	if err != nil {
		return nil, fmt.Errorf("port %q: %w", portStr, err)
	}
	ctx, cancel := context.WithTimeout(ctx, p.dialTimeout)
	defer cancel()
	allowed, err := p.resolveChecked(ctx, pol, host)
	if err != nil {
		return nil, err
	}
	var errs []error
	for _, a := range allowed {
		c, err := p.dial(ctx, network, netip.AddrPortFrom(a, uint16(port)).String())
		if err == nil {
			return c, nil
		}
		errs = append(errs, err)
		if ctx.Err() != nil {
			break
		}
	}
	return nil, errors.Join(errs...)
}

// resolveChecked applies the name rules, resolves host once (an IP literal
// is not resolved) and returns its addresses outside the denied ranges, or
// a DeniedError when none is left.
func (p *Proxy) resolveChecked(ctx context.Context, pol *policy, host string) ([]netip.Addr, error) {
	// Checked again here because the transport dials on its own; a
	// request that got this far has normally passed it already.
	if d := pol.checkHost(host); d != nil {
		return nil, d
	}
	ctx, cancel := context.WithTimeout(ctx, p.dialTimeout)
	defer cancel()
	var addrs []netip.Addr
	if a, err := netip.ParseAddr(host); err == nil {
		addrs = []netip.Addr{a}
	} else {
		addrs, err = p.resolver.LookupNetIP(ctx, "ip", host)
		if err != nil {
			return nil, fmt.Errorf("resolve %s: %w", host, err)
		}
	}
	var allowed []netip.Addr
	var refused []string
	for _, a := range addrs {
		a = a.Unmap()
		if pr, bad := pol.deniedAddr(a); bad {
			refused = append(refused, a.String()+" in "+pr.String())
			continue
		}
		allowed = append(allowed, a)
	}
	if len(allowed) == 0 {
		detail := "no addresses"
		if len(refused) > 0 {
			detail = fmt.Sprintf("resolves only to denied addresses %v", refused)
		}
		return nil, &DeniedError{Host: host, Reason: ReasonDeniedIP, Detail: detail}
	}
	if len(refused) > 0 {
		p.log.Warn("egress host resolves partly to denied addresses; using the others", "host", host, "denied", refused)
	}
	return allowed, nil
}

// copyBuffers are ReverseProxy's body copy buffers, shared by all proxies
// in the process.
var copyBuffers = &bufferPool{pool: sync.Pool{New: func() any {
	b := make([]byte, 32<<10)
	return &b
}}}

// bufferPool is an httputil.BufferPool; it keeps *[]byte so that Put
// does not allocate.
type bufferPool struct{ pool sync.Pool }

func (b *bufferPool) Get() []byte { return *b.pool.Get().(*[]byte) }

func (b *bufferPool) Put(buf []byte) {
	if cap(buf) == 32<<10 {
		buf = buf[:cap(buf)]
		b.pool.Put(&buf)
	}
}

// countingWriter records the status and body bytes sent to the client; it
// unwraps so that ReverseProxy can still flush and hijack through it.
type countingWriter struct {
	http.ResponseWriter
	status int
	bytes  int64
}

func (w *countingWriter) WriteHeader(code int) {
	if w.status == 0 && (code >= 200 || code == http.StatusSwitchingProtocols) {
		w.status = code
	}
	w.ResponseWriter.WriteHeader(code)
}

func (w *countingWriter) Write(b []byte) (int, error) {
	if w.status == 0 {
		w.status = http.StatusOK
	}
	n, err := w.ResponseWriter.Write(b)
	w.bytes += int64(n)
	return n, err
}

func (w *countingWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }

type countingBody struct {
	io.ReadCloser
	mu *sync.Mutex
	n  *int64
}

func (b *countingBody) Read(p []byte) (int, error) {
	n, err := b.ReadCloser.Read(p)
	b.mu.Lock()
	*b.n += int64(n)
	b.mu.Unlock()
	return n, err
}
