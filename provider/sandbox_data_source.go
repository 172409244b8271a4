package provider

import (
	"context"
	"time"

	"github.com/hashicorp/terraform-plugin-framework/attr"
	"github.com/hashicorp/terraform-plugin-framework/datasource"
	"github.com/hashicorp/terraform-plugin-framework/datasource/schema"
	"github.com/hashicorp/terraform-plugin-framework/diag"
	"github.com/hashicorp/terraform-plugin-framework/types"
	apimeta "k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	k8stypes "k8s.io/apimachinery/pkg/types"

	agentboxv1alpha1 "github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
)

var (
	_ datasource.DataSource              = (*sandboxDataSource)(nil)
	_ datasource.DataSourceWithConfigure = (*sandboxDataSource)(nil)
)

// NewSandboxDataSource reads one agent's Sandbox.
func NewSandboxDataSource() datasource.DataSource { return &sandboxDataSource{} }

type sandboxDataSource struct{ data *providerData }

type sandboxDataSourceModel struct {
	sandboxObjectModel
	Status types.Object `tfsdk:"status"`
}

type sandboxStatusModel struct {
	Phase            types.String `tfsdk:"phase"`
	Leased           types.Bool   `tfsdk:"leased"`
	PodName          types.String `tfsdk:"pod_name"`
	PodIP            types.String `tfsdk:"pod_ip"`
	ServiceEndpoint  types.String `tfsdk:"service_endpoint"`
	LastActivityTime types.String `tfsdk:"last_activity_time"`
	Snapshot         types.Object `tfsdk:"snapshot"`
}

type sandboxSnapshotModel struct {
	Name      types.String `tfsdk:"name"`
	SizeBytes types.Int64  `tfsdk:"size_bytes"`
	ReadyTime types.String `tfsdk:"ready_time"`
}

var (
	sandboxSnapshotAttrTypes = map[string]attr.Type{"name": types.StringType, "size_bytes": types.Int64Type, "ready_time": types.StringType}
	sandboxStatusAttrTypes   = map[string]attr.Type{
		"phase": types.StringType, "leased": types.BoolType, "pod_name": types.StringType, "pod_ip": types.StringType,
		"service_endpoint": types.StringType, "last_activity_time": types.StringType,
		"snapshot": types.ObjectType{AttrTypes: sandboxSnapshotAttrTypes},
	}
	sandboxPhases = []string{
		string(agentboxv1alpha1.SandboxPhasePending), string(agentboxv1alpha1.SandboxPhaseRunning),
		string(agentboxv1alpha1.SandboxPhaseIdleStopping), string(agentboxv1alpha1.SandboxPhaseStopped),
		string(agentboxv1alpha1.SandboxPhaseResuming), string(agentboxv1alpha1.SandboxPhaseError),
	}
)

func (d *sandboxDataSource) Metadata(_ context.Context, req datasource.MetadataRequest, resp *datasource.MetadataResponse) {
	resp.TypeName = req.ProviderTypeName + "_sandbox"
}

func (d *sandboxDataSource) Schema(ctx context.Context, _ datasource.SchemaRequest, resp *datasource.SchemaResponse) {
	attrs := computedAttributes(resourceAttributes(ctx, NewSandboxResource(), &resp.Diagnostics),
		[]string{"id", "name", "namespace"}, &resp.Diagnostics)
	attrs["id"] = dataSourceIDAttribute(sandboxKind)
	attrs["name"] = dataSourceNameAttribute(sandboxKind)
	attrs["namespace"] = dataSourceNamespaceAttribute(sandboxKind)
	timestamp := func(desc, nullWhen string) schema.StringAttribute {
		return schema.StringAttribute{Computed: true, MarkdownDescription: desc + ", in RFC 3339 (UTC); null " + nullWhen + "."}
	}
	attrs["status"] = statusAttribute("sandbox", map[string]schema.Attribute{
		"phase": schema.StringAttribute{
			Computed: true,
			MarkdownDescription: "Where the sandbox is in its lifecycle: " + codeAlternatives(sandboxPhases) + ". The Ready " +
				"condition's `reason` says why. Null before the control plane has seen the sandbox.",
		},
		"leased": schema.BoolAttribute{
			Computed:            true,
			MarkdownDescription: "Whether someone holds the sandbox's exclusive lease (its Leased condition is `True`).",
		},
		"pod_name": schema.StringAttribute{
			Computed: true, MarkdownDescription: "The sandbox's current pod; null while none exists, e.g. when stopped.",
		},
		"pod_ip": schema.StringAttribute{
			Computed: true, MarkdownDescription: "IP address of the current pod; null while none exists.",
		},
		"service_endpoint": schema.StringAttribute{
			Computed: true,
			MarkdownDescription: "URL of the sandbox's supervisor, `https://<pod_ip>:8443`; null while no pod runs. Its " +
				"certificate names the sandbox, not the IP, and chains to the platform's `ca_certificate`.",
		},
		"last_activity_time": timestamp("When the control plane last saw API activity, from which idleness is measured", "before the first"),
		"snapshot": schema.SingleNestedAttribute{
			Computed: true,
			MarkdownDescription: "The latest good snapshot of the workspace, which a stopped sandbox resumes from; " +
				"null while there is none.",
			Attributes: map[string]schema.Attribute{
				"name": schema.StringAttribute{
					Computed: true,
					MarkdownDescription: "Name of the snapshot: a VolumeSnapshot in the sandbox's namespace, or the archive's " +
						"key when the platform uses the archive snapshot driver.",
				},
				"size_bytes": schema.Int64Attribute{
					Computed: true, MarkdownDescription: "Size of the snapshot as far as it is known; `0` when the storage does not report it.",
				},
				"ready_time": timestamp("When the snapshot became ready to restore from", "if not recorded"),
			},
		},
	}, agentboxv1alpha1.ReasonRunning, agentboxv1alpha1.ReasonCreating, agentboxv1alpha1.ReasonStopped, agentboxv1alpha1.ReasonPodFailed)
	resp.Schema = schema.Schema{
		MarkdownDescription: "Reads one agent's sandbox (a `Sandbox` object): its settings, as on `agentbox_sandbox`, and " +
			"what the control plane reports about it, such as its phase and its supervisor's endpoint. A sandbox that " +
			"does not exist is an error.",
		Attributes: attrs,
	}
}

func (d *sandboxDataSource) Configure(_ context.Context, req datasource.ConfigureRequest, resp *datasource.ConfigureResponse) {
	d.data = providerDataFrom(req.ProviderData, &resp.Diagnostics)
}

func (d *sandboxDataSource) Read(ctx context.Context, req datasource.ReadRequest, resp *datasource.ReadResponse) {
	var m sandboxDataSourceModel
	resp.Diagnostics.Append(req.Config.Get(ctx, &m)...)
	if resp.Diagnostics.HasError() {
		return
	}
	key := k8stypes.NamespacedName{Namespace: resolveNamespace(m.Namespace, d.data), Name: m.Name.ValueString()}
	var obj agentboxv1alpha1.Sandbox
	if !lookup(ctx, d.data, key, &obj, "sandbox", sandboxKind, &resp.Diagnostics) {
		return
	}
	m.ID = types.StringValue(objectID(obj.Namespace, obj.Name))
	m.Namespace = types.StringValue(obj.Namespace)
	m.fromSpec(&obj.Spec)
	m.Status = withReadyCondition(ctx, sandboxStatus(ctx, &obj.Status, &resp.Diagnostics), obj.Status.Conditions, obj.Generation, &resp.Diagnostics)
	resp.Diagnostics.Append(resp.State.Set(ctx, &m)...)
}

func sandboxStatus(ctx context.Context, s *agentboxv1alpha1.SandboxStatus, diags *diag.Diagnostics) types.Object {
	st := sandboxStatusModel{
		Phase:            stringOrNull(string(s.Phase)),
		Leased:           types.BoolValue(apimeta.IsStatusConditionTrue(s.Conditions, agentboxv1alpha1.ConditionLeased)),
		PodName:          stringOrNull(s.PodName),
		PodIP:            stringOrNull(s.PodIP),
		ServiceEndpoint:  stringOrNull(s.ServiceEndpoint),
		LastActivityTime: timeValue(s.LastActivityTime),
		Snapshot:         types.ObjectNull(sandboxSnapshotAttrTypes),
	}
	if snap := s.Snapshot; snap != nil {
		st.Snapshot = objectValue(ctx, sandboxSnapshotAttrTypes, sandboxSnapshotModel{
			Name: types.StringValue(snap.Name), SizeBytes: types.Int64Value(snap.SizeBytes), ReadyTime: timeValue(snap.ReadyTime),
		}, diags)
	}
	return objectValue(ctx, sandboxStatusAttrTypes, st, diags)
}

func timeValue(t *metav1.Time) types.String {
	if t == nil || t.IsZero() {
		return types.StringNull()
	}
	return types.StringValue(t.UTC().Format(time.RFC3339))
}
