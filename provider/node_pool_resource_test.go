package provider

import (
	"context"
	"fmt"
	"regexp"
	"strings"
	"testing"

	"github.com/hashicorp/terraform-plugin-testing/helper/resource"
	"github.com/hashicorp/terraform-plugin-testing/knownvalue"
	"github.com/hashicorp/terraform-plugin-testing/plancheck"
	"github.com/hashicorp/terraform-plugin-testing/statecheck"
	"github.com/hashicorp/terraform-plugin-testing/terraform"
	"github.com/hashicorp/terraform-plugin-testing/tfjsonpath"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"

	agentboxv1alpha1 "github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
)

// The lifecycle of the Terraform resource against the API server alone: no
// control plane acts on the pool (its selector matches no node anyway), so
// it is created without waiting, and the test writes the status the way the
// controller would. TestAccWarmPool_withPlatform runs a pool that the
// platform makes ready.
func testAccNodePoolConfig(name, body string) string {
	return testAccProviderConfig() + fmt.Sprintf(`
resource "agentbox_node_pool" "test" {
  name           = %q
  wait_for_ready = false
%s
}
`, name, body)
}

func managedPoolBody(selector, overheadCPU string) string {
	return fmt.Sprintf(`
  mode               = "Managed"
  runtime_class_name = "gvisor-acc"
  node_selector      = { "agentbox.test/pool" = %q }
  taint              = { key = "agentbox.test/sandbox", value = "true", effect = "PreferNoSchedule" }
  tolerations = [
    { key = "agentbox.test/sandbox", operator = "Equal", value = "true", effect = "PreferNoSchedule" },
    { operator = "Exists", effect = "NoExecute", toleration_seconds = 60 },
  ]
  overhead = { cpu = %q, memory = "32Mi" }
`, selector, overheadCPU)
}

func TestAccNodePool_lifecycle(t *testing.T) {
	c, ns := testAccCluster(t)
	name := ns + "-np"
	addr := "agentbox_node_pool.test"
	key := types.NamespacedName{Name: name}
	t.Cleanup(func() { deleteNodePool(t, c, name) })
	t.Cleanup(func() { deleteNodePool(t, c, name+"-2") })
	resource.Test(t, resource.TestCase{
		ProtoV6ProviderFactories: testAccProtoV6ProviderFactories,
		Steps: []resource.TestStep{
			{
				// 0.05 CPU is stored as 50m: no diff may come of it.
				Config: testAccNodePoolConfig(name, managedPoolBody(ns, "0.05")),
				ConfigStateChecks: []statecheck.StateCheck{
					statecheck.ExpectKnownValue(addr, tfjsonpath.New("id"), knownvalue.StringExact(name)),
					statecheck.ExpectKnownValue(addr, tfjsonpath.New("mode"), knownvalue.StringExact("Managed")),
					statecheck.ExpectKnownValue(addr, tfjsonpath.New("runtime_class_name"), knownvalue.StringExact("gvisor-acc")),
					statecheck.ExpectKnownValue(addr, tfjsonpath.New("node_selector"), knownvalue.MapExact(map[string]knownvalue.Check{
						"agentbox.test/pool": knownvalue.StringExact(ns),
					})),
					statecheck.ExpectKnownValue(addr, tfjsonpath.New("taint").AtMapKey("effect"), knownvalue.StringExact("PreferNoSchedule")),
					statecheck.ExpectKnownValue(addr, tfjsonpath.New("tolerations").AtSliceIndex(1).AtMapKey("toleration_seconds"), knownvalue.Int64Exact(60)),
					statecheck.ExpectKnownValue(addr, tfjsonpath.New("tolerations").AtSliceIndex(1).AtMapKey("key"), knownvalue.Null()),
					statecheck.ExpectKnownValue(addr, tfjsonpath.New("overhead").AtMapKey("cpu"), knownvalue.StringExact("0.05")),
					statecheck.ExpectKnownValue(addr, tfjsonpath.New("status"), knownvalue.ObjectExact(map[string]knownvalue.Check{
						"nodes": knownvalue.ListExact([]knownvalue.Check{}), "ready_nodes": knownvalue.Int64Exact(0),
					})),
				},
				Check: checkNodePool(c, key, func(p *agentboxv1alpha1.GVisorNodePool) error {
					if p.Spec.Taint == nil || p.Spec.Taint.Key != "agentbox.test/sandbox" || len(p.Spec.Tolerations) != 2 ||
						p.Spec.Overhead.Cpu().MilliValue() != 50 || p.Spec.Overhead.Memory().String() != "32Mi" {
						return fmt.Errorf("spec %+v", p.Spec)
					}
					return nil
				}),
			},
			{
				Config:           testAccNodePoolConfig(name, managedPoolBody(ns, "0.05")),
				ConfigPlanChecks: resource.ConfigPlanChecks{PreApply: []plancheck.PlanCheck{plancheck.ExpectEmptyPlan()}},
			},
			{
				ResourceName:      addr,
				ImportState:       true,
				ImportStateId:     name,
				ImportStateVerify: true,
				// Terraform's own settings, and the quantity in canonical
				// spelling (the empty plan above shows it is equal).
				ImportStateVerifyIgnore: []string{"wait_for_ready", "timeouts", "overhead.cpu"},
			},
			{
				// Status written by the controller is refreshed into state
				// but never plans a change.
				PreConfig: func() {
					pool := getObject[agentboxv1alpha1.GVisorNodePool](t, c, key)
					pool.Status = agentboxv1alpha1.GVisorNodePoolStatus{Nodes: []string{"node-a", "node-b"}, ReadyNodes: 1, ObservedGeneration: pool.Generation}
					if err := c.Status().Update(context.Background(), pool); err != nil {
						t.Fatal(err)
					}
				},
				Config:           testAccNodePoolConfig(name, managedPoolBody(ns, "0.05")),
				ConfigPlanChecks: resource.ConfigPlanChecks{PreApply: []plancheck.PlanCheck{plancheck.ExpectEmptyPlan()}},
				ConfigStateChecks: []statecheck.StateCheck{
					statecheck.ExpectKnownValue(addr, tfjsonpath.New("status"), knownvalue.ObjectExact(map[string]knownvalue.Check{
						"nodes":       knownvalue.ListExact([]knownvalue.Check{knownvalue.StringExact("node-a"), knownvalue.StringExact("node-b")}),
						"ready_nodes": knownvalue.Int64Exact(1),
					})),
				},
			},
			{
				// In place: every spec field can change without replacing
				// the pool; the platform moves labels, taint and RuntimeClass.
				Config: testAccNodePoolConfig(name, `
  mode               = "GKE"
  node_selector      = { "cloud.google.com/gke-nodepool" = "sandbox" }
  overhead           = { cpu = "100m" }
`),
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PreApply: []plancheck.PlanCheck{plancheck.ExpectResourceAction(addr, plancheck.ResourceActionUpdate)},
				},
				ConfigStateChecks: []statecheck.StateCheck{
					statecheck.ExpectKnownValue(addr, tfjsonpath.New("runtime_class_name"), knownvalue.StringExact("gvisor")),
					statecheck.ExpectKnownValue(addr, tfjsonpath.New("taint"), knownvalue.Null()),
					statecheck.ExpectKnownValue(addr, tfjsonpath.New("tolerations"), knownvalue.Null()),
				},
				Check: checkNodePool(c, key, func(p *agentboxv1alpha1.GVisorNodePool) error {
					if p.Spec.Mode != agentboxv1alpha1.GVisorNodePoolModeGKE || p.Spec.RuntimeClassName != "gvisor" || p.Spec.Taint != nil ||
						len(p.Spec.Tolerations) != 0 || p.Spec.Overhead.Cpu().MilliValue() != 100 || p.Spec.Overhead.Memory().Value() != 0 {
						return fmt.Errorf("spec %+v", p.Spec)
					}
					return nil
				}),
			},
			{
				// Out-of-band edit: the plan shows it, the apply repairs it.
				PreConfig: func() {
					mutate(t, c, key, func(p *agentboxv1alpha1.GVisorNodePool) {
						p.Spec.NodeSelector["extra"] = "label"
						p.Spec.Taint = &corev1.Taint{Key: "someone", Effect: corev1.TaintEffectNoSchedule}
					})
				},
				Config: testAccNodePoolConfig(name, `
  mode               = "GKE"
  node_selector      = { "cloud.google.com/gke-nodepool" = "sandbox" }
  overhead           = { cpu = "100m" }
`),
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PreApply: []plancheck.PlanCheck{plancheck.ExpectResourceAction(addr, plancheck.ResourceActionUpdate)},
				},
				Check: checkNodePool(c, key, func(p *agentboxv1alpha1.GVisorNodePool) error {
					if len(p.Spec.NodeSelector) != 1 || p.Spec.Taint != nil {
						return fmt.Errorf("out-of-band edit not repaired: %+v", p.Spec)
					}
					return nil
				}),
			},
			{
				// Disappears: deleted out of band, the next plan creates it.
				PreConfig: func() { deleteNodePool(t, c, name) },
				Config:    testAccNodePoolConfig(name, managedPoolBody(ns, "50m")),
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PreApply: []plancheck.PlanCheck{plancheck.ExpectResourceAction(addr, plancheck.ResourceActionCreate)},
				},
			},
			{
				// The name is immutable: changing it replaces the pool.
				Config: testAccNodePoolConfig(name+"-2", managedPoolBody(ns, "50m")),
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PreApply: []plancheck.PlanCheck{plancheck.ExpectResourceAction(addr, plancheck.ResourceActionDestroyBeforeCreate)},
				},
				Check: checkNodePool(c, types.NamespacedName{Name: name + "-2"}, func(*agentboxv1alpha1.GVisorNodePool) error { return nil }),
			},
		},
		CheckDestroy: func(*terraform.State) error {
			for _, n := range []string{name, name + "-2"} {
				err := c.Get(context.Background(), types.NamespacedName{Name: n}, &agentboxv1alpha1.GVisorNodePool{})
				if !apierrors.IsNotFound(err) {
					return fmt.Errorf("node pool %s after destroy: %v", n, err)
				}
			}
			return nil
		},
	})
}

// TestAccNodePool_invalid: mistakes are reported at plan time, with the fix.
func TestAccNodePool_invalid(t *testing.T) {
	testAccPreCheck(t)
	cases := []struct{ body, want string }{
		{`mode = "Managed"`, `Missing node_selector`},
		{`
  mode          = "Managed"
  node_selector = { "a" = "b" }
  overhead      = { cpu = "lots" }`, `"lots": quantities must match`},
		{`mode = "Kata"`, `value must be one of`},
		{`
  mode          = "Managed"
  node_selector = { "a" = "b" }
  taint         = { key = "k", effect = "Sometimes" }`, `value must be one of`},
	}
	for _, tc := range cases {
		resource.Test(t, resource.TestCase{
			ProtoV6ProviderFactories: testAccProtoV6ProviderFactories,
			Steps: []resource.TestStep{{
				Config:      testAccNodePoolConfig("invalid", tc.body),
				PlanOnly:    true,
				ExpectError: regexp.MustCompile(strings.ReplaceAll(regexp.QuoteMeta(tc.want), ` `, `\s+`)),
			}},
		})
	}
}

func checkNodePool(c client.Client, key types.NamespacedName, check func(*agentboxv1alpha1.GVisorNodePool) error) resource.TestCheckFunc {
	return func(*terraform.State) error {
		var p agentboxv1alpha1.GVisorNodePool
		if err := c.Get(context.Background(), key, &p); err != nil {
			return err
		}
		return check(&p)
	}
}

// deleteNodePool deletes a pool the way kubectl would, and also when a test
// failed halfway: a pool is cluster-scoped and outlives the test namespace.
func deleteNodePool(t *testing.T, c client.Client, name string) {
	t.Helper()
	err := c.Delete(context.Background(), &agentboxv1alpha1.GVisorNodePool{ObjectMeta: metav1.ObjectMeta{Name: name}})
	if err != nil && !apierrors.IsNotFound(err) {
		t.Errorf("delete node pool %s: %v", name, err)
	}
}
