package provider

import (
	"context"
	"fmt"
	"os"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/terraform-plugin-testing/helper/resource"
	"github.com/hashicorp/terraform-plugin-testing/knownvalue"
	"github.com/hashicorp/terraform-plugin-testing/plancheck"
	"github.com/hashicorp/terraform-plugin-testing/statecheck"
	"github.com/hashicorp/terraform-plugin-testing/terraform"
	"github.com/hashicorp/terraform-plugin-testing/tfjsonpath"
	corev1 "k8s.io/api/core/v1"
	nodev1 "k8s.io/api/node/v1"
	apimeta "k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/util/retry"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/controller/controllerutil"

	agentboxv1alpha1 "github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
)

// testAccPlatformPoolsConfig is the platform with a Managed node pool on the
// test cluster's node, a template that runs on it and a warm pool of that
// template, each waiting for readiness. The runsc installer stays off: the
// test node has its runsc already, and the installer would overwrite it.
func testAccPlatformPoolsConfig(tag, suffix, hostname string, replicas int) string {
	return fmt.Sprintf(`
provider "agentbox" {
  kubernetes = {
    config_path = %[1]q
  }
  namespace = %[2]q
}

resource "agentbox_platform" "this" {
  image_tag = %[3]q
  values    = yamlencode({ runscInstaller = { enabled = false } })
}

resource "agentbox_node_pool" "gvisor" {
  name               = "acc-%[4]s"
  mode               = "Managed"
  runtime_class_name = "gvisor-acc-%[4]s"
  node_selector      = { "kubernetes.io/hostname" = %[5]q }
  # PreferNoSchedule under a key of its own: it never keeps other pods off
  # the cluster's only node.
  taint       = { key = "agentbox.test/acc-%[4]s", value = "true", effect = "PreferNoSchedule" }
  tolerations = [{ key = "agentbox.test/acc-%[4]s", operator = "Exists" }]
  overhead    = { cpu = "50m", memory = "32Mi" }

  depends_on = [agentbox_platform.this]
}

resource "agentbox_sandbox_template" "python" {
  name      = "acc-%[4]s"
  node_pool = agentbox_node_pool.gvisor.name
}

resource "agentbox_warm_pool" "python" {
  name     = "acc-%[4]s"
  template = agentbox_sandbox_template.python.name
  replicas = %[6]d
  timeouts = { create = "8m", update = "8m" }
}
`, os.Getenv(testAccKubeconfigEnv), DefaultNamespace, tag, suffix, hostname, replicas)
}

// testAccPlatformPoolsPrewarmConfig is testAccPlatformPoolsConfig whose
// template's package index is a closed port on the sandbox's own loopback,
// and whose pool pre-warms an environment from it: every build fails (and
// no traffic leaves the pod).
func testAccPlatformPoolsPrewarmConfig(tag, suffix, hostname string, replicas int) string {
	cfg := testAccPlatformPoolsConfig(tag, suffix, hostname, replicas)
	cfg = strings.Replace(cfg, "  node_pool = agentbox_node_pool.gvisor.name\n}",
		"  node_pool = agentbox_node_pool.gvisor.name\n  python    = { index_url = \"http://127.0.0.1:9/simple/\" }\n}", 1)
	return strings.Replace(cfg, "  timeouts = { create = \"8m\", update = \"8m\" }",
		"  timeouts = { create = \"8m\", update = \"8m\" }\n  python_environments = [{ name = \"broken\", requirements = [\"agentbox-no-such-package==1.0\"] }]", 1)
}

// checkPrewarmSettled requires every ready warm sandbox of the pool to be
// done with its pre-warm when the apply returns, here by a failed build
// that names the environment: wait_for_ready counted them only then.
func checkPrewarmSettled(c client.Client, pool string, n int) resource.TestCheckFunc {
	return func(*terraform.State) error {
		var list agentboxv1alpha1.SandboxList
		if err := c.List(context.Background(), &list, client.InNamespace(DefaultNamespace),
			client.MatchingLabels{agentboxv1alpha1.LabelWarmPool: pool}); err != nil {
			return err
		}
		settled := 0
		for _, s := range list.Items {
			if !strings.Contains(s.Annotations[agentboxv1alpha1.AnnotationPrewarmFailed], `environment "broken"`) {
				continue
			}
			settled++
		}
		if settled < n {
			return fmt.Errorf("%d warm sandboxes of %s recorded the failed build of \"broken\" when the apply returned, want %d", settled, pool, n)
		}
		var p agentboxv1alpha1.SandboxWarmPool
		if err := c.Get(context.Background(), types.NamespacedName{Namespace: DefaultNamespace, Name: pool}, &p); err != nil {
			return err
		}
		cond := apimeta.FindStatusCondition(p.Status.Conditions, agentboxv1alpha1.ConditionPythonEnvironmentsReady)
		if cond == nil || cond.Reason != agentboxv1alpha1.ReasonPrewarmFailed || !strings.Contains(cond.Message, `environment "broken"`) {
			return fmt.Errorf("pool %s's PythonEnvironmentsReady is %+v", pool, cond)
		}
		return nil
	}
}

// TestAccWarmPool_withPlatform waits for real readiness: the platform's
// controllers make the node pool Ready on the test node and fill the warm
// pool with gVisor sandboxes, and the apply returns only then.
func TestAccWarmPool_withPlatform(t *testing.T) {
	tag := testAccPlatformImageTag(t)
	c, ns := testAccCluster(t)
	suffix := strings.TrimPrefix(ns, "acc-")
	poolName, rcName, taintKey := "acc-"+suffix, "gvisor-acc-"+suffix, "agentbox.test/acc-"+suffix

	node := testAccRealNode(t, c)
	hostname := node.Labels[corev1.LabelHostname]
	// Whatever happens to the apply, the shared node gets its labels and
	// taint back and no RuntimeClass is left.
	t.Cleanup(func() { cleanupNodePool(t, c, poolName, rcName, node.Name, taintKey) })
	t.Cleanup(func() { cleanupNodePool(t, c, poolName+"-none", rcName+"-none", node.Name, taintKey+"-none") })

	wpAddr, npAddr := "agentbox_warm_pool.python", "agentbox_node_pool.gvisor"
	var start time.Time
	begin := func() { start = time.Now() }
	took := func(what string) resource.TestCheckFunc {
		return func(*terraform.State) error {
			t.Logf("%s: %s", what, time.Since(start).Round(time.Millisecond))
			return nil
		}
	}
	resource.Test(t, resource.TestCase{
		ProtoV6ProviderFactories: testAccProtoV6ProviderFactories,
		Steps: []resource.TestStep{
			{
				PreConfig: begin,
				Config:    testAccPlatformPoolsConfig(tag, suffix, hostname, 1),
				ConfigStateChecks: []statecheck.StateCheck{
					statecheck.ExpectKnownValue(npAddr, tfjsonpath.New("status"), knownvalue.ObjectExact(map[string]knownvalue.Check{
						"nodes": knownvalue.ListExact([]knownvalue.Check{knownvalue.StringExact(node.Name)}), "ready_nodes": knownvalue.Int64Exact(1),
					})),
					statecheck.ExpectKnownValue(wpAddr, tfjsonpath.New("id"), knownvalue.StringExact(DefaultNamespace+"/"+poolName)),
					statecheck.ExpectKnownValue(wpAddr, tfjsonpath.New("status").AtMapKey("ready_replicas"), knownvalue.Int64Exact(1)),
				},
				Check: resource.ComposeTestCheckFunc(
					took("apply of platform, node pool, template and warm pool of 1 (waiting for readiness)"),
					checkWarmSandboxesOn(c, rcName, 1),
					checkNodeLabelled(c, node.Name, poolName, taintKey),
				),
			},
			{
				Config:           testAccPlatformPoolsConfig(tag, suffix, hostname, 1),
				ConfigPlanChecks: resource.ConfigPlanChecks{PreApply: []plancheck.PlanCheck{plancheck.ExpectEmptyPlan()}},
			},
			{
				// Scaling up waits for the new sandbox too.
				PreConfig: begin,
				Config:    testAccPlatformPoolsConfig(tag, suffix, hostname, 2),
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PreApply: []plancheck.PlanCheck{plancheck.ExpectResourceAction(wpAddr, plancheck.ResourceActionUpdate)},
				},
				ConfigStateChecks: []statecheck.StateCheck{
					statecheck.ExpectKnownValue(wpAddr, tfjsonpath.New("status").AtMapKey("ready_replicas"), knownvalue.Int64Exact(2)),
				},
				Check: resource.ComposeTestCheckFunc(took("scale of the warm pool from 1 to 2 (waiting for readiness)"), checkWarmSandboxesOn(c, rcName, 2)),
			},
			{
				// A pool that pre-warms an environment counts a sandbox ready
				// only once its build has settled: here every build fails
				// (the index is a closed loopback port), the sandboxes count
				// all the same, and the apply returns then, with a warning
				// naming the environment.
				PreConfig: begin,
				Config:    testAccPlatformPoolsPrewarmConfig(tag, suffix, hostname, 2),
				ConfigStateChecks: []statecheck.StateCheck{
					statecheck.ExpectKnownValue(wpAddr, tfjsonpath.New("status").AtMapKey("ready_replicas"), knownvalue.Int64Exact(2)),
				},
				Check: resource.ComposeTestCheckFunc(took("pre-warm of a broken environment in a pool of 2 (waiting for its build to settle)"),
					checkPrewarmSettled(c, poolName, 2)),
			},
			{
				ResourceName:            wpAddr,
				ImportState:             true,
				ImportStateId:           DefaultNamespace + "/" + poolName,
				ImportStateVerify:       true,
				ImportStateVerifyIgnore: []string{"wait_for_ready", "timeouts"},
			},
			{
				ResourceName:            npAddr,
				ImportState:             true,
				ImportStateId:           poolName,
				ImportStateVerify:       true,
				ImportStateVerifyIgnore: []string{"wait_for_ready", "timeouts"},
			},
			{
				// A pool that cannot become ready fails the apply within its
				// timeout, and the error says why.
				Config: testAccPlatformPoolsPrewarmConfig(tag, suffix, hostname, 2) + fmt.Sprintf(`
resource "agentbox_node_pool" "none" {
  name               = "%s-none"
  mode               = "Managed"
  runtime_class_name = "%s-none"
  node_selector      = { "agentbox.test/no-such-node" = "true" }
  timeouts           = { create = "20s" }
  depends_on         = [agentbox_platform.this]
}
`, poolName, rcName),
				ExpectError: regexp.MustCompile(`(?s)did not become ready.*NoMatchingNodes`),
			},
		},
		CheckDestroy: func(*terraform.State) error {
			// The platform's finalizer ran before the pool went: the node
			// carries nothing of it.
			var n corev1.Node
			if err := c.Get(context.Background(), types.NamespacedName{Name: node.Name}, &n); err != nil {
				return err
			}
			if v, ok := n.Labels[agentboxv1alpha1.LabelNodePool]; ok && v == poolName {
				return fmt.Errorf("node %s still labelled %s=%s after destroy", n.Name, agentboxv1alpha1.LabelNodePool, v)
			}
			if slices.ContainsFunc(n.Spec.Taints, func(tt corev1.Taint) bool { return tt.Key == taintKey }) {
				return fmt.Errorf("node %s still has taint %s after destroy", n.Name, taintKey)
			}
			return nil
		},
	})
}

// checkWarmSandboxesOn requires n running pods of the node pool's
// RuntimeClass: the warm sandboxes the wait promised.
func checkWarmSandboxesOn(c client.Client, runtimeClass string, n int) resource.TestCheckFunc {
	return func(*terraform.State) error {
		var pods corev1.PodList
		if err := c.List(context.Background(), &pods, client.InNamespace(DefaultNamespace)); err != nil {
			return err
		}
		running := 0
		for _, p := range pods.Items {
			if p.Spec.RuntimeClassName != nil && *p.Spec.RuntimeClassName == runtimeClass && p.Status.Phase == corev1.PodRunning &&
				p.DeletionTimestamp == nil {
				running++
			}
		}
		if running < n {
			return fmt.Errorf("%d running pods with RuntimeClass %s, want at least %d", running, runtimeClass, n)
		}
		return nil
	}
}

func checkNodeLabelled(c client.Client, nodeName, pool, taintKey string) resource.TestCheckFunc {
	return func(*terraform.State) error {
		var n corev1.Node
		if err := c.Get(context.Background(), types.NamespacedName{Name: nodeName}, &n); err != nil {
			return err
		}
		if n.Labels[agentboxv1alpha1.LabelNodePool] != pool {
			return fmt.Errorf("node %s label %s=%q, want %q", nodeName, agentboxv1alpha1.LabelNodePool, n.Labels[agentboxv1alpha1.LabelNodePool], pool)
		}
		if !slices.ContainsFunc(n.Spec.Taints, func(tt corev1.Taint) bool { return tt.Key == taintKey }) {
			return fmt.Errorf("node %s lacks taint %s", nodeName, taintKey)
		}
		return nil
	}
}

// cleanupNodePool removes what a failed run could leave on the shared node:
// the pool (finalizer dropped, since the platform may be gone), its
// RuntimeClass, and its label and taint on the node.
func cleanupNodePool(t *testing.T, c client.Client, pool, runtimeClass, nodeName, taintKey string) {
	ctx := context.Background()
	var p agentboxv1alpha1.GVisorNodePool
	if err := c.Get(ctx, types.NamespacedName{Name: pool}, &p); err == nil {
		patch := client.MergeFrom(p.DeepCopy())
		controllerutil.RemoveFinalizer(&p, agentboxv1alpha1.Finalizer)
		_ = c.Patch(ctx, &p, patch)
		_ = c.Delete(ctx, &p)
	}
	_ = client.IgnoreNotFound(c.Delete(ctx, &nodev1.RuntimeClass{ObjectMeta: metav1.ObjectMeta{Name: runtimeClass}}))
	err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		var n corev1.Node
		if err := c.Get(ctx, types.NamespacedName{Name: nodeName}, &n); err != nil {
			return client.IgnoreNotFound(err)
		}
		patch := client.MergeFromWithOptions(n.DeepCopy(), client.MergeFromWithOptimisticLock{})
		changed := false
		if n.Labels[agentboxv1alpha1.LabelNodePool] == pool {
			delete(n.Labels, agentboxv1alpha1.LabelNodePool)
			delete(n.Annotations, agentboxv1alpha1.AnnotationNodePoolTaint)
			changed = true
		}
		if kept := slices.DeleteFunc(slices.Clone(n.Spec.Taints), func(tt corev1.Taint) bool { return tt.Key == taintKey }); len(kept) != len(n.Spec.Taints) {
			n.Spec.Taints = kept
			changed = true
		}
		if !changed {
			return nil
		}
		return c.Patch(ctx, &n, patch)
	})
	if err != nil {
		t.Errorf("restore node %s: %v", nodeName, err)
	}
}
