package provider

import (
	"context"
	"errors"
	"fmt"

	"github.com/hashicorp/terraform-plugin-framework/datasource"
	"github.com/hashicorp/terraform-plugin-framework/datasource/schema"
	"github.com/hashicorp/terraform-plugin-framework/path"
	"github.com/hashicorp/terraform-plugin-framework/schema/validator"
	"github.com/hashicorp/terraform-plugin-framework/types"

	"github.com/agentbox/terraform-provider-agentbox/internal/chart"
)

var (
	_ datasource.DataSource              = (*platformDataSource)(nil)
	_ datasource.DataSourceWithConfigure = (*platformDataSource)(nil)
)

// NewPlatformDataSource reads a Helm release of the embedded chart.
func NewPlatformDataSource() datasource.DataSource { return &platformDataSource{} }

type platformDataSource struct{ data *providerData }

// platformDataSourceModel is platformModel without what only says how
// Terraform applies the release (wait, timeouts). It cannot embed a shared
// part of platformModel, whose tests build it from a literal.
type platformDataSourceModel struct {
	ID              types.String `tfsdk:"id"`
	Namespace       types.String `tfsdk:"namespace"`
	ReleaseName     types.String `tfsdk:"release_name"`
	ChartVersion    types.String `tfsdk:"chart_version"`
	ImageTag        types.String `tfsdk:"image_tag"`
	ImageRegistry   types.String `tfsdk:"image_registry"`
	ImagePullPolicy types.String `tfsdk:"image_pull_policy"`
	Replicas        types.Int64  `tfsdk:"replicas"`
	// SandboxNamespaces are the namespaces served besides Namespace.
	SandboxNamespaces types.Set    `tfsdk:"sandbox_namespaces"`
	Values            types.String `tfsdk:"values"`
	Revision          types.Int64  `tfsdk:"revision"`
	Status            types.String `tfsdk:"status"`
	APIEndpoint       types.String `tfsdk:"api_endpoint"`
	APIServiceDNS     types.String `tfsdk:"api_service_dns"`
	CACertificate     types.String `tfsdk:"ca_certificate"`
	AdminToken        types.String `tfsdk:"admin_token"`
	Drift             types.List   `tfsdk:"drift"`
	SnapshotDriver    types.String `tfsdk:"snapshot_driver"`
}

func (d *platformDataSource) Metadata(_ context.Context, req datasource.MetadataRequest, resp *datasource.MetadataResponse) {
	resp.TypeName = req.ProviderTypeName + "_platform"
}

func (d *platformDataSource) Schema(ctx context.Context, _ datasource.SchemaRequest, resp *datasource.SchemaResponse) {
	// What the release reports (revision, status, how to reach the Compute
	// API) is taken from the resource; what configures the release is
	// described here as what was found, since nothing is configured.
	attrs := computedAttributes(resourceAttributes(ctx, NewPlatformResource(), &resp.Diagnostics),
		[]string{"id", "namespace", "release_name", "chart_version", "image_tag", "image_registry", "image_pull_policy",
			"replicas", "sandbox_namespaces", "values", "drift"}, &resp.Diagnostics)
	computed := func(desc string) schema.StringAttribute {
		return schema.StringAttribute{Computed: true, MarkdownDescription: desc}
	}
	attrs["id"] = computed("`<namespace>/<release_name>`.")
	attrs["namespace"] = schema.StringAttribute{
		Optional: true, Computed: true,
		MarkdownDescription: "Namespace of the release and the control plane. Defaults to the provider's `namespace`. " +
			"Must be " + namespaceCheck.description + ".",
		Validators: []validator.String{namespaceCheck},
	}
	attrs["release_name"] = schema.StringAttribute{
		Optional: true, Computed: true,
		MarkdownDescription: "Name of the Helm release. Defaults to `" + chart.DefaultReleaseName + "`. Must be " +
			releaseNameCheck.description + ".",
		Validators: []validator.String{releaseNameCheck},
	}
	attrs["chart_version"] = computed("Version of the agentbox chart the release runs.")
	attrs["image_tag"] = computed("Tag of the platform images (control plane, sandbox, supervisor, egress proxy) the release runs.")
	attrs["image_registry"] = computed("Registry and path in front of the platform images' repositories; null means Docker Hub.")
	attrs["image_pull_policy"] = computed("Pull policy of the platform images; null means the chart's `IfNotPresent`.")
	attrs["replicas"] = schema.Int64Attribute{Computed: true, MarkdownDescription: "Control plane replicas."}
	attrs["sandbox_namespaces"] = schema.SetAttribute{
		Computed: true, ElementType: types.StringType,
		MarkdownDescription: "Namespaces, besides `namespace` (always served), whose sandboxes, warm pools and egress proxies " +
			"the platform runs; objects elsewhere that no other platform serves get the reason `NamespaceNotServed`. Null means `namespace` only.",
	}
	attrs["values"] = computed("The release's other chart values, as YAML: those that `image_tag`, `image_registry`, " +
		"`image_pull_policy`, `replicas` and `sandbox_namespaces` do not describe. Null when there are none.")
	attrs["drift"] = schema.ListAttribute{
		Computed: true, ElementType: types.StringType,
		MarkdownDescription: "What is wrong with the release in the cluster: objects of the release that are missing or " +
			"being deleted, and a release status other than `deployed`. Empty when all is well; an apply of the " +
			"`agentbox_platform` that manages the release repairs it.",
	}
	resp.Schema = schema.Schema{
		MarkdownDescription: "Reads an installed agentbox platform (a Helm release of the `agentbox` chart): its version " +
			"and settings, whether it is healthy, and how to reach its Compute API (endpoint, CA certificate and admin " +
			"token). Use it in configurations that use a platform installed elsewhere, by another configuration or with " +
			"`helm install`. A release that does not exist is an error.",
		Attributes: attrs,
	}
}

func (d *platformDataSource) Configure(_ context.Context, req datasource.ConfigureRequest, resp *datasource.ConfigureResponse) {
	d.data = providerDataFrom(req.ProviderData, &resp.Diagnostics)
}

func (d *platformDataSource) Read(ctx context.Context, req datasource.ReadRequest, resp *datasource.ReadResponse) {
	var cfg platformDataSourceModel
	resp.Diagnostics.Append(req.Config.Get(ctx, &cfg)...)
	c := chartClient(ctx, d.data, &resp.Diagnostics)
	if resp.Diagnostics.HasError() {
		return
	}
	ns, name := resolveNamespace(cfg.Namespace, d.data), cfg.ReleaseName.ValueString()
	if name == "" {
		name = chart.DefaultReleaseName
	}
	rel, err := c.Status(ctx, ns, name)
	if errors.Is(err, chart.ErrNotFound) {
		notFoundError(&resp.Diagnostics, path.Root("release_name"), "platform release", objectID(ns, name),
			fmt.Sprintf("There is no Helm release %q in namespace %q: install the platform there with agentbox_platform "+
				"or the agentbox chart, or set namespace and release_name to where it is.", name, ns))
		return
	}
	if err != nil {
		resp.Diagnostics.AddError("Cannot read the agentbox platform release", err.Error())
		return
	}
	// A null image_tag makes fromReleaseConfig describe the release's values
	// with the attributes, as after an import.
	m := platformModel{ID: types.StringValue(objectID(rel.Namespace, rel.Name)), Namespace: types.StringValue(rel.Namespace),
		ReleaseName: types.StringValue(rel.Name), ImageTag: types.StringNull()}
	m.fromReleaseConfig(rel, &resp.Diagnostics)
	refreshPlatform(ctx, d.data, rel, &m, &resp.Diagnostics)
	if resp.Diagnostics.HasError() {
		return
	}
	resp.Diagnostics.Append(resp.State.Set(ctx, &platformDataSourceModel{
		ID: m.ID, Namespace: m.Namespace, ReleaseName: m.ReleaseName, ChartVersion: m.ChartVersion,
		ImageTag: m.ImageTag, ImageRegistry: m.ImageRegistry, ImagePullPolicy: m.ImagePullPolicy, Replicas: m.Replicas,
		SandboxNamespaces: m.SandboxNamespaces, Values: m.Values, Revision: m.Revision, Status: m.Status, APIEndpoint: m.APIEndpoint, APIServiceDNS: m.APIServiceDNS,
		CACertificate: m.CACertificate, AdminToken: m.AdminToken, Drift: m.Drift, SnapshotDriver: m.SnapshotDriver,
	})...)
}
