package egressproxy

import (
	"bufio"
	"context"
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
