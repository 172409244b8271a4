package store_test

import (
	"context"
	"testing"
	"time"

	"github.com/agentbox/terraform-provider-agentbox/internal/store"
)

func TestUserTokenIssuer(t *testing.T) {
	for _, b := range backends {
		t.Run(b.name, func(t *testing.T) { testUserTokenIssuer(t, b) })
	}
}

func testUserTokenIssuer(t *testing.T, b backend) {
	ctx := context.Background()
	s := open(t, b.newDSN(t), store.Options{})
	t0 := time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC)
	k1 := store.UserTokenKey{ID: "1", Algorithm: "ES256", PrivateJWK: `{"k":1}`, NotBefore: t0, NotAfter: t0.Add(time.Hour)}
	if got, err := s.AddUserTokenKey(ctx, k1); err != nil || got.PrivateJWK != k1.PrivateJWK || !got.NotAfter.Equal(k1.NotAfter) {
		t.Fatalf("add key: %+v, %v", got, err)
	}
	// A second replica rotating at the same moment gets the first key.
	other := k1
	other.PrivateJWK = `{"k":2}`
	if got, err := s.AddUserTokenKey(ctx, other); err != nil || got.PrivateJWK != k1.PrivateJWK {
		t.Fatalf("racing add: %+v, %v", got, err)
	}
	k2 := store.UserTokenKey{ID: "2", Algorithm: "ES256", PrivateJWK: `{"k":3}`, NotBefore: t0.Add(time.Hour), NotAfter: t0.Add(2 * time.Hour)}
	if _, err := s.AddUserTokenKey(ctx, k2); err != nil {
		t.Fatal(err)
	}
	if _, err := s.AddUserTokenKey(ctx, store.UserTokenKey{ID: "3"}); err == nil {
		t.Error("a key without material was accepted")
	}
	keys, err := s.UserTokenKeys(ctx, t0.Add(90*time.Minute))
	if err != nil || len(keys) != 1 || keys[0].ID != "2" {
		t.Fatalf("keys still signing after 90m: %+v, %v", keys, err)
	}
	if keys, _ = s.UserTokenKeys(ctx, t0); len(keys) != 2 || keys[0].ID != "1" {
		t.Fatalf("all keys, oldest first: %+v", keys)
	}
	if n, err := s.DeleteUserTokenKeys(ctx, t0.Add(90*time.Minute)); err != nil || n != 1 {
		t.Fatalf("delete old keys: %d, %v", n, err)
	}

	exp := t0.Add(time.Hour)
	if revoked, err := s.UserTokenRevoked(ctx, "jti-1"); err != nil || revoked {
		t.Fatalf("fresh jti revoked: %v, %v", revoked, err)
	}
	for range 2 {
		if err := s.RevokeUserToken(ctx, "jti-1", exp); err != nil {
			t.Fatal(err)
		}
	}
	if revoked, err := s.UserTokenRevoked(ctx, "jti-1"); err != nil || !revoked {
		t.Fatalf("revoked jti: %v, %v", revoked, err)
	}
	if n, err := s.PruneUserTokenRevocations(ctx, exp); err != nil || n != 0 {
		t.Fatalf("prune before expiry: %d, %v", n, err)
	}
	if n, err := s.PruneUserTokenRevocations(ctx, exp.Add(time.Second)); err != nil || n != 1 {
		t.Fatalf("prune after expiry: %d, %v", n, err)
	}
}

// Exchange tokens are stored in both dialects (migration 00013 widened
// the kind's constraint).
func TestExchangeTokenKind(t *testing.T) {
	for _, b := range backends {
		t.Run(b.name, func(t *testing.T) {
			ctx := context.Background()
			s := open(t, b.newDSN(t), store.Options{})
			if _, err := s.CreateToken(ctx, store.Token{Hash: store.TokenHash{7}, Kind: store.TokenExchange, Subject: "idp"}); err != nil {
				t.Fatal(err)
			}
			if got, err := s.LookupToken(ctx, store.TokenHash{7}); err != nil || got.Kind != store.TokenExchange {
				t.Fatalf("read back: %+v, %v", got, err)
			}
		})
	}
}
