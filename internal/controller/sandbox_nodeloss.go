package controller

import (
	"context"
	"fmt"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/component-helpers/scheduling/corev1/nodeaffinity"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
)

// EventNodeLost is recorded on a Sandbox whose workspace volume was pinned
// to a node that no longer exists.
const EventNodeLost = "NodeLost"

// Node loss: a workspace on node-local storage (local-path, a
// hostPath or local PersistentVolume) is pinned to its node by the
// volume's node affinity. Once that node object is gone the claim can
// never be mounted again, and a new pod would wait unschedulable for ever.
// The sandbox then gives the claim up and resumes elsewhere from its last
// snapshot, through the same restore as a resume after an idle stop.
//
// Only a deleted Node counts as lost. A node that is NotReady may come
// back with the data; deciding it never will is the node lifecycle
// controller's and the operator's call, and deleting the Node object is
// how they make it.

// recoverFromNodeLoss checks, for a sandbox that is not serving, whether
// its workspace claim is bound to a volume no existing node can mount. If
// so it deletes the pod (whose node is gone, so nothing runs it) and the
// claim, and reports true; the next pass creates a claim that restores the
// last snapshot, or an empty one when there is none.
func (r *SandboxReconciler) recoverFromNodeLoss(ctx context.Context, sbx *v1alpha1.Sandbox, pod *corev1.Pod, claim *corev1.PersistentVolumeClaim) (bool, error) {
	if claim == nil || claim.Spec.VolumeName == "" || !claim.DeletionTimestamp.IsZero() || (pod != nil && podReady(pod)) {
		return false, nil
	}
	var pv corev1.PersistentVolume
	if err := r.Get(ctx, types.NamespacedName{Name: claim.Spec.VolumeName}, &pv); err != nil {
		if apierrors.IsNotFound(err) {
			return false, nil
		}
		return false, fmt.Errorf("get volume %s of workspace claim %s: %w", claim.Spec.VolumeName, claim.Name, err)
	}
	if pv.Spec.NodeAffinity == nil || pv.Spec.NodeAffinity.Required == nil {
		// Network storage: any node can mount it.
		return false, nil
	}
	sel, err := nodeaffinity.NewNodeSelector(pv.Spec.NodeAffinity.Required)
	if err != nil {
		return false, fmt.Errorf("node affinity of volume %s: %w", pv.Name, err)
	}
	var nodes corev1.NodeList
	if err := r.List(ctx, &nodes); err != nil {
		return false, fmt.Errorf("list nodes: %w", err)
	}
	for i := range nodes.Items {
		if sel.Match(&nodes.Items[i]) {
			return false, nil
		}
	}

	next := "an empty workspace: the sandbox has no snapshot, so its files are lost"
	if snap := sbx.Status.Snapshot; snap != nil && !sbx.Spec.Ephemeral && r.Snapshots != nil {
		next = fmt.Sprintf("the workspace restored from its last snapshot %s", snap.Name)
	}
	msg := fmt.Sprintf("workspace volume %s is pinned to a node that no longer exists; the sandbox starts on another node with %s",
		pv.Name, next)
	if pod != nil && pod.DeletionTimestamp.IsZero() {
		// Its node is gone, so no kubelet will ever confirm a graceful
		// deletion; and nothing runs it that a grace period would protect.
		if err := r.Delete(ctx, pod, client.Preconditions{UID: &pod.UID}, client.GracePeriodSeconds(0)); err != nil && !apierrors.IsNotFound(err) {
			return false, fmt.Errorf("delete pod %s of the lost node: %w", pod.Name, err)
		}
	}
	if err := r.Delete(ctx, claim, client.Preconditions{UID: ptr.To(claim.UID)}); err != nil && !apierrors.IsNotFound(err) {
		return false, fmt.Errorf("delete workspace claim %s of the lost node: %w", claim.Name, err)
	}
	r.setNotServing(sbx, v1alpha1.SandboxPhasePending, v1alpha1.ReasonNodeLost, msg)
	r.event(sbx, claim, corev1.EventTypeWarning, EventNodeLost, "Recover", msg)
	return true, nil
}
