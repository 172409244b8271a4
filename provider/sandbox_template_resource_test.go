package provider

import (
	"context"
	"fmt"
	"regexp"
	"testing"
	"time"

	"github.com/hashicorp/terraform-plugin-testing/helper/resource"
	"github.com/hashicorp/terraform-plugin-testing/knownvalue"
	"github.com/hashicorp/terraform-plugin-testing/plancheck"
	"github.com/hashicorp/terraform-plugin-testing/statecheck"
	"github.com/hashicorp/terraform-plugin-testing/terraform"
	"github.com/hashicorp/terraform-plugin-testing/tfjsonpath"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"

	agentboxv1alpha1 "github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
)

func testAccTemplateConfig(ns, image string) string {
	return testAccProviderConfig() + fmt.Sprintf(`
resource "agentbox_sandbox_template" "test" {
  name         = "python"
  namespace    = %q
  image        = %q
  idle_timeout = "45m"
  checkpoint_interval = "5m"
  env          = { GREETING = "hello" }
  resources = {
    requests = { cpu = "0.5", memory = "256Mi" }
    limits   = { memory = "1024Mi" }
  }
  workspace = { size = "2Gi" }
  python = {
    max_timeout      = "120s"
    allowed_packages = ["numpy"]
    trusted_hosts    = ["mirror.internal:8080"]
    environments     = { max_count = 4, max_size = "512Mi", ttl = "24h" }
  }
  mcp_servers = [
    { name = "files", command = "mcp-files", args = ["--root", "/workspace"] },
    { name = "remote", url = "https://mcp.example.test/mcp", audience = "mcp://example" },
  ]
  tolerations = [
    { key = "dedicated", value = "agents", effect = "NoSchedule" },
    { key = "spot", operator = "Exists", effect = "NoExecute", toleration_seconds = 30 },
  ]
}
`, ns, image)
}

func TestAccSandboxTemplate_basic(t *testing.T) {
	t.Parallel()
	c, ns := testAccCluster(t)
	addr := "agentbox_sandbox_template.test"
	key := types.NamespacedName{Namespace: ns, Name: "python"}
	resource.Test(t, resource.TestCase{
		ProtoV6ProviderFactories: testAccProtoV6ProviderFactories,
		Steps: []resource.TestStep{
			{
				Config: testAccTemplateConfig(ns, "example/sandbox:1"),
				Check: func(*terraform.State) error {
					var o agentboxv1alpha1.SandboxTemplate
					if err := c.Get(context.Background(), key, &o); err != nil {
						return err
					}
					e := o.Spec.Python.Environments
					if th := o.Spec.Python.TrustedHosts; len(th) != 1 || th[0] != "mirror.internal:8080" {
						return fmt.Errorf("spec.python.trustedHosts = %q", th)
					}
					if e == nil || e.MaxCount != 4 || e.MaxSize == nil || e.MaxSize.String() != "512Mi" || e.TTL == nil || e.TTL.Duration != 24*time.Hour {
						return fmt.Errorf("spec.python.environments = %+v", e)
					}
					return nil
				},
				ConfigStateChecks: []statecheck.StateCheck{
					statecheck.ExpectKnownValue(addr, tfjsonpath.New("id"), knownvalue.StringExact(ns+"/python")),
					statecheck.ExpectKnownValue(addr, tfjsonpath.New("runtime_class_name"), knownvalue.StringExact("gvisor")),
					statecheck.ExpectKnownValue(addr, tfjsonpath.New("run_as_image_user"), knownvalue.Bool(false)),
					statecheck.ExpectKnownValue(addr, tfjsonpath.New("idle_timeout"), knownvalue.StringExact("45m")),
					statecheck.ExpectKnownValue(addr, tfjsonpath.New("checkpoint_interval"), knownvalue.StringExact("5m")),
					statecheck.ExpectKnownValue(addr, tfjsonpath.New("checkpoints_kept"), knownvalue.Int64Exact(3)),
					statecheck.ExpectKnownValue(addr, tfjsonpath.New("workspace").AtMapKey("mount_path"), knownvalue.StringExact("/workspace")),
					statecheck.ExpectKnownValue(addr, tfjsonpath.New("resources").AtMapKey("requests").AtMapKey("cpu"), knownvalue.StringExact("0.5")),
					statecheck.ExpectKnownValue(addr, tfjsonpath.New("python").AtMapKey("default_timeout"), knownvalue.StringExact("30s")),
					statecheck.ExpectKnownValue(addr, tfjsonpath.New("python").AtMapKey("max_timeout"), knownvalue.StringExact("120s")),
					statecheck.ExpectKnownValue(addr, tfjsonpath.New("mcp_servers"), knownvalue.ListExact([]knownvalue.Check{
						knownvalue.ObjectExact(map[string]knownvalue.Check{
							"name": knownvalue.StringExact("files"), "command": knownvalue.StringExact("mcp-files"), "url": knownvalue.Null(),
							"audience": knownvalue.Null(),
							"args":     knownvalue.ListExact([]knownvalue.Check{knownvalue.StringExact("--root"), knownvalue.StringExact("/workspace")}),
							"env":      knownvalue.Null(),
						}),
						knownvalue.ObjectExact(map[string]knownvalue.Check{
							"name": knownvalue.StringExact("remote"), "command": knownvalue.Null(),
							"url": knownvalue.StringExact("https://mcp.example.test/mcp"), "args": knownvalue.Null(), "env": knownvalue.Null(),
							"audience": knownvalue.StringExact("mcp://example"),
						}),
					})),
					statecheck.ExpectKnownValue(addr, tfjsonpath.New("python").AtMapKey("trusted_hosts"),
						knownvalue.ListExact([]knownvalue.Check{knownvalue.StringExact("mirror.internal:8080")})),
					statecheck.ExpectKnownValue(addr, tfjsonpath.New("python").AtMapKey("environments"), knownvalue.ObjectExact(map[string]knownvalue.Check{
						"max_count": knownvalue.Int64Exact(4), "max_size": knownvalue.StringExact("512Mi"), "ttl": knownvalue.StringExact("24h"),
					})),
					statecheck.ExpectKnownValue(addr, tfjsonpath.New("tolerations"), knownvalue.ListExact([]knownvalue.Check{
						knownvalue.ObjectExact(map[string]knownvalue.Check{
							"key": knownvalue.StringExact("dedicated"), "operator": knownvalue.Null(), "value": knownvalue.StringExact("agents"),
							"effect": knownvalue.StringExact("NoSchedule"), "toleration_seconds": knownvalue.Null(),
						}),
						knownvalue.ObjectExact(map[string]knownvalue.Check{
							"key": knownvalue.StringExact("spot"), "operator": knownvalue.StringExact("Exists"), "value": knownvalue.Null(),
							"effect": knownvalue.StringExact("NoExecute"), "toleration_seconds": knownvalue.Int64Exact(30),
						}),
					})),
				},
			},
			{
				// The API server stores 0.5 as 500m, 1024Mi as 1Gi and 45m as
				// 45m0s; none of that may show up as a change.
				Config: testAccTemplateConfig(ns, "example/sandbox:1"),
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PreApply: []plancheck.PlanCheck{plancheck.ExpectEmptyPlan()},
				},
			},
			{
				ResourceName:      addr,
				ImportState:       true,
				ImportStateId:     ns + "/python",
				ImportStateVerify: true,
				// Imported values come back in canonical spelling; the
				// no-drift step above shows they are equal to these.
				ImportStateVerifyIgnore: []string{"resources.requests.cpu", "resources.limits.memory", "python.max_timeout"},
			},
			{
				// Out-of-band edit: the next plan updates it back.
				PreConfig: func() {
					mutate(t, c, key, func(o *agentboxv1alpha1.SandboxTemplate) {
						o.Spec.Image = "someone/else:2"
						o.Spec.Tolerations = o.Spec.Tolerations[:1]
					})
				},
				Config: testAccTemplateConfig(ns, "example/sandbox:1"),
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PreApply: []plancheck.PlanCheck{plancheck.ExpectResourceAction(addr, plancheck.ResourceActionUpdate)},
				},
				ConfigStateChecks: []statecheck.StateCheck{
					statecheck.ExpectKnownValue(addr, tfjsonpath.New("image"), knownvalue.StringExact("example/sandbox:1")),
					statecheck.ExpectKnownValue(addr, tfjsonpath.New("tolerations").AtSliceIndex(1).AtMapKey("key"), knownvalue.StringExact("spot")),
				},
			},
			{
				// Disappears: deleted out of band, the next plan creates it.
				PreConfig: func() {
					if err := c.Delete(context.Background(), &agentboxv1alpha1.SandboxTemplate{ObjectMeta: objectMeta(key)}); err != nil {
						t.Fatal(err)
					}
				},
				Config: testAccTemplateConfig(ns, "example/sandbox:1"),
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PreApply: []plancheck.PlanCheck{plancheck.ExpectResourceAction(addr, plancheck.ResourceActionCreate)},
				},
			},
		},
	})
}

// TestAccSandboxTemplate_mountPathsAndUser: a workspace or secret files on
// a folder the platform mounts is refused by the plan, secret files inside
// the workspace by the API server at apply, and run_as_image_user reaches
// the template.
func TestAccSandboxTemplate_mountPathsAndUser(t *testing.T) {
	t.Parallel()
	c, ns := testAccCluster(t)
	config := func(body string) string {
		return testAccProviderConfig() + fmt.Sprintf(`
resource "agentbox_sandbox_template" "test" {
  name      = "paths"
  namespace = %q
  %s
}
`, ns, body)
	}
	resource.Test(t, resource.TestCase{
		ProtoV6ProviderFactories: testAccProtoV6ProviderFactories,
		Steps: []resource.TestStep{
			{
				Config:      config(`workspace = { mount_path = "/tmp" }`),
				PlanOnly:    true,
				ExpectError: regexp.MustCompile(`/tmp is the platform's`),
			},
			{
				Config:      config(`secret_files = [{ secret_name = "keys", mount_path = "/etc/agentbox/tls/mine" }]`),
				PlanOnly:    true,
				ExpectError: regexp.MustCompile(`/etc/agentbox/tls is the platform's`),
			},
			{
				Config:      config(`checkpoint_interval = "5s"`),
				PlanOnly:    true,
				ExpectError: regexp.MustCompile(`shorter than 10s`),
			},
			{
				Config:      config(`checkpoints_kept = 11`),
				PlanOnly:    true,
				ExpectError: regexp.MustCompile(`(?s)checkpoints_kept.*between 1 and 10`),
			},
			{
				Config:      config(`mcp_servers = [{ name = "both", command = "mcp", url = "https://mcp.example.test/mcp" }]`),
				PlanOnly:    true,
				ExpectError: regexp.MustCompile(`(?s)Invalid Attribute Combination.*command.*url`),
			},
			{
				Config:      config(`mcp_servers = [{ name = "neither" }]`),
				PlanOnly:    true,
				ExpectError: regexp.MustCompile(`(?s)Invalid Attribute Combination.*command.*url`),
			},
			{
				Config:      config(`mcp_servers = [{ name = "remote", url = "https://mcp.example.test/mcp", args = ["-v"] }]`),
				PlanOnly:    true,
				ExpectError: regexp.MustCompile(`(?s)Invalid Attribute Combination.*url.*cannot be specified when.*args`),
			},
			{
				Config:      config(`mcp_servers = [{ name = "remote", url = "ftp://mcp.example.test/mcp" }]`),
				PlanOnly:    true,
				ExpectError: regexp.MustCompile(`scheme "ftp" is not http or https`),
			},
			{
				Config:      config(`secret_files = [{ secret_name = "keys", mount_path = "/workspace/.keys" }]`),
				ExpectError: regexp.MustCompile(`secretFiles may not be mounted in the workspace`),
			},
			{
				Config: config(`run_as_image_user = true
  secret_files = [{ secret_name = "keys", mount_path = "/etc/keys" }]`),
				ConfigStateChecks: []statecheck.StateCheck{
					statecheck.ExpectKnownValue("agentbox_sandbox_template.test", tfjsonpath.New("run_as_image_user"), knownvalue.Bool(true)),
				},
				Check: func(*terraform.State) error {
					var tpl agentboxv1alpha1.SandboxTemplate
					if err := c.Get(context.Background(), types.NamespacedName{Namespace: ns, Name: "paths"}, &tpl); err != nil {
						return err
					}
					if !tpl.Spec.RunAsImageUser {
						return fmt.Errorf("the SandboxTemplate's runAsImageUser is false")
					}
					return nil
				},
			},
			{
				ResourceName:      "agentbox_sandbox_template.test",
				ImportState:       true,
				ImportStateId:     ns + "/paths",
				ImportStateVerify: true,
			},
		},
	})
}

// mutate changes a live object the way someone with kubectl would.
func mutate[T any, PT interface {
	*T
	client.Object
}](t *testing.T, c client.Client, key types.NamespacedName, f func(PT)) {
	t.Helper()
	obj := PT(new(T))
	if err := c.Get(context.Background(), key, obj); err != nil {
		t.Fatal(err)
	}
	f(obj)
	if err := c.Update(context.Background(), obj); err != nil {
		t.Fatal(err)
	}
}
