package controller

import (
	"context"
	"fmt"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
)

// Events of a reused warm sandbox (a pool with releasePolicy Reuse).
const (
	// EventPoolResetStarted: the pool lease ended, and the sandbox is
	// being readied for its next holder.
	EventPoolResetStarted = "PoolResetStarted"
	// EventPoolReused: the reset finished, and the sandbox is back in its
	// pool.
	EventPoolReused = "PoolReused"
	// EventPoolResetFailed: the reset failed or took too long, and the
	// sandbox was deleted instead.
	EventPoolResetFailed = "PoolResetFailed"
)

// poolResetRecheck is how often a reset in progress is looked at when no
// pod event comes.
const poolResetRecheck = 2 * time.Second

// reusedByPool reports whether sbx's pool returns released sandboxes to
// the pool rather than deleting them. A pool that cannot be read deletes:
// the safe choice.
func (r *SandboxReconciler) reusedByPool(ctx context.Context, sbx *v1alpha1.Sandbox) bool {
	var pool v1alpha1.SandboxWarmPool
	key := types.NamespacedName{Namespace: sbx.Namespace, Name: sbx.Labels[v1alpha1.LabelWarmPool]}
	if err := r.Get(ctx, key, &pool); err != nil {
		return false
	}
	return pool.Spec.ReleasePolicy == v1alpha1.ReleasePolicyReuse
}

// beginPoolReset marks a sandbox whose pool lease ended (why) to be reset
// for its pool; continuePoolReset does the rest. It stays leased, so
// nobody takes it, until the reset is done.
func (r *SandboxReconciler) beginPoolReset(ctx context.Context, sbx *v1alpha1.Sandbox, why string) error {
	patch := client.MergeFrom(sbx.DeepCopy())
	sbx.Annotations[v1alpha1.AnnotationPoolReset] = sbx.Annotations[v1alpha1.AnnotationPoolLeaseRequestID]
	sbx.Annotations[v1alpha1.AnnotationPoolResetAt] = r.now().UTC().Format(time.RFC3339Nano)
	if err := r.Patch(ctx, sbx, patch); err != nil {
		return fmt.Errorf("mark warm sandbox %s for reset: %w", sbx.Name, err)
	}
	r.event(sbx, nil, corev1.EventTypeNormal, EventPoolResetStarted, "Reset",
		fmt.Sprintf("%s; its pool reuses it: the pod is made anew and the workspace reset before it is handed out again", why))
	return nil
}

// continuePoolReset runs the next step of a reset: it deletes the pod the
// holder used; the pass then makes a new one (desiredPod), whose init
// container resets the workspace before the supervisor starts; once that
// pod serves, the sandbox's take and pool-lease annotations are cleared,
// which puts it back in the pool. A failed reset, or one that takes longer
// than v1alpha1.PoolResetTimeout, deletes the sandbox. It reports whether
// the pass is over (deleted, or waiting for the old pod to go).
func (r *SandboxReconciler) continuePoolReset(ctx context.Context, sbx *v1alpha1.Sandbox, pod *corev1.Pod) (bool, time.Duration, error) {
	reset := sbx.Annotations[v1alpha1.AnnotationPoolReset]
	if reset == "" {
		return false, 0, nil
	}
	started, err := time.Parse(time.RFC3339Nano, sbx.Annotations[v1alpha1.AnnotationPoolResetAt])
	if err != nil || r.now().Sub(started) > v1alpha1.PoolResetTimeout {
		return true, 0, r.failPoolReset(ctx, sbx, fmt.Sprintf("the reset did not finish within %s", v1alpha1.PoolResetTimeout))
	}
	switch {
	case pod == nil:
		// The pass creates the new pod.
		return false, poolResetRecheck, nil
	case pod.Annotations[v1alpha1.AnnotationPoolReset] != reset:
		// The holder's pod: everything it ran goes with it.
		if pod.DeletionTimestamp.IsZero() {
			uid := pod.UID
			if err := r.Delete(ctx, pod, client.Preconditions{UID: &uid}); err != nil && !apierrors.IsNotFound(err) {
				return true, 0, fmt.Errorf("delete pod %s for the reset: %w", pod.Name, err)
			}
		}
		return true, poolResetRecheck, nil
	}
	if msg, failed := resetFailed(pod); failed {
		return true, 0, r.failPoolReset(ctx, sbx, "the workspace reset failed: "+msg)
	}
	if !podReady(pod) {
		return false, poolResetRecheck, nil
	}
	return false, 0, r.finishPoolReset(ctx, sbx)
}

// resetFailed reports whether the reset pod's init container (which runs
// the reset) failed, with its termination message.
func resetFailed(pod *corev1.Pod) (string, bool) {
	for _, s := range pod.Status.InitContainerStatuses {
		if s.Name != InstallContainerName {
			continue
		}
		for _, t := range []*corev1.ContainerStateTerminated{s.State.Terminated, s.LastTerminationState.Terminated} {
			if t != nil && t.ExitCode != 0 {
				msg := t.Message
				if msg == "" {
					msg = fmt.Sprintf("exit status %d (%s)", t.ExitCode, t.Reason)
				}
				return msg, true
			}
		}
	}
	return "", pod.Status.Phase == corev1.PodFailed
}

// finishPoolReset puts a reset sandbox back in its pool: its take is
// forgotten, so that the store lets the next lease take it, and then the
// pool-lease annotations go, which makes it takeable.
func (r *SandboxReconciler) finishPoolReset(ctx context.Context, sbx *v1alpha1.Sandbox) error {
	if r.WarmTakes != nil {
		if err := r.WarmTakes.ForgetWarmTake(ctx, string(sbx.UID)); err != nil {
			return fmt.Errorf("forget the take of reused warm sandbox %s: %w", sbx.Name, err)
		}
	}
	holder := sbx.Annotations[v1alpha1.AnnotationPoolLeaseHolder]
	patch := client.MergeFrom(sbx.DeepCopy())
	for _, k := range []string{v1alpha1.AnnotationPoolLeaseHolder, v1alpha1.AnnotationPoolLeaseRequestID, v1alpha1.AnnotationPoolLeasedAt,
		v1alpha1.AnnotationPoolColdStart, v1alpha1.AnnotationPoolReset, v1alpha1.AnnotationPoolResetAt} {
		delete(sbx.Annotations, k)
	}
	sbx.Annotations[v1alpha1.AnnotationPoolReusedAt] = r.now().UTC().Format(time.RFC3339Nano)
	if err := r.Patch(ctx, sbx, patch); err != nil {
		return fmt.Errorf("return warm sandbox %s to its pool: %w", sbx.Name, err)
	}
	r.event(sbx, nil, corev1.EventTypeNormal, EventPoolReused, "Reuse",
		fmt.Sprintf("back in pool %s after the lease of %q: new pod, workspace reset and verified", sbx.Labels[v1alpha1.LabelWarmPool], holder))
	return nil
}

// failPoolReset deletes a sandbox whose reset failed: the safe fallback,
// as under releasePolicy Delete. The pool has its replacement already.
func (r *SandboxReconciler) failPoolReset(ctx context.Context, sbx *v1alpha1.Sandbox, why string) error {
	uid := sbx.UID
	if err := r.Delete(ctx, sbx, client.Preconditions{UID: &uid}); err != nil && !apierrors.IsNotFound(err) {
		return fmt.Errorf("delete warm sandbox %s after its failed reset: %w", sbx.Name, err)
	}
	metricEphemeralRecycled.Inc()
	r.event(sbx, nil, corev1.EventTypeWarning, EventPoolResetFailed, "Delete",
		fmt.Sprintf("%s; the sandbox was deleted with its workspace so that no state reaches the next holder", why))
	return nil
}
