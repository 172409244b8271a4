package provider

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"net/url"
	"regexp"
	"strings"
	"testing"
	"time"

	tfjson "github.com/hashicorp/terraform-json"
	"github.com/hashicorp/terraform-plugin-go/tfprotov6"
	"github.com/hashicorp/terraform-plugin-testing/echoprovider"
	"github.com/hashicorp/terraform-plugin-testing/helper/resource"
	"github.com/hashicorp/terraform-plugin-testing/plancheck"
	"github.com/hashicorp/terraform-plugin-testing/statecheck"
	"github.com/hashicorp/terraform-plugin-testing/tfversion"

	apiclient "github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
)

// jwtPattern matches a compact JWS: what no plan or state may hold.
var jwtPattern = regexp.MustCompile(`eyJ[A-Za-z0-9_-]+\.eyJ[A-Za-z0-9_-]+\.[A-Za-z0-9_-]{20,}`)

// TestAccUserToken_onPlatform installs a platform, mints a user token with
// the agentbox_user_token ephemeral resource and its admin token, and uses
// the token in Terraform: its claims segment, cut out of the token with
// split(), reaches state through the echo provider (the testing
// framework's way of observing ephemeral values). Then it checks the
// claims, that the platform's audit log recorded the exchange by its jti,
// and that neither the plan nor the state holds the token.
func TestAccUserToken_onPlatform(t *testing.T) {
	t.Parallel()
	tag := testAccPlatformImageTag(t)
	_, ns := testAccCluster(t)
	config := testAccProviderConfig() + fmt.Sprintf(`
resource "agentbox_platform" "this" {
  namespace    = %[1]q
  release_name = "acc-user-token"
  image_tag    = %[2]q
}

ephemeral "agentbox_user_token" "github" {
  api_endpoint   = agentbox_platform.this.api_endpoint
  ca_certificate = agentbox_platform.this.ca_certificate
  token          = agentbox_platform.this.admin_token
  user           = "user-7"
  agent_id       = "agent-1"
  audience       = "mcp://github"
  scope          = "repo:read"
  ttl_seconds    = 300
}

provider "echo" {
  data = {
    jti        = ephemeral.agentbox_user_token.github.jti
    expires_at = ephemeral.agentbox_user_token.github.expires_at
    claims     = split(".", ephemeral.agentbox_user_token.github.access_token)[1]
  }
}

resource "echo" "token" {}
`, ns, tag)

	noToken := noJWT{}
	resource.Test(t, resource.TestCase{
		TerraformVersionChecks: []tfversion.TerraformVersionCheck{tfversion.SkipBelow(tfversion.Version1_10_0)},
		ProtoV6ProviderFactories: map[string]func() (tfprotov6.ProviderServer, error){
			"agentbox": testAccProtoV6ProviderFactories["agentbox"],
			"echo":     echoprovider.NewProviderServer(),
		},
		Steps: []resource.TestStep{{
			Config:            config,
			ConfigPlanChecks:  resource.ConfigPlanChecks{PreApply: []plancheck.PlanCheck{noToken}, PostApplyPostRefresh: []plancheck.PlanCheck{noToken}},
			ConfigStateChecks: []statecheck.StateCheck{noToken, userTokenUsed{t: t}},
		}},
	})
}

// noJWT fails a plan or state that holds a JWT anywhere.
type noJWT struct{}

func (noJWT) CheckPlan(_ context.Context, req plancheck.CheckPlanRequest, resp *plancheck.CheckPlanResponse) {
	resp.Error = findJWT("plan", req.Plan)
}

func (noJWT) CheckState(_ context.Context, req statecheck.CheckStateRequest, resp *statecheck.CheckStateResponse) {
	resp.Error = findJWT("state", req.State)
}

func findJWT(what string, v any) error {
	raw, err := json.Marshal(v)
	if err != nil {
		return err
	}
	if m := jwtPattern.Find(raw); m != nil {
		return fmt.Errorf("the %s holds a token: %.20s...", what, m)
	}
	return nil
}

// userTokenUsed checks what the echo resource recorded of the token
// against the platform.
type userTokenUsed struct{ t *testing.T }

func (c userTokenUsed) CheckState(ctx context.Context, req statecheck.CheckStateRequest, resp *statecheck.CheckStateResponse) {
	resp.Error = c.check(ctx, req.State)
}

func (c userTokenUsed) check(ctx context.Context, s *tfjson.State) error {
	var echoed map[string]any
	var platform map[string]any
	for _, r := range s.Values.RootModule.Resources {
		switch r.Address {
		case "echo.token":
			echoed, _ = r.AttributeValues["data"].(map[string]any)
		case "agentbox_platform.this":
			platform = r.AttributeValues
		}
	}
	if echoed == nil || platform == nil {
		return fmt.Errorf("echo.token or agentbox_platform.this missing from the state")
	}
	jti, _ := echoed["jti"].(string)
	segment, _ := echoed["claims"].(string)
	payload, err := base64.RawURLEncoding.DecodeString(segment)
	if err != nil {
		return fmt.Errorf("claims segment %q: %w", segment, err)
	}
	var claims struct {
		Iss   string `json:"iss"`
		Sub   string `json:"sub"`
		Aud   any    `json:"aud"`
		Scope string `json:"scope"`
		JTI   string `json:"jti"`
		Exp   int64  `json:"exp"`
		Iat   int64  `json:"iat"`
		Act   struct {
			Sub string `json:"sub"`
		} `json:"act"`
	}
	if err := json.Unmarshal(payload, &claims); err != nil {
		return fmt.Errorf("claims %s: %w", payload, err)
	}
	c.t.Logf("user token claims: %s", payload)
	if claims.Sub != "user-7" || claims.Act.Sub != "agent-1" || fmt.Sprint(claims.Aud) != "mcp://github" || claims.Scope != "repo:read" ||
		claims.JTI != jti || claims.Exp-claims.Iat != 300 {
		return fmt.Errorf("claims %s, jti %q", payload, jti)
	}

	api, err := apiclient.New(platform["api_endpoint"].(string), platform["admin_token"].(string), []byte(platform["ca_certificate"].(string)))
	if err != nil {
		return err
	}
	defer api.CloseIdleConnections()
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	// The keys are published where the iss says.
	set, err := api.JWKS(ctx)
	if err != nil || !strings.Contains(string(set), `"kid"`) {
		return fmt.Errorf("JWKS: %s, %w", set, err)
	}
	// The audit log is appended in the background: wait for the record.
	for {
		page, err := api.QueryAudit(ctx, url.Values{"operation": {"exchange_token"}})
		if err != nil {
			return fmt.Errorf("audit query: %w", err)
		}
		for _, r := range page.Records {
			if r.Result == "ok" && strings.Contains(r.Detail, jti) {
				if jwtPattern.MatchString(r.Detail) {
					return fmt.Errorf("the audit record holds the token: %s", r.Detail)
				}
				return nil
			}
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("no audit record of the exchange of %s in %d records", jti, len(page.Records))
		case <-time.After(time.Second):
		}
	}
}
