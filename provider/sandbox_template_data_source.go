package provider

import (
	"context"

	"github.com/hashicorp/terraform-plugin-framework/attr"
	"github.com/hashicorp/terraform-plugin-framework/datasource"
	"github.com/hashicorp/terraform-plugin-framework/datasource/schema"
	"github.com/hashicorp/terraform-plugin-framework/types"
	k8stypes "k8s.io/apimachinery/pkg/types"

	agentboxv1alpha1 "github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
)

var (
	_ datasource.DataSource              = (*sandboxTemplateDataSource)(nil)
	_ datasource.DataSourceWithConfigure = (*sandboxTemplateDataSource)(nil)
)

// NewSandboxTemplateDataSource reads a SandboxTemplate.
func NewSandboxTemplateDataSource() datasource.DataSource { return &sandboxTemplateDataSource{} }

type sandboxTemplateDataSource struct{ data *providerData }

type sandboxTemplateDataSourceModel struct {
	sandboxTemplateModel
	Status types.Object `tfsdk:"status"`
}

func (d *sandboxTemplateDataSource) Metadata(_ context.Context, req datasource.MetadataRequest, resp *datasource.MetadataResponse) {
	resp.TypeName = req.ProviderTypeName + "_" + sandboxTemplateTFType
}

func (d *sandboxTemplateDataSource) Schema(ctx context.Context, _ datasource.SchemaRequest, resp *datasource.SchemaResponse) {
	attrs := computedAttributes(resourceAttributes(ctx, NewSandboxTemplateResource(), &resp.Diagnostics),
		[]string{"id", "name", "namespace"}, &resp.Diagnostics)
	attrs["id"] = dataSourceIDAttribute(templateKind)
	attrs["name"] = dataSourceNameAttribute(templateKind)
	attrs["namespace"] = dataSourceNamespaceAttribute(templateKind)
	attrs["status"] = statusAttribute("template", nil, agentboxv1alpha1.ReasonTemplateResolved,
		agentboxv1alpha1.ReasonEgressProxyNotFound, agentboxv1alpha1.ReasonNodePoolNotFound)
	resp.Schema = schema.Schema{
		MarkdownDescription: "Reads a sandbox template (a `SandboxTemplate` object), for example one that another " +
			"configuration or the platform team manages, so that sandboxes can name it and its settings can be used " +
			"elsewhere. Every attribute means what it means on `agentbox_sandbox_template`, with the values the cluster " +
			"holds. A template that does not exist is an error.",
		Attributes: attrs,
	}
}

func (d *sandboxTemplateDataSource) Configure(_ context.Context, req datasource.ConfigureRequest, resp *datasource.ConfigureResponse) {
	d.data = providerDataFrom(req.ProviderData, &resp.Diagnostics)
}

func (d *sandboxTemplateDataSource) Read(ctx context.Context, req datasource.ReadRequest, resp *datasource.ReadResponse) {
	var m sandboxTemplateDataSourceModel
	resp.Diagnostics.Append(req.Config.Get(ctx, &m)...)
	if resp.Diagnostics.HasError() {
		return
	}
	key := k8stypes.NamespacedName{Namespace: resolveNamespace(m.Namespace, d.data), Name: m.Name.ValueString()}
	var obj agentboxv1alpha1.SandboxTemplate
	if !lookup(ctx, d.data, key, &obj, "sandbox template", templateKind, &resp.Diagnostics) {
		return
	}
	m.ID = types.StringValue(objectID(obj.Namespace, obj.Name))
	m.Namespace = types.StringValue(obj.Namespace)
	m.fromSpec(ctx, &obj.Spec, &resp.Diagnostics)
	noStatus := types.ObjectValueMust(map[string]attr.Type{}, map[string]attr.Value{})
	m.Status = withReadyCondition(ctx, noStatus, obj.Status.Conditions, obj.Generation, &resp.Diagnostics)
	resp.Diagnostics.Append(resp.State.Set(ctx, &m)...)
}
