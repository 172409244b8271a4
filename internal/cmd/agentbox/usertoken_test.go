package main

import (
	"bytes"
	"context"
	"encoding/json"
	"strings"
	"testing"

	jose "github.com/go-jose/go-jose/v4"
	"github.com/go-jose/go-jose/v4/jwt"

	"github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
)

// TestUserTokenCommand exchanges and revokes user tokens through the CLI
// against the real Compute API.
func TestUserTokenCommand(t *testing.T) {
	endpoint, caFile := realAPI(t)
	env := map[string]string{"AGENTBOX_ENDPOINT": endpoint, "AGENTBOX_CA_FILE": caFile, "AGENTBOX_TOKEN": token}
	cli := func(args ...string) (int, string, string) {
		var out, errOut bytes.Buffer
		code := run(context.Background(), args, func(k string) string { return env[k] }, strings.NewReader(""), &out, &errOut)
		return code, out.String(), errOut.String()
	}
	code, out, errOut := cli("token", "exchange", "--user", "user-7", "--agent", "agent-1", "--audience", "mcp://github",
		"--scope", "repo:read", "--ttl", "5m", "--run", "run-1")
	if code != 0 {
		t.Fatalf("token exchange: %d %q %q", code, out, errOut)
	}
	parsed, err := jwt.ParseSigned(strings.TrimSpace(out), []jose.SignatureAlgorithm{jose.ES256})
	if err != nil {
		t.Fatalf("stdout is not a JWT: %q: %v", out, err)
	}
	var claims map[string]any
	if err := parsed.UnsafeClaimsWithoutVerification(&claims); err != nil {
		t.Fatal(err)
	}
	act, _ := claims["act"].(map[string]any)
	if claims["sub"] != "user-7" || act["sub"] != "agent-1" || claims["aud"] != "mcp://github" || claims["run_id"] != "run-1" ||
		!strings.Contains(errOut, claims["jti"].(string)) {
		t.Errorf("claims %v, stderr %q", claims, errOut)
	}
	code, out, _ = cli("token", "exchange", "--json", "--user", "u", "--agent", "agent-1", "--audience", "a")
	var resp client.TokenExchangeResponse
	if code != 0 || json.Unmarshal([]byte(out), &resp) != nil || resp.AccessToken == "" || resp.ExpiresIn != 3600 {
		t.Fatalf("token exchange --json: %d %q", code, out)
	}
	if code, out, _ := cli("token", "revoke", resp.JTI); code != 0 || !strings.Contains(out, resp.JTI) {
		t.Errorf("token revoke: %d %q", code, out)
	}
	for _, args := range [][]string{{"token"}, {"token", "exchange", "--user", "u"}, {"token", "revoke"},
		{"token", "exchange", "--user", "u", "--agent", "a", "--audience", "x", "--ttl", "-1m"}} {
		if code, _, _ := cli(args...); code != exitUsage {
			t.Errorf("%q: exit %d, want %d", args, code, exitUsage)
		}
	}
	// An agent's own token may not mint.
	agentTok := func() string {
		code, out, _ := cli("tokens", "create", "--agent", "agent-1")
		if code != 0 {
			t.Fatalf("tokens create: %d", code)
		}
		return strings.TrimSpace(out)
	}()
	env["AGENTBOX_TOKEN"] = agentTok
	if code, _, errOut := cli("token", "exchange", "--user", "u", "--agent", "agent-1", "--audience", "a"); code != exitAPIError ||
		!strings.Contains(errOut, "permission_denied") {
		t.Errorf("agent token exchange: %d %q", code, errOut)
	}
}
