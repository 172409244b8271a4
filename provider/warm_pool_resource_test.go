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
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"

	agentboxv1alpha1 "github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
)

// The lifecycle of the Terraform resource against the API server alone: no
// control plane fills the pool, so it is created without waiting, and the
// test writes the status the way the controller would.
func testAccWarmPoolConfig(ns, name string, replicas int) string {
	return testAccWarmPoolConfigCold(ns, name, replicas, "")
}

// testAccWarmPoolConfigCold sets cold_start_when_exhausted to coldStart,
// or leaves it out when coldStart is "".
func testAccWarmPoolConfigCold(ns, name string, replicas int, coldStart string) string {
	cold := ""
	if coldStart != "" {
		cold = "\n  cold_start_when_exhausted = " + coldStart + "\n"
	}
	return testAccProviderConfig() + fmt.Sprintf(`
resource "agentbox_sandbox_template" "python" {
  name      = "python"
  namespace = %[1]q
}

resource "agentbox_warm_pool" "test" {
  name           = %[2]q
  namespace      = %[1]q
  template       = agentbox_sandbox_template.python.name
  replicas       = %[3]d
  wait_for_ready = false
%[4]s}
`, ns, name, replicas, cold)
}

func TestAccWarmPool_lifecycle(t *testing.T) {
	t.Parallel()
	c, ns := testAccCluster(t)
	addr := "agentbox_warm_pool.test"
	key := types.NamespacedName{Namespace: ns, Name: "python-pool"}
	resource.Test(t, resource.TestCase{
		ProtoV6ProviderFactories: testAccProtoV6ProviderFactories,
		Steps: []resource.TestStep{
			{
				Config: testAccWarmPoolConfig(ns, "python-pool", 2),
				ConfigStateChecks: []statecheck.StateCheck{
					statecheck.ExpectKnownValue(addr, tfjsonpath.New("id"), knownvalue.StringExact(ns+"/python-pool")),
					statecheck.ExpectKnownValue(addr, tfjsonpath.New("namespace"), knownvalue.StringExact(ns)),
					statecheck.ExpectKnownValue(addr, tfjsonpath.New("template"), knownvalue.StringExact("python")),
					statecheck.ExpectKnownValue(addr, tfjsonpath.New("replicas"), knownvalue.Int64Exact(2)),
					statecheck.ExpectKnownValue(addr, tfjsonpath.New("wait_for_ready"), knownvalue.Bool(false)),
					statecheck.ExpectKnownValue(addr, tfjsonpath.New("cold_start_when_exhausted"), knownvalue.Bool(false)),
					statecheck.ExpectKnownValue(addr, tfjsonpath.New("release_policy"), knownvalue.StringExact("Delete")),
					statecheck.ExpectKnownValue(addr, tfjsonpath.New("status"), knownvalue.ObjectExact(map[string]knownvalue.Check{
						"replicas": knownvalue.Int64Exact(0), "ready_replicas": knownvalue.Int64Exact(0), "leased_replicas": knownvalue.Int64Exact(0),
					})),
				},
				Check: checkWarmPoolSpec(t, c, key, "python", 2, false),
			},
			{
				Config:           testAccWarmPoolConfig(ns, "python-pool", 2),
				ConfigPlanChecks: resource.ConfigPlanChecks{PreApply: []plancheck.PlanCheck{plancheck.ExpectEmptyPlan()}},
			},
			{
				ResourceName:      addr,
				ImportState:       true,
				ImportStateId:     ns + "/python-pool",
				ImportStateVerify: true,
				// Terraform's own settings, not stored in the object.
				ImportStateVerifyIgnore: []string{"wait_for_ready", "timeouts"},
			},
			{
				// Status written by the controller is refreshed into state
				// but never plans a change.
				PreConfig: func() {
					pool := getObject[agentboxv1alpha1.SandboxWarmPool](t, c, key)
					pool.Status = agentboxv1alpha1.SandboxWarmPoolStatus{Replicas: 2, ReadyReplicas: 1, LeasedReplicas: 3, ObservedGeneration: pool.Generation}
					if err := c.Status().Update(context.Background(), pool); err != nil {
						t.Fatal(err)
					}
				},
				Config:           testAccWarmPoolConfig(ns, "python-pool", 2),
				ConfigPlanChecks: resource.ConfigPlanChecks{PreApply: []plancheck.PlanCheck{plancheck.ExpectEmptyPlan()}},
				ConfigStateChecks: []statecheck.StateCheck{
					statecheck.ExpectKnownValue(addr, tfjsonpath.New("status"), knownvalue.ObjectExact(map[string]knownvalue.Check{
						"replicas": knownvalue.Int64Exact(2), "ready_replicas": knownvalue.Int64Exact(1), "leased_replicas": knownvalue.Int64Exact(3),
					})),
				},
			},
			{
				// In place: scaling and turning cold starts on do not
				// replace the pool.
				Config: testAccWarmPoolConfigCold(ns, "python-pool", 5, "true"),
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PreApply: []plancheck.PlanCheck{plancheck.ExpectResourceAction(addr, plancheck.ResourceActionUpdate)},
				},
				ConfigStateChecks: []statecheck.StateCheck{
					statecheck.ExpectKnownValue(addr, tfjsonpath.New("replicas"), knownvalue.Int64Exact(5)),
					statecheck.ExpectKnownValue(addr, tfjsonpath.New("cold_start_when_exhausted"), knownvalue.Bool(true)),
				},
				Check: checkWarmPoolSpec(t, c, key, "python", 5, true),
			},
			{
				Config:           testAccWarmPoolConfigCold(ns, "python-pool", 5, "true"),
				ConfigPlanChecks: resource.ConfigPlanChecks{PreApply: []plancheck.PlanCheck{plancheck.ExpectEmptyPlan()}},
			},
			{
				// The import reads cold_start_when_exhausted from the object.
				ResourceName:            addr,
				ImportState:             true,
				ImportStateId:           ns + "/python-pool",
				ImportStateVerify:       true,
				ImportStateVerifyIgnore: []string{"wait_for_ready", "timeouts"},
			},
			{
				// Out-of-band edits (kubectl scale, kubectl edit): the plan
				// shows them, the apply puts Terraform's values back.
				PreConfig: func() {
					mutate(t, c, key, func(p *agentboxv1alpha1.SandboxWarmPool) {
						p.Spec.Replicas = 9
						p.Spec.ColdStartWhenExhausted = false
					})
				},
				Config: testAccWarmPoolConfigCold(ns, "python-pool", 5, "true"),
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PreApply: []plancheck.PlanCheck{
						plancheck.ExpectResourceAction(addr, plancheck.ResourceActionUpdate),
						plancheck.ExpectKnownValue(addr, tfjsonpath.New("replicas"), knownvalue.Int64Exact(5)),
						plancheck.ExpectKnownValue(addr, tfjsonpath.New("cold_start_when_exhausted"), knownvalue.Bool(true)),
					},
				},
				Check: checkWarmPoolSpec(t, c, key, "python", 5, true),
			},
			{
				// Left out again, it goes back to its default.
				Config: testAccWarmPoolConfig(ns, "python-pool", 5),
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PreApply: []plancheck.PlanCheck{plancheck.ExpectResourceAction(addr, plancheck.ResourceActionUpdate)},
				},
				Check: checkWarmPoolSpec(t, c, key, "python", 5, false),
			},
			{
				// Disappears: deleted out of band, the next plan creates it.
				PreConfig: func() {
					if err := c.Delete(context.Background(), &agentboxv1alpha1.SandboxWarmPool{ObjectMeta: objectMeta(key)}); err != nil {
						t.Fatal(err)
					}
				},
				Config: testAccWarmPoolConfig(ns, "python-pool", 5),
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PreApply: []plancheck.PlanCheck{plancheck.ExpectResourceAction(addr, plancheck.ResourceActionCreate)},
				},
				Check: checkWarmPoolSpec(t, c, key, "python", 5, false),
			},
			{
				// The name is immutable: changing it replaces the pool.
				Config: testAccWarmPoolConfig(ns, "python-pool-2", 5),
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PreApply: []plancheck.PlanCheck{plancheck.ExpectResourceAction(addr, plancheck.ResourceActionDestroyBeforeCreate)},
				},
				Check: checkWarmPoolSpec(t, c, types.NamespacedName{Namespace: ns, Name: "python-pool-2"}, "python", 5, false),
			},
		},
	})
}

func TestAccWarmPool_invalid(t *testing.T) {
	t.Parallel()
	_, ns := testAccCluster(t)
	resource.Test(t, resource.TestCase{
		ProtoV6ProviderFactories: testAccProtoV6ProviderFactories,
		Steps: []resource.TestStep{{
			Config:      strings.Replace(testAccWarmPoolConfig(ns, "python-pool", 1), "replicas       = 1", "replicas       = -1", 1),
			PlanOnly:    true,
			ExpectError: regexp.MustCompile(`must\s+be\s+between\s+0\s+and\s+2147483647`),
		}, {
			Config:      testAccWarmPoolConfigEnvs(ns, `[{ requirements = [] }]`),
			PlanOnly:    true,
			ExpectError: regexp.MustCompile(`must\s+contain\s+at\s+least\s+1`),
		}},
	})
}

func checkWarmPoolSpec(t *testing.T, c client.Client, key types.NamespacedName, template string, replicas int32, coldStart bool) resource.TestCheckFunc {
	return func(*terraform.State) error {
		pool := getObject[agentboxv1alpha1.SandboxWarmPool](t, c, key)
		if pool.Spec.TemplateRef.Name != template || pool.Spec.Replicas != replicas || pool.Spec.ColdStartWhenExhausted != coldStart {
			return fmt.Errorf("%s spec: template %q, replicas %d, coldStartWhenExhausted %v; want %q, %d, %v", key,
				pool.Spec.TemplateRef.Name, pool.Spec.Replicas, pool.Spec.ColdStartWhenExhausted, template, replicas, coldStart)
		}
		return nil
	}
}

// testAccWarmPoolConfigEnvs declares python_environments (HCL) on the pool.
func testAccWarmPoolConfigEnvs(ns, envs string) string {
	return testAccProviderConfig() + fmt.Sprintf(`
resource "agentbox_sandbox_template" "python" {
  name      = "python"
  namespace = %[1]q
}

resource "agentbox_warm_pool" "test" {
  name           = "envs-pool"
  namespace      = %[1]q
  template       = agentbox_sandbox_template.python.name
  replicas       = 1
  wait_for_ready = false
  python_environments = %[2]s
}
`, ns, envs)
}

// python_environments through to the pool's spec, in place, imported, and
// put back after an out-of-band edit; no control plane runs, so nothing is
// built.
func TestAccWarmPool_pythonEnvironments(t *testing.T) {
	t.Parallel()
	c, ns := testAccCluster(t)
	addr := "agentbox_warm_pool.test"
	key := types.NamespacedName{Namespace: ns, Name: "envs-pool"}
	two := `[
    { requirements = ["pandas>=2.0", "numpy"] },
    { name = "plots", requirements = ["matplotlib"] },
  ]`
	one := `[{ requirements = ["pandas>=2.0", "numpy"] }]`
	checkEnvs := func(want ...agentboxv1alpha1.WarmPythonEnvironment) resource.TestCheckFunc {
		return func(*terraform.State) error {
			pool := getObject[agentboxv1alpha1.SandboxWarmPool](t, c, key)
			if fmt.Sprint(pool.Spec.PythonEnvironments) != fmt.Sprint(want) {
				return fmt.Errorf("spec.pythonEnvironments %+v, want %+v", pool.Spec.PythonEnvironments, want)
			}
			return nil
		}
	}
	pandas := agentboxv1alpha1.WarmPythonEnvironment{Requirements: []string{"pandas>=2.0", "numpy"}}
	plots := agentboxv1alpha1.WarmPythonEnvironment{Name: "plots", Requirements: []string{"matplotlib"}}
	resource.Test(t, resource.TestCase{
		ProtoV6ProviderFactories: testAccProtoV6ProviderFactories,
		Steps: []resource.TestStep{
			{
				Config: testAccWarmPoolConfigEnvs(ns, two),
				ConfigStateChecks: []statecheck.StateCheck{
					statecheck.ExpectKnownValue(addr, tfjsonpath.New("python_environments"), knownvalue.ListExact([]knownvalue.Check{
						knownvalue.ObjectExact(map[string]knownvalue.Check{"name": knownvalue.Null(),
							"requirements": knownvalue.ListExact([]knownvalue.Check{knownvalue.StringExact("pandas>=2.0"), knownvalue.StringExact("numpy")})}),
						knownvalue.ObjectExact(map[string]knownvalue.Check{"name": knownvalue.StringExact("plots"),
							"requirements": knownvalue.ListExact([]knownvalue.Check{knownvalue.StringExact("matplotlib")})}),
					})),
				},
				Check: checkEnvs(pandas, plots),
			},
			{
				Config:           testAccWarmPoolConfigEnvs(ns, two),
				ConfigPlanChecks: resource.ConfigPlanChecks{PreApply: []plancheck.PlanCheck{plancheck.ExpectEmptyPlan()}},
			},
			{
				ResourceName:            addr,
				ImportState:             true,
				ImportStateId:           ns + "/envs-pool",
				ImportStateVerify:       true,
				ImportStateVerifyIgnore: []string{"wait_for_ready", "timeouts"},
			},
			{
				// In place: the pool builds the change in the sandboxes it has.
				Config: testAccWarmPoolConfigEnvs(ns, one),
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PreApply: []plancheck.PlanCheck{plancheck.ExpectResourceAction(addr, plancheck.ResourceActionUpdate)},
				},
				Check: checkEnvs(pandas),
			},
			{
				PreConfig: func() {
					mutate(t, c, key, func(p *agentboxv1alpha1.SandboxWarmPool) { p.Spec.PythonEnvironments = nil })
				},
				Config: testAccWarmPoolConfigEnvs(ns, one),
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PreApply: []plancheck.PlanCheck{plancheck.ExpectResourceAction(addr, plancheck.ResourceActionUpdate)},
				},
				Check: checkEnvs(pandas),
			},
		},
	})
}

// release_policy: set on create, no drift, imported, changed in place,
// and an out-of-band change is put back.
func TestAccWarmPool_releasePolicy(t *testing.T) {
	t.Parallel()
	c, ns := testAccCluster(t)
	addr := "agentbox_warm_pool.test"
	key := types.NamespacedName{Namespace: ns, Name: "reuse-pool"}
	config := func(policy string) string {
		return testAccProviderConfig() + fmt.Sprintf(`
resource "agentbox_sandbox_template" "python" {
  name      = "python"
  namespace = %[1]q
}

resource "agentbox_warm_pool" "test" {
  name           = "reuse-pool"
  namespace      = %[1]q
  template       = agentbox_sandbox_template.python.name
  replicas       = 0
  wait_for_ready = false
  release_policy = %[2]q
}
`, ns, policy)
	}
	policyIs := func(want agentboxv1alpha1.ReleasePolicy) resource.TestCheckFunc {
		return func(*terraform.State) error {
			if got := getObject[agentboxv1alpha1.SandboxWarmPool](t, c, key).Spec.ReleasePolicy; got != want {
				return fmt.Errorf("spec.releasePolicy %q, want %q", got, want)
			}
			return nil
		}
	}
	resource.Test(t, resource.TestCase{
		ProtoV6ProviderFactories: testAccProtoV6ProviderFactories,
		Steps: []resource.TestStep{
			{
				Config: config("Reuse"),
				ConfigStateChecks: []statecheck.StateCheck{
					statecheck.ExpectKnownValue(addr, tfjsonpath.New("release_policy"), knownvalue.StringExact("Reuse")),
				},
				Check: policyIs(agentboxv1alpha1.ReleasePolicyReuse),
			},
			{
				Config:           config("Reuse"),
				ConfigPlanChecks: resource.ConfigPlanChecks{PreApply: []plancheck.PlanCheck{plancheck.ExpectEmptyPlan()}},
			},
			{
				ResourceName:            addr,
				ImportState:             true,
				ImportStateId:           ns + "/reuse-pool",
				ImportStateVerify:       true,
				ImportStateVerifyIgnore: []string{"wait_for_ready", "timeouts"},
			},
			{
				PreConfig: func() {
					mutate(t, c, key, func(p *agentboxv1alpha1.SandboxWarmPool) { p.Spec.ReleasePolicy = agentboxv1alpha1.ReleasePolicyDelete })
				},
				Config: config("Reuse"),
				ConfigPlanChecks: resource.ConfigPlanChecks{PreApply: []plancheck.PlanCheck{
					plancheck.ExpectResourceAction(addr, plancheck.ResourceActionUpdate),
				}},
				Check: policyIs(agentboxv1alpha1.ReleasePolicyReuse),
			},
			{
				Config: config("Delete"),
				ConfigPlanChecks: resource.ConfigPlanChecks{PreApply: []plancheck.PlanCheck{
					plancheck.ExpectResourceAction(addr, plancheck.ResourceActionUpdate),
				}},
				Check: policyIs(agentboxv1alpha1.ReleasePolicyDelete),
			},
		},
	})
}

// An apply that waited for a pool whose python_environments failed to build
// in a sandbox ends with a warning naming the environment; one that built,
// or whose condition describes an older spec, with none.
func TestWarmPoolPrewarmFailureWarning(t *testing.T) {
	pool := &agentboxv1alpha1.SandboxWarmPool{ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: "p", Generation: 2}}
	cond := func(reason string, gen int64) {
		pool.Status.Conditions = []metav1.Condition{{Type: agentboxv1alpha1.ConditionPythonEnvironmentsReady, Status: metav1.ConditionFalse,
			Reason: reason, ObservedGeneration: gen, Message: `building the python environments failed in 1 warm sandboxes (p-x), which are leased without them: environment "plots": no matching distribution`}}
	}
	cond(agentboxv1alpha1.ReasonPrewarmFailed, 2)
	summary, detail, failed := prewarmFailure(pool)
	if !failed || !strings.Contains(summary, "ns/p") || !strings.Contains(detail, `environment "plots"`) {
		t.Errorf("failed pre-warm: %v %q %q", failed, summary, detail)
	}
	cond(agentboxv1alpha1.ReasonPrewarmFailed, 1)
	if _, _, failed := prewarmFailure(pool); failed {
		t.Error("a condition of an older generation warned")
	}
	cond(agentboxv1alpha1.ReasonPrewarmed, 2)
	if _, _, failed := prewarmFailure(pool); failed {
		t.Error("a built pool warned")
	}
}
