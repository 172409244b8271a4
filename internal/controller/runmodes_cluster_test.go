package controller

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	"github.com/agentbox/terraform-provider-agentbox/internal/computeapi"
	apiclient "github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
	"github.com/agentbox/terraform-provider-agentbox/internal/store"
)

// TestRunModesOnCluster runs pool and job runs through the Compute API on
// real gVisor sandboxes, recorded in the real store:
//
//   - a pool run takes a ready sandbox of a warm pool, and the sandbox is
//     recycled after it (the pool refills with another); a cancelled pool
//     run's sandbox goes too;
//   - a job run that fails twice and succeeds on its third attempt, in the
//     one sandbox made for it (a counter file in /workspace counts the
//     attempts, AGENTBOX_RUN_ATTEMPT numbers them), with the backoff
//     between attempts in its attempt records, and the sandbox deleted
//     after;
//   - an active deadline that kills a job's command (timed_out,
//     DeadlineExceeded), a cancelled job run, and a job run whose record
//     goes after its TTL;
//   - never stuck, never leaked: a pool run and a job run whose executor
//     died are failed by the sweeper, which releases the pool lease (the
//     sandbox is recycled long before the lease's TTL) and deletes the
//     job's sandbox, and a job sandbox whose run is missing is deleted;
//   - the CLI starts a job run and shows a run's attempts.
func TestRunModesOnCluster(t *testing.T) {
	t.Parallel()
	image := os.Getenv(EnvSandboxImage)
	if image == "" {
		t.Skipf("%s is not set: a run is a real command in a real sandbox", EnvSandboxImage)
	}
	var supervisors *computeapi.SupervisorPool
	st, err := store.Open(context.Background(), filepath.Join(t.TempDir(), "agentbox.db"), store.Options{})
	must(t, err)
	t.Cleanup(func() { st.Close() })
	e := newClusterEnv(t, withSnapshots(t, nil, &supervisors), func(r *SandboxReconciler) { r.WarmTakes = st })
	api := e.computeAPIWithStore(supervisors, st, func(o *computeapi.Options) {
		// Runs are lost after 3 s without a heartbeat, and the sweeper
		// looks twice a second; retries wait 1 s, then 2 s.
		o.RunHeartbeatInterval = time.Second
		o.RunSweepInterval = 500 * time.Millisecond
		o.RunRetryBackoff, o.RunRetryBackoffMax = time.Second, 30*time.Second
	})
	ctx := e.ctx
	// The pool has a template of its own, so that the jobs' sandboxes
	// (made from "tpl") do not adopt its warm ones.
	for _, name := range []string{"tpl", "warm"} {
		e.template(name, func(tpl *v1alpha1.SandboxTemplate) {
			tpl.Spec.Image = image
			tpl.Spec.IdleTimeout = metav1.Duration{Duration: time.Hour}
		})
	}
	must(t, e.c.Create(ctx, &v1alpha1.SandboxWarmPool{
		ObjectMeta: metav1.ObjectMeta{Name: "pool", Namespace: e.ns},
		Spec:       v1alpha1.SandboxWarmPoolSpec{TemplateRef: v1alpha1.LocalObjectReference{Name: "warm"}, Replicas: 1},
	}))
	tpl := e.ns + "/tpl"
	wait := func(id string) *apiclient.Run {
		t.Helper()
		wctx, cancel := context.WithTimeout(ctx, 2*waitTimeout)
		defer cancel()
		r, err := api.WaitRun(wctx, id, 200*time.Millisecond)
		must(t, err)
		return r
	}
	start := func(req apiclient.StartRunRequest) *apiclient.Run {
		t.Helper()
		r, created, err := api.StartRun(ctx, req)
		if err != nil || !created {
			t.Fatalf("start %+v: %+v, created %v, %v", req, r, created, err)
		}
		return r
	}
	sandboxName := func(r *apiclient.Run) string {
		t.Helper()
		ns, name, ok := strings.Cut(r.Sandbox, "/")
		if !ok || ns != e.ns {
			t.Fatalf("run %s is in sandbox %q, not one of namespace %s", r.ID, r.Sandbox, e.ns)
		}
		return name
	}

	// The job runs go on in the control plane while the pool is tested.
	// The retried one fails until its third attempt, and only if its two
	// failed attempts left their count in the workspace: the retries
	// share the job's sandbox.
	retried := start(apiclient.StartRunRequest{Mode: apiclient.RunModeJob, Template: tpl, BackoffLimit: 3, TimeoutSeconds: 60,
		Command: []string{"sh", "-c", `n=$(cat /workspace/count 2>/dev/null || echo 0); n=$((n+1)); echo $n > /workspace/count
echo "attempt $AGENTBOX_RUN_ATTEMPT, count $n"; [ "$AGENTBOX_RUN_ATTEMPT" -ge 3 ] && [ "$n" -ge 3 ]`}})
	if retried.AgentID != retried.ID || retried.Template != tpl || retried.BackoffLimit != 3 {
		t.Fatalf("job run recorded as %+v", retried)
	}
	const deadline = 60
	deadlined := start(apiclient.StartRunRequest{Mode: apiclient.RunModeJob, Template: tpl, ActiveDeadlineSeconds: deadline,
		TimeoutSeconds: 600, Command: []string{"sleep", "600"}})
	cancelled := start(apiclient.StartRunRequest{Mode: apiclient.RunModeJob, Template: tpl, TimeoutSeconds: 600,
		Command: []string{"sleep", "600"}})
	ttl := 5
	shortLived := start(apiclient.StartRunRequest{Mode: apiclient.RunModeJob, Template: tpl, TTLSecondsAfterFinished: &ttl,
		Command: []string{"true"}})

	// Pool: the run takes the pool's ready sandbox, which is recycled
	// after it.
	warm := e.waitPoolFull("pool", 1)
	poolRun := start(apiclient.StartRunRequest{Mode: apiclient.RunModePool, Pool: e.ns + "/pool",
		Command: []string{"sh", "-c", "echo from the pool; ls -A /workspace"}})
	done := wait(poolRun.ID)
	name := sandboxName(done)
	if _, ok := warm[name]; !ok || done.Status != apiclient.RunSucceeded || done.AgentID == "" || done.OutputBytes == 0 ||
		len(done.AttemptHistory) != 1 || done.AttemptHistory[0].Sandbox != done.Sandbox || done.AttemptHistory[0].Status != apiclient.RunSucceeded {
		t.Fatalf("pool run ended %+v (the pool had %v)", done, warm)
	}
	e.gone(&v1alpha1.Sandbox{}, name)
	refilled := e.waitPoolFull("pool", 1)
	if _, ok := refilled[name]; ok {
		t.Fatalf("the pool still has the sandbox %s the run used", name)
	}
	t.Logf("pool run %s in %s took %s; the sandbox was recycled and the pool refilled", done.ID, name, done.FinishedAt.Sub(*done.StartedAt))

	// A cancelled pool run's sandbox goes too.
	poolLong := start(apiclient.StartRunRequest{Mode: apiclient.RunModePool, Pool: e.ns + "/pool", TimeoutSeconds: 600,
		Command: []string{"sleep", "600"}})
	var leased string
	e.eventually("the pool run to run in its sandbox", func() error {
		r, err := api.GetRun(ctx, poolLong.ID)
		if err != nil {
			return err
		}
		if r.Status != apiclient.RunRunning || r.Sandbox == "" {
			return fmt.Errorf("%s in %q", r.Status, r.Sandbox)
		}
		leased = sandboxName(r)
		return nil
	})
	time.Sleep(2 * time.Second)
	_, err = api.CancelRun(ctx, poolLong.ID)
	must(t, err)
	if r := wait(poolLong.ID); r.Status != apiclient.RunCancelled || r.CancelledBy == "" {
		t.Fatalf("cancelled pool run ended %+v", r)
	}
	e.gone(&v1alpha1.Sandbox{}, leased)
	e.waitPoolFull("pool", 1)

	// A pool run whose executor died: the sweeper fails it and releases
	// its lease, so that its sandbox is recycled long before the lease's
	// 15 minutes.
	// (The lease is taken as the executor would, named after the run,
	// before the run goes stale.)
	lost, _, err := st.CreateRun(ctx, store.Run{Caller: "test", Mode: store.RunModePool, Pool: e.ns + "/pool",
		Command: store.RunCommand{Argv: []string{"true"}}})
	must(t, err)
	lease, err := api.AcquirePoolLease(ctx, e.ns, "pool", apiclient.AcquireLeaseRequest{Holder: lost.ID, RequestID: lost.ID, TTLSeconds: 900})
	must(t, err)
	_, err = st.StartRunAttempt(ctx, lost.ID, "a-replica-that-died", "")
	must(t, err)
	if r := wait(lost.ID); r.Status != apiclient.RunFailed || r.Reason != "ExecutorLost" {
		t.Fatalf("pool run whose executor died ended %+v", r)
	}
	e.gone(&v1alpha1.Sandbox{}, lease.Sandbox)
	t.Logf("a lost pool run's sandbox %s was recycled %s after its lease was taken (TTL 900s)", lease.Sandbox,
		time.Since(lease.AcquiredAt).Round(time.Second))

	// A job run whose executor died with its sandbox up, and a job
	// sandbox whose run is gone: the sweeper deletes both sandboxes.
	lostJob, _, err := st.CreateRun(ctx, store.Run{Caller: "test", Mode: store.RunModeJob, Template: tpl,
		Command: store.RunCommand{Argv: []string{"true"}}})
	must(t, err)
	_, err = st.StartRunAttempt(ctx, lostJob.ID, "a-replica-that-died", e.ns+"/"+lostJob.ID)
	must(t, err)
	for _, id := range []string{lostJob.ID, "run-00000000000000000000"} {
		must(t, e.c.Create(ctx, &v1alpha1.Sandbox{
			ObjectMeta: metav1.ObjectMeta{Name: id, Namespace: e.ns, Labels: map[string]string{v1alpha1.LabelRunID: id}},
			Spec:       v1alpha1.SandboxSpec{AgentID: id, TemplateRef: v1alpha1.LocalObjectReference{Name: "tpl"}},
		}))
	}
	if r := wait(lostJob.ID); r.Status != apiclient.RunFailed || r.Reason != "ExecutorLost" {
		t.Fatalf("job run whose executor died ended %+v", r)
	}
	e.gone(&v1alpha1.Sandbox{}, lostJob.ID)
	e.gone(&v1alpha1.Sandbox{}, "run-00000000000000000000")

	// The job that succeeds on its third attempt.
	r := wait(retried.ID)
	if r.Status != apiclient.RunSucceeded || r.Attempts != 3 || len(r.AttemptHistory) != 3 || r.Sandbox != e.ns+"/"+retried.ID {
		t.Fatalf("retried job ended %+v", r)
	}
	for i, a := range r.AttemptHistory {
		want, code := apiclient.RunFailed, 1
		if i == 2 {
			want, code = apiclient.RunSucceeded, 0
		}
		if a.Attempt != i+1 || a.Status != want || a.ExitCode == nil || *a.ExitCode != code || a.Sandbox != r.Sandbox ||
			a.FinishedAt == nil || a.OutputBytes != int64(len("attempt 1, count 1\n")) {
			t.Errorf("attempt %d: %+v", i+1, a)
		}
		if i > 0 {
			// The backoff: 1 s before the first retry, 2 s before the
			// second.
			gap := a.StartedAt.Sub(*r.AttemptHistory[i-1].FinishedAt)
			if min := time.Duration(i) * time.Second; gap < min || gap > min+10*time.Second {
				t.Errorf("attempt %d started %s after attempt %d ended, want about %s", i+1, gap, i, min)
			}
		}
	}
	var out strings.Builder
	must(t, api.FollowRun(ctx, retried.ID, 0, func(ev apiclient.RunEvent) error {
		if ev.Type == apiclient.RunEventStdout {
			out.WriteString(ev.Text)
		}
		return nil
	}))
	if want := "attempt 1, count 1\nattempt 2, count 2\nattempt 3, count 3\n"; out.String() != want {
		t.Errorf("retried job's output %q, want %q", out.String(), want)
	}
	e.gone(&v1alpha1.Sandbox{}, retried.ID)
	t.Logf("job %s: attempts at %v", r.ID, attemptTimes(r))

	// The job past its active deadline: its command killed, the run
	// timed out.
	r = wait(deadlined.ID)
	if r.Status != apiclient.RunTimedOut || r.Reason != "DeadlineExceeded" || len(r.AttemptHistory) != 1 ||
		r.AttemptHistory[0].Status != apiclient.RunTimedOut {
		t.Fatalf("job past its deadline ended %+v", r)
	}
	if took := r.FinishedAt.Sub(r.CreatedAt); took < deadline*time.Second || took > (deadline+15)*time.Second {
		t.Errorf("job with an active deadline of %ds ended %s after it was created", deadline, took)
	}
	e.gone(&v1alpha1.Sandbox{}, deadlined.ID)

	// The cancelled job: cancelled once its command runs.
	var sb v1alpha1.Sandbox
	e.eventually("the job to be running in its sandbox", func() error {
		if err := e.get(cancelled.ID, &sb); err != nil {
			return err
		}
		if sb.Status.Phase != v1alpha1.SandboxPhaseRunning {
			return fmt.Errorf("sandbox is %s", sb.Status.Phase)
		}
		return nil
	})
	time.Sleep(3 * time.Second)
	if r, err := api.CancelRun(ctx, cancelled.ID); err != nil || r.CancelRequestedBy == "" {
		t.Fatalf("cancel job: %+v, %v", r, err)
	}
	cctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	if r, err := api.WaitRun(cctx, cancelled.ID, 200*time.Millisecond); err != nil || r.Status != apiclient.RunCancelled || r.CancelledBy == "" {
		t.Fatalf("cancelled job ended %+v, %v", r, err)
	}
	e.gone(&v1alpha1.Sandbox{}, cancelled.ID)

	// The job with a TTL: its record goes 5 s after it ended.
	e.eventually("the record of the job with a TTL to go", func() error {
		r, err := api.GetRun(ctx, shortLived.ID)
		if errors.Is(err, &apiclient.Error{Code: apiclient.CodeNotFound}) {
			return nil
		}
		if err != nil {
			return err
		}
		if r.Terminal() && (r.ExpiresAt == nil || !r.ExpiresAt.Equal(r.FinishedAt.Add(time.Duration(ttl)*time.Second))) {
			t.Fatalf("ended job with a TTL of %ds expires at %v (ended %v)", ttl, r.ExpiresAt, r.FinishedAt)
		}
		return fmt.Errorf("still there: %s, expires at %v", r.Status, r.ExpiresAt)
	})
	e.gone(&v1alpha1.Sandbox{}, shortLived.ID)

	// The CLI: a job run started and waited for, and a run's attempts.
	cli := goBuild(t, "../cmd/agentbox", "agentbox")
	env := e.cliEnv(api.Endpoint(), api.Token())
	cmd := exec.CommandContext(ctx, cli, "runs", "start", "--wait", "--poll", "200ms", "--mode", "job", "--template", tpl,
		"--active-deadline", "5m", "--ttl-after-finished", "1h", "--", "sh", "-c", "echo attempt $AGENTBOX_RUN_ATTEMPT; exit 4")
	cmd.Env = env
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	var exitErr *exec.ExitError
	if err := cmd.Run(); !errors.As(err, &exitErr) || exitErr.ExitCode() != 4 || !strings.Contains(stderr.String(), "failed exit_code=4") {
		t.Fatalf("agentbox runs start --mode job: %v, stdout %q, stderr %q", err, stdout.String(), stderr.String())
	}
	cliRun := strings.TrimSpace(stdout.String())
	for id, want := range map[string][]string{
		cliRun:     {"mode: job", "template: " + tpl, "active_deadline_seconds: 300", "ttl_seconds_after_finished: 3600", "expires_at:", "attempt 1: failed exit_code=4"},
		retried.ID: {"backoff_limit: 3", "attempt 1: failed exit_code=1", "attempt 2: failed exit_code=1", "attempt 3: succeeded exit_code=0"},
	} {
		cmd := exec.CommandContext(ctx, cli, "runs", "get", id)
		cmd.Env = env
		got, err := cmd.Output()
		fields := strings.Join(strings.Fields(string(got)), " ")
		for _, w := range want {
			if err != nil || !strings.Contains(fields, w) {
				t.Errorf("agentbox runs get %s: %v, %q, want %q", id, err, got, w)
			}
		}
	}
	e.gone(&v1alpha1.Sandbox{}, cliRun)
}

// attemptTimes lists when a run's attempts started and how long they took.
func attemptTimes(r *apiclient.Run) []string {
	var out []string
	for _, a := range r.AttemptHistory {
		d := "-"
		if a.FinishedAt != nil {
			d = a.FinishedAt.Sub(a.StartedAt).Round(time.Millisecond).String()
		}
		out = append(out, fmt.Sprintf("#%d %s +%s (%s)", a.Attempt, a.Status, a.StartedAt.Sub(r.CreatedAt).Round(time.Millisecond), d))
	}
	return slices.Clip(out)
}
