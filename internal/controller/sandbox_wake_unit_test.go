package controller

import (
	"context"
	"testing"
	"time"

	"github.com/go-logr/logr"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	"github.com/agentbox/terraform-provider-agentbox/internal/computeapi/holds"
	"github.com/agentbox/terraform-provider-agentbox/internal/snapshot"
)

// TestUnitWokenSandboxServesBeforeItIdles: a resume slower than the idle
// timeout does not stop the sandbox again before the call that woke it is
// served. While the activity clock still holds the Compute API's wake, the
// sandbox is idle only a timeout after it began to serve; any later
// renewal ends that.
func TestUnitWokenSandboxServesBeforeItIdles(t *testing.T) {
	for _, tc := range []struct {
		name string
		// wake moves the activity clock as a call to the stopped sandbox does.
		wake func(f *fakeEnv)
		// stopsAtOnce: the sandbox is stopped on the pass that finds it
		// serving after the slow resume.
		stopsAtOnce bool
	}{
		{name: "woken by the Compute API", wake: func(f *fakeEnv) {
			holds.NewActivityClock(f.c, f.clock, holds.DefaultActivityRenewInterval, logr.Discard()).Wake(context.Background(), f.sandbox("s"))
		}},
		// A plain renewal is no wake: what it records is activity that is
		// over, so the idle timeout counts from it (the cluster tests make
		// sandboxes idle this way).
		{name: "renewed", wake: func(f *fakeEnv) { f.renew("s") }, stopsAtOnce: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f, d := newLifecycleEnv(t, idleSandbox("s", time.Minute))
			f.reconcile("s")
			f.podReady("s")
			f.reconcile("s")
			f.wantPhase("s", v1alpha1.SandboxPhaseRunning, v1alpha1.ReasonRunning)
			f.clock.Step(2 * time.Minute)
			f.reconcile("s")
			f.wantPhase("s", v1alpha1.SandboxPhaseIdleStopping, v1alpha1.ReasonIdleTimeout)
			d.state = snapshot.State{Ready: true, SizeBytes: 4096}
			f.reconcile("s")
			f.wantPhase("s", v1alpha1.SandboxPhaseStopped, v1alpha1.ReasonStopped)
			// The next stop's snapshot is not ready at once, so that it
			// shows as IdleStopping.
			d.state = snapshot.State{}

			tc.wake(f)
			f.reconcile("s")
			f.wantPhase("s", v1alpha1.SandboxPhaseResuming, v1alpha1.ReasonResuming)
			// The resume takes longer than the idle timeout.
			f.clock.Step(90 * time.Second)
			f.podReady("s")
			f.reconcile("s")
			f.wantPhase("s", v1alpha1.SandboxPhaseRunning, v1alpha1.ReasonRunning)
			res := f.reconcile("s")
			if tc.stopsAtOnce {
				f.wantPhase("s", v1alpha1.SandboxPhaseIdleStopping, v1alpha1.ReasonIdleTimeout)
				return
			}
			f.wantPhase("s", v1alpha1.SandboxPhaseRunning, v1alpha1.ReasonRunning)
			if res.RequeueAfter <= 0 || res.RequeueAfter > time.Minute {
				t.Errorf("requeue %s; want the end of the idle timeout counted from the resume", res.RequeueAfter)
			}
			f.clock.Step(30 * time.Second)
			f.reconcile("s")
			f.wantPhase("s", v1alpha1.SandboxPhaseRunning, v1alpha1.ReasonRunning)
			f.clock.Step(31 * time.Second)
			f.reconcile("s")
			f.wantPhase("s", v1alpha1.SandboxPhaseIdleStopping, v1alpha1.ReasonIdleTimeout)
		})
	}
}
