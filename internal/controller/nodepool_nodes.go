package controller

import (
	"context"
	"fmt"
	"slices"
	"strings"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
)

// The node pool reconciler's nodes: the label and taint that put a node in
// a Managed pool and take it out again, and what a node says about
// running gVisor pods.

// prepareNodes labels and taints the nodes the pool selects, and releases
// those it selects no more. It returns the nodes it prepared, and those it
// selects but another pool holds ("node (by pool)").
func (r *GVisorNodePoolReconciler) prepareNodes(ctx context.Context, pool *v1alpha1.GVisorNodePool) ([]*corev1.Node, []string, error) {
	var nodes corev1.NodeList
	if err := r.List(ctx, &nodes); err != nil {
		return nil, nil, fmt.Errorf("list nodes: %w", err)
	}
	selector := labels.SelectorFromSet(pool.Spec.NodeSelector)
	var selected []*corev1.Node
	var claimed []string
	for i := range nodes.Items {
		node := &nodes.Items[i]
		wanted := len(pool.Spec.NodeSelector) > 0 && selector.Matches(labels.Set(node.Labels)) && node.DeletionTimestamp.IsZero()
		if wanted {
			other, err := r.claimedByOther(ctx, pool, node)
			if err != nil {
				return nil, nil, err
			}
			if other != "" {
				claimed = append(claimed, fmt.Sprintf("%s (by %s)", node.Name, other))
				continue
			}
			if err := r.prepareNode(ctx, pool, node); err != nil {
				return nil, nil, err
			}
			selected = append(selected, node)
			continue
		}
		if node.Labels[v1alpha1.LabelNodePool] == pool.Name {
			if err := r.releaseNode(ctx, pool, node); err != nil {
				return nil, nil, err
			}
		}
	}
	return selected, claimed, nil
}

// claimedByOther names the pool that already prepared node, if it is
// another one that still exists: a node serves one pool at a time, and the
// first to label it keeps it until it lets go.
func (r *GVisorNodePoolReconciler) claimedByOther(ctx context.Context, pool *v1alpha1.GVisorNodePool, node *corev1.Node) (string, error) {
	other := node.Labels[v1alpha1.LabelNodePool]
	if other == "" || other == pool.Name {
		return "", nil
	}
	var p v1alpha1.GVisorNodePool
	if err := r.Get(ctx, types.NamespacedName{Name: other}, &p); err != nil {
		if apierrors.IsNotFound(err) {
			return "", nil
		}
		return "", fmt.Errorf("get GVisorNodePool %s that labelled node %s: %w", other, node.Name, err)
	}
	return other, nil
}

// taintString is how a taint is recorded in AnnotationNodePoolTaint.
func taintString(t *corev1.Taint) string {
	if t == nil {
		return ""
	}
	return t.ToString()
}

// parseTaint reads AnnotationNodePoolTaint back: key[=value]:effect.
func parseTaint(s string) (corev1.Taint, bool) {
	i := strings.LastIndexByte(s, ':')
	if s == "" || i < 0 {
		return corev1.Taint{}, false
	}
	t := corev1.Taint{Effect: corev1.TaintEffect(s[i+1:])}
	t.Key, t.Value, _ = strings.Cut(s[:i], "=")
	return t, t.Key != ""
}

// withoutTaint drops the taints with t's key and effect, the identity of a
// taint on a node.
func withoutTaint(taints []corev1.Taint, t corev1.Taint) []corev1.Taint {
	return slices.DeleteFunc(slices.Clone(taints), func(x corev1.Taint) bool { return x.MatchTaint(&t) })
}

// prepareNode puts the pool's label, taint and taint record on node.
func (r *GVisorNodePoolReconciler) prepareNode(ctx context.Context, pool *v1alpha1.GVisorNodePool, node *corev1.Node) error {
	want := pool.Spec.Taint
	recorded := node.Annotations[v1alpha1.AnnotationNodePoolTaint]
	taints := slices.Clone(node.Spec.Taints)
	if old, ok := parseTaint(recorded); ok && recorded != taintString(want) {
		taints = withoutTaint(taints, old)
	}
	if want != nil {
		// In place when a taint of that key and effect is there already, so
		// that a settled node compares equal and is not patched again.
		if i := slices.IndexFunc(taints, func(x corev1.Taint) bool { return x.MatchTaint(want) }); i >= 0 {
			taints[i].Value = want.Value
		} else {
			taints = append(taints, corev1.Taint{Key: want.Key, Value: want.Value, Effect: want.Effect})
		}
	}
	isNew := node.Labels[v1alpha1.LabelNodePool] != pool.Name
	if !isNew && recorded == taintString(want) && taintsEqual(node.Spec.Taints, taints) {
		return nil
	}
	// Optimistic locking: the node lifecycle controller and kubelet write
	// taints too, and a merge patch replaces the whole list.
	patch := client.MergeFromWithOptions(node.DeepCopy(), client.MergeFromWithOptimisticLock{})
	if node.Labels == nil {
		node.Labels = map[string]string{}
	}
	node.Labels[v1alpha1.LabelNodePool] = pool.Name
	if want != nil {
		if node.Annotations == nil {
			node.Annotations = map[string]string{}
		}
		node.Annotations[v1alpha1.AnnotationNodePoolTaint] = taintString(want)
	} else {
		delete(node.Annotations, v1alpha1.AnnotationNodePoolTaint)
	}
	node.Spec.Taints = taints
	if err := r.Patch(ctx, node, patch); err != nil {
		return fmt.Errorf("label and taint node %s: %w", node.Name, err)
	}
	if isNew {
		msg := fmt.Sprintf("node %s joined the pool: labelled %s=%s", node.Name, v1alpha1.LabelNodePool, pool.Name)
		if want != nil {
			msg += ", tainted " + taintString(want)
		}
		r.event(pool, node, corev1.EventTypeNormal, EventNodeAdded, "Label", msg)
	}
	return nil
}

// taintsEqual compares taint lists ignoring timeAdded, which the API server
// sets on NoExecute taints.
func taintsEqual(a, b []corev1.Taint) bool {
	return slices.EqualFunc(a, b, func(x, y corev1.Taint) bool {
		return x.Key == y.Key && x.Value == y.Value && x.Effect == y.Effect
	})
}

// releaseNode takes the pool's label, taint and taint record off node.
func (r *GVisorNodePoolReconciler) releaseNode(ctx context.Context, pool *v1alpha1.GVisorNodePool, node *corev1.Node) error {
	if node.Labels[v1alpha1.LabelNodePool] != pool.Name {
		return nil
	}
	patch := client.MergeFromWithOptions(node.DeepCopy(), client.MergeFromWithOptimisticLock{})
	if old, ok := parseTaint(node.Annotations[v1alpha1.AnnotationNodePoolTaint]); ok {
		node.Spec.Taints = withoutTaint(node.Spec.Taints, old)
	}
	delete(node.Labels, v1alpha1.LabelNodePool)
	delete(node.Annotations, v1alpha1.AnnotationNodePoolTaint)
	if err := r.Patch(ctx, node, patch); err != nil {
		if apierrors.IsNotFound(err) {
			return nil
		}
		return fmt.Errorf("remove node pool label and taint from node %s: %w", node.Name, err)
	}
	r.event(pool, node, corev1.EventTypeNormal, EventNodeRemoved, "Unlabel",
		fmt.Sprintf("node %s left the pool: its %s label and the pool's taint were removed", node.Name, v1alpha1.LabelNodePool))
	return nil
}

// nodeIsReady is kubelet's Ready condition.
func nodeIsReady(n *corev1.Node) bool {
	for _, c := range n.Status.Conditions {
		if c.Type == corev1.NodeReady {
			return c.Status == corev1.ConditionTrue
		}
	}
	return false
}

// nodeHasRunsc says whether runsc can run pods on the node. The node's own
// word is best: kubelet lists the container runtime's configured handlers
// in status.runtimeHandlers (containerd 2.0 and later, Kubernetes 1.30 and
// later), and a handler named runsc is exactly what the RuntimeClass needs.
// Runtimes that report no handlers leave the decision to the
// agentbox.dev/runsc-installed=true label. The installer DaemonSet does not
// set that label: it holds no API credentials, by design.
func nodeHasRunsc(n *corev1.Node) bool {
	if n.Labels[v1alpha1.LabelRunscInstalled] == "true" {
		return true
	}
	return slices.ContainsFunc(n.Status.RuntimeHandlers, func(h corev1.NodeRuntimeHandler) bool {
		return h.Name == v1alpha1.RunscHandler
	})
}

// releaseAll deletes the RuntimeClasses the pool created and takes its
// label and taint off every node that has them.
func (r *GVisorNodePoolReconciler) releaseAll(ctx context.Context, pool *v1alpha1.GVisorNodePool) error {
	if err := r.deleteStaleRuntimeClasses(ctx, pool, ""); err != nil {
		return err
	}
	var nodes corev1.NodeList
	if err := r.List(ctx, &nodes, client.MatchingLabels{v1alpha1.LabelNodePool: pool.Name}); err != nil {
		return fmt.Errorf("list nodes of node pool %s: %w", pool.Name, err)
	}
	for i := range nodes.Items {
		if err := r.releaseNode(ctx, pool, &nodes.Items[i]); err != nil {
			return err
		}
	}
	return nil
}
