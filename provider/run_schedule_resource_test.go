package provider

import (
	"context"
	"fmt"
	"regexp"
	"testing"

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

// The lifecycle of the Terraform resource against the API server alone; the
// schedule acting on a real platform is TestAccRunSchedule_onPlatform.
func testAccRunScheduleConfig(ns, name, extra string) string {
	return testAccProviderConfig() + fmt.Sprintf(`
resource "agentbox_run_schedule" "test" {
  name      = %[2]q
  namespace = %[1]q
  schedule  = "*/5 * * * *"
  agent_id  = "agent-1"
  command   = ["sh", "-c", "echo hi"]
%[3]s}
`, ns, name, extra)
}

const runScheduleFull = `
  time_zone                     = "Europe/Berlin"
  env                           = { MODE = "full" }
  cwd                           = "/tmp"
  timeout_seconds               = 120
  concurrency_policy            = "Replace"
  starting_deadline_seconds     = 30
  successful_runs_history_limit = 5
  failed_runs_history_limit     = 2
  suspend                       = true
`

func TestAccRunSchedule_lifecycle(t *testing.T) {
	t.Parallel()
	c, ns := testAccCluster(t)
	addr := "agentbox_run_schedule.test"
	key := types.NamespacedName{Namespace: ns, Name: "report"}
	importStep := resource.TestStep{
		ResourceName: addr, ImportState: true, ImportStateId: ns + "/report", ImportStateVerify: true,
		// Terraform's own setting, not stored in the object, and the
		// status, which a platform of a parallel test may write
		// (NamespaceNotServed) between the apply and the import.
		ImportStateVerifyIgnore: []string{"timeouts", "status"},
	}
	resource.Test(t, resource.TestCase{
		ProtoV6ProviderFactories: testAccProtoV6ProviderFactories,
		Steps: []resource.TestStep{
			{
				Config: testAccRunScheduleConfig(ns, "report", ""),
				ConfigStateChecks: []statecheck.StateCheck{
					statecheck.ExpectKnownValue(addr, tfjsonpath.New("id"), knownvalue.StringExact(ns+"/report")),
					statecheck.ExpectKnownValue(addr, tfjsonpath.New("schedule"), knownvalue.StringExact("*/5 * * * *")),
					statecheck.ExpectKnownValue(addr, tfjsonpath.New("time_zone"), knownvalue.Null()),
					statecheck.ExpectKnownValue(addr, tfjsonpath.New("agent_id"), knownvalue.StringExact("agent-1")),
					statecheck.ExpectKnownValue(addr, tfjsonpath.New("command"), knownvalue.ListExact([]knownvalue.Check{
						knownvalue.StringExact("sh"), knownvalue.StringExact("-c"), knownvalue.StringExact("echo hi")})),
					statecheck.ExpectKnownValue(addr, tfjsonpath.New("env"), knownvalue.Null()),
					statecheck.ExpectKnownValue(addr, tfjsonpath.New("concurrency_policy"), knownvalue.StringExact("Forbid")),
					statecheck.ExpectKnownValue(addr, tfjsonpath.New("starting_deadline_seconds"), knownvalue.Null()),
					statecheck.ExpectKnownValue(addr, tfjsonpath.New("successful_runs_history_limit"), knownvalue.Int64Exact(3)),
					statecheck.ExpectKnownValue(addr, tfjsonpath.New("failed_runs_history_limit"), knownvalue.Int64Exact(1)),
					statecheck.ExpectKnownValue(addr, tfjsonpath.New("suspend"), knownvalue.Bool(false)),
				},
				Check: checkRunScheduleSpec(t, c, key, func(s *agentboxv1alpha1.RunScheduleSpec) error {
					if s.Schedule != "*/5 * * * *" || s.Target.AgentID != "agent-1" || len(s.Command.Argv) != 3 ||
						s.ConcurrencyPolicy != agentboxv1alpha1.ConcurrencyForbid || *s.SuccessfulRunsHistoryLimit != 3 {
						return fmt.Errorf("spec %+v", s)
					}
					return nil
				}),
			},
			{
				Config:           testAccRunScheduleConfig(ns, "report", ""),
				ConfigPlanChecks: resource.ConfigPlanChecks{PreApply: []plancheck.PlanCheck{plancheck.ExpectEmptyPlan()}},
			},
			importStep,
			{
				// Every setting, in place.
				Config: testAccRunScheduleConfig(ns, "report", runScheduleFull),
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PreApply: []plancheck.PlanCheck{plancheck.ExpectResourceAction(addr, plancheck.ResourceActionUpdate)},
				},
				ConfigStateChecks: []statecheck.StateCheck{
					statecheck.ExpectKnownValue(addr, tfjsonpath.New("time_zone"), knownvalue.StringExact("Europe/Berlin")),
					statecheck.ExpectKnownValue(addr, tfjsonpath.New("concurrency_policy"), knownvalue.StringExact("Replace")),
					statecheck.ExpectKnownValue(addr, tfjsonpath.New("starting_deadline_seconds"), knownvalue.Int64Exact(30)),
					statecheck.ExpectKnownValue(addr, tfjsonpath.New("suspend"), knownvalue.Bool(true)),
				},
				Check: checkRunScheduleSpec(t, c, key, func(s *agentboxv1alpha1.RunScheduleSpec) error {
					if s.TimeZone != "Europe/Berlin" || s.Command.Env["MODE"] != "full" || s.Command.Cwd != "/tmp" ||
						s.Command.TimeoutSeconds != 120 || s.ConcurrencyPolicy != agentboxv1alpha1.ConcurrencyReplace ||
						*s.StartingDeadlineSeconds != 30 || *s.SuccessfulRunsHistoryLimit != 5 || *s.FailedRunsHistoryLimit != 2 || !s.Suspend {
						return fmt.Errorf("spec %+v", s)
					}
					return nil
				}),
			},
			{
				Config:           testAccRunScheduleConfig(ns, "report", runScheduleFull),
				ConfigPlanChecks: resource.ConfigPlanChecks{PreApply: []plancheck.PlanCheck{plancheck.ExpectEmptyPlan()}},
			},
			importStep,
			{
				// An out-of-band edit (kubectl edit) shows as drift, and the
				// apply puts Terraform's values back.
				PreConfig: func() {
					mutate(t, c, key, func(rs *agentboxv1alpha1.RunSchedule) {
						rs.Spec.Schedule = "0 * * * *"
						rs.Spec.Suspend = false
					})
				},
				Config: testAccRunScheduleConfig(ns, "report", runScheduleFull),
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PreApply: []plancheck.PlanCheck{
						plancheck.ExpectResourceAction(addr, plancheck.ResourceActionUpdate),
						plancheck.ExpectKnownValue(addr, tfjsonpath.New("schedule"), knownvalue.StringExact("*/5 * * * *")),
					},
				},
				Check: checkRunScheduleSpec(t, c, key, func(s *agentboxv1alpha1.RunScheduleSpec) error {
					if s.Schedule != "*/5 * * * *" || !s.Suspend {
						return fmt.Errorf("spec %+v", s)
					}
					return nil
				}),
			},
			{
				// Left out again, the settings go back to their defaults.
				Config: testAccRunScheduleConfig(ns, "report", ""),
				Check: checkRunScheduleSpec(t, c, key, func(s *agentboxv1alpha1.RunScheduleSpec) error {
					if s.TimeZone != "" || s.Command.Env != nil || s.ConcurrencyPolicy != agentboxv1alpha1.ConcurrencyForbid ||
						s.StartingDeadlineSeconds != nil || *s.FailedRunsHistoryLimit != 1 || s.Suspend {
						return fmt.Errorf("spec %+v", s)
					}
					return nil
				}),
			},
			{
				// Disappears: deleted out of band, the next plan creates it.
				PreConfig: func() {
					if err := c.Delete(context.Background(), &agentboxv1alpha1.RunSchedule{ObjectMeta: objectMeta(key)}); err != nil {
						t.Fatal(err)
					}
				},
				Config: testAccRunScheduleConfig(ns, "report", ""),
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PreApply: []plancheck.PlanCheck{plancheck.ExpectResourceAction(addr, plancheck.ResourceActionCreate)},
				},
				Check: checkRunScheduleSpec(t, c, key, func(*agentboxv1alpha1.RunScheduleSpec) error { return nil }),
			},
			{
				// The name is immutable: changing it replaces the schedule.
				Config: testAccRunScheduleConfig(ns, "report-2", ""),
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PreApply: []plancheck.PlanCheck{plancheck.ExpectResourceAction(addr, plancheck.ResourceActionDestroyBeforeCreate)},
				},
			},
		},
	})
}

// TestAccRunSchedule_invalid: what the control plane could not read is
// refused at plan time, with the rule in the message (which Terraform
// wraps, hence \s+ between words).
func TestAccRunSchedule_invalid(t *testing.T) {
	t.Parallel()
	_, ns := testAccCluster(t)
	cfg := func(schedule, extra string) string {
		return testAccProviderConfig() + fmt.Sprintf(`
resource "agentbox_run_schedule" "bad" {
  name      = "bad"
  namespace = %q
  schedule  = %q
  agent_id  = "agent-1"
  command   = ["true"]
%s
}
`, ns, schedule, extra)
	}
	cfgNoAgent := func(target string) string {
		return testAccProviderConfig() + fmt.Sprintf(`
resource "agentbox_run_schedule" "bad" {
  name      = "bad"
  namespace = %q
  schedule  = "* * * * *"
  command   = ["true"]
%s
}
`, ns, target)
	}
	resource.Test(t, resource.TestCase{
		ProtoV6ProviderFactories: testAccProtoV6ProviderFactories,
		Steps: []resource.TestStep{
			{Config: cfg("0 */5 * * * *", ""), ExpectError: regexp.MustCompile(`five-field\s+cron\s+expression`)},
			{Config: cfg("@every 1m", ""), ExpectError: regexp.MustCompile(`@every\s+is\s+not\s+a\s+cron\s+schedule`)},
			{Config: cfg("CRON_TZ=UTC * * * * *", ""), ExpectError: regexp.MustCompile(`time_zone`)},
			{Config: cfg("* * * * *", `  time_zone = "Mars/Olympus"`), ExpectError: regexp.MustCompile(`unknown\s+time\s+zone\s+Mars/Olympus`)},
			{Config: cfg("* * * * *", `  concurrency_policy = "Sometimes"`), ExpectError: regexp.MustCompile(`Forbid`)},
			{Config: cfg("* * * * *", `  starting_deadline_seconds = 0`), ExpectError: regexp.MustCompile(`at\s+least\s+1`)},
			// Exactly one target, and job options with a template only.
			{Config: cfg("* * * * *", `  pool = "py"`),
				ExpectError: regexp.MustCompile(`Exactly\s+one\s+of\s+.agent_id.,\s+.pool.\s+or\s+.template.\s+must\s+be\s+set(.|\n)*.agent_id.\s+and\s+.pool.\s+are\s+set`)},
			{Config: cfgNoAgent(`  template = "standard"
  pool     = "py"`), ExpectError: regexp.MustCompile(`.pool.\s+and\s+.template.\s+are\s+set`)},
			{Config: cfgNoAgent(""), ExpectError: regexp.MustCompile(`Invalid\s+run\s+schedule\s+target(.|\n)*none\s+is\s+set`)},
			{Config: cfg("* * * * *", `  backoff_limit = 1`), ExpectError: regexp.MustCompile(`"template"\s+must\s+be\s+specified`)},
			{Config: cfgNoAgent(`  pool = "py"
  ttl_seconds_after_finished = 60`), ExpectError: regexp.MustCompile(`"template"\s+must\s+be\s+specified`)},
			{Config: cfgNoAgent(`  template = "standard"
  backoff_limit = 11`), ExpectError: regexp.MustCompile(`between\s+0\s+and\s+10`)},
			{Config: cfgNoAgent(`  template = "standard"
  active_deadline_seconds = 0`), ExpectError: regexp.MustCompile(`active_deadline_seconds`)},
			{Config: cfgNoAgent(`  pool = "team/py"`), ExpectError: regexp.MustCompile(`pool`)},
		},
	})
}

func checkRunScheduleSpec(t *testing.T, c client.Client, key types.NamespacedName, check func(*agentboxv1alpha1.RunScheduleSpec) error) resource.TestCheckFunc {
	return func(*terraform.State) error {
		rs := getObject[agentboxv1alpha1.RunSchedule](t, c, key)
		return check(&rs.Spec)
	}
}

// TestAccRunSchedule_targets: the target moves between a pool, a template
// with the job's options, and an agent, in place, each written to
// spec.target (the job's options in its job block), imported and read
// back without drift; an out-of-band edit of a job option shows as drift.
func TestAccRunSchedule_targets(t *testing.T) {
	t.Parallel()
	c, ns := testAccCluster(t)
	addr := "agentbox_run_schedule.test"
	key := types.NamespacedName{Namespace: ns, Name: "targets"}
	cfg := func(target string) string {
		return testAccProviderConfig() + fmt.Sprintf(`
resource "agentbox_run_schedule" "test" {
  name      = "targets"
  namespace = %[1]q
  schedule  = "*/5 * * * *"
  command   = ["true"]
%[2]s
}
`, ns, target)
	}
	const pool = `  pool = "py"`
	const job = `  template                   = "standard"
  backoff_limit              = 2
  active_deadline_seconds    = 300
  ttl_seconds_after_finished = 0`
	importStep := resource.TestStep{
		ResourceName: addr, ImportState: true, ImportStateId: ns + "/targets", ImportStateVerify: true,
		ImportStateVerifyIgnore: []string{"timeouts", "status"},
	}
	noDrift := func(target string) resource.TestStep {
		return resource.TestStep{Config: cfg(target),
			ConfigPlanChecks: resource.ConfigPlanChecks{PreApply: []plancheck.PlanCheck{plancheck.ExpectEmptyPlan()}}}
	}
	resource.Test(t, resource.TestCase{
		ProtoV6ProviderFactories: testAccProtoV6ProviderFactories,
		Steps: []resource.TestStep{
			{
				Config: cfg(pool),
				ConfigStateChecks: []statecheck.StateCheck{
					statecheck.ExpectKnownValue(addr, tfjsonpath.New("pool"), knownvalue.StringExact("py")),
					statecheck.ExpectKnownValue(addr, tfjsonpath.New("agent_id"), knownvalue.Null()),
					statecheck.ExpectKnownValue(addr, tfjsonpath.New("template"), knownvalue.Null()),
					statecheck.ExpectKnownValue(addr, tfjsonpath.New("backoff_limit"), knownvalue.Null()),
				},
				Check: checkRunScheduleSpec(t, c, key, func(s *agentboxv1alpha1.RunScheduleSpec) error {
					if s.Target != (agentboxv1alpha1.RunScheduleTarget{Pool: "py"}) {
						return fmt.Errorf("target %+v", s.Target)
					}
					return nil
				}),
			},
			noDrift(pool),
			importStep,
			{
				// From the pool to a template with the job's options, in place.
				Config: cfg(job),
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PreApply: []plancheck.PlanCheck{plancheck.ExpectResourceAction(addr, plancheck.ResourceActionUpdate)},
				},
				ConfigStateChecks: []statecheck.StateCheck{
					statecheck.ExpectKnownValue(addr, tfjsonpath.New("pool"), knownvalue.Null()),
					statecheck.ExpectKnownValue(addr, tfjsonpath.New("template"), knownvalue.StringExact("standard")),
					statecheck.ExpectKnownValue(addr, tfjsonpath.New("backoff_limit"), knownvalue.Int64Exact(2)),
					statecheck.ExpectKnownValue(addr, tfjsonpath.New("active_deadline_seconds"), knownvalue.Int64Exact(300)),
					statecheck.ExpectKnownValue(addr, tfjsonpath.New("ttl_seconds_after_finished"), knownvalue.Int64Exact(0)),
				},
				Check: checkRunScheduleSpec(t, c, key, func(s *agentboxv1alpha1.RunScheduleSpec) error {
					tg, j := s.Target, s.Target.Job
					if tg.Template != "standard" || tg.Pool != "" || tg.AgentID != "" || j == nil || j.BackoffLimit == nil ||
						*j.BackoffLimit != 2 || j.ActiveDeadlineSeconds == nil || *j.ActiveDeadlineSeconds != 300 ||
						j.TTLSecondsAfterFinished == nil || *j.TTLSecondsAfterFinished != 0 {
						return fmt.Errorf("target %+v, job %+v", tg, j)
					}
					return nil
				}),
			},
			noDrift(job),
			importStep,
			{
				// An out-of-band edit of a job option shows as drift, and the
				// apply puts Terraform's value back.
				PreConfig: func() {
					mutate(t, c, key, func(rs *agentboxv1alpha1.RunSchedule) { rs.Spec.Target.Job.BackoffLimit = new(int32(5)) })
				},
				Config: cfg(job),
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PreApply: []plancheck.PlanCheck{
						plancheck.ExpectResourceAction(addr, plancheck.ResourceActionUpdate),
						plancheck.ExpectKnownValue(addr, tfjsonpath.New("backoff_limit"), knownvalue.Int64Exact(2)),
					},
				},
				Check: checkRunScheduleSpec(t, c, key, func(s *agentboxv1alpha1.RunScheduleSpec) error {
					if j := s.Target.Job; j == nil || j.BackoffLimit == nil || *j.BackoffLimit != 2 {
						return fmt.Errorf("job %+v", j)
					}
					return nil
				}),
			},
			{
				// Back to an agent: the template and the job block go.
				Config: cfg(`  agent_id = "agent-1"`),
				Check: checkRunScheduleSpec(t, c, key, func(s *agentboxv1alpha1.RunScheduleSpec) error {
					if s.Target != (agentboxv1alpha1.RunScheduleTarget{AgentID: "agent-1"}) {
						return fmt.Errorf("target %+v", s.Target)
					}
					return nil
				}),
			},
			noDrift(`  agent_id = "agent-1"`),
		},
	})
}
