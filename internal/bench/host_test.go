package bench

import (
	"fmt"
	"os"
	"os/exec"
	"testing"
	"time"

	"github.com/agentbox/terraform-provider-agentbox/internal/benchreport"
)

// TestBenchHostIdleSpawn prints what this machine charges for the first
// process after a pause, on the host itself, without gVisor or the
// platform: `echo` spawned right after the previous one against `echo`
// spawned after the machine sat idle about as long as a warm pool's
// sandbox does between claims in the claim phase. The claim figure's
// first command is such a process, in a sandbox whose kernel does many
// times the host's work per exec, so this is the floor under the
// difference between its first and second commands.
func TestBenchHostIdleSpawn(t *testing.T) {
	if os.Getenv(EnvBench) == "" {
		t.Skipf("%s is not set: the benchmarks run only on request", EnvBench)
	}
	echo, err := exec.LookPath("echo")
	if err != nil {
		t.Skipf("no echo on PATH: %v", err)
	}
	spawn := func() time.Duration {
		start := time.Now()
		if err := exec.Command(echo, "ready").Run(); err != nil {
			t.Fatalf("echo: %v", err)
		}
		return time.Since(start)
	}
	const rounds, batch, idle = 6, 10, 2 * time.Second
	var hot, cold []time.Duration
	for range rounds {
		time.Sleep(idle)
		cold = append(cold, spawn())
		for range batch {
			hot = append(hot, spawn())
		}
	}
	hotMS, coldMS := benchreport.Millis(hot), benchreport.Millis(cold)
	hotP50 := benchreport.Percentile(hotMS, 50)
	ratios := make([]float64, len(coldMS))
	for i, c := range coldMS {
		ratios[i] = c / hotP50
	}
	benchreport.Record(t, benchreport.Figure{
		Name: "host: echo after 2 s idle, against echo right after another", Unit: "x", Values: ratios,
		Note: fmt.Sprintf("no gVisor, no platform: after 2 s idle p50 %.2f ms (n=%d), right after the previous spawn p50 %.2f ms (n=%d), alternating",
			benchreport.Percentile(coldMS, 50), len(cold), hotP50, len(hot)),
	})
}
