package main

import (
	"context"
	"net/http"
	"testing"
	"time"

	"github.com/go-logr/logr"
)

// A manager that fails before it starts the API leaves nothing to drain:
// drain returns at once, and a Start the manager begins afterwards does
// not serve (it would outlive the Compute API it serves).
func TestDrainBeforeStart(t *testing.T) {
	a := newAPIServer("127.0.0.1:0", http.NotFoundHandler(), nil, nil, logr.Discard())
	done := make(chan struct{})
	go func() {
		defer close(done)
		if started, finished := a.drain(time.Minute); started || !finished {
			t.Errorf("drain before Start: started %v, finished %v; want false, true", started, finished)
		}
	}()
	select {
	case <-done:
	case <-time.After(30 * time.Second):
		t.Fatal("drain before Start did not return")
	}
	// The nil cache would panic if Start went on to wait for it.
	if err := a.Start(context.Background()); err != nil {
		t.Errorf("Start after drain: %v", err)
	}
	if err := a.readyCheck(nil); err == nil {
		t.Error("ready after drain; want not serving")
	}
}
