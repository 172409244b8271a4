package provider

import (
	"context"
	"fmt"
	"maps"
	"regexp"
	"slices"

	"github.com/hashicorp/terraform-plugin-framework/attr"
	"github.com/hashicorp/terraform-plugin-framework/datasource/schema"
	"github.com/hashicorp/terraform-plugin-framework/diag"
	"github.com/hashicorp/terraform-plugin-framework/path"
	"github.com/hashicorp/terraform-plugin-framework/resource"
	rschema "github.com/hashicorp/terraform-plugin-framework/resource/schema"
	"github.com/hashicorp/terraform-plugin-framework/schema/validator"
	"github.com/hashicorp/terraform-plugin-framework/types"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	apimeta "k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	k8stypes "k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"

	agentboxv1alpha1 "github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
)

// Shared by the agentbox_* data sources. Each reads the object its resource
// manages, and its schema is derived from the resource's, so that an
// attribute means the same in both and its documentation cannot drift. What
// a data source adds itself is the lookup arguments and the status.

// terraformOnlyAttributes say how Terraform manages an object, not what the
// object is, so data sources leave them out.
var terraformOnlyAttributes = []string{"wait", "wait_for_ready", "timeouts"}

// changingSentence is where a resource's description says what changing the
// attribute does, which means nothing to a data source.
var changingSentence = regexp.MustCompile(`\s*Changing it [^.]*\.`)

// computedAttributes returns the data source counterparts of a resource's
// attributes: the same types, descriptions and sensitivity, all computed.
// It leaves out terraformOnlyAttributes and the names in omit, which the
// data source defines itself.
func computedAttributes(attrs map[string]rschema.Attribute, omit []string, diags *diag.Diagnostics) map[string]schema.Attribute {
	out := make(map[string]schema.Attribute, len(attrs))
	for name, a := range attrs {
		if slices.Contains(omit, name) || slices.Contains(terraformOnlyAttributes, name) {
			continue
		}
		out[name] = computedAttribute(name, a, diags)
	}
	return out
}

func computedAttribute(name string, a rschema.Attribute, diags *diag.Diagnostics) schema.Attribute {
	desc := changingSentence.ReplaceAllString(a.GetMarkdownDescription(), "")
	switch a := a.(type) {
	case rschema.StringAttribute:
		return schema.StringAttribute{Computed: true, Sensitive: a.Sensitive, MarkdownDescription: desc}
	case rschema.BoolAttribute:
		return schema.BoolAttribute{Computed: true, Sensitive: a.Sensitive, MarkdownDescription: desc}
	case rschema.Int64Attribute:
		return schema.Int64Attribute{Computed: true, Sensitive: a.Sensitive, MarkdownDescription: desc}
	case rschema.MapAttribute:
		return schema.MapAttribute{ElementType: a.ElementType, Computed: true, Sensitive: a.Sensitive, MarkdownDescription: desc}
	case rschema.ListAttribute:
		return schema.ListAttribute{ElementType: a.ElementType, Computed: true, Sensitive: a.Sensitive, MarkdownDescription: desc}
	case rschema.SetAttribute:
		return schema.SetAttribute{ElementType: a.ElementType, Computed: true, Sensitive: a.Sensitive, MarkdownDescription: desc}
	case rschema.SingleNestedAttribute:
		return schema.SingleNestedAttribute{
			Attributes: computedAttributes(a.Attributes, nil, diags), Computed: true, Sensitive: a.Sensitive, MarkdownDescription: desc,
		}
	case rschema.ListNestedAttribute:
		return schema.ListNestedAttribute{
			NestedObject: schema.NestedAttributeObject{Attributes: computedAttributes(a.NestedObject.Attributes, nil, diags)},
			Computed:     true, Sensitive: a.Sensitive, MarkdownDescription: desc,
		}
	}
	diags.AddError("Cannot build the data source schema",
		fmt.Sprintf("attribute %q is a %T, which has no data source counterpart here. This is a bug in the provider.", name, a))
	return schema.StringAttribute{Computed: true, MarkdownDescription: desc}
}

// resourceAttributes returns the schema attributes of a resource.
func resourceAttributes(ctx context.Context, r resource.Resource, diags *diag.Diagnostics) map[string]rschema.Attribute {
	var resp resource.SchemaResponse
	r.Schema(ctx, resource.SchemaRequest{}, &resp)
	diags.Append(resp.Diagnostics...)
	return resp.Schema.Attributes
}

func dataSourceIDAttribute(kind string) schema.StringAttribute {
	return schema.StringAttribute{Computed: true, MarkdownDescription: "`<namespace>/<name>` of the " + kind + "."}
}

func dataSourceNameAttribute(kind string) schema.StringAttribute {
	return schema.StringAttribute{
		Required:            true,
		MarkdownDescription: "Name of the " + kind + " to read. Must be " + dnsSubdomainCheck.description + ".",
		Validators:          []validator.String{dnsSubdomainCheck},
	}
}

func dataSourceNamespaceAttribute(kind string) schema.StringAttribute {
	return schema.StringAttribute{
		Optional: true, Computed: true,
		MarkdownDescription: "Namespace of the " + kind + ". Defaults to the provider's `namespace`.",
		Validators:          []validator.String{namespaceCheck},
	}
}

// lookup reads the object key names into obj. A missing object is an
// error, not an empty result: a configuration that reads an object depends
// on it, and an empty result would only fail later and less clearly.
func lookup(ctx context.Context, d *providerData, key k8stypes.NamespacedName, obj client.Object, noun, kind string, diags *diag.Diagnostics) bool {
	c := objectsOrDiag(d, diags)
	if diags.HasError() {
		return false
	}
	err := c.Get(ctx, key, obj)
	switch {
	case err == nil:
		return true
	case apierrors.IsNotFound(err):
		id, where := key.Name, "in the cluster"
		if key.Namespace != "" {
			id, where = objectID(key.Namespace, key.Name), fmt.Sprintf("in namespace %q", key.Namespace)
		}
		notFoundError(diags, path.Root("name"), noun, id, fmt.Sprintf("There is no %s named %q %s.", kind, key.Name, where))
	default:
		apiErrorDiag(diags, "Read", key, kind, err)
	}
	return false
}

func notFoundError(diags *diag.Diagnostics, attr path.Path, noun, id, detail string) {
	diags.AddAttributeError(attr, fmt.Sprintf("%s %s not found", noun, id), detail)
}

// readyConditionModel summarises an object's Ready condition.
type readyConditionModel struct {
	Ready   types.Bool   `tfsdk:"ready"`
	Reason  types.String `tfsdk:"reason"`
	Message types.String `tfsdk:"message"`
}

var readyConditionAttrTypes = map[string]attr.Type{"ready": types.BoolType, "reason": types.StringType, "message": types.StringType}

// statusAttribute is a data source's `status`: attrs and the summary of the
// Ready condition, whose reasons are listed in reasons.
func statusAttribute(kind string, attrs map[string]schema.Attribute, reasons ...string) schema.SingleNestedAttribute {
	all := maps.Clone(attrs)
	if all == nil {
		all = map[string]schema.Attribute{}
	}
	all["ready"] = schema.BoolAttribute{
		Computed: true,
		MarkdownDescription: "Whether the " + kind + "'s Ready condition is `True` and describes its current spec. " +
			"`false` before the control plane has reported on it.",
	}
	all["reason"] = schema.StringAttribute{
		Computed: true,
		MarkdownDescription: "Reason of the Ready condition, such as " + codeAlternatives(reasons) +
			"; null before the control plane has reported on the " + kind + ".",
	}
	all["message"] = schema.StringAttribute{
		Computed:            true,
		MarkdownDescription: "Message of the Ready condition, the detail of `reason`; null before the control plane has reported on the " + kind + ".",
	}
	return schema.SingleNestedAttribute{
		Computed:            true,
		MarkdownDescription: "What the control plane last reported about the " + kind + ", read anew on every refresh.",
		Attributes:          all,
	}
}

// withReadyCondition adds the summary of the Ready condition in conds to
// a status object. A condition about an older generation of the spec says
// nothing about the current one, so it does not count as ready.
func withReadyCondition(ctx context.Context, status types.Object, conds []metav1.Condition, generation int64, diags *diag.Diagnostics) types.Object {
	rc := readyConditionModel{Ready: types.BoolValue(false), Reason: types.StringNull(), Message: types.StringNull()}
	if c := apimeta.FindStatusCondition(conds, agentboxv1alpha1.ConditionReady); c != nil {
		rc.Ready = types.BoolValue(c.Status == metav1.ConditionTrue && c.ObservedGeneration >= generation)
		rc.Reason = types.StringValue(c.Reason)
		rc.Message = types.StringValue(c.Message)
	}
	cond := objectValue(ctx, readyConditionAttrTypes, rc, diags)
	attrTypes, values := maps.Clone(status.AttributeTypes(ctx)), maps.Clone(status.Attributes())
	if attrTypes == nil {
		attrTypes, values = map[string]attr.Type{}, map[string]attr.Value{}
	}
	maps.Copy(attrTypes, readyConditionAttrTypes)
	maps.Copy(values, cond.Attributes())
	o, d := types.ObjectValue(attrTypes, values)
	diags.Append(d...)
	return o
}
