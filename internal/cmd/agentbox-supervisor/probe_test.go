package main

import (
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"
)

// TestSupervisorProcessProbe runs -probe, as kubelet's liveness probe does,
// against the real binary: it passes while the supervisor serves, fails
// once the supervisor is stopped (SIGSTOP: its port still accepts
// connections, which is all a TCP probe would see), and passes again once
// it runs.
func TestSupervisorProcessProbe(t *testing.T) {
	bin := buildSupervisor(t)
	p := startSupervisor(t, bin, []string{"-insecure-listen", "127.0.0.1:0", "-health-listen", "127.0.0.1:0", "-workdir", t.TempDir()},
		[]string{"PATH=" + os.Getenv("PATH")})
	var addr string
	waitFor(t, "the health listener", 10*time.Second, func() bool {
		for _, l := range p.logLines() {
			if l["msg"] == "serving health checks" {
				addr = asString(l["addr"])
			}
		}
		return addr != ""
	})
	runProbe := func(env []string, args ...string) (string, error) {
		cmd := exec.Command(bin, append([]string{"-probe", "-probe-timeout", "2s"}, args...)...)
		cmd.Env = env
		out, err := cmd.CombinedOutput()
		return string(out), err
	}
	// As in the pod: the address comes from the environment the probe
	// shares with the supervisor.
	env := []string{"AGENTBOX_HEALTH_LISTEN=" + addr}
	if out, err := runProbe(env); err != nil {
		t.Fatalf("probe of a serving supervisor: %v %s", err, out)
	}

	if err := p.cmd.Process.Signal(syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	out, err := runProbe(env)
	if ee, ok := err.(*exec.ExitError); !ok || ee.ExitCode() != 1 || !strings.Contains(out, "/livez") {
		t.Errorf("probe of a stopped supervisor: %v %q, want exit 1 naming /livez", err, out)
	}
	t.Logf("probe of a stopped supervisor failed after %v: %s", time.Since(start).Round(time.Millisecond), strings.TrimSpace(out))
	if err := p.cmd.Process.Signal(syscall.SIGCONT); err != nil {
		t.Fatal(err)
	}
	if out, err := runProbe(env); err != nil {
		t.Errorf("probe once the supervisor runs again: %v %s", err, out)
	}

	if out, err := runProbe(nil); err == nil || !strings.Contains(out, "AGENTBOX_HEALTH_LISTEN") {
		t.Errorf("probe without an address: %v %q, want a failure naming AGENTBOX_HEALTH_LISTEN", err, out)
	}
}
