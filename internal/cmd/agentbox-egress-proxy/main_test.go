package main

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// These tests run the real binary and send traffic only to 127.0.0.1: the
// upstreams are local httptest servers, and "localhost" resolves through
// /etc/hosts. Denials of other addresses are unit tests in egressproxy, with
// a fake resolver and dialer, so that nothing is ever sent elsewhere.

var binary string

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "egress-proxy-test-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	binary = filepath.Join(dir, "agentbox-egress-proxy")
	cmd := exec.Command("go", "build", "-o", binary, ".")
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := cmd.CombinedOutput(); err != nil {
		fmt.Fprintf(os.Stderr, "go build: %v\n%s", err, out)
		os.RemoveAll(dir)
		os.Exit(1)
	}
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

type proxyProc struct {
	url  *url.URL
	cmd  *exec.Cmd
	mu   sync.Mutex
	logs []map[string]any
	raw  strings.Builder // every line, to search for what must not be logged
}

// startProxy runs the binary on a free loopback port and collects its JSON
// log lines.
func startProxy(t *testing.T, args ...string) *proxyProc {
	t.Helper()
	cmd := exec.Command(binary, append([]string{"-listen", "127.0.0.1:0"}, args...)...)
	// The proxy must not inherit a proxy or policy from the environment
	// the tests run in.
	cmd.Env = []string{"PATH=" + os.Getenv("PATH")}
	stderr, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cmd.Process.Kill()
		cmd.Wait()
	})
	p := &proxyProc{cmd: cmd}
	addr := make(chan string, 1)
	go func() {
		sc := bufio.NewScanner(stderr)
		for sc.Scan() {
			p.mu.Lock()
			p.raw.WriteString(sc.Text() + "\n")
			p.mu.Unlock()
			var m map[string]any
			if json.Unmarshal(sc.Bytes(), &m) != nil {
				t.Logf("proxy: %s", sc.Text())
				continue
			}
			t.Logf("proxy: %s", sc.Text())
			if m["msg"] == "listening" {
				addr <- m["addr"].(string)
			}
			p.mu.Lock()
			p.logs = append(p.logs, m)
			p.mu.Unlock()
		}
	}()
	select {
	case a := <-addr:
		p.url = &url.URL{Scheme: "http", Host: a}
	case <-time.After(20 * time.Second):
		t.Fatal("proxy did not report its address")
	}
	return p
}

// accessLog waits for the access-log line about host.
func (p *proxyProc) accessLog(t *testing.T, host string) map[string]any {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for time.Now().Before(deadline) {
		p.mu.Lock()
		for _, m := range p.logs {
			if m["msg"] == "egress" && m["host"] == host {
				p.mu.Unlock()
				return m
			}
		}
		p.mu.Unlock()
		time.Sleep(20 * time.Millisecond)
	}
	t.Fatalf("no access-log line for %s", host)
	return nil
}

func (p *proxyProc) client(tr *http.Transport) *http.Client {
	if tr == nil {
		tr = &http.Transport{}
	}
	tr.Proxy = http.ProxyURL(p.url)
	return &http.Client{Transport: tr, Timeout: 10 * time.Second}
}

// upstream is a loopback HTTP server that counts the connections it gets,
// so a test can tell "refused before connecting" from "refused by upstream".
type upstream struct {
	*httptest.Server
	conns atomic.Int64
}

func newUpstream(t *testing.T, tls bool) *upstream {
	u := &upstream{}
	u.Server = httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprintf(w, "hello from upstream %s", r.URL.Path)
	}))
	u.Config.ConnState = func(_ net.Conn, s http.ConnState) {
		if s == http.StateNew {
			u.conns.Add(1)
		}
	}
	if tls {
		u.StartTLS()
	} else {
		u.Start()
	}
	t.Cleanup(u.Close)
	return u
}

func (u *upstream) port() string {
	_, port, _ := net.SplitHostPort(u.Listener.Addr().String())
	return port
}

func TestAllowedRequestsReachUpstream(t *testing.T) {
	plain := newUpstream(t, false)
	secure := newUpstream(t, true)
	// Loopback is denied by default; replacing the denied ranges with none
	// and allowing the one address lets the proxy reach the local upstreams.
	p := startProxy(t, "-deny-cidrs", "", "-allow", "127.0.0.1")

	resp, err := p.client(nil).Get(plain.URL + "/plain")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK || string(body) != "hello from upstream /plain" {
		t.Fatalf("plain HTTP: %d %q", resp.StatusCode, body)
	}
	m := p.accessLog(t, "127.0.0.1")
	if m["decision"] != "allow" || m["method"] != "GET" || m["port"] != plain.port() || m["bytes_out"].(float64) != float64(len(body)) {
		t.Errorf("access log: %v", m)
	}

	// CONNECT: the test client speaks TLS to the upstream through the tunnel.
	tr := secure.Client().Transport.(*http.Transport).Clone()
	resp, err = p.client(tr).Get(secure.URL + "/tunnel")
	if err != nil {
		t.Fatal(err)
	}
	body, _ = io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK || string(body) != "hello from upstream /tunnel" {
		t.Fatalf("CONNECT: %d %q", resp.StatusCode, body)
	}
	tr.CloseIdleConnections() // ends the tunnel so its log line is written
	deadline := time.Now().Add(5 * time.Second)
	for {
		var connect map[string]any
		p.mu.Lock()
		for _, m := range p.logs {
			if m["msg"] == "egress" && m["method"] == "CONNECT" {
				connect = m
			}
		}
		p.mu.Unlock()
		if connect != nil {
			if connect["decision"] != "allow" || connect["port"] != secure.port() || connect["bytes_in"].(float64) == 0 || connect["bytes_out"].(float64) == 0 {
				t.Errorf("CONNECT access log: %v", connect)
			}
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("no access-log line for the CONNECT tunnel")
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func TestDeniedHostGets403WithoutConnecting(t *testing.T) {
	up := newUpstream(t, false)
	// No denied ranges, so only the name rules can refuse.
	p := startProxy(t, "-deny-cidrs", "", "-allow", "allowed.invalid", "-allow", "*,blocked.invalid", "-deny", "127.0.0.1")

	resp, err := p.client(nil).Get(up.URL)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusForbidden || resp.Header.Get("X-Agentbox-Egress-Denied") != "denylisted" {
		t.Errorf("denylisted host: %d %q, want 403 denylisted", resp.StatusCode, resp.Header.Get("X-Agentbox-Egress-Denied"))
	}
	// CONNECT is refused the same way; Go reports the proxy's status.
	_, err = p.client(nil).Get("https://127.0.0.1:" + up.port() + "/")
	if err == nil || !strings.Contains(err.Error(), "Forbidden") {
		t.Errorf("denied CONNECT: err = %v, want the proxy's 403", err)
	}
	if m := p.accessLog(t, "127.0.0.1"); m["decision"] != "deny" || m["reason"] != "denylisted" || m["status"].(float64) != 403 {
		t.Errorf("access log: %v", m)
	}
	if n := up.conns.Load(); n != 0 {
		t.Errorf("upstream got %d connections from a denied request", n)
	}
}

func TestNotAllowedHostGets403WithoutConnecting(t *testing.T) {
	up := newUpstream(t, false)
	p := startProxy(t, "-deny-cidrs", "", "-allow", "only.invalid")
	resp, err := p.client(nil).Get(up.URL)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusForbidden || resp.Header.Get("X-Agentbox-Egress-Denied") != "not_allowed" {
		t.Errorf("got %d %q, want 403 not_allowed", resp.StatusCode, resp.Header.Get("X-Agentbox-Egress-Denied"))
	}
	if n := up.conns.Load(); n != 0 {
		t.Errorf("upstream got %d connections from a denied request", n)
	}
}

func TestLocalhostRefusedAfterResolution(t *testing.T) {
	up := newUpstream(t, false)
	// The name is allowed; the default denied ranges must still stop it
	// once it resolves to 127.0.0.1.
	p := startProxy(t, "-allow", "localhost")
	resp, err := p.client(nil).Get("http://localhost:" + up.port() + "/")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusForbidden || resp.Header.Get("X-Agentbox-Egress-Denied") != "denied_ip" {
		t.Errorf("got %d %q %q, want 403 denied_ip", resp.StatusCode, resp.Header.Get("X-Agentbox-Egress-Denied"), body)
	}
	if !strings.Contains(string(body), "127.0.0.1") {
		t.Errorf("body %q does not name the resolved address", body)
	}
	if m := p.accessLog(t, "localhost"); m["decision"] != "deny" || m["reason"] != "denied_ip" {
		t.Errorf("access log: %v", m)
	}
	if n := up.conns.Load(); n != 0 {
		t.Errorf("upstream got %d connections", n)
	}
}

func TestParseOptions(t *testing.T) {
	noEnv := func(string) (string, bool) { return "", false }
	o, err := parseOptions(nil, noEnv, io.Discard)
	if err != nil || o.deniedCIDRs != nil || len(o.allow) != 0 {
		t.Fatalf("defaults: %+v, %v", o, err)
	}
	o, err = parseOptions([]string{"-deny-cidrs", "", "-allow", "a.example,*.b.example", "-allow", "c.example"}, noEnv, io.Discard)
	if err != nil || o.deniedCIDRs == nil || len(o.deniedCIDRs) != 0 || strings.Join(o.allow, " ") != "a.example *.b.example c.example" {
		t.Fatalf("flags: %+v, %v", o, err)
	}
	env := func(k string) (string, bool) {
		return map[string]string{"AGENTBOX_EGRESS_ALLOW": "e.example", "AGENTBOX_EGRESS_DENY_CIDRS": ""}[k],
			k == "AGENTBOX_EGRESS_ALLOW" || k == "AGENTBOX_EGRESS_DENY_CIDRS"
	}
	o, err = parseOptions(nil, env, io.Discard)
	if err != nil || o.deniedCIDRs == nil || len(o.deniedCIDRs) != 0 || strings.Join(o.allow, " ") != "e.example" {
		t.Fatalf("env: %+v, %v", o, err)
	}
	// A flag replaces the environment's list rather than adding to it.
	o, err = parseOptions([]string{"-allow", "f.example"}, env, io.Discard)
	if err != nil || strings.Join(o.allow, " ") != "f.example" {
		t.Fatalf("flag over env: %+v, %v", o, err)
	}
	if _, err := parseOptions([]string{"-deny-cidrs", "nope"}, noEnv, io.Discard); err == nil {
		t.Error("bad CIDR accepted")
	}
	if o.configPoll != 5*time.Second || o.metricsListen != "" || o.upstream != "" {
		t.Errorf("defaults for reload, metrics, upstream: %+v", o)
	}
	chainEnv := func(k string) (string, bool) {
		v, ok := map[string]string{
			"AGENTBOX_EGRESS_UPSTREAM":                  "http://up.example:3128",
			"AGENTBOX_EGRESS_UPSTREAM_CREDENTIALS_FILE": "/secret/credentials",
			"AGENTBOX_EGRESS_AGENT":                     "agent-1",
			"AGENTBOX_EGRESS_METRICS_LISTEN":            ":9090",
			"AGENTBOX_EGRESS_CONFIG":                    "/config/policy.yaml",
			"AGENTBOX_EGRESS_CONFIG_POLL":               "2s",
		}[k]
		return v, ok
	}
	o, err = parseOptions(nil, chainEnv, io.Discard)
	if err != nil || o.upstream != "http://up.example:3128" || o.credentialsFile != "/secret/credentials" ||
		o.agent != "agent-1" || o.metricsListen != ":9090" || o.configFile != "/config/policy.yaml" || o.configPoll != 2*time.Second {
		t.Fatalf("env for chaining, metrics, reload: %+v, %v", o, err)
	}
	for _, bad := range [][]string{
		{"-config-poll", "0s"},
		{"-config-poll", "soon"},
		{"-upstream-credentials-file", "/secret/credentials"}, // without -upstream
	} {
		if _, err := parseOptions(bad, noEnv, io.Discard); err == nil {
			t.Errorf("%q accepted", bad)
		}
	}
}
