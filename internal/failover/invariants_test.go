package failover

import (
	"strings"
	"testing"
	"time"
)

// The checks must catch what they are for: these run without a cluster.

func TestGrantViolations(t *testing.T) {
	t0 := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	at := func(s int) time.Time { return t0.Add(time.Duration(s) * time.Second) }
	end := at(100)
	clean := []grant{
		{Holder: "h1", Agent: "a", Got: at(1), Released: at(2), ReleaseOK: true},
		{Holder: "h2", Agent: "b", Got: at(1), Released: at(3), ReleaseOK: true},
		{Holder: "h1", Agent: "c", Got: at(3), Released: at(4)}, // release lost: held to the end
	}
	if v := grantViolations(clean, end); len(v) != 0 {
		t.Errorf("violations in a clean run: %v", v)
	}
	overlap := append(clean, grant{Holder: "h2", Agent: "c", Got: at(50), Released: at(51), ReleaseOK: true})
	v := grantViolations(overlap, end)
	if len(v) != 2 || !strings.HasPrefix(v[0], "double pool lease: ") || !strings.Contains(v[1], "leased 2 times") {
		t.Errorf("a lease on a sandbox still held (its release lost): %v", v)
	}
	again := append(clean, grant{Holder: "h2", Agent: "a", Got: at(10), Released: at(11), ReleaseOK: true})
	if v := grantViolations(again, end); len(v) != 1 || !strings.Contains(v[0], "leased 2 times") {
		t.Errorf("a released sandbox leased again: %v", v)
	}
}

func TestUnavailability(t *testing.T) {
	t0 := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	at := func(ms int) time.Time { return t0.Add(time.Duration(ms) * time.Millisecond) }
	c := func(start, end int, code string) call { return call{Start: at(start), End: at(end), Code: code} }
	calls := []call{
		c(0, 10, ""),
		c(950, 960, "pool_exhausted"), // an answer of a working API
		c(1000, 1200, "transport"),    // the first failure seen, at 1200, after the fault at 900
		c(1100, 5000, ""),             // started before the failure was seen: does not count
		c(1250, 1400, "unavailable"),  // still failing
		c(1500, 1600, ""),             // back
		c(920, 1300, "transport"),     // a wait cut later: its answer is not the first seen
		c(9000, 9100, "hung"),         // after the next fault: not this one's
	}
	d, n := unavailability(calls, at(900), at(8000))
	if d != 400*time.Millisecond || n != 3 {
		t.Errorf("unavailability = %s over %d failures, want 400ms over 3", d, n)
	}
	if d, n := unavailability(calls[:1], at(900), at(8000)); d != 0 || n != 0 {
		t.Errorf("no failure: %s, %d", d, n)
	}
	if d, _ := unavailability(calls[7:], at(8000), at(10000)); d >= 0 {
		t.Errorf("never back: %s, want negative", d)
	}
}
