package main

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/agentbox/terraform-provider-agentbox/internal/pki"
)

// credTarget is a loopback destination with a certificate from a CA of the
// test's own (for "localhost" and 127.0.0.1), recording the headers of
// each request it gets.
type credTarget struct {
	*httptest.Server
	mu  sync.Mutex
	got []http.Header
}

func newCredTarget(t *testing.T, ca *pki.CA, useTLS bool) *credTarget {
	t.Helper()
	c := &credTarget{}
	c.Server = httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		c.mu.Lock()
		c.got = append(c.got, r.Header.Clone())
		c.mu.Unlock()
		fmt.Fprintf(w, "target %s", r.URL.Path)
	}))
	if useTLS {
		leaf, err := ca.Issue(pki.LeafOptions{
			ID: pki.SandboxID("", "test", "destination"), Usage: pki.UsageServer,
			DNSNames: []string{"localhost"}, IPAddresses: []net.IP{net.IPv4(127, 0, 0, 1)},
		})
		if err != nil {
			t.Fatal(err)
		}
		cert, err := leaf.TLSCertificate()
		if err != nil {
			t.Fatal(err)
		}
		c.TLS = &tls.Config{Certificates: []tls.Certificate{cert}}
		c.StartTLS()
	} else {
		c.Start()
	}
	t.Cleanup(c.Close)
	return c
}

func (c *credTarget) headers() []http.Header {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]http.Header(nil), c.got...)
}

func (c *credTarget) port() string {
	_, port, _ := net.SplitHostPort(c.Listener.Addr().String())
	return port
}

// credSetup is what a proxy with credentials needs on disk: the
// interception CA, the destinations' CA bundle, the secret and the policy
// file naming it.
type credSetup struct {
	dir, secretFile, configFile string
	interceptCA, destCA         *pki.CA
	args                        []string
}

const testSecret = "s3cret-api-key-1f9d"

func newCredSetup(t *testing.T, destCA *pki.CA) *credSetup {
	t.Helper()
	dir := t.TempDir()
	s := &credSetup{dir: dir, destCA: destCA}
	var err error
	if s.interceptCA, err = pki.NewCA("test egress interception CA"); err != nil {
		t.Fatal(err)
	}
	keyPEM, err := s.interceptCA.KeyPEM()
	if err != nil {
		t.Fatal(err)
	}
	write := func(name string, b []byte) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, b, 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	caCert := write("ca.crt", s.interceptCA.CertPEM)
	caKey := write("ca.key", keyPEM)
	bundle := write("destinations.pem", destCA.CertPEM)
	// A trailing newline as "echo secret > file" leaves; it is not sent.
	s.secretFile = write("token", []byte(testSecret+"\n"))
	s.configFile = write("policy.yaml", []byte(`allowedDomains: [localhost, 127.0.0.1]
credentials:
- name: api-token
  hosts: [localhost]
  header:
    name: Authorization
    valueTemplate: "Bearer {{secret}}"
  secretFile: `+s.secretFile+"\n"))
	s.args = []string{"-deny-cidrs", "", "-config", s.configFile, "-config-poll", "100ms",
		"-intercept-ca-cert-file", caCert, "-intercept-ca-key-file", caKey,
		"-destination-ca-file", bundle, "-metrics-listen", "127.0.0.1:0"}
	return s
}

// sandboxClient trusts what a sandbox's trust store holds: the "public"
// roots (here the destinations' CA) and the proxy's interception CA.
func (s *credSetup) sandboxClient(p *proxyProc) (*http.Client, *http.Transport) {
	roots := x509.NewCertPool()
	roots.AddCert(s.destCA.Cert)
	roots.AddCert(s.interceptCA.Cert)
	tr := &http.Transport{TLSClientConfig: &tls.Config{RootCAs: roots}}
	return p.client(tr), tr
}

func get(t *testing.T, c *http.Client, u string, hdr http.Header) (*http.Response, string) {
	t.Helper()
	req, err := http.NewRequest(http.MethodGet, u, nil)
	if err != nil {
		t.Fatal(err)
	}
	for k, v := range hdr {
		req.Header[k] = v
	}
	resp, err := c.Do(req)
	if err != nil {
		t.Fatalf("GET %s: %v", u, err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	return resp, string(body)
}

func TestCredentialInjection(t *testing.T) {
	destCA, err := pki.NewCA("test destination CA")
	if err != nil {
		t.Fatal(err)
	}
	withCred := newCredTarget(t, destCA, true)       // https://localhost: gets the credential
	withoutCred := newCredTarget(t, destCA, true)    // https://127.0.0.1: gets none, tunnelled
	plainWithCred := newCredTarget(t, destCA, false) // http://localhost
	s := newCredSetup(t, destCA)
	p := startProxy(t, s.args...)
	client, tr := s.sandboxClient(p)

	// HTTPS with a credential: the agent sends a placeholder, the
	// destination gets the secret, and the certificate the agent saw came
	// from the proxy's CA.
	placeholder := http.Header{"Authorization": {"Bearer PLACEHOLDER"}, "X-Agent-Header": {"kept"}}
	resp, body := get(t, client, "https://localhost:"+withCred.port()+"/v1/models", placeholder)
	if resp.StatusCode != http.StatusOK || body != "target /v1/models" {
		t.Fatalf("intercepted HTTPS: %d %q", resp.StatusCode, body)
	}
	if got := resp.TLS.PeerCertificates[0].Issuer.CommonName; got != "test egress interception CA" {
		t.Errorf("the agent saw a certificate issued by %q, want the interception CA", got)
	}
	h := withCred.headers()
	if len(h) != 1 || h[0].Get("Authorization") != "Bearer "+testSecret || len(h[0]["Authorization"]) != 1 || h[0].Get("X-Agent-Header") != "kept" {
		t.Fatalf("destination with credential got %v", h)
	}
	// A second request on the same intercepted connection also gets it.
	get(t, client, "https://localhost:"+withCred.port()+"/again", nil)
	if h := withCred.headers(); len(h) != 2 || h[1].Get("Authorization") != "Bearer "+testSecret {
		t.Fatalf("second request got %v", h)
	}

	// HTTPS without a credential: a plain tunnel; the agent talks TLS to
	// the destination itself and its header arrives untouched.
	resp, body = get(t, client, "https://127.0.0.1:"+withoutCred.port()+"/free", placeholder)
	if resp.StatusCode != http.StatusOK || body != "target /free" {
		t.Fatalf("tunnelled HTTPS: %d %q", resp.StatusCode, body)
	}
	if got := resp.TLS.PeerCertificates[0].Issuer.CommonName; got != "test destination CA" {
		t.Errorf("the tunnelled destination's certificate was issued by %q, want the destination's own CA", got)
	}
	if h := withoutCred.headers(); len(h) != 1 || h[0].Get("Authorization") != "Bearer PLACEHOLDER" {
		t.Fatalf("destination without credential got %v", h)
	}

	// Plain HTTP with a credential: added on the way out.
	resp, body = get(t, client, "http://localhost:"+plainWithCred.port()+"/plain", nil)
	if resp.StatusCode != http.StatusOK || body != "target /plain" {
		t.Fatalf("plain HTTP: %d %q", resp.StatusCode, body)
	}
	if h := plainWithCred.headers(); len(h) != 1 || h[0].Get("Authorization") != "Bearer "+testSecret {
		t.Fatalf("plain destination got %v", h)
	}

	tr.CloseIdleConnections() // ends the tunnels so their log lines are written
	inner := p.waitLog(t, "intercepted request", func(m map[string]any) bool {
		return m["msg"] == "egress" && m["method"] == "GET" && m["host"] == "localhost" && m["port"] == withCred.port()
	})
	if inner["credential"] != "api-token" || inner["intercepted"] != true || inner["decision"] != "allow" || inner["status"].(float64) != 200 {
		t.Errorf("intercepted request's log line: %v", inner)
	}
	p.waitLog(t, "intercepted CONNECT", func(m map[string]any) bool {
		return m["msg"] == "egress" && m["method"] == "CONNECT" && m["host"] == "localhost" && m["intercepted"] == true
	})
	tunnel := p.waitLog(t, "tunnelled CONNECT", func(m map[string]any) bool {
		return m["msg"] == "egress" && m["method"] == "CONNECT" && m["host"] == "127.0.0.1"
	})
	if tunnel["intercepted"] != false || tunnel["credential"] != "" {
		t.Errorf("tunnel's log line: %v", tunnel)
	}
	plainLog := p.waitLog(t, "plain request", func(m map[string]any) bool {
		return m["msg"] == "egress" && m["method"] == "GET" && m["port"] == plainWithCred.port()
	})
	if plainLog["credential"] != "api-token" {
		t.Errorf("plain request's log line: %v", plainLog)
	}
	p.mu.Lock()
	raw := p.raw.String()
	p.mu.Unlock()
	if strings.Contains(raw, testSecret) {
		t.Error("the secret appears in the proxy's log")
	}

	listening := p.waitLog(t, "listening", func(m map[string]any) bool { return m["msg"] == "listening" })
	mresp, err := http.Get("http://" + listening["metrics_addr"].(string) + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	metrics, _ := io.ReadAll(mresp.Body)
	mresp.Body.Close()
	for _, line := range []string{
		`agentbox_egress_credential_injections_total{credential="api-token",scheme="https"} 2`,
		`agentbox_egress_credential_injections_total{credential="api-token",scheme="http"} 1`,
	} {
		if !strings.Contains(string(metrics), line+"\n") {
			t.Errorf("/metrics lacks %q", line)
		}
	}

	// A rotated secret is picked up like an edited policy, without a restart.
	if err := os.WriteFile(s.secretFile, []byte("rotated-key-77"), 0o600); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		get(t, client, "http://localhost:"+plainWithCred.port()+"/rotated", nil)
		h := plainWithCred.headers()
		if h[len(h)-1].Get("Authorization") == "Bearer rotated-key-77" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("rotated secret not used: %v", h[len(h)-1])
		}
		time.Sleep(100 * time.Millisecond)
	}
}

func TestCredentialDestinationVerified(t *testing.T) {
	destCA, err := pki.NewCA("test destination CA")
	if err != nil {
		t.Fatal(err)
	}
	target := newCredTarget(t, destCA, true)
	// The proxy trusts another CA than the one that signed the destination:
	// it must refuse to send the credential there.
	otherCA, err := pki.NewCA("some other CA")
	if err != nil {
		t.Fatal(err)
	}
	s := newCredSetup(t, otherCA)
	p := startProxy(t, s.args...)
	client, _ := s.sandboxClient(p)

	resp, body := get(t, client, "https://localhost:"+target.port()+"/secret", nil)
	if resp.StatusCode != http.StatusBadGateway || !strings.Contains(body, "certificate signed by unknown authority") {
		t.Fatalf("want 502 naming the unknown authority, got %d %q", resp.StatusCode, body)
	}
	if h := target.headers(); len(h) != 0 {
		t.Fatalf("the destination got a request: %v", h)
	}
	m := p.waitLog(t, "refused request", func(m map[string]any) bool {
		return m["msg"] == "egress" && m["method"] == "GET" && m["host"] == "localhost"
	})
	if m["decision"] != "error" || m["reason"] != "upstream_tls" {
		t.Errorf("log line: %v", m)
	}

	// A sandbox that does not trust the proxy's CA fails the handshake,
	// and the proxy's log says why.
	plain := p.client(&http.Transport{TLSClientConfig: &tls.Config{RootCAs: destCA.Pool()}})
	if _, err := plain.Get("https://localhost:" + target.port() + "/"); err == nil || !strings.Contains(err.Error(), "certificate") {
		t.Fatalf("client without the interception CA: %v", err)
	}
	p.waitLog(t, "client handshake failure", func(m map[string]any) bool {
		return m["msg"] == "egress" && m["method"] == "CONNECT" && m["reason"] == "client_tls"
	})
}

func TestCredentialsNeedInterceptionCA(t *testing.T) {
	dir := t.TempDir()
	secret := filepath.Join(dir, "token")
	os.WriteFile(secret, []byte("x"), 0o600)
	cfg := filepath.Join(dir, "policy.yaml")
	os.WriteFile(cfg, []byte("allowedDomains: [localhost]\ncredentials:\n- name: t\n  hosts: [localhost]\n  header: {name: X-Key}\n  secretFile: "+secret+"\n"), 0o600)
	o := &options{listen: "127.0.0.1:0", configPoll: time.Hour, configFile: cfg}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	err := run(ctx, o, slog.New(slog.NewTextHandler(io.Discard, nil)))
	if err == nil || !strings.Contains(err.Error(), "credentials need an interception CA") {
		t.Fatalf("want a refusal naming the missing CA, got %v", err)
	}
}
