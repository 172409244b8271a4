package provider

import (
	"context"
	"fmt"
	"slices"
	"sort"
	"strings"
	"time"

	"github.com/hashicorp/terraform-plugin-framework/attr"
	"github.com/hashicorp/terraform-plugin-framework/diag"
	"github.com/hashicorp/terraform-plugin-framework/types"
	"github.com/hashicorp/terraform-plugin-framework/types/basetypes"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// The API server returns durations and quantities in canonical form ("1h"
// comes back as "1h0m0s", "1024Mi" as "1Gi"). Read keeps the spelling from
// state whenever the values are equal, so a clean re-apply plans nothing.

func keepDuration(prior types.String, live time.Duration) types.String {
	if !prior.IsNull() && !prior.IsUnknown() {
		if d, err := time.ParseDuration(prior.ValueString()); err == nil && d == live {
			return prior
		}
	}
	return types.StringValue(formatDuration(live))
}

// formatDuration drops the zero units Go prints ("1h0m0s" becomes "1h"), so
// an imported value reads the way people write it.
func formatDuration(d time.Duration) string {
	s := d.String()
	if strings.HasSuffix(s, "m0s") {
		s = strings.TrimSuffix(s, "0s")
	}
	if strings.HasSuffix(s, "h0m") {
		s = strings.TrimSuffix(s, "0m")
	}
	return s
}

func keepQuantity(prior types.String, live resource.Quantity) types.String {
	if !prior.IsNull() && !prior.IsUnknown() {
		if q, err := resource.ParseQuantity(prior.ValueString()); err == nil && q.Cmp(live) == 0 {
			return prior
		}
	}
	return types.StringValue(live.String())
}

func parseDuration(v types.String, attr string, diags *diag.Diagnostics) metav1.Duration {
	if v.IsNull() || v.IsUnknown() {
		return metav1.Duration{}
	}
	d, err := time.ParseDuration(v.ValueString())
	if err != nil {
		diags.AddError("Invalid duration", fmt.Sprintf("%s: %q is not a duration such as \"30s\", \"15m\" or \"1h\": %v", attr, v.ValueString(), err))
	}
	return metav1.Duration{Duration: d}
}

func parseQuantity(v types.String, attr string, diags *diag.Diagnostics) resource.Quantity {
	if v.IsNull() || v.IsUnknown() {
		return resource.Quantity{}
	}
	q, err := resource.ParseQuantity(v.ValueString())
	if err != nil {
		diags.AddError("Invalid quantity", fmt.Sprintf("%s: %q is not a quantity such as \"500m\", \"1Gi\" or \"2\": %v", attr, v.ValueString(), err))
	}
	return q
}

// stringOrNull maps "" to null, which is how Terraform shows an unset
// optional attribute.
func stringOrNull(s string) types.String {
	if s == "" {
		return types.StringNull()
	}
	return types.StringValue(s)
}

func stringPtrValue(p *string) types.String {
	if p == nil {
		return types.StringNull()
	}
	return types.StringValue(*p)
}

func stringPtr(v types.String) *string {
	if v.IsNull() || v.IsUnknown() {
		return nil
	}
	s := v.ValueString()
	return &s
}

// mapValue maps an empty map to null unless state already holds an empty
// map, so neither spelling of "nothing" shows up as a change.
func mapValue(ctx context.Context, prior types.Map, m map[string]string, diags *diag.Diagnostics) types.Map {
	if len(m) == 0 {
		if !prior.IsNull() && !prior.IsUnknown() && len(prior.Elements()) == 0 {
			return prior
		}
		return types.MapNull(types.StringType)
	}
	v, d := types.MapValueFrom(ctx, types.StringType, m)
	diags.Append(d...)
	return v
}

func goMap(ctx context.Context, v types.Map, diags *diag.Diagnostics) map[string]string {
	if v.IsNull() || v.IsUnknown() {
		return nil
	}
	m := map[string]string{}
	diags.Append(v.ElementsAs(ctx, &m, false)...)
	return m
}

func listValue(ctx context.Context, prior types.List, s []string, diags *diag.Diagnostics) types.List {
	if len(s) == 0 {
		if !prior.IsNull() && !prior.IsUnknown() && len(prior.Elements()) == 0 {
			return prior
		}
		return types.ListNull(types.StringType)
	}
	v, d := types.ListValueFrom(ctx, types.StringType, s)
	diags.Append(d...)
	return v
}

func goStrings(ctx context.Context, v types.List, diags *diag.Diagnostics) []string {
	if v.IsNull() || v.IsUnknown() {
		return nil
	}
	var s []string
	diags.Append(v.ElementsAs(ctx, &s, false)...)
	return s
}

func sortedKeys(m map[string]string) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys
}

// setValue maps an empty list to null unless state already holds an empty
// set, so neither spelling of "nothing" shows up as a change.
func setValue[S ~string](ctx context.Context, prior types.Set, s []S, diags *diag.Diagnostics) types.Set {
	if len(s) == 0 {
		if !prior.IsNull() && !prior.IsUnknown() && len(prior.Elements()) == 0 {
			return prior
		}
		return types.SetNull(types.StringType)
	}
	v, d := types.SetValueFrom(ctx, types.StringType, s)
	diags.Append(d...)
	return v
}

// goSet returns a set's strings sorted, so the object's lists are stable.
func goSet(ctx context.Context, v types.Set, diags *diag.Diagnostics) []string {
	if v.IsNull() || v.IsUnknown() {
		return nil
	}
	var s []string
	diags.Append(v.ElementsAs(ctx, &s, false)...)
	slices.Sort(s)
	return s
}

// resourceList converts a map of quantities, such as requests or limits.
func resourceList(m map[string]string, attr string, diags *diag.Diagnostics) corev1.ResourceList {
	if len(m) == 0 {
		return nil
	}
	l := corev1.ResourceList{}
	for k, v := range m {
		l[corev1.ResourceName(k)] = parseQuantity(types.StringValue(v), attr+"."+k, diags)
	}
	return l
}

// quantityMap is the attribute for a live resource list, keeping the prior
// spelling of equal quantities (see keepQuantity).
func quantityMap(ctx context.Context, prior types.Map, l corev1.ResourceList, diags *diag.Diagnostics) types.Map {
	priorVals := goMap(ctx, prior, diags)
	m := make(map[string]string, len(l))
	for k, q := range l {
		m[string(k)] = keepQuantity(stringOrNull(priorVals[string(k)]), q).ValueString()
	}
	return mapValue(ctx, prior, m, diags)
}

// objectValue converts a model struct into an object of attrTypes.
func objectValue(ctx context.Context, attrTypes map[string]attr.Type, v any, diags *diag.Diagnostics) types.Object {
	o, d := types.ObjectValueFrom(ctx, attrTypes, v)
	diags.Append(d...)
	return o
}

// objectAsOptions converts nested objects into their model structs; defaults
// make nested values known by the time a resource converts them.
var objectAsOptions = basetypes.ObjectAsOptions{}
