package provider

import (
	"context"
	"fmt"
	"regexp"
	"testing"

	"github.com/hashicorp/terraform-plugin-testing/helper/resource"
	"github.com/hashicorp/terraform-plugin-testing/knownvalue"
	"github.com/hashicorp/terraform-plugin-testing/statecheck"
	"github.com/hashicorp/terraform-plugin-testing/tfjsonpath"
	apimeta "k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	agentboxv1alpha1 "github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
)

func testAccNodePoolDataSourceConfig(name, ns, extra string) string {
	return testAccNodePoolConfig(name, managedPoolBody(ns, "0.05")) + `
data "agentbox_node_pool" "test" {
  name = agentbox_node_pool.test.name
}
` + extra
}

// TestAccNodePoolDataSource reads a pool whose status the test writes the
// way the control plane would (see TestAccNodePool_lifecycle).
func TestAccNodePoolDataSource(t *testing.T) {
	c, ns := testAccCluster(t)
	name := ns + "-np"
	addr := "data.agentbox_node_pool.test"
	t.Cleanup(func() { deleteNodePool(t, c, name) })
	attr := func(path tfjsonpath.Path, v knownvalue.Check) statecheck.StateCheck {
		return statecheck.ExpectKnownValue(addr, path, v)
	}
	resource.Test(t, resource.TestCase{
		ProtoV6ProviderFactories: testAccProtoV6ProviderFactories,
		Steps: []resource.TestStep{
			{
				Config: testAccNodePoolDataSourceConfig(name, ns, ""),
				ConfigStateChecks: []statecheck.StateCheck{
					attr(tfjsonpath.New("id"), knownvalue.StringExact(name)),
					attr(tfjsonpath.New("mode"), knownvalue.StringExact("Managed")),
					attr(tfjsonpath.New("runtime_class_name"), knownvalue.StringExact("gvisor-acc")),
					attr(tfjsonpath.New("node_selector"), knownvalue.MapExact(map[string]knownvalue.Check{
						"agentbox.test/pool": knownvalue.StringExact(ns),
					})),
					attr(tfjsonpath.New("taint"), knownvalue.ObjectExact(map[string]knownvalue.Check{
						"key": knownvalue.StringExact("agentbox.test/sandbox"), "value": knownvalue.StringExact("true"),
						"effect": knownvalue.StringExact("PreferNoSchedule"),
					})),
					attr(tfjsonpath.New("tolerations"), knownvalue.ListExact([]knownvalue.Check{
						knownvalue.ObjectExact(map[string]knownvalue.Check{
							"key": knownvalue.StringExact("agentbox.test/sandbox"), "operator": knownvalue.StringExact("Equal"),
							"value": knownvalue.StringExact("true"), "effect": knownvalue.StringExact("PreferNoSchedule"),
							"toleration_seconds": knownvalue.Null(),
						}),
						knownvalue.ObjectExact(map[string]knownvalue.Check{
							"key": knownvalue.Null(), "operator": knownvalue.StringExact("Exists"), "value": knownvalue.Null(),
							"effect": knownvalue.StringExact("NoExecute"), "toleration_seconds": knownvalue.Int64Exact(60),
						}),
					})),
					// What the cluster stores: 0.05 CPU is 50m.
					attr(tfjsonpath.New("overhead"), knownvalue.MapExact(map[string]knownvalue.Check{
						"cpu": knownvalue.StringExact("50m"), "memory": knownvalue.StringExact("32Mi"),
					})),
					attr(tfjsonpath.New("status"), knownvalue.ObjectExact(map[string]knownvalue.Check{
						"nodes": knownvalue.ListExact([]knownvalue.Check{}), "ready_nodes": knownvalue.Int64Exact(0),
						"ready": knownvalue.Bool(false), "reason": knownvalue.Null(), "message": knownvalue.Null(),
					})),
				},
			},
			{
				PreConfig: func() {
					pool := getObject[agentboxv1alpha1.GVisorNodePool](t, c, types.NamespacedName{Name: name})
					pool.Status = agentboxv1alpha1.GVisorNodePoolStatus{Nodes: []string{"node-a", "node-b"}, ReadyNodes: 1, ObservedGeneration: pool.Generation}
					apimeta.SetStatusCondition(&pool.Status.Conditions, metav1.Condition{Type: agentboxv1alpha1.ConditionReady,
						Status: metav1.ConditionTrue, Reason: agentboxv1alpha1.ReasonNodesReady, Message: "1 of 2 selected nodes can run gVisor pods",
						ObservedGeneration: pool.Generation})
					if err := c.Status().Update(context.Background(), pool); err != nil {
						t.Fatal(err)
					}
				},
				Config: testAccNodePoolDataSourceConfig(name, ns, ""),
				ConfigStateChecks: []statecheck.StateCheck{
					attr(tfjsonpath.New("status"), knownvalue.ObjectExact(map[string]knownvalue.Check{
						"nodes":       knownvalue.ListExact([]knownvalue.Check{knownvalue.StringExact("node-a"), knownvalue.StringExact("node-b")}),
						"ready_nodes": knownvalue.Int64Exact(1), "ready": knownvalue.Bool(true), "reason": knownvalue.StringExact("NodesReady"),
						"message": knownvalue.StringExact("1 of 2 selected nodes can run gVisor pods"),
					})),
				},
			},
			{
				Config:      testAccNodePoolDataSourceConfig(name, ns, fmt.Sprintf(`data "agentbox_node_pool" "missing" { name = "%s-none" }`, ns)),
				ExpectError: regexp.MustCompile(`node pool ` + ns + `-none not found`),
			},
		},
	})
}
