package controller

import (
	"context"
	"errors"
	"fmt"
	"os"
	"testing"
	"time"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	"github.com/agentbox/terraform-provider-agentbox/internal/benchreport"
	"github.com/agentbox/terraform-provider-agentbox/internal/computeapi"
	apiclient "github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
)

// TestAgentEventsBench prints how long an agent's events take to reach a
// follower of GET /v1/agents/{id}/events on the real cluster, with the
// control plane's parts in process as on its leader: from a run_command's
// start as its caller sees it to the command_started event's arrival,
// from each event's own time to its arrival, and from a run's start to
// the first event of its stream and to the agent's command_started.
func TestAgentEventsBench(t *testing.T) {
	if os.Getenv(EnvBench) == "" {
		t.Skipf("%s is not set: the benchmarks run only on request", EnvBench)
	}
	image := os.Getenv(EnvSandboxImage)
	if image == "" {
		t.Skipf("%s is not set: the Compute API needs the real sandbox image's supervisor", EnvSandboxImage)
	}
	// The activity clocks through the manager's client, cached, as the
	// control plane has them: the test's direct client reads each call's
	// Lease through client-go's default rate limit (5/s), which alone
	// makes a call take 200 ms in a loop.
	e, _, api := apiTemplate(t, image, nil, func(e *clusterEnv, o *computeapi.Options) { o.Leases = e.r.Client })
	e.sandbox("bench-events", "tpl")
	sbx, _ := e.waitPhase("bench-events", v1alpha1.SandboxPhaseRunning, v1alpha1.ReasonRunning)
	agent := sbx.Spec.AgentID
	ctx, cancel := context.WithCancel(e.ctx)
	defer cancel()
	type arrival struct {
		ev apiclient.AgentEvent
		at time.Time
	}
	arrivals := make(chan arrival, 1024)
	followed := make(chan error, 1)
	go func() {
		followed <- api.FollowAgentEvents(ctx, agent, 0, func(ev apiclient.AgentEvent) error {
			arrivals <- arrival{ev, time.Now()}
			return nil
		})
	}()
	// next returns the next event of type typ (and run runID) that
	// arrives, skipping others.
	next := func(typ, runID string) arrival {
		t.Helper()
		timeout := time.After(time.Minute)
		for {
			select {
			case a := <-arrivals:
				if a.ev.Type == typ && a.ev.RunID == runID {
					return a
				}
			case err := <-followed:
				t.Fatalf("the follower stopped: %v", err)
			case <-timeout:
				t.Fatalf("no %s event within a minute", typ)
			}
		}
	}
	var ownTime []time.Duration
	for range 3 { // warm the connections
		_, err := api.RunCommand(ctx, agent, apiclient.RunCommandRequest{Command: []string{"true"}, Cwd: "/tmp"})
		must(t, err)
		next(apiclient.AgentEventCommandEnded, "")
	}
	const calls = 100
	var callToEvent, callToAPI, roundTrip []time.Duration
	for range calls {
		start := time.Now()
		res, err := api.RunCommand(ctx, agent, apiclient.RunCommandRequest{Command: []string{"true"}, Cwd: "/tmp"})
		if err != nil || res.ExitCode != 0 {
			t.Fatalf("true: %+v, %v", res, err)
		}
		roundTrip = append(roundTrip, time.Since(start))
		s := next(apiclient.AgentEventCommandStarted, "")
		x := next(apiclient.AgentEventCommandEnded, "")
		callToEvent, callToAPI = append(callToEvent, s.at.Sub(start)), append(callToAPI, s.ev.Time.Sub(start))
		ownTime = append(ownTime, s.at.Sub(s.ev.Time), x.at.Sub(x.ev.Time))
	}
	benchreport.Record(t, benchreport.Figure{
		Name: "agent event: run_command start (as its caller sees it) to command_started on the stream", Unit: "ms",
		Values: benchreport.Millis(callToEvent),
		Note: fmt.Sprintf("`true` through the API, one follower of GET /v1/agents/{id}/events on the same replica (n=%d); of which the API's own start of the command "+
			"(sandbox lookup, activity clock, supervisor connection) p50 %.1f ms; whole call p50 %.1f ms",
			calls, benchreport.Percentile(benchreport.Millis(callToAPI), 50), benchreport.Percentile(benchreport.Millis(roundTrip), 50)),
	})

	const runs = 20
	var runToFirst, runToAgent []time.Duration
	for range runs {
		start := time.Now()
		run, _, err := api.StartRun(ctx, apiclient.StartRunRequest{AgentID: agent, Command: []string{"true"}})
		must(t, err)
		var first time.Time
		errFirst := errors.New("first")
		if err := api.FollowRun(ctx, run.ID, 0, func(apiclient.RunEvent) error {
			first = time.Now()
			return errFirst
		}); !errors.Is(err, errFirst) {
			t.Fatalf("follow run %s: %v", run.ID, err)
		}
		s := next(apiclient.AgentEventCommandStarted, run.ID)
		runToFirst, runToAgent = append(runToFirst, first.Sub(start)), append(runToAgent, s.at.Sub(start))
		x := next(apiclient.AgentEventCommandEnded, run.ID)
		ownTime = append(ownTime, s.at.Sub(s.ev.Time), x.at.Sub(x.ev.Time))
	}
	benchreport.Record(t, benchreport.Figure{
		Name: "run start (POST /v1/runs) to the first event of the run's stream", Unit: "ms", Values: benchreport.Millis(runToFirst),
		Note: fmt.Sprintf("`true`, the run's stream opened once POST /v1/runs answered (n=%d)", runs),
	})
	benchreport.Record(t, benchreport.Figure{
		Name: "run start (POST /v1/runs) to command_started on the agent's stream", Unit: "ms", Values: benchreport.Millis(runToAgent),
		Note: fmt.Sprintf("the same runs, followed on GET /v1/agents/{id}/events all along (n=%d)", runs),
	})

	// The sandbox controller's events: an idle stop and the resume the
	// next call makes.
	e.setActivity(sbx.Name, time.Now().Add(-2*time.Hour))
	for _, typ := range []string{apiclient.AgentEventIdleStopping, apiclient.AgentEventSnapshot, apiclient.AgentEventStopped} {
		a := next(typ, "")
		ownTime = append(ownTime, a.at.Sub(a.ev.Time))
	}
	// The event comes before the status says Stopped; a call in between
	// would find the sandbox still serving, its pod going.
	e.waitPhase(sbx.Name, v1alpha1.SandboxPhaseStopped, v1alpha1.ReasonStopped)
	_, err := api.RunCommand(ctx, agent, apiclient.RunCommandRequest{Command: []string{"true"}, Cwd: "/tmp"})
	must(t, err)
	for _, typ := range []string{apiclient.AgentEventResuming, apiclient.AgentEventResumed} {
		a := next(typ, "")
		ownTime = append(ownTime, a.at.Sub(a.ev.Time))
	}
	benchreport.Record(t, benchreport.Figure{
		Name: "agent event: its own time to its arrival on the stream", Unit: "ms", Values: benchreport.Millis(ownTime),
		Target: "<= 100 ms", Met: benchreport.Bool(benchreport.Percentile(benchreport.Millis(ownTime), 99) <= 100),
		Note: "command_started/ended of the calls and runs above, and the controller's idle_stopping, snapshot, stopped, resuming, resumed; the event's time is taken where it happens (Compute API, sandbox controller)",
	})
}
