package provider

import (
	"context"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/terraform-plugin-framework/attr"
	"github.com/hashicorp/terraform-plugin-framework/datasource"
	"github.com/hashicorp/terraform-plugin-framework/datasource/schema"
	"github.com/hashicorp/terraform-plugin-framework/diag"
	"github.com/hashicorp/terraform-plugin-framework/resource"
	rschema "github.com/hashicorp/terraform-plugin-framework/resource/schema"
	"github.com/hashicorp/terraform-plugin-framework/types"
	apimeta "k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	agentboxv1alpha1 "github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
)

// dataSourceSchemas returns every data source's schema by type name.
func dataSourceSchemas(t *testing.T) map[string]schema.Schema {
	t.Helper()
	ctx := context.Background()
	out := map[string]schema.Schema{}
	for _, newDataSource := range New("test")().DataSources(ctx) {
		ds := newDataSource()
		var meta datasource.MetadataResponse
		ds.Metadata(ctx, datasource.MetadataRequest{ProviderTypeName: "agentbox"}, &meta)
		var resp datasource.SchemaResponse
		ds.Schema(ctx, datasource.SchemaRequest{}, &resp)
		if resp.Diagnostics.HasError() {
			t.Fatalf("%s: %v", meta.TypeName, resp.Diagnostics)
		}
		if diags := resp.Schema.ValidateImplementation(ctx); diags.HasError() {
			t.Fatalf("%s schema: %v", meta.TypeName, diags)
		}
		out[meta.TypeName] = resp.Schema
	}
	return out
}

// TestDataSourceSchemas holds the data sources to the rules of the
// resources' schemas, and checks what deriving them from the resources
// must give: the lookup arguments as the only inputs, no Terraform-only
// settings, no sentences about changing a value, secrets still sensitive.
func TestDataSourceSchemas(t *testing.T) {
	schemas := dataSourceSchemas(t)
	arguments := map[string][]string{
		"agentbox_platform":         {"namespace", "release_name"},
		"agentbox_node_pool":        {"name"},
		"agentbox_sandbox_template": {"name", "namespace"},
		"agentbox_sandbox":          {"name", "namespace"},
	}
	for typeName, want := range arguments {
		s, ok := schemas[typeName]
		if !ok {
			t.Errorf("no data source %s", typeName)
			continue
		}
		if s.MarkdownDescription == "" {
			t.Errorf("%s has no MarkdownDescription", typeName)
		}
		var walk func(prefix string, attrs map[string]schema.Attribute)
		walk = func(prefix string, attrs map[string]schema.Attribute) {
			for name, a := range attrs {
				desc := a.GetMarkdownDescription()
				if desc == "" {
					t.Errorf("%s%s has no MarkdownDescription", prefix, name)
				}
				if strings.Contains(desc, "Changing it") {
					t.Errorf("%s%s talks about changing it: %s", prefix, name, desc)
				}
				if slices.Contains(terraformOnlyAttributes, name) {
					t.Errorf("%s%s is a Terraform-only setting", prefix, name)
				}
				isArgument := prefix == typeName+"." && slices.Contains(want, name)
				if input := a.IsRequired() || a.IsOptional(); input != isArgument {
					t.Errorf("%s%s: required or optional = %v, want %v", prefix, name, input, isArgument)
				}
				switch n := a.(type) {
				case schema.SingleNestedAttribute:
					walk(prefix+name+".", n.Attributes)
				case schema.ListNestedAttribute:
					walk(prefix+name+"[].", n.NestedObject.Attributes)
				}
			}
		}
		walk(typeName+".", s.Attributes)
	}
	if !schemas["agentbox_platform"].Attributes["admin_token"].IsSensitive() {
		t.Error("agentbox_platform.admin_token is not sensitive")
	}
	// The status adds the Ready condition to what the resource reports.
	status := schemas["agentbox_node_pool"].Attributes["status"].(schema.SingleNestedAttribute)
	for _, name := range []string{"nodes", "ready_nodes", "ready", "reason", "message"} {
		if _, ok := status.Attributes[name]; !ok {
			t.Errorf("agentbox_node_pool.status lacks %s", name)
		}
	}
}

// TestDataSourceAttributesFollowResources: every attribute of a resource
// but Terraform's own settings is in its data source, with the same type,
// so the two cannot drift apart. A status may report more.
func TestDataSourceAttributesFollowResources(t *testing.T) {
	ctx := context.Background()
	schemas := dataSourceSchemas(t)
	for typeName, r := range map[string]resource.Resource{
		"agentbox_platform":         NewPlatformResource(),
		"agentbox_node_pool":        NewNodePoolResource(),
		"agentbox_sandbox_template": NewSandboxTemplateResource(),
		"agentbox_sandbox":          NewSandboxResource(),
	} {
		var diags diag.Diagnostics
		res := resourceAttributes(ctx, r, &diags)
		if diags.HasError() {
			t.Fatal(diags)
		}
		ds := schemas[typeName].Attributes
		for name, a := range res {
			if slices.Contains(terraformOnlyAttributes, name) {
				continue
			}
			d, ok := ds[name]
			resStatus, isObject := a.GetType().(types.ObjectType)
			switch {
			case !ok:
				t.Errorf("data source %s lacks %s", typeName, name)
			case name == "status" && isObject:
				got := d.GetType().(types.ObjectType).AttrTypes
				for k, want := range resStatus.AttrTypes {
					if got[k] == nil || !got[k].Equal(want) {
						t.Errorf("%s.status.%s is %v, want %v", typeName, k, got[k], want)
					}
				}
			case !d.GetType().Equal(a.GetType()):
				t.Errorf("%s.%s is %v in the data source, %v in the resource", typeName, name, d.GetType(), a.GetType())
			}
		}
	}
}

func TestComputedAttribute(t *testing.T) {
	var diags diag.Diagnostics
	a := computedAttribute("agent_id", rschema.StringAttribute{
		Required: true, Sensitive: true,
		MarkdownDescription: "The agent. Must be a name. Changing it replaces the sandbox. Read by the API.",
	}, &diags)
	if diags.HasError() {
		t.Fatal(diags)
	}
	if !a.IsComputed() || a.IsRequired() || !a.IsSensitive() {
		t.Errorf("computed %v, required %v, sensitive %v; want computed and sensitive only", a.IsComputed(), a.IsRequired(), a.IsSensitive())
	}
	if got, want := a.GetMarkdownDescription(), "The agent. Must be a name. Read by the API."; got != want {
		t.Errorf("description %q, want %q", got, want)
	}
	computedAttribute("mapping", rschema.MapNestedAttribute{MarkdownDescription: "x"}, &diags)
	if !diags.HasError() {
		t.Error("an attribute type without a counterpart gives no error")
	}
}

func TestWithReadyCondition(t *testing.T) {
	ctx := context.Background()
	base := types.ObjectValueMust(map[string]attr.Type{"nodes": types.Int64Type}, map[string]attr.Value{"nodes": types.Int64Value(2)})
	var conds []metav1.Condition
	read := func(generation int64) map[string]attr.Value {
		t.Helper()
		var diags diag.Diagnostics
		o := withReadyCondition(ctx, base, conds, generation, &diags)
		if diags.HasError() {
			t.Fatal(diags)
		}
		return o.Attributes()
	}
	got := read(1)
	if !got["ready"].Equal(types.BoolValue(false)) || !got["reason"].IsNull() || !got["message"].IsNull() || !got["nodes"].Equal(types.Int64Value(2)) {
		t.Errorf("without a condition: %v", got)
	}
	apimeta.SetStatusCondition(&conds, metav1.Condition{Type: agentboxv1alpha1.ConditionReady, Status: metav1.ConditionTrue,
		Reason: agentboxv1alpha1.ReasonNodesReady, Message: "1 of 1 nodes ready", ObservedGeneration: 2})
	got = read(2)
	if !got["ready"].Equal(types.BoolValue(true)) || !got["reason"].Equal(types.StringValue("NodesReady")) ||
		!got["message"].Equal(types.StringValue("1 of 1 nodes ready")) {
		t.Errorf("with a current condition: %v", got)
	}
	if got = read(3); !got["ready"].Equal(types.BoolValue(false)) || !got["reason"].Equal(types.StringValue("NodesReady")) {
		t.Errorf("a condition about an older spec counts as ready: %v", got)
	}
}

func TestSandboxStatus(t *testing.T) {
	ctx := context.Background()
	at := metav1.NewTime(time.Date(2026, 1, 2, 3, 4, 5, 0, time.FixedZone("CET", 3600)))
	s := agentboxv1alpha1.SandboxStatus{
		Phase: agentboxv1alpha1.SandboxPhaseStopped, LastActivityTime: &at,
		Snapshot:   &agentboxv1alpha1.SandboxSnapshot{Name: "snap-1", SizeBytes: 4096, ReadyTime: &at},
		Conditions: []metav1.Condition{{Type: agentboxv1alpha1.ConditionLeased, Status: metav1.ConditionTrue, Reason: "Held"}},
	}
	var diags diag.Diagnostics
	o := sandboxStatus(ctx, &s, &diags)
	if diags.HasError() {
		t.Fatal(diags)
	}
	got := o.Attributes()
	want := map[string]attr.Value{
		"phase": types.StringValue("Stopped"), "leased": types.BoolValue(true), "pod_name": types.StringNull(),
		"pod_ip": types.StringNull(), "service_endpoint": types.StringNull(), "last_activity_time": types.StringValue("2026-01-02T02:04:05Z"),
		"snapshot": types.ObjectValueMust(sandboxSnapshotAttrTypes, map[string]attr.Value{
			"name": types.StringValue("snap-1"), "size_bytes": types.Int64Value(4096), "ready_time": types.StringValue("2026-01-02T02:04:05Z"),
		}),
	}
	for k, v := range want {
		if !got[k].Equal(v) {
			t.Errorf("%s = %v, want %v", k, got[k], v)
		}
	}
	empty := sandboxStatus(ctx, &agentboxv1alpha1.SandboxStatus{}, &diags).Attributes()
	if !empty["phase"].IsNull() || !empty["snapshot"].IsNull() || !empty["last_activity_time"].IsNull() || !empty["leased"].Equal(types.BoolValue(false)) {
		t.Errorf("status of a sandbox the control plane has not seen: %v", empty)
	}
}
