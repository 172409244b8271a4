package egressproxy

// Credential injection.
//
// A sandbox runs untrusted code, so a long-lived API key in its environment
// or files could be read and sent anywhere the allowlist permits. Instead
// the proxy holds the key and adds it to requests bound for the
// destinations it belongs to; the sandbox sends a request without it (or
// with a placeholder header of the same name, which is replaced).
//
// Plain HTTP requests pass through the proxy in the clear, so the header is
// added on the way out. An HTTPS destination with a credential is reached
// by a CONNECT whose TLS the proxy must terminate to see the request: it
// answers the sandbox with a leaf certificate for the destination issued
// by a CA of its own (which the sandbox trusts), and opens its own TLS
// connection to the destination, verified against the system roots or a
// configured bundle (see intercept.go). Destinations without a credential
// keep the plain CONNECT tunnel, which the proxy cannot read.
//
// A credential is added only after the request passed the policy, and
// only for the host the policy checked: inside an intercepted tunnel every
// request goes to the CONNECT's host whatever its Host header says.
// Values are never logged; the access log names the credential used.

import (
	"errors"
	"fmt"
	"net/http"
	"net/textproto"
	"strings"
)

// SecretPlaceholder is replaced by the secret in a header template.
const SecretPlaceholder = "{{secret}}"

// Credential is a secret added to requests bound for some hosts.
type Credential struct {
	// Name identifies the credential in the access log and the metric; it
	// is not secret.
	Name string
	// Hosts are host patterns in the allowlist's syntax ("api.example.com",
	// "*.example.com"). A credential applies only to hosts the policy
	// also allows.
	Hosts []string
	// Header, when set, is the header that carries the secret, its value
	// Template with SecretPlaceholder replaced ("Bearer {{secret}}").
	// An empty Template means the secret alone.
	Header   string
	Template string
	// BasicAuth sends the secret as HTTP basic authentication in the
	// Authorization header instead: as the password of BasicUser, or,
	// when BasicUser is empty, as "user:password" whole.
	BasicAuth bool
	BasicUser string
	// Secret is the value itself.
	Secret string
}

// credentialSet is the credentials compiled for matching; like policy it
// is never modified once built.
type credentialSet struct {
	creds []compiledCredential
}

type compiledCredential struct {
	hosts  domainList
	name   string
	header string // canonical header name
	value  string // the header's value, secret included
}

// hopByHop are headers that never reach the destination (or, for Host,
// are set from the checked URL), so a credential in one would vanish or
// redirect the request.
var hopByHop = map[string]bool{
	"Connection": true, "Proxy-Connection": true, "Keep-Alive": true, "Proxy-Authenticate": true,
	"Proxy-Authorization": true, "Te": true, "Trailer": true, "Transfer-Encoding": true,
	"Upgrade": true, "Host": true, "Content-Length": true,
}

func compileCredentials(in []Credential) (*credentialSet, error) {
	set := &credentialSet{}
	names := map[string]bool{}
	for i, c := range in {
		if c.Name == "" {
			return nil, fmt.Errorf("credential %d: needs a name", i)
		}
		if names[c.Name] {
			return nil, fmt.Errorf("credential %q: name used twice", c.Name)
		}
		names[c.Name] = true
		hosts, err := newDomainList(c.Hosts)
		if err != nil {
			return nil, fmt.Errorf("credential %q: %w", c.Name, err)
		}
		if hosts.empty() {
			return nil, fmt.Errorf("credential %q: needs at least one host", c.Name)
		}
		if hosts.all {
			// Every destination would get the secret, including ones an
			// agent controls; that is handing it to the agent.
			return nil, fmt.Errorf("credential %q: host \"*\" would send the secret everywhere; name the hosts", c.Name)
		}
		if c.Secret == "" {
			return nil, fmt.Errorf("credential %q: the secret is empty", c.Name)
		}
		if strings.ContainsAny(c.Secret, "\r\n\x00") {
			return nil, fmt.Errorf("credential %q: the secret contains a line break or NUL", c.Name)
		}
		cc := compiledCredential{hosts: hosts, name: c.Name}
		switch {
		case c.BasicAuth && c.Header != "":
			return nil, fmt.Errorf("credential %q: give a header or basic auth, not both", c.Name)
		case c.BasicAuth:
			user, pass := c.BasicUser, c.Secret
			if user == "" {
				var ok bool
				if user, pass, ok = strings.Cut(c.Secret, ":"); !ok {
					return nil, fmt.Errorf("credential %q: basic auth without a user needs the secret as user:password", c.Name)
				}
			}
			r := &http.Request{Header: http.Header{}}
			r.SetBasicAuth(user, pass)
			cc.header, cc.value = "Authorization", r.Header.Get("Authorization")
		case c.Header != "":
			if !validHeaderName(c.Header) {
				return nil, fmt.Errorf("credential %q: %q is not a header name", c.Name, c.Header)
			}
			cc.header = textproto.CanonicalMIMEHeaderKey(c.Header)
			if hopByHop[cc.header] {
				return nil, fmt.Errorf("credential %q: header %s is not passed to the destination", c.Name, cc.header)
			}
			tmpl := c.Template
			if tmpl == "" {
				tmpl = SecretPlaceholder
			}
			if !strings.Contains(tmpl, SecretPlaceholder) {
				return nil, fmt.Errorf("credential %q: template %q lacks %s", c.Name, tmpl, SecretPlaceholder)
			}
			if strings.ContainsAny(tmpl, "\r\n\x00") {
				return nil, fmt.Errorf("credential %q: template contains a line break or NUL", c.Name)
			}
			cc.value = strings.ReplaceAll(tmpl, SecretPlaceholder, c.Secret)
		default:
			return nil, fmt.Errorf("credential %q: give a header or basic auth", c.Name)
		}
		set.creds = append(set.creds, cc)
	}
	return set, nil
}

// validHeaderName reports whether s is an RFC 9110 token.
func validHeaderName(s string) bool {
	if s == "" {
		return false
	}
	for _, r := range s {
		if r >= 0x7f || r <= ' ' || strings.ContainsRune("\"(),/:;<=>?@[\\]{}", r) {
			return false
		}
	}
	return true
}

// lookup returns the first credential for host, or nil.
func (s *credentialSet) lookup(host string) *compiledCredential {
	if s == nil {
		return nil
	}
	for i := range s.creds {
		if s.creds[i].hosts.match(host) {
			return &s.creds[i]
		}
	}
	return nil
}

// apply sets the credential's header, replacing any the client sent (a
// placeholder, or an attempt of its own).
func (c *compiledCredential) apply(h http.Header) {
	h[c.header] = []string{c.value}
}

// SetCredentials replaces the credentials for requests that arrive from
// now on. Credentials need the interception CA (Config.InterceptCA): an
// HTTPS destination with a credential cannot be served without it, and
// tunnelling it unchanged would fail the agent's request silently.
func (p *Proxy) SetCredentials(creds []Credential) error {
	set, err := compileCredentials(creds)
	if err != nil {
		return err
	}
	if len(set.creds) > 0 && p.leaves == nil {
		return errors.New("credentials need an interception CA (-intercept-ca-cert-file and -intercept-ca-key-file) for their HTTPS destinations")
	}
	p.creds.Store(set)
	return nil
}

// CredentialNames returns the names of the credentials in force, for logs.
func (p *Proxy) CredentialNames() []string {
	set := p.creds.Load()
	if set == nil {
		return nil
	}
	out := make([]string, len(set.creds))
	for i, c := range set.creds {
		out[i] = c.name
	}
	return out
}

type credsKey struct{}

// credentialsFor returns the credentials a request started with.
func (p *Proxy) credentialsFor(r *http.Request) *credentialSet {
	if s, ok := r.Context().Value(credsKey{}).(*credentialSet); ok {
		return s
	}
	return p.creds.Load()
}

// injectCredential adds the credential for the request's (already checked)
// host to out, recording its name for the access log and the metric.
func (p *Proxy) injectCredential(in, out *http.Request) {
	host := normalizeHost(out.URL.Hostname())
	c := p.credentialsFor(in).lookup(host)
	if c == nil {
		return
	}
	c.apply(out.Header)
	if e, ok := in.Context().Value(entryKey{}).(*entry); ok {
		e.mu.Lock()
		e.credential = c.name
		e.mu.Unlock()
	}
	p.metrics.injections.WithLabelValues(c.name, out.URL.Scheme).Inc()
}
