package controller

import (
	"context"
	"fmt"
	"maps"
	"slices"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
)

// scheduleOnNodePool points pod at the GVisorNodePool the template names
// in nodePoolRef, if any. The pool is read when the pod is created, like the
// rest of the template. A missing pool is an error the sandbox retries
// (apierrors.IsNotFound tells it apart): a pod on the template's own
// RuntimeClass could land where the pool does not want it.
func (r *SandboxReconciler) scheduleOnNodePool(ctx context.Context, tpl *v1alpha1.SandboxTemplate, pod *corev1.Pod) error {
	if tpl == nil || tpl.Spec.NodePoolRef == nil {
		return nil
	}
	var pool v1alpha1.GVisorNodePool
	if err := r.Get(ctx, types.NamespacedName{Name: *tpl.Spec.NodePoolRef}, &pool); err != nil {
		return fmt.Errorf("get GVisorNodePool %s named by template %s: %w", *tpl.Spec.NodePoolRef, tpl.Name, err)
	}
	applyNodePool(&pod.Spec, &pool)
	return nil
}

// applyNodePool gives a pod spec the pool's RuntimeClass. A Managed pool's
// RuntimeClass carries its scheduling and overhead, which the API server's
// RuntimeClass admission merges into the pod. A GKE pool adopts GKE's
// RuntimeClass without changing it, so the pool's nodeSelector (winning
// over the template's on the same key: the pod must land on gVisor nodes)
// and tolerations, plus the toleration of GKE Sandbox's node taint, go onto
// the pod itself.
func applyNodePool(spec *corev1.PodSpec, pool *v1alpha1.GVisorNodePool) {
	spec.RuntimeClassName = ptr.To(poolRuntimeClassName(pool))
	if pool.Spec.Mode != v1alpha1.GVisorNodePoolModeGKE {
		return
	}
	if len(pool.Spec.NodeSelector) > 0 {
		if spec.NodeSelector == nil {
			spec.NodeSelector = map[string]string{}
		}
		maps.Copy(spec.NodeSelector, pool.Spec.NodeSelector)
	}
	for _, t := range append(copyTolerations(pool.Spec.Tolerations), GKESandboxToleration) {
		if !slices.ContainsFunc(spec.Tolerations, func(x corev1.Toleration) bool { return x.MatchToleration(&t) }) {
			spec.Tolerations = append(spec.Tolerations, t)
		}
	}
}
