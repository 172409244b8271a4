package computeapi

import (
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"net/http"
	"net/url"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/modelcontextprotocol/go-sdk/mcp"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	clocktesting "k8s.io/utils/clock/testing"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	api "github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
	"github.com/agentbox/terraform-provider-agentbox/internal/store"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/mcpbridge"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"
	"github.com/agentbox/terraform-provider-agentbox/internal/usertoken"
)

// The client's names of the header and the _meta key are the
// supervisor's.
func TestUserTokenNamesAgree(t *testing.T) {
	if api.HeaderUserToken != supervisorapi.HeaderUserToken || api.MetaUserToken != supervisorapi.MetaUserToken {
		t.Errorf("client %q %q, supervisor %q %q", api.HeaderUserToken, api.MetaUserToken, supervisorapi.HeaderUserToken, supervisorapi.MetaUserToken)
	}
}

func TestMCPServerAudience(t *testing.T) {
	if got := mcpServerAudience(v1alpha1.MCPServer{Name: "calc"}); got != "calc" {
		t.Errorf("default audience %q, want the name", got)
	}
	if got := mcpServerAudience(v1alpha1.MCPServer{Name: "calc", Audience: "mcp://calc"}); got != "mcp://calc" {
		t.Errorf("audience %q, want mcp://calc", got)
	}
}

// userTokenMCPAPI serves a real supervisor with two stdio MCP servers
// (the test binary's serveTestMCP): "calc", whose audience is its name,
// and "named", whose audience is set. issuer, if set, is the API's user
// token issuer.
func userTokenMCPAPI(t *testing.T, st *store.Store, issuer *usertoken.Issuer) func(token string) *api.Client {
	t.Helper()
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	env := map[string]string{envMCPServer: "1"}
	servers := []v1alpha1.MCPServer{{Name: "calc", Command: self, Env: env}, {Name: "named", Command: self, Env: env, Audience: "mcp://named"}}
	tpl := &v1alpha1.SandboxTemplate{ObjectMeta: metav1.ObjectMeta{Namespace: "team-a", Name: "python"},
		Spec: v1alpha1.SandboxTemplateSpec{MCPServers: servers}}
	var cfgs []mcpbridge.ServerConfig
	for _, s := range servers {
		cfgs = append(cfgs, mcpbridge.ServerConfig{Name: s.Name, Command: s.Command, Env: s.Env})
	}
	mgr, err := mcpbridge.New(mcpbridge.Config{Servers: cfgs, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	mgr.Start(context.Background())
	t.Cleanup(func() { _ = mgr.Stop(context.Background()) })
	return realSupervisorAPIWith(t, apiSetup{store: st, extra: []client.Object{tpl}, pushDelay: -1,
		configure: func(cfg *supervisor.Config) { cfg.MCP = mgr },
		options:   func(o *Options) { o.UserTokens = issuer }})
}

// userTokenSeen calls server's user_token tool through mcp_request, with
// the caller's own _meta value under MetaUserToken if forged is set, and
// returns the token the server saw.
func userTokenSeen(ctx context.Context, c *api.Client, server, forged string, opts ...api.MCPOption) (string, error) {
	params := map[string]any{"name": "user_token", "arguments": map[string]any{}}
	if forged != "" {
		params["_meta"] = map[string]any{api.MetaUserToken: forged}
	}
	raw, err := c.MCPRequest(ctx, "agent-1", server, map[string]any{"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": params}, opts...)
	if err != nil {
		return "", err
	}
	var res struct {
		Result struct {
			StructuredContent userTokenOut `json:"structuredContent"`
		} `json:"result"`
	}
	if err := json.Unmarshal(raw, &res); err != nil {
		return "", err
	}
	return res.Result.StructuredContent.Token, nil
}

// TestMCPUserToken: a user token given in the header reaches the stdio
// server in _meta when it verifies for the agent and the server's
// audience, and every other one is refused by the API with
// invalid_user_token and a message that says what did not match and
// never holds the token; a caller's own _meta value never reaches the
// server; the audit record notes the token's jti and sub.
func TestMCPUserToken(t *testing.T) {
	st := tempStore(t)
	// The issuer's own clock, to expire a token without waiting.
	clk := clocktesting.NewFakeClock(time.Now())
	issuer, err := usertoken.New(usertoken.Options{Issuer: testIssuer, Store: st, Clock: clk, MaxLifetime: 10 * time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	clients := userTokenMCPAPI(t, st, issuer)
	admin, agent := clients(adminToken), clients("agent-token:agent-1")
	ctx := context.Background()
	mint := func(user, agentID, aud string) api.TokenExchangeResponse {
		t.Helper()
		tok, err := admin.ExchangeToken(ctx, api.TokenExchangeRequest{GrantType: api.GrantTypeTokenExchange, SubjectToken: user,
			AgentID: agentID, Audience: aud})
		if err != nil {
			t.Fatal(err)
		}
		return *tok
	}

	// The bridge starts the servers in the background.
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		_, err1 := userTokenSeen(ctx, agent, "calc", "")
		_, err2 := userTokenSeen(ctx, agent, "named", "")
		if err1 == nil && err2 == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the servers did not answer: %v, %v", err1, err2)
		}
	}

	alice, bob := mint("alice", "agent-1", "calc"), mint("bob", "agent-1", "calc")
	for i := range 2 {
		for _, tok := range []api.TokenExchangeResponse{alice, bob} {
			if got, err := userTokenSeen(ctx, agent, "calc", "", api.WithUserToken(tok.AccessToken)); err != nil || got != tok.AccessToken {
				t.Errorf("call %d with the token of %s: the server saw %q (%v)", i, tok.JTI, got, err)
			}
		}
	}
	// The header's token replaces a caller's; without the header the
	// caller's does not reach the server.
	if got, err := userTokenSeen(ctx, agent, "calc", "forged", api.WithUserToken(alice.AccessToken)); err != nil || got != alice.AccessToken {
		t.Errorf("a caller's _meta token beside the header: the server saw %q (%v)", got, err)
	}
	for _, forged := range []string{"forged", alice.AccessToken} {
		if got, err := userTokenSeen(ctx, agent, "calc", forged); err != nil || got != "" {
			t.Errorf("a caller's _meta token without the header: the server saw %q (%v)", got, err)
		}
	}
	// A set audience is the one required.
	named := mint("alice", "agent-1", "mcp://named")
	if got, err := userTokenSeen(ctx, agent, "named", "", api.WithUserToken(named.AccessToken)); err != nil || got != named.AccessToken {
		t.Errorf("the token for mcp://named: the server saw %q (%v)", got, err)
	}

	revoked := mint("carol", "agent-1", "calc")
	if err := admin.RevokeUserToken(ctx, revoked.JTI); err != nil {
		t.Fatal(err)
	}
	expiring := mint("dave", "agent-1", "calc")
	for _, tc := range []struct {
		name, server, token, want string
		after                     func()
	}{
		{name: "another agent's", server: "calc", token: mint("alice", "agent-2", "calc").AccessToken, want: `another agent than "agent-1"`},
		{name: "another audience's", server: "calc", token: mint("alice", "agent-1", "mcp://other").AccessToken, want: `not for MCP server "calc": its audience does not include "calc"`},
		{name: "the server's name for a set audience", server: "named", token: mint("alice", "agent-1", "named").AccessToken, want: `its audience does not include "mcp://named"`},
		{name: "a revoked", server: "calc", token: revoked.AccessToken, want: "revoked"},
		{name: "a malformed", server: "calc", token: "not-a-jwt", want: "not valid"},
		{name: "a tampered", server: "calc", token: alice.AccessToken[:len(alice.AccessToken)-4] + "AAAA", want: "not valid"},
		{name: "an expired", server: "calc", token: expiring.AccessToken, want: "expired"},
	} {
		if tc.name == "an expired" {
			clk.Step(11 * time.Minute)
		}
		_, err := userTokenSeen(ctx, agent, tc.server, "", api.WithUserToken(tc.token))
		e := wantAPIError(t, err, api.CodeInvalidUserToken, http.StatusForbidden)
		if !strings.Contains(e.Message, tc.want) || strings.Contains(e.Error(), tc.token) {
			t.Errorf("%s token: %q, want it to say %q without the token", tc.name, e.Message, tc.want)
		}
	}
	clk.Step(-11 * time.Minute)
	// Another agent's caller learns nothing about the token: scope first.
	_, err = userTokenSeen(ctx, clients("agent-token:agent-2"), "calc", "", api.WithUserToken("not-a-jwt"))
	if api.CodeOf(err) == api.CodeInvalidUserToken {
		t.Errorf("another agent's caller had the token checked: %v", err)
	}
	// The MCP endpoint's mcp_request tool passes on the token its POSTs
	// carry, verified as mcp_request's own.
	for _, tc := range []struct{ token, want, wantErr string }{
		{token: alice.AccessToken, want: alice.AccessToken},
		{token: ""},
		{token: mint("alice", "agent-2", "calc").AccessToken, wantErr: "invalid_user_token: the user token was issued for another agent"},
	} {
		cl := mcp.NewClient(&mcp.Implementation{Name: "agentbox-test", Version: "v0"}, nil)
		cs, err := cl.Connect(ctx, &mcp.StreamableClientTransport{Endpoint: agent.Endpoint() + api.PathMCP("agent-1"),
			HTTPClient: agent.MCPHTTPClient(api.WithUserToken(tc.token))}, nil)
		if err != nil {
			t.Fatal(err)
		}
		var out struct {
			Result struct {
				StructuredContent userTokenOut `json:"structuredContent"`
			} `json:"result"`
		}
		res := callTool(t, cs, "mcp_request", map[string]any{"server": "calc", "method": "tools/call",
			"params": map[string]any{"name": "user_token", "arguments": map[string]any{}, "_meta": map[string]any{api.MetaUserToken: "forged"}}}, &out)
		cs.Close()
		switch {
		case tc.wantErr != "":
			if !res.IsError || !strings.HasPrefix(toolText(res), tc.wantErr) {
				t.Errorf("the MCP endpoint's mcp_request with another agent's token: %s", toolText(res))
			}
		case res.IsError || out.Result.StructuredContent.Token != tc.want:
			t.Errorf("the MCP endpoint's mcp_request with token %.12q: the server saw %.12q (%s)", tc.token, out.Result.StructuredContent.Token, toolText(res))
		}
	}

	// A server the template does not have.
	_, err = userTokenSeen(ctx, agent, "nope", "", api.WithUserToken(alice.AccessToken))
	wantAPIError(t, err, api.CodeInvalidArgument, http.StatusBadRequest)

	// The records of the calls with a token name its jti and sub, never
	// the token.
	page, err := admin.QueryAudit(ctx, url.Values{"operation": {"mcp_request"}, "limit": {"500"}})
	if err != nil {
		t.Fatal(err)
	}
	seen := map[string]bool{}
	for _, r := range page.Records {
		var d struct{ JTI, Sub string }
		if r.Detail != "" {
			if err := json.Unmarshal([]byte(r.Detail), &d); err != nil {
				t.Errorf("record detail %q: %v", r.Detail, err)
			}
		}
		seen[d.JTI+"/"+d.Sub] = true
		for _, tok := range []string{alice.AccessToken, bob.AccessToken, named.AccessToken} {
			if strings.Contains(r.Detail, tok) {
				t.Errorf("record %d holds a token: %s", r.Seq, r.Detail)
			}
		}
	}
	for want, tok := range map[string]api.TokenExchangeResponse{"alice": alice, "bob": bob, "alice ": named} {
		if key := tok.JTI + "/" + strings.TrimSpace(want); !seen[key] {
			t.Errorf("no mcp_request record notes %s (have %v)", key, seen)
		}
	}
}

// TestMCPUserTokenWithoutIssuer: a control plane without a store cannot
// verify a user token and says so; a call without one goes through.
func TestMCPUserTokenWithoutIssuer(t *testing.T) {
	agent := userTokenMCPAPI(t, nil, nil)("agent-token:agent-1")
	ctx := context.Background()
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		_, err := userTokenSeen(ctx, agent, "calc", "")
		if err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the server did not answer: %v", err)
		}
	}
	_, err := userTokenSeen(ctx, agent, "calc", "", api.WithUserToken("a.b.c"))
	e := wantAPIError(t, err, api.CodeUnavailable, http.StatusServiceUnavailable)
	if !strings.Contains(e.Message, "does not verify user tokens") {
		t.Errorf("message %q", e.Message)
	}
}
