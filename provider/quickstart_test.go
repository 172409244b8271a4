package provider

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/terraform-plugin-testing/config"
	"github.com/hashicorp/terraform-plugin-testing/helper/resource"
	"github.com/hashicorp/terraform-plugin-testing/knownvalue"
	"github.com/hashicorp/terraform-plugin-testing/plancheck"
	"github.com/hashicorp/terraform-plugin-testing/statecheck"
	"github.com/hashicorp/terraform-plugin-testing/terraform"
	"github.com/hashicorp/terraform-plugin-testing/tfjsonpath"
	apimeta "k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/types"

	agentboxv1alpha1 "github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	"github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
)

// testAccImageTagEnv names the tag of the platform images that `make test`
// built and imported into the test node.
const testAccImageTagEnv = "AGENTBOX_TEST_IMAGE_TAG"

// TestAccQuickstart is the main job end to end: examples/quickstart applied
// with the real terraform CLI gives an agent a gVisor sandbox, and the
// Compute API runs the agent's code in it.
func TestAccQuickstart(t *testing.T) {
	tag := testAccPlatformImageTag(t)
	c, _ := testAccCluster(t)
	const agent = "quickstart-agent"
	vars := config.Variables{
		"kubeconfig": config.StringVariable(os.Getenv(testAccKubeconfigEnv)),
		"image_tag":  config.StringVariable(tag),
		"agent_id":   config.StringVariable(agent),
	}
	dir := config.StaticDirectory("../examples/quickstart")
	// Import steps leave the outputs null, which the framework's state shim
	// cannot read, so they use the resources without outputs.tf.
	resources := config.StaticFile("../examples/quickstart/main.tf")
	sandboxKey := types.NamespacedName{Namespace: DefaultNamespace, Name: "quickstart-agent"}
	// The example has its own required_providers block, which the testing
	// framework counts as providers given per step, and whose source is
	// agentbox/agentbox rather than the framework's default namespace.
	t.Setenv("TF_ACC_PROVIDER_NAMESPACE", "agentbox")
	f := testAccProtoV6ProviderFactories
	resource.Test(t, resource.TestCase{
		Steps: []resource.TestStep{
			{
				ProtoV6ProviderFactories: f,
				ConfigDirectory:          dir,
				ConfigVariables:          vars,
				ConfigStateChecks: []statecheck.StateCheck{
					statecheck.ExpectKnownValue("agentbox_platform.this", tfjsonpath.New("revision"), knownvalue.Int64Exact(1)),
					statecheck.ExpectKnownValue("agentbox_platform.this", tfjsonpath.New("status"), knownvalue.StringExact("deployed")),
					statecheck.ExpectKnownValue("agentbox_sandbox_template.python", tfjsonpath.New("runtime_class_name"), knownvalue.StringExact("gvisor")),
					statecheck.ExpectKnownValue("agentbox_sandbox.agent", tfjsonpath.New("agent_id"), knownvalue.StringExact(agent)),
					statecheck.ExpectKnownValue("agentbox_sandbox.agent", tfjsonpath.New("id"), knownvalue.StringExact(DefaultNamespace+"/quickstart-agent")),
				},
				Check: checkRunsInGVisor(t, agent),
			},
			{
				ProtoV6ProviderFactories: f,
				ConfigDirectory:          dir,
				ConfigVariables:          vars,
				ConfigPlanChecks:         resource.ConfigPlanChecks{PreApply: []plancheck.PlanCheck{plancheck.ExpectEmptyPlan()}},
			},
			{
				ProtoV6ProviderFactories: f,
				ConfigFile:               resources,
				ConfigVariables:          vars,
				ResourceName:             "agentbox_sandbox.agent",
				ImportState:              true,
				ImportStateId:            DefaultNamespace + "/quickstart-agent",
				ImportStateVerify:        true,
				ImportStateVerifyIgnore:  []string{"wait_for_ready", "timeouts"},
			},
			{
				ProtoV6ProviderFactories: f,
				ConfigFile:               resources,
				ConfigVariables:          vars,
				ResourceName:             "agentbox_sandbox_template.python",
				ImportState:              true,
				ImportStateId:            DefaultNamespace + "/python",
				ImportStateVerify:        true,
			},
			{
				// The Sandbox deleted out of band is re-created, and the
				// agent's sandbox runs code again.
				PreConfig: func() {
					ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
					defer cancel()
					if err := c.Delete(ctx, &agentboxv1alpha1.Sandbox{ObjectMeta: objectMeta(sandboxKey)}); err != nil {
						t.Fatal(err)
					}
					if err := waitGone(ctx, c, sandboxKey, &agentboxv1alpha1.Sandbox{}, time.Minute); err != nil {
						t.Fatal(err)
					}
				},
				ProtoV6ProviderFactories: f,
				ConfigDirectory:          dir,
				ConfigVariables:          vars,
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PreApply: []plancheck.PlanCheck{plancheck.ExpectResourceAction("agentbox_sandbox.agent", plancheck.ResourceActionCreate)},
				},
				Check: checkRunsInGVisor(t, agent),
			},
			{
				// A second sandbox for the agent: the control plane refuses
				// it (an agent has one sandbox), and wait_for_ready fails the
				// apply with the reason at once instead of waiting out the
				// create timeout.
				ProtoV6ProviderFactories: f,
				ConfigDirectory:          config.StaticDirectory(quickstartWithTwin(t)),
				ConfigVariables:          vars,
				ExpectError:              regexp.MustCompile(`DuplicateAgent:\s+agent\s+"quickstart-agent"\s+already\s+has\s+Sandbox\s+agentbox-system/quickstart-agent`),
			},
			{
				// The refused twin has no pod; going back to the quickstart
				// destroys it, and the agent's own sandbox runs code as before.
				PreConfig: func() {
					ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
					defer cancel()
					var twin agentboxv1alpha1.Sandbox
					if err := c.Get(ctx, types.NamespacedName{Namespace: DefaultNamespace, Name: "quickstart-twin"}, &twin); err != nil {
						t.Fatal(err)
					}
					ready := apimeta.FindStatusCondition(twin.Status.Conditions, agentboxv1alpha1.ConditionReady)
					if twin.Status.Phase != agentboxv1alpha1.SandboxPhaseError || ready == nil || ready.Reason != agentboxv1alpha1.ReasonDuplicateAgent ||
						twin.Status.PodName != "" {
						t.Fatalf("the twin: phase %s, pod %q, Ready %+v", twin.Status.Phase, twin.Status.PodName, ready)
					}
				},
				ProtoV6ProviderFactories: f,
				ConfigDirectory:          dir,
				ConfigVariables:          vars,
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PreApply: []plancheck.PlanCheck{plancheck.ExpectResourceAction("agentbox_sandbox.twin", plancheck.ResourceActionDestroy)},
				},
				Check: checkRunsInGVisor(t, agent),
			},
		},
	})
}

// quickstartWithTwin is examples/quickstart with a second sandbox for the
// same agent.
func quickstartWithTwin(t *testing.T) string {
	t.Helper()
	dir := t.TempDir()
	main, err := os.ReadFile("../examples/quickstart/main.tf")
	if err != nil {
		t.Fatal(err)
	}
	twin := `
resource "agentbox_sandbox" "twin" {
  name     = "quickstart-twin"
  agent_id = var.agent_id
  template = agentbox_sandbox_template.python.name
  timeouts = {
    create = "10m"
  }

  depends_on = [agentbox_sandbox.agent]
}
`
	for name, data := range map[string][]byte{"main.tf": main, "twin.tf": []byte(twin)} {
		if err := os.WriteFile(filepath.Join(dir, name), data, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	return dir
}

// checkRunsInGVisor runs Python in the agent's sandbox through the Compute
// API, with the endpoint, CA and token that agentbox_platform reports, and
// requires the gVisor kernel.
func checkRunsInGVisor(t *testing.T, agent string) resource.TestCheckFunc {
	return func(s *terraform.State) error {
		platform, ok := s.RootModule().Resources["agentbox_platform.this"]
		if !ok {
			return fmt.Errorf("agentbox_platform.this not in state")
		}
		attrs := platform.Primary.Attributes
		api, err := client.New(attrs["api_endpoint"], attrs["admin_token"], []byte(attrs["ca_certificate"]))
		if err != nil {
			return err
		}
		defer api.CloseIdleConnections()
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		defer cancel()
		res, err := api.RunCommand(ctx, agent, client.RunCommandRequest{
			Command: []string{"python3", "-c", "import platform; print(platform.release())"},
		})
		if err != nil {
			return fmt.Errorf("run_command: %w", err)
		}
		t.Logf("run_command: exit %d in %d ms, stdout %q, stderr %q", res.ExitCode, res.DurationMS, res.Stdout, res.Stderr)
		if res.ExitCode != 0 || !strings.Contains(res.Stdout, "gvisor") {
			return fmt.Errorf("python3 in the sandbox: exit %d, stdout %q, stderr %q; want the gVisor kernel release", res.ExitCode, res.Stdout, res.Stderr)
		}
		return nil
	}
}
