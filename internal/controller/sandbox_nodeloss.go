package controller

import (
	"context"
	"errors"
	"fmt"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/component-helpers/scheduling/corev1/nodeaffinity"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"
	logf "sigs.k8s.io/controller-runtime/pkg/log"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	"github.com/agentbox/terraform-provider-agentbox/internal/snapshot"
)

// EventNodeLost is recorded on a Sandbox whose node no longer exists.
const EventNodeLost = "NodeLost"

// sandboxNodeIndex indexes Sandboxes by status.nodeName, so that a deleted
// Node finds the sandboxes that ran there.
const sandboxNodeIndex = "status.nodeName"

// Node loss. Only a deleted Node object counts as lost: a node that is
// NotReady may come back with the data, and deciding that it never will is
// the node lifecycle controller's, an autoscaler's or an operator's call,
// which they make by deleting the Node. A sandbox can learn of it three
// ways, and all three end the same:
//
//   - its pod is still there, bound to the deleted node (the pod garbage
//     collector waits 40 s before it removes such pods);
//   - its pod is gone already, removed by the pod garbage collector, and
//     status.nodeName, kept for this, names the deleted node;
//   - its workspace claim is bound to a node-local volume that no existing
//     node can mount (the pod was never scheduled, or the loss happened
//     while the controller was down and the pod is gone).
//
// The pod is force-deleted: its kubelet is gone and will never confirm a
// graceful deletion. What happens to the workspace depends on its storage.
// Node-local storage (local-path, a hostPath or local PersistentVolume,
// pinned to the node by the volume's node affinity) went with the node: the
// claim is deleted, and the sandbox will resume from its last snapshot, as
// after an idle stop, or with an empty workspace when it has none (its
// files are lost, and the condition says so). Network storage is kept: any
// other node mounts the same claim, with the files as they were.
//
// The sandbox then goes to phase Error with reason NodeLost, and
// status.nodeLoss records the activity clock's renewTime. It holds no node
// until the next activity, a renewal past that time, which every call
// through the Compute API makes (the call waits for the resume within its
// bound): a sandbox nobody calls any more is not restarted for nothing, and
// one that had unsnapshotted changes shows, until then, that they are lost.
// A warm pool's unassigned sandbox has nobody to call it, so it starts
// again at once.

// handleNodeLoss looks for the loss of the sandbox's node, and deals with a
// loss found earlier. It reports true when the pass ends here: the loss was
// just found, or the sandbox waits for the activity that resumes it. It
// runs before the idle stop and the start of a pod, which would otherwise
// wait for ever on a pod or a volume of a node that is gone.
func (r *SandboxReconciler) handleNodeLoss(ctx context.Context, sbx *v1alpha1.Sandbox, tpl *v1alpha1.SandboxTemplate, pod *corev1.Pod, activityClock *coordinationv1.Lease) (bool, error) {
	claim, err := r.workspaceClaim(ctx, sbx)
	if err != nil {
		return false, err
	}
	if loss := sbx.Status.NodeLoss; loss != nil {
		// Whatever a pass that failed half-way left behind goes now.
		if err := r.dropLostWorkload(ctx, sbx, pod, claim, !isWarm(sbx) && !lossWoken(loss, activityClock)); err != nil {
			return false, err
		}
		if isWarm(sbx) || lossWoken(loss, activityClock) {
			sbx.Status.NodeLoss = nil
			at := ""
			if activityClock != nil && activityClock.Spec.RenewTime != nil {
				at = " at " + activityClock.Spec.RenewTime.UTC().Format(time.RFC3339)
			}
			r.event(sbx, nil, corev1.EventTypeNormal, EventResuming, "Resume",
				fmt.Sprintf("activity%s after the loss of %s: starting the sandbox on another node with %s", at, lostNodeName(loss), resumeSource(sbx, loss, r.Snapshots != nil)))
			return false, nil
		}
		// Said again on every pass, so that a ReconcileError in between
		// does not leave the sandbox looking like it needs a person.
		r.setNotServing(sbx, v1alpha1.SandboxPhaseError, v1alpha1.ReasonNodeLost, nodeLossMessage(sbx, loss, r.Snapshots != nil))
		sbx.Status.NodeName = ""
		return true, nil
	}

	node, err := r.lostNode(ctx, sbx, pod, claim)
	if err != nil || node == nil {
		if err == nil {
			sbx.Status.NodeName = ""
			if pod != nil {
				sbx.Status.NodeName = pod.Spec.NodeName
			}
		}
		return false, err
	}
	if sbx.Status.Phase == v1alpha1.SandboxPhaseStopped {
		// A stopped sandbox lost nothing: its workspace is in the snapshot.
		// Only the pod the stop deleted, which its node can no longer
		// confirm, is left to remove.
		sbx.Status.NodeName = ""
		return false, r.dropLostWorkload(ctx, sbx, pod, claim, false)
	}
	stranded, _, err := r.volumeStranded(ctx, claim)
	if err != nil {
		return false, err
	}
	if sbx.Status.Phase == v1alpha1.SandboxPhaseIdleStopping {
		r.endStopOfLostNode(ctx, sbx, tpl)
	}
	// A checkpoint under way read from the lost node; the newest ready
	// one is what the sandbox resumes from.
	if err := r.dropPendingCheckpoint(ctx, sbx); err != nil {
		return false, err
	}
	if err := r.dropLostWorkload(ctx, sbx, pod, claim, false); err != nil {
		return false, err
	}
	loss := &v1alpha1.SandboxNodeLoss{
		NodeName:      *node,
		Time:          metav1.NewTime(r.now().Truncate(time.Second)),
		WorkspaceLost: stranded || claim == nil,
	}
	if activityClock != nil && activityClock.Spec.RenewTime != nil {
		loss.ActivityTime = ptr.To(metav1.NewMicroTime(activityClock.Spec.RenewTime.Truncate(time.Microsecond)))
	}
	sbx.Status.NodeLoss = loss
	sbx.Status.NodeName = ""
	msg := nodeLossMessage(sbx, loss, r.Snapshots != nil)
	r.setNotServing(sbx, v1alpha1.SandboxPhaseError, v1alpha1.ReasonNodeLost, msg)
	var related runtime.Object
	if claim != nil {
		related = claim
	}
	r.event(sbx, related, corev1.EventTypeWarning, EventNodeLost, "Recover", msg)
	return true, nil
}

// lossWoken reports whether there was activity after the node loss: the
// activity clock's renewTime moved from what it was when the loss was found. Only a
// change is asked for, not a later time, so that the clocks of the control
// plane's replicas never matter. Lease times are kept to microseconds.
func lossWoken(loss *v1alpha1.SandboxNodeLoss, activityClock *coordinationv1.Lease) bool {
	if activityClock == nil || activityClock.Spec.RenewTime == nil {
		return false
	}
	if loss.ActivityTime == nil {
		return true
	}
	return !activityClock.Spec.RenewTime.Truncate(time.Microsecond).Equal(loss.ActivityTime.Truncate(time.Microsecond))
}

// workspaceClaim returns the sandbox's workspace claim, nil when it has none.
func (r *SandboxReconciler) workspaceClaim(ctx context.Context, sbx *v1alpha1.Sandbox) (*corev1.PersistentVolumeClaim, error) {
	var claim corev1.PersistentVolumeClaim
	found, err := r.getChild(ctx, sbx, WorkspaceClaimName(workloadName(sbx)), &claim)
	if err != nil || !found {
		return nil, err
	}
	return &claim, nil
}

// lostNode returns the name of the sandbox's node if that node no longer
// exists, and nil while it does (or the sandbox has none). The name is
// empty when only the workspace volume shows the loss, through a node
// affinity that may name no single node.
func (r *SandboxReconciler) lostNode(ctx context.Context, sbx *v1alpha1.Sandbox, pod *corev1.Pod, claim *corev1.PersistentVolumeClaim) (*string, error) {
	name := ""
	switch {
	case pod != nil:
		name = pod.Spec.NodeName
	case sbx.Status.Phase != v1alpha1.SandboxPhaseStopped:
		// The pod went without the controller deleting it (deleting it
		// clears status.nodeName): evicted, deleted by someone, or garbage
		// collected after its node went.
		name = sbx.Status.NodeName
	}
	if name != "" {
		gone, err := r.nodeGone(ctx, name)
		if err != nil || !gone {
			return nil, err
		}
		return &name, nil
	}
	if claim == nil || !claim.DeletionTimestamp.IsZero() {
		return nil, nil
	}
	stranded, pv, err := r.volumeStranded(ctx, claim)
	if err != nil || !stranded {
		return nil, err
	}
	name = pinnedHostname(pv)
	return &name, nil
}

// nodeGone reports whether Node name does not exist. The cache may not have
// seen a node that has just joined, so a miss there is confirmed with a
// direct read before anything is deleted because of it.
func (r *SandboxReconciler) nodeGone(ctx context.Context, name string) (bool, error) {
	var node corev1.Node
	err := r.Get(ctx, types.NamespacedName{Name: name}, &node)
	if err == nil {
		return false, nil
	}
	if !apierrors.IsNotFound(err) {
		return false, fmt.Errorf("get node %s: %w", name, err)
	}
	err = r.apiReader().Get(ctx, types.NamespacedName{Name: name}, &node)
	switch {
	case err == nil:
		return false, nil
	case apierrors.IsNotFound(err):
		return true, nil
	default:
		return false, fmt.Errorf("get node %s: %w", name, err)
	}
}

func (r *SandboxReconciler) apiReader() client.Reader {
	if r.APIReader != nil {
		return r.APIReader
	}
	return r.Client
}

// volumeStranded reports whether claim is bound to a volume pinned, by its
// node affinity, to nodes of which none exists any more: node-local storage
// of a lost node. Network storage, with no node affinity, is never
// stranded. It also returns the volume.
func (r *SandboxReconciler) volumeStranded(ctx context.Context, claim *corev1.PersistentVolumeClaim) (bool, *corev1.PersistentVolume, error) {
	if claim == nil || claim.Spec.VolumeName == "" {
		return false, nil, nil
	}
	var pv corev1.PersistentVolume
	if err := r.Get(ctx, types.NamespacedName{Name: claim.Spec.VolumeName}, &pv); err != nil {
		if apierrors.IsNotFound(err) {
			return false, nil, nil
		}
		return false, nil, fmt.Errorf("get volume %s of workspace claim %s: %w", claim.Spec.VolumeName, claim.Name, err)
	}
	if pv.Spec.NodeAffinity == nil || pv.Spec.NodeAffinity.Required == nil {
		return false, &pv, nil
	}
	sel, err := nodeaffinity.NewNodeSelector(pv.Spec.NodeAffinity.Required)
	if err != nil {
		return false, nil, fmt.Errorf("node affinity of volume %s: %w", pv.Name, err)
	}
	// The cache first; a miss there is confirmed directly, as in nodeGone.
	for _, reader := range []client.Reader{r.Client, r.apiReader()} {
		var nodes corev1.NodeList
		if err := reader.List(ctx, &nodes); err != nil {
			return false, nil, fmt.Errorf("list nodes: %w", err)
		}
		for i := range nodes.Items {
			if sel.Match(&nodes.Items[i]) {
				return false, &pv, nil
			}
		}
	}
	return true, &pv, nil
}

// pinnedHostname is the node a local volume is pinned to, as its node
// affinity names it by hostname; empty when it names none or several.
func pinnedHostname(pv *corev1.PersistentVolume) string {
	terms := pv.Spec.NodeAffinity.Required.NodeSelectorTerms
	if len(terms) != 1 {
		return ""
	}
	for _, e := range terms[0].MatchExpressions {
		if e.Key == corev1.LabelHostname && e.Operator == corev1.NodeSelectorOpIn && len(e.Values) == 1 {
			return e.Values[0]
		}
	}
	return ""
}

// dropLostWorkload removes what a node loss leaves unusable: a pod on a
// node that is gone (force-deleted: no kubelet will confirm a graceful
// deletion) and a workspace claim stranded on such a node. With anyPod,
// any other pod goes too, gracefully: a sandbox that waits after a node
// loss holds no node, and a pod there can only come from a pass that
// worked from a cache which had not seen the loss yet.
func (r *SandboxReconciler) dropLostWorkload(ctx context.Context, sbx *v1alpha1.Sandbox, pod *corev1.Pod, claim *corev1.PersistentVolumeClaim, anyPod bool) error {
	if pod != nil {
		onLostNode := false
		if pod.Spec.NodeName != "" {
			gone, err := r.nodeGone(ctx, pod.Spec.NodeName)
			if err != nil {
				return err
			}
			onLostNode = gone
		}
		opts := []client.DeleteOption{client.Preconditions{UID: &pod.UID}}
		switch {
		case onLostNode:
			opts = append(opts, client.GracePeriodSeconds(0))
		case anyPod && pod.DeletionTimestamp.IsZero():
		default:
			opts = nil
		}
		if opts != nil {
			if err := r.Delete(ctx, pod, opts...); err != nil && !apierrors.IsNotFound(err) && !apierrors.IsConflict(err) {
				return fmt.Errorf("delete pod %s of the lost node: %w", pod.Name, err)
			}
		}
	}
	if claim == nil || !claim.DeletionTimestamp.IsZero() {
		return nil
	}
	stranded, _, err := r.volumeStranded(ctx, claim)
	if err != nil || !stranded {
		return err
	}
	if err := r.Delete(ctx, claim, client.Preconditions{UID: ptr.To(claim.UID)}); err != nil && !apierrors.IsNotFound(err) && !apierrors.IsConflict(err) {
		return fmt.Errorf("delete workspace claim %s of the lost node: %w", claim.Name, err)
	}
	return nil
}

// endStopOfLostNode ends an idle stop that the node loss interrupted. A snapshot
// the stop had already finished is kept as the newest; one still being
// taken can no longer be completed from a node that is gone, and is
// deleted, as after a failed snapshot.
func (r *SandboxReconciler) endStopOfLostNode(ctx context.Context, sbx *v1alpha1.Sandbox, tpl *v1alpha1.SandboxTemplate) {
	name := sbx.Status.PendingSnapshot
	sbx.Status.PendingSnapshot = ""
	if name == "" || r.Snapshots == nil {
		return
	}
	if tpl == nil {
		// As in idleStop: the driver reads only the workspace settings.
		tpl = &v1alpha1.SandboxTemplate{}
	}
	log := logf.FromContext(ctx)
	// No supervisor: the stop's earlier passes started the snapshot, and
	// the driver only reports on what it has.
	state, err := r.Snapshots.Take(ctx, snapshot.Request{Sandbox: sbx, Template: tpl, ClaimName: WorkspaceClaimName(workloadName(sbx)), Name: name})
	if err == nil && state.Ready {
		r.recordStopSnapshot(ctx, sbx, name, state)
		return
	}
	if err := r.Snapshots.Delete(ctx, sbx, name); err != nil && !errors.Is(err, snapshot.ErrNotFound) {
		log.Error(err, "delete the snapshot of a stop the node loss interrupted", "snapshot", name)
	}
}

// resumeSource says what the sandbox resumes with after loss.
func resumeSource(sbx *v1alpha1.Sandbox, loss *v1alpha1.SandboxNodeLoss, haveDriver bool) string {
	if !loss.WorkspaceLost {
		return fmt.Sprintf("its workspace claim %s and the files in it", WorkspaceClaimName(workloadName(sbx)))
	}
	if snap := sbx.Status.Snapshot; snap != nil && !sbx.Spec.Ephemeral && haveDriver {
		taken := ""
		if snap.ReadyTime != nil {
			taken = ", taken " + snap.ReadyTime.UTC().Format(time.RFC3339)
		}
		if snap.Checkpoint {
			return fmt.Sprintf("the workspace restored from its newest checkpoint %s%s", snap.Name, taken)
		}
		return fmt.Sprintf("the workspace restored from its last snapshot %s%s", snap.Name, taken)
	}
	return "an empty workspace"
}

// lostNodeName names the lost node in messages.
func lostNodeName(loss *v1alpha1.SandboxNodeLoss) string {
	if loss.NodeName == "" {
		return "the node its workspace volume was pinned to"
	}
	return "node " + loss.NodeName
}

// nodeLossMessage is the Ready condition's message after loss. It is
// derived from the status alone, so that repeating it changes nothing.
func nodeLossMessage(sbx *v1alpha1.Sandbox, loss *v1alpha1.SandboxNodeLoss, haveDriver bool) string {
	msg := lostNodeName(loss) + ", where the sandbox ran, no longer exists; its pod is gone"
	next := "the next call starts it on another node with "
	if isWarm(sbx) {
		next = "the warm sandbox starts again on another node with "
	}
	switch {
	case !loss.WorkspaceLost:
		msg += fmt.Sprintf(". Its workspace claim %s is kept, since its volume is not tied to that node (network storage): %sits files",
			WorkspaceClaimName(workloadName(sbx)), next)
	case resumeSource(sbx, loss, haveDriver) == "an empty workspace":
		msg += ", and so is its workspace, which was on that node's local storage. The sandbox has no snapshot, so its files are lost: " +
			next + "an empty workspace"
	default:
		what := "snapshot"
		if sbx.Status.Snapshot.Checkpoint {
			what = "checkpoint"
		}
		msg += ", and so is its workspace, which was on that node's local storage: " + next +
			resumeSource(sbx, loss, haveDriver) + "; changes made after that " + what + " are lost"
	}
	return msg
}

// sandboxesOnNode maps a deleted Node to the sandboxes that ran there, so
// that the loss is handled at once rather than when the pod garbage
// collector gets to their pods.
func (r *SandboxReconciler) sandboxesOnNode(ctx context.Context, o client.Object) []reconcile.Request {
	var list v1alpha1.SandboxList
	if err := r.List(ctx, &list, client.MatchingFields{sandboxNodeIndex: o.GetName()}); err != nil {
		logf.FromContext(ctx).Error(err, "list sandboxes of node", "node", o.GetName())
		return nil
	}
	return requestsFor(list.Items)
}
