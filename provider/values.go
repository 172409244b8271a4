package provider

import (
	"context"
	"fmt"
	"sort"
	"strings"
	"time"

	"github.com/hashicorp/terraform-plugin-framework/diag"
	"github.com/hashicorp/terraform-plugin-framework/types"
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
