package provider

import (
	"context"
	"fmt"
	"strings"

	"github.com/hashicorp/terraform-plugin-framework/diag"
	"github.com/hashicorp/terraform-plugin-framework/path"
	"github.com/hashicorp/terraform-plugin-framework/resource"
	"github.com/hashicorp/terraform-plugin-framework/tfsdk"
	"github.com/hashicorp/terraform-plugin-framework/types"
	"github.com/hashicorp/terraform-plugin-framework/types/basetypes"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	k8stypes "k8s.io/apimachinery/pkg/types"
)

// The Terraform IDs and namespaces of the namespaced objects the provider
// manages: "<namespace>/<name>", with the provider's namespace where the
// configuration names none.

// objectID is the Terraform ID of a namespaced object: "<namespace>/<name>".
func objectID(namespace, name string) string { return namespace + "/" + name }

// parseImportID accepts "<namespace>/<name>" or, for objects in the
// provider's default namespace, "<name>".
func parseImportID(id, defaultNamespace string) (k8stypes.NamespacedName, error) {
	parts := strings.Split(id, "/")
	switch {
	case len(parts) == 1 && parts[0] != "" && defaultNamespace != "":
		return k8stypes.NamespacedName{Namespace: defaultNamespace, Name: parts[0]}, nil
	case len(parts) == 2 && parts[0] != "" && parts[1] != "":
		return k8stypes.NamespacedName{Namespace: parts[0], Name: parts[1]}, nil
	}
	return k8stypes.NamespacedName{}, fmt.Errorf("import ID %q is not \"<namespace>/<name>\" or \"<name>\"", id)
}

// importObject sets the identifying attributes of an imported object; Read
// fills in the rest.
func importObject(ctx context.Context, d *providerData, req resource.ImportStateRequest, resp *resource.ImportStateResponse) {
	ns := ""
	if d != nil {
		ns, _ = d.Namespace()
	}
	key, err := parseImportID(req.ID, ns)
	if err != nil {
		resp.Diagnostics.AddError("Invalid import ID", err.Error())
		return
	}
	resp.Diagnostics.Append(resp.State.SetAttribute(ctx, path.Root("id"), objectID(key.Namespace, key.Name))...)
	resp.Diagnostics.Append(resp.State.SetAttribute(ctx, path.Root("namespace"), key.Namespace)...)
	resp.Diagnostics.Append(resp.State.SetAttribute(ctx, path.Root("name"), key.Name)...)
}

// objectKey names the namespaced object that a plan or state describes.
func objectKey(namespace, name types.String) k8stypes.NamespacedName {
	return k8stypes.NamespacedName{Namespace: namespace.ValueString(), Name: name.ValueString()}
}

// namedObjectMeta is objectKey as object metadata, for a Delete.
func namedObjectMeta(namespace, name types.String) metav1.ObjectMeta {
	return metav1.ObjectMeta{Namespace: namespace.ValueString(), Name: name.ValueString()}
}

// resolveNamespace picks the configured namespace or the provider's default.
func resolveNamespace(v types.String, d *providerData) string {
	if !v.IsNull() && !v.IsUnknown() && v.ValueString() != "" {
		return v.ValueString()
	}
	ns, _ := d.Namespace()
	return ns
}

// defaultNamespace plans the provider's namespace for a resource whose
// configuration names none. It belongs in ModifyPlan: only the resource
// instance serving a request is configured, and plan modifiers in a schema
// may come from another instance that never sees the provider's settings.
func defaultNamespace(ctx context.Context, d *providerData, config tfsdk.Config, planned *types.String, diags *diag.Diagnostics) {
	if !planned.IsUnknown() || d == nil {
		return
	}
	var configured basetypes.StringValue
	diags.Append(config.GetAttribute(ctx, path.Root("namespace"), &configured)...)
	if !configured.IsNull() {
		return
	}
	if ns, ok := d.Namespace(); ok {
		*planned = basetypes.NewStringValue(ns)
	}
}

// planObjectID plans the namespace and, with it, the ID of a resource that
// wraps one namespaced object, so plans show where the object will live.
func planObjectID(ctx context.Context, d *providerData, req resource.ModifyPlanRequest, resp *resource.ModifyPlanResponse) {
	if req.Plan.Raw.IsNull() {
		return
	}
	var ns, name basetypes.StringValue
	resp.Diagnostics.Append(req.Plan.GetAttribute(ctx, path.Root("namespace"), &ns)...)
	resp.Diagnostics.Append(req.Plan.GetAttribute(ctx, path.Root("name"), &name)...)
	defaultNamespace(ctx, d, req.Config, &ns, &resp.Diagnostics)
	if resp.Diagnostics.HasError() {
		return
	}
	resp.Diagnostics.Append(resp.Plan.SetAttribute(ctx, path.Root("namespace"), ns)...)
	if !ns.IsUnknown() && !name.IsUnknown() {
		resp.Diagnostics.Append(resp.Plan.SetAttribute(ctx, path.Root("id"), objectID(ns.ValueString(), name.ValueString()))...)
	}
}
