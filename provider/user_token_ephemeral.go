package provider

import (
	"context"
	"errors"
	"fmt"
	"syscall"
	"time"

	"github.com/hashicorp/terraform-plugin-framework-validators/int64validator"
	"github.com/hashicorp/terraform-plugin-framework-validators/stringvalidator"
	"github.com/hashicorp/terraform-plugin-framework/ephemeral"
	"github.com/hashicorp/terraform-plugin-framework/ephemeral/schema"
	"github.com/hashicorp/terraform-plugin-framework/schema/validator"
	"github.com/hashicorp/terraform-plugin-framework/types"

	apiclient "github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
)

var _ ephemeral.EphemeralResource = (*UserTokenEphemeralResource)(nil)

// userTokenTimeout bounds the exchange: it touches the store only, never a
// sandbox.
const userTokenTimeout = time.Minute

// UserTokenEphemeralResource mints a user token through the Compute API's
// token exchange. It is ephemeral so that the token, a credential, is
// never written to the plan or the state.
type UserTokenEphemeralResource struct{}

// NewUserTokenEphemeralResource returns the agentbox_user_token ephemeral
// resource.
func NewUserTokenEphemeralResource() ephemeral.EphemeralResource {
	return &UserTokenEphemeralResource{}
}

type userTokenModel struct {
	APIEndpoint   types.String `tfsdk:"api_endpoint"`
	CACertificate types.String `tfsdk:"ca_certificate"`
	Token         types.String `tfsdk:"token"`
	User          types.String `tfsdk:"user"`
	AgentID       types.String `tfsdk:"agent_id"`
	Audience      types.String `tfsdk:"audience"`
	Scope         types.String `tfsdk:"scope"`
	TTLSeconds    types.Int64  `tfsdk:"ttl_seconds"`
	RunID         types.String `tfsdk:"run_id"`
	LeaseID       types.String `tfsdk:"lease_id"`
	AccessToken   types.String `tfsdk:"access_token"`
	JTI           types.String `tfsdk:"jti"`
	ExpiresAt     types.String `tfsdk:"expires_at"`
}

func (r *UserTokenEphemeralResource) Metadata(_ context.Context, req ephemeral.MetadataRequest, resp *ephemeral.MetadataResponse) {
	resp.TypeName = req.ProviderTypeName + "_user_token"
}

func (r *UserTokenEphemeralResource) Schema(_ context.Context, _ ephemeral.SchemaRequest, resp *ephemeral.SchemaResponse) {
	nonEmpty := []validator.String{stringvalidator.LengthBetween(1, 1024)}
	optional := func(desc string) schema.StringAttribute {
		return schema.StringAttribute{Optional: true, MarkdownDescription: desc, Validators: []validator.String{stringvalidator.LengthAtMost(1024)}}
	}
	resp.Schema = schema.Schema{
		MarkdownDescription: "A short-lived user token (a JWT signed by the platform, ES256) that says an agent acts for a user, " +
			"for the MCP servers and APIs the agent calls: minted by the Compute API's token exchange (`POST /v1/token`, " +
			"RFC 8693) with an admin or exchange token. Its claims are `iss`, `sub` (the user), `act` (`{\"sub\": agent_id}`), `aud`, " +
			"`scope`, `exp`, `iat`, `jti`, and `run_id` / `lease_id` when set; verifiers read the keys from the API's " +
			"`/.well-known/jwks.json`. Being ephemeral, the token is never written to the plan or the state: pass it " +
			"where Terraform accepts ephemeral values (a write-only argument, a provider block, another ephemeral " +
			"resource). Each plan and apply mints a new one; Terraform does not revoke it when done (`agentbox token " +
			"revoke JTI` does), since what it was given to may still use it. A refused connection (a platform created in the " +
			"same apply whose API address the cluster does not route yet) is tried again for up to a minute; any answer " +
			"of the API is final.",
		Attributes: map[string]schema.Attribute{
			"api_endpoint": schema.StringAttribute{Required: true, Validators: nonEmpty,
				MarkdownDescription: "The Compute API's HTTPS URL, such as `agentbox_platform.this.api_endpoint`."},
			"ca_certificate": schema.StringAttribute{Optional: true,
				MarkdownDescription: "PEM CA certificate the Compute API's serving certificate verifies with, such as " +
					"`agentbox_platform.this.ca_certificate`; without it the system's roots are used."},
			"token": schema.StringAttribute{Required: true, Sensitive: true, Validators: nonEmpty,
				MarkdownDescription: "An admin token of the Compute API, such as `agentbox_platform.this.admin_token`, or " +
					"an exchange token (`agentbox tokens create --kind exchange`), which may mint user tokens and nothing else: " +
					"only those may assert which user an agent acts for."},
			"user": schema.StringAttribute{Required: true, Validators: nonEmpty,
				MarkdownDescription: "The user the agent acts for (the token's `sub`), an opaque id the platform trusts the caller for."},
			"agent_id": schema.StringAttribute{Required: true, Validators: nonEmpty,
				MarkdownDescription: "The agent that acts for the user (the token's `act.sub`)."},
			"audience": schema.StringAttribute{Required: true, Validators: nonEmpty,
				MarkdownDescription: "Who verifies the token (its `aud`): the MCP server or API it is for."},
			"scope": optional("Space-separated scopes, passed through as the token's `scope`."),
			"ttl_seconds": schema.Int64Attribute{Optional: true, Validators: []validator.Int64{int64validator.AtLeast(0)},
				MarkdownDescription: "The token's life in seconds; unset, 0 or above the platform's maximum " +
					"(`computeApi.userTokens.maxLifetime`, an hour by default) gives the maximum."},
			"run_id":   optional("A run the token is for, carried as its `run_id` claim."),
			"lease_id": optional("A lease the token is for, carried as its `lease_id` claim."),
			"access_token": schema.StringAttribute{Computed: true, Sensitive: true,
				MarkdownDescription: "The user token (a JWT)."},
			"jti": schema.StringAttribute{Computed: true,
				MarkdownDescription: "The token's id: the audit log's record of the exchange names it, and revocation takes it."},
			"expires_at": schema.StringAttribute{Computed: true, MarkdownDescription: "When the token expires (RFC 3339)."},
		},
	}
}

func (r *UserTokenEphemeralResource) Open(ctx context.Context, req ephemeral.OpenRequest, resp *ephemeral.OpenResponse) {
	var m userTokenModel
	resp.Diagnostics.Append(req.Config.Get(ctx, &m)...)
	if resp.Diagnostics.HasError() {
		return
	}
	var ca []byte
	if v := m.CACertificate.ValueString(); v != "" {
		ca = []byte(v)
	}
	c, err := apiclient.New(m.APIEndpoint.ValueString(), m.Token.ValueString(), ca)
	if err != nil {
		resp.Diagnostics.AddError("Cannot reach the Compute API", err.Error())
		return
	}
	defer c.CloseIdleConnections()
	ctx, cancel := context.WithTimeout(ctx, userTokenTimeout)
	defer cancel()
	exchange := apiclient.TokenExchangeRequest{
		SubjectToken: m.User.ValueString(), AgentID: m.AgentID.ValueString(), Audience: m.Audience.ValueString(),
		Scope: m.Scope.ValueString(), ExpiresIn: m.TTLSeconds.ValueInt64(), RunID: m.RunID.ValueString(), LeaseID: m.LeaseID.ValueString(),
	}
	var got *apiclient.TokenExchangeResponse
	start := time.Now()
	err = retryRefused(ctx, func() (err error) {
		got, err = c.ExchangeToken(ctx, exchange)
		return err
	})
	if err != nil {
		resp.Diagnostics.AddError("Cannot mint the user token", fmt.Sprintf("POST %s (tried for %s): %v",
			apiclient.PathTokenExchange, time.Since(start).Round(time.Second), err))
		return
	}
	m.AccessToken = types.StringValue(got.AccessToken)
	m.JTI = types.StringValue(got.JTI)
	m.ExpiresAt = types.StringValue(got.ExpiresAt.UTC().Format(time.RFC3339))
	resp.Diagnostics.Append(resp.Result.Set(ctx, &m)...)
}

// retryRefused calls call until it returns something other than a refused
// or unroutable connection, or ctx ends. A platform created in the same
// apply has a Ready API whose Service address the nodes' proxies may not
// route yet, and such a call never reached the API, so trying it again
// mints nothing twice.
func retryRefused(ctx context.Context, call func() error) error {
	pause := 250 * time.Millisecond
	for {
		err := call()
		if err == nil || !(errors.Is(err, syscall.ECONNREFUSED) || errors.Is(err, syscall.EHOSTUNREACH)) {
			return err
		}
		select {
		case <-ctx.Done():
			return err
		case <-time.After(pause):
		}
		pause = min(2*pause, 4*time.Second)
	}
}
