package controller

import (
	"context"
	"testing"
	"time"

	apiclient "github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
)

// TestRunsOnCluster runs commands to completion through the Compute API's
// runs in a real gVisor sandbox, recorded in the real store: a run that
// succeeds (with its output counted), the same request id answering the
// same run, a failing command's exit code, and a cancel that stops a long
// command within seconds.
func TestRunsOnCluster(t *testing.T) {
	t.Parallel()
	e, _, api, sbx := apiSandbox(t, "runs", nil)
	agent := sbx.Spec.AgentID
	ctx := e.ctx
	wait := func(id string) *apiclient.Run {
		t.Helper()
		wctx, cancel := context.WithTimeout(ctx, waitTimeout)
		defer cancel()
		r, err := api.WaitRun(wctx, id, 200*time.Millisecond)
		must(t, err)
		return r
	}

	req := apiclient.StartRunRequest{AgentID: agent, Command: []string{"sh", "-c", "echo hello from a run; uname -a"},
		RequestID: "runs-cluster-1", TimeoutSeconds: 60}
	run, created, err := api.StartRun(ctx, req)
	if err != nil || !created {
		t.Fatalf("start run: %+v, created %v, %v", run, created, err)
	}
	done := wait(run.ID)
	if done.Status != apiclient.RunSucceeded || done.ExitCode == nil || *done.ExitCode != 0 || done.OutputBytes <= 0 ||
		done.Sandbox != sbx.Namespace+"/"+sbx.Name {
		t.Fatalf("run ended %+v", done)
	}
	again, created, err := api.StartRun(ctx, req)
	if err != nil || created || again.ID != run.ID || again.Status != apiclient.RunSucceeded {
		t.Fatalf("repeated start: %+v, created %v, %v; want run %s", again, created, err, run.ID)
	}

	failing, _, err := api.StartRun(ctx, apiclient.StartRunRequest{AgentID: agent, Command: []string{"sh", "-c", "exit 7"}})
	must(t, err)
	if r := wait(failing.ID); r.Status != apiclient.RunFailed || r.ExitCode == nil || *r.ExitCode != 7 || r.Reason != "NonZeroExit" {
		t.Fatalf("failing run ended %+v", r)
	}

	long, _, err := api.StartRun(ctx, apiclient.StartRunRequest{AgentID: agent, Command: []string{"sleep", "600"}, TimeoutSeconds: 600})
	must(t, err)
	for deadline := time.Now().Add(waitTimeout); ; time.Sleep(200 * time.Millisecond) {
		r, err := api.GetRun(ctx, long.ID)
		must(t, err)
		if r.Status == apiclient.RunRunning {
			break
		}
		if r.Terminal() || time.Now().After(deadline) {
			t.Fatalf("long run never ran: %+v", r)
		}
	}
	// Let the command start in the sandbox before it is cancelled.
	time.Sleep(2 * time.Second)
	_, err = api.CancelRun(ctx, long.ID)
	must(t, err)
	// Within seconds, not the command's ten minutes.
	cctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	r, err := api.WaitRun(cctx, long.ID, 200*time.Millisecond)
	if err != nil {
		t.Fatalf("cancelled run did not end within 30s: %v", err)
	}
	if r.Status != apiclient.RunCancelled || r.CancelledBy == "" {
		t.Fatalf("cancelled run ended %+v", r)
	}
	t.Logf("run %s: %d output bytes; cancelled run ended %s after %s", done.ID, done.OutputBytes, r.Status,
		r.FinishedAt.Sub(*r.StartedAt))
}
