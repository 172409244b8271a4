package squid

import (
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"testing"
	"time"
)

func TestPackageForSoname(t *testing.T) {
	for so, want := range map[string]string{
		"libecap.so.3":        "libecap3",
		"libltdl.so.7":        "libltdl7",
		"libnettle.so.8":      "libnettle8",
		"libgnutls.so.30":     "libgnutls30",
		"libldap-2.5.so.0":    "libldap-2.5-0",
		"libstdc++.so.6.0.30": "libstdc++6",
		"libfoo.so":           "",
	} {
		if got := packageForSoname(so); got != want {
			t.Errorf("packageForSoname(%q) = %q, want %q", so, got, want)
		}
	}
}

// TestAllowlistOnLoopback runs the real squid (fetched on first use, a few
// MB of Debian packages) against a local origin: the allowed name is
// forwarded to 127.0.0.1, another name is refused by squid itself.
func TestAllowlistOnLoopback(t *testing.T) {
	if testing.Short() {
		t.Skip("fetches and runs squid")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	dir, err := DefaultCacheDir()
	if err != nil {
		t.Skip(err)
	}
	in, err := Ensure(ctx, dir, t.Logf)
	if errors.Is(err, ErrUnavailable) {
		t.Skipf("squid cannot be had here: %v", err)
	}
	if err != nil {
		t.Fatal(err)
	}
	origin := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.WriteString(w, "origin saw "+r.Host)
	}))
	defer origin.Close()
	_, port, _ := net.SplitHostPort(origin.Listener.Addr().String())

	s, err := in.Start(ctx, Config{
		Allow:     []string{"origin.squid.test"},
		Hosts:     map[string]string{"origin.squid.test": "127.0.0.1", "other.squid.test": "127.0.0.1"},
		AccessLog: true,
	})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Stop()
	client := &http.Client{Transport: &http.Transport{Proxy: http.ProxyURL(&url.URL{Scheme: "http", Host: s.Addr})}}
	get := func(host string) (int, string) {
		t.Helper()
		resp, err := client.Get("http://" + host + ":" + port + "/")
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	if code, body := get("origin.squid.test"); code != http.StatusOK || body != "origin saw origin.squid.test:"+port {
		t.Errorf("allowed host: %d %q\n%s", code, body, s.Log())
	}
	if code, _ := get("other.squid.test"); code != http.StatusForbidden {
		t.Errorf("host not on the allowlist: %d, want 403", code)
	}
	// squid writes its log lines a little later than it answers.
	var log string
	for range 100 {
		if log = s.AccessLog(); strings.Contains(log, "TCP_DENIED/403") && strings.Contains(log, "HIER_DIRECT/127.0.0.1") {
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	if !strings.Contains(log, "TCP_DENIED/403") || !strings.Contains(log, "HIER_DIRECT/127.0.0.1") {
		t.Errorf("access log lacks the two requests:\n%s", log)
	}
	if err := s.Stop(); err != nil {
		t.Error(err)
	}
}
