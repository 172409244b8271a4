package usertoken_test

import (
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"testing"
	"time"

	jose "github.com/go-jose/go-jose/v4"
	"github.com/go-jose/go-jose/v4/jwt"
	clocktesting "k8s.io/utils/clock/testing"

	"github.com/agentbox/terraform-provider-agentbox/internal/store"
	"github.com/agentbox/terraform-provider-agentbox/internal/usertoken"
)

const issuerURL = "https://agentbox.test"

func openStore(t *testing.T, clk *clocktesting.FakeClock) *store.Store {
	t.Helper()
	st, err := store.OpenSQLite(context.Background(), filepath.Join(t.TempDir(), "agentbox.db"), store.Options{Now: clk.Now})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	return st
}

func newIssuer(t *testing.T, st *store.Store, clk *clocktesting.FakeClock) *usertoken.Issuer {
	t.Helper()
	is, err := usertoken.New(usertoken.Options{Issuer: issuerURL, Store: st, Clock: clk,
		RotationPeriod: time.Hour, MaxLifetime: 10 * time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	return is
}

// fetchJWKS reads the key set the way a third-party consumer does: over
// HTTP, decoded by the JOSE library, with nothing shared with the issuer.
func fetchJWKS(t *testing.T, is *usertoken.Issuer) jose.JSONWebKeySet {
	t.Helper()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		set, err := is.JWKS(r.Context())
		if err != nil {
			http.Error(w, err.Error(), 500)
			return
		}
		_ = json.NewEncoder(w).Encode(set)
	}))
	defer srv.Close()
	resp, err := http.Get(srv.URL)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var set jose.JSONWebKeySet
	if err := json.NewDecoder(resp.Body).Decode(&set); err != nil {
		t.Fatal(err)
	}
	for _, k := range set.Keys {
		if !k.IsPublic() || !k.Valid() {
			t.Fatalf("published key %s is not a valid public key", k.KeyID)
		}
	}
	return set
}

// consume verifies token with the JOSE library alone, as an MCP server
// holding the fetched JWKS would.
func consume(t *testing.T, set jose.JSONWebKeySet, token string, now time.Time) (map[string]any, error) {
	t.Helper()
	parsed, err := jwt.ParseSigned(token, []jose.SignatureAlgorithm{jose.ES256})
	if err != nil {
		return nil, err
	}
	keys := set.Key(parsed.Headers[0].KeyID)
	if len(keys) != 1 {
		return nil, errors.New("key not in the JWKS")
	}
	var std jwt.Claims
	var all map[string]any
	if err := parsed.Claims(keys[0].Key, &std, &all); err != nil {
		return nil, err
	}
	return all, std.Validate(jwt.Expected{Issuer: issuerURL, AnyAudience: jwt.Audience{"mcp://github"}, Time: now})
}

func TestIssueAndVerify(t *testing.T) {
	ctx := context.Background()
	clk := clocktesting.NewFakeClock(time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC))
	st := openStore(t, clk)
	is := newIssuer(t, st, clk)

	got, err := is.Issue(ctx, usertoken.Request{User: "user-7", Agent: "agent-1", Audience: []string{"mcp://github"},
		Scope: "repo:read", Lifetime: time.Hour, RunID: "run-1", LeaseID: "lease-1"})
	if err != nil {
		t.Fatal(err)
	}
	if got.Claims.Expiry.Time().Sub(got.Claims.IssuedAt.Time()) != 10*time.Minute {
		t.Errorf("lifetime %v, want the 10m maximum", got.Claims.Expiry.Time().Sub(got.Claims.IssuedAt.Time()))
	}
	claims, err := consume(t, fetchJWKS(t, is), got.Token, clk.Now())
	if err != nil {
		t.Fatalf("a JWKS consumer refused the token: %v", err)
	}
	act, _ := claims["act"].(map[string]any)
	if claims["sub"] != "user-7" || act["sub"] != "agent-1" || claims["scope"] != "repo:read" || claims["run_id"] != "run-1" ||
		claims["lease_id"] != "lease-1" || claims["jti"] != got.Claims.ID || claims["iss"] != issuerURL {
		t.Errorf("claims %v", claims)
	}

	want := usertoken.Expectation{Audience: "mcp://github", Agent: "agent-1"}
	if c, err := is.Verify(ctx, got.Token, want); err != nil || c.Subject != "user-7" {
		t.Fatalf("Verify: %+v, %v", c, err)
	}
	for name, c := range map[string]struct {
		want usertoken.Expectation
		err  error
	}{
		"other audience": {usertoken.Expectation{Audience: "mcp://slack", Agent: "agent-1"}, usertoken.ErrAudience},
		"no audience":    {usertoken.Expectation{Agent: "agent-1"}, usertoken.ErrAudience},
		"other agent":    {usertoken.Expectation{Audience: "mcp://github", Agent: "agent-2"}, usertoken.ErrAgent},
	} {
		if _, err := is.Verify(ctx, got.Token, c.want); !errors.Is(err, c.err) {
			t.Errorf("%s: %v, want %v", name, err, c.err)
		}
	}
	tampered := got.Token[:len(got.Token)-4] + "AAAA"
	if _, err := is.Verify(ctx, tampered, want); !errors.Is(err, usertoken.ErrInvalid) {
		t.Errorf("tampered signature: %v", err)
	}
	// A token signed by another issuer's key (same kid) is refused.
	other := newIssuer(t, openStore(t, clk), clk)
	forged, err := other.Issue(ctx, usertoken.Request{User: "user-7", Agent: "agent-1", Audience: []string{"mcp://github"}})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := is.Verify(ctx, forged.Token, want); !errors.Is(err, usertoken.ErrInvalid) {
		t.Errorf("token of another key: %v", err)
	}

	// Revoked: refused at once, by this replica and by a second one on the
	// same store.
	if err := is.Revoke(ctx, got.Claims.ID, got.Claims.Expiry.Time()); err != nil {
		t.Fatal(err)
	}
	replica := newIssuer(t, st, clk)
	for _, v := range []*usertoken.Issuer{is, replica} {
		if _, err := v.Verify(ctx, got.Token, want); !errors.Is(err, usertoken.ErrRevoked) {
			t.Errorf("revoked token: %v", err)
		}
	}

	// Expired: past exp (and the leeway) it is refused.
	fresh, err := is.Issue(ctx, usertoken.Request{User: "user-7", Agent: "agent-1", Audience: []string{"mcp://github"}, Lifetime: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	clk.Step(2 * time.Minute)
	if _, err := is.Verify(ctx, fresh.Token, want); !errors.Is(err, usertoken.ErrExpired) {
		t.Errorf("expired token: %v", err)
	}

	for name, r := range map[string]usertoken.Request{
		"no user":     {Agent: "a", Audience: []string{"x"}},
		"no agent":    {User: "u", Audience: []string{"x"}},
		"no audience": {User: "u", Agent: "a"},
		"negative":    {User: "u", Agent: "a", Audience: []string{"x"}, Lifetime: -time.Second},
	} {
		if _, err := is.Issue(ctx, r); err == nil {
			t.Errorf("%s: issued", name)
		}
	}
}

// TestRotation shows the keys rotating each period, the next key
// published before it signs, the previous one kept until its last token
// has expired, and replicas agreeing on the keys.
func TestRotation(t *testing.T) {
	ctx := context.Background()
	clk := clocktesting.NewFakeClock(time.Date(2030, 1, 2, 3, 0, 0, 0, time.UTC))
	st := openStore(t, clk)
	a, b := newIssuer(t, st, clk), newIssuer(t, st, clk)

	kid := func(tok string) string {
		p, err := jwt.ParseSigned(tok, []jose.SignatureAlgorithm{jose.ES256})
		if err != nil {
			t.Fatal(err)
		}
		return p.Headers[0].KeyID
	}
	req := usertoken.Request{User: "u", Agent: "agent-1", Audience: []string{"mcp://github"}}
	first, err := a.Issue(ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	setA, setB := fetchJWKS(t, a), fetchJWKS(t, b)
	if len(setA.Keys) != 2 || len(setB.Keys) != 2 || setA.Keys[0].KeyID != setB.Keys[0].KeyID || setA.Keys[1].KeyID != setB.Keys[1].KeyID {
		t.Fatalf("replicas publish %v and %v, want the same current and next key", setA.Keys, setB.Keys)
	}
	if kid(first.Token) != setA.Keys[0].KeyID {
		t.Fatalf("signed with %s, want the current key %s", kid(first.Token), setA.Keys[0].KeyID)
	}
	next := setA.Keys[1].KeyID

	// Just before the period ends: a token valid for 10 more minutes.
	clk.SetTime(time.Date(2030, 1, 2, 3, 59, 0, 0, time.UTC))
	late, err := a.Issue(ctx, req)
	if err != nil || kid(late.Token) != kid(first.Token) {
		t.Fatalf("late token: %v, key %s", err, kid(late.Token))
	}
	// The next period: the pre-published key signs; the old one is still
	// published, so the late token still verifies with a fresh JWKS.
	clk.SetTime(time.Date(2030, 1, 2, 4, 1, 0, 0, time.UTC))
	rotated, err := b.Issue(ctx, req)
	if err != nil || kid(rotated.Token) != next {
		t.Fatalf("after rotation: %v, key %s, want %s", err, kid(rotated.Token), next)
	}
	set := fetchJWKS(t, a)
	if len(set.Keys) != 3 {
		t.Fatalf("during the overlap %d keys are published, want previous, current and next", len(set.Keys))
	}
	for _, tok := range []string{late.Token, rotated.Token} {
		if _, err := consume(t, set, tok, clk.Now()); err != nil {
			t.Errorf("during the overlap: %v", err)
		}
		if _, err := a.Verify(ctx, tok, usertoken.Expectation{Audience: "mcp://github"}); err != nil {
			t.Errorf("Verify during the overlap: %v", err)
		}
	}
	// Once every token of the old key has expired, it is no longer
	// published.
	clk.SetTime(time.Date(2030, 1, 2, 4, 12, 0, 0, time.UTC))
	set = fetchJWKS(t, a)
	if len(set.Keys) != 2 || len(set.Key(kid(first.Token))) != 0 {
		t.Fatalf("after the overlap the JWKS has %d keys, old key still there: %v", len(set.Keys), len(set.Key(kid(first.Token))) != 0)
	}

	// A restart (a new Issuer on the same store) keeps the keys.
	now, err := a.Issue(ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	restarted := newIssuer(t, st, clk)
	if _, err := restarted.Verify(ctx, now.Token, usertoken.Expectation{Audience: "mcp://github"}); err != nil {
		t.Errorf("after a restart: %v", err)
	}
}
