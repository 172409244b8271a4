package provider

import (
	"context"
	"strings"
	"testing"

	"github.com/hashicorp/terraform-plugin-framework/resource"
	"github.com/hashicorp/terraform-plugin-framework/resource/schema"
)

// TestPoolSchemas holds the node and warm pool resources to the rules every
// resource follows: a valid schema, a MarkdownDescription on every
// attribute, and docs that state what the validators enforce.
func TestPoolSchemas(t *testing.T) {
	ctx := context.Background()
	for _, newResource := range []func() resource.Resource{NewNodePoolResource, NewWarmPoolResource} {
		r := newResource()
		var meta resource.MetadataResponse
		r.Metadata(ctx, resource.MetadataRequest{ProviderTypeName: "agentbox"}, &meta)
		var resp resource.SchemaResponse
		r.Schema(ctx, resource.SchemaRequest{}, &resp)
		if resp.Diagnostics.HasError() {
			t.Fatalf("%s: %v", meta.TypeName, resp.Diagnostics)
		}
		if diags := resp.Schema.ValidateImplementation(ctx); diags.HasError() {
			t.Fatalf("%s schema: %v", meta.TypeName, diags)
		}
		if resp.Schema.MarkdownDescription == "" {
			t.Errorf("%s has no MarkdownDescription", meta.TypeName)
		}
		var walk func(prefix string, attrs map[string]schema.Attribute)
		walk = func(prefix string, attrs map[string]schema.Attribute) {
			for name, a := range attrs {
				if a.GetMarkdownDescription() == "" {
					t.Errorf("%s: %s%s has no MarkdownDescription", meta.TypeName, prefix, name)
				}
				switch n := a.(type) {
				case schema.SingleNestedAttribute:
					walk(prefix+name+".", n.Attributes)
				case schema.ListNestedAttribute:
					walk(prefix+name+"[].", n.NestedObject.Attributes)
				}
			}
		}
		walk(meta.TypeName+".", resp.Schema.Attributes)
	}
}

func TestNodePoolModeDocs(t *testing.T) {
	var resp resource.SchemaResponse
	NewNodePoolResource().Schema(context.Background(), resource.SchemaRequest{}, &resp)
	mode := resp.Schema.Attributes["mode"].GetMarkdownDescription()
	for _, m := range nodePoolModes {
		if !strings.Contains(mode, "`"+string(m.name)+"`: "+m.description) {
			t.Errorf("mode's description lacks %s: %s", m.name, mode)
		}
	}
	if sel := resp.Schema.Attributes["node_selector"].GetMarkdownDescription(); !strings.Contains(sel, "Required in `Managed` mode") {
		t.Errorf("node_selector's description does not say when it is required: %s", sel)
	}
	for _, check := range []stringCheck{quantityCheck, labelValueCheck, qualifiedNameCheck} {
		for _, bad := range []string{"-nope-", "a b"} {
			if check.check(bad) == nil {
				t.Errorf("%q passes the check for %s", bad, check.description)
			}
		}
	}
	for check, good := range map[*stringCheck]string{&quantityCheck: "50m", &labelValueCheck: "", &qualifiedNameCheck: "agentbox.dev/sandbox"} {
		if err := check.check(good); err != nil {
			t.Errorf("%q fails the check for %s: %v", good, check.description, err)
		}
	}
}
