package computeapi

import (
	"context"
	"crypto/sha256"
	"crypto/subtle"
	"errors"
	"fmt"
	"net/http"
	"strings"

	"github.com/agentbox/terraform-provider-agentbox/internal/store"
)

// ErrInvalidToken is what an Authenticator returns for a token it does not
// know. The API answers 401 without saying more, so that a caller cannot
// learn which tokens exist.
var ErrInvalidToken = errors.New("invalid token")

// Principal is who made a call, as established from its token.
type Principal struct {
	// Name identifies the token holder in logs and the audit log; it is
	// never a secret.
	Name string
	// Kind is how the principal authenticated: "admin", "agent" or
	// "staff" (the store's token kinds).
	Kind string
	// Subject is who holds the token, as recorded when it was minted (a
	// staff member's id for staff tokens); it names staff in console
	// sessions.
	Subject string
	// AllAgents lets the principal address any agent's sandbox (the admin
	// token). Otherwise it may address only AgentID.
	AllAgents bool
	AgentID   string
}

// MayAccessAgent reports whether the principal may act on agentID's
// sandbox. One agent must never reach another's sandbox.
func (p *Principal) MayAccessAgent(agentID string) bool {
	return p != nil && (p.AllAgents || (p.AgentID != "" && p.AgentID == agentID))
}

// Authenticator maps a bearer token to a Principal. It is an interface so
// that per-agent and time-boxed staff tokens, which live in the store, can
// be added beside the admin token without changing the handlers.
type Authenticator interface {
	// Authenticate returns ErrInvalidToken (possibly wrapped) for an
	// unknown token and other errors for failures to decide.
	Authenticate(ctx context.Context, token string) (*Principal, error)
}

// TokenHash is the SHA-256 of a token. The control plane keeps only hashes,
// so a memory dump or a leaked configuration does not reveal usable tokens.
type TokenHash [sha256.Size]byte

// HashToken returns the hash the API compares a presented token with.
func HashToken(token string) TokenHash { return sha256.Sum256([]byte(token)) }

type adminTokenAuth struct{ hash TokenHash }

// NewAdminTokenAuthenticator accepts the token with the given hash as the
// admin, who may address every agent. A zero hash is refused: it would
// mean the token was never configured, and the API must then fail closed
// rather than compare against garbage.
func NewAdminTokenAuthenticator(hash TokenHash) (Authenticator, error) {
	if hash == (TokenHash{}) {
		return nil, errors.New("admin token hash is empty")
	}
	return &adminTokenAuth{hash: hash}, nil
}

func (a *adminTokenAuth) Authenticate(_ context.Context, token string) (*Principal, error) {
	sum := HashToken(token)
	// Constant time, so that response timing does not leak how much of the
	// hash a guess got right.
	if subtle.ConstantTimeCompare(sum[:], a.hash[:]) != 1 {
		return nil, ErrInvalidToken
	}
	return &Principal{Name: "admin", Kind: string(store.TokenAdmin), AllAgents: true}, nil
}

// bearerToken extracts the token of an "Authorization: Bearer <token>"
// header; the scheme is case-insensitive (RFC 7235).
func bearerToken(r *http.Request) (string, bool) {
	h := r.Header.Get("Authorization")
	scheme, token, ok := strings.Cut(h, " ")
	if !ok || !strings.EqualFold(scheme, "Bearer") {
		return "", false
	}
	token = strings.TrimSpace(token)
	return token, token != ""
}

type principalKey struct{}

// PrincipalFrom returns the principal an authenticated request was made
// by, or nil outside an authenticated handler.
func PrincipalFrom(ctx context.Context) *Principal {
	p, _ := ctx.Value(principalKey{}).(*Principal)
	return p
}

// NewStoreAuthenticator accepts the tokens whose hashes the store holds:
// agent tokens address their agent's sandbox, admin tokens every sandbox,
// staff tokens none (they mint console sessions). Revoked and expired
// tokens are refused like unknown ones.
func NewStoreAuthenticator(st *store.Store) Authenticator { return storeAuth{st} }

type storeAuth struct{ st *store.Store }

func (a storeAuth) Authenticate(ctx context.Context, token string) (*Principal, error) {
	t, err := a.st.LookupToken(ctx, store.TokenHash(HashToken(token)))
	switch {
	case errors.Is(err, store.ErrNotFound), errors.Is(err, store.ErrRevoked), errors.Is(err, store.ErrExpired):
		return nil, fmt.Errorf("%w: %w", ErrInvalidToken, err)
	case err != nil:
		return nil, err
	}
	return &Principal{Name: string(t.Kind) + ":" + t.ID, Kind: string(t.Kind), Subject: t.Subject, AgentID: t.AgentID,
		AllAgents: t.Kind == store.TokenAdmin}, nil
}

// ChainAuthenticators tries each authenticator in turn and returns the
// first that knows the token.
func ChainAuthenticators(as ...Authenticator) Authenticator { return chain(as) }

type chain []Authenticator

func (c chain) Authenticate(ctx context.Context, token string) (*Principal, error) {
	for _, a := range c {
		p, err := a.Authenticate(ctx, token)
		if !errors.Is(err, ErrInvalidToken) {
			return p, err
		}
	}
	return nil, ErrInvalidToken
}
