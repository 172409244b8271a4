package egressproxy

import (
	"bufio"
	"bytes"
	"encoding/base64"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
)

// fakeUpstreamProxy is an upstream proxy served over net.Pipe by the fake
// dialer: it records each request and answers plain requests itself and
// CONNECTs with a tunnel to an echo server that upper-cases a line.
type fakeUpstreamProxy struct {
	mu     sync.Mutex
	reqs   []*http.Request
	status int // answer every request with this instead, if non-zero
	// connectReply is the response to a CONNECT; default a bare 200.
	connectReply string
}

func (u *fakeUpstreamProxy) serve(c net.Conn) {
	defer c.Close()
	br := bufio.NewReader(c)
	for {
		req, err := http.ReadRequest(br)
		if err != nil {
			return
		}
		io.Copy(io.Discard, req.Body)
		u.mu.Lock()
		u.reqs = append(u.reqs, req)
		status := u.status
		u.mu.Unlock()
		if status != 0 {
			io.WriteString(c, "HTTP/1.1 "+strconv.Itoa(status)+" refused\r\nProxy-Authenticate: Basic realm=\"up\"\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
			return
		}
		if req.Method == http.MethodConnect {
			reply := u.connectReply
			if reply == "" {
				reply = "HTTP/1.1 200 Connection established\r\n\r\n"
			}
			io.WriteString(c, reply)
			line, err := br.ReadString('\n')
			if err != nil {
				return
			}
			io.WriteString(c, strings.ToUpper(line))
			return
		}
		body := "via upstream " + req.URL.String()
		io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Length: "+strconv.Itoa(len(body))+"\r\n\r\n"+body)
	}
}

func (u *fakeUpstreamProxy) requests() []*http.Request {
	u.mu.Lock()
	defer u.mu.Unlock()
	return append([]*http.Request(nil), u.reqs...)
}

const (
	upUser     = "up-user"
	upPassword = "up-s3cret-pw"
	clientAuth = "Basic Y2xpZW50OnNhbmRib3gtc2VjcmV0" // client:sandbox-secret
)

// chainedProxy returns a proxy chained to a fake upstream, its log and
// the dialer, which every connection goes through.
func chainedProxy(t *testing.T, up *fakeUpstreamProxy) (*Proxy, *logBuffer, *fakeDialer, *fakeResolver) {
	t.Helper()
	res := &fakeResolver{names: map[string][]string{
		"target.example":   {"203.0.113.7"},
		"internal.example": {"10.1.2.3"},
	}}
	dial := &fakeDialer{serve: up.serve}
	logBuf := &logBuffer{}
	p, err := New(Config{
		Allow:            []string{"*.example"},
		Resolver:         res,
		Dial:             dial.Dial,
		Logger:           slog.New(slog.NewJSONHandler(logBuf, nil)),
		Agent:            "agent-7",
		Upstream:         "http://upstream.test:3128",
		UpstreamUser:     upUser,
		UpstreamPassword: upPassword,
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Close)
	return p, logBuf, dial, res
}

// logBuffer collects log output written from the proxy's goroutines.
type logBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (l *logBuffer) Write(b []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.buf.Write(b)
}

func (l *logBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.buf.String()
}

func wantUpstreamAuth() string {
	return "Basic " + base64.StdEncoding.EncodeToString([]byte(upUser+":"+upPassword))
}

// assertNoSecrets checks the log for the upstream's and the client's
// credentials, in clear and encoded.
func assertNoSecrets(t *testing.T, log string) {
	t.Helper()
	for _, s := range []string{upPassword, wantUpstreamAuth()[len("Basic "):], clientAuth[len("Basic "):], "sandbox-secret"} {
		if strings.Contains(log, s) {
			t.Errorf("log contains a credential %q:\n%s", s, log)
		}
	}
}

func TestUpstreamChainingPlainHTTP(t *testing.T) {
	up := &fakeUpstreamProxy{}
	p, logBuf, dial, res := chainedProxy(t, up)

	r := httptest.NewRequest(http.MethodGet, "http://target.example/path?q=1", nil)
	r.Header.Set("Proxy-Authorization", clientAuth)
	w := httptest.NewRecorder()
	p.ServeHTTP(w, r)
	if w.Code != http.StatusOK || w.Body.String() != "via upstream http://target.example/path?q=1" {
		t.Fatalf("got %d %q", w.Code, w.Body.String())
	}
	reqs := up.requests()
	if len(reqs) != 1 {
		t.Fatalf("upstream got %d requests", len(reqs))
	}
	if got := reqs[0].Header.Values("Proxy-Authorization"); len(got) != 1 || got[0] != wantUpstreamAuth() {
		t.Errorf("upstream saw Proxy-Authorization %q, want only the upstream's credentials", got)
	}
	if reqs[0].Host != "target.example" {
		t.Errorf("upstream saw Host %q, want the target's name", reqs[0].Host)
	}
	if got := dial.Calls(); len(got) != 1 || got[0] != "upstream.test:3128" {
		t.Errorf("dialled %v, want only the upstream", got)
	}
	// The target was still resolved here, for the address check.
	if got := res.Calls(); len(got) != 1 || got[0] != "target.example" {
		t.Errorf("resolved %v", got)
	}
	log := logBuf.String()
	assertNoSecrets(t, log)
	if !strings.Contains(log, `"agent":"agent-7"`) || !strings.Contains(log, `"via":"upstream.test:3128"`) {
		t.Errorf("access log lacks agent or via: %s", log)
	}
}

func TestUpstreamChainingConnect(t *testing.T) {
	for name, reply := range map[string]string{
		"bare 200": "",
		// Framing headers on a CONNECT 200 must be ignored (RFC 9110,
		// 9.3.6); honouring this one would wait for a chunk forever.
		"chunked 200": "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n",
	} {
		t.Run(name, func(t *testing.T) { testUpstreamChainingConnect(t, reply) })
	}
}

func testUpstreamChainingConnect(t *testing.T, reply string) {
	up := &fakeUpstreamProxy{connectReply: reply}
	p, logBuf, dial, _ := chainedProxy(t, up)
	// A real listener, on loopback, because CONNECT hijacks the connection.
	srv := httptest.NewServer(p)
	defer srv.Close()

	c, err := net.Dial("tcp", srv.Listener.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(10 * time.Second))
	io.WriteString(c, "CONNECT target.example:443 HTTP/1.1\r\nHost: target.example:443\r\nProxy-Authorization: "+clientAuth+"\r\n\r\n")
	br := bufio.NewReader(c)
	resp, err := http.ReadResponse(br, &http.Request{Method: http.MethodConnect})
	if err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("CONNECT: %v %v", resp, err)
	}
	io.WriteString(c, "hello tunnel\n")
	line, err := br.ReadString('\n')
	if err != nil || line != "HELLO TUNNEL\n" {
		t.Fatalf("through the tunnel: %q %v", line, err)
	}
	c.Close()

	reqs := up.requests()
	if len(reqs) != 1 || reqs[0].Method != http.MethodConnect || reqs[0].Host != "target.example:443" {
		t.Fatalf("upstream got %v", reqs)
	}
	if got := reqs[0].Header.Values("Proxy-Authorization"); len(got) != 1 || got[0] != wantUpstreamAuth() {
		t.Errorf("upstream saw Proxy-Authorization %q, want only the upstream's credentials", got)
	}
	if got := dial.Calls(); len(got) != 1 || got[0] != "upstream.test:3128" {
		t.Errorf("dialled %v, want only the upstream", got)
	}
	waitFor(t, func() bool { return strings.Contains(logBuf.String(), `"method":"CONNECT"`) })
	assertNoSecrets(t, logBuf.String())
}

func TestUpstreamChainingStillEnforcesPolicy(t *testing.T) {
	up := &fakeUpstreamProxy{}
	p, logBuf, dial, _ := chainedProxy(t, up)
	cases := []struct{ method, target, reason string }{
		{http.MethodGet, "http://other.test/", ReasonNotAllowed},
		{http.MethodGet, "http://internal.example/", ReasonDeniedIP},
		{http.MethodConnect, "internal.example:443", ReasonDeniedIP},
		{http.MethodGet, "http://10.0.0.1/", ReasonNotAllowed},
	}
	for _, c := range cases {
		w := do(p, c.method, c.target)
		if w.Code != http.StatusForbidden || w.Header().Get("X-Agentbox-Egress-Denied") != c.reason {
			t.Errorf("%s %s: %d %q, want 403 %s", c.method, c.target, w.Code, w.Header().Get("X-Agentbox-Egress-Denied"), c.reason)
		}
	}
	// A name that does not resolve here is not passed on unchecked.
	if w := do(p, http.MethodGet, "http://nxdomain.example/"); w.Code != http.StatusBadGateway {
		t.Errorf("unresolvable name: %d, want 502", w.Code)
	}
	if got := dial.Calls(); len(got) != 0 {
		t.Errorf("the upstream was contacted for refused requests: %v", got)
	}
	assertNoSecrets(t, logBuf.String())
}

func TestUpstream407BecomesBadGateway(t *testing.T) {
	up := &fakeUpstreamProxy{status: http.StatusProxyAuthRequired}
	p, logBuf, _, _ := chainedProxy(t, up)
	w := do(p, http.MethodGet, "http://target.example/")
	if w.Code != http.StatusBadGateway || w.Header().Get("Proxy-Authenticate") != "" {
		t.Errorf("plain HTTP: %d %v, want 502 without Proxy-Authenticate", w.Code, w.Header())
	}
	srv := httptest.NewServer(p)
	defer srv.Close()
	c, err := net.Dial("tcp", srv.Listener.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(10 * time.Second))
	io.WriteString(c, "CONNECT target.example:443 HTTP/1.1\r\nHost: target.example:443\r\n\r\n")
	resp, err := http.ReadResponse(bufio.NewReader(c), &http.Request{Method: http.MethodConnect})
	if err != nil || resp.StatusCode != http.StatusBadGateway {
		t.Fatalf("CONNECT: %v %v, want 502", resp, err)
	}
	waitFor(t, func() bool { return strings.Count(logBuf.String(), `"reason":"upstream_auth"`) == 2 })
	assertNoSecrets(t, logBuf.String())
}

func TestParseUpstream(t *testing.T) {
	if u, err := parseUpstream("http://proxy.corp:3128"); err != nil || u.String() != "http://proxy.corp:3128" {
		t.Errorf("good URL: %v %v", u, err)
	}
	for _, bad := range []string{"https://p:3128", "http://u:pw@p:3128", "http://p", "http://p:3128/path", "p:3128"} {
		if _, err := parseUpstream(bad); err == nil {
			t.Errorf("%q accepted", bad)
		} else if strings.Contains(err.Error(), "pw") && strings.Contains(bad, "pw") {
			t.Errorf("error quotes the password: %v", err)
		}
	}
}

func TestParseCredentials(t *testing.T) {
	u, pw, err := ParseCredentials([]byte("user:pa:ss\n"))
	if err != nil || u != "user" || pw != "pa:ss" {
		t.Errorf("got %q %q %v", u, pw, err)
	}
	for _, bad := range []string{"", "nocolon", ":pw\n"} {
		if _, _, err := ParseCredentials([]byte(bad)); err == nil {
			t.Errorf("%q accepted", bad)
		} else if bad != "" && strings.Contains(err.Error(), strings.TrimSpace(bad)) {
			t.Errorf("error quotes the content: %v", err)
		}
	}
}

func waitFor(t *testing.T, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatal("condition not met within 5s")
		}
		time.Sleep(10 * time.Millisecond)
	}
}
