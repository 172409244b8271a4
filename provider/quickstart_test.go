package provider

import (
	"context"
	"fmt"
	"os"
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
	corev1 "k8s.io/api/core/v1"
	apimeta "k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	ctrlclient "sigs.k8s.io/controller-runtime/pkg/client"

	agentboxv1alpha1 "github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	"github.com/agentbox/terraform-provider-agentbox/internal/chart"
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
				Check: resource.ComposeTestCheckFunc(checkRunsInGVisor(t, agent), checkRestrictedNamespace(c, sandboxKey)),
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
		},
	})
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

// checkRestrictedNamespace checks that the namespace the platform created
// enforces the restricted Pod Security Standard, which the API server then
// applied to the sandbox's pod, and that the sandbox reports it so.
func checkRestrictedNamespace(c ctrlclient.Client, sandbox types.NamespacedName) resource.TestCheckFunc {
	return func(*terraform.State) error {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		var ns corev1.Namespace
		if err := c.Get(ctx, types.NamespacedName{Name: sandbox.Namespace}, &ns); err != nil {
			return err
		}
		for k, v := range chart.RestrictedNamespaceLabels() {
			if ns.Labels[k] != v {
				return fmt.Errorf("namespace %s: label %s=%q, want %q (labels %v)", ns.Name, k, ns.Labels[k], v, ns.Labels)
			}
		}
		var sb agentboxv1alpha1.Sandbox
		if err := c.Get(ctx, sandbox, &sb); err != nil {
			return err
		}
		cond := apimeta.FindStatusCondition(sb.Status.Conditions, agentboxv1alpha1.ConditionPodSecurity)
		if cond == nil || cond.Status != metav1.ConditionTrue {
			return fmt.Errorf("sandbox %s: PodSecurity condition %+v, want True", sandbox, cond)
		}
		return nil
	}
}
