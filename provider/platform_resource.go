package provider

import (
	"context"
	"errors"
	"fmt"
	"regexp"
	"time"

	"github.com/hashicorp/terraform-plugin-framework-timeouts/resource/timeouts"
	"github.com/hashicorp/terraform-plugin-framework-validators/int64validator"
	"github.com/hashicorp/terraform-plugin-framework-validators/setvalidator"
	"github.com/hashicorp/terraform-plugin-framework-validators/stringvalidator"
	"github.com/hashicorp/terraform-plugin-framework/diag"
	"github.com/hashicorp/terraform-plugin-framework/path"
	"github.com/hashicorp/terraform-plugin-framework/resource"
	"github.com/hashicorp/terraform-plugin-framework/resource/schema"
	"github.com/hashicorp/terraform-plugin-framework/resource/schema/booldefault"
	"github.com/hashicorp/terraform-plugin-framework/resource/schema/int64default"
	"github.com/hashicorp/terraform-plugin-framework/resource/schema/planmodifier"
	"github.com/hashicorp/terraform-plugin-framework/resource/schema/stringdefault"
	"github.com/hashicorp/terraform-plugin-framework/resource/schema/stringplanmodifier"
	"github.com/hashicorp/terraform-plugin-framework/schema/validator"
	"github.com/hashicorp/terraform-plugin-framework/types"
	"github.com/hashicorp/terraform-plugin-log/tflog"

	"github.com/agentbox/terraform-provider-agentbox/internal/chart"
)

var (
	_ resource.Resource                   = (*platformResource)(nil)
	_ resource.ResourceWithConfigure      = (*platformResource)(nil)
	_ resource.ResourceWithImportState    = (*platformResource)(nil)
	_ resource.ResourceWithModifyPlan     = (*platformResource)(nil)
	_ resource.ResourceWithValidateConfig = (*platformResource)(nil)
)

// NewPlatformResource manages the Helm release of the embedded chart.
func NewPlatformResource() resource.Resource { return &platformResource{} }

type platformResource struct{ data *providerData }

type platformModel struct {
	ID              types.String `tfsdk:"id"`
	Namespace       types.String `tfsdk:"namespace"`
	ReleaseName     types.String `tfsdk:"release_name"`
	ChartVersion    types.String `tfsdk:"chart_version"`
	ImageTag        types.String `tfsdk:"image_tag"`
	ImageRegistry   types.String `tfsdk:"image_registry"`
	ImagePullPolicy types.String `tfsdk:"image_pull_policy"`
	Replicas        types.Int64  `tfsdk:"replicas"`
	// SandboxNamespaces are the namespaces served besides Namespace.
	SandboxNamespaces types.Set      `tfsdk:"sandbox_namespaces"`
	Values            types.String   `tfsdk:"values"`
	Wait              types.Bool     `tfsdk:"wait"`
	Timeouts          timeouts.Value `tfsdk:"timeouts"`
	Revision          types.Int64    `tfsdk:"revision"`
	Status            types.String   `tfsdk:"status"`
	APIEndpoint       types.String   `tfsdk:"api_endpoint"`
	APIServiceDNS     types.String   `tfsdk:"api_service_dns"`
	CACertificate     types.String   `tfsdk:"ca_certificate"`
	AdminToken        types.String   `tfsdk:"admin_token"`
	Drift             types.List     `tfsdk:"drift"`
	SnapshotDriver    types.String   `tfsdk:"snapshot_driver"`
}

const (
	// maxSandboxNamespaces bounds sandbox_namespaces as the chart's
	// values.schema.json does.
	maxSandboxNamespaces   = 100
	platformDefaultTimeout = 5 * time.Minute
	statusDeployed         = "deployed"
)

// valuesCheck checks what the chart reads, so it stays with the platform.
var valuesCheck = stringCheck{
	description: "a YAML map of chart values",
	check: func(s string) error {
		_, err := chart.ParseValues(s)
		return err
	},
}

func (r *platformResource) Metadata(_ context.Context, req resource.MetadataRequest, resp *resource.MetadataResponse) {
	resp.TypeName = req.ProviderTypeName + "_platform"
}

func (r *platformResource) Schema(ctx context.Context, _ resource.SchemaRequest, resp *resource.SchemaResponse) {
	appVersion := chart.AppVersion()
	resp.Schema = schema.Schema{
		MarkdownDescription: "The agentbox platform: a Helm release of the `agentbox` chart (version `" + chart.Version() +
			"`) embedded in this provider. It installs the agentbox.dev CRDs and the control plane (controllers and the " +
			"Compute API) into one namespace; one platform per namespace.\n\n" +
			"Create installs the release and, unless `wait = false`, waits until the control plane Deployment is ready; " +
			"a failed install is uninstalled again, a failed upgrade rolled back. Refresh notices objects of the release " +
			"that were deleted or changed out of band (see `drift`), and the next apply upgrades the release to restore them. " +
			"Destroy uninstalls the release but leaves the CRDs, and with them every sandbox, and the generated CA Secret " +
			"`agentbox-ca` (see the chart's `ca.existingSecret` value for why).\n\n" +
			"The CRDs are applied by the provider itself on every create and update, because Helm never upgrades them.\n\n" +
			"`api_endpoint`, `ca_certificate` and `admin_token` stay known in the plan of an update that cannot change " +
			"them, so that what reads them is not updated along with the platform. They are planned unknown only when " +
			"`values` name another Secret for the CA or the token (`ca.existingSecret`, `adminToken.existingSecret`) or " +
			"another `service.port`, when the refresh found the Service or a generated Secret missing or changed, when " +
			"the release is not `deployed`, or when the chart version changes.",
		Attributes: map[string]schema.Attribute{
			"id": schema.StringAttribute{
				Computed:            true,
				MarkdownDescription: "`<namespace>/<release_name>`.",
				PlanModifiers:       []planmodifier.String{stringplanmodifier.UseStateForUnknown()},
			},
			"namespace": schema.StringAttribute{
				Optional: true, Computed: true,
				MarkdownDescription: "Namespace of the release and the control plane; created if missing, never deleted. " +
					"A namespace the platform creates enforces the restricted Pod Security Standard " +
					"(`pod-security.kubernetes.io/enforce`, `warn` and `audit` set to `restricted`, version `latest`), " +
					"which every pod of the platform and every sandbox meets, and each apply puts those labels back; " +
					"a namespace that existed before is left as it is, and sandboxes in it report whether it enforces " +
					"restricted (their `PodSecurity` condition). The runsc installer runs in a namespace of its own. " +
					"Defaults to the provider's `namespace`. Changing it replaces the platform.",
				PlanModifiers: []planmodifier.String{
					stringplanmodifier.UseStateForUnknown(), stringplanmodifier.RequiresReplace(),
				},
				Validators: []validator.String{namespaceCheck},
			},
			"release_name": schema.StringAttribute{
				Optional: true, Computed: true, Default: stringdefault.StaticString(chart.DefaultReleaseName),
				MarkdownDescription: "Name of the Helm release. Must be " + releaseNameCheck.description + ". Defaults to `" +
					chart.DefaultReleaseName + "`. Changing it replaces the platform.",
				PlanModifiers: []planmodifier.String{stringplanmodifier.RequiresReplace()},
				Validators:    []validator.String{releaseNameCheck},
			},
			"chart_version": schema.StringAttribute{
				Computed: true,
				MarkdownDescription: "Version of the chart the release runs. When a newer provider embeds a newer chart, " +
					"the plan shows this changing and apply upgrades the release.",
			},
			"image_tag": schema.StringAttribute{
				Optional: true, Computed: true, Default: stringdefault.StaticString(appVersion),
				MarkdownDescription: "Tag of all four platform images (control plane, sandbox, supervisor, egress proxy), which are " +
					"built together. Defaults to the chart's appVersion, `" + appVersion + "`.",
				Validators: []validator.String{stringvalidator.RegexMatches(regexp.MustCompile(`^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$`),
					"must be an image tag")},
			},
			"image_registry": schema.StringAttribute{
				Optional: true,
				MarkdownDescription: "Registry, optionally with a path, put in front of every image repository: " +
					"`registry.example.com/mirror` gives `registry.example.com/mirror/agentbox/agentbox-controlplane:<tag>`. " +
					"Unset means Docker Hub (`agentbox/agentbox-controlplane:<tag>`).",
			},
			"image_pull_policy": schema.StringAttribute{
				Optional: true,
				MarkdownDescription: "Pull policy of the platform images: " + codeList(pullPolicies) +
					". Unset means the chart's `IfNotPresent`.",
				Validators: []validator.String{stringvalidator.OneOf(pullPolicies...)},
			},
			"replicas": schema.Int64Attribute{
				Optional: true, Computed: true, Default: int64default.StaticInt64(1),
				MarkdownDescription: "Control plane replicas. Defaults to `1`. More than one needs a PostgreSQL store " +
					"(`store.dsn` in `values`) and turns on leader election.",
				Validators: []validator.Int64{int64validator.AtLeast(0)},
			},
			"sandbox_namespaces": schema.SetAttribute{
				Optional: true, ElementType: types.StringType,
				MarkdownDescription: "Namespaces, besides `namespace` (always served), whose sandboxes, warm pools and " +
					"egress proxies the platform runs. The control plane's Kubernetes rights over what a sandbox is made of " +
					"(pods, Secrets, workspace claims, Leases, Services, ConfigMaps, NetworkPolicies, Deployments) are " +
					"granted only in these namespaces, by a Role in each, so a leaked control plane token reads no Secret " +
					"and starts no pod anywhere else. An `agentbox_sandbox`, `agentbox_warm_pool` or `agentbox_egress_proxy` " +
					"in another namespace is not run: unless another platform on the cluster serves it, it gets the condition " +
					"`Ready=False` with reason `NamespaceNotServed` after 10 seconds, and an event saying to add its namespace " +
					"here. Several platforms may share a cluster, each in its own `namespace` and serving its own namespaces; " +
					"agent IDs are each platform's own. Take a namespace off the list only once its sandboxes are deleted: " +
					"the platform no longer finalizes them there. Each namespace must exist before apply (the platform " +
					"creates its Roles there, not the namespace). At most " + fmt.Sprint(maxSandboxNamespaces) + ", each " +
					namespaceCheck.description + ". Unset serves `namespace` only. The chart value `sandboxNamespaces`.",
				Validators: []validator.Set{setvalidator.SizeAtMost(maxSandboxNamespaces), setvalidator.ValueStringsAre(namespaceCheck)},
			},
			"values": schema.StringAttribute{
				Optional: true,
				MarkdownDescription: "Further chart values as YAML, merged last, so they win over the attributes above " +
					"(maps merge key by key). Every key is documented in the chart's `values.yaml`; unknown keys are errors, " +
					"reported at plan time. Use `yamlencode({...})` or a heredoc. The attributes above are the supported " +
					"way to set images and replicas.",
				Validators: []validator.String{valuesCheck},
			},
			"wait": schema.BoolAttribute{
				Optional: true, Computed: true, Default: booldefault.StaticBool(true),
				MarkdownDescription: "Wait on create and update until the control plane Deployment is ready (every replica " +
					"updated and available), and undo the change if it is not within the timeout; the error then says why, " +
					"for example an image that cannot be pulled; and on destroy until the release's objects are gone. " +
					"`false` returns once Kubernetes accepted the objects, or their deletion. Defaults to `true`.",
			},
			"timeouts": platformTimeouts(ctx),
			"revision": schema.Int64Attribute{
				Computed:            true,
				MarkdownDescription: "Revision of the Helm release; every upgrade adds one.",
			},
			"status": schema.StringAttribute{
				Computed:            true,
				MarkdownDescription: "Helm's status of the release: `deployed` when all is well, else for example `failed`.",
			},
			"api_endpoint": schema.StringAttribute{
				Computed: true,
				MarkdownDescription: "`https://<ClusterIP>:443` of the Compute API Service `agentbox-api`. It is reachable " +
					"from inside the cluster and from machines that route the Service network; its certificate names the " +
					"ClusterIP, so it verifies with `ca_certificate`. Elsewhere use `api_service_dns` in the cluster, or " +
					"`kubectl port-forward`.",
				PlanModifiers: []planmodifier.String{stringplanmodifier.UseStateForUnknown()},
			},
			"api_service_dns": schema.StringAttribute{
				Computed:            true,
				MarkdownDescription: "In-cluster DNS name of the Compute API, `agentbox-api.<namespace>.svc` (port 443).",
			},
			"ca_certificate": schema.StringAttribute{
				Computed: true,
				MarkdownDescription: "The platform CA certificate (PEM) from the Secret `agentbox-ca`. The Compute API's " +
					"certificate and every sandbox's chain to it.",
				PlanModifiers: []planmodifier.String{stringplanmodifier.UseStateForUnknown()},
			},
			"admin_token": schema.StringAttribute{
				Computed: true, Sensitive: true,
				MarkdownDescription: "The first admin bearer token of the Compute API, from the Secret `agentbox-admin-token` " +
					"(or the chart's `adminToken.existingSecret`).",
				PlanModifiers: []planmodifier.String{stringplanmodifier.UseStateForUnknown()},
			},
			"snapshot_driver": schema.StringAttribute{
				Computed: true,
				MarkdownDescription: "How the platform keeps the workspaces of idle-stopped sandboxes, from the chart's " +
					"`snapshot` values: `archive/embedded` (the default: archives on a volume of the control plane's own, " +
					"which needs nothing outside the cluster), `archive/s3` (archives in the S3-compatible store of " +
					"`snapshot.archive.endpoint`) or `volumesnapshot` (CSI VolumeSnapshots). The control plane checks that " +
					"its driver can work and publishes the result in the ConfigMap `agentbox-controlplane-status`; when the " +
					"check fails, apply and refresh warn with the reason and the fix (sandboxes are then not idle-stopped, " +
					"and keep running).",
			},
			"drift": schema.ListAttribute{
				Computed: true, ElementType: types.StringType,
				MarkdownDescription: "What the last refresh found wrong with the release in the cluster: objects of the " +
					"release that are missing, being deleted or changed out of band, and a release status other than " +
					"`deployed`. A changed object names the fields that differ, for example `Deployment " +
					"agentbox-system/agentbox-controlplane changed out of band: spec.template.spec.containers[0].image`. " +
					"Empty when all is well. When it is not, the plan shows it emptied and apply upgrades the release, which " +
					"recreates the objects and sets the changed fields back. An object that \"rejects the release's version\" " +
					"(one recreated with another value of an immutable field) makes that apply fail with the same message, " +
					"until it is deleted. " +
					"Only fields the chart sets are compared, with what the Kubernetes API server makes of them: each object " +
					"is applied in a server-side dry run and the result compared with the live object, so defaults, " +
					"normalized values and mutating admission webhooks are not drift, and neither are labels, annotations or " +
					"fields that others add. Left out because others legitimately own them: the control plane Deployment's " +
					"`replicas` while a HorizontalPodAutoscaler targets it; the data of the generated Secrets `agentbox-ca` " +
					"and `agentbox-admin-token`, which the chart keeps as the cluster holds them (replacing them is how they " +
					"are rotated); and the size of the volume claims (the store's, the embedded snapshot store's), which may be expanded but never shrunk. The " +
					"CRDs, which every platform in the cluster shares, and objects the API server will not apply in a dry " +
					"run (for lack of the rights to patch them, for one) are checked for presence only.",
			},
		},
	}
}

// platformTimeouts describes the timeouts attribute, which the timeouts
// module leaves without a description of its own.
func platformTimeouts(ctx context.Context) schema.Attribute {
	d := "Go duration such as `10m`. Defaults to `5m`."
	a := timeouts.Attributes(ctx, timeouts.Opts{
		Create: true, Update: true, Delete: true,
		CreateDescription: "How long the install, including the wait for the control plane, may take. " + d,
		UpdateDescription: "How long an upgrade, including the wait for the control plane, may take. " + d,
		DeleteDescription: "How long the uninstall may take, until the release's objects are gone. " + d,
	}).(schema.SingleNestedAttribute)
	a.MarkdownDescription = "How long create, update and delete may take before they fail (and, with `wait`, are undone)."
	return a
}

func (r *platformResource) Configure(_ context.Context, req resource.ConfigureRequest, resp *resource.ConfigureResponse) {
	r.data = providerDataFrom(req.ProviderData, &resp.Diagnostics)
}

func (r *platformResource) Create(ctx context.Context, req resource.CreateRequest, resp *resource.CreateResponse) {
	var plan platformModel
	resp.Diagnostics.Append(req.Plan.Get(ctx, &plan)...)
	c := chartClient(ctx, r.data, &resp.Diagnostics)
	if resp.Diagnostics.HasError() {
		return
	}
	timeout, diags := plan.Timeouts.Create(ctx, platformDefaultTimeout)
	resp.Diagnostics.Append(diags...)
	if resp.Diagnostics.HasError() {
		return
	}
	rel, err := c.Install(ctx, plan.options(timeout))
	if err != nil {
		resp.Diagnostics.AddError("Cannot install the agentbox platform", err.Error())
		return
	}
	r.afterApply(ctx, rel, &plan, &resp.Diagnostics)
	resp.Diagnostics.Append(resp.State.Set(ctx, &plan)...)
}

func (r *platformResource) Read(ctx context.Context, req resource.ReadRequest, resp *resource.ReadResponse) {
	var state platformModel
	resp.Diagnostics.Append(req.State.Get(ctx, &state)...)
	if resp.Diagnostics.HasError() {
		return
	}
	// During a plan whose provider configuration is not known yet the
	// cluster cannot be asked; the state is all there is.
	if r.data != nil && !r.data.Known() {
		return
	}
	c := chartClient(ctx, r.data, &resp.Diagnostics)
	if resp.Diagnostics.HasError() {
		return
	}
	rel, err := c.Status(ctx, state.Namespace.ValueString(), state.ReleaseName.ValueString())
	if errors.Is(err, chart.ErrNotFound) {
		tflog.Info(ctx, "platform release is gone; removing it from state", map[string]any{"id": state.ID.ValueString()})
		resp.State.RemoveResource(ctx)
		return
	}
	if err != nil {
		resp.Diagnostics.AddError("Cannot read the agentbox platform release", err.Error())
		return
	}
	state.fromReleaseConfig(rel, &resp.Diagnostics)
	refreshPlatform(ctx, r.data, rel, &state, &resp.Diagnostics)
	resp.Diagnostics.Append(resp.State.Set(ctx, &state)...)
}

func (r *platformResource) Update(ctx context.Context, req resource.UpdateRequest, resp *resource.UpdateResponse) {
	var plan, state platformModel
	resp.Diagnostics.Append(req.Plan.Get(ctx, &plan)...)
	resp.Diagnostics.Append(req.State.Get(ctx, &state)...)
	c := chartClient(ctx, r.data, &resp.Diagnostics)
	if resp.Diagnostics.HasError() {
		return
	}
	timeout, diags := plan.Timeouts.Update(ctx, platformDefaultTimeout)
	resp.Diagnostics.Append(diags...)
	if resp.Diagnostics.HasError() {
		return
	}
	ns, name := plan.Namespace.ValueString(), plan.ReleaseName.ValueString()

	var rel *chart.Release
	var err error
	if state.needsUpgrade(plan) {
		rel, err = c.Upgrade(ctx, plan.options(timeout))
		if err != nil {
			resp.Diagnostics.AddError("Cannot upgrade the agentbox platform", err.Error())
			return
		}
	} else {
		// Only `wait` or `timeouts` changed: how the provider behaves, not
		// what runs. A new revision would be noise in the release history.
		rel, err = c.Status(ctx, ns, name)
		if err != nil {
			resp.Diagnostics.AddError("Cannot read the agentbox platform release", err.Error())
			return
		}
	}
	r.afterApply(ctx, rel, &plan, &resp.Diagnostics)
	resp.Diagnostics.Append(resp.State.Set(ctx, &plan)...)
}

func (r *platformResource) Delete(ctx context.Context, req resource.DeleteRequest, resp *resource.DeleteResponse) {
	var state platformModel
	resp.Diagnostics.Append(req.State.Get(ctx, &state)...)
	c := chartClient(ctx, r.data, &resp.Diagnostics)
	if resp.Diagnostics.HasError() {
		return
	}
	timeout, diags := state.Timeouts.Delete(ctx, platformDefaultTimeout)
	resp.Diagnostics.Append(diags...)
	if resp.Diagnostics.HasError() {
		return
	}
	if err := c.Uninstall(ctx, state.Namespace.ValueString(), state.ReleaseName.ValueString(), timeout, state.Wait.ValueBool()); err != nil {
		resp.Diagnostics.AddError("Cannot uninstall the agentbox platform", err.Error())
	}
}

func (r *platformResource) ImportState(ctx context.Context, req resource.ImportStateRequest, resp *resource.ImportStateResponse) {
	ns := ""
	if r.data != nil {
		ns, _ = r.data.Namespace()
	}
	key, err := parseImportID(req.ID, ns)
	if err != nil {
		resp.Diagnostics.AddError("Invalid import ID", "Expected \"<namespace>/<release_name>\": "+err.Error())
		return
	}
	resp.Diagnostics.Append(resp.State.SetAttribute(ctx, path.Root("id"), objectID(key.Namespace, key.Name))...)
	resp.Diagnostics.Append(resp.State.SetAttribute(ctx, path.Root("namespace"), key.Namespace)...)
	resp.Diagnostics.Append(resp.State.SetAttribute(ctx, path.Root("release_name"), key.Name)...)
	// Read fills in the configuration from the release; this is only how
	// the provider behaves, which the release does not record.
	resp.Diagnostics.Append(resp.State.SetAttribute(ctx, path.Root("wait"), true)...)
}

// ValidateConfig renders the chart with the configured values, so that a
// typo in `values` fails the plan rather than the apply.
func (r *platformResource) ValidateConfig(ctx context.Context, req resource.ValidateConfigRequest, resp *resource.ValidateConfigResponse) {
	var m platformModel
	resp.Diagnostics.Append(req.Config.Get(ctx, &m)...)
	if resp.Diagnostics.HasError() {
		return
	}
	for _, v := range []interface{ IsUnknown() bool }{m.Namespace, m.ReleaseName, m.ImageTag, m.ImageRegistry, m.ImagePullPolicy, m.Replicas, m.SandboxNamespaces, m.Values} {
		if v.IsUnknown() {
			return
		}
	}
	vals := m.chartValues()
	if _, err := vals.Map(); err != nil {
		return // valuesCheck reports it
	}
	ns := m.Namespace.ValueString()
	if ns == "" {
		ns = DefaultNamespace
	}
	// As the install renders, which can look up (and so generate) the CA
	// and the admin token; `helm template` could not.
	if _, err := chart.RenderInstall(ns, chart.DefaultReleaseName, vals); err != nil {
		if m.Values.IsNull() {
			resp.Diagnostics.AddError("Invalid chart values", err.Error())
			return
		}
		resp.Diagnostics.AddAttributeError(path.Root("values"), "Invalid chart values", err.Error())
	}
}

// ModifyPlan fills in what is known before apply and turns drift found by
// the last refresh into a planned update.
//
// Drift is recorded by Read in the computed `drift` attribute. A computed
// attribute changing during refresh does not by itself make a plan, so here
// the planned value is set to empty whenever the state holds drift: the plan
// then differs from the state and Terraform calls Update, which upgrades the
// release. This keeps the reason visible in the plan (`drift` going from the
// list of missing or changed objects to empty) instead of faking a change
// elsewhere.
func (r *platformResource) ModifyPlan(ctx context.Context, req resource.ModifyPlanRequest, resp *resource.ModifyPlanResponse) {
	if req.Plan.Raw.IsNull() {
		return
	}
	var plan platformModel
	resp.Diagnostics.Append(req.Plan.Get(ctx, &plan)...)
	if resp.Diagnostics.HasError() {
		return
	}
	defaultNamespace(ctx, r.data, req.Config, &plan.Namespace, &resp.Diagnostics)
	plan.ChartVersion = types.StringValue(chart.Version())
	plan.Drift = types.ListValueMust(types.StringType, nil)
	if !plan.Namespace.IsUnknown() && !plan.ReleaseName.IsUnknown() {
		plan.APIServiceDNS = types.StringValue(chart.ServiceDNS(plan.Namespace.ValueString()))
		plan.ID = types.StringValue(objectID(plan.Namespace.ValueString(), plan.ReleaseName.ValueString()))
	}

	if !req.State.Raw.IsNull() {
		var state platformModel
		resp.Diagnostics.Append(req.State.Get(ctx, &state)...)
		if resp.Diagnostics.HasError() {
			return
		}
		if len(state.Drift.Elements()) > 0 {
			plan.Revision = types.Int64Unknown()
			plan.Status = types.StringUnknown()
		}
		// The attributes' UseStateForUnknown keeps them; only an update
		// that can change them plans them unknown, so that what reads them
		// (another resource, an output, a provider configuration) is not
		// planned again on every update.
		endpoint, ca, token := state.accessChanges(ctx, plan)
		if endpoint {
			plan.APIEndpoint = types.StringUnknown()
		}
		if ca {
			plan.CACertificate = types.StringUnknown()
		}
		if token {
			plan.AdminToken = types.StringUnknown()
		}
	}
	resp.Diagnostics.Append(resp.Plan.Set(ctx, &plan)...)
}

// accessChanges reports which of api_endpoint, ca_certificate and
// admin_token an update from m (the state) to plan can change. Changing
// namespace or release_name replaces the platform, which plans all three
// anew; within an update they follow chart.AccessSettings, so they can
// change only when
//   - the values name other Secrets for the CA or the token, or another
//     Service port (an unknown `values` might);
//   - the upgrade recreates their object: the refresh found the Service or
//     a generated Secret missing, being deleted or changed (a new Service
//     gets a new ClusterIP, a new generated Secret new contents), or found
//     no value at all;
//   - the release is not deployed, so the upgrade may recreate anything;
//   - the chart changes: another chart may derive them differently, and
//     only this provider's chart is known here.
//
// Anything else (replicas, images, other values, drift of other objects)
// keeps them.
func (m *platformModel) accessChanges(ctx context.Context, plan platformModel) (endpoint, ca, token bool) {
	if plan.Values.IsUnknown() || m.Status.ValueString() != statusDeployed || !plan.ChartVersion.Equal(m.ChartVersion) {
		return true, true, true
	}
	before, errBefore := chart.AccessSettingsOf(m.chartValues())
	after, errAfter := chart.AccessSettingsOf(plan.chartValues())
	if errBefore != nil || errAfter != nil {
		// ValidateConfig reports bad values; unknown is the safe plan.
		tflog.Debug(ctx, "cannot tell whether the update changes the Compute API access", map[string]any{
			"state_error": fmt.Sprint(errBefore), "plan_error": fmt.Sprint(errAfter),
		})
		return true, true, true
	}
	ns := m.Namespace.ValueString()
	var drift []string
	for _, d := range m.Drift.Elements() {
		if s, ok := d.(types.String); ok {
			drift = append(drift, s.ValueString())
		}
	}
	drifted := func(kind, name string) bool {
		for _, line := range drift {
			if chart.DriftIsAbout(line, kind, ns, name) {
				return true
			}
		}
		return false
	}
	endpoint = m.APIEndpoint.ValueString() == "" || before.ServicePort != after.ServicePort ||
		drifted("Service", chart.APIService)
	ca = m.CACertificate.ValueString() == "" || before.CASecret != after.CASecret ||
		drifted("Secret", before.CASecret)
	token = m.AdminToken.ValueString() == "" || before.AdminTokenSecret != after.AdminTokenSecret ||
		drifted("Secret", before.AdminTokenSecret)
	return endpoint, ca, token
}

// chartClient returns a client of the cluster, or adds a diagnostic.
func chartClient(ctx context.Context, d *providerData, diags *diag.Diagnostics) *chart.Client {
	if d == nil {
		diags.AddError("Provider not configured", "The agentbox provider was not configured. This is a bug in the provider.")
		return nil
	}
	cfg, err := d.RESTConfig()
	if err != nil {
		diags.AddError("Cannot reach the cluster", err.Error())
		return nil
	}
	c := chart.New(cfg)
	c.Log = func(format string, args ...any) { tflog.Debug(ctx, fmt.Sprintf(format, args...)) }
	return c
}

// afterApply records the release an install or upgrade produced. Every
// object was just applied, so drift now means something removed or
// rewrote objects during the apply, which is worth an error rather than a
// silent repair on the next run.
func (r *platformResource) afterApply(ctx context.Context, rel *chart.Release, m *platformModel, diags *diag.Diagnostics) {
	m.ID = types.StringValue(objectID(rel.Namespace, rel.Name))
	m.Namespace = types.StringValue(rel.Namespace)
	if m.Wait.ValueBool() {
		// So that refreshPlatform's warning reflects the control plane
		// just applied, not its predecessor.
		waitSnapshotCheck(ctx, r.data, rel)
	}
	refreshPlatform(ctx, r.data, rel, m, diags)
	if n := len(m.Drift.Elements()); n > 0 {
		diags.AddError("The agentbox platform differs from its release right after apply",
			fmt.Sprintf("%d objects of release %s are missing or differ from the release although the apply just wrote "+
				"them: %s. Something in the cluster removes or rewrites them; the next apply will try again.",
				n, m.ID.ValueString(), m.Drift))
	}
}

// refreshPlatform sets the computed attributes from rel and the live cluster.
func refreshPlatform(ctx context.Context, data *providerData, rel *chart.Release, m *platformModel, diags *diag.Diagnostics) {
	m.Revision = types.Int64Value(int64(rel.Revision))
	m.Status = types.StringValue(rel.Status)
	m.ChartVersion = types.StringValue(rel.ChartVersion)
	m.APIServiceDNS = types.StringValue(chart.ServiceDNS(rel.Namespace))

	cfg, err := data.RESTConfig()
	if err != nil {
		diags.AddError("Cannot reach the cluster", err.Error())
		return
	}
	clients, err := data.Clients()
	if err != nil {
		diags.AddError("Cannot reach the cluster", err.Error())
		return
	}
	items, err := chart.LiveDrift(ctx, cfg, rel)
	if err != nil {
		diags.AddError("Cannot compare the agentbox platform with the cluster", err.Error())
		return
	}
	drift := make([]string, 0, len(items)+1)
	if rel.Status != statusDeployed {
		drift = append(drift, fmt.Sprintf("release %s/%s is %s: %s", rel.Namespace, rel.Name, rel.Status, rel.Description))
	}
	for _, it := range items {
		drift = append(drift, it.String())
	}
	list, d := types.ListValueFrom(ctx, types.StringType, drift)
	diags.Append(d...)
	m.Drift = list

	access, err := chart.ReadAccess(ctx, clients.Kubernetes, rel)
	if err != nil {
		diags.AddError("Cannot read how to reach the Compute API", err.Error())
		return
	}
	m.APIEndpoint = types.StringValue(access.Endpoint)
	m.CACertificate = types.StringValue(access.CACertificate)
	m.AdminToken = types.StringValue(access.AdminToken)
	m.SnapshotDriver = types.StringValue(rel.SnapshotDriver())
	warnSnapshotCheck(ctx, clients.Kubernetes, rel, diags)
}
