package mcpbridge

import (
	"bytes"
	"context"
	"encoding/json"
	"encoding/pem"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/modelcontextprotocol/go-sdk/mcp"

	api "github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"
)

// remoteServer is an in-process Streamable HTTP MCP server on loopback,
// built with the SDK, that records the Authorization header of every HTTP
// request it gets.
type remoteServer struct {
	ts *httptest.Server
	// handler is swapped to make the server forget its sessions, as a
	// restarted server does.
	handler atomic.Pointer[http.Handler]
	// release unblocks the "block" tool's calls.
	release chan struct{}

	mu       sync.Mutex
	requests []seenRequest
}

type seenRequest struct {
	Method, RPC, Authorization string
}

type whoamiOut struct {
	Authorization string `json:"authorization"`
	// MetaToken says whether params._meta had a user token key.
	MetaToken bool `json:"meta_token"`
}

func newRemoteServer(t *testing.T, tls bool) *remoteServer {
	t.Helper()
	rs := &remoteServer{release: make(chan struct{})}
	rs.reset()
	outer := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var rpc string
		if r.Method == http.MethodPost {
			var body struct {
				Method string `json:"method"`
			}
			b, _ := readAllAndRestore(r)
			_ = json.Unmarshal(b, &body)
			rpc = body.Method
		}
		rs.mu.Lock()
		rs.requests = append(rs.requests, seenRequest{Method: r.Method, RPC: rpc, Authorization: r.Header.Get("Authorization")})
		rs.mu.Unlock()
		// The "deny" token is refused as a server checking tokens would.
		if r.Header.Get("Authorization") == "Bearer deny" {
			w.Header().Set("WWW-Authenticate", `Bearer error="invalid_token"`)
			http.Error(w, "invalid token", http.StatusUnauthorized)
			return
		}
		(*rs.handler.Load()).ServeHTTP(w, r)
	})
	if tls {
		rs.ts = httptest.NewTLSServer(outer)
	} else {
		rs.ts = httptest.NewServer(outer)
	}
	t.Cleanup(func() {
		close(rs.release)
		rs.ts.Close()
	})
	return rs
}

// reset puts a new handler in place: the sessions of the old are gone.
func (rs *remoteServer) reset() {
	s := mcp.NewServer(&mcp.Implementation{Name: "remote-test", Version: "1.0.0"}, nil)
	mcp.AddTool(s, &mcp.Tool{Name: "whoami", Description: "returns the Authorization header of the call"},
		func(_ context.Context, req *mcp.CallToolRequest, _ struct{}) (*mcp.CallToolResult, whoamiOut, error) {
			_, meta := req.Params.GetMeta()[api.MetaUserToken]
			return nil, whoamiOut{Authorization: req.Extra.Header.Get("Authorization"), MetaToken: meta}, nil
		})
	mcp.AddTool(s, &mcp.Tool{Name: "block", Description: "answers once the test lets it"},
		func(ctx context.Context, _ *mcp.CallToolRequest, _ struct{}) (*mcp.CallToolResult, struct{}, error) {
			select {
			case <-rs.release:
			case <-ctx.Done():
			}
			return nil, struct{}{}, nil
		})
	var h http.Handler = mcp.NewStreamableHTTPHandler(func(*http.Request) *mcp.Server { return s }, nil)
	rs.handler.Store(&h)
}

func (rs *remoteServer) seen() []seenRequest {
	rs.mu.Lock()
	defer rs.mu.Unlock()
	return append([]seenRequest(nil), rs.requests...)
}

func readAllAndRestore(r *http.Request) ([]byte, error) {
	b, err := io.ReadAll(r.Body)
	r.Body = io.NopCloser(bytes.NewReader(b))
	return b, err
}

// postAs sends a JSON-RPC request to the bridge with token as the user
// token (none if empty) and extra headers.
func postAs(t *testing.T, ts *httptest.Server, server, token, body string, header map[string]string) (int, []byte) {
	t.Helper()
	req, err := http.NewRequest(http.MethodPost, ts.URL+"/mcp/"+server, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	if token != "" {
		req.Header.Set(api.HeaderUserToken, token)
	}
	for k, v := range header {
		req.Header.Set(k, v)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp.StatusCode, b
}

const whoamiCall = `{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"name":"whoami","arguments":{}}}`

// whoami calls the whoami tool as token and returns the Authorization the
// remote server saw.
func whoami(t *testing.T, ts *httptest.Server, token string) string {
	t.Helper()
	status, body := postAs(t, ts, "remote", token, whoamiCall, nil)
	if status != http.StatusOK {
		t.Fatalf("whoami as %q: HTTP %d: %s", token, status, body)
	}
	var r struct {
		Result struct {
			StructuredContent whoamiOut `json:"structuredContent"`
		} `json:"result"`
		Error any `json:"error"`
	}
	if err := json.Unmarshal(body, &r); err != nil || r.Error != nil {
		t.Fatalf("whoami as %q: %s (%v)", token, body, err)
	}
	return r.Result.StructuredContent.Authorization
}

// TestRemoteUserToken: a remote server's calls carry the caller's user
// token as a bearer token, each call its own, on one session; a call
// without a token sends no Authorization, and neither do the session's
// own requests (handshake, tools/list, the event stream).
func TestRemoteUserToken(t *testing.T) {
	rs := newRemoteServer(t, false)
	m, ts := startManager(t, Config{Servers: []ServerConfig{{Name: "remote", URL: rs.ts.URL}}, BaseEnv: map[string]string{}})
	waitRunning(t, m, "remote", 10*time.Second)

	if got := whoami(t, ts, "token-of-alice"); got != "Bearer token-of-alice" {
		t.Errorf("alice's call: the server saw Authorization %q", got)
	}
	if got := whoami(t, ts, "token-of-bob"); got != "Bearer token-of-bob" {
		t.Errorf("bob's call: the server saw Authorization %q", got)
	}
	if got := whoami(t, ts, ""); got != "" {
		t.Errorf("a call without a token: the server saw Authorization %q", got)
	}

	// The token never rides in _meta to a remote server, and a caller's
	// own _meta key is dropped, with or without a token.
	for _, token := range []string{"", "token-of-carol"} {
		status, body := postAs(t, ts, "remote", token, `{"jsonrpc":"2.0","id":8,"method":"tools/call","params":{"name":"whoami","arguments":{},"_meta":{"`+api.MetaUserToken+`":"forged"}}}`, nil)
		if status != http.StatusOK || !strings.Contains(string(body), `"meta_token":false`) || strings.Contains(string(body), "forged") {
			t.Errorf("a forged _meta token, user token %q: %d %s", token, status, body)
		}
	}

	// Concurrent calls on the one session keep their own tokens.
	var wg sync.WaitGroup
	errs := make(chan string, 24)
	for i := range 24 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			token := fmt.Sprintf("user-%d", i)
			status, body := postAs(t, ts, "remote", token, whoamiCall, nil)
			if status != http.StatusOK || !strings.Contains(string(body), `"authorization":"Bearer `+token+`"`) {
				errs <- fmt.Sprintf("%s: %d %s", token, status, body)
			}
		}()
	}
	wg.Wait()
	close(errs)
	for e := range errs {
		t.Errorf("concurrent call: %s", e)
	}

	// Only tools/call requests carried a token; everything else went bare.
	calls := 0
	for _, r := range rs.seen() {
		if r.RPC == "tools/call" {
			calls++
			continue
		}
		if r.Authorization != "" {
			t.Errorf("the session's own %s %s carried Authorization %q", r.Method, r.RPC, r.Authorization)
		}
	}
	if calls != 29 {
		t.Errorf("the server saw %d tools/call requests, want 29", calls)
	}

	// The cached tool list and the status work as for a stdio server.
	var tools ToolsResponse
	if code := getJSON(t, ts.URL+"/mcp/remote/tools", &tools); code != http.StatusOK || len(tools.Tools) != 2 {
		t.Errorf("GET tools: %d %+v", code, tools)
	}
	var st Status
	getJSON(t, ts.URL+"/mcp/remote", &st)
	if st.State != StateRunning || st.URL != rs.ts.URL || st.PID != 0 || st.ServerInfo == nil || st.ServerInfo.Name != "remote-test" {
		t.Errorf("status %+v", st)
	}
}

// TestRemoteTrust: an HTTPS server whose CA only SSL_CERT_FILE names is
// trusted through it, and not without it.
func TestRemoteTrust(t *testing.T) {
	rs := newRemoteServer(t, true)
	caFile := filepath.Join(t.TempDir(), "ca-bundle.crt")
	pemBytes := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: rs.ts.Certificate().Raw})
	if err := os.WriteFile(caFile, pemBytes, 0o600); err != nil {
		t.Fatal(err)
	}
	m, ts := startManager(t, Config{
		Servers: []ServerConfig{{Name: "remote", URL: rs.ts.URL}, {Name: "untrusted", URL: rs.ts.URL}},
		BaseEnv: map[string]string{"SSL_CERT_FILE": caFile},
	})
	waitRunning(t, m, "remote", 10*time.Second)
	if got := whoami(t, ts, "t1"); got != "Bearer t1" {
		t.Errorf("over HTTPS: the server saw %q", got)
	}

	// A manager without the bundle cannot verify the server.
	m2, _ := startManager(t, Config{Servers: []ServerConfig{{Name: "remote", URL: rs.ts.URL}}, BaseEnv: map[string]string{},
		InitialBackoff: time.Minute, MaxBackoff: time.Minute})
	waitFor(t, 10*time.Second, "the untrusted connect to fail", func() bool {
		st, _ := m2.Status("remote")
		return st.State == StateBackoff
	})
	if st, _ := m2.Status("remote"); !strings.Contains(st.LastError, "certificate") {
		t.Errorf("last error without the CA: %q", st.LastError)
	}

	// An unreadable bundle is a configuration error.
	if _, err := New(Config{Servers: []ServerConfig{{Name: "r", URL: rs.ts.URL}},
		BaseEnv: map[string]string{"SSL_CERT_FILE": filepath.Join(t.TempDir(), "missing.crt")}}); err == nil ||
		!strings.Contains(err.Error(), "trust store") {
		t.Errorf("a missing SSL_CERT_FILE: %v", err)
	}
}

// TestRemoteErrors: a call that does not answer times out within its
// bound, a refused token fails only its call, a server that forgot the
// session is reconnected to, and a server that cannot be reached is
// reported with its last error.
func TestRemoteErrors(t *testing.T) {
	rs := newRemoteServer(t, false)
	m, ts := startManager(t, Config{
		Servers:        []ServerConfig{{Name: "remote", URL: rs.ts.URL}},
		BaseEnv:        map[string]string{},
		InitialBackoff: 50 * time.Millisecond, MaxBackoff: 50 * time.Millisecond,
	})
	waitRunning(t, m, "remote", 10*time.Second)

	// The call's bound.
	start := time.Now()
	status, body := postAs(t, ts, "remote", "tok", `{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"block","arguments":{}}}`,
		map[string]string{HeaderTimeout: "1"})
	if took := time.Since(start); status != http.StatusGatewayTimeout || !strings.Contains(string(body), string(api.CodeTimeout)) || took > 5*time.Second {
		t.Errorf("a call that does not answer: %d %s after %s", status, body, took)
	}

	// A token the server refuses fails that call, with the server's
	// challenge, and the session goes on.
	status, body = postAs(t, ts, "remote", "deny", whoamiCall, nil)
	if status != http.StatusForbidden || !strings.Contains(string(body), string(api.CodePermissionDenied)) ||
		!strings.Contains(string(body), "401 Unauthorized to the user token") || !strings.Contains(string(body), "invalid_token") {
		t.Errorf("a refused token: %d %s", status, body)
	}
	if got := whoami(t, ts, "good"); got != "Bearer good" {
		t.Errorf("after a refused token: %q", got)
	}
	if st, _ := m.Status("remote"); st.Restarts != 0 {
		t.Errorf("the session was restarted %d times", st.Restarts)
	}

	// The server restarts and forgets the session: the call that finds
	// out fails as unavailable, and the bridge reconnects.
	rs.reset()
	status, body = postAs(t, ts, "remote", "tok", whoamiCall, nil)
	if status != http.StatusServiceUnavailable || !strings.Contains(string(body), "went away") {
		t.Errorf("the call on the forgotten session: %d %s", status, body)
	}
	waitFor(t, 10*time.Second, "the reconnect", func() bool {
		st, _ := m.Status("remote")
		return st.State == StateRunning && st.Restarts == 1
	})
	if got := whoami(t, ts, "again"); got != "Bearer again" {
		t.Errorf("after the reconnect: %q", got)
	}

	// Nothing listens: the server stays in backoff with why, and calls
	// are answered at once with that.
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	dead := "http://" + l.Addr().String() + "/mcp"
	l.Close()
	m2, ts2 := startManager(t, Config{Servers: []ServerConfig{{Name: "remote", URL: dead}}, BaseEnv: map[string]string{},
		InitialBackoff: time.Minute, MaxBackoff: time.Minute})
	waitFor(t, 10*time.Second, "the connect to fail", func() bool {
		st, _ := m2.Status("remote")
		return st.State == StateBackoff
	})
	status, body = postAs(t, ts2, "remote", "tok", whoamiCall, nil)
	if status != http.StatusServiceUnavailable || !strings.Contains(string(body), "connection refused") ||
		!strings.Contains(string(body), "connect: ") {
		t.Errorf("a server that cannot be reached: %d %s", status, body)
	}
}

// TestRemoteHungConnect: a server that accepts the connection but never
// answers the handshake is given up on after StartTimeout.
func TestRemoteHungConnect(t *testing.T) {
	hang := make(chan struct{})
	hung := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-hang:
		case <-r.Context().Done():
		}
	}))
	t.Cleanup(func() {
		close(hang)
		hung.Close()
	})
	m, _ := startManager(t, Config{Servers: []ServerConfig{{Name: "remote", URL: hung.URL}}, BaseEnv: map[string]string{},
		StartTimeout: 500 * time.Millisecond, InitialBackoff: time.Minute, MaxBackoff: time.Minute})
	waitFor(t, 10*time.Second, "the start-up to time out", func() bool {
		st, _ := m.Status("remote")
		return st.State == StateBackoff
	})
	if st, _ := m.Status("remote"); st.LastError != "connect: no answer within 500ms" {
		t.Errorf("last error %q", st.LastError)
	}
}

// TestRemoteEgressDenied: the egress proxy's refusal, for a plain HTTP
// destination (a 403 with its reason) and for an HTTPS one (a refused
// CONNECT), is reported as such.
func TestRemoteEgressDenied(t *testing.T) {
	proxy := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set(egressDeniedHeader, "host not allowed")
		http.Error(w, "agentbox egress proxy: denied", http.StatusForbidden)
	}))
	t.Cleanup(proxy.Close)
	base, err := RemoteTransport(map[string]string{})
	if err != nil {
		t.Fatal(err)
	}
	// Loopback is never proxied from the environment, so the test names
	// its proxy itself.
	proxyURL, _ := url.Parse(proxy.URL)
	base.Proxy = http.ProxyURL(proxyURL)
	m, ts := startManager(t, Config{
		Servers: []ServerConfig{
			{Name: "plain", URL: "http://mcp.example.test/mcp"},
			{Name: "tls", URL: "https://mcp.example.test/mcp"},
		},
		RemoteTransport: base, InitialBackoff: time.Minute, MaxBackoff: time.Minute,
	})
	for _, name := range []string{"plain", "tls"} {
		waitFor(t, 10*time.Second, name+" to fail", func() bool {
			st, _ := m.Status(name)
			return st.State == StateBackoff
		})
		status, body := postAs(t, ts, name, "", whoamiCall, nil)
		if status != http.StatusServiceUnavailable ||
			!strings.Contains(string(body), "the sandbox's egress proxy refused mcp.example.test") ||
			!strings.Contains(string(body), "host not allowed") {
			t.Errorf("%s through a refusing proxy: %d %s", name, status, body)
		}
	}
}

func TestRemoteConfigValidation(t *testing.T) {
	for _, sc := range []ServerConfig{
		{Name: "a", URL: "https://mcp.example.test/mcp", Command: "x"},
		{Name: "a", URL: "https://mcp.example.test/mcp", Args: []string{"-v"}},
		{Name: "a", URL: "https://mcp.example.test/mcp", Env: map[string]string{"A": "b"}},
		{Name: "a", URL: "https://mcp.example.test/mcp", Dir: "/tmp"},
		{Name: "a", URL: "ftp://mcp.example.test/mcp"},
		{Name: "a", URL: "http:///mcp"},
		{Name: "a", URL: "://x"},
	} {
		if _, err := New(Config{Servers: []ServerConfig{sc}, BaseEnv: map[string]string{}}); err == nil {
			t.Errorf("%+v: accepted", sc)
		}
	}
	servers, err := ParseServers([]byte(`[{"name":"r","url":"https://mcp.example.test/mcp"}]`))
	if err != nil || len(servers) != 1 || servers[0].URL != "https://mcp.example.test/mcp" || servers[0].Command != "" {
		t.Errorf("ParseServers: %+v, %v", servers, err)
	}
}
