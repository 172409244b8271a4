package main

import (
	"encoding/base64"
	"io"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/agentbox/terraform-provider-agentbox/internal/pki"
)

// TestChainedCredentialInjection: with an upstream proxy and a credential
// both configured, an HTTPS destination with the credential is reached by
// terminating the sandbox's TLS, tunnelling through the upstream (CONNECT
// with the upstream's credentials) and opening a new TLS connection to the
// destination inside that tunnel, verified against the destination CA
// bundle; the destination gets the credential. A destination without one
// is a plain tunnel through the same upstream.
func TestChainedCredentialInjection(t *testing.T) {
	const user, password = "up-user", "up-s3cret-pw"
	up := newFakeUpstream(t, user, password)
	upAuth := "Basic " + base64.StdEncoding.EncodeToString([]byte(user+":"+password))
	destCA, err := pki.NewCA("test destination CA")
	if err != nil {
		t.Fatal(err)
	}
	withCred := newCredTarget(t, destCA, true)    // https://localhost: gets the credential
	withoutCred := newCredTarget(t, destCA, true) // https://127.0.0.1: tunnelled
	s := newCredSetup(t, destCA)
	credFile := filepath.Join(s.dir, "upstream-credentials")
	if err := os.WriteFile(credFile, []byte(user+":"+password+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	p := startProxy(t, append(s.args, "-agent", "agent-7", "-upstream", up.URL, "-upstream-credentials-file", credFile)...)
	client, tr := s.sandboxClient(p)
	// The sandbox sends credentials of its own; they must stop at the proxy.
	sandboxProxy := *p.url
	sandboxProxy.User = url.UserPassword("sandbox", "sandbox-secret")
	tr.Proxy = http.ProxyURL(&sandboxProxy)

	placeholder := http.Header{"Authorization": {"Bearer PLACEHOLDER"}}
	for _, path := range []string{"/v1/models", "/again"} {
		resp, body := get(t, client, "https://localhost:"+withCred.port()+path, placeholder)
		if resp.StatusCode != http.StatusOK || body != "target "+path {
			t.Fatalf("intercepted HTTPS through the upstream, %s: %d %q", path, resp.StatusCode, body)
		}
		if got := resp.TLS.PeerCertificates[0].Issuer.CommonName; got != "test egress interception CA" {
			t.Errorf("the agent saw a certificate issued by %q, want the interception CA", got)
		}
	}
	for i, h := range withCred.headers() {
		if got := h.Values("Authorization"); len(got) != 1 || got[0] != "Bearer "+testSecret {
			t.Errorf("request %d: the destination got Authorization %q, want the injected credential only", i, got)
		}
		if h.Get("Proxy-Authorization") != "" {
			t.Errorf("request %d: the destination got a Proxy-Authorization header", i)
		}
	}
	if n := len(withCred.headers()); n != 2 {
		t.Fatalf("the destination with the credential got %d requests, want 2", n)
	}

	resp, body := get(t, client, "https://127.0.0.1:"+withoutCred.port()+"/free", nil)
	if resp.StatusCode != http.StatusOK || body != "target /free" {
		t.Fatalf("tunnelled HTTPS through the upstream: %d %q", resp.StatusCode, body)
	}
	if got := resp.TLS.PeerCertificates[0].Issuer.CommonName; got != "test destination CA" {
		t.Errorf("the tunnelled destination's certificate was issued by %q, want the destination's own CA", got)
	}
	if h := withoutCred.headers(); len(h) != 1 || h[0].Get("Authorization") != "" || h[0].Get("Proxy-Authorization") != "" {
		t.Fatalf("the destination without a credential got %v, want no Authorization", h)
	}

	// Both destinations were reached through the upstream only, each by one
	// CONNECT (the intercepted one's connection is kept for the second
	// request) carrying the upstream's credentials and nothing of the
	// sandbox's.
	seen := up.requests()
	wantTargets := []string{"localhost:" + withCred.port(), "127.0.0.1:" + withoutCred.port()}
	if len(seen) != len(wantTargets) {
		t.Fatalf("upstream saw %+v, want a CONNECT to each of %v", seen, wantTargets)
	}
	for i, s := range seen {
		if s.method != http.MethodConnect || s.target != wantTargets[i] {
			t.Errorf("upstream request %d: %s %s, want CONNECT %s", i, s.method, s.target, wantTargets[i])
		}
		if len(s.proxyAuth) != 1 || s.proxyAuth[0] != upAuth {
			t.Errorf("upstream request %d carried Proxy-Authorization %q, want only the upstream's credentials", i, s.proxyAuth)
		}
	}

	tr.CloseIdleConnections() // ends the tunnels so their log lines are written
	upAddr := up.Listener.Addr().String()
	isInner := func(m map[string]any) bool {
		return m["msg"] == "egress" && m["method"] == "GET" && m["host"] == "localhost" && m["port"] == withCred.port()
	}
	p.waitLog(t, "both intercepted requests", func(map[string]any) bool { return countMatching(p, isInner) == 2 })
	for _, m := range matching(p, isInner) {
		if m["credential"] != "api-token" || m["intercepted"] != true || m["decision"] != "allow" ||
			m["status"].(float64) != 200 || m["via"] != upAddr || m["upstream"] != upAddr || m["agent"] != "agent-7" {
			t.Errorf("intercepted request's log line: %v", m)
		}
	}
	p.waitLog(t, "intercepted CONNECT", func(m map[string]any) bool {
		return m["msg"] == "egress" && m["method"] == "CONNECT" && m["host"] == "localhost" && m["intercepted"] == true
	})
	tunnel := p.waitLog(t, "tunnelled CONNECT", func(m map[string]any) bool {
		return m["msg"] == "egress" && m["method"] == "CONNECT" && m["host"] == "127.0.0.1"
	})
	if tunnel["intercepted"] != false || tunnel["credential"] != "" || tunnel["via"] != upAddr || tunnel["decision"] != "allow" {
		t.Errorf("tunnel's log line: %v", tunnel)
	}
	p.mu.Lock()
	raw := p.raw.String()
	p.mu.Unlock()
	for _, secret := range []string{testSecret, password, upAuth[len("Basic "):], "sandbox-secret",
		base64.StdEncoding.EncodeToString([]byte("sandbox:sandbox-secret"))} {
		if strings.Contains(raw, secret) {
			t.Errorf("the proxy's log contains a secret %q", secret)
		}
	}

	metrics := scrapeMetrics(t, p)
	if line := `agentbox_egress_credential_injections_total{credential="api-token",scheme="https"} 2`; !strings.Contains(metrics, line+"\n") {
		t.Errorf("/metrics lacks %q", line)
	}
	if strings.Contains(metrics, `scheme="http"}`) {
		t.Error("/metrics counts a plain HTTP injection; there was none")
	}
}

// TestChainedCredentialUpstreamRefuses: when the upstream refuses the
// CONNECT for an intercepted destination, the sandbox gets a 502 (never the
// upstream's 407) and the log names the upstream's refusal.
func TestChainedCredentialUpstreamRefuses(t *testing.T) {
	up := newFakeUpstream(t, "up-user", "up-s3cret-pw")
	destCA, err := pki.NewCA("test destination CA")
	if err != nil {
		t.Fatal(err)
	}
	target := newCredTarget(t, destCA, true)
	s := newCredSetup(t, destCA)
	credFile := filepath.Join(s.dir, "upstream-credentials")
	if err := os.WriteFile(credFile, []byte("up-user:wrong-pw\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	p := startProxy(t, append(s.args, "-upstream", up.URL, "-upstream-credentials-file", credFile)...)
	client, _ := s.sandboxClient(p)

	resp, body := get(t, client, "https://localhost:"+target.port()+"/secret", nil)
	if resp.StatusCode != http.StatusBadGateway || resp.Header.Get("Proxy-Authenticate") != "" {
		t.Fatalf("want 502 without Proxy-Authenticate, got %d %v %q", resp.StatusCode, resp.Header, body)
	}
	if h := target.headers(); len(h) != 0 {
		t.Fatalf("the destination got a request: %v", h)
	}
	if seen := up.requests(); len(seen) == 0 || seen[0].method != http.MethodConnect {
		t.Fatalf("upstream saw %+v, want the CONNECT it refused", seen)
	}
	m := p.waitLog(t, "refused request", func(m map[string]any) bool {
		return m["msg"] == "egress" && m["method"] == "GET" && m["host"] == "localhost"
	})
	if m["decision"] != "error" || m["reason"] != "upstream_auth" || m["status"].(float64) != 502 {
		t.Errorf("log line: %v", m)
	}
}

// matching returns the log lines for which match is true.
func matching(p *proxyProc, match func(map[string]any) bool) []map[string]any {
	p.mu.Lock()
	defer p.mu.Unlock()
	var out []map[string]any
	for _, m := range p.logs {
		if match(m) {
			out = append(out, m)
		}
	}
	return out
}

func countMatching(p *proxyProc, match func(map[string]any) bool) int {
	return len(matching(p, match))
}

// scrapeMetrics returns the proxy's /metrics page.
func scrapeMetrics(t *testing.T, p *proxyProc) string {
	t.Helper()
	listening := p.waitLog(t, "listening", func(m map[string]any) bool { return m["msg"] == "listening" })
	resp, err := http.Get("http://" + listening["metrics_addr"].(string) + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}
