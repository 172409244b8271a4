package client

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"time"
)

// The Compute API issues user tokens: short-lived JWTs (ES256) saying an
// agent acts for a user, for the MCP servers and APIs the agent calls.
//
//	POST /v1/token                           TokenExchangeRequest -> TokenExchangeResponse (admin)
//	POST /v1/token/revoke                    RevokeUserTokenRequest -> 204 No Content (admin)
//	GET  /.well-known/jwks.json              the keys that verify them (no token needed)
//	GET  /.well-known/openid-configuration   the issuer's metadata (no token needed)
const (
	PathTokenExchange       = "/v1/token"
	PathTokenRevoke         = "/v1/token/revoke"
	PathJWKS                = "/.well-known/jwks.json"
	PathOpenIDConfiguration = "/.well-known/openid-configuration"

	// GrantTypeTokenExchange is RFC 8693's grant type, the only one.
	GrantTypeTokenExchange = "urn:ietf:params:oauth:grant-type:token-exchange"
	// SubjectTokenTypeUserID says the subject token is an opaque user id
	// the caller asserts: the platform does not authenticate users itself,
	// it trusts the admin or orchestrator that calls the exchange to have.
	SubjectTokenTypeUserID = "urn:agentbox:params:oauth:token-type:user-id"
	// TokenTypeJWT is the issued token's type.
	TokenTypeJWT = "urn:ietf:params:oauth:token-type:jwt"
)

// TokenExchangeRequest asks for a user token (RFC 8693's parameters, as
// JSON, plus the agent the token is bound to).
type TokenExchangeRequest struct {
	// GrantType must be GrantTypeTokenExchange.
	GrantType string `json:"grant_type"`
	// SubjectToken is the user the agent acts for (the token's sub).
	SubjectToken string `json:"subject_token"`
	// SubjectTokenType must be SubjectTokenTypeUserID (the default).
	SubjectTokenType string `json:"subject_token_type,omitempty"`
	// Audience is who the token is for (the token's aud): the MCP server
	// or API that will verify it.
	Audience string `json:"audience"`
	// Scope is a space-separated list of scopes, passed through.
	Scope string `json:"scope,omitempty"`
	// ExpiresIn is the token's life in seconds; 0 or more than the
	// platform's maximum gives the maximum.
	ExpiresIn int64 `json:"expires_in,omitempty"`
	// AgentID is the agent that acts for the user (the token's act.sub).
	AgentID string `json:"agent_id"`
	// RunID and LeaseID, when given, are carried as claims.
	RunID   string `json:"run_id,omitempty"`
	LeaseID string `json:"lease_id,omitempty"`
}

// TokenExchangeResponse is an issued user token (RFC 8693's response).
// AccessToken is shown only here: the platform keeps its jti alone.
type TokenExchangeResponse struct {
	AccessToken     string    `json:"access_token"`
	IssuedTokenType string    `json:"issued_token_type"`
	TokenType       string    `json:"token_type"`
	ExpiresIn       int64     `json:"expires_in"`
	Scope           string    `json:"scope,omitempty"`
	JTI             string    `json:"jti"`
	ExpiresAt       time.Time `json:"expires_at"`
}

// RevokeUserTokenRequest revokes an issued user token by its jti.
type RevokeUserTokenRequest struct {
	JTI string `json:"jti"`
}

// ExchangeToken mints a user token (admin only).
func (c *Client) ExchangeToken(ctx context.Context, req TokenExchangeRequest) (*TokenExchangeResponse, error) {
	if req.GrantType == "" {
		req.GrantType = GrantTypeTokenExchange
	}
	if req.SubjectTokenType == "" {
		req.SubjectTokenType = SubjectTokenTypeUserID
	}
	body, err := json.Marshal(req)
	if err != nil {
		return nil, fmt.Errorf("encode token exchange: %w", err)
	}
	var out TokenExchangeResponse
	if err := c.do(ctx, http.MethodPost, PathTokenExchange, body, &out); err != nil {
		return nil, err
	}
	return &out, nil
}

// RevokeUserToken revokes the user token with the given jti (admin only);
// the platform's verification refuses it until it expires.
func (c *Client) RevokeUserToken(ctx context.Context, jti string) error {
	body, err := json.Marshal(RevokeUserTokenRequest{JTI: jti})
	if err != nil {
		return fmt.Errorf("encode token revocation: %w", err)
	}
	return c.do(ctx, http.MethodPost, PathTokenRevoke, body, nil)
}

// JWKS fetches the keys that verify user tokens, as raw JSON for a JOSE
// library to read. The endpoint needs no token; the client's is sent
// and ignored.
func (c *Client) JWKS(ctx context.Context) (json.RawMessage, error) {
	var out json.RawMessage
	if err := c.do(ctx, http.MethodGet, PathJWKS, nil, &out); err != nil {
		return nil, err
	}
	return out, nil
}
