package controller

import (
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	"github.com/agentbox/terraform-provider-agentbox/internal/computeapi"
	"github.com/agentbox/terraform-provider-agentbox/internal/testenv/s3server"
)

// TestResumeSlowerThanIdleTimeout wakes, through the Compute API, a
// sandbox whose idle timeout is shorter than its resume, over and over:
// each call appends a line to a file and counts the lines. The call that
// woke the sandbox must be served on it and its write kept, rather than
// the sandbox being stopped again the moment it serves, under the call
// (a stop whose snapshot is taken before the call's write loses it).
func TestResumeSlowerThanIdleTimeout(t *testing.T) {
	t.Parallel()
	image := os.Getenv(EnvSandboxImage)
	if image == "" {
		t.Skipf("%s is not set: idle stop needs the real sandbox image's supervisor", EnvSandboxImage)
	}
	var pool *computeapi.SupervisorPool
	e := newClusterEnv(t, withSnapshots(t, s3Archive(t, s3server.Start(t)), &pool))
	api := e.computeAPI(pool)
	const idle = 2 * time.Second
	e.template("tpl", func(tpl *v1alpha1.SandboxTemplate) {
		tpl.Spec.Image = image
		tpl.Spec.IdleTimeout = metav1.Duration{Duration: idle}
	})
	agent := e.sandbox("quick", "tpl").Spec.AgentID

	const rounds = 3
	for round := 1; round <= rounds; round++ {
		e.waitPhase("quick", v1alpha1.SandboxPhaseStopped, v1alpha1.ReasonStopped)
		start := time.Now()
		got := apiRun(t, e.ctx, api, agent, "echo x >> wake.log && wc -l < wake.log")
		took := time.Since(start)
		if got != fmt.Sprint(round) {
			t.Fatalf("round %d: the call that woke the sandbox counted %q lines in wake.log, want %d (a write of an earlier call was lost); events: %s",
				round, got, round, e.eventSummary("quick"))
		}
		t.Logf("round %d: the call that woke the sandbox (idle timeout %s) answered after %s with %s lines", round, idle, took.Round(time.Millisecond), got)
		if took <= idle {
			t.Logf("round %d: the resume was not slower than the idle timeout, so this round did not test the race", round)
		}
	}
}

// eventSummary lists the reasons and messages of the events of the
// sandbox named name, oldest first, for a failure's message.
func (e *clusterEnv) eventSummary(name string) string {
	var list corev1.EventList
	if err := e.c.List(e.ctx, &list, client.InNamespace(e.ns)); err != nil {
		return err.Error()
	}
	var b strings.Builder
	for _, ev := range list.Items {
		if ev.InvolvedObject.Name == name && ev.InvolvedObject.Kind == "Sandbox" {
			fmt.Fprintf(&b, "\n  %s %s: %s", ev.LastTimestamp.Format("15:04:05"), ev.Reason, ev.Message)
		}
	}
	return b.String()
}
