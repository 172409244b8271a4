package main

import (
	"context"
	"encoding/base64"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// The tests here chain the real binary to a fake upstream proxy. Every
// server is on 127.0.0.1: the target, the upstream, the proxy and its
// metrics listener.

// fakeUpstream is a minimal authenticating forward proxy: it records the
// requests it gets, answers 407 without the expected Basic credentials,
// forwards absolute-form requests and tunnels CONNECT, to 127.0.0.1 and
// localhost only.
type fakeUpstream struct {
	*httptest.Server
	auth string
	mu   sync.Mutex
	seen []seenRequest
}

type seenRequest struct {
	method, target string
	proxyAuth      []string
}

func newFakeUpstream(t *testing.T, user, password string) *fakeUpstream {
	u := &fakeUpstream{auth: "Basic " + base64.StdEncoding.EncodeToString([]byte(user+":"+password))}
	u.Server = httptest.NewServer(http.HandlerFunc(u.serve))
	t.Cleanup(u.Close)
	return u
}

func (u *fakeUpstream) serve(w http.ResponseWriter, r *http.Request) {
	target := r.Host
	if r.Method != http.MethodConnect {
		target = r.URL.String()
	}
	u.mu.Lock()
	u.seen = append(u.seen, seenRequest{r.Method, target, r.Header.Values("Proxy-Authorization")})
	u.mu.Unlock()
	if r.Header.Get("Proxy-Authorization") != u.auth {
		w.Header().Set("Proxy-Authenticate", `Basic realm="upstream"`)
		w.WriteHeader(http.StatusProxyAuthRequired)
		return
	}
	host := r.URL.Host
	if r.Method == http.MethodConnect {
		host = r.Host
	}
	h, port, err := net.SplitHostPort(host)
	if err != nil || (h != "127.0.0.1" && h != "localhost") {
		// Never send anywhere but loopback, whatever the proxy asks.
		http.Error(w, "fake upstream: loopback only", http.StatusForbidden)
		return
	}
	if r.Method == http.MethodConnect {
		// "localhost" is dialled as 127.0.0.1, not resolved.
		dst, err := net.Dial("tcp", net.JoinHostPort("127.0.0.1", port))
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadGateway)
			return
		}
		defer dst.Close()
		// Answered the way Go servers usually do, through the
		// ResponseWriter (which may add framing headers the proxy must
		// ignore on a CONNECT 200), then taken over.
		w.WriteHeader(http.StatusOK)
		http.NewResponseController(w).Flush()
		src, buf, err := http.NewResponseController(w).Hijack()
		if err != nil {
			return
		}
		defer src.Close()
		go func() {
			io.Copy(dst, io.MultiReader(io.LimitReader(buf, int64(buf.Reader.Buffered())), src))
			dst.(*net.TCPConn).CloseWrite()
		}()
		io.Copy(src, dst)
		return
	}
	out := r.Clone(r.Context())
	out.RequestURI = ""
	out.Header.Del("Proxy-Authorization")
	resp, err := (&http.Transport{}).RoundTrip(out)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadGateway)
		return
	}
	defer resp.Body.Close()
	for k, v := range resp.Header {
		w.Header()[k] = v
	}
	w.WriteHeader(resp.StatusCode)
	io.Copy(w, resp.Body)
}

func (u *fakeUpstream) requests() []seenRequest {
	u.mu.Lock()
	defer u.mu.Unlock()
	return append([]seenRequest(nil), u.seen...)
}

// recordingTarget is the destination; it records the headers it got.
func recordingTarget(t *testing.T, tls bool) (*httptest.Server, func() []http.Header) {
	var mu sync.Mutex
	var got []http.Header
	s := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		got = append(got, r.Header.Clone())
		mu.Unlock()
		fmt.Fprintf(w, "target %s", r.URL.Path)
	}))
	if tls {
		s.StartTLS()
	} else {
		s.Start()
	}
	t.Cleanup(s.Close)
	return s, func() []http.Header {
		mu.Lock()
		defer mu.Unlock()
		return append([]http.Header(nil), got...)
	}
}

// waitLog waits for a log line for which match is true.
func (p *proxyProc) waitLog(t *testing.T, what string, match func(map[string]any) bool) map[string]any {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		p.mu.Lock()
		logs := append([]map[string]any(nil), p.logs...)
		p.mu.Unlock()
		// match may lock p.mu itself (countLogs), so it runs on a copy.
		for _, m := range logs {
			if match(m) {
				return m
			}
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Fatalf("no log line: %s", what)
	return nil
}

func (p *proxyProc) countLogs(msg string) int {
	p.mu.Lock()
	defer p.mu.Unlock()
	n := 0
	for _, m := range p.logs {
		if m["msg"] == msg {
			n++
		}
	}
	return n
}

func TestChainsThroughUpstreamWithCredentials(t *testing.T) {
	const user, password = "up-user", "up-s3cret-pw"
	up := newFakeUpstream(t, user, password)
	plain, plainHeaders := recordingTarget(t, false)
	secure, _ := recordingTarget(t, true)
	dir := t.TempDir()
	credFile := filepath.Join(dir, "credentials")
	if err := os.WriteFile(credFile, []byte(user+":"+password+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	p := startProxy(t, "-deny-cidrs", "", "-allow", "127.0.0.1", "-agent", "agent-7",
		"-upstream", up.URL, "-upstream-credentials-file", credFile, "-metrics-listen", "127.0.0.1:0")

	// The sandbox sends credentials of its own; they must stop at the proxy.
	sandboxProxy := *p.url
	sandboxProxy.User = url.UserPassword("sandbox", "sandbox-secret")
	client := func(tr *http.Transport) *http.Client {
		tr.Proxy = http.ProxyURL(&sandboxProxy)
		return &http.Client{Transport: tr, Timeout: 10 * time.Second}
	}

	resp, err := client(&http.Transport{}).Get(plain.URL + "/plain")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK || string(body) != "target /plain" {
		t.Fatalf("plain HTTP: %d %q", resp.StatusCode, body)
	}

	tr := secure.Client().Transport.(*http.Transport).Clone()
	resp, err = client(tr).Get(secure.URL + "/tunnel")
	if err != nil {
		t.Fatal(err)
	}
	body, _ = io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK || string(body) != "target /tunnel" {
		t.Fatalf("CONNECT: %d %q", resp.StatusCode, body)
	}
	tr.CloseIdleConnections()

	want := "Basic " + base64.StdEncoding.EncodeToString([]byte(user+":"+password))
	seen := up.requests()
	if len(seen) != 2 || seen[0].method != http.MethodGet || seen[1].method != http.MethodConnect {
		t.Fatalf("upstream saw %+v, want a GET and a CONNECT", seen)
	}
	for _, s := range seen {
		if len(s.proxyAuth) != 1 || s.proxyAuth[0] != want {
			t.Errorf("upstream saw Proxy-Authorization %q on %s, want only the proxy's credentials", s.proxyAuth, s.method)
		}
	}
	for _, h := range plainHeaders() {
		if h.Get("Proxy-Authorization") != "" {
			t.Errorf("the target saw Proxy-Authorization")
		}
	}

	m := p.waitLog(t, "CONNECT access log", func(m map[string]any) bool { return m["msg"] == "egress" && m["method"] == "CONNECT" })
	if m["agent"] != "agent-7" || m["decision"] != "allow" || m["via"] != up.Listener.Addr().String() ||
		m["bytes_in"].(float64) == 0 || m["bytes_out"].(float64) == 0 || m["status"].(float64) != 200 {
		t.Errorf("CONNECT access log: %v", m)
	}
	p.mu.Lock()
	raw := p.raw.String()
	p.mu.Unlock()
	for _, secret := range []string{password, want[len("Basic "):], "sandbox-secret",
		base64.StdEncoding.EncodeToString([]byte("sandbox:sandbox-secret"))} {
		if strings.Contains(raw, secret) {
			t.Errorf("the proxy's log contains a credential %q", secret)
		}
	}

	// Metrics on their own listener.
	listening := p.waitLog(t, "listening", func(m map[string]any) bool { return m["msg"] == "listening" })
	mresp, err := http.Get("http://" + listening["metrics_addr"].(string) + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	metrics, _ := io.ReadAll(mresp.Body)
	mresp.Body.Close()
	for _, line := range []string{
		`agentbox_egress_requests_total{decision="allow",reason=""} 2`,
		`agentbox_egress_request_duration_seconds_count{kind="connect"} 1`,
		`agentbox_egress_config_reloads_total{result="success"} 1`,
		`agentbox_egress_active_tunnels 0`,
	} {
		if !strings.Contains(string(metrics), line+"\n") {
			t.Errorf("/metrics lacks %q", line)
		}
	}
	if !strings.Contains(string(metrics), `agentbox_egress_bytes_total{direction="out"}`) {
		t.Error("/metrics lacks bytes")
	}
	// The proxy port does not serve metrics to sandboxes.
	if resp, err := http.Get(p.url.String() + "/metrics"); err == nil {
		resp.Body.Close()
		if resp.StatusCode == http.StatusOK {
			t.Error("the proxy port serves /metrics")
		}
	}
}

func TestSIGHUPReloadsPolicy(t *testing.T) {
	target, _ := recordingTarget(t, false)
	dir := t.TempDir()
	cfg := filepath.Join(dir, "policy.yaml")
	write := func(s string) {
		if err := os.WriteFile(cfg, []byte(s), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	write("allowedDomains: [only.invalid]\n")
	// A long poll interval, so that only the signal can cause the reload.
	p := startProxy(t, "-deny-cidrs", "", "-config", cfg, "-config-poll", "1h")
	get := func() int {
		resp, err := p.client(nil).Get(target.URL + "/")
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	if code := get(); code != http.StatusForbidden {
		t.Fatalf("before reload: %d, want 403", code)
	}

	write("allowedDomains: [only.invalid, 127.0.0.1]\n")
	if err := p.cmd.Process.Signal(syscall.SIGHUP); err != nil {
		t.Fatal(err)
	}
	p.waitLog(t, "second config applied", func(map[string]any) bool { return p.countLogs("egress config applied") >= 2 })
	if code := get(); code != http.StatusOK {
		t.Fatalf("after reload: %d, want 200", code)
	}

	// A broken file is refused and the policy in force stays.
	write("allowedDomains: [127.0.0.1\n")
	if err := p.cmd.Process.Signal(syscall.SIGHUP); err != nil {
		t.Fatal(err)
	}
	p.waitLog(t, "reload error", func(m map[string]any) bool {
		return m["level"] == "ERROR" && strings.Contains(fmt.Sprint(m["msg"]), "not applied")
	})
	if code := get(); code != http.StatusOK {
		t.Fatalf("after a failed reload: %d, want 200 (the old policy)", code)
	}
}

func TestPollReloadsPolicy(t *testing.T) {
	target, _ := recordingTarget(t, false)
	cfg := filepath.Join(t.TempDir(), "policy.json")
	if err := os.WriteFile(cfg, []byte(`{"allowedDomains": ["127.0.0.1"]}`), 0o600); err != nil {
		t.Fatal(err)
	}
	p := startProxy(t, "-deny-cidrs", "", "-config", cfg, "-config-poll", "50ms")
	resp, err := p.client(nil).Get(target.URL + "/")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("before change: %d", resp.StatusCode)
	}
	if err := os.WriteFile(cfg, []byte(`{"allowedDomains": ["127.0.0.1"], "deniedDomains": ["127.0.0.1"]}`), 0o600); err != nil {
		t.Fatal(err)
	}
	p.waitLog(t, "config applied after change", func(map[string]any) bool { return p.countLogs("egress config applied") >= 2 })
	resp, err = p.client(nil).Get(target.URL + "/")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusForbidden {
		t.Fatalf("after change: %d, want 403", resp.StatusCode)
	}
}

// TestStartupRefusesBadFiles: with no earlier policy to keep, a broken
// file at startup is fatal rather than a proxy that denies or allows
// something unintended.
func TestStartupRefusesBadFiles(t *testing.T) {
	dir := t.TempDir()
	badCfg := filepath.Join(dir, "policy.yaml")
	badCred := filepath.Join(dir, "credentials")
	os.WriteFile(badCfg, []byte("allowDomains: [typo.example]\n"), 0o600)
	os.WriteFile(badCred, []byte("no-colon\n"), 0o600)
	for name, o := range map[string]*options{
		"unknown field":      {configFile: badCfg},
		"missing file":       {configFile: filepath.Join(dir, "absent.yaml")},
		"bad credentials":    {upstream: "http://127.0.0.1:1", credentialsFile: badCred},
		"credentials in URL": {upstream: "http://u:pw@127.0.0.1:1"},
	} {
		o.listen, o.configPoll = "127.0.0.1:0", time.Hour
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		err := run(ctx, o, slog.New(slog.NewTextHandler(io.Discard, nil)))
		cancel()
		if err == nil {
			t.Errorf("%s: started", name)
		}
	}
}

// TestSharedModeClientAuth: with client credentials, a request without
// them gets 407, and an authenticated one is logged under its user name.
func TestSharedModeClientAuth(t *testing.T) {
	target, targetHeaders := recordingTarget(t, false)
	clients := filepath.Join(t.TempDir(), "clients")
	if err := os.WriteFile(clients, []byte("agent-a:pw-a\nagent-b:pw-b\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	p := startProxy(t, "-deny-cidrs", "", "-allow", "127.0.0.1", "-client-credentials-file", clients)

	resp, err := p.client(nil).Get(target.URL + "/anon")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusProxyAuthRequired {
		t.Errorf("without credentials: %d, want 407", resp.StatusCode)
	}

	withCreds := *p.url
	withCreds.User = url.UserPassword("agent-b", "pw-b")
	c := &http.Client{Transport: &http.Transport{Proxy: http.ProxyURL(&withCreds)}, Timeout: 10 * time.Second}
	resp, err = c.Get(target.URL + "/b")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("with credentials: %d", resp.StatusCode)
	}
	m := p.waitLog(t, "agent-b's request", func(m map[string]any) bool { return m["msg"] == "egress" && m["status"] == float64(200) })
	if m["agent"] != "agent-b" {
		t.Errorf("access log agent: %v", m)
	}
	for _, h := range targetHeaders() {
		if h.Get("Proxy-Authorization") != "" {
			t.Error("the client's credentials reached the target")
		}
	}
	p.mu.Lock()
	raw := p.raw.String()
	p.mu.Unlock()
	if strings.Contains(raw, "pw-b") || strings.Contains(raw, base64.StdEncoding.EncodeToString([]byte("agent-b:pw-b"))) {
		t.Error("the log contains a client's password")
	}
}
