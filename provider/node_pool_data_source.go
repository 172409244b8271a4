package provider

import (
	"context"

	"github.com/hashicorp/terraform-plugin-framework/datasource"
	"github.com/hashicorp/terraform-plugin-framework/datasource/schema"
	rschema "github.com/hashicorp/terraform-plugin-framework/resource/schema"
	"github.com/hashicorp/terraform-plugin-framework/schema/validator"
	"github.com/hashicorp/terraform-plugin-framework/types"
	k8stypes "k8s.io/apimachinery/pkg/types"

	agentboxv1alpha1 "github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
)

var (
	_ datasource.DataSource              = (*nodePoolDataSource)(nil)
	_ datasource.DataSourceWithConfigure = (*nodePoolDataSource)(nil)
)

// NewNodePoolDataSource reads a GVisorNodePool.
func NewNodePoolDataSource() datasource.DataSource { return &nodePoolDataSource{} }

type nodePoolDataSource struct{ data *providerData }

type nodePoolDataSourceModel struct {
	nodePoolObjectModel
	Status types.Object `tfsdk:"status"`
}

func (d *nodePoolDataSource) Metadata(_ context.Context, req datasource.MetadataRequest, resp *datasource.MetadataResponse) {
	resp.TypeName = req.ProviderTypeName + "_" + nodePoolTFType
}

func (d *nodePoolDataSource) Schema(ctx context.Context, _ datasource.SchemaRequest, resp *datasource.SchemaResponse) {
	res := resourceAttributes(ctx, NewNodePoolResource(), &resp.Diagnostics)
	attrs := computedAttributes(res, []string{"id", "name", "status"}, &resp.Diagnostics)
	attrs["id"] = schema.StringAttribute{
		Computed: true, MarkdownDescription: "Name of the " + nodePoolKind + ", which is cluster-scoped.",
	}
	attrs["name"] = schema.StringAttribute{
		Required: true,
		MarkdownDescription: "Name of the " + nodePoolKind + " to read; node pools are cluster-scoped, so there is no " +
			"namespace. Must be " + dnsSubdomainCheck.description + ".",
		Validators: []validator.String{dnsSubdomainCheck},
	}
	var status map[string]schema.Attribute
	if s, ok := res["status"].(rschema.SingleNestedAttribute); ok {
		status = computedAttributes(s.Attributes, nil, &resp.Diagnostics)
	} else {
		resp.Diagnostics.AddError("Cannot build the data source schema",
			"agentbox_node_pool has no nested status attribute. This is a bug in the provider.")
	}
	attrs["status"] = statusAttribute("node pool", status, agentboxv1alpha1.ReasonNodesReady, agentboxv1alpha1.ReasonInstalling,
		agentboxv1alpha1.ReasonNoMatchingNodes, agentboxv1alpha1.ReasonRuntimeClassNotFound)
	resp.Schema = schema.Schema{
		MarkdownDescription: "Reads a gVisor node pool (a cluster-scoped `GVisorNodePool` object): its settings, as on " +
			"`agentbox_node_pool`, and which nodes it selects and whether they can run sandboxes. Use it to name in " +
			"`node_pool` of a template a pool that another configuration manages. A pool that does not exist is an error.",
		Attributes: attrs,
	}
}

func (d *nodePoolDataSource) Configure(_ context.Context, req datasource.ConfigureRequest, resp *datasource.ConfigureResponse) {
	d.data = providerDataFrom(req.ProviderData, &resp.Diagnostics)
}

func (d *nodePoolDataSource) Read(ctx context.Context, req datasource.ReadRequest, resp *datasource.ReadResponse) {
	var m nodePoolDataSourceModel
	resp.Diagnostics.Append(req.Config.Get(ctx, &m)...)
	if resp.Diagnostics.HasError() {
		return
	}
	var obj agentboxv1alpha1.GVisorNodePool
	if !lookup(ctx, d.data, k8stypes.NamespacedName{Name: m.Name.ValueString()}, &obj, "node pool", nodePoolKind, &resp.Diagnostics) {
		return
	}
	m.ID = types.StringValue(obj.Name)
	m.fromSpec(ctx, &obj.Spec, &resp.Diagnostics)
	m.Status = withReadyCondition(ctx, nodePoolStatus(ctx, &obj.Status, &resp.Diagnostics), obj.Status.Conditions, obj.Generation, &resp.Diagnostics)
	resp.Diagnostics.Append(resp.State.Set(ctx, &m)...)
}
