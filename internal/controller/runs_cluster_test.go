package controller

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/agentbox/terraform-provider-agentbox/internal/computeapi"
	apiclient "github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
	"github.com/agentbox/terraform-provider-agentbox/internal/store"
)

// TestRunsOnCluster runs commands to completion through the Compute API's
// runs in a real gVisor sandbox, recorded in the real store: a run that
// succeeds (with its output counted), the same request id answering the
// same run, a failing command's exit code, and a cancel that stops a long
// command within seconds.
func TestRunsOnCluster(t *testing.T) {
	t.Parallel()
	e, st, api, sbx := apiSandbox(t, "runs", nil)
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

	runEventsOnCluster(t, e, api, agent)
	runsAcrossRestart(t, e, st, agent)
}

// runsAcrossRestart: a control plane replica that shuts down mid-run (a
// rolling update's SIGTERM) stops the command in the sandbox and records
// the run failed with ExecutorStopped, as another replica on the same
// store answers at once; and a run whose replica died without a word (its
// heartbeats stopped) is failed ExecutorLost by the other replica's
// sweeper. Neither is left running.
func runsAcrossRestart(t *testing.T, e *clusterEnv, st *store.Store, agent string) {
	ctx := e.ctx
	fast := func(o *computeapi.Options) {
		o.RunHeartbeatInterval, o.RunSweepInterval = time.Second, time.Second
	}
	leaving, shutdown := e.startComputeAPI(e.supervisors, st, func(o *computeapi.Options) { fast(o); o.Replica = "replica-leaving" })
	staying, _ := e.startComputeAPI(e.supervisors, st, func(o *computeapi.Options) { fast(o); o.Replica = "replica-staying" })

	run, _, err := leaving.StartRun(ctx, apiclient.StartRunRequest{AgentID: agent, TimeoutSeconds: 600,
		Command: []string{"sh", "-c", "echo started; exec sleep 599"}})
	must(t, err)
	for deadline := time.Now().Add(waitTimeout); ; time.Sleep(100 * time.Millisecond) {
		r, err := staying.GetRun(ctx, run.ID)
		must(t, err)
		if r.Status == apiclient.RunRunning {
			break
		}
		if r.Terminal() || time.Now().After(deadline) {
			t.Fatalf("run never ran: %+v", r)
		}
	}
	time.Sleep(time.Second) // the command is up in the sandbox
	stopped := time.Now()
	shutdown()
	r, err := staying.GetRun(ctx, run.ID)
	must(t, err)
	if r.Status != apiclient.RunFailed || r.Reason != "ExecutorStopped" || r.Executor != "replica-leaving" {
		t.Fatalf("after its replica shut down the run is %+v, want failed ExecutorStopped", r)
	}
	t.Logf("run %s ended %s (%s) %s after its replica began shutting down", r.ID, r.Status, r.Reason,
		time.Since(stopped).Round(time.Millisecond))
	// Its command went with it: nothing sleeps 599 in the sandbox.
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(500 * time.Millisecond) {
		res, err := staying.RunCommand(ctx, agent, apiclient.RunCommandRequest{
			Command: []string{"sh", "-c", "for p in /proc/[0-9]*; do cat $p/cmdline 2>/dev/null | tr '\\0' ' '; echo; done"}})
		must(t, err)
		if !strings.Contains(res.Stdout, "sleep 599") {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the stopped run's command still runs in the sandbox:\n%s", res.Stdout)
		}
	}

	// A replica that died mid-run: its run stays "running" in the store
	// with a heartbeat that no longer moves.
	lost, _, err := st.CreateRun(ctx, store.Run{Caller: "admin", Mode: store.RunModeAgent, AgentID: agent,
		Command: store.RunCommand{Argv: []string{"sleep", "30"}, TimeoutSeconds: 60}})
	must(t, err)
	_, err = st.StartRunAttempt(ctx, lost.ID, "replica-killed", e.ns+"/runs")
	must(t, err)
	wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	ended, err := staying.WaitRun(wctx, lost.ID, 200*time.Millisecond)
	if err != nil || ended.Status != apiclient.RunFailed || ended.Reason != "ExecutorLost" {
		t.Fatalf("the run of a replica that died: %+v, %v; want failed ExecutorLost by the sweeper", ended, err)
	}
}

// runEventsOnCluster follows a run that prints many known lines over a
// few seconds, live, through its event stream: the connection is cut
// twice mid-stream and resumed with Last-Event-ID, and the output put
// together is exactly the command's. The finished run is replayed whole,
// read by curl as a third-party SSE client too, and by the agentbox CLI.
func runEventsOnCluster(t *testing.T, e *clusterEnv, api *apiclient.Client, agent string) {
	ctx := e.ctx
	const (
		before = 60  // lines printed before the command waits for the test
		total  = 400 // lines in all
	)
	// The command prints its first lines, waits for the test to have cut
	// the connection, then prints the rest in bursts.
	script := fmt.Sprintf(`i=1; while [ $i -le %d ]; do echo "line $i of the run"; i=$((i+1)); done
while [ ! -e go-on ]; do sleep 0.1; done
while [ $i -le %d ]; do echo "line $i of the run"; if [ $((i %% 40)) = 0 ]; then sleep 0.25; fi; i=$((i+1)); done
echo "to stderr" >&2`, before, total)
	var want strings.Builder
	for i := 1; i <= total; i++ {
		fmt.Fprintf(&want, "line %d of the run\n", i)
	}
	run, _, err := api.StartRun(ctx, apiclient.StartRunRequest{AgentID: agent, Command: []string{"sh", "-c", script},
		TimeoutSeconds: 300})
	must(t, err)

	var got []apiclient.RunEvent
	// follow reads from the last event seen until cut stdout lines more
	// have come, then cuts the connection (cancels its request), or, with
	// cut 0, to the end.
	follow := func(cut int) error {
		fctx, cancel := context.WithTimeout(ctx, waitTimeout)
		defer cancel()
		var after int64
		if len(got) > 0 {
			after = got[len(got)-1].ID
		}
		n := 0
		return api.FollowRun(fctx, run.ID, after, func(ev apiclient.RunEvent) error {
			got = append(got, ev)
			if ev.Type == apiclient.RunEventStdout {
				n++
			}
			if cut > 0 && n == cut {
				cancel()
			}
			return nil
		})
	}
	if err := follow(30); !errors.Is(err, context.Canceled) {
		t.Fatalf("first connection: %v after %d events", err, len(got))
	}
	cut1 := len(got)
	// The command is waiting for the test: the stream was live.
	if r, err := api.GetRun(ctx, run.ID); err != nil || r.Status != apiclient.RunRunning {
		t.Fatalf("run after the first cut: %+v, %v", r, err)
	}
	res, err := api.RunCommand(ctx, agent, apiclient.RunCommandRequest{Command: []string{"touch", "go-on"}})
	if err != nil || res.ExitCode != 0 {
		t.Fatalf("touch go-on: %+v, %v", res, err)
	}
	if err := follow(100); !errors.Is(err, context.Canceled) {
		t.Fatalf("second connection: %v after %d events", err, len(got))
	}
	cut2 := len(got)
	must(t, follow(0))

	for i, ev := range got {
		if ev.ID != int64(i+1) {
			t.Fatalf("event %d has id %d (lost or repeated events)", i, ev.ID)
		}
	}
	var stdout, stderr strings.Builder
	for _, ev := range got {
		switch ev.Type {
		case apiclient.RunEventStdout:
			stdout.WriteString(ev.Text)
		case apiclient.RunEventStderr:
			stderr.WriteString(ev.Text)
		}
	}
	if stdout.String() != want.String() || stderr.String() != "to stderr\n" {
		t.Fatalf("followed over three connections, stdout %d bytes (want %d), stderr %q", stdout.Len(), want.Len(), stderr.String())
	}
	first, last := got[0], got[len(got)-1]
	if first.Type != apiclient.RunEventState || first.Status != apiclient.RunRunning || first.Attempt != 1 ||
		last.Type != apiclient.RunEventEnd || last.Status != apiclient.RunSucceeded || last.ExitCode == nil || *last.ExitCode != 0 {
		t.Fatalf("the log runs from %+v to %+v", first, last)
	}

	// Replayed once it has ended: the same events.
	var replay []apiclient.RunEvent
	must(t, api.FollowRun(ctx, run.ID, 0, func(ev apiclient.RunEvent) error {
		replay = append(replay, ev)
		return nil
	}))
	if len(replay) != len(got) {
		t.Fatalf("replay has %d events, the live stream had %d", len(replay), len(got))
	}
	for i := range got {
		if a, b := got[i], replay[i]; a.ID != b.ID || a.Type != b.Type || a.Text != b.Text || !a.Time.Equal(b.Time) {
			t.Fatalf("replayed event %d is %+v, live it was %+v", i, b, a)
		}
	}

	// curl, as a client this project did not write.
	if curl, err := exec.LookPath("curl"); err != nil {
		t.Log("curl is not installed: the stream is not read by a third-party SSE client")
	} else {
		const resume = 10
		out, err := e.curlEvents(curl, api, apiclient.PathRunEvents(run.ID), resume, "60")
		if err != nil {
			t.Fatalf("curl: %v", err)
		}
		var ids []int64
		must(t, apiclient.ReadEventStream(bytes.NewReader(out), func(ev apiclient.EventStreamEvent) error {
			var re apiclient.RunEvent
			if err := json.Unmarshal([]byte(ev.Data), &re); err != nil {
				return err
			}
			want := got[re.ID-1]
			if ev.ID != fmt.Sprint(re.ID) || ev.Event != re.Type || re.Type != want.Type || re.Text != want.Text {
				return fmt.Errorf("curl read event %s %s %+v; the client read %+v", ev.ID, ev.Event, re, want)
			}
			ids = append(ids, re.ID)
			return nil
		}))
		if len(ids) != len(got)-resume || ids[0] != resume+1 {
			t.Fatalf("curl read %d events from %v, want %d from %d", len(ids), ids[:min(len(ids), 1)], len(got)-resume, resume+1)
		}
		t.Logf("curl read events %d..%d (%d bytes)", ids[0], ids[len(ids)-1], len(out))
	}

	// The CLI: the finished run's output, and a run started and followed.
	cli := goBuild(t, "../cmd/agentbox", "agentbox")
	env := e.cliEnv(api.Endpoint(), api.Token())
	cmd := exec.CommandContext(ctx, cli, "runs", "logs", run.ID)
	cmd.Env = env
	var cliOut, cliErr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &cliOut, &cliErr
	if err := cmd.Run(); err != nil || cliOut.String() != want.String() || cliErr.String() != "to stderr\n" {
		t.Fatalf("agentbox runs logs: %v, stdout %d bytes, stderr %q", err, cliOut.Len(), cliErr.String())
	}
	cmd = exec.CommandContext(ctx, cli, "runs", "start", "--follow", agent, "--", "sh", "-c", "echo one; sleep 1; echo two; exit 7")
	cmd.Env = env
	cliOut.Reset()
	cliErr.Reset()
	cmd.Stdout, cmd.Stderr = &cliOut, &cliErr
	var exitErr *exec.ExitError
	if err := cmd.Run(); !errors.As(err, &exitErr) || exitErr.ExitCode() != 7 || cliOut.String() != "one\ntwo\n" {
		t.Fatalf("agentbox runs start --follow: %v, stdout %q, stderr %q", err, cliOut.String(), cliErr.String())
	}
	t.Logf("run %s: %d events over three connections (cut after events %d and %d)", run.ID, len(got), cut1, cut2)
}
