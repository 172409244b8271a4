package provider

import (
	"context"
	"fmt"
	"strings"
	"testing"

	"github.com/hashicorp/terraform-plugin-testing/helper/resource"
	"github.com/hashicorp/terraform-plugin-testing/knownvalue"
	"github.com/hashicorp/terraform-plugin-testing/plancheck"
	"github.com/hashicorp/terraform-plugin-testing/statecheck"
	"github.com/hashicorp/terraform-plugin-testing/terraform"
	"github.com/hashicorp/terraform-plugin-testing/tfjsonpath"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	agentboxv1alpha1 "github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
)

// The lifecycle of the Terraform resource itself: no control plane runs
// here, so the sandbox is created without waiting for it to become ready.
// The quickstart test covers a sandbox that really runs.
func testAccSandboxConfig(ns, idle string) string {
	return testAccProviderConfig() + fmt.Sprintf(`
resource "agentbox_sandbox_template" "python" {
  name      = "python"
  namespace = %[1]q
}

resource "agentbox_sandbox" "test" {
  name           = "agent-1"
  namespace      = %[1]q
  agent_id       = "agent-1@example.com"
  template       = agentbox_sandbox_template.python.name
  idle_timeout   = %[2]q
  wait_for_ready = false
}
`, ns, idle)
}

func TestAccSandbox_lifecycle(t *testing.T) {
	t.Parallel()
	c, ns := testAccCluster(t)
	addr := "agentbox_sandbox.test"
	key := types.NamespacedName{Namespace: ns, Name: "agent-1"}
	resource.Test(t, resource.TestCase{
		ProtoV6ProviderFactories: testAccProtoV6ProviderFactories,
		Steps: []resource.TestStep{
			{
				Config: testAccSandboxConfig(ns, "30m"),
				ConfigStateChecks: []statecheck.StateCheck{
					statecheck.ExpectKnownValue(addr, tfjsonpath.New("id"), knownvalue.StringExact(ns+"/agent-1")),
					statecheck.ExpectKnownValue(addr, tfjsonpath.New("agent_id"), knownvalue.StringExact("agent-1@example.com")),
					statecheck.ExpectKnownValue(addr, tfjsonpath.New("template"), knownvalue.StringExact("python")),
					statecheck.ExpectKnownValue(addr, tfjsonpath.New("ephemeral"), knownvalue.Bool(false)),
				},
			},
			{
				Config:           testAccSandboxConfig(ns, "30m"),
				ConfigPlanChecks: resource.ConfigPlanChecks{PreApply: []plancheck.PlanCheck{plancheck.ExpectEmptyPlan()}},
			},
			{
				ResourceName:            addr,
				ImportState:             true,
				ImportStateId:           ns + "/agent-1",
				ImportStateVerify:       true,
				ImportStateVerifyIgnore: []string{"wait_for_ready", "timeouts"},
			},
			{
				// An in-place change of a mutable field.
				Config: testAccSandboxConfig(ns, "2h"),
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PreApply: []plancheck.PlanCheck{plancheck.ExpectResourceAction(addr, plancheck.ResourceActionUpdate)},
				},
				Check: func(*terraform.State) error {
					var sb agentboxv1alpha1.Sandbox
					if err := c.Get(context.Background(), key, &sb); err != nil {
						return err
					}
					if sb.Spec.IdleTimeout == nil || sb.Spec.IdleTimeout.Duration.String() != "2h0m0s" {
						return fmt.Errorf("spec.idleTimeout = %v, want 2h", sb.Spec.IdleTimeout)
					}
					return nil
				},
			},
			{
				// Disappears: deleted out of band, the next plan re-creates it.
				PreConfig: func() {
					if err := c.Delete(context.Background(), &agentboxv1alpha1.Sandbox{ObjectMeta: objectMeta(key)}); err != nil {
						t.Fatal(err)
					}
				},
				Config: testAccSandboxConfig(ns, "2h"),
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PreApply: []plancheck.PlanCheck{plancheck.ExpectResourceAction(addr, plancheck.ResourceActionCreate)},
				},
			},
			{
				// agent_id is immutable: changing it replaces the sandbox.
				Config: replaceAgent(testAccSandboxConfig(ns, "2h")),
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PreApply: []plancheck.PlanCheck{plancheck.ExpectResourceAction(addr, plancheck.ResourceActionDestroyBeforeCreate)},
				},
			},
		},
	})
}

func objectMeta(key types.NamespacedName) metav1.ObjectMeta {
	return metav1.ObjectMeta{Namespace: key.Namespace, Name: key.Name}
}

func replaceAgent(config string) string {
	return strings.Replace(config, `agent_id       = "agent-1@example.com"`, `agent_id       = "agent-2@example.com"`, 1)
}
