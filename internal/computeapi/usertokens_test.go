package computeapi

import (
	"context"
	"encoding/json"
	"encoding/pem"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"path/filepath"
	"strings"
	"testing"
	"time"

	jose "github.com/go-jose/go-jose/v4"
	"github.com/go-jose/go-jose/v4/jwt"

	api "github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
	"github.com/agentbox/terraform-provider-agentbox/internal/store"
	"github.com/agentbox/terraform-provider-agentbox/internal/usertoken"
)

const testIssuer = "https://agentbox-api.agentbox-system.svc"

// userTokenAPI serves the fixture's cluster through a Server with a real
// SQLite store and a user token issuer (10 minute maximum lifetime).
func userTokenAPI(t *testing.T, f *fixture) (*usertoken.Issuer, *store.Store, *httptest.Server, func(token string) *api.Client) {
	t.Helper()
	st, err := store.OpenSQLite(context.Background(), filepath.Join(t.TempDir(), "agentbox.db"), store.Options{Now: f.clock.Now})
	if err != nil {
		t.Fatal(err)
	}
	issuer, err := usertoken.New(usertoken.Options{Issuer: testIssuer, Store: st, Clock: f.clock,
		RotationPeriod: time.Hour, MaxLifetime: 10 * time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	admin, err := NewAdminTokenAuthenticator(HashToken(adminToken))
	if err != nil {
		t.Fatal(err)
	}
	srv, err := NewServer(Options{Sandboxes: f.kube, Leases: f.kube, Supervisors: f.services.supervisors,
		Authenticator: ChainAuthenticators(admin, NewStoreAuthenticator(st)), TrustDomain: testTrustDomain,
		Clock: f.clock, Store: st, FilespacePushDelay: -1, UserTokens: issuer})
	if err != nil {
		t.Fatal(err)
	}
	ts := httptest.NewTLSServer(contractCheck(t, srv.Handler()))
	t.Cleanup(func() {
		ts.Close()
		srv.Close()
		st.Close()
	})
	return issuer, st, ts, func(token string) *api.Client {
		c, err := api.New(ts.URL, token, pemOf(ts))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(c.CloseIdleConnections)
		return c
	}
}

func pemOf(ts *httptest.Server) []byte {
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: ts.Certificate().Raw})
}

// TestUserTokenExchange mints a user token through the Go client, checks
// it the way a third-party MCP server would (the JWKS fetched anonymously
// over HTTPS, read by the JOSE library), and through the platform's own
// Verify, and shows who may mint, revocation and the audit record.
func TestUserTokenExchange(t *testing.T) {
	f := newFixture(t, "")
	issuer, st, ts, client := userTokenAPI(t, f)
	ctx := context.Background()
	admin := client(adminToken)

	got, err := admin.ExchangeToken(ctx, api.TokenExchangeRequest{SubjectToken: "user-7", Audience: "mcp://github",
		Scope: "repo:read issues:write", ExpiresIn: 3600, AgentID: "agent-1", RunID: "run-1", LeaseID: "lease-1"})
	if err != nil {
		t.Fatal(err)
	}
	if got.ExpiresIn != 600 || got.TokenType != "Bearer" || got.IssuedTokenType != api.TokenTypeJWT || got.JTI == "" ||
		!got.ExpiresAt.Equal(f.clock.Now().Add(10*time.Minute).Truncate(time.Second)) {
		t.Fatalf("exchange answered %+v (want the 10m cap)", got)
	}

	// A consumer: discovery, then the JWKS, without a token.
	var disco struct {
		Issuer  string `json:"issuer"`
		JWKSURI string `json:"jwks_uri"`
	}
	getJSON(t, ts, api.PathOpenIDConfiguration, &disco)
	if disco.Issuer != testIssuer || disco.JWKSURI != testIssuer+api.PathJWKS {
		t.Fatalf("discovery %+v", disco)
	}
	var set jose.JSONWebKeySet
	cache := getJSON(t, ts, api.PathJWKS, &set)
	if !strings.HasPrefix(cache, "public, max-age=") {
		t.Errorf("JWKS Cache-Control %q", cache)
	}
	parsed, err := jwt.ParseSigned(got.AccessToken, []jose.SignatureAlgorithm{jose.ES256})
	if err != nil {
		t.Fatal(err)
	}
	keys := set.Key(parsed.Headers[0].KeyID)
	if len(keys) != 1 || !keys[0].IsPublic() {
		t.Fatalf("signing key %q not published as a public key: %+v", parsed.Headers[0].KeyID, set)
	}
	var std jwt.Claims
	var all map[string]any
	if err := parsed.Claims(keys[0].Key, &std, &all); err != nil {
		t.Fatalf("signature: %v", err)
	}
	if err := std.Validate(jwt.Expected{Issuer: testIssuer, AnyAudience: jwt.Audience{"mcp://github"}, Time: f.clock.Now()}); err != nil {
		t.Fatalf("claims: %v", err)
	}
	act, _ := all["act"].(map[string]any)
	if all["sub"] != "user-7" || act["sub"] != "agent-1" || all["scope"] != "repo:read issues:write" || all["run_id"] != "run-1" ||
		all["lease_id"] != "lease-1" || all["jti"] != got.JTI {
		t.Errorf("claims %v", all)
	}
	// The Go client's JWKS is the same set.
	if raw, err := client("any-token").JWKS(ctx); err != nil || !strings.Contains(string(raw), parsed.Headers[0].KeyID) {
		t.Errorf("client JWKS: %s, %v", raw, err)
	}

	want := usertoken.Expectation{Audience: "mcp://github", Agent: "agent-1"}
	if _, err := issuer.Verify(ctx, got.AccessToken, want); err != nil {
		t.Fatalf("Verify: %v", err)
	}
	if _, err := issuer.Verify(ctx, got.AccessToken, usertoken.Expectation{Audience: "mcp://github", Agent: "agent-2"}); !errors.Is(err, usertoken.ErrAgent) {
		t.Errorf("Verify for another agent: %v", err)
	}

	// Who may mint: not an agent (for itself or another), not staff, not
	// anyone without a token.
	agentTok, err := admin.CreateToken(ctx, api.CreateTokenRequest{Kind: api.TokenKindAgent, AgentID: "agent-1"})
	if err != nil {
		t.Fatal(err)
	}
	for _, agent := range []string{"agent-1", "agent-2"} {
		_, err = client(agentTok.Token).ExchangeToken(ctx, api.TokenExchangeRequest{SubjectToken: "user-7", Audience: "mcp://github", AgentID: agent})
		wantAPIError(t, err, api.CodePermissionDenied, http.StatusForbidden)
	}
	err = client(agentTok.Token).RevokeUserToken(ctx, got.JTI)
	wantAPIError(t, err, api.CodePermissionDenied, http.StatusForbidden)
	_, err = client("abx_not-a-token").ExchangeToken(ctx, api.TokenExchangeRequest{SubjectToken: "user-7", Audience: "mcp://github", AgentID: "agent-1"})
	wantAPIError(t, err, api.CodeUnauthenticated, http.StatusUnauthorized)

	for name, req := range map[string]api.TokenExchangeRequest{
		"grant type":   {GrantType: "client_credentials", SubjectToken: "u", Audience: "a", AgentID: "agent-1"},
		"subject type": {SubjectTokenType: "urn:ietf:params:oauth:token-type:jwt", SubjectToken: "u", Audience: "a", AgentID: "agent-1"},
		"no user":      {Audience: "a", AgentID: "agent-1"},
		"no audience":  {SubjectToken: "u", AgentID: "agent-1"},
		"no agent":     {SubjectToken: "u", Audience: "a"},
		"negative":     {SubjectToken: "u", Audience: "a", AgentID: "agent-1", ExpiresIn: -1},
		"control char": {SubjectToken: "u\n", Audience: "a", AgentID: "agent-1"},
	} {
		_, err := admin.ExchangeToken(ctx, req)
		var e *api.Error
		if !errors.As(err, &e) || e.Code != api.CodeInvalidArgument {
			t.Errorf("%s: %v, want invalid_argument", name, err)
		}
	}

	// Revoked: the platform's verification refuses it from then on.
	if err := admin.RevokeUserToken(ctx, got.JTI); err != nil {
		t.Fatal(err)
	}
	if _, err := issuer.Verify(ctx, got.AccessToken, want); !errors.Is(err, usertoken.ErrRevoked) {
		t.Errorf("Verify after revocation: %v", err)
	}
	err = admin.RevokeUserToken(ctx, "")
	wantAPIError(t, err, api.CodeInvalidArgument, http.StatusBadRequest)

	// The audit log has the exchange with its jti, never the token.
	var rec *api.AuditRecord
	deadline := time.Now().Add(10 * time.Second)
	for rec == nil && time.Now().Before(deadline) {
		page, err := admin.QueryAudit(ctx, url.Values{"operation": {"exchange_token"}, "caller": {"admin"}})
		if err != nil {
			t.Fatal(err)
		}
		for i := range page.Records {
			if page.Records[i].Result == "ok" {
				rec = &page.Records[i]
			}
		}
		time.Sleep(20 * time.Millisecond)
	}
	if rec == nil || rec.AgentID != "agent-1" || !strings.Contains(rec.Detail, got.JTI) || !strings.Contains(rec.Detail, "user-7") {
		t.Fatalf("audit record of the exchange: %+v", rec)
	}
	page, err := st.QueryAudit(ctx, store.AuditQuery{Limit: 1000})
	if err != nil {
		t.Fatal(err)
	}
	sig := got.AccessToken[strings.LastIndexByte(got.AccessToken, '.')+1:]
	for _, r := range page.Records {
		if b, _ := json.Marshal(r); strings.Contains(string(b), sig) {
			t.Errorf("audit record %d holds the token", r.Seq)
		}
	}
}

// TestExchangeTokenActsForUsers: an exchange token, made for the service
// that vouches for users, mints and revokes user tokens and can do
// nothing else; a staff token cannot mint them.
func TestExchangeTokenActsForUsers(t *testing.T) {
	f := newFixture(t, "")
	issuer, _, _, client := userTokenAPI(t, f)
	ctx := context.Background()
	admin := client(adminToken)
	ex, err := admin.CreateToken(ctx, api.CreateTokenRequest{Kind: api.TokenKindExchange, Subject: "idp-gateway"})
	if err != nil {
		t.Fatal(err)
	}
	gw := client(ex.Token)
	got, err := gw.ExchangeToken(ctx, api.TokenExchangeRequest{SubjectToken: "user-9", Audience: "mcp://github", AgentID: "agent-1"})
	if err != nil {
		t.Fatalf("exchange with an exchange token: %v", err)
	}
	want := usertoken.Expectation{Audience: "mcp://github", Agent: "agent-1"}
	if c, err := issuer.Verify(ctx, got.AccessToken, want); err != nil || c.Subject != "user-9" {
		t.Fatalf("Verify: %+v, %v", c, err)
	}
	if err := gw.RevokeUserToken(ctx, got.JTI); err != nil {
		t.Fatalf("revoke with an exchange token: %v", err)
	}
	if _, err := issuer.Verify(ctx, got.AccessToken, want); !errors.Is(err, usertoken.ErrRevoked) {
		t.Errorf("Verify after revocation: %v", err)
	}

	// Nothing else: no sandbox, no runs, no tokens, no audit.
	_, err = gw.Status(ctx, "agent-1")
	wantAPIError(t, err, api.CodePermissionDenied, http.StatusForbidden)
	_, err = gw.ListRuns(ctx, api.RunFilter{})
	wantAPIError(t, err, api.CodePermissionDenied, http.StatusForbidden)
	_, err = gw.CreateToken(ctx, api.CreateTokenRequest{Kind: api.TokenKindExchange})
	wantAPIError(t, err, api.CodePermissionDenied, http.StatusForbidden)
	_, err = gw.QueryAudit(ctx, nil)
	wantAPIError(t, err, api.CodePermissionDenied, http.StatusForbidden)

	// An exchange token is bound to no agent; staff may not act for users.
	_, err = admin.CreateToken(ctx, api.CreateTokenRequest{Kind: api.TokenKindExchange, AgentID: "agent-1"})
	wantAPIError(t, err, api.CodeInvalidArgument, http.StatusBadRequest)
	staff, err := admin.CreateToken(ctx, api.CreateTokenRequest{Kind: api.TokenKindStaff, Subject: "alice"})
	if err != nil {
		t.Fatal(err)
	}
	_, err = client(staff.Token).ExchangeToken(ctx, api.TokenExchangeRequest{SubjectToken: "user-9", Audience: "a", AgentID: "agent-1"})
	wantAPIError(t, err, api.CodePermissionDenied, http.StatusForbidden)
}

// TestUserTokensOff: without an issuer the endpoints answer clearly.
func TestUserTokensOff(t *testing.T) {
	f := newFixture(t, "")
	_, err := f.client(t, adminToken).ExchangeToken(context.Background(),
		api.TokenExchangeRequest{SubjectToken: "u", Audience: "a", AgentID: "agent-1"})
	wantAPIError(t, err, api.CodeUnavailable, http.StatusServiceUnavailable)
	_, err = f.client(t, adminToken).JWKS(context.Background())
	wantAPIError(t, err, api.CodeNotFound, http.StatusNotFound)
}

// getJSON GETs path without a token and decodes the answer into out; it
// returns the Cache-Control header.
func getJSON(t *testing.T, ts *httptest.Server, path string, out any) string {
	t.Helper()
	resp, err := ts.Client().Get(ts.URL + path)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("GET %s: %d %s", path, resp.StatusCode, body)
	}
	if err := json.Unmarshal(body, out); err != nil {
		t.Fatalf("GET %s: %v", path, err)
	}
	return resp.Header.Get("Cache-Control")
}
