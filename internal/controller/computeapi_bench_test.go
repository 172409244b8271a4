package controller

import (
	"fmt"
	"os"
	"testing"
	"time"

	"github.com/agentbox/terraform-provider-agentbox/internal/benchreport"
	apiclient "github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"
)

// TestComputeAPIBench prints what the Compute API adds to a call: `true`
// through the API (an agent token from the store, the audit, the
// activity clock) against the same command sent straight to the
// supervisor of the same gVisor sandbox, in alternating batches so that
// both sides see the same load.
func TestComputeAPIBench(t *testing.T) {
	if os.Getenv(EnvBench) == "" {
		t.Skipf("%s is not set: the benchmarks run only on request", EnvBench)
	}
	e, _, admin, sbx := apiSandbox(t, "bench-api", nil)
	agent := sbx.Spec.AgentID
	api, _ := agentClients(e, admin, agent)
	direct := e.supervisor(t, sbx)
	ctx := e.ctx

	viaAPI := func() time.Duration {
		start := time.Now()
		res, err := api.RunCommand(ctx, agent, apiclient.RunCommandRequest{Command: []string{"true"}, Cwd: "/tmp"})
		if err != nil || res.ExitCode != 0 {
			t.Fatalf("true through the API: %+v, %v", res, err)
		}
		return time.Since(start)
	}
	viaSupervisor := func() time.Duration {
		start := time.Now()
		res, err := direct.RunCommand(ctx, supervisorapi.CommandRequest{Command: []string{"true"}, Cwd: "/tmp"})
		if err != nil || res.ExitCode != 0 {
			t.Fatalf("true through the supervisor: %+v, %v", res, err)
		}
		return time.Since(start)
	}
	for range 3 { // warm both connections
		viaAPI()
		viaSupervisor()
	}
	const rounds, batch = 10, 20
	var apiTimes, supTimes []time.Duration
	for range rounds {
		for range batch {
			apiTimes = append(apiTimes, viaAPI())
		}
		for range batch {
			supTimes = append(supTimes, viaSupervisor())
		}
	}
	supP50 := percentile(supTimes, 50)
	added := make([]float64, len(apiTimes))
	for i, d := range apiTimes {
		added[i] = float64(d-supP50) / float64(time.Millisecond)
	}
	benchreport.Record(t, benchreport.Figure{
		Name: "run_command true through the API, added to the supervisor directly", Unit: "ms", Values: added,
		Target: "<= 1 ms added at p50", Met: benchreport.Bool(benchreport.Percentile(added, 50) <= 1),
		Note: fmt.Sprintf("API p50 %v against the supervisor's %v, same pod, alternating batches of %d (n=%d each); the API runs in the test process, over TLS on loopback",
			percentile(apiTimes, 50).Round(10*time.Microsecond), supP50.Round(10*time.Microsecond), batch, len(supTimes)),
	})
}
