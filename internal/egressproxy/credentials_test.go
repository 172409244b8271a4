package egressproxy

import (
	"io"
	"log/slog"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/agentbox/terraform-provider-agentbox/internal/pki"
)

func TestCompileCredentials(t *testing.T) {
	set, err := compileCredentials([]Credential{
		{Name: "bearer", Hosts: []string{"api.example.com"}, Header: "authorization", Template: "Bearer {{secret}}", Secret: "k1"},
		{Name: "raw", Hosts: []string{"*.raw.example"}, Header: "X-Api-Key", Secret: "k2"},
		{Name: "basic-user", Hosts: []string{"basic.example"}, BasicAuth: true, BasicUser: "bot", Secret: "pw"},
		{Name: "basic-pair", Hosts: []string{"pair.example"}, BasicAuth: true, Secret: "u:p:w"},
	})
	if err != nil {
		t.Fatal(err)
	}
	for host, want := range map[string][2]string{
		"api.example.com": {"Authorization", "Bearer k1"},
		"a.b.raw.example": {"X-Api-Key", "k2"},
		"basic.example":   {"Authorization", "Basic Ym90OnB3"}, // bot:pw
		"pair.example":    {"Authorization", "Basic dTpwOnc="}, // u:p:w, split at the first colon
	} {
		c := set.lookup(host)
		if c == nil {
			t.Errorf("%s: no credential", host)
			continue
		}
		h := http.Header{"Authorization": {"placeholder"}, "X-Api-Key": {"placeholder", "second"}}
		c.apply(h)
		if got := h[want[0]]; len(got) != 1 || got[0] != want[1] {
			t.Errorf("%s: %s = %q, want %q", host, want[0], got, want[1])
		}
	}
	for _, host := range []string{"raw.example", "example.com", "other.api.example.com"} {
		if c := set.lookup(host); c != nil {
			t.Errorf("%s: got credential %s", host, c.name)
		}
	}
	if set := (*credentialSet)(nil); set.lookup("api.example.com") != nil {
		t.Error("nil set matched")
	}
}

func TestCompileCredentialsRefuses(t *testing.T) {
	ok := Credential{Name: "c", Hosts: []string{"a.example"}, Header: "X-Key", Secret: "s"}
	for want, c := range map[string]Credential{
		"needs a name":                  {Hosts: ok.Hosts, Header: ok.Header, Secret: ok.Secret},
		"at least one host":             {Name: "c", Header: ok.Header, Secret: ok.Secret},
		"send the secret everywhere":    {Name: "c", Hosts: []string{"*"}, Header: ok.Header, Secret: ok.Secret},
		"the secret is empty":           {Name: "c", Hosts: ok.Hosts, Header: ok.Header},
		"line break":                    {Name: "c", Hosts: ok.Hosts, Header: ok.Header, Secret: "a\r\nX-Evil: 1"},
		"not a header name":             {Name: "c", Hosts: ok.Hosts, Header: "X Key", Secret: "s"},
		"not passed to the destination": {Name: "c", Hosts: ok.Hosts, Header: "proxy-authorization", Secret: "s"},
		"lacks {{secret}}":              {Name: "c", Hosts: ok.Hosts, Header: "X-Key", Template: "Bearer", Secret: "s"},
		"not both":                      {Name: "c", Hosts: ok.Hosts, Header: "X-Key", BasicAuth: true, Secret: "s"},
		"header or basic auth":          {Name: "c", Hosts: ok.Hosts, Secret: "s"},
		"user:password":                 {Name: "c", Hosts: ok.Hosts, BasicAuth: true, Secret: "nocolon"},
		"wildcard":                      {Name: "c", Hosts: []string{"a.*.example"}, Header: "X-Key", Secret: "s"},
	} {
		_, err := compileCredentials([]Credential{c})
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("want error containing %q, got %v", want, err)
		}
	}
	if _, err := compileCredentials([]Credential{ok, ok}); err == nil || !strings.Contains(err.Error(), "twice") {
		t.Errorf("duplicate name: %v", err)
	}
	// Without an interception CA the proxy refuses credentials.
	p, err := New(Config{})
	if err != nil {
		t.Fatal(err)
	}
	if err := p.SetCredentials([]Credential{ok}); err == nil || !strings.Contains(err.Error(), "interception CA") {
		t.Errorf("SetCredentials without a CA: %v", err)
	}
}

// A credential whose secret file is missing or empty is refused as a
// whole: the credentials and policy in force stay.
func TestReloadCredentials(t *testing.T) {
	dir := t.TempDir()
	cfgPath := filepath.Join(dir, "policy.yaml")
	secretPath := filepath.Join(dir, "token")
	writeFile(t, secretPath, "first\n")
	writeFile(t, cfgPath, "allowedDomains: [api.example]\ncredentials:\n- name: tok\n  hosts: [api.example]\n  header: {name: X-Key}\n  secretFile: "+secretPath+"\n")
	ca, err := pki.NewCA("test")
	if err != nil {
		t.Fatal(err)
	}
	p, err := New(Config{InterceptCA: ca})
	if err != nil {
		t.Fatal(err)
	}
	r := &Reloader{Proxy: p, ConfigFile: cfgPath, Log: slog.New(slog.NewTextHandler(io.Discard, nil))}
	if err := r.Reload(); err != nil {
		t.Fatal(err)
	}
	value := func() string {
		h := http.Header{}
		c := p.creds.Load().lookup("api.example")
		if c == nil {
			return "<none>"
		}
		c.apply(h)
		return h.Get("X-Key")
	}
	if got := value(); got != "first" {
		t.Fatalf("after load: %q", got)
	}
	writeFile(t, secretPath, "")
	if err := r.Reload(); err == nil || !strings.Contains(err.Error(), "secret is empty") {
		t.Errorf("empty secret: %v", err)
	}
	os.Remove(secretPath)
	if err := r.Reload(); err == nil || !strings.Contains(err.Error(), `read secret of credential "tok"`) {
		t.Errorf("missing secret: %v", err)
	}
	if got := value(); got != "first" {
		t.Errorf("after failed reloads: %q, want the first value kept", got)
	}
	writeFile(t, secretPath, "second")
	if err := r.Reload(); err != nil || value() != "second" {
		t.Errorf("rotation: %v, %q", err, value())
	}
	// Without an interception CA the file's credentials are refused.
	p2, _ := New(Config{})
	r2 := &Reloader{Proxy: p2, ConfigFile: cfgPath, Log: slog.New(slog.NewTextHandler(io.Discard, nil))}
	if err := r2.Reload(); err == nil || !strings.Contains(err.Error(), "interception CA") {
		t.Errorf("no CA: %v", err)
	}
}
