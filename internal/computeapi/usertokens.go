package computeapi

import (
	"encoding/json"
	"net/http"
	"strconv"
	"strings"
	"time"

	api "github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
	"github.com/agentbox/terraform-provider-agentbox/internal/store"
	"github.com/agentbox/terraform-provider-agentbox/internal/usertoken"
)

// maxClaimBytes bounds the text claims a caller puts into a user token,
// which every call the agent makes with it carries.
const maxClaimBytes = 1024

// userTokens checks that the caller may mint or revoke user tokens and
// that the issuer is configured. Only an admin or an exchange token may:
// it asserts who the user is, which an agent's own token must never do (a
// compromised sandbox could then act for any user, or as another agent).
func (s *Server) userTokens(r *http.Request) *api.Error {
	if p := PrincipalFrom(r.Context()); p == nil || (!p.AllAgents && p.Kind != string(store.TokenExchange)) {
		return api.Errorf(api.CodePermissionDenied, "only an admin or exchange token may exchange or revoke user tokens")
	}
	if s.userTokenIssuer == nil {
		return api.Errorf(api.CodeUnavailable, "the control plane does not issue user tokens (it runs without a store)")
	}
	return nil
}

func (s *Server) exchangeToken(w http.ResponseWriter, r *http.Request) {
	if apiErr := s.userTokens(r); apiErr != nil {
		writeError(w, apiErr)
		return
	}
	var req api.TokenExchangeRequest
	if apiErr := s.decode(w, r, &req); apiErr != nil {
		writeError(w, apiErr)
		return
	}
	maxLife := int64(s.userTokenIssuer.MaxLifetime() / time.Second)
	switch {
	case req.GrantType != api.GrantTypeTokenExchange:
		writeError(w, api.Errorf(api.CodeInvalidArgument, "grant_type must be %q, got %q", api.GrantTypeTokenExchange, req.GrantType))
		return
	case req.SubjectTokenType != "" && req.SubjectTokenType != api.SubjectTokenTypeUserID:
		writeError(w, api.Errorf(api.CodeInvalidArgument, "subject_token_type must be %q, got %q", api.SubjectTokenTypeUserID, req.SubjectTokenType))
		return
	case req.SubjectToken == "" || req.Audience == "" || req.AgentID == "":
		writeError(w, api.Errorf(api.CodeInvalidArgument, "subject_token (the user id), audience and agent_id are required"))
		return
	case req.ExpiresIn < 0:
		writeError(w, api.Errorf(api.CodeInvalidArgument, "expires_in must be 0 (the maximum, %d) or more, got %d", maxLife, req.ExpiresIn))
		return
	}
	for name, v := range map[string]string{"subject_token": req.SubjectToken, "audience": req.Audience, "scope": req.Scope,
		"agent_id": req.AgentID, "run_id": req.RunID, "lease_id": req.LeaseID} {
		if len(v) > maxClaimBytes || strings.ContainsFunc(v, func(r rune) bool { return r < ' ' }) {
			writeError(w, api.Errorf(api.CodeInvalidArgument, "%s must be at most %d bytes without control characters", name, maxClaimBytes))
			return
		}
	}
	// Capped by the maximum; compared in seconds so that a huge value does
	// not wrap around into a short Duration.
	life := time.Duration(min(req.ExpiresIn, maxLife)) * time.Second
	issued, err := s.userTokenIssuer.Issue(r.Context(), usertoken.Request{User: req.SubjectToken, Agent: req.AgentID,
		Audience: []string{req.Audience}, Scope: req.Scope, Lifetime: life, RunID: req.RunID, LeaseID: req.LeaseID})
	if err != nil {
		s.log.Error(err, "issue user token")
		writeError(w, api.Errorf(api.CodeInternal, "could not issue the token"))
		return
	}
	c := issued.Claims
	// The audit log gets the token's id and claims, never the token.
	noteAuditAgent(r.Context(), req.AgentID)
	noteAudit(r.Context(), "jti", c.ID)
	noteAudit(r.Context(), "sub", c.Subject)
	noteAudit(r.Context(), "aud", req.Audience)
	noteAudit(r.Context(), "exp", c.Expiry.Time().UTC().Format(time.RFC3339))
	exp := c.Expiry.Time().UTC()
	writeJSON(w, http.StatusOK, api.TokenExchangeResponse{AccessToken: issued.Token, IssuedTokenType: api.TokenTypeJWT,
		TokenType: "Bearer", ExpiresIn: int64(exp.Sub(c.IssuedAt.Time()) / time.Second), Scope: c.Scope, JTI: c.ID, ExpiresAt: exp})
}

func (s *Server) revokeUserToken(w http.ResponseWriter, r *http.Request) {
	if apiErr := s.userTokens(r); apiErr != nil {
		writeError(w, apiErr)
		return
	}
	var req api.RevokeUserTokenRequest
	if apiErr := s.decode(w, r, &req); apiErr != nil {
		writeError(w, apiErr)
		return
	}
	if req.JTI == "" || len(req.JTI) > maxClaimBytes {
		writeError(w, api.Errorf(api.CodeInvalidArgument, "jti is required (at most %d bytes)", maxClaimBytes))
		return
	}
	noteAudit(r.Context(), "jti", req.JTI)
	// The platform keeps no record of the tokens it issued, so it keeps
	// the revocation for the longest life a token may have: past that, the
	// token is refused as expired anyway.
	until := s.clock.Now().Add(s.userTokenIssuer.MaxLifetime() + time.Minute)
	if err := s.userTokenIssuer.Revoke(r.Context(), req.JTI, until); err != nil {
		s.log.Error(err, "revoke user token")
		writeError(w, api.Errorf(api.CodeInternal, "could not revoke the token"))
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

// wellKnownMaxAge is how long a consumer may cache the JWKS and the
// issuer's metadata: keys are published a whole rotation period before
// they sign, so any cache shorter than that sees a key before its tokens.
func (s *Server) wellKnownMaxAge() string {
	age := min(5*time.Minute, s.userTokenIssuer.RotationPeriod()/2)
	return "public, max-age=" + strconv.FormatInt(int64(age/time.Second), 10)
}

// writePublic answers v, which anyone may cache (writeJSON's answers
// must not be cached).
func (s *Server) writePublic(w http.ResponseWriter, v any) {
	data, err := json.Marshal(v)
	if err != nil {
		writeError(w, api.Errorf(api.CodeInternal, "could not encode the response"))
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Cache-Control", s.wellKnownMaxAge())
	w.WriteHeader(http.StatusOK)
	_, _ = w.Write(append(data, '\n'))
}

func (s *Server) serveJWKS(w http.ResponseWriter, r *http.Request) {
	if s.userTokenIssuer == nil {
		writeError(w, api.Errorf(api.CodeNotFound, "the control plane does not issue user tokens"))
		return
	}
	set, err := s.userTokenIssuer.JWKS(r.Context())
	if err != nil {
		s.log.Error(err, "read user token keys")
		writeError(w, api.Errorf(api.CodeInternal, "could not read the keys"))
		return
	}
	s.writePublic(w, set)
}

// openIDConfiguration is the part of OpenID Connect Discovery (and RFC
// 8414) metadata a JWT consumer reads to find the keys.
type openIDConfiguration struct {
	Issuer                 string   `json:"issuer"`
	JWKSURI                string   `json:"jwks_uri"`
	TokenEndpoint          string   `json:"token_endpoint"`
	GrantTypes             []string `json:"grant_types_supported"`
	ResponseTypes          []string `json:"response_types_supported"`
	SubjectTypes           []string `json:"subject_types_supported"`
	SigningAlgs            []string `json:"id_token_signing_alg_values_supported"`
	TokenEndpointAuthMeths []string `json:"token_endpoint_auth_methods_supported"`
}

func (s *Server) serveOpenIDConfiguration(w http.ResponseWriter, r *http.Request) {
	if s.userTokenIssuer == nil {
		writeError(w, api.Errorf(api.CodeNotFound, "the control plane does not issue user tokens"))
		return
	}
	iss := strings.TrimSuffix(s.userTokenIssuer.IssuerURL(), "/")
	s.writePublic(w, openIDConfiguration{
		Issuer: s.userTokenIssuer.IssuerURL(), JWKSURI: iss + api.PathJWKS, TokenEndpoint: iss + api.PathTokenExchange,
		GrantTypes: []string{api.GrantTypeTokenExchange}, ResponseTypes: []string{"token"}, SubjectTypes: []string{"public"},
		SigningAlgs: []string{string(usertoken.Algorithm)}, TokenEndpointAuthMeths: []string{"bearer"},
	})
}

// unauthenticatedRoutes are served without a token and not audited: they
// publish what anyone may know (public keys, the issuer's metadata) and
// are fetched often by every consumer.
func (s *Server) unauthenticatedRoutes(mux *http.ServeMux) {
	get := http.MethodGet
	for pattern, serve := range map[string]http.HandlerFunc{
		api.PathJWKS:                s.serveJWKS,
		api.PathOpenIDConfiguration: s.serveOpenIDConfiguration,
	} {
		mux.Handle(get+" "+pattern, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			r, _ = withRequestID(w, r)
			serve(w, r)
		}))
		mux.Handle(pattern, methodNotAllowed(get))
		s.routes = append(s.routes, get+" "+pattern)
	}
}
