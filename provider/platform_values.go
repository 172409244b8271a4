package provider

import (
	"slices"
	"time"

	"github.com/hashicorp/terraform-plugin-framework/attr"
	"github.com/hashicorp/terraform-plugin-framework/diag"
	"github.com/hashicorp/terraform-plugin-framework/types"

	"github.com/agentbox/terraform-provider-agentbox/internal/chart"
)

// The platform's configured attributes as the chart's values and options,
// and back from the release they produced.

// chartValues are the values the configuration asks for.
func (m *platformModel) chartValues() chart.Values {
	v := chart.Values{
		ImageRegistry:   m.ImageRegistry.ValueString(),
		ImageTag:        m.ImageTag.ValueString(),
		ImagePullPolicy: m.ImagePullPolicy.ValueString(),
		Raw:             m.Values.ValueString(),
	}
	if !m.Replicas.IsNull() && !m.Replicas.IsUnknown() {
		n := int(m.Replicas.ValueInt64())
		v.Replicas = &n
	}
	if !m.SandboxNamespaces.IsNull() && !m.SandboxNamespaces.IsUnknown() {
		v.SandboxNamespaces = []string{}
		for _, e := range m.SandboxNamespaces.Elements() {
			if s, ok := e.(types.String); ok && !s.IsUnknown() {
				v.SandboxNamespaces = append(v.SandboxNamespaces, s.ValueString())
			}
		}
		// A set has no order; the release's values get one, so that an
		// unchanged set never plans an upgrade.
		slices.Sort(v.SandboxNamespaces)
	}
	return v
}

func (m *platformModel) options(timeout time.Duration) chart.Options {
	return chart.Options{
		Namespace:   m.Namespace.ValueString(),
		ReleaseName: m.ReleaseName.ValueString(),
		Values:      m.chartValues(),
		Wait:        m.Wait.ValueBool(),
		Timeout:     timeout,
	}
}

// needsUpgrade reports whether going from m (the state) to plan changes
// what runs in the cluster, or the cluster has drifted.
func (m *platformModel) needsUpgrade(plan platformModel) bool {
	if len(m.Drift.Elements()) > 0 || m.Status.ValueString() != statusDeployed || m.ChartVersion.ValueString() != chart.Version() {
		return true
	}
	a, errA := m.chartValues().Map()
	b, errB := plan.chartValues().Map()
	return errA != nil || errB != nil || !chart.SameValues(a, b)
}

// fromReleaseConfig keeps the configured attributes while they still
// produce the values the release runs with. When they do not (after an
// import, or a `helm upgrade` by hand) it describes the release's values
// with the attributes instead, so that the plan shows the difference.
func (m *platformModel) fromReleaseConfig(rel *chart.Release, diags *diag.Diagnostics) {
	if m.Wait.IsNull() {
		m.Wait = types.BoolValue(true)
	}
	// A null image_tag means an import: nothing configured is known yet.
	if want, err := m.chartValues().Map(); err == nil && !m.ImageTag.IsNull() && chart.SameValues(want, rel.Config) {
		return
	}
	v, err := chart.ValuesFromConfig(rel.Config)
	if err != nil {
		diags.AddError("Cannot read the values of the agentbox platform release", err.Error())
		return
	}
	m.ImageRegistry = stringOrNull(v.ImageRegistry)
	m.ImagePullPolicy = stringOrNull(v.ImagePullPolicy)
	m.ImageTag = types.StringValue(v.ImageTag)
	if v.ImageTag == "" {
		// The chart's own default: its appVersion.
		m.ImageTag = types.StringValue(rel.AppVersion)
	}
	m.Replicas = types.Int64Value(1)
	if v.Replicas != nil {
		m.Replicas = types.Int64Value(int64(*v.Replicas))
	}
	m.SandboxNamespaces = types.SetNull(types.StringType)
	if v.SandboxNamespaces != nil {
		elems := make([]attr.Value, len(v.SandboxNamespaces))
		for i, ns := range v.SandboxNamespaces {
			elems[i] = types.StringValue(ns)
		}
		set, d := types.SetValue(types.StringType, elems)
		diags.Append(d...)
		m.SandboxNamespaces = set
	}
	m.Values = stringOrNull(v.Raw)
}
