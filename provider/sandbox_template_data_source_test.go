package provider

import (
	"context"
	"fmt"
	"regexp"
	"testing"

	"github.com/hashicorp/terraform-plugin-testing/compare"
	"github.com/hashicorp/terraform-plugin-testing/helper/resource"
	"github.com/hashicorp/terraform-plugin-testing/knownvalue"
	"github.com/hashicorp/terraform-plugin-testing/statecheck"
	"github.com/hashicorp/terraform-plugin-testing/tfjsonpath"
	apimeta "k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"

	agentboxv1alpha1 "github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
)

func testAccTemplateDataSourceConfig(ns, extra string) string {
	return testAccProviderConfig() + fmt.Sprintf(`
resource "agentbox_sandbox_template" "test" {
  name         = "python"
  namespace    = %q
  image        = "example/sandbox:1"
  idle_timeout = "45m"
  env          = { GREETING = "hello" }
  resources    = { requests = { cpu = "0.5" } }
  workspace    = { size = "2Gi" }
  python       = { allowed_packages = ["numpy"] }
  mcp_servers  = [{ name = "files", command = "mcp-files", args = ["--root", "/workspace"] }]
  node_pool    = "sandboxes"
}

data "agentbox_sandbox_template" "test" {
  name      = agentbox_sandbox_template.test.name
  namespace = agentbox_sandbox_template.test.namespace
}
%s
`, ns, extra)
}

func TestAccSandboxTemplateDataSource(t *testing.T) {
	t.Parallel()
	c, ns := testAccCluster(t)
	addr := "data.agentbox_sandbox_template.test"
	key := types.NamespacedName{Namespace: ns, Name: "python"}
	attr := func(path tfjsonpath.Path, v knownvalue.Check) statecheck.StateCheck {
		return statecheck.ExpectKnownValue(addr, path, v)
	}
	status := func(ready bool, reason, message string) statecheck.StateCheck {
		return attr(tfjsonpath.New("status"), knownvalue.ObjectExact(map[string]knownvalue.Check{
			"ready": knownvalue.Bool(ready), "reason": knownvalue.StringExact(reason), "message": knownvalue.StringExact(message),
		}))
	}
	resource.Test(t, resource.TestCase{
		ProtoV6ProviderFactories: testAccProtoV6ProviderFactories,
		Steps: []resource.TestStep{
			{
				Config: testAccTemplateDataSourceConfig(ns, ""),
				ConfigStateChecks: []statecheck.StateCheck{
					attr(tfjsonpath.New("id"), knownvalue.StringExact(ns+"/python")),
					attr(tfjsonpath.New("image"), knownvalue.StringExact("example/sandbox:1")),
					attr(tfjsonpath.New("image_pull_policy"), knownvalue.Null()),
					attr(tfjsonpath.New("runtime_class_name"), knownvalue.StringExact("gvisor")),
					attr(tfjsonpath.New("idle_timeout"), knownvalue.StringExact("45m")),
					attr(tfjsonpath.New("env"), knownvalue.MapExact(map[string]knownvalue.Check{"GREETING": knownvalue.StringExact("hello")})),
					// The data source shows what the cluster stores: 0.5 CPU is 500m.
					attr(tfjsonpath.New("resources"), knownvalue.ObjectExact(map[string]knownvalue.Check{
						"requests": knownvalue.MapExact(map[string]knownvalue.Check{"cpu": knownvalue.StringExact("500m")}),
						"limits":   knownvalue.Null(),
					})),
					attr(tfjsonpath.New("workspace"), knownvalue.ObjectExact(map[string]knownvalue.Check{
						"size": knownvalue.StringExact("2Gi"), "mount_path": knownvalue.StringExact("/workspace"),
						"storage_class_name": knownvalue.Null(), "volume_snapshot_class_name": knownvalue.Null(),
					})),
					attr(tfjsonpath.New("python"), knownvalue.ObjectExact(map[string]knownvalue.Check{
						"default_timeout": knownvalue.StringExact("30s"), "max_timeout": knownvalue.StringExact("2m"),
						"index_url": knownvalue.Null(), "extra_index_urls": knownvalue.Null(), "trusted_hosts": knownvalue.Null(),
						"environments":     knownvalue.Null(),
						"allowed_packages": knownvalue.ListExact([]knownvalue.Check{knownvalue.StringExact("numpy")}),
					})),
					attr(tfjsonpath.New("mcp_servers"), knownvalue.ListExact([]knownvalue.Check{knownvalue.ObjectExact(map[string]knownvalue.Check{
						"name": knownvalue.StringExact("files"), "command": knownvalue.StringExact("mcp-files"),
						"args": knownvalue.ListExact([]knownvalue.Check{knownvalue.StringExact("--root"), knownvalue.StringExact("/workspace")}),
						"env":  knownvalue.Null(), "url": knownvalue.Null(), "audience": knownvalue.Null(),
					})})),
					attr(tfjsonpath.New("secret_files"), knownvalue.Null()),
					attr(tfjsonpath.New("egress_proxy"), knownvalue.Null()),
					attr(tfjsonpath.New("node_pool"), knownvalue.StringExact("sandboxes")),
					attr(tfjsonpath.New("node_selector"), knownvalue.Null()),
					// No control plane runs here, so nothing has reported yet.
					attr(tfjsonpath.New("status"), knownvalue.ObjectExact(map[string]knownvalue.Check{
						"ready": knownvalue.Bool(false), "reason": knownvalue.Null(), "message": knownvalue.Null(),
					})),
					statecheck.CompareValuePairs("agentbox_sandbox_template.test", tfjsonpath.New("workspace"),
						addr, tfjsonpath.New("workspace"), compare.ValuesSame()),
				},
			},
			{
				// What the control plane reports is read on every refresh.
				PreConfig: func() {
					setTemplateReady(t, c, key, metav1.ConditionFalse, agentboxv1alpha1.ReasonNodePoolNotFound,
						`GVisorNodePool "sandboxes" does not exist`, 0)
				},
				Config:            testAccTemplateDataSourceConfig(ns, ""),
				ConfigStateChecks: []statecheck.StateCheck{status(false, "NodePoolNotFound", `GVisorNodePool "sandboxes" does not exist`)},
			},
			{
				PreConfig: func() {
					setTemplateReady(t, c, key, metav1.ConditionTrue, agentboxv1alpha1.ReasonTemplateResolved, "all references resolve", 0)
				},
				Config:            testAccTemplateDataSourceConfig(ns, ""),
				ConfigStateChecks: []statecheck.StateCheck{status(true, "Resolved", "all references resolve")},
			},
			{
				// A Ready condition about an older spec is not ready.
				PreConfig: func() {
					setTemplateReady(t, c, key, metav1.ConditionTrue, agentboxv1alpha1.ReasonTemplateResolved, "all references resolve", -1)
				},
				Config:            testAccTemplateDataSourceConfig(ns, ""),
				ConfigStateChecks: []statecheck.StateCheck{status(false, "Resolved", "all references resolve")},
			},
			{
				// Without a namespace the provider's is used, where there is
				// no such template.
				Config:      testAccTemplateDataSourceConfig(ns, `data "agentbox_sandbox_template" "missing" { name = "python" }`),
				ExpectError: regexp.MustCompile(`sandbox template ` + DefaultNamespace + `/python not found`),
			},
		},
	})
}

// setTemplateReady writes the Ready condition the way the control plane
// would, about the template's generation plus age (0 for the current spec).
func setTemplateReady(t *testing.T, c client.Client, key types.NamespacedName, status metav1.ConditionStatus, reason, message string, age int64) {
	t.Helper()
	tpl := getObject[agentboxv1alpha1.SandboxTemplate](t, c, key)
	apimeta.SetStatusCondition(&tpl.Status.Conditions, metav1.Condition{
		Type: agentboxv1alpha1.ConditionReady, Status: status, Reason: reason, Message: message, ObservedGeneration: tpl.Generation + age,
	})
	tpl.Status.ObservedGeneration = tpl.Generation + age
	if err := c.Status().Update(context.Background(), tpl); err != nil {
		t.Fatal(err)
	}
}
