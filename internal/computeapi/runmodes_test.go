package computeapi

import (
	"context"
	"testing"
	"time"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	api "github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
)

// TestRetryBackoff: a job run's backoff doubles from the base after every
// failed attempt, up to the cap.
func TestRetryBackoff(t *testing.T) {
	s := &Server{runRetryBackoff: 10 * time.Second, runRetryBackoffMax: 6 * time.Minute}
	var got []time.Duration
	for n := 1; n <= 8; n++ {
		got = append(got, s.retryBackoff(n))
	}
	want := []time.Duration{10 * time.Second, 20 * time.Second, 40 * time.Second, 80 * time.Second, 160 * time.Second,
		320 * time.Second, 6 * time.Minute, 6 * time.Minute}
	for i := range want {
		if got[i] != want[i] {
			t.Fatalf("backoffs %v, want %v", got, want)
		}
	}
}

// TestPoolRunInProcess: a pool run leases the pool's ready sandbox, runs
// in it under the lease, records the sandbox and its agent, and releases
// the lease when it ends, so that the pool's controller recycles it. The
// fixture's supervisor serves no streamed commands, so the run fails
// there: the release after a failed run is what this shows (the cluster
// test runs pool runs to success).
func TestPoolRunInProcess(t *testing.T) {
	ctx := context.Background()
	f := servedPoolFixture(t)
	c := f.client(t, adminToken)
	run, created, err := c.StartRun(ctx, api.StartRunRequest{Mode: api.RunModePool, Pool: "team-a/p", Command: []string{"echo", "hi"}})
	if err != nil || !created || run.Pool != "team-a/p" || run.AgentID != "" {
		t.Fatalf("start pool run: %+v, %v, %v", run, created, err)
	}
	done := waitRun(t, c, run.ID)
	if done.Status != api.RunFailed || done.Reason != "SupervisorUnavailable" || done.Sandbox != "team-a/w-1" || done.AgentID != "warm.p.w-1" ||
		len(done.AttemptHistory) != 1 || done.AttemptHistory[0].Sandbox != "team-a/w-1" {
		t.Fatalf("pool run ended %+v", done)
	}
	f.settled()
	l := f.leaseNamed(t, "w-1")
	if got := l.Annotations[v1alpha1.AnnotationLeaseReleasedRequestID]; got != run.ID {
		t.Errorf("the pool sandbox's Lease says request %q released, want the run's %s (annotations %v)", got, run.ID, l.Annotations)
	}
	if sb := f.sandboxNamed(t, "w-1"); sb.Annotations[v1alpha1.AnnotationPoolLeaseRequestID] != run.ID {
		t.Errorf("the pool sandbox is not marked leased by the run: %v", sb.Annotations)
	}
}

// TestJobRunWithoutItsTemplate: a job run whose template does not exist
// ends failed at its first attempt, saying so, without retries (nothing
// was created, so nothing could succeed on a retry) and without a
// sandbox left behind.
func TestJobRunWithoutItsTemplate(t *testing.T) {
	ctx := context.Background()
	f := servedPoolFixture(t)
	c := f.client(t, adminToken)
	ttl := 0
	run, _, err := c.StartRun(ctx, api.StartRunRequest{Mode: api.RunModeJob, Template: "team-a/nope", BackoffLimit: 2,
		TTLSecondsAfterFinished: &ttl, Command: []string{"true"}})
	if err != nil || run.AgentID != run.ID || run.Template != "team-a/nope" || run.BackoffLimit != 2 {
		t.Fatalf("start job run: %+v, %v", run, err)
	}
	done := waitRun(t, c, run.ID)
	if done.Status != api.RunFailed || done.Reason != "InvalidArgument" || done.Attempts != 1 || done.Sandbox != "team-a/"+run.ID ||
		done.ExpiresAt == nil || !done.ExpiresAt.Equal(*done.FinishedAt) {
		t.Fatalf("job run without its template ended %+v", done)
	}
	var list v1alpha1.SandboxList
	if err := f.kube.List(ctx, &list); err != nil {
		t.Fatal(err)
	}
	for _, sb := range list.Items {
		if sb.Labels[v1alpha1.LabelRunID] != "" {
			t.Errorf("sandbox %s of run %s was made", sb.Name, sb.Labels[v1alpha1.LabelRunID])
		}
	}
}
