package provider

import (
	"context"
	"fmt"
	"strings"
	"time"

	"github.com/hashicorp/terraform-plugin-framework-timeouts/resource/timeouts"
	"github.com/hashicorp/terraform-plugin-framework-validators/int64validator"
	"github.com/hashicorp/terraform-plugin-framework-validators/objectvalidator"
	"github.com/hashicorp/terraform-plugin-framework-validators/setvalidator"
	"github.com/hashicorp/terraform-plugin-framework-validators/stringvalidator"
	"github.com/hashicorp/terraform-plugin-framework/attr"
	"github.com/hashicorp/terraform-plugin-framework/diag"
	"github.com/hashicorp/terraform-plugin-framework/path"
	"github.com/hashicorp/terraform-plugin-framework/resource"
	"github.com/hashicorp/terraform-plugin-framework/resource/schema"
	"github.com/hashicorp/terraform-plugin-framework/resource/schema/booldefault"
	"github.com/hashicorp/terraform-plugin-framework/resource/schema/stringdefault"
	"github.com/hashicorp/terraform-plugin-framework/schema/validator"
	"github.com/hashicorp/terraform-plugin-framework/types"
	apimeta "k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	k8stypes "k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"

	agentboxv1alpha1 "github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
)

var (
	_ resource.Resource                   = (*egressProxyResource)(nil)
	_ resource.ResourceWithConfigure      = (*egressProxyResource)(nil)
	_ resource.ResourceWithImportState    = (*egressProxyResource)(nil)
	_ resource.ResourceWithModifyPlan     = (*egressProxyResource)(nil)
	_ resource.ResourceWithValidateConfig = (*egressProxyResource)(nil)
)

// NewEgressProxyResource manages an EgressProxy and, when its upstream
// credentials are given in the configuration, the Secret that holds them.
func NewEgressProxyResource() resource.Resource { return &egressProxyResource{} }

type egressProxyResource struct{ data *providerData }

type egressProxyModel struct {
	ID                           types.String   `tfsdk:"id"`
	Name                         types.String   `tfsdk:"name"`
	Namespace                    types.String   `tfsdk:"namespace"`
	Mode                         types.String   `tfsdk:"mode"`
	Replicas                     types.Int64    `tfsdk:"replicas"`
	AllowedDomains               types.Set      `tfsdk:"allowed_domains"`
	DeniedDomains                types.Set      `tfsdk:"denied_domains"`
	DeniedCIDRs                  types.Set      `tfsdk:"denied_cidrs"`
	AllowedCIDRs                 types.Set      `tfsdk:"allowed_cidrs"`
	RuntimeClassName             types.String   `tfsdk:"runtime_class_name"`
	UpstreamURL                  types.String   `tfsdk:"upstream_url"`
	UpstreamCredentialsWO        types.String   `tfsdk:"upstream_credentials_wo"`
	UpstreamCredentialsWOVersion types.Int64    `tfsdk:"upstream_credentials_wo_version"`
	UpstreamCredentialsSecret    types.Object   `tfsdk:"upstream_credentials_secret"`
	Credentials                  types.List     `tfsdk:"credentials"`
	DestinationCABundle          types.String   `tfsdk:"destination_ca_bundle"`
	WaitForReady                 types.Bool     `tfsdk:"wait_for_ready"`
	Status                       types.Object   `tfsdk:"status"`
	Timeouts                     timeouts.Value `tfsdk:"timeouts"`
}

type secretKeyModel struct {
	Name types.String `tfsdk:"name"`
	Key  types.String `tfsdk:"key"`
}

type egressProxyStatusModel struct {
	Ready          types.Bool   `tfsdk:"ready"`
	Reason         types.String `tfsdk:"reason"`
	Message        types.String `tfsdk:"message"`
	ReadyEndpoints types.List   `tfsdk:"ready_endpoints"`
}

const (
	egressProxyKind          = "EgressProxy"
	egressProxyTFType        = "egress_proxy"
	defaultEgressProxyWait   = 5 * time.Minute
	defaultEgressProxyDelete = 5 * time.Minute

	maxDomains = 1024
	maxCIDRs   = 256
)

var egressProxyCR = crKind{kind: egressProxyKind, tfType: egressProxyTFType}

// egressProxyMode is one value of `mode`: the validator, the attribute's
// documentation and the configuration checks all come from this list.
type egressProxyMode struct {
	name        agentboxv1alpha1.EgressProxyMode
	description string
	hasReplicas bool
}

var egressProxyModes = []egressProxyMode{
	{
		name: agentboxv1alpha1.EgressProxyModePerAgent,
		description: "one proxy pod and Service per sandbox, so one agent's traffic never shares a process or an " +
			"upstream session with another's",
	},
	{
		name:        agentboxv1alpha1.EgressProxyModeShared,
		description: "one proxy Deployment and Service that every sandbox naming the proxy uses; `replicas` sizes it",
		hasReplicas: true,
	},
}

func egressProxyModeNames() []string {
	names := make([]string, len(egressProxyModes))
	for i, m := range egressProxyModes {
		names[i] = string(m.name)
	}
	return names
}

func egressModesWithReplicas() []string {
	var names []string
	for _, m := range egressProxyModes {
		if m.hasReplicas {
			names = append(names, string(m.name))
		}
	}
	return names
}

var (
	egressProxyStatusAttrTypes = map[string]attr.Type{
		"ready": types.BoolType, "reason": types.StringType, "message": types.StringType,
		"ready_endpoints": types.ListType{ElemType: types.StringType},
	}
	secretKeyAttrTypes = map[string]attr.Type{"name": types.StringType, "key": types.StringType}

	egressReplicasRange = int64validator.Between(1, 100)
)

func (r *egressProxyResource) Metadata(_ context.Context, req resource.MetadataRequest, resp *resource.MetadataResponse) {
	resp.TypeName = req.ProviderTypeName + "_" + egressProxyTFType
}

func (r *egressProxyResource) Schema(ctx context.Context, _ resource.SchemaRequest, resp *resource.SchemaResponse) {
	modes := make([]string, len(egressProxyModes))
	for i, m := range egressProxyModes {
		modes[i] = "`" + string(m.name) + "`: " + m.description + "."
	}
	domains := func(desc string) schema.SetAttribute {
		return schema.SetAttribute{
			ElementType: types.StringType, Optional: true,
			MarkdownDescription: desc + " Each must be " + domainCheck.description + "; at most " + fmt.Sprint(maxDomains) + ".",
			Validators:          []validator.Set{setvalidator.SizeAtMost(maxDomains), setvalidator.ValueStringsAre(domainCheck)},
		}
	}
	resp.Schema = schema.Schema{
		MarkdownDescription: "An egress proxy: the HTTP(S) proxy that is the sandboxes' only way out. It lets through only " +
			"`allowed_domains`, refuses private, loopback, link-local and metadata addresses (less `allowed_cidrs`) and " +
			"`denied_cidrs` after DNS resolution, can chain to an upstream proxy with credentials, and logs every request. It becomes an " +
			"`EgressProxy` object; templates name it in `egress_proxy`. Upstream credentials given in " +
			"`upstream_credentials_wo` are kept in a Secret `<name>-egress-upstream` that the resource owns; they are " +
			"write-only and never stored in the plan or state (Terraform 1.11 or later). `credentials` are secrets the proxy " +
			"adds to requests for some hosts, so that sandboxes never hold them; their values given in `value_wo` are kept, " +
			"write-only too, in a Secret `<name>-egress-injected` that the resource owns. Requires `agentbox_platform`.",
		Attributes: map[string]schema.Attribute{
			"id":        idAttribute(egressProxyKind),
			"name":      nameAttribute(egressProxyKind),
			"namespace": namespaceAttribute(egressProxyKind),
			"mode": schema.StringAttribute{
				Optional: true, Computed: true, Default: stringdefault.StaticString(string(agentboxv1alpha1.EgressProxyModePerAgent)),
				MarkdownDescription: "How sandboxes share the proxy; defaults to `" + string(agentboxv1alpha1.EgressProxyModePerAgent) +
					"`. " + strings.Join(modes, " "),
				Validators: []validator.String{stringvalidator.OneOf(egressProxyModeNames()...)},
			},
			"replicas": schema.Int64Attribute{
				Optional: true,
				MarkdownDescription: "Number of proxy pods, only in " + codeList(egressModesWithReplicas()) + " mode; unset means 1. " +
					"The " + egressReplicasRange.MarkdownDescription(ctx) + ".",
				Validators: []validator.Int64{egressReplicasRange},
			},
			"allowed_domains": domains("The only destinations the proxy lets through, by host name. Unset or empty denies everything."),
			"denied_domains":  domains("Destinations refused even when `allowed_domains` matches them."),
			"denied_cidrs": schema.SetAttribute{
				ElementType: types.StringType, Optional: true,
				MarkdownDescription: "Networks refused after DNS resolution, in addition to the private, loopback, link-local and " +
					"metadata ranges that are always refused. Each must be " + cidrCheck.description + "; at most " + fmt.Sprint(maxCIDRs) + ".",
				Validators: []validator.Set{setvalidator.SizeAtMost(maxCIDRs), setvalidator.ValueStringsAre(cidrCheck)},
			},
			"allowed_cidrs": schema.SetAttribute{
				ElementType: types.StringType, Optional: true,
				MarkdownDescription: "Networks inside the always-refused private ranges that the proxy may reach anyway, such as " +
					"the pod or Service network of an in-cluster server named in `allowed_domains` (by a name that resolves there, or " +
					"by its IP). Only names in `allowed_domains` get there, and `denied_cidrs` still win inside them. The proxy pods' " +
					"NetworkPolicy lets them out to these networks too. Each must be " + allowedCIDRCheck.description + "; at most " +
					fmt.Sprint(maxCIDRs) + ".",
				Validators: []validator.Set{setvalidator.SizeAtMost(maxCIDRs), setvalidator.ValueStringsAre(allowedCIDRCheck)},
			},
			"runtime_class_name": schema.StringAttribute{
				Optional: true,
				MarkdownDescription: "RuntimeClass of the proxy pods, such as the gVisor class the sandboxes run under. Unset leaves " +
					"the control plane's choice, by default the cluster's default runtime. Must be " + dnsSubdomainCheck.description +
					". Changing it replaces the running proxy pods.",
				Validators: []validator.String{dnsSubdomainCheck},
			},
			"upstream_url": schema.StringAttribute{
				Optional: true,
				MarkdownDescription: "An upstream HTTP proxy that the egress proxy chains to. Must be " + upstreamURLCheck.description +
					". Unset means the proxy connects to destinations directly. An upstream inside the cluster (a Service's name, " +
					"such as `http://squid.proxies.svc:3128`, or a private IP) is let out through the proxy pods' NetworkPolicy: the " +
					"Service's pods on its target port, or that one address.",
				Validators: []validator.String{upstreamURLCheck},
			},
			"upstream_credentials_wo": schema.StringAttribute{
				Optional: true, Sensitive: true, WriteOnly: true,
				MarkdownDescription: "Credentials for the upstream, sent as `Proxy-Authorization`; must be " + credentialsDescription +
					". Write-only: Terraform passes it to the provider but never keeps it in the plan or state (Terraform 1.11 or " +
					"later). The provider stores it in the Secret `<name>-egress-upstream`, owned by the proxy, and writes it only " +
					"when `upstream_credentials_wo_version` changes or the Secret is missing. The credentials reach only the proxy " +
					"pods, never the sandboxes. Requires `upstream_url`; conflicts with `upstream_credentials_secret`.",
				Validators: []validator.String{
					credentialsCheck{},
					stringvalidator.AlsoRequires(path.MatchRoot("upstream_url"), path.MatchRoot("upstream_credentials_wo_version")),
					stringvalidator.ConflictsWith(path.MatchRoot("upstream_credentials_secret")),
				},
			},
			"upstream_credentials_wo_version": schema.Int64Attribute{
				Optional: true,
				MarkdownDescription: "Any number, changed to make the provider write a new `upstream_credentials_wo` into its " +
					"Secret (a rotation). Required with `upstream_credentials_wo`. If the Secret goes missing, the next plan shows " +
					"this attribute changing, and the apply writes the Secret again.",
				Validators: []validator.Int64{int64validator.AlsoRequires(path.MatchRoot("upstream_credentials_wo"))},
			},
			"upstream_credentials_secret": schema.SingleNestedAttribute{
				Optional: true,
				MarkdownDescription: "An existing Secret, in the proxy's namespace, whose key holds the upstream credentials as " +
					credentialsDescription + ". The alternative to `upstream_credentials_wo` when something else manages the " +
					"Secret; the proxy starts once the Secret exists. Requires `upstream_url`.",
				Validators: []validator.Object{objectvalidator.AlsoRequires(path.MatchRoot("upstream_url"))},
				Attributes: map[string]schema.Attribute{
					"name": schema.StringAttribute{
						Required: true, MarkdownDescription: "Name of the Secret. Must be " + dnsSubdomainCheck.description + ".",
						Validators: []validator.String{dnsSubdomainCheck},
					},
					"key": schema.StringAttribute{
						Required: true, MarkdownDescription: "Key in the Secret whose value is the credentials.",
						Validators: []validator.String{stringvalidator.LengthBetween(1, 253)},
					},
				},
			},
			"credentials":           egressCredentialsAttribute(),
			"destination_ca_bundle": destinationCABundleAttribute(),
			"wait_for_ready": schema.BoolAttribute{
				Optional: true, Computed: true, Default: booldefault.StaticBool(true),
				MarkdownDescription: "Wait on create and update until the platform reports the proxy Ready (in `Shared` mode its " +
					"pods are ready; in `PerAgent` mode every existing sandbox's proxy is), within the `timeouts`. Defaults to " +
					"`true`. On timeout the error carries the proxy's Ready condition, e.g. `UpstreamSecretNotFound`.",
			},
			"status": schema.SingleNestedAttribute{
				Computed: true,
				MarkdownDescription: "What the control plane last reported. Refreshed on every read; it never causes a change " +
					"by itself.",
				Attributes: map[string]schema.Attribute{
					"ready": schema.BoolAttribute{
						Computed: true, MarkdownDescription: "Whether the proxy's Ready condition is `True` for the current spec.",
					},
					"reason": schema.StringAttribute{
						Computed: true,
						MarkdownDescription: "Reason of the Ready condition, such as `" + agentboxv1alpha1.ReasonProxyAvailable + "`, `" +
							agentboxv1alpha1.ReasonProxyProgressing + "` or `" + agentboxv1alpha1.ReasonUpstreamSecretNotFound +
							"`; null before the control plane has seen the proxy.",
					},
					"message": schema.StringAttribute{
						Computed: true, MarkdownDescription: "Message of the Ready condition; null before the control plane has seen the proxy.",
					},
					"ready_endpoints": schema.ListAttribute{
						ElementType: types.StringType, Computed: true,
						MarkdownDescription: "Proxy URLs (`http://<service>.<namespace>.svc:<port>`) whose pods are ready.",
					},
				},
			},
			"timeouts": timeoutsAttribute(ctx,
				&timeoutDoc{"the create, including the wait for readiness", defaultEgressProxyWait},
				&timeoutDoc{"an update, including the wait for readiness", defaultEgressProxyWait},
				&timeoutDoc{"the destroy, which waits until the proxy is gone", defaultEgressProxyDelete}),
		},
	}
}

func (r *egressProxyResource) Configure(_ context.Context, req resource.ConfigureRequest, resp *resource.ConfigureResponse) {
	r.data = providerDataFrom(req.ProviderData, &resp.Diagnostics)
}

// ValidateConfig applies the rules of egressProxyModes and of
// egressCredentialRules before plan, so a proxy the API server would
// reject fails early.
func (r *egressProxyResource) ValidateConfig(ctx context.Context, req resource.ValidateConfigRequest, resp *resource.ValidateConfigResponse) {
	validateEgressCredentials(ctx, req.Config, &resp.Diagnostics)
	var mode types.String
	var replicas types.Int64
	resp.Diagnostics.Append(req.Config.GetAttribute(ctx, path.Root("mode"), &mode)...)
	resp.Diagnostics.Append(req.Config.GetAttribute(ctx, path.Root("replicas"), &replicas)...)
	if resp.Diagnostics.HasError() || mode.IsUnknown() || replicas.IsNull() {
		return
	}
	name := string(agentboxv1alpha1.EgressProxyModePerAgent)
	if !mode.IsNull() {
		name = mode.ValueString()
	}
	for _, m := range egressProxyModes {
		if string(m.name) == name && !m.hasReplicas {
			resp.Diagnostics.AddAttributeError(path.Root("replicas"), "replicas needs mode Shared",
				fmt.Sprintf("mode %q runs one proxy per sandbox, so it has no replica count; set mode = %s or remove replicas.",
					name, codeList(egressModesWithReplicas())))
		}
	}
}

// ModifyPlan plans the namespace and ID, known before apply.
func (r *egressProxyResource) ModifyPlan(ctx context.Context, req resource.ModifyPlanRequest, resp *resource.ModifyPlanResponse) {
	planObjectID(ctx, r.data, req, resp)
}

func (r *egressProxyResource) Create(ctx context.Context, req resource.CreateRequest, resp *resource.CreateResponse) {
	var plan egressProxyModel
	var creds types.String
	resp.Diagnostics.Append(req.Config.GetAttribute(ctx, path.Root("upstream_credentials_wo"), &creds)...)
	injected := injectedValues(ctx, req.Config, types.ListNull(types.ObjectType{AttrTypes: egressCredentialAttrTypes}), &resp.Diagnostics)
	c := modelAndClient(ctx, r.data, req.Plan, &plan, &resp.Diagnostics)
	if c == nil {
		return
	}
	timeout, diags := plan.Timeouts.Create(ctx, defaultEgressProxyWait)
	resp.Diagnostics.Append(diags...)
	ns := resolveNamespace(plan.Namespace, r.data)
	obj := &agentboxv1alpha1.EgressProxy{ObjectMeta: metav1.ObjectMeta{Name: plan.Name.ValueString(), Namespace: ns}}
	obj.Spec = plan.spec(ctx, &resp.Diagnostics)
	if resp.Diagnostics.HasError() || !egressProxyCR.create(ctx, c, obj, &resp.Diagnostics) {
		return
	}
	key := client.ObjectKeyFromObject(obj)
	plan.ID = types.StringValue(objectID(ns, obj.Name))
	plan.Namespace = types.StringValue(ns)
	plan.setStatus(ctx, obj, &resp.Diagnostics)
	// Saved before the Secret and the wait: the proxy exists and must be in
	// state so that destroy removes it.
	resp.Diagnostics.Append(resp.State.Set(ctx, &plan)...)
	if !creds.IsNull() {
		// After the proxy, so that the Secret can be owned by it; the
		// controller waits for the Secret and its watch wakes it.
		if err := writeUpstreamSecret(ctx, c, obj, creds.ValueString()); err != nil {
			upstreamSecretDiag(&resp.Diagnostics, "write", key, err)
			return
		}
	}
	if len(injected) > 0 {
		if err := syncInjectedSecret(ctx, c, obj, injected); err != nil {
			injectedSecretDiag(&resp.Diagnostics, "write", key, err)
			return
		}
	}
	r.waitAndRefresh(ctx, c, key, &plan, timeout, &resp.Diagnostics)
	resp.Diagnostics.Append(resp.State.Set(ctx, &plan)...)
}

func (r *egressProxyResource) Read(ctx context.Context, req resource.ReadRequest, resp *resource.ReadResponse) {
	var state egressProxyModel
	c := modelAndClient(ctx, r.data, req.State, &state, &resp.Diagnostics)
	if c == nil {
		return
	}
	key := objectKey(state.Namespace, state.Name)
	var obj agentboxv1alpha1.EgressProxy
	if !egressProxyCR.read(ctx, c, key, &obj, resp) {
		return
	}
	state.ID = types.StringValue(objectID(obj.Namespace, obj.Name))
	// As for the upstream credentials, Read sees of the value_wo only
	// whether its key is in the resource's Secret; a missing one makes
	// fromSpec forget the credential's version, which plans a rewrite.
	var present map[string]bool
	if usesInjectedSecret(&obj) {
		var err error
		if present, err = injectedSecret(obj.Name).keys(ctx, c, &obj); err != nil {
			injectedSecretDiag(&resp.Diagnostics, "read", key, err)
			return
		}
	}
	state.fromSpec(ctx, &obj, present, &resp.Diagnostics)
	if !state.UpstreamCredentialsWOVersion.IsNull() {
		// The value is write-only, so Read cannot compare it; what it can see
		// is the Secret gone or no longer referenced. Forgetting the version
		// then plans an update, which writes the Secret and reference again.
		ok, err := upstreamSecretInUse(ctx, c, &obj)
		if err != nil {
			upstreamSecretDiag(&resp.Diagnostics, "read", key, err)
			return
		}
		if !ok {
			state.UpstreamCredentialsWOVersion = types.Int64Null()
		}
	}
	state.setStatus(ctx, &obj, &resp.Diagnostics)
	defaultWaitForReady(&state.WaitForReady)
	resp.Diagnostics.Append(resp.State.Set(ctx, &state)...)
}

func (r *egressProxyResource) Update(ctx context.Context, req resource.UpdateRequest, resp *resource.UpdateResponse) {
	var plan, prior egressProxyModel
	var creds types.String
	resp.Diagnostics.Append(req.State.Get(ctx, &prior)...)
	resp.Diagnostics.Append(req.Config.GetAttribute(ctx, path.Root("upstream_credentials_wo"), &creds)...)
	injected := injectedValues(ctx, req.Config, prior.Credentials, &resp.Diagnostics)
	c := modelAndClient(ctx, r.data, req.Plan, &plan, &resp.Diagnostics)
	if c == nil {
		return
	}
	timeout, diags := plan.Timeouts.Update(ctx, defaultEgressProxyWait)
	resp.Diagnostics.Append(diags...)
	spec := plan.spec(ctx, &resp.Diagnostics)
	if resp.Diagnostics.HasError() {
		return
	}
	key := objectKey(plan.Namespace, plan.Name)
	var obj agentboxv1alpha1.EgressProxy
	// The whole spec is Terraform's: replacing it undoes out-of-band edits.
	if !updateObject(ctx, egressProxyCR, c, key, &obj, func() { obj.Spec = spec }, &resp.Diagnostics) {
		return
	}
	switch {
	case !creds.IsNull() && !plan.UpstreamCredentialsWOVersion.Equal(prior.UpstreamCredentialsWOVersion):
		// A new version is a rotation; a version Read forgot means the
		// Secret went missing. Either way the configuration's value goes in.
		if err := writeUpstreamSecret(ctx, c, &obj, creds.ValueString()); err != nil {
			upstreamSecretDiag(&resp.Diagnostics, "write", key, err)
			return
		}
	case creds.IsNull():
		// Credentials dropped or moved to a Secret of the user's: ours goes.
		if err := deleteUpstreamSecret(ctx, c, &obj); err != nil {
			upstreamSecretDiag(&resp.Diagnostics, "delete", key, err)
			return
		}
	}
	// New and rotated values go in, dropped credentials' keys go out, and
	// with no value_wo left the Secret goes.
	if err := syncInjectedSecret(ctx, c, &obj, injected); err != nil {
		injectedSecretDiag(&resp.Diagnostics, "write", key, err)
		return
	}
	plan.setStatus(ctx, &obj, &resp.Diagnostics)
	resp.Diagnostics.Append(resp.State.Set(ctx, &plan)...)
	r.waitAndRefresh(ctx, c, key, &plan, timeout, &resp.Diagnostics)
	resp.Diagnostics.Append(resp.State.Set(ctx, &plan)...)
}

func (r *egressProxyResource) Delete(ctx context.Context, req resource.DeleteRequest, resp *resource.DeleteResponse) {
	var state egressProxyModel
	c := modelAndClient(ctx, r.data, req.State, &state, &resp.Diagnostics)
	if c == nil {
		return
	}
	timeout, diags := state.Timeouts.Delete(ctx, defaultEgressProxyDelete)
	resp.Diagnostics.Append(diags...)
	obj := &agentboxv1alpha1.EgressProxy{ObjectMeta: namedObjectMeta(state.Namespace, state.Name)}
	// The owner reference would have the garbage collector remove the
	// Secret too, but a cluster without one (or a destroy racing it) must
	// not keep credentials behind.
	if err := deleteUpstreamSecret(ctx, c, obj); err != nil {
		upstreamSecretDiag(&resp.Diagnostics, "delete", client.ObjectKeyFromObject(obj), err)
		return
	}
	if err := injectedSecret(obj.Name).delete(ctx, c, obj); err != nil {
		injectedSecretDiag(&resp.Diagnostics, "delete", client.ObjectKeyFromObject(obj), err)
		return
	}
	egressProxyCR.delete(ctx, c, obj, timeout, &resp.Diagnostics)
}

func (r *egressProxyResource) ImportState(ctx context.Context, req resource.ImportStateRequest, resp *resource.ImportStateResponse) {
	importObject(ctx, r.data, req, resp)
}

// waitAndRefresh waits, if asked to, until the controller reports the
// current spec Ready, and takes the status it ends with.
func (r *egressProxyResource) waitAndRefresh(ctx context.Context, c client.Client, key k8stypes.NamespacedName, m *egressProxyModel,
	timeout time.Duration, diags *diag.Diagnostics) {
	if !m.WaitForReady.ValueBool() {
		return
	}
	var ep agentboxv1alpha1.EgressProxy
	waitReady(ctx, egressProxyCR, c, key, &ep, timeout, func() (bool, string) {
		progress := fmt.Sprintf("%d ready endpoints (observed generation %d of %d); %s", len(ep.Status.ReadyEndpoints),
			ep.Status.ObservedGeneration, ep.Generation, readyConditionText(ep.Status.Conditions, agentboxv1alpha1.ConditionReady))
		return egressProxyReady(&ep), progress
	}, func() { m.setStatus(ctx, &ep, diags) }, diags)
}

// egressProxyReady: a Ready condition about an older spec says nothing
// about this one.
func egressProxyReady(ep *agentboxv1alpha1.EgressProxy) bool {
	cond := apimeta.FindStatusCondition(ep.Status.Conditions, agentboxv1alpha1.ConditionReady)
	return cond != nil && cond.Status == metav1.ConditionTrue && ep.Status.ObservedGeneration >= ep.Generation
}

func (m *egressProxyModel) spec(ctx context.Context, diags *diag.Diagnostics) agentboxv1alpha1.EgressProxySpec {
	s := agentboxv1alpha1.EgressProxySpec{Mode: agentboxv1alpha1.EgressProxyMode(m.Mode.ValueString())}
	for _, d := range goSet(ctx, m.AllowedDomains, diags) {
		s.AllowedDomains = append(s.AllowedDomains, agentboxv1alpha1.Domain(d))
	}
	for _, d := range goSet(ctx, m.DeniedDomains, diags) {
		s.DeniedDomains = append(s.DeniedDomains, agentboxv1alpha1.Domain(d))
	}
	for _, n := range goSet(ctx, m.DeniedCIDRs, diags) {
		s.DeniedCIDRs = append(s.DeniedCIDRs, agentboxv1alpha1.CIDR(n))
	}
	for _, n := range goSet(ctx, m.AllowedCIDRs, diags) {
		s.AllowedCIDRs = append(s.AllowedCIDRs, agentboxv1alpha1.AllowedCIDR(n))
	}
	s.RuntimeClassName = m.RuntimeClassName.ValueString()
	if !m.Replicas.IsNull() && !m.Replicas.IsUnknown() {
		n := int32(m.Replicas.ValueInt64())
		s.Replicas = &n
	}
	s.Credentials = m.credentialsSpec(ctx, diags)
	s.DestinationCABundle = m.DestinationCABundle.ValueString()
	if !m.UpstreamURL.IsNull() {
		s.Upstream = &agentboxv1alpha1.EgressUpstream{URL: m.UpstreamURL.ValueString()}
		switch {
		case !m.UpstreamCredentialsSecret.IsNull() && !m.UpstreamCredentialsSecret.IsUnknown():
			var ref secretKeyModel
			diags.Append(m.UpstreamCredentialsSecret.As(ctx, &ref, objectAsOptions)...)
			s.Upstream.CredentialsSecretRef = &agentboxv1alpha1.SecretKeySelector{Name: ref.Name.ValueString(), Key: ref.Key.ValueString()}
		case !m.UpstreamCredentialsWOVersion.IsNull():
			// The write-only value is null in the plan; its version stands
			// for it.
			s.Upstream.CredentialsSecretRef = ownedSecretRef(m.Name.ValueString())
		}
	}
	return s
}

// fromSpec sets the attributes from the live spec. A reference to the
// resource's own Secret is upstream_credentials_wo's doing, not
// upstream_credentials_secret, and likewise value_wo's for a credential;
// present are the keys holding a value in the Secret of the latter.
func (m *egressProxyModel) fromSpec(ctx context.Context, ep *agentboxv1alpha1.EgressProxy, present map[string]bool, diags *diag.Diagnostics) {
	s := &ep.Spec
	mode := s.Mode
	if mode == "" {
		mode = agentboxv1alpha1.EgressProxyModePerAgent
	}
	m.Mode = types.StringValue(string(mode))
	m.Replicas = types.Int64Null()
	if s.Replicas != nil {
		m.Replicas = types.Int64Value(int64(*s.Replicas))
	}
	m.AllowedDomains = setValue(ctx, m.AllowedDomains, s.AllowedDomains, diags)
	m.DeniedDomains = setValue(ctx, m.DeniedDomains, s.DeniedDomains, diags)
	m.DeniedCIDRs = setValue(ctx, m.DeniedCIDRs, s.DeniedCIDRs, diags)
	m.AllowedCIDRs = setValue(ctx, m.AllowedCIDRs, s.AllowedCIDRs, diags)
	m.RuntimeClassName = types.StringNull()
	if s.RuntimeClassName != "" {
		m.RuntimeClassName = types.StringValue(s.RuntimeClassName)
	}
	m.Credentials = credentialsValue(ctx, m.Credentials, ep, present, diags)
	m.DestinationCABundle = stringOrNull(s.DestinationCABundle)
	m.UpstreamURL = types.StringNull()
	m.UpstreamCredentialsSecret = types.ObjectNull(secretKeyAttrTypes)
	m.UpstreamCredentialsWO = types.StringNull()
	if s.Upstream == nil {
		return
	}
	m.UpstreamURL = types.StringValue(s.Upstream.URL)
	if ref := s.Upstream.CredentialsSecretRef; ref != nil && *ref != *ownedSecretRef(ep.Name) {
		m.UpstreamCredentialsSecret = objectValue(ctx, secretKeyAttrTypes,
			secretKeyModel{Name: types.StringValue(ref.Name), Key: types.StringValue(ref.Key)}, diags)
	}
}

func (m *egressProxyModel) setStatus(ctx context.Context, ep *agentboxv1alpha1.EgressProxy, diags *diag.Diagnostics) {
	endpoints := ep.Status.ReadyEndpoints
	if endpoints == nil {
		endpoints = []string{}
	}
	list, d := types.ListValueFrom(ctx, types.StringType, endpoints)
	diags.Append(d...)
	st := egressProxyStatusModel{Ready: types.BoolValue(egressProxyReady(ep)), Reason: types.StringNull(), Message: types.StringNull(), ReadyEndpoints: list}
	if cond := apimeta.FindStatusCondition(ep.Status.Conditions, agentboxv1alpha1.ConditionReady); cond != nil {
		st.Reason = types.StringValue(cond.Reason)
		st.Message = types.StringValue(cond.Message)
	}
	m.Status = objectValue(ctx, egressProxyStatusAttrTypes, st, diags)
}
