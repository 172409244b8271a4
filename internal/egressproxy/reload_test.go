package egressproxy

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

func writeFile(t *testing.T, path, content string) {
	t.Helper()
	if err := os.WriteFile(path, []byte(content), 0o600); err != nil {
		t.Fatal(err)
	}
}

func allows(p *Proxy, host string) bool { return p.policy.Load().checkHost(host) == nil }

func TestReloadValidAndInvalid(t *testing.T) {
	dir := t.TempDir()
	cfgPath := filepath.Join(dir, "policy.yaml")
	credPath := filepath.Join(dir, "credentials")
	writeFile(t, cfgPath, "allowedDomains: [a.example, '*.wild.example']\ndeniedDomains: [bad.wild.example]\ndeniedCIDRs: [203.0.113.0/24]\n")
	writeFile(t, credPath, "user:first-pw\n")

	p, _, _ := newTestProxy(t, Config{})
	logBuf := &logBuffer{}
	r := &Reloader{
		Proxy: p, Base: Policy{Allow: []string{"flag.example"}},
		ConfigFile: cfgPath, CredentialsFile: credPath,
		Log: slog.New(slog.NewJSONHandler(logBuf, nil)),
	}
	if err := r.Reload(); err != nil {
		t.Fatal(err)
	}
	for host, want := range map[string]bool{
		"a.example": true, "x.wild.example": true, "bad.wild.example": false,
		"flag.example": true, "b.example": false,
	} {
		if allows(p, host) != want {
			t.Errorf("after load: allows(%s) = %v, want %v", host, !want, want)
		}
	}
	pol := p.policy.Load()
	// The file's CIDRs add to the defaults; they never replace them.
	for _, a := range []string{"203.0.113.5", "10.0.0.1", "169.254.169.254"} {
		if _, bad := pol.deniedAddr(netip.MustParseAddr(a)); !bad {
			t.Errorf("%s not denied", a)
		}
	}
	firstAuth := *p.upAuth.Load()

	// Each of these is refused as a whole and the policy stays.
	for name, content := range map[string]string{
		"unknown field": "allowDomains: [b.example]\n",
		"bad pattern":   "allowedDomains: [b.example, 'a.*.example']\n",
		"bad CIDR":      "allowedDomains: [b.example]\ndeniedCIDRs: [10.0.0.0/33]\n",
		"not YAML":      "allowedDomains: [b.example\n",
	} {
		writeFile(t, cfgPath, content)
		if err := r.Reload(); err == nil {
			t.Errorf("%s: accepted", name)
		}
		if !allows(p, "a.example") || allows(p, "b.example") {
			t.Errorf("%s: the old policy did not stay", name)
		}
	}
	// A good policy with bad credentials changes neither.
	writeFile(t, cfgPath, `{"allowedDomains": ["b.example"]}`)
	writeFile(t, credPath, "no-colon-secret\n")
	if err := r.Reload(); err == nil {
		t.Error("bad credentials accepted")
	}
	if !allows(p, "a.example") || allows(p, "b.example") || *p.upAuth.Load() != firstAuth {
		t.Error("a half-applied reload: policy or credentials changed")
	}
	if strings.Contains(logBuf.String(), "no-colon-secret") || strings.Contains(logBuf.String(), "first-pw") {
		t.Errorf("credentials in the log: %s", logBuf.String())
	}
	// Fixed: both apply (JSON works too).
	writeFile(t, credPath, "user:second-pw")
	if err := r.Reload(); err != nil {
		t.Fatal(err)
	}
	if allows(p, "a.example") || !allows(p, "b.example") || *p.upAuth.Load() == firstAuth {
		t.Error("the fixed files were not applied")
	}
	if !strings.Contains(logBuf.String(), "the previous policy stays in force") {
		t.Errorf("no error logged for the refused files: %s", logBuf.String())
	}
}

// TestReloadFollowsConfigMapSymlinkSwap updates the file the way the
// kubelet updates a mounted ConfigMap: the visible path is a symlink
// through "..data", and an update re-points "..data" at a new directory.
func TestReloadFollowsConfigMapSymlinkSwap(t *testing.T) {
	dir := t.TempDir()
	mkVersion := func(name, content string) {
		os.Mkdir(filepath.Join(dir, name), 0o755)
		writeFile(t, filepath.Join(dir, name, "policy.yaml"), content)
	}
	swap := func(name string) {
		tmp := filepath.Join(dir, "..data_tmp")
		if err := os.Symlink(name, tmp); err != nil {
			t.Fatal(err)
		}
		if err := os.Rename(tmp, filepath.Join(dir, "..data")); err != nil {
			t.Fatal(err)
		}
	}
	mkVersion("..v1", "allowedDomains: [one.example]\n")
	swap("..v1")
	if err := os.Symlink("..data/policy.yaml", filepath.Join(dir, "policy.yaml")); err != nil {
		t.Fatal(err)
	}
	p, _, _ := newTestProxy(t, Config{})
	r := &Reloader{Proxy: p, ConfigFile: filepath.Join(dir, "policy.yaml")}
	if err := r.Reload(); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go r.Run(ctx, 10*time.Millisecond, nil)

	mkVersion("..v2", "allowedDomains: [two.example]\n")
	swap("..v2")
	waitFor(t, func() bool { return allows(p, "two.example") && !allows(p, "one.example") })
}

// TestReloadKeepsOpenTunnels: a tunnel opened under the old policy keeps
// working after the host is denied; the next CONNECT is refused.
func TestReloadKeepsOpenTunnels(t *testing.T) {
	res := &fakeResolver{names: map[string][]string{"echo.example": {"203.0.113.9"}}}
	p, _, _ := newTestProxy(t, Config{Allow: []string{"echo.example"}, Resolver: res})
	dial := &fakeDialer{serve: func(c net.Conn) {
		defer c.Close()
		br := bufio.NewReader(c)
		for {
			line, err := br.ReadString('\n')
			if err != nil {
				return
			}
			io.WriteString(c, strings.ToUpper(line))
		}
	}}
	p.dial = dial.Dial
	srv := httptest.NewServer(p) // loopback; the target is the in-memory fake
	defer srv.Close()

	c, err := net.Dial("tcp", srv.Listener.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(10 * time.Second))
	io.WriteString(c, "CONNECT echo.example:443 HTTP/1.1\r\nHost: echo.example:443\r\n\r\n")
	br := bufio.NewReader(c)
	if resp, err := http.ReadResponse(br, &http.Request{Method: http.MethodConnect}); err != nil || resp.StatusCode != 200 {
		t.Fatalf("CONNECT: %v %v", resp, err)
	}
	if err := p.SetPolicy(Policy{Allow: []string{"other.example"}}); err != nil {
		t.Fatal(err)
	}
	io.WriteString(c, "still open\n")
	if line, err := br.ReadString('\n'); err != nil || line != "STILL OPEN\n" {
		t.Fatalf("tunnel after reload: %q %v", line, err)
	}
	if w := do(p, http.MethodConnect, "echo.example:443"); w.Code != http.StatusForbidden {
		t.Errorf("new CONNECT after reload: %d, want 403", w.Code)
	}
}

// TestAllowedCIDRsMakeHoles: a policy file's allowedCIDRs let allowlisted
// names reach an in-cluster network the defaults deny, and nothing else:
// the file's own deniedCIDRs still hold inside the hole, other private
// addresses stay denied, and names off the allowlist are refused before
// any lookup. Addresses come from the fake resolver and connections go to
// the in-memory dialer, so nothing leaves the process.
func TestAllowedCIDRsMakeHoles(t *testing.T) {
	res := &fakeResolver{names: map[string][]string{
		"svc.example":     {"10.20.1.7"},
		"carved.example":  {"10.20.5.9"},
		"private.example": {"10.30.0.1"},
		"meta.example":    {"169.254.169.254"},
	}}
	p, _, dial := newTestProxy(t, Config{Resolver: res})
	dial.serve = func(c net.Conn) {
		defer c.Close()
		br := bufio.NewReader(c)
		if _, err := http.ReadRequest(br); err != nil {
			return
		}
		io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")
	}
	cfgPath := filepath.Join(t.TempDir(), "policy.yaml")
	writeFile(t, cfgPath, "allowedDomains: ['*.example', 10.20.1.8]\ndeniedCIDRs: [10.20.5.0/24]\nallowedCIDRs: [10.20.0.0/16]\n")
	r := &Reloader{Proxy: p, ConfigFile: cfgPath}
	if err := r.Reload(); err != nil {
		t.Fatal(err)
	}
	if w := do(p, http.MethodGet, "http://svc.example/"); w.Code != http.StatusOK || w.Body.String() != "ok" {
		t.Errorf("GET svc.example (10.20.1.7, inside allowedCIDRs): %d %q %q", w.Code, w.Header().Get("X-Agentbox-Egress-Denied"), w.Body.String())
	}
	for target, reason := range map[string]string{
		"http://carved.example/":  ReasonDeniedIP, // deniedCIDRs win inside the hole
		"http://private.example/": ReasonDeniedIP, // outside the hole, still a default denied range
		"http://meta.example/":    ReasonDeniedIP,
		"http://10.20.1.9/":       ReasonNotAllowed, // in the hole, but not on the allowlist
	} {
		if w := do(p, http.MethodGet, target); w.Code != http.StatusForbidden || w.Header().Get("X-Agentbox-Egress-Denied") != reason {
			t.Errorf("GET %s: %d %q, want 403 %s", target, w.Code, w.Header().Get("X-Agentbox-Egress-Denied"), reason)
		}
	}
	if got := dial.Calls(); len(got) != 1 || got[0] != "10.20.1.7:80" {
		t.Errorf("dialled %v; want only 10.20.1.7:80", got)
	}
	for _, c := range res.Calls() {
		if c == "10.20.1.9" {
			t.Error("a host off the allowlist was resolved")
		}
	}

	// A hole over loopback or metadata is refused as a whole, and the
	// policy in force stays.
	for _, bad := range []string{"127.0.0.1/32", "169.254.169.254", "0.0.0.0/0", "::ffff:10.0.0.0/104", "fe80::/64", "10.0.0.0/33"} {
		writeFile(t, cfgPath, "allowedDomains: [other.example]\nallowedCIDRs: ['"+bad+"']\n")
		if err := r.Reload(); err == nil {
			t.Errorf("allowedCIDRs %s accepted", bad)
		}
		if !allows(p, "svc.example") {
			t.Errorf("after refusing %s the old policy did not stay", bad)
		}
	}
	if err := p.SetPolicy(Policy{Allow: []string{"*"}, AllowedCIDRs: []netip.Prefix{netip.MustParsePrefix("127.0.0.0/24")}}); err == nil {
		t.Error("SetPolicy accepted a hole in loopback")
	}
}

func TestParseAllowedCIDRs(t *testing.T) {
	got, err := ParseAllowedCIDRs([]string{" 10.20.0.0/16", "198.18.0.7", "fd12::/64", ""})
	if err != nil {
		t.Fatal(err)
	}
	if want := "[10.20.0.0/16 198.18.0.7/32 fd12::/64]"; fmt.Sprint(got) != want {
		t.Errorf("got %v, want %s", got, want)
	}
	for _, never := range NeverAllowedCIDRs {
		if _, err := ParseAllowedCIDRs([]string{never.String()}); err == nil {
			t.Errorf("%s accepted", never)
		}
	}
}
