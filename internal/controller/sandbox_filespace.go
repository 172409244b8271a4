package controller

import (
	"context"
	"fmt"
	"time"

	corev1 "k8s.io/api/core/v1"
	logf "sigs.k8s.io/controller-runtime/pkg/log"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	"github.com/agentbox/terraform-provider-agentbox/internal/filespace"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"
)

// The sandbox's sync with its agent's filespace: a push before an idle
// stop's snapshot, and a pull before a new or resumed workspace serves.

// syncRetryDelay spaces the two sync attempts of an idle stop.
var syncRetryDelay = time.Second

// syncBeforeStop pushes the workspace into the agent's filespace and then
// makes the workspace's last writes durable before it is snapshotted,
// retrying once: a failure that persists stops the sandbox without a
// snapshot (SyncFailed). The push comes first because it writes
// the sync baseline into the workspace, which the snapshot must hold.
func (r *SandboxReconciler) syncBeforeStop(ctx context.Context, sbx *v1alpha1.Sandbox, sup *supervisorapi.Client) error {
	var err error
	for attempt := range 2 {
		if attempt > 0 {
			select {
			case <-ctx.Done():
				return ctx.Err()
			case <-time.After(syncRetryDelay):
			}
		}
		if err = r.pushFilespace(ctx, sbx, sup); err != nil {
			continue
		}
		fctx, cancel := context.WithTimeout(ctx, supervisorCallTimeout)
		err = sup.Flush(fctx)
		cancel()
		if err == nil {
			return nil
		}
	}
	return err
}

func (r *SandboxReconciler) pushFilespace(ctx context.Context, sbx *v1alpha1.Sandbox, sup *supervisorapi.Client) error {
	sum, err := r.syncFilespace(ctx, sbx, sup, filespace.Push)
	if err != nil || sum == nil {
		return err
	}
	logf.FromContext(ctx).Info("filespace pushed before the idle stop", "pushed", sum.Pushed, "deleted", sum.Deleted, "bytes", sum.Bytes)
	return nil
}

// pullFilespace brings the agent's filespace into a workspace that is about
// to serve: a new one (the agent's files outlive its sandboxes) or one just
// restored from a snapshot (the filespace may be newer). A sync is
// idempotent, so running it again after a crash or an error is safe.
func (r *SandboxReconciler) pullFilespace(ctx context.Context, sbx *v1alpha1.Sandbox, pod *corev1.Pod) error {
	if r.Filespaces == nil || isWarm(sbx) {
		return nil
	}
	sup, err := r.supervisor(sbx, pod)
	if err != nil {
		return err
	}
	sum, err := r.syncFilespace(ctx, sbx, sup, filespace.Pull)
	if err != nil || sum == nil {
		return err
	}
	if sum.Pulled+sum.Deleted > 0 {
		r.event(sbx, pod, corev1.EventTypeNormal, EventFilespacePulled, "Sync",
			fmt.Sprintf("pulled %d files (%s) and %d deletions from the agent's filespace into the workspace", sum.Pulled, formatBytes(sum.Bytes), sum.Deleted))
	}
	return nil
}

// syncFilespace runs one sync of sbx's workspace with its agent's
// filespace, or nothing (nil, nil) without a syncer or for a warm sandbox,
// which has no agent yet and pulls once it is adopted.
func (r *SandboxReconciler) syncFilespace(ctx context.Context, sbx *v1alpha1.Sandbox, sup *supervisorapi.Client, dir filespace.Direction) (*filespace.Summary, error) {
	if r.Filespaces == nil || isWarm(sbx) {
		return nil, nil
	}
	sctx, cancel := context.WithTimeout(ctx, filespace.Timeout)
	defer cancel()
	sum, err := r.Filespaces.Sync(sctx, sup, filespace.Options{AgentID: sbx.Spec.AgentID, Direction: dir, Now: r.now})
	if err != nil {
		return nil, fmt.Errorf("%s between the workspace and the agent's filespace: %w", dir, err)
	}
	return sum, nil
}
