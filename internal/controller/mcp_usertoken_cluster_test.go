package controller

import (
	"bytes"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"net/url"
	"os"
	"os/exec"
	"slices"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/client-go/kubernetes"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	"github.com/agentbox/terraform-provider-agentbox/internal/computeapi"
	apiclient "github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"
	"github.com/agentbox/terraform-provider-agentbox/internal/usertoken"
)

// whoamiAnswer is testdata/mcpwhoami's whoami result.
type whoamiAnswer struct {
	Token   bool     `json:"token"`
	Refused string   `json:"refused"`
	Sub     string   `json:"sub"`
	Act     string   `json:"act"`
	Aud     []string `json:"aud"`
	JTI     string   `json:"jti"`
}

// TestMCPUserTokenOnCluster: user tokens through mcp_request to a stdio
// MCP server (testdata/mcpwhoami) in a real gVisor sandbox, which
// verifies each token it gets as a third-party server would (with the
// JWKS the API publishes, put into the sandbox as a file). Each user's
// token reaches it for that user; a token for another agent or audience,
// an expired or revoked one, and a caller's own _meta value never reach
// it; the token is in no process environment and no file of the sandbox,
// nor in the sandbox's log; the audit log notes its jti and sub.
func TestMCPUserTokenOnCluster(t *testing.T) {
	t.Parallel()
	image := os.Getenv(EnvSandboxImage)
	if image == "" {
		t.Skipf("%s is not set: the Compute API needs the real sandbox image's supervisor", EnvSandboxImage)
	}
	whoami := goBuild(t, "./testdata/mcpwhoami", "mcpwhoami")
	const issuerURL = "https://agentbox-api.test"
	e, _, api := apiTemplate(t, image, func(tpl *v1alpha1.SandboxTemplate) {
		tpl.Spec.MCPServers = []v1alpha1.MCPServer{{Name: "whoami", Command: "/workspace/mcpwhoami"}}
	}, func(e *clusterEnv, o *computeapi.Options) {
		is, err := usertoken.New(usertoken.Options{Issuer: issuerURL, Store: o.Store})
		must(t, err)
		o.UserTokens = is
	})
	e.sandbox("mcptok", "tpl")
	sbx, _ := e.waitPhase("mcptok", v1alpha1.SandboxPhaseRunning, v1alpha1.ReasonRunning)
	agent := sbx.Spec.AgentID
	sup := e.supervisor(t, sbx)
	if !e.workspaceWritable(t, sup) {
		t.Skip("the MCP server's binary goes into the workspace")
	}
	ctx := e.ctx
	mint := func(user, agentID, aud string, ttl int64) apiclient.TokenExchangeResponse {
		t.Helper()
		tok, err := api.ExchangeToken(ctx, apiclient.TokenExchangeRequest{GrantType: apiclient.GrantTypeTokenExchange,
			SubjectToken: user, AgentID: agentID, Audience: aud, ExpiresIn: ttl})
		must(t, err)
		return *tok
	}
	// Minted first, to have expired (past the verifiers' 30 s leeway) by
	// the time the other cases are done.
	expiring := mint("erin", agent, "whoami", 1)

	// The server and the public keys go in through the file API.
	f, err := os.Open(whoami)
	must(t, err)
	_, err = api.PutFile(ctx, agent, "mcpwhoami", f, 0o755)
	f.Close()
	must(t, err)
	jwks, err := api.JWKS(ctx)
	must(t, err)
	_, err = api.PutFile(ctx, agent, "jwks.json", bytes.NewReader(jwks), 0o644)
	must(t, err)

	call := func(id int, meta map[string]any, opts ...apiclient.MCPOption) (whoamiAnswer, error) {
		params := map[string]any{"name": "whoami", "arguments": map[string]string{
			"jwks_file": "/workspace/jwks.json", "issuer": issuerURL, "audience": "whoami", "agent": agent}}
		if meta != nil {
			params["_meta"] = meta
		}
		raw, err := api.MCPRequest(ctx, agent, "whoami", map[string]any{"jsonrpc": "2.0", "id": id, "method": "tools/call", "params": params}, opts...)
		if err != nil {
			return whoamiAnswer{}, err
		}
		var res struct {
			Result struct {
				StructuredContent whoamiAnswer `json:"structuredContent"`
				IsError           bool         `json:"isError"`
			} `json:"result"`
			Error json.RawMessage `json:"error"`
		}
		if err := json.Unmarshal(raw, &res); err != nil || res.Result.IsError || res.Error != nil {
			return whoamiAnswer{}, fmt.Errorf("whoami answered %s (%v)", raw, err)
		}
		return res.Result.StructuredContent, nil
	}
	start := time.Now()
	e.eventually("the whoami MCP server in the sandbox", func() error {
		_, err := call(0, nil)
		return err
	})
	t.Logf("the whoami server answered %s after its binary was put", time.Since(start).Round(time.Millisecond))

	// Two users' tokens for the agent, in turn: each call is that user's.
	alice, bob := mint("alice", agent, "whoami", 0), mint("bob", agent, "whoami", 0)
	for i := range 2 {
		for _, u := range []struct {
			user string
			tok  apiclient.TokenExchangeResponse
		}{{"alice", alice}, {"bob", bob}} {
			got, err := call(10+i, nil, apiclient.WithUserToken(u.tok.AccessToken))
			if err != nil || !got.Token || got.Refused != "" || got.Sub != u.user || got.Act != agent ||
				!slices.Equal(got.Aud, []string{"whoami"}) || got.JTI != u.tok.JTI {
				t.Errorf("call %d as %s: whoami %+v (%v)", i, u.user, got, err)
			}
		}
	}

	// Tokens the API refuses, before the sandbox: none reaches the server.
	revoked := mint("carol", agent, "whoami", 0)
	must(t, api.RevokeUserToken(ctx, revoked.JTI))
	refused := map[string]struct{ token, want string }{
		"another agent's":    {mint("alice", agent+"-other", "whoami", 0).AccessToken, "another agent"},
		"another audience's": {mint("alice", agent, "mcp://elsewhere", 0).AccessToken, `not for MCP server "whoami"`},
		"a revoked":          {revoked.AccessToken, "revoked"},
	}
	for name, r := range refused {
		_, err := call(20, nil, apiclient.WithUserToken(r.token))
		var apiErr *apiclient.Error
		if !errors.As(err, &apiErr) || apiErr.Code != apiclient.CodeInvalidUserToken || !strings.Contains(apiErr.Message, r.want) ||
			strings.Contains(err.Error(), r.token) {
			t.Errorf("%s token: %v, want invalid_user_token saying %q without the token", name, err, r.want)
		}
	}
	// A caller's own _meta token without the header does not reach the
	// server, though it is a valid one.
	forged := mint("mallory", agent, "whoami", 0)
	if got, err := call(30, map[string]any{apiclient.MetaUserToken: forged.AccessToken}); err != nil || got.Token {
		t.Errorf("a caller's _meta token without the header: whoami %+v (%v)", got, err)
	}

	// The CLI, with the token from the environment.
	cli := goBuild(t, "../cmd/agentbox", "agentbox")
	cmd := exec.CommandContext(ctx, cli, "mcp", "request", agent, "whoami",
		fmt.Sprintf(`{"jsonrpc":"2.0","id":40,"method":"tools/call","params":{"name":"whoami","arguments":{"jwks_file":"/workspace/jwks.json","issuer":%q,"audience":"whoami","agent":%q}}}`, issuerURL, agent))
	cmd.Env = append(e.cliEnv(api.Endpoint(), api.Token()), "AGENTBOX_USER_TOKEN="+bob.AccessToken)
	out, err := cmd.Output()
	var cliRes struct {
		Result struct {
			StructuredContent whoamiAnswer `json:"structuredContent"`
		} `json:"result"`
	}
	if err != nil || json.Unmarshal(out, &cliRes) != nil || cliRes.Result.StructuredContent.Sub != "bob" || cliRes.Result.StructuredContent.JTI != bob.JTI {
		t.Errorf("agentbox mcp request with AGENTBOX_USER_TOKEN: %s (%v)", out, err)
	}

	// The expired token, once past the leeway.
	time.Sleep(time.Until(expiring.ExpiresAt.Add(32 * time.Second)))
	_, err = call(50, nil, apiclient.WithUserToken(expiring.AccessToken))
	if apiclient.CodeOf(err) != apiclient.CodeInvalidUserToken || !strings.Contains(err.Error(), "expired") {
		t.Errorf("an expired token: %v, want invalid_user_token saying it expired", err)
	}

	// What the server received: alice's and bob's tokens only.
	raw, err := api.MCPRequest(ctx, agent, "whoami", map[string]any{"jsonrpc": "2.0", "id": 60, "method": "tools/call",
		"params": map[string]any{"name": "received", "arguments": map[string]any{}}})
	must(t, err)
	var rec struct {
		Result struct {
			StructuredContent struct {
				SHA256 []string `json:"sha256"`
			} `json:"structuredContent"`
		} `json:"result"`
	}
	must(t, json.Unmarshal(raw, &rec))
	hash := func(tok string) string {
		sum := sha256.Sum256([]byte(tok))
		return hex.EncodeToString(sum[:])
	}
	got := rec.Result.StructuredContent.SHA256
	allowed := map[string]bool{hash(alice.AccessToken): true, hash(bob.AccessToken): true}
	for _, h := range got {
		if !allowed[h] {
			t.Errorf("the server received a token other than alice's and bob's (SHA-256 %s); refused: %v", h,
				slices.ContainsFunc([]string{hash(revoked.AccessToken), hash(forged.AccessToken), hash(expiring.AccessToken)}, func(x string) bool { return x == h }))
		}
	}
	if len(got) != 5 {
		t.Errorf("the server received %d tokens, want 5 (alice and bob twice, bob through the CLI)", len(got))
	}

	// Nothing in the sandbox holds the token: no process's environment
	// (the server's included), no file, and not the sandbox's log.
	enc := func(s string) string {
		b := []byte(s)
		slices.Reverse(b)
		return base64.StdEncoding.EncodeToString(b)
	}
	control := "control-" + alice.JTI
	searchStart := time.Now()
	res, err := sup.RunCommand(ctx, supervisorapi.CommandRequest{
		Command: []string{"python3", "-c", secretSearch, enc(alice.AccessToken), enc(control)}, Cwd: "/tmp", TimeoutSeconds: 300,
	})
	must(t, err)
	if res.ExitCode != 0 {
		t.Fatalf("the search exited %d: %s", res.ExitCode, res.Stderr)
	}
	var search struct {
		Hits        []string `json:"hits"`
		ControlHits []string `json:"control_hits"`
		Files       int      `json:"files"`
	}
	must(t, json.Unmarshal([]byte(strings.TrimSpace(res.Stdout)), &search))
	if len(search.Hits) != 0 {
		t.Errorf("the user token is in the sandbox: %v", search.Hits)
	}
	if len(search.ControlHits) == 0 || search.Files < 100 {
		t.Errorf("the search did not find its control file (%v) or read few files (%d): it proves nothing", search.ControlHits, search.Files)
	}
	t.Logf("searched %d files and every process's environment in the sandbox in %s; the user token is in none",
		search.Files, time.Since(searchStart).Round(time.Millisecond))
	cs, err := kubernetes.NewForConfig(e.cfg)
	must(t, err)
	e.eventually("the sandbox's pod name", func() error {
		must(t, e.c.Get(ctx, client.ObjectKeyFromObject(sbx), sbx))
		if sbx.Status.PodName == "" {
			return errors.New("no pod yet")
		}
		return nil
	})
	logs, err := cs.CoreV1().Pods(e.ns).GetLogs(sbx.Status.PodName, &corev1.PodLogOptions{Container: ContainerName}).DoRaw(ctx)
	must(t, err)
	for _, tok := range []string{alice.AccessToken, bob.AccessToken, forged.AccessToken} {
		if bytes.Contains(logs, []byte(tok)) {
			t.Error("the sandbox's log holds a user token")
		}
	}

	// The audit log notes each call's token by jti and sub, never the
	// token.
	e.eventually("the audit records of the calls with a token", func() error {
		page, err := api.QueryAudit(ctx, url.Values{"agent_id": {agent}, "operation": {"mcp_request"}, "limit": {"1000"}})
		if err != nil {
			return err
		}
		noted := map[string]bool{}
		for _, r := range page.Records {
			var d struct{ JTI, Sub string }
			_ = json.Unmarshal([]byte(r.Detail), &d)
			noted[d.JTI+"/"+d.Sub] = true
			for _, tok := range []string{alice.AccessToken, bob.AccessToken, forged.AccessToken} {
				if strings.Contains(r.Detail, tok) {
					return fmt.Errorf("audit record %d holds a user token", r.Seq)
				}
			}
		}
		for _, want := range []string{alice.JTI + "/alice", bob.JTI + "/bob"} {
			if !noted[want] {
				return fmt.Errorf("no mcp_request record notes %s", want)
			}
		}
		return nil
	})
}
