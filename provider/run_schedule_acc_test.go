package provider

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/terraform-plugin-testing/helper/resource"
	"github.com/hashicorp/terraform-plugin-testing/knownvalue"
	"github.com/hashicorp/terraform-plugin-testing/statecheck"
	"github.com/hashicorp/terraform-plugin-testing/terraform"
	"github.com/hashicorp/terraform-plugin-testing/tfjsonpath"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/wait"
	"sigs.k8s.io/controller-runtime/pkg/client"

	agentboxv1alpha1 "github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	apiclient "github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
)

// TestAccRunSchedule_onPlatform: schedules applied through Terraform on the
// real platform start runs in a real gVisor sandbox at their cron times,
// recorded in the platform's store and listed by the Compute API by
// schedule:
//   - "forbid" runs `sleep 70` every minute under Forbid: its first run
//     starts at a minute boundary, and the next boundary is skipped while
//     that run still runs, which its status records;
//   - "history" runs `true` every minute keeping one succeeded record: once
//     a second run has succeeded, the first one's record is gone;
//   - "missed" is created suspended with a starting deadline of 5 seconds;
//     unsuspended more than 5 seconds after a boundary it missed, it skips
//     that time as MissedDeadline and starts nothing;
//   - "pool" targets a warm pool: its run leases the pool's sandbox and
//     succeeds in it (run mode pool);
//   - "job" targets a template with the job's options: its run gets a
//     sandbox made from the template, succeeds in it, and the sandbox is
//     deleted after (run mode job). Both are suspended in the second step,
//     so that they make no more sandboxes than they need.
//
// Every wait is for a minute boundary of the real clock: the test takes
// about three minutes beyond the platform's install.
func TestAccRunSchedule_onPlatform(t *testing.T) {
	t.Parallel()
	tag := testAccPlatformImageTag(t)
	c, ns := testAccCluster(t)
	const agent = "scheduled-agent"
	cfg := func(first bool) string {
		return testAccProviderConfig() + fmt.Sprintf(`
resource "agentbox_platform" "this" {
  namespace    = %[1]q
  release_name = "acc-schedules"
  image_tag    = %[2]q
}

resource "agentbox_sandbox_template" "standard" {
  name      = "standard"
  namespace = agentbox_platform.this.namespace
}

resource "agentbox_sandbox" "agent" {
  name      = %[3]q
  namespace = agentbox_platform.this.namespace
  agent_id  = %[3]q
  template  = agentbox_sandbox_template.standard.name
}

resource "agentbox_run_schedule" "forbid" {
  name            = "forbid"
  namespace       = agentbox_platform.this.namespace
  schedule        = "* * * * *"
  agent_id        = agentbox_sandbox.agent.agent_id
  command         = ["sleep", "70"]
  timeout_seconds = 120
}

resource "agentbox_run_schedule" "history" {
  name                          = "history"
  namespace                     = agentbox_platform.this.namespace
  schedule                      = "* * * * *"
  agent_id                      = agentbox_sandbox.agent.agent_id
  command                       = ["sh", "-c", "echo $GREETING"]
  env                           = { GREETING = "hello from a schedule" }
  concurrency_policy            = "Allow"
  successful_runs_history_limit = 1
}

resource "agentbox_run_schedule" "missed" {
  name                      = "missed"
  namespace                 = agentbox_platform.this.namespace
  schedule                  = "* * * * *"
  agent_id                  = agentbox_sandbox.agent.agent_id
  command                   = ["true"]
  starting_deadline_seconds = 5
  suspend                   = %[4]t
}

resource "agentbox_warm_pool" "py" {
  name      = "py"
  namespace = agentbox_platform.this.namespace
  template  = agentbox_sandbox_template.standard.name
  replicas  = 1
}

resource "agentbox_run_schedule" "pool" {
  name      = "pool"
  namespace = agentbox_platform.this.namespace
  schedule  = "* * * * *"
  pool      = agentbox_warm_pool.py.name
  command   = ["sh", "-c", "echo from the pool"]
  suspend   = %[5]t
}

resource "agentbox_run_schedule" "job" {
  name                       = "job"
  namespace                  = agentbox_platform.this.namespace
  schedule                   = "* * * * *"
  template                   = agentbox_sandbox_template.standard.name
  command                    = ["sh", "-c", "echo from a job"]
  backoff_limit              = 1
  active_deadline_seconds    = 600
  ttl_seconds_after_finished = 3600
  suspend                    = %[5]t
}
`, ns, tag, agent, first, !first)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Minute)
	defer cancel()
	key := func(name string) types.NamespacedName { return types.NamespacedName{Namespace: ns, Name: name} }

	resource.Test(t, resource.TestCase{
		ProtoV6ProviderFactories: testAccProtoV6ProviderFactories,
		Steps: []resource.TestStep{
			{
				Config: cfg(true),
				ConfigStateChecks: []statecheck.StateCheck{
					statecheck.ExpectKnownValue("agentbox_run_schedule.forbid", tfjsonpath.New("id"), knownvalue.StringExact(ns+"/forbid")),
					statecheck.ExpectKnownValue("agentbox_run_schedule.forbid", tfjsonpath.New("concurrency_policy"), knownvalue.StringExact("Forbid")),
					statecheck.ExpectKnownValue("agentbox_run_schedule.history", tfjsonpath.New("successful_runs_history_limit"), knownvalue.Int64Exact(1)),
					statecheck.ExpectKnownValue("agentbox_run_schedule.missed", tfjsonpath.New("suspend"), knownvalue.Bool(true)),
					statecheck.ExpectKnownValue("agentbox_run_schedule.pool", tfjsonpath.New("agent_id"), knownvalue.Null()),
					statecheck.ExpectKnownValue("agentbox_run_schedule.job", tfjsonpath.New("backoff_limit"), knownvalue.Int64Exact(1)),
				},
				Check: func(s *terraform.State) error {
					api, err := platformAPI(s, "agentbox_platform.this")
					if err != nil {
						return err
					}
					defer api.CloseIdleConnections()
					// Side by side: the history check must see the
					// schedule's first run before it is pruned.
					history, pool, job := make(chan error, 1), make(chan error, 1), make(chan error, 1)
					go func() { history <- checkHistory(ctx, t, c, api, key("history")) }()
					go func() { pool <- checkTargetRun(ctx, t, c, api, key("pool"), apiclient.RunModePool) }()
					go func() { job <- checkTargetRun(ctx, t, c, api, key("job"), apiclient.RunModeJob) }()
					return errors.Join(checkForbid(ctx, t, c, api, key("forbid")), <-history, <-pool, <-job)
				},
			},
			{
				// Unsuspended at least 10 s after a boundary the schedule
				// missed while suspended: past its 5 s deadline.
				PreConfig: func() {
					if sec := time.Now().Second(); sec < 10 || sec > 50 {
						time.Sleep(time.Duration((70-sec)%60) * time.Second)
					}
				},
				Config: cfg(false),
				ConfigStateChecks: []statecheck.StateCheck{
					statecheck.ExpectKnownValue("agentbox_run_schedule.missed", tfjsonpath.New("suspend"), knownvalue.Bool(false)),
				},
				Check: func(s *terraform.State) error {
					api, err := platformAPI(s, "agentbox_platform.this")
					if err != nil {
						return err
					}
					defer api.CloseIdleConnections()
					return checkMissed(ctx, t, c, api, key("missed"))
				},
			},
		},
	})
}

// waitSchedule polls the schedule until done says it is, for up to limit.
func waitSchedule(ctx context.Context, c client.Client, key types.NamespacedName, limit time.Duration,
	done func(*agentboxv1alpha1.RunSchedule) (bool, error)) (*agentboxv1alpha1.RunSchedule, error) {
	var rs agentboxv1alpha1.RunSchedule
	var last error
	err := wait.PollUntilContextTimeout(ctx, time.Second, limit, true, func(ctx context.Context) (bool, error) {
		if err := c.Get(ctx, key, &rs); err != nil {
			last = err
			return false, nil
		}
		ok, err := done(&rs)
		last = err
		return ok, nil
	})
	if err != nil {
		return &rs, fmt.Errorf("schedule %s: %w (last: %v; status %+v)", key, err, last, rs.Status)
	}
	return &rs, nil
}

// checkForbid: the first run starts at a due time and runs; at the next
// due time, while it still runs, the schedule skips (Forbid).
func checkForbid(ctx context.Context, t *testing.T, c client.Client, api *apiclient.Client, key types.NamespacedName) error {
	rs, err := waitSchedule(ctx, c, key, 3*time.Minute, func(rs *agentboxv1alpha1.RunSchedule) (bool, error) {
		return rs.Status.LastSkipped != nil, nil
	})
	if err != nil {
		return err
	}
	skip := rs.Status.LastSkipped
	if skip.Reason != agentboxv1alpha1.SkipForbid || rs.Status.LastRunID == "" {
		return fmt.Errorf("forbid: status %+v, skipped %+v; want a Forbid skip after a run", rs.Status, skip)
	}
	run, err := api.GetRun(ctx, rs.Status.LastRunID)
	if err != nil {
		return err
	}
	due := skip.Time.Add(-time.Minute)
	if run.Schedule != key.String() || run.Caller != "schedule:"+key.String() || run.Mode != apiclient.RunModeAgent ||
		run.RequestID != "schedule-"+due.UTC().Format("20060102T150405Z") || slices.Compare(run.Command, []string{"sleep", "70"}) != 0 {
		return fmt.Errorf("forbid: the run %+v is not the schedule's for %s", run, due)
	}
	// On time: created after its due time and before the next one.
	if run.CreatedAt.Before(due) || !run.CreatedAt.Before(skip.Time.Time) {
		return fmt.Errorf("forbid: run for %s created at %s", due, run.CreatedAt)
	}
	// The skip was taken while the run was live, and it is still live
	// then: 70 s of sleep outlast the minute.
	if run.Terminal() && (run.FinishedAt == nil || !run.FinishedAt.After(skip.Time.Time)) {
		return fmt.Errorf("forbid: the run had ended (%s at %v) before the skipped time %s", run.Status, run.FinishedAt, skip.Time)
	}
	list, err := api.ListRuns(ctx, apiclient.RunFilter{Schedule: key.String()})
	if err != nil {
		return err
	}
	if len(list.Runs) != 1 || list.Runs[0].ID != run.ID {
		return fmt.Errorf("forbid: runs of the schedule %+v, want only %s", list.Runs, run.ID)
	}
	t.Logf("forbid: run %s created %s after its due time %s; skipped %s: %s", run.ID, run.CreatedAt.Sub(due),
		due.Format(time.RFC3339), skip.Time.Format(time.RFC3339), skip.Message)
	return nil
}

// checkHistory: once a later run of the schedule has succeeded, only its
// record is kept (successful_runs_history_limit 1): the first is deleted.
func checkHistory(ctx context.Context, t *testing.T, c client.Client, api *apiclient.Client, key types.NamespacedName) error {
	var seen []string
	var list *apiclient.RunList
	_, err := waitSchedule(ctx, c, key, 3*time.Minute, func(rs *agentboxv1alpha1.RunSchedule) (bool, error) {
		if id := rs.Status.LastRunID; id != "" && !slices.Contains(seen, id) {
			seen = append(seen, id)
		}
		if len(seen) < 2 {
			return false, fmt.Errorf("runs seen %v", seen)
		}
		var err error
		list, err = api.ListRuns(ctx, apiclient.RunFilter{Schedule: key.String()})
		if err != nil {
			return false, err
		}
		if len(list.Runs) != 1 || list.Runs[0].Status != apiclient.RunSucceeded {
			return false, fmt.Errorf("runs of the schedule: %+v", list.Runs)
		}
		_, err = api.GetRun(ctx, seen[0])
		if apiclient.CodeOf(err) != apiclient.CodeNotFound {
			return false, fmt.Errorf("first run %s: %v, want not found", seen[0], err)
		}
		return true, nil
	})
	if err != nil {
		return err
	}
	kept := list.Runs[0]
	if slices.Compare(kept.EnvNames, []string{"GREETING"}) != 0 || kept.ExitCode == nil || *kept.ExitCode != 0 || kept.OutputBytes == 0 {
		return fmt.Errorf("history: kept run %+v", kept)
	}
	t.Logf("history: runs %v started; the store keeps only %s", seen, kept.ID)
	return nil
}

// checkMissed: unsuspended after its deadline had passed for the latest
// missed time, the schedule records the skip and starts no run.
func checkMissed(ctx context.Context, t *testing.T, c client.Client, api *apiclient.Client, key types.NamespacedName) error {
	rs, err := waitSchedule(ctx, c, key, time.Minute, func(rs *agentboxv1alpha1.RunSchedule) (bool, error) {
		return rs.Status.LastSkipped != nil, nil
	})
	if err != nil {
		return err
	}
	if s := rs.Status.LastSkipped; s.Reason != agentboxv1alpha1.SkipMissedDeadline || rs.Status.LastScheduleTime == nil ||
		rs.Status.LastScheduleTime.Before(&s.Time) {
		return fmt.Errorf("missed: status %+v, skipped %+v", rs.Status, s)
	}
	list, err := api.ListRuns(ctx, apiclient.RunFilter{Schedule: key.String()})
	if err != nil {
		return err
	}
	// The boundary after the unsuspend may have come meanwhile and started
	// a run: that one is for a later time than the skip.
	for _, r := range list.Runs {
		if r.RequestID == "schedule-"+rs.Status.LastSkipped.Time.UTC().Format("20060102T150405Z") {
			return fmt.Errorf("missed: the skipped time has a run %+v", r)
		}
	}
	t.Logf("missed: %s", rs.Status.LastSkipped.Message)
	return nil
}

// checkTargetRun: the schedule of a pool or template target starts a run
// of that mode, with the pool or template of its namespace (and the job's
// options), which succeeds in a sandbox of the pool or made for it, and is
// listed by schedule; a job run's sandbox is deleted once it ends.
func checkTargetRun(ctx context.Context, t *testing.T, c client.Client, api *apiclient.Client, key types.NamespacedName, mode string) error {
	var run *apiclient.Run
	rs, err := waitSchedule(ctx, c, key, 4*time.Minute, func(rs *agentboxv1alpha1.RunSchedule) (bool, error) {
		if rs.Status.LastRunID == "" {
			return false, fmt.Errorf("no run yet")
		}
		var err error
		if run, err = api.GetRun(ctx, rs.Status.LastRunID); err != nil {
			return false, err
		}
		return run.Terminal(), fmt.Errorf("run %s is %s", run.ID, run.Status)
	})
	if err != nil {
		return fmt.Errorf("%s: %w", mode, err)
	}
	if c := readyCondition(rs); c == nil || !strings.Contains(c.Message, "mode "+mode) {
		return fmt.Errorf("%s: Ready %+v does not say the target", mode, c)
	}
	ok := run.Status == apiclient.RunSucceeded && run.Mode == mode && run.Schedule == key.String() &&
		run.Caller == "schedule:"+key.String() && strings.HasPrefix(run.Sandbox, key.Namespace+"/") && run.OutputBytes > 0
	switch mode {
	case apiclient.RunModePool:
		ok = ok && run.Pool == key.Namespace+"/py" && run.Template == ""
	case apiclient.RunModeJob:
		ok = ok && run.Template == key.Namespace+"/standard" && run.Pool == "" && run.BackoffLimit == 1 &&
			run.ActiveDeadlineSeconds == 600 && run.TTLSecondsAfterFinished != nil && *run.TTLSecondsAfterFinished == 3600
	}
	if !ok {
		return fmt.Errorf("%s: run %+v", mode, run)
	}
	list, err := api.ListRuns(ctx, apiclient.RunFilter{Schedule: key.String()})
	if err != nil {
		return err
	}
	if !slices.ContainsFunc(list.Runs, func(r apiclient.Run) bool { return r.ID == run.ID }) {
		return fmt.Errorf("%s: runs of the schedule %+v miss %s", mode, list.Runs, run.ID)
	}
	if mode == apiclient.RunModeJob {
		ns, name, _ := strings.Cut(run.Sandbox, "/")
		err := wait.PollUntilContextTimeout(ctx, time.Second, time.Minute, true, func(ctx context.Context) (bool, error) {
			var sb agentboxv1alpha1.Sandbox
			err := c.Get(ctx, types.NamespacedName{Namespace: ns, Name: name}, &sb)
			return apierrors.IsNotFound(err), nil
		})
		if err != nil {
			return fmt.Errorf("job: the run's sandbox %s is not deleted a minute after it ended: %w", run.Sandbox, err)
		}
	}
	t.Logf("%s: run %s of %s succeeded in sandbox %s (%d bytes of output); Ready: %s", mode, run.ID, key, run.Sandbox,
		run.OutputBytes, readyCondition(rs).Message)
	return nil
}

func readyCondition(rs *agentboxv1alpha1.RunSchedule) *metav1.Condition {
	for i := range rs.Status.Conditions {
		if rs.Status.Conditions[i].Type == agentboxv1alpha1.ConditionReady {
			return &rs.Status.Conditions[i]
		}
	}
	return nil
}
