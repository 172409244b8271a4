package runner

import (
	"errors"
	"testing"
	"time"
)

const mib = 1 << 20

// step is one reading the policy is given, and what it must decide.
type step struct {
	after time.Duration // since the previous reading
	used  int64
	kill  bool
	wait  time.Duration
}

func runPolicy(t *testing.T, p *guardPolicy, steps []step) {
	t.Helper()
	now := time.Unix(1_700_000_000, 0)
	for i, s := range steps {
		now = now.Add(s.after)
		kill, wait := p.sample(s.used, now)
		if kill != s.kill || wait != s.wait {
			t.Errorf("reading %d (%d MiB at +%v): kill %v, wait %v; want kill %v, wait %v",
				i+1, s.used/mib, s.after, kill, wait, s.kill, s.wait)
		}
	}
}

func newPolicy() *guardPolicy {
	return &guardPolicy{threshold: 160 * mib, interval: 50 * time.Millisecond}
}

const (
	slow = 50 * time.Millisecond
	fast = 10 * time.Millisecond
)

func TestGuardPolicySamplesFasterNearTheThreshold(t *testing.T) {
	runPolicy(t, newPolicy(), []step{
		{0, 40 * mib, false, slow},
		{slow, 120 * mib, false, slow}, // exactly three quarters: not past it
		{slow, 121 * mib, false, fast},
		{fast, 159 * mib, false, fast},
		{fast, 160 * mib, true, fast},
	})
}

// A second bomb started right after the first was killed: the guard keeps
// sampling (fast) and kills it as soon as it grows past what the first
// bomb's dead group still held, instead of sleeping through it.
func TestGuardPolicyCatchesASecondBombWhileSettling(t *testing.T) {
	runPolicy(t, newPolicy(), []step{
		{0, 175 * mib, true, fast},
		// The dead group's memory is not back yet: no second kill.
		{fast, 175 * mib, false, fast},
		{fast, 170 * mib, false, fast},
		{fast, 170*mib + settleSlack, false, fast},
		// Something grows on top of what is left: kill it, settling or not.
		{fast, 171*mib + settleSlack, true, fast},
	})
}

// After a kill, memory comes back, and a new bomb grows from there: the
// plain threshold holds again, not the level at the kill.
func TestGuardPolicyFloorFollowsTheMemoryBack(t *testing.T) {
	runPolicy(t, newPolicy(), []step{
		{0, 175 * mib, true, fast},
		{fast, 60 * mib, false, fast},
		{fast, 150 * mib, false, fast},
		{fast, 165 * mib, true, fast},
	})
}

// A big command that starts while a killed group's memory is still
// counted is not blamed for it; once the settle time is over and the
// memory is still above the threshold, the guard kills as before.
func TestGuardPolicyAfterTheSettleTime(t *testing.T) {
	runPolicy(t, newPolicy(), []step{
		{0, 175 * mib, true, fast},
		{fast, 172 * mib, false, fast},
		{memorySettle, 172 * mib, true, fast},
	})
}

func TestGuardPolicyIdleAfterSettling(t *testing.T) {
	runPolicy(t, newPolicy(), []step{
		{0, 175 * mib, true, fast},
		{fast, 50 * mib, false, fast},
		{memorySettle, 50 * mib, false, slow},
	})
}

func TestChargeEstimateAddsLiveAndPooledProcesses(t *testing.T) {
	var used int64 = 30 * mib
	procs := 4
	c := &ChargeEstimate{
		InUse:     func() (int64, error) { return used, nil },
		Processes: func() (int, error) { return procs, nil },
	}
	check := func(what string, want int64) {
		t.Helper()
		got, err := c.Charged()
		if err != nil || got != want {
			t.Errorf("%s: Charged() = %d, %v; want %d", what, got, err, want)
		}
	}
	check("at rest", 30*mib+4*hiddenPerProcess)
	// A fork bomb: 300 processes alive, each costing the pod more than
	// meminfo shows.
	used, procs = 75*mib, 300
	check("fork bomb", 75*mib+300*hiddenPerProcess)
	// Killed: meminfo is back, but the stubs of the 296 processes that
	// ended stay charged.
	used, procs = 30*mib, 4
	check("after the fork bomb", 30*mib+4*hiddenPerProcess+296*pooledPerProcess)
	// Fewer processes than the peak but more than now reuse pooled stubs.
	procs = 104
	check("100 new processes", 30*mib+104*hiddenPerProcess+196*pooledPerProcess)
}

func TestChargeEstimateErrors(t *testing.T) {
	boom := errors.New("boom")
	for name, c := range map[string]*ChargeEstimate{
		"meminfo":   {InUse: func() (int64, error) { return 0, boom }, Processes: func() (int, error) { return 1, nil }},
		"processes": {InUse: func() (int64, error) { return 1, nil }, Processes: func() (int, error) { return 0, boom }},
	} {
		if _, err := c.Charged(); !errors.Is(err, boom) {
			t.Errorf("%s fails: Charged() error %v, want %v", name, err, boom)
		}
	}
}

func TestCountProcesses(t *testing.T) {
	n, err := CountProcesses()
	if err != nil || n < 1 {
		t.Fatalf("CountProcesses() = %d, %v; want at least this test's process", n, err)
	}
}

func TestCommandPidsLimitFor(t *testing.T) {
	for _, c := range []struct {
		limit, reserve int64
		want           int
	}{
		{256 * mib, 0, 256},        // 160 MiB under the guard's threshold
		{1 << 30, 0, 1024},         // would be 1433
		{736 * mib, 0, 1024},       // 640 MiB under the threshold
		{512 * mib, 0, 665},        // 416 MiB
		{128 * mib, 32 * mib, 153}, // a configured reserve
		{128 * mib, 0, 64},         // 32 MiB would be 51
	} {
		if got := CommandPidsLimitFor(c.limit, c.reserve); got != c.want {
			t.Errorf("CommandPidsLimitFor(%d MiB, %d MiB) = %d, want %d", c.limit/mib, c.reserve/mib, got, c.want)
		}
	}
}
