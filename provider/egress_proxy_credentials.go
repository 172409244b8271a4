package provider

import (
	"context"
	"fmt"
	"regexp"
	"strings"

	"github.com/hashicorp/terraform-plugin-framework-validators/listvalidator"
	"github.com/hashicorp/terraform-plugin-framework-validators/setvalidator"
	"github.com/hashicorp/terraform-plugin-framework-validators/stringvalidator"
	"github.com/hashicorp/terraform-plugin-framework/attr"
	"github.com/hashicorp/terraform-plugin-framework/diag"
	"github.com/hashicorp/terraform-plugin-framework/path"
	"github.com/hashicorp/terraform-plugin-framework/resource/schema"
	"github.com/hashicorp/terraform-plugin-framework/schema/validator"
	"github.com/hashicorp/terraform-plugin-framework/tfsdk"
	"github.com/hashicorp/terraform-plugin-framework/types"

	agentboxv1alpha1 "github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	"github.com/agentbox/terraform-provider-agentbox/internal/pki"
)

// The egress proxy's injected credentials (`credentials`): secrets the
// proxy adds to requests for some hosts, so that the sandboxes never hold
// them. A value comes from a Secret of the user's (secret_ref) or from the
// configuration (value_wo, write-only), which the resource keeps in a
// Secret of its own, one key per credential.

const (
	maxEgressCredentials     = 64
	maxEgressCredentialHosts = 64
	maxDestinationCABundle   = 262144
)

type egressCredentialModel struct {
	Name           types.String `tfsdk:"name"`
	Hosts          types.Set    `tfsdk:"hosts"`
	Header         types.Object `tfsdk:"header"`
	BasicAuth      types.Object `tfsdk:"basic_auth"`
	SecretRef      types.Object `tfsdk:"secret_ref"`
	ValueWO        types.String `tfsdk:"value_wo"`
	ValueWOVersion types.Int64  `tfsdk:"value_wo_version"`
}

type egressCredentialHeaderModel struct {
	Name          types.String `tfsdk:"name"`
	ValueTemplate types.String `tfsdk:"value_template"`
}

type egressCredentialBasicAuthModel struct {
	Username types.String `tfsdk:"username"`
}

var (
	egressCredentialHeaderAttrTypes    = map[string]attr.Type{"name": types.StringType, "value_template": types.StringType}
	egressCredentialBasicAuthAttrTypes = map[string]attr.Type{"username": types.StringType}
	egressCredentialAttrTypes          = map[string]attr.Type{
		"name": types.StringType, "hosts": types.SetType{ElemType: types.StringType},
		"header":           types.ObjectType{AttrTypes: egressCredentialHeaderAttrTypes},
		"basic_auth":       types.ObjectType{AttrTypes: egressCredentialBasicAuthAttrTypes},
		"secret_ref":       types.ObjectType{AttrTypes: secretKeyAttrTypes},
		"value_wo":         types.StringType,
		"value_wo_version": types.Int64Type,
	}
)

// egressCredentialRule is one rule between a credential's attributes.
// ValidateConfig enforces each, and the attributes' descriptions quote
// them, so the documentation and the check cannot drift apart.
type egressCredentialRule struct {
	attrs []string
	// together: all of attrs or none; otherwise exactly one of them.
	together    bool
	description string
}

var egressCredentialRules = []egressCredentialRule{
	{attrs: []string{"header", "basic_auth"}, description: "exactly one of `header` and `basic_auth` says how the value is sent"},
	{attrs: []string{"secret_ref", "value_wo"}, description: "exactly one of `secret_ref` and `value_wo` gives the value"},
	{attrs: []string{"value_wo", "value_wo_version"}, together: true, description: "`value_wo` and `value_wo_version` go together"},
}

// holds reports whether the rule is kept, given which attributes are set.
func (r egressCredentialRule) holds(set map[string]bool) bool {
	n := 0
	for _, a := range r.attrs {
		if set[a] {
			n++
		}
	}
	if r.together {
		return n == 0 || n == len(r.attrs)
	}
	return n == 1
}

// egressCredentialRulesOf are the descriptions of the rules attr is in,
// a sentence each, for its documentation.
func egressCredentialRulesOf(attr string) string {
	var out strings.Builder
	for _, r := range egressCredentialRules {
		for _, a := range r.attrs {
			if a == attr {
				out.WriteString(" Rule: " + r.description + ".")
			}
		}
	}
	return out.String()
}

// Checks of the credential's fields, the CRD's rules, so that a plan fails
// where the API server would.
var (
	credentialNamePattern = regexp.MustCompile(`^[a-z0-9]([-a-z0-9]*[a-z0-9])?$`)
	credentialNameCheck   = stringCheck{
		description: "at most 63 lower-case letters, digits and `-`, starting and ending with a letter or digit",
		check: func(s string) error {
			if len(s) == 0 || len(s) > 63 || !credentialNamePattern.MatchString(s) {
				return fmt.Errorf("not a lower-case name of 1 to 63 characters")
			}
			return nil
		},
	}
	headerNamePattern = regexp.MustCompile(`^[-!#$%&'*+.^_|~0-9A-Za-z]+$`)
	// hopByHopHeaders are the headers that never reach the destination
	// (the CRD's list), so a credential in one would never arrive.
	hopByHopHeaders = []string{"Host", "Connection", "Proxy-Connection", "Keep-Alive", "Proxy-Authenticate",
		"Proxy-Authorization", "TE", "Trailer", "Transfer-Encoding", "Upgrade", "Content-Length"}
	headerNameCheck = stringCheck{
		description: "an HTTP header name of at most 256 characters that reaches the destination (not " +
			codeAlternatives(hopByHopHeaders) + ")",
		check: func(s string) error {
			if len(s) == 0 || len(s) > 256 || !headerNamePattern.MatchString(s) {
				return fmt.Errorf("not an HTTP header name of 1 to 256 characters")
			}
			for _, h := range hopByHopHeaders {
				if strings.EqualFold(s, h) {
					return fmt.Errorf("%s never reaches the destination", h)
				}
			}
			return nil
		},
	}
	valueTemplateCheck = stringCheck{
		description: "at most 4096 characters containing `{{secret}}`, such as `Bearer {{secret}}`",
		check: func(s string) error {
			if len(s) > 4096 {
				return fmt.Errorf("longer than 4096 characters")
			}
			if !strings.Contains(s, "{{secret}}") {
				return fmt.Errorf("no {{secret}} in it")
			}
			return nil
		},
	}
	basicAuthUserCheck = stringCheck{
		description: "at most 256 characters without `:` or line breaks",
		check: func(s string) error {
			if len(s) > 256 || strings.ContainsAny(s, ":\r\n") {
				return fmt.Errorf("longer than 256 characters or holds `:` or a line break")
			}
			return nil
		},
	}
)

// pemBundleCheck checks destination_ca_bundle without quoting it back: a
// bundle runs to hundreds of lines.
type pemBundleCheck struct{}

var pemBundleDescription = fmt.Sprintf("PEM text of at most %d bytes holding at least one certificate (`-----BEGIN CERTIFICATE-----`)",
	maxDestinationCABundle)

func (pemBundleCheck) Description(context.Context) string         { return pemBundleDescription }
func (pemBundleCheck) MarkdownDescription(context.Context) string { return pemBundleDescription }

func (pemBundleCheck) ValidateString(_ context.Context, req validator.StringRequest, resp *validator.StringResponse) {
	if req.ConfigValue.IsNull() || req.ConfigValue.IsUnknown() {
		return
	}
	s := req.ConfigValue.ValueString()
	if len(s) > maxDestinationCABundle {
		resp.Diagnostics.AddAttributeError(req.Path, "Invalid CA bundle", fmt.Sprintf("%d bytes; must be %s.", len(s), pemBundleDescription))
		return
	}
	if _, err := pki.CertPoolFromPEM([]byte(s)); err != nil {
		resp.Diagnostics.AddAttributeError(req.Path, "Invalid CA bundle",
			fmt.Sprintf("%v; must be %s. The proxy would not start with it.", err, pemBundleDescription))
	}
}

// injectedSecretName names the Secret that holds the credentials given
// by value_wo. Not "<name>-egress-credentials": that is a sandbox's own
// proxy client Secret, and a sandbox may share the proxy's name.
func injectedSecretName(proxy string) string { return proxy + "-egress-injected" }

// injectedSecretRef is where a value_wo credential's value lives.
func injectedSecretRef(proxy, credential string) agentboxv1alpha1.SecretKeySelector {
	return agentboxv1alpha1.SecretKeySelector{Name: injectedSecretName(proxy), Key: credential}
}

// usesInjectedSecret reports whether a credential of the proxy takes its
// value from the resource's own Secret.
func usesInjectedSecret(ep *agentboxv1alpha1.EgressProxy) bool {
	for _, c := range ep.Spec.Credentials {
		if c.SecretRef == injectedSecretRef(ep.Name, c.Name) {
			return true
		}
	}
	return false
}

func egressCredentialsAttribute() schema.ListNestedAttribute {
	return schema.ListNestedAttribute{
		Optional: true,
		MarkdownDescription: "Secrets the proxy adds to requests bound for some hosts, so that the sandboxes never hold them: " +
			"a sandbox sends a placeholder (or nothing) and the proxy puts the value in. The values are mounted only into the " +
			"proxy pods. For an HTTPS host with a credential the proxy terminates TLS with a certificate from a CA of its own, " +
			"which the control plane creates and the sandboxes trust; other destinations stay end-to-end encrypted tunnels. " +
			"A changed value (a rotated Secret, a new `value_wo_version`) reaches the running proxy without a restart, once the kubelet refreshes the mounted Secret (typically within a minute or two). " +
			"Each credential is named, at most " + fmt.Sprint(maxEgressCredentials) + ". Values given by `value_wo` are kept " +
			"in the Secret `<name>-egress-injected` that the resource owns, one key per credential name; write-only values " +
			"cannot be imported, so after `terraform import` those credentials have a null `value_wo_version` and the " +
			"first apply writes them.",
		Validators: []validator.List{listvalidator.SizeAtMost(maxEgressCredentials)},
		NestedObject: schema.NestedAttributeObject{Attributes: map[string]schema.Attribute{
			"name": schema.StringAttribute{
				Required: true,
				MarkdownDescription: "Names the credential in the proxy's access log and metrics, and its key in the " +
					"resource's Secret; not secret, unique within the proxy. Must be " + credentialNameCheck.description + ".",
				Validators: []validator.String{credentialNameCheck},
			},
			"hosts": schema.SetAttribute{
				ElementType: types.StringType, Required: true,
				MarkdownDescription: "Hosts the credential is sent to. Each must be " + domainCheck.description + "; 1 to " +
					fmt.Sprint(maxEgressCredentialHosts) + ". Only hosts that `allowed_domains` also lets through are reached.",
				Validators: []validator.Set{setvalidator.SizeBetween(1, maxEgressCredentialHosts), setvalidator.ValueStringsAre(domainCheck)},
			},
			"header": schema.SingleNestedAttribute{
				Optional: true,
				MarkdownDescription: "Send the value in a request header, replacing any header of that name the sandbox sent " +
					"(such as a placeholder)." + egressCredentialRulesOf("header"),
				Attributes: map[string]schema.Attribute{
					"name": schema.StringAttribute{
						Required:            true,
						MarkdownDescription: "The header, such as `Authorization` or `X-Api-Key`. Must be " + headerNameCheck.description + ".",
						Validators:          []validator.String{headerNameCheck},
					},
					"value_template": schema.StringAttribute{
						Optional: true,
						MarkdownDescription: "The header's value with `{{secret}}` where the value goes; unset sends the value " +
							"alone. Must be " + valueTemplateCheck.description + ".",
						Validators: []validator.String{valueTemplateCheck},
					},
				},
			},
			"basic_auth": schema.SingleNestedAttribute{
				Optional:            true,
				MarkdownDescription: "Send the value as HTTP basic authentication." + egressCredentialRulesOf("basic_auth"),
				Attributes: map[string]schema.Attribute{
					"username": schema.StringAttribute{
						Optional: true,
						MarkdownDescription: "User name sent with the value as the password. Unset, the value holds " +
							credentialsDescription + ". Must be " + basicAuthUserCheck.description + ".",
						Validators: []validator.String{basicAuthUserCheck},
					},
				},
			},
			"secret_ref": schema.SingleNestedAttribute{
				Optional: true,
				MarkdownDescription: "An existing Secret in the proxy's namespace, managed elsewhere, whose key holds the " +
					"value. The proxy starts once the Secret exists." + egressCredentialRulesOf("secret_ref"),
				Attributes: map[string]schema.Attribute{
					"name": schema.StringAttribute{
						Required: true,
						MarkdownDescription: "Name of the Secret. Must be " + dnsSubdomainCheck.description + ", and not the " +
							"resource's own `<name>-egress-injected`.",
						Validators: []validator.String{dnsSubdomainCheck},
					},
					"key": schema.StringAttribute{
						Required: true, MarkdownDescription: "Key in the Secret whose value is the credential.",
						Validators: []validator.String{stringvalidator.LengthBetween(1, 253)},
					},
				},
			},
			"value_wo": schema.StringAttribute{
				Optional: true, Sensitive: true, WriteOnly: true,
				MarkdownDescription: "The value itself. Write-only: Terraform passes it to the provider but never keeps it " +
					"in the plan or state (Terraform 1.11 or later). The provider stores it under the credential's name in the " +
					"Secret `<name>-egress-injected`, owned by the proxy, and writes it only when `value_wo_version` changes " +
					"or the key is missing." + egressCredentialRulesOf("value_wo"),
			},
			"value_wo_version": schema.Int64Attribute{
				Optional: true,
				MarkdownDescription: "Any number, changed to make the provider write a new `value_wo` (a rotation). If the " +
					"value goes missing from the Secret, the next plan shows this attribute changing, and the apply writes " +
					"it again." + egressCredentialRulesOf("value_wo_version"),
			},
		}},
	}
}

func destinationCABundleAttribute() schema.StringAttribute {
	return schema.StringAttribute{
		Optional: true,
		MarkdownDescription: "PEM certificates that verify the destinations of `credentials` instead of the system roots, " +
			"for destinations with a private CA. Must be " + pemBundleDescription + ". The proxy reads it as it starts, so " +
			"changing it replaces the running proxy pods.",
		Validators: []validator.String{pemBundleCheck{}},
	}
}

// validateEgressCredentials applies egressCredentialRules and what a
// single attribute's validator cannot see: unique names, the resource's
// own Secret not named in secret_ref, and `user:password` in a value_wo
// sent as basic authentication without a user name. No value is ever
// repeated in an error.
func validateEgressCredentials(ctx context.Context, config tfsdk.Config, diags *diag.Diagnostics) {
	var proxy types.String
	var list types.List
	diags.Append(config.GetAttribute(ctx, path.Root("name"), &proxy)...)
	diags.Append(config.GetAttribute(ctx, path.Root("credentials"), &list)...)
	if diags.HasError() || list.IsNull() || list.IsUnknown() {
		return
	}
	seen := map[string]int{}
	for i, el := range list.Elements() {
		obj, ok := el.(types.Object)
		if !ok || obj.IsNull() || obj.IsUnknown() {
			continue
		}
		at := path.Root("credentials").AtListIndex(i)
		attrs := obj.Attributes()
		label := fmt.Sprintf("credentials[%d]", i)
		if n, ok := attrs["name"].(types.String); ok && !n.IsNull() && !n.IsUnknown() {
			label = fmt.Sprintf("credential %q", n.ValueString())
			if j, dup := seen[n.ValueString()]; dup {
				diags.AddAttributeError(at.AtName("name"), "Duplicate credential name",
					fmt.Sprintf("credentials[%d] and credentials[%d] are both named %q; names are unique within a proxy.", j, i, n.ValueString()))
			}
			seen[n.ValueString()] = i
		}
		set, unknown := map[string]bool{}, map[string]bool{}
		for name, v := range attrs {
			set[name], unknown[name] = !v.IsNull(), v.IsUnknown()
		}
		for _, r := range egressCredentialRules {
			skip := false
			var given []string
			for _, a := range r.attrs {
				skip = skip || unknown[a]
				if set[a] {
					given = append(given, a)
				}
			}
			if skip || r.holds(set) {
				continue
			}
			what := "none is set"
			if len(given) > 0 {
				what = codeList(given) + " set"
			}
			diags.AddAttributeError(at, "Invalid credential", fmt.Sprintf("%s: %s (%s).", label, r.description, what))
		}
		var cred egressCredentialModel
		if d := obj.As(ctx, &cred, objectAsOptions); d.HasError() {
			continue
		}
		if !cred.SecretRef.IsNull() && !cred.SecretRef.IsUnknown() && !proxy.IsNull() && !proxy.IsUnknown() {
			var ref secretKeyModel
			diags.Append(cred.SecretRef.As(ctx, &ref, objectAsOptions)...)
			if ref.Name.ValueString() == injectedSecretName(proxy.ValueString()) {
				diags.AddAttributeError(at.AtName("secret_ref").AtName("name"), "Secret owned by the resource",
					fmt.Sprintf("%s: Secret %s is where the resource keeps the values given by value_wo; give the value in value_wo, or name a Secret of your own.",
						label, ref.Name.ValueString()))
			}
		}
		if !cred.BasicAuth.IsNull() && !cred.BasicAuth.IsUnknown() && !cred.ValueWO.IsNull() && !cred.ValueWO.IsUnknown() {
			var ba egressCredentialBasicAuthModel
			diags.Append(cred.BasicAuth.As(ctx, &ba, objectAsOptions)...)
			user, _, found := strings.Cut(cred.ValueWO.ValueString(), ":")
			if ba.Username.IsNull() && (!found || user == "" || strings.ContainsAny(cred.ValueWO.ValueString(), "\r\n")) {
				diags.AddAttributeError(at.AtName("value_wo"), "Invalid basic authentication value",
					fmt.Sprintf("%s has no basic_auth.username, so its value (not shown, it is secret) must be %s.", label, credentialsDescription))
			}
		}
	}
}

// credentialsSpec is the planned credentials as the CRD has them. A
// value_wo is null in the plan, so its version stands for it.
func (m *egressProxyModel) credentialsSpec(ctx context.Context, diags *diag.Diagnostics) []agentboxv1alpha1.EgressCredential {
	if m.Credentials.IsNull() || m.Credentials.IsUnknown() {
		return nil
	}
	var creds []egressCredentialModel
	diags.Append(m.Credentials.ElementsAs(ctx, &creds, false)...)
	out := make([]agentboxv1alpha1.EgressCredential, 0, len(creds))
	for _, c := range creds {
		ec := agentboxv1alpha1.EgressCredential{Name: c.Name.ValueString()}
		for _, h := range goSet(ctx, c.Hosts, diags) {
			ec.Hosts = append(ec.Hosts, agentboxv1alpha1.Domain(h))
		}
		if !c.Header.IsNull() && !c.Header.IsUnknown() {
			var h egressCredentialHeaderModel
			diags.Append(c.Header.As(ctx, &h, objectAsOptions)...)
			ec.Header = &agentboxv1alpha1.EgressCredentialHeader{Name: h.Name.ValueString(), ValueTemplate: h.ValueTemplate.ValueString()}
		}
		if !c.BasicAuth.IsNull() && !c.BasicAuth.IsUnknown() {
			var b egressCredentialBasicAuthModel
			diags.Append(c.BasicAuth.As(ctx, &b, objectAsOptions)...)
			ec.BasicAuth = &agentboxv1alpha1.EgressCredentialBasicAuth{Username: b.Username.ValueString()}
		}
		switch {
		case !c.SecretRef.IsNull() && !c.SecretRef.IsUnknown():
			var ref secretKeyModel
			diags.Append(c.SecretRef.As(ctx, &ref, objectAsOptions)...)
			ec.SecretRef = agentboxv1alpha1.SecretKeySelector{Name: ref.Name.ValueString(), Key: ref.Key.ValueString()}
		case !c.ValueWOVersion.IsNull():
			ec.SecretRef = injectedSecretRef(m.Name.ValueString(), ec.Name)
		}
		out = append(out, ec)
	}
	return out
}

// credentialVersions are the value_wo_version of each credential given by
// value_wo, by name.
func credentialVersions(ctx context.Context, l types.List, diags *diag.Diagnostics) map[string]types.Int64 {
	out := map[string]types.Int64{}
	if l.IsNull() || l.IsUnknown() {
		return out
	}
	var creds []egressCredentialModel
	diags.Append(l.ElementsAs(ctx, &creds, false)...)
	for _, c := range creds {
		if !c.ValueWOVersion.IsNull() {
			out[c.Name.ValueString()] = c.ValueWOVersion
		}
	}
	return out
}

// credentialsValue is the attribute for the live credentials. A
// credential whose value is the resource's own Secret's key of its name is
// value_wo's: its version is the prior one while present holds the key,
// and null otherwise (after an import, or when the key went missing), so
// that the next plan writes it. An empty list the configuration wrote
// stays empty rather than turning null.
func credentialsValue(ctx context.Context, prior types.List, ep *agentboxv1alpha1.EgressProxy, present map[string]bool,
	diags *diag.Diagnostics) types.List {
	credType := types.ObjectType{AttrTypes: egressCredentialAttrTypes}
	if len(ep.Spec.Credentials) == 0 {
		if prior.IsNull() || prior.IsUnknown() || len(prior.Elements()) != 0 {
			return types.ListNull(credType)
		}
		return prior
	}
	versions := credentialVersions(ctx, prior, diags)
	out := make([]egressCredentialModel, 0, len(ep.Spec.Credentials))
	for _, c := range ep.Spec.Credentials {
		m := egressCredentialModel{
			Name:           types.StringValue(c.Name),
			Hosts:          setValue(ctx, types.SetNull(types.StringType), c.Hosts, diags),
			Header:         types.ObjectNull(egressCredentialHeaderAttrTypes),
			BasicAuth:      types.ObjectNull(egressCredentialBasicAuthAttrTypes),
			SecretRef:      types.ObjectNull(secretKeyAttrTypes),
			ValueWO:        types.StringNull(),
			ValueWOVersion: types.Int64Null(),
		}
		if c.Header != nil {
			m.Header = objectValue(ctx, egressCredentialHeaderAttrTypes, egressCredentialHeaderModel{
				Name: types.StringValue(c.Header.Name), ValueTemplate: stringOrNull(c.Header.ValueTemplate),
			}, diags)
		}
		if c.BasicAuth != nil {
			m.BasicAuth = objectValue(ctx, egressCredentialBasicAuthAttrTypes,
				egressCredentialBasicAuthModel{Username: stringOrNull(c.BasicAuth.Username)}, diags)
		}
		if c.SecretRef == injectedSecretRef(ep.Name, c.Name) {
			if v, ok := versions[c.Name]; ok && present[c.Name] {
				m.ValueWOVersion = v
			}
		} else {
			m.SecretRef = objectValue(ctx, secretKeyAttrTypes,
				secretKeyModel{Name: types.StringValue(c.SecretRef.Name), Key: types.StringValue(c.SecretRef.Key)}, diags)
		}
		out = append(out, m)
	}
	v, d := types.ListValueFrom(ctx, credType, out)
	diags.Append(d...)
	return v
}

// injectedValues are the value_wo credentials of the configuration, by
// name, each with whether it must be written: its version is not the
// prior one (new, rotated, or forgotten by Read because the key went
// missing).
func injectedValues(ctx context.Context, config tfsdk.Config, prior types.List, diags *diag.Diagnostics) map[string]injectedValue {
	var list types.List
	diags.Append(config.GetAttribute(ctx, path.Root("credentials"), &list)...)
	out := map[string]injectedValue{}
	if diags.HasError() || list.IsNull() || list.IsUnknown() {
		return out
	}
	var creds []egressCredentialModel
	diags.Append(list.ElementsAs(ctx, &creds, false)...)
	versions := credentialVersions(ctx, prior, diags)
	for _, c := range creds {
		if c.ValueWO.IsNull() {
			continue
		}
		v, had := versions[c.Name.ValueString()]
		out[c.Name.ValueString()] = injectedValue{value: c.ValueWO.ValueString(), rewrite: !had || !v.Equal(c.ValueWOVersion)}
	}
	return out
}
