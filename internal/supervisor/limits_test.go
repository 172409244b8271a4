package supervisor

import (
	"errors"
	"regexp"
	"sync/atomic"
	"testing"
	"time"

	api "github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"
)

// Every command starts with the configured RLIMIT_NPROC, as the kernel
// itself shows it to the command. (That the sandbox kernel refuses a fork
// past it is TestSupervisorGVisorHostile's fork bomb, in a real gVisor pod.)
func TestCommandPidsLimit(t *testing.T) {
	for _, tc := range []struct {
		limit  int
		memory int64
		want   string
	}{{0, 0, "1024"}, {300, 0, "300"}, {0, 256 << 20, "256"}, {300, 256 << 20, "300"}} {
		// A pod's memory limit holds only so many processes (see
		// runner.CommandPidsLimitFor); the reading is the guard's only.
		s := newServer(t, Config{CommandPidsLimit: tc.limit, MemoryLimit: tc.memory, MemoryInUse: func() (int64, error) { return 0, nil }})
		_, res, e := post(t, s, api.CommandRequest{Command: []string{"cat", "/proc/self/limits"}})
		if e != nil {
			t.Fatal(e)
		}
		m := regexp.MustCompile(`Max processes\s+(\S+)\s+(\S+)`).FindStringSubmatch(res.Stdout)
		if m == nil || m[1] != tc.want || m[2] != tc.want {
			t.Errorf("CommandPidsLimit %d, MemoryLimit %d: /proc/self/limits says %q, want soft and hard %s", tc.limit, tc.memory, m, tc.want)
		}
	}
	s := newServer(t, Config{CommandPidsLimit: -1})
	_, res, e := post(t, s, api.CommandRequest{Command: []string{"cat", "/proc/self/limits"}})
	if e != nil {
		t.Fatal(e)
	}
	if m := regexp.MustCompile(`Max processes\s+(\S+)`).FindStringSubmatch(res.Stdout); m == nil || m[1] == "1024" {
		t.Errorf("CommandPidsLimit -1: /proc/self/limits says %q, want the supervisor's own limit", m)
	}
}

// The guard kills the running command, a real process, once the reported
// use passes the limit less the reserve, and says so in the result; below
// it, nothing is killed. The use is injected: the real source is gVisor's
// /proc/meminfo, exercised by the gVisor pod test's memory bomb.
func TestMemoryGuardKillsLargestCommand(t *testing.T) {
	var used atomic.Int64
	s := newServer(t, Config{MemoryLimit: 256 << 20, MemoryReserve: 56 << 20, MemoryInUse: func() (int64, error) {
		return used.Load(), nil
	}})
	t.Cleanup(func() { s.Close() })

	used.Store(199 << 20)
	_, res, e := post(t, s, api.CommandRequest{Command: []string{"sleep", "0.5"}})
	if e != nil || res.ExitCode != 0 || res.OutOfMemory {
		t.Fatalf("below the threshold: %+v %v; want a normal exit", res, e)
	}

	go func() { time.Sleep(300 * time.Millisecond); used.Store(200 << 20) }()
	start := time.Now()
	_, res, e = post(t, s, api.CommandRequest{Command: []string{"sh", "-c", "sleep 30 & sleep 30"}, TimeoutSeconds: 60})
	if e != nil {
		t.Fatal(e)
	}
	if !res.OutOfMemory || res.Signal != "SIGKILL" || res.TimedOut {
		t.Fatalf("at the threshold: %+v; want killed for memory", res)
	}
	t.Logf("killed %v after the start (the use passed the threshold at 300ms)", time.Since(start).Round(time.Millisecond))
}

func TestMemoryGuardRejectsAReserveAboveTheLimit(t *testing.T) {
	_, err := New(Config{DefaultCwd: t.TempDir(), MemoryLimit: 64 << 20, MemoryReserve: 64 << 20, MemoryInUse: func() (int64, error) { return 0, errors.New("unused") }})
	if err == nil {
		t.Fatal("New accepted a reserve that leaves nothing for commands")
	}
}

func TestMemInfoInUse(t *testing.T) {
	n, err := MemInfoInUse()
	if err != nil || n <= 0 {
		t.Fatalf("MemInfoInUse() = %d, %v; want the host's memory in use", n, err)
	}
}
