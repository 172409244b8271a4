package provider

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strings"
	"testing"

	"github.com/hashicorp/terraform-plugin-testing/helper/resource"
	"github.com/hashicorp/terraform-plugin-testing/knownvalue"
	"github.com/hashicorp/terraform-plugin-testing/plancheck"
	"github.com/hashicorp/terraform-plugin-testing/statecheck"
	"github.com/hashicorp/terraform-plugin-testing/terraform"
	"github.com/hashicorp/terraform-plugin-testing/tfjsonpath"

	"github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
	"github.com/agentbox/terraform-provider-agentbox/internal/testenv/toolchain"
)

const anyImageAgent = "any-image-agent"

// TestAccAnyImageSandbox declares, through the terraform CLI, the platform
// with the chart's defaults and a template whose image knows nothing of
// agentbox (the test node's busybox: sh and a few applets in /bin, no
// python3), and an agent's sandbox from it. The platform injects its
// supervisor: the sandbox runs, and through the Compute API a command gets
// the image's PATH, the workspace as HOME and the template's env, while
// python_exec answers that the image has no python3.
func TestAccAnyImageSandbox(t *testing.T) {
	tag := testAccPlatformImageTag(t)
	c, ns := testAccCluster(t)
	cfg := fmt.Sprintf(`
provider "agentbox" {
  kubernetes = {
    config_path = %[1]q
  }
  namespace = %[2]q
}

resource "agentbox_platform" "this" {
  image_tag = %[3]q
}

resource "agentbox_sandbox_template" "busybox" {
  name              = "busybox"
  image             = %[4]q
  image_pull_policy = "Never"
  env = {
    GREETING = "hello"
  }
  depends_on = [agentbox_platform.this]
}

resource "agentbox_sandbox" "agent" {
  name     = "any-image"
  agent_id = %[5]q
  template = agentbox_sandbox_template.busybox.name
}
`, os.Getenv(testAccKubeconfigEnv), ns, tag, toolchain.BusyboxImage, anyImageAgent)
	tpl := "agentbox_sandbox_template.busybox"
	resource.Test(t, resource.TestCase{
		ProtoV6ProviderFactories: testAccProtoV6ProviderFactories,
		CheckDestroy:             platformDestroyed(c, ns),
		Steps: []resource.TestStep{
			{
				Config: cfg,
				ConfigStateChecks: []statecheck.StateCheck{
					statecheck.ExpectKnownValue(tpl, tfjsonpath.New("image"), knownvalue.StringExact(toolchain.BusyboxImage)),
					statecheck.ExpectKnownValue("agentbox_sandbox.agent", tfjsonpath.New("agent_id"), knownvalue.StringExact(anyImageAgent)),
				},
				Check: checkAnyImageSandbox(t),
			},
			{
				Config:           cfg,
				ConfigPlanChecks: resource.ConfigPlanChecks{PreApply: []plancheck.PlanCheck{plancheck.ExpectEmptyPlan()}},
			},
			{
				Config:            cfg,
				ResourceName:      tpl,
				ImportState:       true,
				ImportStateId:     ns + "/busybox",
				ImportStateVerify: true,
			},
		},
	})
}

// checkAnyImageSandbox runs a command and python_exec in the busybox
// sandbox through the Compute API that agentbox_platform reports.
func checkAnyImageSandbox(t *testing.T) resource.TestCheckFunc {
	return func(s *terraform.State) error {
		api, err := platformAPI(s, "agentbox_platform.this")
		if err != nil {
			return err
		}
		defer api.CloseIdleConnections()
		ctx, cancel := context.WithTimeout(context.Background(), callTimeout)
		defer cancel()
		res, err := api.RunCommand(ctx, anyImageAgent, client.RunCommandRequest{
			Command: []string{"sh", "-c", `echo "$PATH|$HOME|$GREETING|$(id -u)"`},
		})
		if err != nil {
			return fmt.Errorf("run_command: %w", err)
		}
		t.Logf("run_command in busybox: exit %d in %d ms, stdout %q, stderr %q", res.ExitCode, res.DurationMS, res.Stdout, res.Stderr)
		if want := "/bin|/workspace|hello|65532\n"; res.ExitCode != 0 || res.Stdout != want {
			return fmt.Errorf("the command printed %q (exit %d, stderr %q), want %q: the image's PATH, the workspace as HOME, the template's env, the sandbox user",
				res.Stdout, res.ExitCode, res.Stderr, want)
		}
		_, err = api.ToolRequest(ctx, anyImageAgent, "python_exec", map[string]any{"code": "print(1)"})
		var apiErr *client.Error
		if !errors.As(err, &apiErr) || apiErr.Code != client.CodeInvalidArgument || !strings.Contains(apiErr.Message, "needs python3") {
			return fmt.Errorf("python_exec in an image without python3: %v, want invalid_argument saying it needs python3", err)
		}
		t.Logf("python_exec in busybox: %s: %s", apiErr.Code, apiErr.Message)
		return nil
	}
}
