package main

import (
	"cmp"
	"flag"
	"fmt"
	"net/url"
	"time"

	"github.com/agentbox/terraform-provider-agentbox/internal/store"
	"github.com/agentbox/terraform-provider-agentbox/internal/usertoken"
)

// userTokenFlags configure the user token issuer of the Compute API.
type userTokenFlags struct {
	issuerURL      string
	rotationPeriod time.Duration
	maxLifetime    time.Duration
	// rotation and lifetime are the flags' text, parsed by check.
	rotation, lifetime string
}

func (f *userTokenFlags) register(fs *flag.FlagSet, getenv func(string) string) {
	fs.StringVar(&f.issuerURL, "user-token-issuer", getenv("AGENTBOX_USER_TOKEN_ISSUER"),
		"iss of the user tokens POST /v1/token issues: the Compute API's URL as their verifiers reach it (its /.well-known/jwks.json publishes the keys); empty means https://API-SERVICE.NAMESPACE.svc [AGENTBOX_USER_TOKEN_ISSUER]")
	fs.StringVar(&f.rotation, "user-token-key-rotation", cmp.Or(getenv("AGENTBOX_USER_TOKEN_KEY_ROTATION"), usertoken.DefaultRotationPeriod.String()),
		"how long one user token signing key signs; the next key is published a period ahead, the previous one until its tokens have expired [AGENTBOX_USER_TOKEN_KEY_ROTATION]")
	fs.StringVar(&f.lifetime, "user-token-max-lifetime", cmp.Or(getenv("AGENTBOX_USER_TOKEN_MAX_LIFETIME"), usertoken.DefaultMaxLifetime.String()),
		"longest life of a user token; expires_in above it is capped [AGENTBOX_USER_TOKEN_MAX_LIFETIME]")
}

func (f *userTokenFlags) check() error {
	var err error
	if f.rotationPeriod, err = time.ParseDuration(f.rotation); err != nil || f.rotationPeriod < time.Minute {
		return fmt.Errorf("--user-token-key-rotation %q: want a duration of at least 1m", f.rotation)
	}
	if f.maxLifetime, err = time.ParseDuration(f.lifetime); err != nil {
		return fmt.Errorf("--user-token-max-lifetime %q: want a duration such as 1h", f.lifetime)
	}
	if f.rotationPeriod < time.Minute {
		return fmt.Errorf("--user-token-key-rotation %s: want at least 1m", f.rotationPeriod)
	}
	if f.maxLifetime < time.Minute || f.maxLifetime > 24*time.Hour {
		return fmt.Errorf("--user-token-max-lifetime %s: want between 1m and 24h (user tokens are short-lived)", f.maxLifetime)
	}
	if f.issuerURL != "" {
		u, err := url.Parse(f.issuerURL)
		if err != nil || u.Scheme != "https" || u.Host == "" || u.RawQuery != "" || u.Fragment != "" {
			return fmt.Errorf("--user-token-issuer %q: want an https URL without query or fragment", f.issuerURL)
		}
	}
	return nil
}

// issuer is the user token issuer, or nil without a store: its keys and
// revocations live there, shared by every replica.
func (f *userTokenFlags) issuer(st *store.Store, o *options) (*usertoken.Issuer, error) {
	if st == nil {
		return nil, nil
	}
	iss := cmp.Or(f.issuerURL, "https://"+o.apiService+"."+o.namespace+".svc")
	is, err := usertoken.New(usertoken.Options{Issuer: iss, Store: st, RotationPeriod: f.rotationPeriod, MaxLifetime: f.maxLifetime})
	if err != nil {
		return nil, fmt.Errorf("user token issuer: %w", err)
	}
	return is, nil
}
