package controller

import (
	"context"
	"errors"
	"slices"
	"strings"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	"github.com/agentbox/terraform-provider-agentbox/internal/snapshot"
)

func checkpointNames(list []v1alpha1.SandboxSnapshot) []string {
	var out []string
	for _, c := range list {
		out = append(out, c.Name)
	}
	return out
}

// A running sandbox is checkpointed every checkpointInterval while calls
// come in, keeps checkpointsKept of them, survives a failed one, and its
// idle stop supersedes them all.
func TestUnitCheckpoints(t *testing.T) {
	f, d := newLifecycleEnv(t, idleSandbox("s", time.Hour))
	ctx := context.Background()
	tpl := unitTemplate("t")
	must(t, f.c.Get(ctx, client.ObjectKeyFromObject(tpl), tpl))
	tpl.Spec.CheckpointInterval = &metav1.Duration{Duration: time.Minute}
	tpl.Spec.CheckpointsKept = 2
	must(t, f.c.Update(ctx, tpl))

	f.reconcile("s")
	// The pod takes a while to start: the sandbox's creation renewed the
	// activity clock before it serves, more than a renew interval before,
	// so no call can have gone unrecorded since.
	f.clock.Step(v1alpha1.ActivityRenewInterval + 3*time.Second)
	f.podReady("s")
	f.reconcile("s")
	f.wantPhase("s", v1alpha1.SandboxPhaseRunning, v1alpha1.ReasonRunning)

	// Due, but nobody called since the sandbox began serving: nothing to save.
	f.clock.Step(61 * time.Second)
	f.reconcile("s")
	if len(d.taken) != 0 {
		t.Fatalf("checkpoint taken without activity: %v", d.taken)
	}

	// A call, and the checkpoint is begun; it stays pending until ready,
	// and the sandbox serves all along.
	f.renew("s")
	res := f.reconcile("s")
	sbx := f.wantPhase("s", v1alpha1.SandboxPhaseRunning, v1alpha1.ReasonRunning)
	if len(d.taken) != 1 || sbx.Status.PendingCheckpoint != d.taken[0] || !strings.Contains(d.taken[0], "-c") || res.RequeueAfter != snapshotPoll {
		t.Fatalf("taken %v, pending %q, requeue %s", d.taken, sbx.Status.PendingCheckpoint, res.RequeueAfter)
	}
	first := d.taken[0]
	d.state = snapshot.State{Ready: true, SizeBytes: 2048}
	res = f.reconcile("s")
	sbx = f.wantPhase("s", v1alpha1.SandboxPhaseRunning, v1alpha1.ReasonRunning)
	if s := sbx.Status.Snapshot; s == nil || s.Name != first || !s.Checkpoint || s.Driver != "recording" || sbx.Status.PendingCheckpoint != "" {
		t.Fatalf("after the first checkpoint: snapshot %+v, pending %q", s, sbx.Status.PendingCheckpoint)
	}
	if res.RequeueAfter <= 0 || res.RequeueAfter > time.Minute {
		t.Errorf("requeue %s; want the next checkpoint within the 1m interval", res.RequeueAfter)
	}
	if evs := strings.Join(f.drainEvents(), "\n"); !strings.Contains(evs, EventCheckpointed) || !strings.Contains(evs, first) {
		t.Errorf("events %q lack Checkpointed for %s", evs, first)
	}

	// Two more: only the newest two are kept.
	for range 2 {
		f.clock.Step(61 * time.Second)
		f.renew("s")
		f.reconcile("s")
	}
	sbx = f.sandbox("s")
	if got := checkpointNames(sbx.Status.Checkpoints); len(got) != 2 || got[1] != sbx.Status.Snapshot.Name || slices.Contains(got, first) {
		t.Fatalf("checkpoints %v, snapshot %s", got, sbx.Status.Snapshot.Name)
	}
	if !slices.Equal(d.deleted, []string{first}) {
		t.Fatalf("deleted %v; want the oldest, %s", d.deleted, first)
	}
	kept := checkpointNames(sbx.Status.Checkpoints)

	// A failed checkpoint: the sandbox serves on, the good ones stay, the
	// failed one is deleted, and the next waits a whole interval.
	d.takeErr = errors.New("store unreachable")
	f.clock.Step(61 * time.Second)
	f.renew("s")
	f.reconcile("s")
	sbx = f.wantPhase("s", v1alpha1.SandboxPhaseRunning, v1alpha1.ReasonRunning)
	failed := d.taken[len(d.taken)-1]
	if sbx.Status.PendingCheckpoint != "" || sbx.Status.Snapshot.Name != kept[1] || d.deleted[len(d.deleted)-1] != failed {
		t.Fatalf("after a failure: pending %q, snapshot %s, deleted %v", sbx.Status.PendingCheckpoint, sbx.Status.Snapshot.Name, d.deleted)
	}
	if evs := strings.Join(f.drainEvents(), "\n"); !strings.Contains(evs, EventCheckpointFailed) || !strings.Contains(evs, "store unreachable") {
		t.Errorf("events %q lack CheckpointFailed with the cause", evs)
	}
	takes := len(d.taken)
	f.renew("s")
	f.reconcile("s")
	if len(d.taken) != takes {
		t.Fatalf("a checkpoint was tried again at once after a failure: %v", d.taken)
	}

	// The idle stop's snapshot supersedes every checkpoint.
	d.takeErr = nil
	f.clock.Step(2 * time.Hour)
	f.reconcile("s")
	sbx = f.wantPhase("s", v1alpha1.SandboxPhaseStopped, v1alpha1.ReasonStopped)
	if sbx.Status.Snapshot.Checkpoint || len(sbx.Status.Checkpoints) != 0 {
		t.Fatalf("after the stop: snapshot %+v, checkpoints %v", sbx.Status.Snapshot, checkpointNames(sbx.Status.Checkpoints))
	}
	for _, n := range kept {
		if !slices.Contains(d.deleted, n) {
			t.Errorf("checkpoint %s was not deleted when the stop superseded it (deleted %v)", n, d.deleted)
		}
	}
	if slices.Contains(d.deleted, sbx.Status.Snapshot.Name) {
		t.Errorf("the stop's own snapshot %s was deleted", sbx.Status.Snapshot.Name)
	}
}

// The Compute API renews the activity clock at most once per renew
// interval, so calls made within it after a renewal leave no mark: a
// checkpoint begun then may have missed them, and the next one is taken
// although the clock did not move. Once a checkpoint began a whole renew
// interval after the last renewal, none is taken without a new one.
func TestUnitCheckpointAfterUnrecordedCalls(t *testing.T) {
	f, d := newLifecycleEnv(t, idleSandbox("s", time.Hour))
	ctx := context.Background()
	tpl := unitTemplate("t")
	must(t, f.c.Get(ctx, client.ObjectKeyFromObject(tpl), tpl))
	tpl.Spec.CheckpointInterval = &metav1.Duration{Duration: time.Minute}
	must(t, f.c.Update(ctx, tpl))
	d.state = snapshot.State{Ready: true, SizeBytes: 1024}
	f.reconcile("s")
	f.clock.Step(v1alpha1.ActivityRenewInterval + time.Second)
	f.podReady("s")
	f.reconcile("s")
	f.wantPhase("s", v1alpha1.SandboxPhaseRunning, v1alpha1.ReasonRunning)

	// A call renews the clock 10 s before the checkpoint is due.
	f.clock.Step(50 * time.Second)
	f.renew("s")
	f.clock.Step(11 * time.Second)
	f.reconcile("s")
	if len(d.taken) != 1 {
		t.Fatalf("checkpoints after a call: %v", d.taken)
	}
	// Quiet since, on the clock; but a call 20 s after the renewal, after
	// the checkpoint began, would not have renewed it.
	f.clock.Step(61 * time.Second)
	f.reconcile("s")
	if len(d.taken) != 2 {
		t.Fatalf("no checkpoint after one begun within a renew interval of the last renewal: %v", d.taken)
	}
	for range 3 {
		f.clock.Step(61 * time.Second)
		f.reconcile("s")
	}
	if len(d.taken) != 2 {
		t.Fatalf("checkpoints taken with no call that could have gone unrecorded: %v", d.taken)
	}
}

// A stop that begins while a checkpoint is being taken drops it, and
// templates without an interval take none.
func TestUnitCheckpointDroppedByStop(t *testing.T) {
	f, d := newLifecycleEnv(t, idleSandbox("s", 90*time.Second))
	ctx := context.Background()
	tpl := unitTemplate("t")
	must(t, f.c.Get(ctx, client.ObjectKeyFromObject(tpl), tpl))
	tpl.Spec.CheckpointInterval = &metav1.Duration{Duration: time.Minute}
	must(t, f.c.Update(ctx, tpl))
	f.reconcile("s")
	f.podReady("s")
	f.reconcile("s")
	f.clock.Step(61 * time.Second)
	f.renew("s")
	f.reconcile("s")
	pending := f.sandbox("s").Status.PendingCheckpoint
	if pending == "" {
		t.Fatal("no checkpoint begun")
	}
	f.clock.Step(2 * time.Minute)
	f.reconcile("s")
	sbx := f.wantPhase("s", v1alpha1.SandboxPhaseIdleStopping, v1alpha1.ReasonIdleTimeout)
	if sbx.Status.PendingCheckpoint != "" || !slices.Contains(d.deleted, pending) {
		t.Fatalf("pending checkpoint %q after the stop began; deleted %v", sbx.Status.PendingCheckpoint, d.deleted)
	}

	g, d2 := newLifecycleEnv(t, idleSandbox("s", time.Hour))
	g.reconcile("s")
	g.podReady("s")
	g.reconcile("s")
	for range 3 {
		g.clock.Step(10 * time.Minute)
		g.renew("s")
		g.reconcile("s")
	}
	if len(d2.taken) != 0 {
		t.Fatalf("checkpoints taken without an interval: %v", d2.taken)
	}
}

// After a node loss, the messages say the sandbox resumes from its
// newest checkpoint, and what is lost.
func TestUnitNodeLossNamesCheckpoint(t *testing.T) {
	ready := metav1.NewTime(time.Date(2026, 11, 27, 12, 0, 0, 0, time.UTC))
	sbx := unitSandbox("s", "t")
	sbx.Status.Snapshot = &v1alpha1.SandboxSnapshot{Name: "s-c123", ReadyTime: &ready, Checkpoint: true}
	loss := &v1alpha1.SandboxNodeLoss{NodeName: "n1", WorkspaceLost: true}
	msg := nodeLossMessage(sbx, loss, true)
	for _, want := range []string{"newest checkpoint s-c123", "2026-11-27T12:00:00Z", "changes made after that checkpoint are lost"} {
		if !strings.Contains(msg, want) {
			t.Errorf("message %q lacks %q", msg, want)
		}
	}
}
