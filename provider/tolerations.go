package provider

import (
	"context"

	"github.com/hashicorp/terraform-plugin-framework-validators/int64validator"
	"github.com/hashicorp/terraform-plugin-framework-validators/stringvalidator"
	"github.com/hashicorp/terraform-plugin-framework/attr"
	"github.com/hashicorp/terraform-plugin-framework/diag"
	"github.com/hashicorp/terraform-plugin-framework/resource/schema"
	"github.com/hashicorp/terraform-plugin-framework/schema/validator"
	"github.com/hashicorp/terraform-plugin-framework/types"
	corev1 "k8s.io/api/core/v1"
)

// Pod tolerations, as the node pool (for its RuntimeClass) and the sandbox
// template (for its pods) declare them.

type tolerationModel struct {
	Key               types.String `tfsdk:"key"`
	Operator          types.String `tfsdk:"operator"`
	Value             types.String `tfsdk:"value"`
	Effect            types.String `tfsdk:"effect"`
	TolerationSeconds types.Int64  `tfsdk:"toleration_seconds"`
}

var (
	tolerationOperators = []string{string(corev1.TolerationOpEqual), string(corev1.TolerationOpExists)}
	taintEffects        = []string{string(corev1.TaintEffectNoSchedule), string(corev1.TaintEffectPreferNoSchedule), string(corev1.TaintEffectNoExecute)}
	taintEffectDesc     = "One of " + codeList(taintEffects) + "."

	tolerationAttrTypes = map[string]attr.Type{
		"key": types.StringType, "operator": types.StringType, "value": types.StringType,
		"effect": types.StringType, "toleration_seconds": types.Int64Type,
	}
)

func tolerationsAttribute(desc string) schema.ListNestedAttribute {
	return schema.ListNestedAttribute{
		Optional:            true,
		MarkdownDescription: desc,
		NestedObject: schema.NestedAttributeObject{Attributes: map[string]schema.Attribute{
			"key": schema.StringAttribute{
				Optional:            true,
				MarkdownDescription: "Taint key to tolerate; unset with operator `Exists` tolerates every taint.",
			},
			"operator": schema.StringAttribute{
				Optional:            true,
				MarkdownDescription: "One of " + codeList(tolerationOperators) + ". Unset means `Equal`.",
				Validators:          []validator.String{stringvalidator.OneOf(tolerationOperators...)},
			},
			"value": schema.StringAttribute{
				Optional: true, MarkdownDescription: "Taint value to match with operator `Equal`.",
			},
			"effect": schema.StringAttribute{
				Optional:            true,
				MarkdownDescription: "Taint effect to tolerate. " + taintEffectDesc + " Unset means every effect.",
				Validators:          []validator.String{stringvalidator.OneOf(taintEffects...)},
			},
			"toleration_seconds": schema.Int64Attribute{
				Optional:            true,
				MarkdownDescription: "For effect `NoExecute`: how long a pod stays bound after the taint appears. Unset means forever.",
				Validators:          []validator.Int64{int64validator.AtLeast(0)},
			},
		}},
	}
}

// tolerationsSpec converts the planned list into the object's tolerations.
func tolerationsSpec(ctx context.Context, l types.List, diags *diag.Diagnostics) []corev1.Toleration {
	if l.IsNull() || l.IsUnknown() {
		return nil
	}
	var tols []tolerationModel
	diags.Append(l.ElementsAs(ctx, &tols, false)...)
	out := make([]corev1.Toleration, 0, len(tols))
	for _, t := range tols {
		tol := corev1.Toleration{
			Key:      t.Key.ValueString(),
			Operator: corev1.TolerationOperator(t.Operator.ValueString()),
			Value:    t.Value.ValueString(),
			Effect:   corev1.TaintEffect(t.Effect.ValueString()),
		}
		if !t.TolerationSeconds.IsNull() && !t.TolerationSeconds.IsUnknown() {
			secs := t.TolerationSeconds.ValueInt64()
			tol.TolerationSeconds = &secs
		}
		out = append(out, tol)
	}
	return out
}

// tolerationsValue is the attribute for the live tolerations; an empty
// list the configuration wrote stays empty rather than turning null.
func tolerationsValue(ctx context.Context, prior types.List, ts []corev1.Toleration, diags *diag.Diagnostics) types.List {
	tolType := types.ObjectType{AttrTypes: tolerationAttrTypes}
	if len(ts) == 0 {
		if prior.IsNull() || prior.IsUnknown() || len(prior.Elements()) != 0 {
			return types.ListNull(tolType)
		}
		return prior
	}
	tols := make([]tolerationModel, len(ts))
	for i, t := range ts {
		tols[i] = tolerationModel{
			Key: stringOrNull(t.Key), Operator: stringOrNull(string(t.Operator)), Value: stringOrNull(t.Value),
			Effect: stringOrNull(string(t.Effect)), TolerationSeconds: types.Int64PointerValue(t.TolerationSeconds),
		}
	}
	v, d := types.ListValueFrom(ctx, tolType, tols)
	diags.Append(d...)
	return v
}
