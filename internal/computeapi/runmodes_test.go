package computeapi

import (
	"testing"
	"time"
)

// TestRetryBackoff: a job run's backoff doubles from the base after every
// failed attempt, up to the cap.
func TestRetryBackoff(t *testing.T) {
	s := &Server{runRetryBackoff: 10 * time.Second, runRetryBackoffMax: 6 * time.Minute}
	var got []time.Duration
	for n := 1; n <= 8; n++ {
		got = append(got, s.retryBackoff(n))
	}
	want := []time.Duration{10 * time.Second, 20 * time.Second, 40 * time.Second, 80 * time.Second, 160 * time.Second,
		320 * time.Second, 6 * time.Minute, 6 * time.Minute}
	for i := range want {
		if got[i] != want[i] {
			t.Fatalf("backoffs %v, want %v", got, want)
		}
	}
}
