// Package usertoken issues and verifies the platform's user tokens: short
// lived JWTs (ES256) that say an agent acts for a user (RFC 8693 token
// exchange), so that the MCP servers and APIs an agent calls see that
// user's scoped identity rather than a shared platform secret.
//
// The signing keys rotate on a schedule. Each key signs during one
// rotation period, is published in the JWKS one period before (so that
// consumers that cache the JWKS know it before its first token) and until
// the last token it signed has expired. Keys and revocations live in the
// platform's store: every control plane replica shares it and it outlives
// a restart, so all replicas sign with and publish the same keys without
// another moving part (a Kubernetes Secret would need write access to
// Secrets and a consistency story of its own). A copy of the database
// does hold the private keys, which is why they rotate and why tokens
// are short lived.
package usertoken

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"sync"
	"time"

	jose "github.com/go-jose/go-jose/v4"
	"github.com/go-jose/go-jose/v4/jwt"
	"k8s.io/utils/clock"

	"github.com/agentbox/terraform-provider-agentbox/internal/store"
)

const (
	// Algorithm signs every token.
	Algorithm = jose.ES256
	// DefaultRotationPeriod is how long one key signs.
	DefaultRotationPeriod = 24 * time.Hour
	// DefaultMaxLifetime caps a token's life.
	DefaultMaxLifetime = time.Hour
	// keyCacheTTL bounds how long a replica signs and verifies with keys
	// read from the store before reading them again.
	keyCacheTTL = 30 * time.Second
	// leeway absorbs clock skew between the issuer and a verifier.
	leeway = 30 * time.Second
)

// Store is what the issuer keeps in the platform's store.
type Store interface {
	AddUserTokenKey(ctx context.Context, k store.UserTokenKey) (store.UserTokenKey, error)
	UserTokenKeys(ctx context.Context, since time.Time) ([]store.UserTokenKey, error)
	DeleteUserTokenKeys(ctx context.Context, before time.Time) (int64, error)
	RevokeUserToken(ctx context.Context, jti string, expiresAt time.Time) error
	UserTokenRevoked(ctx context.Context, jti string) (bool, error)
	PruneUserTokenRevocations(ctx context.Context, before time.Time) (int64, error)
}

// Options configure an Issuer.
type Options struct {
	// Issuer is the iss claim: the Compute API's external URL, under
	// which /.well-known/openid-configuration is served.
	Issuer string
	Store  Store
	// RotationPeriod defaults to DefaultRotationPeriod, MaxLifetime to
	// DefaultMaxLifetime.
	RotationPeriod, MaxLifetime time.Duration
	Clock                       clock.PassiveClock
}

// Actor is RFC 8693's act claim: who acts for the subject.
type Actor struct {
	Subject string `json:"sub"`
}

// Claims are a user token's claims.
type Claims struct {
	Issuer   string           `json:"iss"`
	Subject  string           `json:"sub"`
	Actor    Actor            `json:"act"`
	Audience jwt.Audience     `json:"aud"`
	Scope    string           `json:"scope,omitempty"`
	Expiry   *jwt.NumericDate `json:"exp"`
	IssuedAt *jwt.NumericDate `json:"iat"`
	ID       string           `json:"jti"`
	RunID    string           `json:"run_id,omitempty"`
	LeaseID  string           `json:"lease_id,omitempty"`
}

// Request is what a token is minted for.
type Request struct {
	// User is the subject the agent acts for; Agent the agent.
	User, Agent string
	Audience    []string
	Scope       string
	// Lifetime defaults to, and is capped by, the configured maximum.
	Lifetime       time.Duration
	RunID, LeaseID string
}

// Issued is a minted token and what may be said of it without the token.
type Issued struct {
	Token  string
	Claims Claims
}

// Errors of Verify, all wrapping ErrInvalid.
var (
	ErrInvalid  = errors.New("invalid user token")
	ErrRevoked  = fmt.Errorf("%w: revoked", ErrInvalid)
	ErrExpired  = fmt.Errorf("%w: expired", ErrInvalid)
	ErrAudience = fmt.Errorf("%w: not for this audience", ErrInvalid)
	ErrAgent    = fmt.Errorf("%w: bound to another agent", ErrInvalid)
)

// Issuer signs and verifies user tokens.
type Issuer struct {
	opts Options

	mu      sync.Mutex
	keys    []signingKey // oldest first
	fetched time.Time
}

type signingKey struct {
	id                  string
	private             *ecdsa.PrivateKey
	notBefore, notAfter time.Time
}

// New returns an Issuer.
func New(opts Options) (*Issuer, error) {
	if opts.Issuer == "" || opts.Store == nil {
		return nil, errors.New("usertoken: Options.Issuer and Options.Store are required")
	}
	if opts.RotationPeriod <= 0 {
		opts.RotationPeriod = DefaultRotationPeriod
	}
	if opts.MaxLifetime <= 0 {
		opts.MaxLifetime = DefaultMaxLifetime
	}
	if opts.Clock == nil {
		opts.Clock = clock.RealClock{}
	}
	return &Issuer{opts: opts}, nil
}

// IssuerURL is the iss claim of the tokens.
func (is *Issuer) IssuerURL() string { return is.opts.Issuer }

// MaxLifetime is the longest life a token gets.
func (is *Issuer) MaxLifetime() time.Duration { return is.opts.MaxLifetime }

// RotationPeriod is how long one key signs.
func (is *Issuer) RotationPeriod() time.Duration { return is.opts.RotationPeriod }

// window is the signing window of the period that contains t. Windows
// start at multiples of the period since the Unix epoch, so replicas agree
// on them without talking.
func (is *Issuer) window(t time.Time) (time.Time, time.Time) {
	p := is.opts.RotationPeriod
	start := time.Unix(0, 0).Add(t.Sub(time.Unix(0, 0)).Truncate(p)).UTC()
	return start, start.Add(p)
}

// loadKeys returns the keys to publish, making the current and the next
// window's keys when missing and forgetting those no longer needed.
func (is *Issuer) loadKeys(ctx context.Context) ([]signingKey, error) {
	now := is.opts.Clock.Now()
	is.mu.Lock()
	defer is.mu.Unlock()
	cur, next := is.window(now)
	if is.fetched.Add(keyCacheTTL).After(now) && is.has(cur) && is.has(next) {
		return is.keys, nil
	}
	// A key is needed while a token it signed may be valid.
	since := now.Add(-is.opts.MaxLifetime - leeway)
	stored, err := is.opts.Store.UserTokenKeys(ctx, since)
	if err != nil {
		return nil, err
	}
	for _, start := range []time.Time{cur, next} {
		if slices.ContainsFunc(stored, func(k store.UserTokenKey) bool { return k.NotBefore.Equal(start) }) {
			continue
		}
		k, err := newKey(start, start.Add(is.opts.RotationPeriod))
		if err != nil {
			return nil, err
		}
		if k, err = is.opts.Store.AddUserTokenKey(ctx, k); err != nil {
			return nil, err
		}
		stored = append(stored, k)
	}
	keys := make([]signingKey, 0, len(stored))
	for _, k := range stored {
		sk, err := parseKey(k)
		if err != nil {
			return nil, err
		}
		keys = append(keys, sk)
	}
	slices.SortFunc(keys, func(a, b signingKey) int { return a.notBefore.Compare(b.notBefore) })
	// Forgetting is housekeeping: a failure leaves rows that are no longer
	// published, and the next load tries again.
	_, _ = is.opts.Store.DeleteUserTokenKeys(ctx, since)
	_, _ = is.opts.Store.PruneUserTokenRevocations(ctx, now.Add(-leeway))
	is.keys, is.fetched = keys, now
	return keys, nil
}

func (is *Issuer) has(start time.Time) bool {
	return slices.ContainsFunc(is.keys, func(k signingKey) bool { return k.notBefore.Equal(start) })
}

func newKey(notBefore, notAfter time.Time) (store.UserTokenKey, error) {
	priv, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return store.UserTokenKey{}, fmt.Errorf("generate user token key: %w", err)
	}
	// The id is the window: replicas that make the same window's key at
	// once race on it, and the store keeps the first.
	kid := strconv.FormatInt(notBefore.Unix(), 10) + "-" + strconv.FormatInt(int64(notAfter.Sub(notBefore)/time.Second), 10)
	jwk, err := json.Marshal(jose.JSONWebKey{Key: priv, KeyID: kid, Algorithm: string(Algorithm), Use: "sig"})
	if err != nil {
		return store.UserTokenKey{}, fmt.Errorf("encode user token key: %w", err)
	}
	return store.UserTokenKey{ID: kid, Algorithm: string(Algorithm), PrivateJWK: string(jwk), NotBefore: notBefore, NotAfter: notAfter}, nil
}

func parseKey(k store.UserTokenKey) (signingKey, error) {
	var jwk jose.JSONWebKey
	if err := json.Unmarshal([]byte(k.PrivateJWK), &jwk); err != nil {
		return signingKey{}, fmt.Errorf("user token key %s: %w", k.ID, err)
	}
	priv, ok := jwk.Key.(*ecdsa.PrivateKey)
	if !ok {
		return signingKey{}, fmt.Errorf("user token key %s is a %T, not an ECDSA private key", k.ID, jwk.Key)
	}
	return signingKey{id: jwk.KeyID, private: priv, notBefore: k.NotBefore, notAfter: k.NotAfter}, nil
}

// Issue mints a token for r.
func (is *Issuer) Issue(ctx context.Context, r Request) (Issued, error) {
	switch {
	case r.User == "" || r.Agent == "":
		return Issued{}, errors.New("a user token needs a user and an agent")
	case len(r.Audience) == 0:
		return Issued{}, errors.New("a user token needs an audience")
	case r.Lifetime < 0:
		return Issued{}, errors.New("a user token's lifetime must be positive")
	}
	life := r.Lifetime
	if life == 0 || life > is.opts.MaxLifetime {
		life = is.opts.MaxLifetime
	}
	keys, err := is.loadKeys(ctx)
	if err != nil {
		return Issued{}, err
	}
	now := is.opts.Clock.Now()
	key, ok := signer(keys, now)
	if !ok {
		return Issued{}, errors.New("no user token key signs now")
	}
	sig, err := jose.NewSigner(jose.SigningKey{Algorithm: Algorithm, Key: jose.JSONWebKey{Key: key.private, KeyID: key.id}},
		(&jose.SignerOptions{}).WithType("JWT"))
	if err != nil {
		return Issued{}, fmt.Errorf("user token signer: %w", err)
	}
	jti := make([]byte, 16)
	if _, err := rand.Read(jti); err != nil {
		return Issued{}, fmt.Errorf("user token id: %w", err)
	}
	c := Claims{
		Issuer: is.opts.Issuer, Subject: r.User, Actor: Actor{Subject: r.Agent}, Audience: jwt.Audience(r.Audience),
		Scope: r.Scope, IssuedAt: jwt.NewNumericDate(now), Expiry: jwt.NewNumericDate(now.Add(life)),
		ID: fmt.Sprintf("%x", jti), RunID: r.RunID, LeaseID: r.LeaseID,
	}
	token, err := jwt.Signed(sig).Claims(c).Serialize()
	if err != nil {
		return Issued{}, fmt.Errorf("sign user token: %w", err)
	}
	return Issued{Token: token, Claims: c}, nil
}

// signer is the key that signs at t: the newest whose window holds t.
func signer(keys []signingKey, t time.Time) (signingKey, bool) {
	for i := len(keys) - 1; i >= 0; i-- {
		if k := keys[i]; !t.Before(k.notBefore) && t.Before(k.notAfter) {
			return k, true
		}
	}
	return signingKey{}, false
}

// JWKS is the public half of the keys a verifier needs: those that signed
// tokens still valid, the one that signs now and the next one.
func (is *Issuer) JWKS(ctx context.Context) (jose.JSONWebKeySet, error) {
	keys, err := is.loadKeys(ctx)
	if err != nil {
		return jose.JSONWebKeySet{}, err
	}
	set := jose.JSONWebKeySet{Keys: make([]jose.JSONWebKey, len(keys))}
	for i, k := range keys {
		set.Keys[i] = jose.JSONWebKey{Key: &k.private.PublicKey, KeyID: k.id, Algorithm: string(Algorithm), Use: "sig"}
	}
	return set, nil
}

// Revoke revokes the token with id jti, which expires at expiresAt; Verify
// refuses it from then on. Revocations are kept until expiresAt.
func (is *Issuer) Revoke(ctx context.Context, jti string, expiresAt time.Time) error {
	return is.opts.Store.RevokeUserToken(ctx, jti, expiresAt)
}

// Expectation is what Verify requires of a token beyond its signature,
// issuer and expiry.
type Expectation struct {
	// Audience must be one of the token's audiences.
	Audience string
	// Agent, when set, must be the agent the token was minted for.
	Agent string
}

// Verify checks token as the platform's own consumers (MCP forwarding)
// do: signed by one of the issuer's keys, from this issuer, unexpired,
// for want, and not revoked. Its errors wrap ErrInvalid when the token is
// refused, and are other errors when Verify could not decide.
func (is *Issuer) Verify(ctx context.Context, token string, want Expectation) (Claims, error) {
	set, err := is.JWKS(ctx)
	if err != nil {
		return Claims{}, err
	}
	c, err := VerifyWithKeys(set, token, is.opts.Issuer, want, is.opts.Clock.Now())
	if err != nil {
		return Claims{}, err
	}
	revoked, err := is.opts.Store.UserTokenRevoked(ctx, c.ID)
	if err != nil {
		return Claims{}, err
	}
	if revoked {
		return Claims{}, ErrRevoked
	}
	return c, nil
}

// VerifyWithKeys checks token's signature against set, its issuer, its
// expiry at now and want; it does not know revocations.
func VerifyWithKeys(set jose.JSONWebKeySet, token, issuer string, want Expectation, now time.Time) (Claims, error) {
	parsed, err := jwt.ParseSigned(token, []jose.SignatureAlgorithm{Algorithm})
	if err != nil {
		return Claims{}, fmt.Errorf("%w: %w", ErrInvalid, err)
	}
	if len(parsed.Headers) != 1 || parsed.Headers[0].KeyID == "" {
		return Claims{}, fmt.Errorf("%w: no key id", ErrInvalid)
	}
	keys := set.Key(parsed.Headers[0].KeyID)
	if len(keys) == 0 {
		return Claims{}, fmt.Errorf("%w: unknown key %q", ErrInvalid, parsed.Headers[0].KeyID)
	}
	var c Claims
	if err := parsed.Claims(keys[0].Key, &c); err != nil {
		return Claims{}, fmt.Errorf("%w: %w", ErrInvalid, err)
	}
	std := jwt.Claims{Issuer: c.Issuer, Subject: c.Subject, Audience: c.Audience, Expiry: c.Expiry, IssuedAt: c.IssuedAt, ID: c.ID}
	if c.Expiry == nil || c.ID == "" || c.Subject == "" || c.Actor.Subject == "" {
		return Claims{}, fmt.Errorf("%w: exp, jti, sub or act missing", ErrInvalid)
	}
	err = std.ValidateWithLeeway(jwt.Expected{Issuer: issuer, Time: now}, leeway)
	switch {
	case errors.Is(err, jwt.ErrExpired):
		return Claims{}, ErrExpired
	case err != nil:
		return Claims{}, fmt.Errorf("%w: %w", ErrInvalid, err)
	case !c.Audience.Contains(want.Audience):
		return Claims{}, ErrAudience
	case want.Agent != "" && c.Actor.Subject != want.Agent:
		return Claims{}, ErrAgent
	}
	return c, nil
}
