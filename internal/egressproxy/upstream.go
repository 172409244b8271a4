package egressproxy

// Chaining to an upstream proxy.
//
// The policy is this proxy's, and it is applied in full before anything is
// sent upstream: the name rules, then a local DNS lookup of the target and
// the denied-CIDR check on its answers. A request is refused when the name
// resolves here only to denied addresses, and also when it does not
// resolve here at all (fail closed: an unchecked name is never passed on).
//
// What the upstream receives is the target's name, not the address checked
// here. Upstream proxies usually enforce name-based rules of their own and
// log names, and sending them an IP would bypass both. The cost is that the
// upstream resolves the name again and may get another answer: the
// pinning described in the package comment does not extend past this hop.
// That is acceptable because the connection this proxy makes is to the
// upstream only, so the cluster and node ranges the denied CIDRs protect
// are not reached through this process's network; what the upstream can
// reach from its own network is the upstream's policy to decide. An IP
// literal target is checked and passed on as the same literal, so it is
// pinned end to end.
//
// A destination with a credential (credentials.go) is reached the same
// way: the proxy's own TLS connection to it runs inside a CONNECT tunnel
// opened by connectViaUpstream, so the upstream sees a CONNECT to the
// destination's name and never the plaintext or the credential.
//
// The upstream proxy's own address is not checked against the denied
// CIDRs: the operator configured it, and it usually lives in a private
// range.
//
// Credentials: the sandbox's own Proxy-Authorization is never passed on
// (it is a hop-by-hop header, dropped for plain HTTP and never copied into
// the CONNECT this proxy writes), and the upstream's credentials are added
// only on the way out. Neither is ever logged, and an upstream 407 becomes
// a 502 so the client is not asked for credentials it must not have.

import (
	"bufio"
	"context"
	"encoding/base64"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"strings"
	"time"
)

// UpstreamError is the upstream proxy answering a request with a refusal.
type UpstreamError struct {
	Status int
}

func (e *UpstreamError) Error() string {
	return fmt.Sprintf("upstream proxy answered %d %s", e.Status, http.StatusText(e.Status))
}

func (e *UpstreamError) reason() string {
	if e.Status == http.StatusProxyAuthRequired {
		return ReasonUpstreamAuth
	}
	return ReasonUpstreamRefused
}

func parseUpstream(s string) (*url.URL, error) {
	u, err := url.Parse(s)
	if err != nil {
		return nil, fmt.Errorf("upstream %q: %w", s, err)
	}
	switch {
	case u.Scheme != "http":
		return nil, fmt.Errorf("upstream %q: only http:// proxies are supported", s)
	case u.User != nil:
		// URLs end up in logs and process listings; credentials belong
		// in the credentials file.
		return nil, fmt.Errorf("upstream: credentials in the URL are not accepted; use the credentials file")
	case u.Hostname() == "" || u.Port() == "":
		return nil, fmt.Errorf("upstream %q: need http://host:port", s)
	case (u.Path != "" && u.Path != "/") || u.RawQuery != "" || u.Fragment != "":
		return nil, fmt.Errorf("upstream %q: a proxy URL has no path or query", s)
	}
	return &url.URL{Scheme: "http", Host: u.Host}, nil
}

// SetUpstreamCredentials replaces the Basic credentials sent to the
// upstream proxy; an empty user sends none. Requests already sent keep
// the credentials they were sent with.
func (p *Proxy) SetUpstreamCredentials(user, password string) {
	if user == "" {
		p.upAuth.Store(nil)
		return
	}
	v := "Basic " + base64.StdEncoding.EncodeToString([]byte(user+":"+password))
	p.upAuth.Store(&v)
}

// ParseCredentials reads "user:password" as stored in a mounted Secret
// file. A trailing newline, which editors and `echo` add, is dropped.
func ParseCredentials(b []byte) (user, password string, err error) {
	s := strings.TrimRight(string(b), "\r\n")
	user, password, ok := strings.Cut(s, ":")
	if !ok || user == "" {
		// The content is not quoted in the error: it may be a password.
		return "", "", fmt.Errorf("credentials must be user:password")
	}
	return user, password, nil
}

// newUpstreamTransport forwards plain HTTP through the upstream: the
// transport writes the absolute URL to it, as proxies expect.
func (p *Proxy) newUpstreamTransport() *http.Transport {
	up := p.upstream
	return &http.Transport{
		Proxy: func(*http.Request) (*url.URL, error) { return up, nil },
		// Every connection goes to the upstream proxy, so the dialer
		// needs no policy; the target was checked before forwarding.
		DialContext: func(ctx context.Context, network, _ string) (net.Conn, error) {
			ctx, cancel := context.WithTimeout(ctx, p.dialTimeout)
			defer cancel()
			return p.dial(ctx, network, up.Host)
		},
		DisableCompression:  true,
		MaxIdleConns:        100,
		MaxIdleConnsPerHost: 100, // one "host", the upstream, for all targets
		IdleConnTimeout:     90 * time.Second,
	}
}

// checkUpstreamResponse turns an upstream 407 into an error (and so a 502)
// rather than relaying it to the client.
func (p *Proxy) checkUpstreamResponse(resp *http.Response) error {
	if p.upstream != nil && resp.StatusCode == http.StatusProxyAuthRequired {
		resp.Body.Close()
		return &UpstreamError{Status: resp.StatusCode}
	}
	return nil
}

// connectViaUpstream checks the target like a direct connection would, then
// opens a CONNECT tunnel to it through the upstream. The returned reader
// yields anything the upstream sent after its 200, then the connection.
func (p *Proxy) connectViaUpstream(ctx context.Context, host, port string) (net.Conn, io.Reader, error) {
	if _, err := p.resolveChecked(ctx, p.policyFor(ctx), host); err != nil {
		return nil, nil, err
	}
	ctx, cancel := context.WithTimeout(ctx, p.dialTimeout)
	defer cancel()
	c, err := p.dial(ctx, "tcp", p.upstream.Host)
	if err != nil {
		return nil, nil, fmt.Errorf("dial upstream proxy %s: %w", p.upstream.Host, err)
	}
	// The handshake is bounded like a dial; the tunnel after it is not.
	if dl, ok := ctx.Deadline(); ok {
		c.SetDeadline(dl)
	}
	stop := context.AfterFunc(ctx, func() { c.SetDeadline(time.Unix(1, 0)) })
	defer stop()
	target := net.JoinHostPort(host, port)
	req := &http.Request{
		Method: http.MethodConnect,
		URL:    &url.URL{Opaque: target},
		Host:   target,
		Header: http.Header{"User-Agent": {"agentbox-egress-proxy"}},
	}
	if a := p.upAuth.Load(); a != nil {
		req.Header.Set("Proxy-Authorization", *a)
	}
	if err := req.Write(c); err != nil {
		c.Close()
		return nil, nil, fmt.Errorf("CONNECT to upstream proxy: %w", err)
	}
	br := bufio.NewReader(c)
	resp, err := http.ReadResponse(br, req)
	if err != nil {
		c.Close()
		return nil, nil, fmt.Errorf("CONNECT to upstream proxy: %w", err)
	}
	// resp.Body is never read: on a refusal the connection is dropped,
	// and after a 2xx the bytes that follow are the tunnel, whatever
	// Content-Length or Transfer-Encoding the upstream sent (RFC 9110,
	// 9.3.6, says a client must ignore both there). Closing the body
	// could wait for a chunked end that never comes.
	if resp.StatusCode/100 != 2 {
		c.Close()
		return nil, nil, &UpstreamError{Status: resp.StatusCode}
	}
	if !stop() {
		c.Close()
		return nil, nil, fmt.Errorf("CONNECT to upstream proxy: %w", ctx.Err())
	}
	c.SetDeadline(time.Time{})
	var r io.Reader = c
	if n := br.Buffered(); n > 0 {
		r = io.MultiReader(io.LimitReader(br, int64(n)), c)
	}
	return c, r, nil
}
