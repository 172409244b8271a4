package runner

import (
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
