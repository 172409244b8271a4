package computeapi

import (
	"context"
	"net/http"
	"testing"
	"time"

	api "github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
)

// TestTTLBounds: a token's and a console session's ttl_seconds are checked
// before they become a duration. Values past the bound, including those
// whose product with a second wraps around an int64 of nanoseconds
// (9223372037 s to a negative lifetime, 18446744074 s to 290 ms), are
// refused instead of answered with a token that is already expired or a
// session that ends at once.
func TestTTLBounds(t *testing.T) {
	st := tempStore(t)
	clients := realSupervisorAPI(t, st, nil)
	ctx := context.Background()
	admin := clients(adminToken)
	maxToken := int64(maxTokenTTL / time.Second)

	for _, ttl := range []int64{-1, maxToken + 1, 9223372037, 18446744074} {
		_, err := admin.CreateToken(ctx, api.CreateTokenRequest{Kind: api.TokenKindAdmin, TTLSeconds: ttl})
		wantAPIError(t, err, api.CodeInvalidArgument, http.StatusBadRequest)
	}
	for _, ttl := range []int64{0, 1, maxToken} {
		tok, err := admin.CreateToken(ctx, api.CreateTokenRequest{Kind: api.TokenKindAdmin, TTLSeconds: ttl})
		if err != nil {
			t.Fatalf("token with ttl_seconds %d: %v", ttl, err)
		}
		switch {
		case ttl == 0 && tok.ExpiresAt != nil:
			t.Errorf("ttl_seconds 0 means no expiry, got %v", tok.ExpiresAt)
		case ttl > 0 && (tok.ExpiresAt == nil || tok.ExpiresAt.Sub(tok.CreatedAt).Round(time.Minute) != (time.Duration(ttl)*time.Second).Round(time.Minute)):
			t.Errorf("ttl_seconds %d: created %v, expires %v", ttl, tok.CreatedAt, tok.ExpiresAt)
		}
		if ttl == maxToken {
			// The longest lifetime is a token that works.
			if _, err := clients(tok.Token).Status(ctx, "agent-1"); err != nil {
				t.Errorf("the token of the longest lifetime: %v", err)
			}
		}
	}

	staffTok, err := admin.CreateToken(ctx, api.CreateTokenRequest{Kind: api.TokenKindStaff, Subject: "alice@ops"})
	if err != nil {
		t.Fatal(err)
	}
	staff := clients(staffTok.Token)
	maxConsole := int(maxConsoleTTL / time.Second)
	for _, ttl := range []int{-1, maxConsole + 1, 9223372037, 18446744074} {
		_, err := staff.CreateConsoleSession(ctx, api.CreateConsoleSessionRequest{AgentID: "agent-1", Reason: "bounds", TTLSeconds: ttl})
		wantAPIError(t, err, api.CodeInvalidArgument, http.StatusBadRequest)
	}
	for ttl, want := range map[int]time.Duration{0: defaultConsoleTTL, 1: time.Second, maxConsole: maxConsoleTTL} {
		s, err := staff.CreateConsoleSession(ctx, api.CreateConsoleSessionRequest{AgentID: "agent-1", Reason: "bounds", TTLSeconds: ttl})
		if err != nil {
			t.Fatalf("console session with ttl_seconds %d: %v", ttl, err)
		}
		if got := s.ExpiresAt.Sub(s.CreatedAt); got != want {
			t.Errorf("console session with ttl_seconds %d lasts %s, want %s", ttl, got, want)
		}
	}
}
