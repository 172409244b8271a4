package mcpbridge

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"strings"

	"github.com/modelcontextprotocol/go-sdk/mcp"
	"golang.org/x/net/http/httpproxy"
)

// Remote servers: a template's server with a URL is not started but
// connected to, over the MCP Streamable HTTP transport, with one long-lived
// session like a stdio server's. The sandbox can only reach the outside
// through its egress proxy, so the HTTP client takes the proxy and the
// trust store from the same variables the sandbox's processes get, and a
// caller's user token rides on the context of its call: the SDK makes a
// call's HTTP requests with the call's context, so the transport below
// adds the token to that call's requests only, never to the session's own
// (the handshake, the server-sent event stream).

// egressDeniedHeader is where the egress proxy says why it refused a
// destination.
const egressDeniedHeader = "X-Agentbox-Egress-Denied"

type userTokenKey struct{}

// withUserToken returns ctx carrying token for a remote server's requests.
func withUserToken(ctx context.Context, token string) context.Context {
	return context.WithValue(ctx, userTokenKey{}, token)
}

func userToken(ctx context.Context) string {
	s, _ := ctx.Value(userTokenKey{}).(string)
	return s
}

// EgressDeniedError is the egress proxy refusing a remote server's host.
type EgressDeniedError struct {
	Host, Reason string
}

func (e *EgressDeniedError) Error() string {
	msg := "the sandbox's egress proxy refused " + e.Host
	if e.Reason != "" {
		msg += ": " + e.Reason
	}
	return msg
}

// AuthError is a remote server answering 401 or 403. The transport turns
// such an answer into an error of the one call, so that a user whose
// token is refused does not break the session everyone shares (the SDK
// ends a session on any other 4xx).
type AuthError struct {
	Status int
	// Challenge is the WWW-Authenticate header, when there is one.
	Challenge string
	// TokenSent says whether the call carried a user token.
	TokenSent bool
}

func (e *AuthError) Error() string {
	msg := fmt.Sprintf("the MCP server answered %d %s", e.Status, http.StatusText(e.Status))
	if e.TokenSent {
		msg += " to the user token"
	} else {
		msg += " (the call carried no user token)"
	}
	if e.Challenge != "" {
		msg += "; WWW-Authenticate: " + e.Challenge
	}
	return msg
}

// RemoteTransport returns the base transport to remote servers, configured
// from env as the sandbox's processes are: the egress proxy of HTTP_PROXY,
// HTTPS_PROXY and NO_PROXY (upper case first, as Go and curl read them),
// and the system roots with the certificates of SSL_CERT_FILE added (the
// bundle with the egress proxy's CA, when its credentials intercept TLS).
func RemoteTransport(env map[string]string) (*http.Transport, error) {
	get := func(upper string) string {
		if v := env[upper]; v != "" {
			return v
		}
		return env[strings.ToLower(upper)]
	}
	proxy := (&httpproxy.Config{HTTPProxy: get("HTTP_PROXY"), HTTPSProxy: get("HTTPS_PROXY"), NoProxy: get("NO_PROXY")}).ProxyFunc()
	roots, err := x509.SystemCertPool()
	if err != nil || roots == nil {
		roots = x509.NewCertPool()
	}
	if f := env["SSL_CERT_FILE"]; f != "" {
		pem, err := os.ReadFile(f)
		if err != nil {
			return nil, fmt.Errorf("remote MCP servers' trust store: %w", err)
		}
		if !roots.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("remote MCP servers' trust store: no certificate in %s", f)
		}
	}
	t := http.DefaultTransport.(*http.Transport).Clone()
	t.Proxy = func(r *http.Request) (*url.URL, error) { return proxy(r.URL) }
	t.TLSClientConfig = &tls.Config{RootCAs: roots, MinVersion: tls.VersionTLS12}
	// An HTTPS destination is reached with CONNECT, whose refusal Go
	// would report as a bare status text.
	t.OnProxyConnectResponse = func(_ context.Context, _ *url.URL, req *http.Request, resp *http.Response) error {
		if resp.StatusCode == http.StatusForbidden && resp.Header.Get(egressDeniedHeader) != "" {
			return &EgressDeniedError{Host: req.Host, Reason: resp.Header.Get(egressDeniedHeader)}
		}
		return nil
	}
	return t, nil
}

// remoteTransport is one remote server's: it sends the call's user token,
// and only to the server's own origin (not wherever a redirect leads).
type remoteTransport struct {
	base   http.RoundTripper
	origin string // scheme://host[:port] of the server's URL
}

func origin(u *url.URL) string { return strings.ToLower(u.Scheme + "://" + u.Host) }

func (t *remoteTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	r := req.Clone(req.Context())
	// Whatever the SDK or a redirect set, only the call's token is sent.
	r.Header.Del("Authorization")
	token := userToken(req.Context())
	if token != "" && origin(r.URL) == t.origin {
		r.Header.Set("Authorization", "Bearer "+token)
	}
	resp, err := t.base.RoundTrip(r)
	if err != nil {
		return nil, err
	}
	// Only the POSTs of calls: the SDK tolerates a 4xx to the GET of its
	// server-sent event stream (a server may not offer one), and would
	// retry an error there until it ended the session.
	if r.Method != http.MethodPost {
		return resp, nil
	}
	switch {
	case resp.StatusCode == http.StatusForbidden && resp.Header.Get(egressDeniedHeader) != "":
		drain(resp)
		return nil, &EgressDeniedError{Host: r.URL.Host, Reason: resp.Header.Get(egressDeniedHeader)}
	case resp.StatusCode == http.StatusUnauthorized || resp.StatusCode == http.StatusForbidden:
		drain(resp)
		return nil, &AuthError{Status: resp.StatusCode, Challenge: resp.Header.Get("WWW-Authenticate"), TokenSent: token != ""}
	}
	return resp, nil
}

func drain(resp *http.Response) {
	_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10))
	resp.Body.Close()
}

// checkRemoteURL checks a remote server's URL as the CRD does, and returns
// its origin.
func checkRemoteURL(raw string) (string, error) {
	u, err := url.Parse(raw)
	switch {
	case err != nil:
		return "", fmt.Errorf("url: %w", err)
	case u.Scheme != "http" && u.Scheme != "https":
		return "", fmt.Errorf("url: scheme %q is not http or https", u.Scheme)
	case u.Hostname() == "":
		return "", errors.New("url: no host")
	}
	return origin(u), nil
}

// newRemoteServer is a server the Manager connects to at sc.URL.
func (m *Manager) newRemoteServer(sc ServerConfig) (*server, error) {
	if sc.Command != "" || len(sc.Args) > 0 || len(sc.Env) > 0 || sc.Dir != "" {
		return nil, errors.New("a remote server (url) takes no command, args, env or dir")
	}
	org, err := checkRemoteURL(sc.URL)
	if err != nil {
		return nil, err
	}
	if m.remoteBase == nil {
		m.remoteBase = m.cfg.RemoteTransport
		if m.remoteBase == nil {
			t, err := RemoteTransport(m.cfg.BaseEnv)
			if err != nil {
				return nil, err
			}
			m.remoteBase = t
		}
	}
	return &server{
		m: m, cfg: sc, state: StateStopped,
		httpClient: &http.Client{Transport: &remoteTransport{base: m.remoteBase, origin: org}},
	}, nil
}

// runRemote connects to a remote server, does the MCP handshake and keeps
// the session until it ends or ctx is done. The error says why it ended;
// supervise reconnects with the same backoff as it restarts a stdio
// server (a server that restarted has forgotten the session, and the SDK
// ends it on the server's 404).
func (s *server) runRemote(ctx context.Context) error {
	cfg := &s.m.cfg
	s.mu.Lock()
	s.gen++
	gen := s.gen
	s.mu.Unlock()
	startCtx, cancelStart := context.WithTimeout(ctx, cfg.StartTimeout)
	defer cancelStart()
	transport := &mcp.StreamableClientTransport{Endpoint: s.cfg.URL, HTTPClient: s.httpClient}
	session, err := s.client(gen).Connect(startCtx, transport, nil)
	if err != nil {
		if errors.Is(context.Cause(startCtx), context.DeadlineExceeded) && ctx.Err() == nil {
			return fmt.Errorf("connect: no answer within %s", cfg.StartTimeout)
		}
		return fmt.Errorf("connect: %w", err)
	}
	s.mu.Lock()
	s.session = session
	s.mu.Unlock()
	if ir := session.InitializeResult(); ir == nil || ir.Capabilities == nil || ir.Capabilities.Tools != nil {
		s.loadTools(startCtx, session, gen)
	}
	s.mu.Lock()
	s.state = StateRunning
	s.mu.Unlock()
	s.m.log.Info("mcp server connected", "server", s.cfg.Name, "url", s.cfg.URL)

	ended := make(chan error, 1)
	go func() { ended <- session.Wait() }()
	select {
	case err := <-ended:
		_ = session.Close()
		if err == nil {
			return errors.New("the session ended")
		}
		return fmt.Errorf("the session ended: %w", err)
	case <-ctx.Done():
		s.mu.Lock()
		s.state = StateStopped
		s.mu.Unlock()
		// The SDK bounds the session's DELETE.
		_ = session.Close()
		return ctx.Err()
	}
}
