package egressproxy

import (
	"bufio"
	"bytes"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/base64"
	"fmt"
	"net/http"
	"strings"
)

// Client authentication is optional. A Shared proxy serves many agents, and
// tells them apart by the proxy credentials each sandbox is given: the
// user name is the agent, and it is what the access log reports. A
// PerAgent proxy needs none (NetworkPolicy admits only its sandbox) and
// names its agent with Config.Agent.

// ReasonAuth is the denial of a request without valid client credentials.
const ReasonAuth = "auth_required"

// clientCreds maps each user to the SHA-256 of its password, so that
// comparing takes the same time whatever the password's length.
type clientCreds map[string][32]byte

// ParseClientCredentials reads one "user:password" per line; blank lines
// and lines starting with # are skipped. Errors name the line, never its
// content.
func ParseClientCredentials(b []byte) (map[string]string, error) {
	out := map[string]string{}
	sc := bufio.NewScanner(bytes.NewReader(b))
	for n := 1; sc.Scan(); n++ {
		line := strings.TrimSpace(sc.Text())
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		user, password, err := ParseCredentials([]byte(line))
		if err != nil {
			return nil, fmt.Errorf("line %d: %w", n, err)
		}
		if _, dup := out[user]; dup {
			return nil, fmt.Errorf("line %d: user %q listed twice", n, user)
		}
		out[user] = password
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("client credentials: %w", err)
	}
	return out, nil
}

// SetClientCredentials makes the proxy require Basic Proxy-Authorization
// from clients with one of these user:password pairs; nil turns the
// requirement off. An empty, non-nil map refuses every client.
func (p *Proxy) SetClientCredentials(users map[string]string) {
	if users == nil {
		p.clientAuth.Store(nil)
		return
	}
	c := clientCreds{}
	for u, pw := range users {
		c[u] = sha256.Sum256([]byte(pw))
	}
	p.clientAuth.Store(&c)
}

// authenticate returns the client's user name, "" when no authentication
// is configured, or ok false when it is required and missing or wrong.
func (p *Proxy) authenticate(r *http.Request) (user string, ok bool) {
	creds := p.clientAuth.Load()
	if creds == nil {
		return "", true
	}
	scheme, encoded, found := strings.Cut(r.Header.Get("Proxy-Authorization"), " ")
	if !found || !strings.EqualFold(scheme, "Basic") {
		return "", false
	}
	raw, err := base64.StdEncoding.DecodeString(strings.TrimSpace(encoded))
	if err != nil {
		return "", false
	}
	user, password, found := strings.Cut(string(raw), ":")
	want, known := (*creds)[user]
	got := sha256.Sum256([]byte(password))
	if !found || !known || subtle.ConstantTimeCompare(want[:], got[:]) != 1 {
		return "", false
	}
	return user, true
}

// askForAuth answers 407, which makes clients retry with credentials.
func askForAuth(w http.ResponseWriter, e *entry) {
	e.set("deny", ReasonAuth)
	w.Header().Set("Proxy-Authenticate", `Basic realm="agentbox-egress"`)
	w.Header().Set("X-Agentbox-Egress-Denied", ReasonAuth)
	http.Error(w, "agentbox egress proxy: proxy credentials required", http.StatusProxyAuthRequired)
}
