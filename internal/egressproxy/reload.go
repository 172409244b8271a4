package egressproxy

import (
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"os"
	"slices"
	"strings"
	"time"

	"sigs.k8s.io/yaml"
)

// FileConfig is the reloadable policy file: the policy fields of the
// EgressProxy resource (internal/api/v1alpha1), in YAML or JSON.
type FileConfig struct {
	AllowedDomains []string `json:"allowedDomains,omitempty"`
	DeniedDomains  []string `json:"deniedDomains,omitempty"`
	// DeniedCIDRs are denied in addition to the base ranges, as the CRD
	// documents, and hold even inside AllowedCIDRs.
	DeniedCIDRs []string `json:"deniedCIDRs,omitempty"`
	// AllowedCIDRs are holes in the base ranges (see Policy.AllowedCIDRs);
	// the file's own DeniedCIDRs still apply inside them.
	AllowedCIDRs []string `json:"allowedCIDRs,omitempty"`
	// Credentials are added to requests bound for their hosts (see
	// credentials.go). Their values are read from SecretFile, a mounted
	// Secret key, never from this file.
	Credentials []FileCredential `json:"credentials,omitempty"`
}

// FileCredential is one credential in the policy file: the EgressProxy
// resource's credentials entry with its Secret mounted at SecretFile.
type FileCredential struct {
	Name  string   `json:"name"`
	Hosts []string `json:"hosts"`
	// Header and BasicAuth: exactly one.
	Header    *FileCredentialHeader `json:"header,omitempty"`
	BasicAuth *FileCredentialBasic  `json:"basicAuth,omitempty"`
	// SecretFile holds the secret; one trailing line break is dropped, as
	// files written by hand usually end in one.
	SecretFile string `json:"secretFile"`
}

// FileCredentialHeader sends the secret in a header.
type FileCredentialHeader struct {
	Name string `json:"name"`
	// ValueTemplate contains {{secret}}; empty means the secret alone.
	ValueTemplate string `json:"valueTemplate,omitempty"`
}

// FileCredentialBasic sends the secret as HTTP basic authentication.
type FileCredentialBasic struct {
	// Username, if set, is sent with the secret as the password;
	// otherwise the secret is user:password.
	Username string `json:"username,omitempty"`
}

// credentials turns the file's credentials into Credentials, taking each
// value from secrets (contents by SecretFile).
func (c *FileConfig) credentials(secrets map[string][]byte) ([]Credential, error) {
	out := make([]Credential, 0, len(c.Credentials))
	for _, fc := range c.Credentials {
		if fc.SecretFile == "" {
			return nil, fmt.Errorf("credential %q: needs secretFile", fc.Name)
		}
		v := string(secrets[fc.SecretFile])
		v = strings.TrimSuffix(v, "\n")
		v = strings.TrimSuffix(v, "\r")
		cred := Credential{Name: fc.Name, Hosts: fc.Hosts, Secret: v}
		if fc.Header != nil {
			cred.Header, cred.Template = fc.Header.Name, fc.Header.ValueTemplate
		}
		if fc.BasicAuth != nil {
			cred.BasicAuth, cred.BasicUser = true, fc.BasicAuth.Username
		}
		out = append(out, cred)
	}
	return out, nil
}

// ParseFileConfig reads a policy file. Unknown fields are errors: a typo
// such as "allowDomains" would otherwise load as an empty allowlist.
func ParseFileConfig(b []byte) (*FileConfig, error) {
	var c FileConfig
	if err := yaml.UnmarshalStrict(b, &c); err != nil {
		return nil, fmt.Errorf("policy file: %w", err)
	}
	return &c, nil
}

// Reloader keeps a Proxy's policy and upstream credentials in step with
// their files.
//
// The files are polled by content hash rather than watched with inotify.
// Kubernetes updates a mounted ConfigMap or Secret by writing a new
// timestamped directory and swapping the "..data" symlink; the file's own
// path never sees a write event, watches on it go stale after the swap,
// and editors that write a temporary file and rename it behave much the
// same. Reading a few small files every few seconds is cheap and notices
// every one of these, and a hash ignores touches that change nothing.
type Reloader struct {
	Proxy *Proxy
	// Base is the policy from flags. The file's domain lists are added to
	// its lists and the file's CIDRs to its denied ranges (nil meaning the
	// defaults).
	Base Policy
	// ConfigFile and CredentialsFile are optional.
	ConfigFile      string
	CredentialsFile string
	// ClientCredentialsFile, optional, lists the clients' user:password
	// pairs (see ParseClientCredentials).
	ClientCredentialsFile string
	Log                   *slog.Logger

	applied [32]byte // hash of the contents last applied
	failed  [32]byte // hash of the contents last refused, to log it once
}

// Reload reads the files and applies them. If either is missing or invalid
// nothing changes: the policy and credentials in force stay, the error is
// logged and returned. Reload is not safe for concurrent use; Run calls it
// from one goroutine.
func (r *Reloader) Reload() error { return r.reload(true) }

func (r *Reloader) reload(force bool) error {
	cfg, creds, clients, secrets, sum, err := r.read()
	if err == nil && !force && sum == r.applied {
		return nil
	}
	if err == nil {
		err = r.apply(cfg, creds, clients, secrets)
	}
	if err != nil {
		if force || sum != r.failed {
			r.Proxy.metrics.reloads.WithLabelValues("failure").Inc()
			r.log().Error("egress config not applied; the previous policy stays in force", "error", err.Error())
		}
		r.failed = sum
		return err
	}
	r.applied, r.failed = sum, [32]byte{}
	r.Proxy.metrics.reloads.WithLabelValues("success").Inc()
	pol := r.Proxy.CurrentPolicy()
	r.log().Info("egress config applied", "allow", pol.Allow, "deny", pol.Deny,
		"denied_cidrs", len(pol.DeniedCIDRs)+len(pol.ExtraDeniedCIDRs), "allowed_cidrs", prefixStrings(pol.AllowedCIDRs),
		"credentials", r.Proxy.CredentialNames(), "sha256", fmt.Sprintf("%x", sum[:6]))
	return nil
}

func (r *Reloader) log() *slog.Logger {
	if r.Log != nil {
		return r.Log
	}
	return r.Proxy.log
}

// read returns the files' contents and a hash over them all, the secret
// files the policy file names included, so that a rotated Secret is
// picked up like an edited policy. On an error the hash still covers what
// was read, so a broken file is reported once.
func (r *Reloader) read() (cfg, creds, clients []byte, secrets map[string][]byte, sum [32]byte, err error) {
	h := sha256.New()
	var errs []error
	if r.ConfigFile != "" {
		cfg, err = os.ReadFile(r.ConfigFile)
		if err != nil {
			errs = append(errs, fmt.Errorf("read policy file: %w", err))
		}
		h.Write(cfg)
	}
	h.Write([]byte{0})
	if r.CredentialsFile != "" {
		creds, err = os.ReadFile(r.CredentialsFile)
		if err != nil {
			errs = append(errs, fmt.Errorf("read upstream credentials file: %w", err))
		}
		h.Write(creds)
	}
	h.Write([]byte{0})
	if r.ClientCredentialsFile != "" {
		clients, err = os.ReadFile(r.ClientCredentialsFile)
		if err != nil {
			errs = append(errs, fmt.Errorf("read client credentials file: %w", err))
		}
		h.Write(clients)
	}
	if cfg != nil {
		// A file that does not parse is reported by apply.
		if fc, perr := ParseFileConfig(cfg); perr == nil {
			secrets = map[string][]byte{}
			for _, c := range fc.Credentials {
				if _, done := secrets[c.SecretFile]; done || c.SecretFile == "" {
					continue
				}
				b, err := os.ReadFile(c.SecretFile)
				if err != nil {
					errs = append(errs, fmt.Errorf("read secret of credential %q: %w", c.Name, err))
				}
				secrets[c.SecretFile] = b
				h.Write([]byte{0})
				h.Write(b)
			}
		}
	}
	h.Sum(sum[:0])
	return cfg, creds, clients, secrets, sum, errors.Join(errs...)
}

// apply validates everything first and only then swaps, so that a bad
// credentials file cannot leave a new policy with old credentials.
func (r *Reloader) apply(cfg, creds, clients []byte, secrets map[string][]byte) error {
	pol := Policy{
		Allow:            slices.Clone(r.Base.Allow),
		Deny:             slices.Clone(r.Base.Deny),
		DeniedCIDRs:      r.Base.DeniedCIDRs,
		AllowedCIDRs:     r.Base.AllowedCIDRs,
		ExtraDeniedCIDRs: r.Base.ExtraDeniedCIDRs,
	}
	var credentials *credentialSet
	if r.ConfigFile != "" {
		fc, err := ParseFileConfig(cfg)
		if err != nil {
			return err
		}
		list, err := fc.credentials(secrets)
		if err != nil {
			return fmt.Errorf("policy file: %w", err)
		}
		if credentials, err = compileCredentials(list); err != nil {
			return fmt.Errorf("policy file: %w", err)
		}
		if len(credentials.creds) > 0 && r.Proxy.leaves == nil {
			return errors.New("policy file: credentials need an interception CA (-intercept-ca-cert-file and -intercept-ca-key-file)")
		}
		cidrs, err := ParseCIDRs(fc.DeniedCIDRs)
		if err != nil {
			return fmt.Errorf("policy file deniedCIDRs: %w", err)
		}
		allowed, err := ParseAllowedCIDRs(fc.AllowedCIDRs)
		if err != nil {
			return fmt.Errorf("policy file allowedCIDRs: %w", err)
		}
		pol.Allow = append(pol.Allow, fc.AllowedDomains...)
		pol.Deny = append(pol.Deny, fc.DeniedDomains...)
		// The file's denied ranges are kept apart from the base ones so
		// that its allowed ranges cannot undo them.
		pol.ExtraDeniedCIDRs = append(slices.Clone(pol.ExtraDeniedCIDRs), cidrs...)
		pol.AllowedCIDRs = append(slices.Clone(pol.AllowedCIDRs), allowed...)
	}
	compiled, err := compilePolicy(pol)
	if err != nil {
		return fmt.Errorf("policy file: %w", err)
	}
	var user, password string
	if r.CredentialsFile != "" {
		if user, password, err = ParseCredentials(creds); err != nil {
			return fmt.Errorf("upstream credentials file %s: %w", r.CredentialsFile, err)
		}
	}
	var users map[string]string
	if r.ClientCredentialsFile != "" {
		if users, err = ParseClientCredentials(clients); err != nil {
			return fmt.Errorf("client credentials file %s: %w", r.ClientCredentialsFile, err)
		}
	}
	r.Proxy.policy.Store(compiled)
	r.Proxy.Close() // see SetPolicy
	if credentials != nil {
		r.Proxy.creds.Store(credentials)
	}
	if r.CredentialsFile != "" {
		r.Proxy.SetUpstreamCredentials(user, password)
	}
	if r.ClientCredentialsFile != "" {
		r.Proxy.SetClientCredentials(users)
	}
	return nil
}

// Run reloads whenever the files' contents change, checked every interval,
// and unconditionally on each value from hup (SIGHUP), until ctx ends.
func (r *Reloader) Run(ctx context.Context, interval time.Duration, hup <-chan struct{}) {
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-hup:
			r.log().Info("reloading egress config on SIGHUP")
			r.reload(true)
		case <-t.C:
			r.reload(false)
		}
	}
}

func prefixStrings(p []netip.Prefix) []string {
	out := make([]string, len(p))
	for i, x := range p {
		out[i] = x.String()
	}
	return out
}
