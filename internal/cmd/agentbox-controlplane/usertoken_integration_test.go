package main

import (
	"context"
	"encoding/json"
	"syscall"
	"testing"
	"time"

	jose "github.com/go-jose/go-jose/v4"

	apiclient "github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
	"github.com/agentbox/terraform-provider-agentbox/internal/usertoken"
)

// TestBinaryUserTokens runs the real binary with its store and the user
// token flags: a token exchanged through the API verifies against the
// JWKS it publishes, and after a restart on the same store (a new
// process, even against a new API server) the same keys are published,
// so tokens minted before the restart still verify.
func TestBinaryUserTokens(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a kube-apiserver")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	const issuer = "https://agentbox.example"
	first := startControlPlane(ctx, t, "--user-token-issuer", issuer, "--user-token-max-lifetime", "10m")
	admin := first.client(t, "admin-token")
	got, err := admin.ExchangeToken(ctx, apiclient.TokenExchangeRequest{SubjectToken: "user-7", Audience: "mcp://github", AgentID: "agent-1"})
	if err != nil {
		t.Fatal(err)
	}
	if got.ExpiresIn != 600 {
		t.Errorf("expires_in %d, want the flag's 10m", got.ExpiresIn)
	}
	verify := func(c *apiclient.Client) jose.JSONWebKeySet {
		t.Helper()
		raw, err := c.JWKS(ctx)
		if err != nil {
			t.Fatal(err)
		}
		var set jose.JSONWebKeySet
		if err := json.Unmarshal(raw, &set); err != nil {
			t.Fatal(err)
		}
		want := usertoken.Expectation{Audience: "mcp://github", Agent: "agent-1"}
		if _, err := usertoken.VerifyWithKeys(set, got.AccessToken, issuer, want, time.Now()); err != nil {
			t.Fatalf("the token does not verify against the published keys: %v", err)
		}
		return set
	}
	before := verify(admin)

	if err := first.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	select {
	case <-first.exited:
	case <-time.After(40 * time.Second):
		t.Fatal("did not exit within 40s of SIGTERM")
	}
	second := startControlPlane(ctx, t, "--user-token-issuer", issuer, "--data-dir", first.dataDir)
	after := verify(second.client(t, "admin-token"))
	if len(after.Keys) != len(before.Keys) || after.Keys[0].KeyID != before.Keys[0].KeyID {
		t.Errorf("keys before the restart %v, after %v", before.Keys, after.Keys)
	}
}
