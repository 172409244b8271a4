package egressproxy

import (
	"bufio"
	"context"
	"errors"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"strings"
	"sync"
	"testing"
)

// These tests never touch the network: names resolve through fakeResolver
// and connections go through fakeDialer, which records what would have been
// dialled. The process tests in internal/cmd/agentbox-egress-proxy cover
// real sockets, on loopback only.

type fakeResolver struct {
	mu    sync.Mutex
	names map[string][]string
	calls []string
}

func (r *fakeResolver) LookupNetIP(_ context.Context, _, host string) ([]netip.Addr, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.calls = append(r.calls, host)
	ips, ok := r.names[host]
	if !ok {
		return nil, &net.DNSError{Err: "no such host", Name: host, IsNotFound: true}
	}
	var out []netip.Addr
	for _, s := range ips {
		out = append(out, netip.MustParseAddr(s))
	}
	return out, nil
}

func (r *fakeResolver) Calls() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]string(nil), r.calls...)
}

// fakeDialer hands out in-memory connections served by serve, or fails
// when serve is nil.
type fakeDialer struct {
	mu    sync.Mutex
	calls []string
	serve func(net.Conn)
}

func (d *fakeDialer) Dial(_ context.Context, _, address string) (net.Conn, error) {
	d.mu.Lock()
	d.calls = append(d.calls, address)
	d.mu.Unlock()
	if d.serve == nil {
		return nil, errors.New("fake dialer: refused")
	}
	client, server := net.Pipe()
	go d.serve(server)
	return client, nil
}

func (d *fakeDialer) Calls() []string {
	d.mu.Lock()
	defer d.mu.Unlock()
	return append([]string(nil), d.calls...)
}

func newTestProxy(t *testing.T, cfg Config) (*Proxy, *fakeResolver, *fakeDialer) {
	t.Helper()
	res, _ := cfg.Resolver.(*fakeResolver)
	if res == nil {
		res = &fakeResolver{}
		cfg.Resolver = res
	}
	dial := &fakeDialer{}
	if cfg.Dial == nil {
		cfg.Dial = dial.Dial
	}
	cfg.Logger = slog.New(slog.NewTextHandler(io.Discard, nil))
	p, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Close)
	return p, res, dial
}

func do(p *Proxy, method, target string) *httptest.ResponseRecorder {
	r := httptest.NewRequest(method, target, nil)
	if method == http.MethodConnect {
		r.Host = target
		r.URL.Host = target
		r.RequestURI = target
	}
	w := httptest.NewRecorder()
	p.ServeHTTP(w, r)
	return w
}

func TestDeniedHostIsNeverResolvedNorDialled(t *testing.T) {
	p, res, dial := newTestProxy(t, Config{
		Allow: []string{"allowed.example", "*.corp.example"},
		Deny:  []string{"secret.corp.example"},
	})
	cases := []struct {
		method, target, reason string
	}{
		{http.MethodGet, "http://other.example/x", ReasonNotAllowed},
		{http.MethodConnect, "other.example:443", ReasonNotAllowed},
		{http.MethodGet, "http://secret.corp.example/", ReasonDenylisted},
		{http.MethodConnect, "SECRET.corp.example.:443", ReasonDenylisted},
		// The wildcard covers subdomains, not the apex.
		{http.MethodGet, "http://corp.example/", ReasonNotAllowed},
		// An IP literal is a host like any other: not listed, not allowed.
		{http.MethodGet, "http://203.0.113.9/", ReasonNotAllowed},
	}
	for _, c := range cases {
		w := do(p, c.method, c.target)
		if w.Code != http.StatusForbidden || w.Header().Get("X-Agentbox-Egress-Denied") != c.reason {
			t.Errorf("%s %s: got %d %q, want 403 %q", c.method, c.target, w.Code, w.Header().Get("X-Agentbox-Egress-Denied"), c.reason)
		}
	}
	if got := res.Calls(); len(got) != 0 {
		t.Errorf("resolver called for denied hosts: %v", got)
	}
	if got := dial.Calls(); len(got) != 0 {
		t.Errorf("dialer called for denied hosts: %v", got)
	}
}

func TestResolvedToDeniedAddressIsNeverDialled(t *testing.T) {
	res := &fakeResolver{names: map[string][]string{
		"internal.example": {"10.0.0.1"},
		"metadata.example": {"169.254.169.254"},
		"mapped.example":   {"::ffff:10.0.0.1"},
		"zero.example":     {"0.0.0.0"},
		"pods.example":     {"198.18.4.5"},
		"cgnat.example":    {"100.64.0.1"},
		"ula.example":      {"fd00:ec2::254"},
		"loop6.example":    {"::1"},
	}}
	p, _, dial := newTestProxy(t, Config{Allow: []string{"*.example", "10.0.0.1"}, Resolver: res})
	for _, target := range []string{
		"http://internal.example/", "metadata.example:80", "http://mapped.example/",
		"http://zero.example/", "pods.example:443", "http://cgnat.example/",
		"http://ula.example/", "loop6.example:443",
		// Allowed by name, denied by address, without a lookup.
		"http://10.0.0.1/",
	} {
		method := http.MethodGet
		if !strings.HasPrefix(target, "http://") {
			method = http.MethodConnect
		}
		w := do(p, method, target)
		if w.Code != http.StatusForbidden || w.Header().Get("X-Agentbox-Egress-Denied") != ReasonDeniedIP {
			t.Errorf("%s %s: got %d %q, want 403 %s", method, target, w.Code, w.Header().Get("X-Agentbox-Egress-Denied"), ReasonDeniedIP)
		}
	}
	if got := dial.Calls(); len(got) != 0 {
		t.Errorf("dialer called for denied addresses: %v", got)
	}
	for _, c := range res.Calls() {
		if c == "10.0.0.1" {
			t.Errorf("an IP literal was sent to the resolver")
		}
	}
}

// TestDialsTheCheckedAddress shows the pinning: the name is resolved once,
// the denied address among the answers is skipped, and the connection goes
// to the permitted IP (an in-memory fake, not a network).
func TestDialsTheCheckedAddress(t *testing.T) {
	res := &fakeResolver{names: map[string][]string{"mixed.example": {"10.0.0.1", "203.0.113.7"}}}
	var gotHost string
	p, _, _ := newTestProxy(t, Config{Allow: []string{"mixed.example"}, Resolver: res})
	dial := &fakeDialer{serve: func(c net.Conn) {
		defer c.Close()
		req, err := http.ReadRequest(bufio.NewReader(c))
		if err != nil {
			return
		}
		gotHost = req.Host
		io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Length: 5\r\nConnection: close\r\n\r\nhello")
	}}
	p.dial = dial.Dial

	r := httptest.NewRequest(http.MethodGet, "http://mixed.example/path", nil)
	// A Host header naming another site must not pick the virtual host.
	r.Host = "other.example"
	w := httptest.NewRecorder()
	p.ServeHTTP(w, r)
	if w.Code != http.StatusOK || w.Body.String() != "hello" {
		t.Fatalf("got %d %q, want 200 hello", w.Code, w.Body.String())
	}
	if got := dial.Calls(); len(got) != 1 || got[0] != "203.0.113.7:80" {
		t.Errorf("dialled %v, want exactly [203.0.113.7:80]", got)
	}
	if got := res.Calls(); len(got) != 1 {
		t.Errorf("resolved %v, want one lookup", got)
	}
	if gotHost != "mixed.example" {
		t.Errorf("upstream saw Host %q, want mixed.example", gotHost)
	}
}

func TestUpstreamFailureIs502(t *testing.T) {
	res := &fakeResolver{names: map[string][]string{"down.example": {"203.0.113.8"}}}
	p, _, _ := newTestProxy(t, Config{Allow: []string{"*"}, Resolver: res})
	if w := do(p, http.MethodGet, "http://down.example/"); w.Code != http.StatusBadGateway {
		t.Errorf("refused dial: got %d, want 502", w.Code)
	}
	if w := do(p, http.MethodGet, "http://nxdomain.example/"); w.Code != http.StatusBadGateway {
		t.Errorf("unknown name: got %d, want 502", w.Code)
	}
	if w := do(p, http.MethodConnect, "down.example:443"); w.Code != http.StatusBadGateway {
		t.Errorf("refused CONNECT: got %d, want 502", w.Code)
	}
}

func TestNonProxyRequests(t *testing.T) {
	p, _, dial := newTestProxy(t, Config{Allow: []string{"*"}})
	if w := do(p, http.MethodGet, "/healthz"); w.Code != http.StatusOK {
		t.Errorf("/healthz: %d", w.Code)
	}
	if w := do(p, http.MethodGet, "/other"); w.Code != http.StatusBadRequest {
		t.Errorf("origin-form request: %d, want 400", w.Code)
	}
	if w := do(p, http.MethodGet, "https://example.com/"); w.Code != http.StatusBadRequest {
		t.Errorf("https:// absolute URL: %d, want 400", w.Code)
	}
	if len(dial.Calls()) != 0 {
		t.Errorf("dialled %v", dial.Calls())
	}
}

func TestDomainList(t *testing.T) {
	l, err := newDomainList([]string{"Example.com.", "*.svc.example", "::ffff:192.0.2.1"})
	if err != nil {
		t.Fatal(err)
	}
	for host, want := range map[string]bool{
		"example.com":      true,
		"www.example.com":  false,
		"a.svc.example":    true,
		"a.b.svc.example":  true,
		"svc.example":      false,
		"evilsvc.example":  false,
		"192.0.2.1":        true,
		"notexample.com":   false,
		"example.com.evil": false,
	} {
		if got := l.match(normalizeHost(host)); got != want {
			t.Errorf("match(%q) = %v, want %v", host, got, want)
		}
	}
	for _, bad := range []string{"a.*.example", "*example.com", "*."} {
		if _, err := newDomainList([]string{bad}); err == nil {
			t.Errorf("pattern %q accepted", bad)
		}
	}
	empty, _ := newDomainList(nil)
	if !empty.empty() || empty.match("example.com") {
		t.Error("an empty list must match nothing")
	}
}

func TestDefaultDeniedCIDRs(t *testing.T) {
	p, _, _ := newTestProxy(t, Config{})
	for _, a := range []string{
		"127.0.0.1", "127.1.2.3", "10.1.2.3", "172.16.0.1", "172.31.255.255", "192.168.1.1",
		"100.64.0.1", "100.100.100.200", "169.254.169.254", "198.18.0.1", "198.19.255.255",
		"0.0.0.0", "::1", "::", "fe80::1", "fd00:ec2::254", "::ffff:127.0.0.1", "255.255.255.255",
	} {
		if _, bad := p.policy.Load().deniedAddr(netip.MustParseAddr(a)); !bad {
			t.Errorf("%s is not denied by default", a)
		}
	}
	for _, a := range []string{"203.0.113.1", "2001:db8::1", "172.32.0.1", "198.20.0.1", "100.128.0.1"} {
		if _, bad := p.policy.Load().deniedAddr(netip.MustParseAddr(a)); bad {
			t.Errorf("%s is denied by default, but is a public address", a)
		}
	}
}

func TestParseCIDRs(t *testing.T) {
	got, err := ParseCIDRs([]string{" 10.0.0.0/8", "192.0.2.7", "::ffff:10.0.0.0/104", ""})
	if err != nil {
		t.Fatal(err)
	}
	want := []string{"10.0.0.0/8", "192.0.2.7/32", "10.0.0.0/8"}
	if len(got) != len(want) {
		t.Fatalf("got %v, want %v", got, want)
	}
	for i := range want {
		if got[i].String() != want[i] {
			t.Errorf("got %v, want %v", got, want)
		}
	}
	if _, err := ParseCIDRs([]string{"10.0.0.0/33"}); err == nil {
		t.Error("bad prefix accepted")
	}
	if p, err := ParseCIDRs(nil); err != nil || p == nil || len(p) != 0 {
		t.Errorf("ParseCIDRs(nil) = %v, %v; want an empty non-nil slice (deny no address)", p, err)
	}
}
