package controller

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	"github.com/agentbox/terraform-provider-agentbox/internal/snapshot"
)

// Periodic checkpoints. An idle stop saves the workspace, but a node that
// dies takes every change since the last stop with it. A template's
// checkpointInterval bounds that loss: while the sandbox runs, its
// workspace is saved in the background with the platform's snapshot
// driver, which reads it through the supervisor (archive) or snapshots the
// live volume (volumesnapshot), so the agent is never paused. A ready
// checkpoint becomes status.snapshot, which is what a sandbox whose
// workspace went with its node resumes from, so node loss needs nothing
// of its own. The last checkpointsKept are kept in status.checkpoints; an
// idle stop's snapshot supersedes them all.
//
// What must survive a restart of the control plane lives in status: the
// checkpoint being taken (pendingCheckpoint) and when the newest attempt
// began (lastCheckpointTime), from which the next one is due.

// Event reasons of checkpoints.
const (
	// EventCheckpointed (Normal): a checkpoint of the running sandbox's
	// workspace is ready.
	EventCheckpointed = "Checkpointed"
	// EventCheckpointFailed (Warning): a checkpoint could not be taken;
	// the sandbox keeps running, and the next is tried an interval later.
	EventCheckpointFailed = "CheckpointFailed"
)

// checkpointPolicy returns the template's checkpoint interval, zero when
// checkpoints are off, and how many to keep.
func checkpointPolicy(tpl *v1alpha1.SandboxTemplate) (time.Duration, int) {
	if tpl == nil || tpl.Spec.CheckpointInterval == nil || tpl.Spec.CheckpointInterval.Duration <= 0 {
		return 0, 0
	}
	kept := int(tpl.Spec.CheckpointsKept)
	if kept <= 0 {
		// Not defaulted by the API server: objects built in tests.
		kept = v1alpha1.DefaultCheckpointsKept
	}
	return tpl.Spec.CheckpointInterval.Duration, kept
}

// checkpointName names the checkpoint begun at begin. The "c" keeps it
// apart from the stops' snapshot names, which end in a Unix time too.
func checkpointName(sandbox string, begin time.Time) string {
	return boundedSnapshotName(sandbox, "-c"+strconv.FormatInt(begin.Unix(), 10))
}

// checkpoint runs this pass's part of the periodic checkpoints of a
// sandbox that is to run, and returns when to look again (zero: no need).
// A failure is reported through an event and retried an interval later: a
// checkpoint missed costs nothing until a node is lost, so it never holds
// the sandbox up.
func (r *SandboxReconciler) checkpoint(ctx context.Context, sbx *v1alpha1.Sandbox, tpl *v1alpha1.SandboxTemplate, pod *corev1.Pod, a activity) (time.Duration, error) {
	interval, kept := checkpointPolicy(tpl)
	if interval == 0 || r.Snapshots == nil || sbx.Spec.Ephemeral || isWarm(sbx) {
		// Turned off (or never on) while one was being taken.
		return 0, r.dropPendingCheckpoint(ctx, sbx)
	}
	if sbx.Status.Phase != v1alpha1.SandboxPhaseRunning || pod == nil || !podReady(pod) {
		return 0, nil
	}
	if name := sbx.Status.PendingCheckpoint; name != "" {
		return r.takeCheckpoint(ctx, sbx, tpl, pod, name, kept, interval)
	}
	since := readyTransition(sbx)
	if last := sbx.Status.LastCheckpointTime; last != nil && last.After(since) {
		since = last.Time
	}
	if wait := since.Add(interval).Sub(r.now()); wait > 0 {
		return wait, nil
	}
	if a.last.IsZero() || !a.last.Add(v1alpha1.ActivityRenewInterval).After(since) {
		// No call since the newest checkpoint began (or since the sandbox
		// began serving): the workspace is as the agent left it then. The
		// Compute API writes at most one renewal per renew interval, so
		// calls up to an interval after the last renewal are not on the
		// clock: a checkpoint begun within that interval may have missed
		// them, and the next one is taken all the same.
		return interval, nil
	}
	if r.SnapshotHealth != nil && r.SnapshotHealth.Problem() != nil {
		// The stops' IdleStopBlocked condition already says why.
		return interval, nil
	}
	begin := r.now().Truncate(time.Second)
	sbx.Status.PendingCheckpoint = checkpointName(sbx.Name, begin)
	sbx.Status.LastCheckpointTime = &metav1.Time{Time: begin}
	return r.takeCheckpoint(ctx, sbx, tpl, pod, sbx.Status.PendingCheckpoint, kept, interval)
}

// takeCheckpoint starts, or looks at, checkpoint name, and records it once
// it is ready.
func (r *SandboxReconciler) takeCheckpoint(ctx context.Context, sbx *v1alpha1.Sandbox, tpl *v1alpha1.SandboxTemplate, pod *corev1.Pod, name string, kept int, interval time.Duration) (time.Duration, error) {
	sup, err := r.supervisor(sbx, pod)
	if err != nil {
		return 0, err
	}
	state, err := r.Snapshots.Take(ctx, snapshot.Request{
		Sandbox: sbx, Template: tpl, ClaimName: WorkspaceClaimName(workloadName(sbx)), Name: name, Supervisor: sup,
	})
	if err != nil || state.Failed != "" {
		cause := state.Failed
		var problem *snapshot.Problem
		switch {
		case errors.As(err, &problem):
			cause = problem.Message
		case err != nil:
			cause = err.Error()
		}
		if derr := r.dropPendingCheckpoint(ctx, sbx); derr != nil {
			return 0, derr
		}
		r.event(sbx, pod, corev1.EventTypeWarning, EventCheckpointFailed, "Checkpoint",
			fmt.Sprintf("checkpoint %s with the %s driver failed: %s; the sandbox keeps running, and the next checkpoint is tried in %s",
				name, snapshot.ID(r.Snapshots), cause, interval))
		metricSnapshots.WithLabelValues(r.Snapshots.Name(), "failed").Inc()
		return interval, nil
	}
	if !state.Ready {
		return snapshotPoll, nil
	}
	r.recordCheckpoint(ctx, sbx, pod, name, state, kept)
	return interval, nil
}

// recordCheckpoint makes a ready checkpoint the sandbox's snapshot, and
// deletes what it supersedes: an idle stop's snapshot, and checkpoints
// beyond the kept number. A failed delete leaks storage, not data, so it
// is logged and the checkpoint recorded all the same.
func (r *SandboxReconciler) recordCheckpoint(ctx context.Context, sbx *v1alpha1.Sandbox, pod *corev1.Pod, name string, state snapshot.State, kept int) {
	ck := r.snapshotRecord(name, state)
	ck.Checkpoint = true
	var stale []string
	if prev := sbx.Status.Snapshot; prev != nil && !prev.Checkpoint && prev.Name != name {
		stale = append(stale, prev.Name)
	}
	list := append(slices.Clone(sbx.Status.Checkpoints), ck)
	for len(list) > kept {
		stale = append(stale, list[0].Name)
		list = list[1:]
	}
	sbx.Status.Checkpoints = list
	sbx.Status.Snapshot = ck.DeepCopy()
	sbx.Status.PendingCheckpoint = ""
	r.deleteSnapshots(ctx, sbx, stale)
	metricSnapshots.WithLabelValues(r.Snapshots.Name(), "ready").Inc()
	began := ""
	if t := sbx.Status.LastCheckpointTime; t != nil {
		began = " begun " + t.UTC().Format(time.RFC3339) + ","
	}
	msg := fmt.Sprintf("checkpoint %s of the workspace is ready (%s,%s %s driver); %d kept", name, formatBytes(state.SizeBytes), began, snapshot.ID(r.Snapshots), len(list))
	r.event(sbx, pod, corev1.EventTypeNormal, EventCheckpointed, "Checkpoint", msg)
	r.snapshotCut(sbx, EventCheckpointed, name, state.SizeBytes, msg)
}

// dropPendingCheckpoint abandons the checkpoint being taken, if any: an
// idle stop's snapshot supersedes it, checkpoints were turned off, or it
// failed. The driver cancels an upload in flight.
func (r *SandboxReconciler) dropPendingCheckpoint(ctx context.Context, sbx *v1alpha1.Sandbox) error {
	name := sbx.Status.PendingCheckpoint
	if name == "" {
		return nil
	}
	if r.Snapshots != nil {
		if err := r.Snapshots.Delete(ctx, sbx, name); err != nil && !errors.Is(err, snapshot.ErrNotFound) {
			return fmt.Errorf("delete checkpoint %s: %w", name, err)
		}
	}
	sbx.Status.PendingCheckpoint = ""
	return nil
}
