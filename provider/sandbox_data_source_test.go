package provider

import (
	"context"
	"fmt"
	"net/netip"
	"os"
	"regexp"
	"testing"
	"time"

	"github.com/hashicorp/terraform-plugin-testing/helper/resource"
	"github.com/hashicorp/terraform-plugin-testing/knownvalue"
	"github.com/hashicorp/terraform-plugin-testing/statecheck"
	"github.com/hashicorp/terraform-plugin-testing/terraform"
	"github.com/hashicorp/terraform-plugin-testing/tfjsonpath"
	apimeta "k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	agentboxv1alpha1 "github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
)

const testAccSandboxDataAddr = "data.agentbox_sandbox.test"

func testAccSandboxDataSourceConfig(ns, extra string) string {
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
  idle_timeout   = "30m"
  ephemeral      = true
  wait_for_ready = false
}

data "agentbox_sandbox" "test" {
  name      = agentbox_sandbox.test.name
  namespace = agentbox_sandbox.test.namespace
}
%[2]s
`, ns, extra)
}

// TestAccSandboxDataSource reads a sandbox whose status the test writes the
// way the control plane would, so that every status field has a known
// value; TestAccSandboxDataSource_running reads one the platform runs.
func TestAccSandboxDataSource(t *testing.T) {
	t.Parallel()
	c, ns := testAccCluster(t)
	key := types.NamespacedName{Namespace: ns, Name: "agent-1"}
	attr := func(name string, v knownvalue.Check) statecheck.StateCheck {
		return statecheck.ExpectKnownValue(testAccSandboxDataAddr, tfjsonpath.New(name), v)
	}
	at := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	resource.Test(t, resource.TestCase{
		ProtoV6ProviderFactories: testAccProtoV6ProviderFactories,
		Steps: []resource.TestStep{
			{
				Config: testAccSandboxDataSourceConfig(ns, ""),
				ConfigStateChecks: []statecheck.StateCheck{
					attr("id", knownvalue.StringExact(ns+"/agent-1")),
					attr("name", knownvalue.StringExact("agent-1")),
					attr("namespace", knownvalue.StringExact(ns)),
					attr("agent_id", knownvalue.StringExact("agent-1@example.com")),
					attr("template", knownvalue.StringExact("python")),
					attr("idle_timeout", knownvalue.StringExact("30m")),
					attr("ephemeral", knownvalue.Bool(true)),
					// No control plane runs here: nothing is reported yet.
					attr("status", knownvalue.ObjectExact(map[string]knownvalue.Check{
						"phase": knownvalue.Null(), "ready": knownvalue.Bool(false), "reason": knownvalue.Null(),
						"message": knownvalue.Null(), "leased": knownvalue.Bool(false), "pod_name": knownvalue.Null(),
						"pod_ip": knownvalue.Null(), "service_endpoint": knownvalue.Null(), "last_activity_time": knownvalue.Null(),
						"snapshot": knownvalue.Null(),
					})),
				},
			},
			{
				PreConfig: func() {
					sb := getObject[agentboxv1alpha1.Sandbox](t, c, key)
					sb.Status = agentboxv1alpha1.SandboxStatus{
						Phase: agentboxv1alpha1.SandboxPhaseRunning, PodName: "agent-1", PodIP: "192.0.2.10",
						ServiceEndpoint: "https://192.0.2.10:8443", LastActivityTime: &metav1.Time{Time: at},
						Snapshot:           &agentboxv1alpha1.SandboxSnapshot{Name: "agent-1-1", SizeBytes: 1 << 20, ReadyTime: &metav1.Time{Time: at.Add(-time.Hour)}},
						ObservedGeneration: sb.Generation,
					}
					apimeta.SetStatusCondition(&sb.Status.Conditions, metav1.Condition{Type: agentboxv1alpha1.ConditionReady,
						Status: metav1.ConditionTrue, Reason: agentboxv1alpha1.ReasonRunning, Message: "supervisor answers", ObservedGeneration: sb.Generation})
					apimeta.SetStatusCondition(&sb.Status.Conditions, metav1.Condition{Type: agentboxv1alpha1.ConditionLeased,
						Status: metav1.ConditionTrue, Reason: agentboxv1alpha1.ReasonLeaseHeld, Message: "held by worker-7", ObservedGeneration: sb.Generation})
					if err := c.Status().Update(context.Background(), sb); err != nil {
						t.Fatal(err)
					}
				},
				Config: testAccSandboxDataSourceConfig(ns, ""),
				ConfigStateChecks: []statecheck.StateCheck{
					attr("status", knownvalue.ObjectExact(map[string]knownvalue.Check{
						"phase": knownvalue.StringExact("Running"), "ready": knownvalue.Bool(true), "reason": knownvalue.StringExact("Running"),
						"message": knownvalue.StringExact("supervisor answers"), "leased": knownvalue.Bool(true),
						"pod_name": knownvalue.StringExact("agent-1"), "pod_ip": knownvalue.StringExact("192.0.2.10"),
						"service_endpoint":   knownvalue.StringExact("https://192.0.2.10:8443"),
						"last_activity_time": knownvalue.StringExact("2026-01-02T03:04:05Z"),
						"snapshot": knownvalue.ObjectExact(map[string]knownvalue.Check{
							"name": knownvalue.StringExact("agent-1-1"), "size_bytes": knownvalue.Int64Exact(1 << 20),
							"ready_time": knownvalue.StringExact("2026-01-02T02:04:05Z"),
						}),
					})),
				},
			},
			{
				Config: testAccSandboxDataSourceConfig(ns, fmt.Sprintf(`data "agentbox_sandbox" "missing" {
  name      = "nobody"
  namespace = %q
}`, ns)),
				ExpectError: regexp.MustCompile(`sandbox ` + ns + `/nobody not found`),
			},
		},
	})
}

// TestAccSandboxDataSource_running reads a sandbox that the real platform
// runs under gVisor on the test node, and checks the data source against
// the live object.
func TestAccSandboxDataSource_running(t *testing.T) {
	t.Parallel()
	testAccPreCheck(t)
	tag := os.Getenv(testAccImageTagEnv)
	if tag == "" {
		t.Skip(testAccImageTagEnv + " is not set: the agentbox images were not built and imported into the test node " +
			"(TestAccSandboxDataSource covers the data source without them)")
	}
	c, ns := testAccCluster(t)
	key := types.NamespacedName{Namespace: ns, Name: "agent-1"}
	config := testAccProviderConfig() + fmt.Sprintf(`
resource "agentbox_platform" "test" {
  namespace         = %[1]q
  image_tag         = %[2]q
  image_pull_policy = "Never"
}

resource "agentbox_sandbox_template" "python" {
  name       = "python"
  namespace  = %[1]q
  depends_on = [agentbox_platform.test]
}

resource "agentbox_sandbox" "test" {
  name      = "agent-1"
  namespace = %[1]q
  agent_id  = "agent-1@example.com"
  template  = agentbox_sandbox_template.python.name
}

data "agentbox_sandbox" "test" {
  name      = agentbox_sandbox.test.name
  namespace = agentbox_sandbox.test.namespace
}
`, ns, tag)
	// The pod's IP is only known once it runs: the checks compare with the
	// live Sandbox when they run.
	live := func(field func(*agentboxv1alpha1.Sandbox) string) knownvalue.Check {
		return knownvalue.StringFunc(func(v string) error {
			sb := getObject[agentboxv1alpha1.Sandbox](t, c, key)
			if want := field(sb); v != want {
				return fmt.Errorf("%q, want %q as in the Sandbox's status", v, want)
			}
			return nil
		})
	}
	attr := func(path tfjsonpath.Path, v knownvalue.Check) statecheck.StateCheck {
		return statecheck.ExpectKnownValue(testAccSandboxDataAddr, path, v)
	}
	start := time.Now()
	resource.Test(t, resource.TestCase{
		ProtoV6ProviderFactories: testAccProtoV6ProviderFactories,
		Steps: []resource.TestStep{{
			Config: config,
			ConfigStateChecks: []statecheck.StateCheck{
				attr(tfjsonpath.New("agent_id"), knownvalue.StringExact("agent-1@example.com")),
				attr(tfjsonpath.New("idle_timeout"), knownvalue.Null()),
				attr(tfjsonpath.New("status").AtMapKey("phase"), knownvalue.StringExact("Running")),
				attr(tfjsonpath.New("status").AtMapKey("ready"), knownvalue.Bool(true)),
				attr(tfjsonpath.New("status").AtMapKey("reason"), knownvalue.StringRegexp(regexp.MustCompile(`^(Running|AdoptedFromWarmPool)$`))),
				attr(tfjsonpath.New("status").AtMapKey("pod_name"), live(func(sb *agentboxv1alpha1.Sandbox) string { return sb.Status.PodName })),
				attr(tfjsonpath.New("status").AtMapKey("pod_ip"), knownvalue.StringFunc(func(v string) error {
					if _, err := netip.ParseAddr(v); err != nil {
						return err
					}
					return live(func(sb *agentboxv1alpha1.Sandbox) string { return sb.Status.PodIP }).CheckValue(v)
				})),
				attr(tfjsonpath.New("status").AtMapKey("service_endpoint"), live(func(sb *agentboxv1alpha1.Sandbox) string {
					return "https://" + sb.Status.PodIP + ":8443"
				})),
			},
			Check: func(*terraform.State) error {
				t.Logf("platform, template and running sandbox applied and read in %s", time.Since(start).Round(time.Second))
				return nil
			},
		}},
	})
}
