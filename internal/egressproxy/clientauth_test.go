package egressproxy

import (
	"encoding/base64"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func basic(user, password string) string {
	return "Basic " + base64.StdEncoding.EncodeToString([]byte(user+":"+password))
}

func TestClientAuthentication(t *testing.T) {
	res := &fakeResolver{names: map[string][]string{"ok.example": {"203.0.113.7"}}}
	logBuf := &logBuffer{}
	p, err := New(Config{
		Allow: []string{"ok.example"}, Resolver: res, Dial: (&fakeDialer{}).Dial,
		Logger:            slog.New(slog.NewJSONHandler(logBuf, nil)),
		Agent:             "fallback",
		ClientCredentials: map[string]string{"agent-a": "pw-a", "agent-b": "pw-b"},
	})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	req := func(method, target, auth string) *httptest.ResponseRecorder {
		r := httptest.NewRequest(method, target, nil)
		if method == http.MethodConnect {
			r.Host, r.URL.Host, r.RequestURI = target, target, target
		}
		if auth != "" {
			r.Header.Set("Proxy-Authorization", auth)
		}
		w := httptest.NewRecorder()
		p.ServeHTTP(w, r)
		return w
	}
	for _, auth := range []string{"", basic("agent-a", "wrong-pw"), basic("nobody", "pw-a"), "Bearer x", "Basic !!"} {
		for _, m := range []string{http.MethodGet, http.MethodConnect} {
			target := "http://ok.example/"
			if m == http.MethodConnect {
				target = "ok.example:443"
			}
			w := req(m, target, auth)
			if w.Code != http.StatusProxyAuthRequired || !strings.HasPrefix(w.Header().Get("Proxy-Authenticate"), "Basic") {
				t.Errorf("%s with %q: %d, want 407 with a Basic challenge", m, auth, w.Code)
			}
		}
	}
	if got := res.Calls(); len(got) != 0 {
		t.Errorf("unauthenticated requests were resolved: %v", got)
	}
	// Authenticated: the request goes on to the policy (and to the fake
	// dialer, which refuses: 502), and the log names the agent.
	if w := req(http.MethodGet, "http://ok.example/", basic("agent-b", "pw-b")); w.Code != http.StatusBadGateway {
		t.Errorf("authenticated: %d, want 502 from the refusing fake dialer", w.Code)
	}
	if w := req(http.MethodGet, "http://other.example/", basic("agent-b", "pw-b")); w.Code != http.StatusForbidden {
		t.Errorf("authenticated but not allowed: %d, want 403", w.Code)
	}
	log := logBuf.String()
	if !strings.Contains(log, `"agent":"agent-b"`) || !strings.Contains(log, `"reason":"auth_required"`) {
		t.Errorf("log: %s", log)
	}
	for _, secret := range []string{"pw-a", "pw-b", "wrong-pw"} {
		if strings.Contains(log, secret) {
			t.Errorf("log contains %q", secret)
		}
	}
	// The probe needs no credentials.
	if w := req(http.MethodGet, "/healthz", ""); w.Code != http.StatusOK {
		t.Errorf("/healthz: %d", w.Code)
	}
}

func TestClientCredentialsReload(t *testing.T) {
	dir := t.TempDir()
	f := filepath.Join(dir, "clients")
	os.WriteFile(f, []byte("# per-sandbox credentials\nagent-a:pw-a\n\nagent-b:pw:b\n"), 0o600)
	p, _, _ := newTestProxy(t, Config{Allow: []string{"*"}})
	r := &Reloader{Proxy: p, ClientCredentialsFile: f}
	if err := r.Reload(); err != nil {
		t.Fatal(err)
	}
	check := func(user, pw string, want bool) {
		t.Helper()
		rq := httptest.NewRequest(http.MethodGet, "http://x.example/", nil)
		rq.Header.Set("Proxy-Authorization", basic(user, pw))
		if _, ok := p.authenticate(rq); ok != want {
			t.Errorf("%s: authenticated = %v, want %v", user, ok, want)
		}
	}
	check("agent-a", "pw-a", true)
	check("agent-b", "pw:b", true)
	os.WriteFile(f, []byte("agent-a:pw-a\nbroken-line\n"), 0o600)
	if err := r.Reload(); err == nil || strings.Contains(err.Error(), "broken-line") {
		t.Errorf("bad file: %v (want an error that does not quote the line)", err)
	}
	check("agent-b", "pw:b", true) // the old set stays
	os.WriteFile(f, []byte("agent-a:pw-a\n"), 0o600)
	if err := r.Reload(); err != nil {
		t.Fatal(err)
	}
	check("agent-b", "pw:b", false)
}
