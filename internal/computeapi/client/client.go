package client

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/agentbox/terraform-provider-agentbox/internal/contentcoding"
	"github.com/agentbox/terraform-provider-agentbox/internal/wire"
)

// DefaultMaxResponseBytes bounds how much of a response the client reads;
// see wire.DefaultMaxResponseBytes.
const DefaultMaxResponseBytes = wire.DefaultMaxResponseBytes

// Client calls one Compute API endpoint with one token.
type Client struct {
	// endpoint has no trailing slash; paths are appended to it as they
	// are, so an API behind a path prefix works and escaping survives.
	endpoint   string
	token      string
	httpClient *http.Client
	// MaxResponseBytes defaults to DefaultMaxResponseBytes.
	MaxResponseBytes int64
	// DisableCompression keeps file transfers as they are: uploads are
	// never coded and downloads do not ask for a coding. By default an
	// upload whose content compresses is coded (S2, see package
	// contentcoding) once the API has said it takes the coding (on any
	// earlier answer), and a download asks for it and is decoded as it is
	// read.
	DisableCompression bool

	// coding is what the API's latest answer said of coded uploads: the
	// coding it prefers, "" for none, or nil before any answer.
	coding atomic.Pointer[string]

	mu sync.Mutex
	// leases are the lease IDs the client presents, by agent ID.
	leases map[string]string
}

// UseLease makes the client present leaseID (in HeaderLeaseID) on its calls
// to agentID's sandbox, which a hold refuses to anyone else; an empty
// leaseID stops it. AcquireLease, HeartbeatLease and AcquirePoolLease do
// this for the lease they return, and ReleaseLease, or a heartbeat that
// finds the lease gone, undoes it. Call it to act for a hold acquired
// elsewhere, with the lease ID its holder handed on.
func (c *Client) UseLease(agentID, leaseID string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if leaseID == "" {
		delete(c.leases, agentID)
		return
	}
	if c.leases == nil {
		c.leases = map[string]string{}
	}
	c.leases[agentID] = leaseID
}

// forgetLease stops presenting leaseID for agentID, unless the client has
// moved on to another lease.
func (c *Client) forgetLease(agentID, leaseID string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.leases[agentID] == leaseID {
		delete(c.leases, agentID)
	}
}

// authorize sets what every request to path carries: the bearer token and,
// for a path of an agent whose lease the client holds, its lease ID.
func (c *Client) authorize(h http.Header, path string) {
	h.Set("Authorization", "Bearer "+c.token)
	agentID, ok := agentOfPath(path)
	if !ok {
		return
	}
	if id := c.leaseOf(agentID); id != "" {
		h.Set(HeaderLeaseID, id)
	}
}

// leaseOf is the lease ID the client presents on agentID's calls, or "".
func (c *Client) leaseOf(agentID string) string {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.leases[agentID]
}

// agentOfPath returns the agent a request path (escaped, possibly behind
// a prefix) addresses.
func agentOfPath(path string) (string, bool) {
	const prefix = "/v1/agents/"
	i := strings.Index(path, prefix)
	if i < 0 {
		return "", false
	}
	seg, _, _ := strings.Cut(path[i+len(prefix):], "/")
	seg, _, _ = strings.Cut(seg, "?")
	agentID, err := url.PathUnescape(seg)
	return agentID, err == nil && agentID != ""
}

// New returns a client for the API at endpoint (e.g.
// "https://agentbox-api.agentbox-system.svc"), authenticating with token.
// caPEM is the platform CA that issued the API's serving certificate; with
// none, the system roots are used, for an API behind a publicly trusted
// front end.
func New(endpoint, token string, caPEM []byte) (*Client, error) {
	endpoint = strings.TrimSuffix(endpoint, "/")
	u, err := url.Parse(endpoint)
	if err != nil {
		return nil, fmt.Errorf("endpoint %q: %w", endpoint, err)
	}
	if u.Scheme != "https" && u.Scheme != "http" || u.Host == "" || u.RawQuery != "" || u.Fragment != "" {
		return nil, fmt.Errorf("endpoint %q: want https://host[:port]", endpoint)
	}
	if token == "" {
		return nil, errors.New("empty token")
	}
	tlsConfig := &tls.Config{MinVersion: tls.VersionTLS12}
	if len(caPEM) > 0 {
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(caPEM) {
			return nil, errors.New("no CA certificate found in the CA PEM data")
		}
		tlsConfig.RootCAs = pool
	}
	tr := http.DefaultTransport.(*http.Transport).Clone()
	tr.TLSClientConfig = tlsConfig
	// No http.Client timeout: a command may legitimately run for minutes,
	// so calls are bounded by the caller's context.
	return &Client{endpoint: endpoint, token: token, httpClient: &http.Client{Transport: tr}}, nil
}

// RunCommand runs a command in the agent's sandbox and returns its result.
// A command that exits non-zero, is killed or times out is a result, not an
// error; errors the API reports are *Error.
func (c *Client) RunCommand(ctx context.Context, agentID string, req RunCommandRequest) (*CommandResult, error) {
	if agentID == "" {
		return nil, errors.New("empty agent ID")
	}
	body, err := json.Marshal(req)
	if err != nil {
		return nil, fmt.Errorf("encode run_command request: %w", err)
	}
	var res CommandResult
	if err := c.do(ctx, http.MethodPost, PathRunCommand(agentID), body, &res); err != nil {
		return nil, err
	}
	return &res, nil
}

// AcquireLease takes the exclusive lease on the agent's sandbox, or returns
// the lease an earlier call with the same holder and request ID got. When
// another holder has it, the error matches ErrLeaseHeld and LeaseHeldBy
// says who until when.
func (c *Client) AcquireLease(ctx context.Context, agentID string, req AcquireLeaseRequest) (*Lease, error) {
	l, err := c.leaseCall(ctx, http.MethodPost, agentID, PathLease(agentID), req)
	if err == nil {
		c.UseLease(agentID, l.LeaseID)
	}
	return l, err
}

// HeartbeatLease extends a held lease by its TTL from now. An error
// matching ErrLeaseExpired or ErrLeaseNotHeld means the hold is gone.
func (c *Client) HeartbeatLease(ctx context.Context, agentID string, req HeartbeatLeaseRequest) (*Lease, error) {
	l, err := c.leaseCall(ctx, http.MethodPost, agentID, PathLeaseHeartbeat(agentID), req)
	switch code := CodeOf(err); {
	case err == nil:
		c.UseLease(agentID, l.LeaseID)
	case code == CodeLeaseExpired || code == CodeLeaseNotHeld:
		c.forgetLease(agentID, req.LeaseID)
	}
	return l, err
}

// ReleaseLease gives a held lease up. Releasing a lease that nobody holds
// succeeds, so a retried release is harmless; one that another hold has
// replaced fails with ErrLeaseNotHeld.
func (c *Client) ReleaseLease(ctx context.Context, agentID string, req ReleaseLeaseRequest) error {
	if agentID == "" {
		return errors.New("empty agent ID")
	}
	body, err := json.Marshal(req)
	if err != nil {
		return fmt.Errorf("encode lease request: %w", err)
	}
	err = c.do(ctx, http.MethodDelete, PathLease(agentID), body, nil)
	if code := CodeOf(err); err == nil || code == CodeLeaseNotHeld {
		c.forgetLease(agentID, req.LeaseID)
	}
	return err
}

// AcquirePoolLease leases a ready sandbox of a warm pool for one run, or
// returns the lease an earlier call with the same holder and request ID
// got. When the pool has no ready sandbox free, the call waits up to
// req.WaitSeconds for one (or for the one a pool with
// coldStartWhenExhausted starts for it); then the error has
// CodePoolExhausted.
func (c *Client) AcquirePoolLease(ctx context.Context, namespace, pool string, req AcquireLeaseRequest) (*PoolLease, error) {
	if namespace == "" || pool == "" {
		return nil, errors.New("empty namespace or pool")
	}
	body, err := json.Marshal(req)
	if err != nil {
		return nil, fmt.Errorf("encode lease request: %w", err)
	}
	var l PoolLease
	if err := c.do(ctx, http.MethodPost, PathPoolLeases(namespace, pool), body, &l); err != nil {
		return nil, err
	}
	c.UseLease(l.AgentID, l.LeaseID)
	return &l, nil
}

func (c *Client) leaseCall(ctx context.Context, method, agentID, path string, req any) (*Lease, error) {
	if agentID == "" {
		return nil, errors.New("empty agent ID")
	}
	body, err := json.Marshal(req)
	if err != nil {
		return nil, fmt.Errorf("encode lease request: %w", err)
	}
	var l Lease
	if err := c.do(ctx, method, path, body, &l); err != nil {
		return nil, err
	}
	return &l, nil
}

// CloseIdleConnections closes connections kept for reuse.
func (c *Client) CloseIdleConnections() { c.httpClient.CloseIdleConnections() }

// transport is the client's wire transport for one call: every request
// carries the token, and the hold the client presents on the agent.
func (c *Client) transport() *wire.Transport[wire.API] {
	return &wire.Transport[wire.API]{BaseURL: c.endpoint, HTTPClient: c.httpClient, MaxResponseBytes: c.MaxResponseBytes, Authorize: c.authorize,
		Observe: c.observe}
}

func (c *Client) do(ctx context.Context, method, path string, body []byte, out any) error {
	return c.transport().Do(ctx, method, path, body, out)
}

// CreateToken mints an API token (admin only). The returned Token is the
// only copy: the control plane keeps its hash.
func (c *Client) CreateToken(ctx context.Context, req CreateTokenRequest) (*CreatedToken, error) {
	body, err := json.Marshal(req)
	if err != nil {
		return nil, fmt.Errorf("encode token request: %w", err)
	}
	var t CreatedToken
	if err := c.do(ctx, http.MethodPost, PathTokens, body, &t); err != nil {
		return nil, err
	}
	return &t, nil
}

// RevokeToken revokes a token by its ID (admin only).
func (c *Client) RevokeToken(ctx context.Context, id string) error {
	if id == "" {
		return errors.New("empty token ID")
	}
	return c.do(ctx, http.MethodDelete, PathToken(id), nil, nil)
}

// QueryAudit reads one page of the audit log (admin only). query takes the
// parameters listed in the package documentation.
func (c *Client) QueryAudit(ctx context.Context, query url.Values) (*AuditPage, error) {
	path := PathAudit
	if len(query) > 0 {
		path += "?" + query.Encode()
	}
	var p AuditPage
	if err := c.do(ctx, http.MethodGet, path, nil, &p); err != nil {
		return nil, err
	}
	return &p, nil
}

// VerifyAudit walks the audit chain on the control plane and reports the
// first broken record, if any (admin only).
func (c *Client) VerifyAudit(ctx context.Context) (*AuditVerification, error) {
	var v AuditVerification
	if err := c.do(ctx, http.MethodGet, PathAuditVerify, nil, &v); err != nil {
		return nil, err
	}
	return &v, nil
}

// Status reports the agent's sandbox without waking it.
func (c *Client) Status(ctx context.Context, agentID string) (*SandboxStatus, error) {
	var st SandboxStatus
	if err := c.do(ctx, http.MethodGet, PathAgent(agentID, "status"), nil, &st); err != nil {
		return nil, err
	}
	return &st, nil
}

// DeployOrResume returns the agent's sandbox once it serves calls: it
// wakes a stopped one, and creates one from req.Template (or the
// platform's default template) when the agent has none.
func (c *Client) DeployOrResume(ctx context.Context, agentID string, req DeployRequest) (*SandboxStatus, error) {
	if agentID == "" {
		return nil, errors.New("empty agent ID")
	}
	body, err := json.Marshal(req)
	if err != nil {
		return nil, fmt.Errorf("encode deploy_or_resume request: %w", err)
	}
	var st SandboxStatus
	if err := c.do(ctx, http.MethodPost, PathAgent(agentID, "deploy_or_resume"), body, &st); err != nil {
		return nil, err
	}
	return &st, nil
}

// PutFile streams body into the workspace file at path, atomically; mode 0
// means the sandbox's default (0644).
func (c *Client) PutFile(ctx context.Context, agentID, path string, body io.Reader, mode uint32) (*FileInfo, error) {
	p := PathFile(agentID, path)
	if mode != 0 {
		p += "?mode=" + strconv.FormatUint(uint64(mode), 8)
	}
	r := wire.Request{Method: http.MethodPut, Path: p, Body: body, ContentType: "application/octet-stream"}
	if coding := c.coding.Load(); !c.DisableCompression && (coding == nil || *coding != "") {
		size := wire.LengthOf(body)
		sniffed, compressible, err := contentcoding.Sniff(body, size)
		if err != nil {
			return nil, fmt.Errorf("PUT %s: read the content: %w", p, err)
		}
		r.Body = sniffed
		if size >= 0 {
			// Sent with its length, as the body itself would have been.
			r.Body = wire.Sized(sniffed, size)
		}
		if compressible && coding == nil && (size < 0 || size >= probeMinBytes) {
			// A client that has had no answer yet (a CLI's one upload)
			// asks first, with a call that does not wake the sandbox;
			// its result does not matter, only what the answer says.
			_, _ = c.Status(ctx, agentID)
			coding = c.coding.Load()
		}
		if compressible && coding != nil && *coding != "" {
			coded, err := contentcoding.Encode(*coding, sniffed)
			if err != nil {
				return nil, fmt.Errorf("PUT %s: %w", p, err)
			}
			defer coded.Close()
			r.Body = coded
			r.Header = http.Header{}
			contentcoding.SetCoded(r.Header, *coding, size)
		}
	}
	resp, err := c.transport().Send(ctx, r)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	var fi FileInfo
	if err := json.NewDecoder(io.LimitReader(resp.Body, DefaultMaxResponseBytes)).Decode(&fi); err != nil {
		return nil, fmt.Errorf("PUT %s: decode response: %w", p, err)
	}
	return &fi, nil
}

// probeMinBytes is the smallest compressible upload for which a client
// that has not heard from the API yet asks it whether it takes a coding:
// a round trip is worth it only when it saves more.
const probeMinBytes = 1 << 20

func (c *Client) observe(resp *http.Response) {
	coding := contentcoding.Advertised(resp)
	c.coding.Store(&coding)
}

// GetFile streams the workspace file at path; the caller closes it. It
// asks for a content coding (unless DisableCompression) and decodes what
// comes coded, so the reader gives the file as it is either way.
func (c *Client) GetFile(ctx context.Context, agentID, path string) (io.ReadCloser, error) {
	r := wire.Request{Method: http.MethodGet, Path: PathFile(agentID, path)}
	if !c.DisableCompression {
		r.Header = http.Header{"Accept-Encoding": {contentcoding.AcceptAll}}
	}
	resp, err := c.transport().Send(ctx, r)
	if err != nil {
		return nil, err
	}
	coding, err := contentcoding.Of(resp.Header)
	if err != nil {
		resp.Body.Close()
		return nil, fmt.Errorf("GET %s: %w", r.Path, err)
	}
	if coding == "" {
		return resp.Body, nil
	}
	dec, err := contentcoding.NewReader(coding, resp.Body)
	if err != nil {
		resp.Body.Close()
		return nil, fmt.Errorf("GET %s: %w", r.Path, err)
	}
	n, err := contentcoding.DecodedLength(resp.Header)
	if err != nil || n < 0 {
		return dec, nil
	}
	return &lengthChecked{ReadCloser: dec, left: n, path: r.Path}, nil
}

// lengthChecked fails a decoded download that ends short of, or runs
// past, the length the API declared: a coded stream cut at a block
// boundary, relayed by the API in a body that ends cleanly, would
// otherwise read as a whole, shorter file.
type lengthChecked struct {
	io.ReadCloser
	left int64
	path string
}

func (l *lengthChecked) Read(p []byte) (int, error) {
	n, err := l.ReadCloser.Read(p)
	l.left -= int64(n)
	switch {
	case l.left < 0:
		return n, fmt.Errorf("GET %s: the decoded file is longer than the %s the API declared", l.path, contentcoding.HeaderDecodedLength)
	case errors.Is(err, io.EOF) && l.left > 0:
		return n, fmt.Errorf("GET %s: the file ended %d bytes short: %w", l.path, l.left, io.ErrUnexpectedEOF)
	}
	return n, err
}

// DeleteFile removes a workspace file, or a directory with recursive.
func (c *Client) DeleteFile(ctx context.Context, agentID, path string, recursive bool) error {
	p := PathFile(agentID, path)
	if recursive {
		p += "?recursive=true"
	}
	return c.do(ctx, http.MethodDelete, p, nil, nil)
}

// ToolRequest calls a sandboxed tool (create_file, python_exec, ...) with
// input, encoded as JSON unless it is a json.RawMessage, and returns the
// tool's JSON output.
func (c *Client) ToolRequest(ctx context.Context, agentID, tool string, input any) (json.RawMessage, error) {
	return c.rawCall(ctx, PathAgent(agentID, "tools/"+url.PathEscape(tool)), input)
}

// Execute runs the execute operation (code, requirements, env_name, inline
// files) in the agent's sandbox and returns the result as sent.
func (c *Client) Execute(ctx context.Context, agentID string, req any) (json.RawMessage, error) {
	return c.rawCall(ctx, PathAgent(agentID, "execute"), req)
}

func (c *Client) rawCall(ctx context.Context, path string, input any) (json.RawMessage, error) {
	body, ok := input.(json.RawMessage)
	if !ok {
		var err error
		if body, err = json.Marshal(input); err != nil {
			return nil, fmt.Errorf("encode request: %w", err)
		}
	}
	var out json.RawMessage
	if err := c.do(ctx, http.MethodPost, path, body, &out); err != nil {
		return nil, err
	}
	return out, nil
}

// stream sends a raw body and returns a 2xx response unread; errors are
// decoded as for every other call.
func (c *Client) stream(ctx context.Context, method, path string, body io.Reader) (*http.Response, error) {
	r := wire.Request{Method: method, Path: path, Body: body}
	if body != nil {
		r.ContentType = "application/octet-stream"
	}
	return c.transport().Send(ctx, r)
}

// CreateConsoleSession mints a staff console session (staff token).
func (c *Client) CreateConsoleSession(ctx context.Context, req CreateConsoleSessionRequest) (*ConsoleSession, error) {
	body, err := json.Marshal(req)
	if err != nil {
		return nil, fmt.Errorf("encode console request: %w", err)
	}
	var s ConsoleSession
	if err := c.do(ctx, http.MethodPost, PathConsoleSessions, body, &s); err != nil {
		return nil, err
	}
	return &s, nil
}

// GetConsoleSession reads a console session back, with its transcript.
func (c *Client) GetConsoleSession(ctx context.Context, id string) (*ConsoleSession, error) {
	var s ConsoleSession
	if err := c.do(ctx, http.MethodGet, PathConsoleSession(id), nil, &s); err != nil {
		return nil, err
	}
	return &s, nil
}

// Endpoint, Token and HTTPClient let a WebSocket client (the console's
// terminal) dial the API with this client's address, credentials and TLS
// settings.
func (c *Client) Endpoint() string { return c.endpoint }

// Token returns the bearer token the client sends.
func (c *Client) Token() string { return c.token }

// HTTPClient returns the client's HTTP client.
func (c *Client) HTTPClient() *http.Client { return c.httpClient }

// MCPHTTPClient returns an HTTP client for an MCP client's streamable HTTP
// transport to the agent's MCP endpoint (Endpoint()+PathMCP(agentID)): it
// has this client's TLS settings and sends the bearer token on every
// request, which MCP libraries leave to the HTTP client, and what opts add
// (WithUserToken).
func (c *Client) MCPHTTPClient(opts ...MCPOption) *http.Client {
	return &http.Client{Transport: bearerTransport{c: c, base: c.httpClient.Transport, opts: opts}}
}

// bearerTransport authorizes requests as the client's own are: the token,
// and the lease the client holds on the agent addressed.
type bearerTransport struct {
	c    *Client
	base http.RoundTripper
	opts []MCPOption
}

func (t bearerTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	// A RoundTripper must not change the caller's request.
	r = r.Clone(r.Context())
	t.c.authorize(r.Header, r.URL.EscapedPath())
	for _, o := range t.opts {
		o(r.Header)
	}
	return t.base.RoundTrip(r)
}

// MCPOption adds to an MCP call (MCPRequest, MCPHTTPClient).
type MCPOption func(h http.Header)

// WithUserToken passes token, a user token from ExchangeToken, on to the
// MCP server in HeaderUserToken; an empty token passes none.
func WithUserToken(token string) MCPOption {
	return func(h http.Header) {
		if token != "" {
			h.Set(HeaderUserToken, token)
		}
	}
}

// MCPRequest sends one JSON-RPC request (request, encoded as JSON unless it
// is a json.RawMessage) to the stdio MCP server of the agent's sandbox and
// returns the JSON-RPC response. WithUserToken passes a user token on.
func (c *Client) MCPRequest(ctx context.Context, agentID, server string, request any, opts ...MCPOption) (json.RawMessage, error) {
	body, ok := request.(json.RawMessage)
	if !ok {
		var err error
		if body, err = json.Marshal(request); err != nil {
			return nil, fmt.Errorf("encode request: %w", err)
		}
	}
	t := c.transport()
	t.Authorize = func(h http.Header, path string) {
		c.authorize(h, path)
		for _, o := range opts {
			o(h)
		}
	}
	var out json.RawMessage
	if err := t.Do(ctx, http.MethodPost, PathAgent(agentID, "mcp/"+url.PathEscape(server)), body, &out); err != nil {
		return nil, err
	}
	return out, nil
}

// MCPTools returns the cached tool catalog of an MCP server; refresh asks
// the sandbox (waking it) instead of the cache.
func (c *Client) MCPTools(ctx context.Context, agentID, server string, refresh bool) (*MCPToolCatalog, error) {
	p := PathAgent(agentID, "mcp/"+url.PathEscape(server)+"/tools")
	if refresh {
		p += "?refresh=true"
	}
	var cat MCPToolCatalog
	if err := c.do(ctx, http.MethodGet, p, nil, &cat); err != nil {
		return nil, err
	}
	return &cat, nil
}
