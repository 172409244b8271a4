package provider

import (
	"fmt"
	"regexp"
	"testing"

	"github.com/hashicorp/terraform-plugin-testing/compare"
	"github.com/hashicorp/terraform-plugin-testing/helper/resource"
	"github.com/hashicorp/terraform-plugin-testing/knownvalue"
	"github.com/hashicorp/terraform-plugin-testing/statecheck"
	"github.com/hashicorp/terraform-plugin-testing/tfjsonpath"

	"github.com/agentbox/terraform-provider-agentbox/internal/chart"
)

// TestAccPlatformDataSource reads a release that agentbox_platform
// installed without waiting for the control plane (as in
// TestAccPlatform_noWait), so it needs no images.
func TestAccPlatformDataSource(t *testing.T) {
	t.Parallel()
	c, ns := testAccCluster(t)
	values := "values = <<-EOT\n    metrics:\n      enabled: false\n  EOT"
	config := testAccPlatformConfig(ns, "absent", "  wait = false", "  "+values) + `
data "agentbox_platform" "test" {
  namespace    = agentbox_platform.test.namespace
  release_name = agentbox_platform.test.release_name
}
`
	addr := "data.agentbox_platform.test"
	attr := func(name string, v knownvalue.Check) statecheck.StateCheck {
		return statecheck.ExpectKnownValue(addr, tfjsonpath.New(name), v)
	}
	same := func(name string) statecheck.StateCheck {
		return statecheck.CompareValuePairs(testAccPlatformAddr, tfjsonpath.New(name), addr, tfjsonpath.New(name), compare.ValuesSame())
	}
	resource.Test(t, resource.TestCase{
		ProtoV6ProviderFactories: testAccProtoV6ProviderFactories,
		CheckDestroy:             platformDestroyed(c, ns),
		Steps: []resource.TestStep{
			{
				Config: config,
				ConfigStateChecks: []statecheck.StateCheck{
					attr("id", knownvalue.StringExact(ns+"/agentbox")),
					attr("namespace", knownvalue.StringExact(ns)),
					attr("release_name", knownvalue.StringExact("agentbox")),
					attr("chart_version", knownvalue.StringExact(chart.Version())),
					attr("image_tag", knownvalue.StringExact("absent")),
					attr("image_registry", knownvalue.Null()),
					attr("image_pull_policy", knownvalue.StringExact("Never")),
					attr("replicas", knownvalue.Int64Exact(1)),
					attr("values", knownvalue.StringExact("metrics:\n  enabled: false\n")),
					attr("revision", knownvalue.Int64Exact(1)),
					attr("status", knownvalue.StringExact("deployed")),
					attr("api_service_dns", knownvalue.StringExact("agentbox-api."+ns+".svc")),
					attr("api_endpoint", knownvalue.StringRegexp(regexp.MustCompile(`^https://[0-9.]+:443$`))),
					attr("drift", knownvalue.ListExact([]knownvalue.Check{})),
					// How to reach the Compute API is what the resource reports.
					same("api_endpoint"),
					same("ca_certificate"),
					same("admin_token"),
				},
			},
			{
				Config: config + fmt.Sprintf(`
data "agentbox_platform" "missing" {
  namespace    = %q
  release_name = "elsewhere"
}
`, ns),
				ExpectError: regexp.MustCompile(`platform release ` + ns + `/elsewhere not found`),
			},
		},
	})
}
