package controller

import (
	"context"
	"fmt"
	"strings"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
)

// Event reasons of a pool's pre-warm.
const (
	EventPrewarmFailed = "PrewarmFailed"
	EventPrewarmed     = "Prewarmed"
)

// passPrewarm hands the pool's pythonEnvironments to its unassigned
// sandboxes, in their AnnotationPrewarmEnvs (metadata, which the Sandbox
// controller builds from): a change of the pool's environments is built
// in the sandboxes it has, none is replaced.
func (r *SandboxWarmPoolReconciler) passPrewarm(ctx context.Context, pool *v1alpha1.SandboxWarmPool, current []*v1alpha1.Sandbox) error {
	want := v1alpha1.PrewarmEnvsAnnotation(pool.Spec.PythonEnvironments)
	for _, s := range current {
		if s.Annotations[v1alpha1.AnnotationPrewarmEnvs] == want {
			continue
		}
		target := s.DeepCopy()
		patch := client.MergeFrom(s.DeepCopy())
		if want == "" {
			delete(target.Annotations, v1alpha1.AnnotationPrewarmEnvs)
		} else {
			if target.Annotations == nil {
				target.Annotations = map[string]string{}
			}
			target.Annotations[v1alpha1.AnnotationPrewarmEnvs] = want
		}
		if err := r.Patch(ctx, target, patch); err != nil && !apierrors.IsNotFound(err) {
			return fmt.Errorf("pass the python environments of warm pool %s to sandbox %s: %w", pool.Name, s.Name, err)
		}
	}
	return nil
}

// States of a warm sandbox's pre-warm, as the pool counts it.
const (
	prewarmNone = iota
	prewarmBuilding
	prewarmBuilt
	prewarmFailedState
)

// prewarmSettledFor is where the pre-warm of the pool's sandbox s stands
// for the pool's environments as they are now: prewarmNone for a pool
// that declares none. It reads the sandbox's metadata (the environments
// handed to it, its inventory, a recorded failure) rather than its
// PythonEnvironmentsReady condition, which lags a change of the pool's
// environments by a pass of the Sandbox controller: a sandbox not yet
// handed the current environments is building them.
func prewarmSettledFor(pool *v1alpha1.SandboxWarmPool, tpl *v1alpha1.SandboxTemplate, s *v1alpha1.Sandbox) int {
	want := v1alpha1.PrewarmEnvsAnnotation(pool.Spec.PythonEnvironments)
	if want == "" {
		return prewarmNone
	}
	if s.Annotations[v1alpha1.AnnotationPrewarmEnvs] != want || tpl == nil {
		return prewarmBuilding
	}
	if strings.HasPrefix(s.Annotations[v1alpha1.AnnotationPrewarmFailed], prewarmHash(want)+": ") {
		return prewarmFailedState
	}
	for _, e := range pool.Spec.PythonEnvironments {
		name, err := prewarmName(e, tpl)
		if err != nil {
			// The Sandbox controller reports it PrewarmFailed, and the
			// sandbox is leased without it.
			return prewarmFailedState
		}
		if v1alpha1.PythonEnvState(s, name) != v1alpha1.PythonEnvBuilt {
			return prewarmBuilding
		}
	}
	return prewarmBuilt
}

// prewarmFailureText is what s records of its failed pre-warm.
func prewarmFailureText(pool *v1alpha1.SandboxWarmPool, tpl *v1alpha1.SandboxTemplate, s *v1alpha1.Sandbox) string {
	want := v1alpha1.PrewarmEnvsAnnotation(pool.Spec.PythonEnvironments)
	if msg, ok := strings.CutPrefix(s.Annotations[v1alpha1.AnnotationPrewarmFailed], prewarmHash(want)+": "); ok {
		return msg
	}
	for _, e := range pool.Spec.PythonEnvironments {
		if _, err := prewarmName(e, tpl); err != nil {
			return fmt.Sprintf("environment %s is invalid: %v", prewarmLabel(e), err)
		}
	}
	return "the build failed"
}

// reportPrewarm sets the pool's PythonEnvironmentsReady condition from its
// ready sandboxes' pre-warm, read as report reads it (prewarmSettledFor),
// so that the ready count and this condition never disagree; a pool
// without pythonEnvironments has none.
func (r *SandboxWarmPoolReconciler) reportPrewarm(pool *v1alpha1.SandboxWarmPool, tpl *v1alpha1.SandboxTemplate, current []*v1alpha1.Sandbox) {
	if len(pool.Spec.PythonEnvironments) == 0 {
		meta.RemoveStatusCondition(&pool.Status.Conditions, v1alpha1.ConditionPythonEnvironmentsReady)
		return
	}
	var failed, building []string
	failMsg := ""
	for _, s := range current {
		if !sandboxReady(s) {
			continue
		}
		switch prewarmSettledFor(pool, tpl, s) {
		case prewarmFailedState:
			failed = append(failed, s.Name)
			if failMsg == "" {
				failMsg = prewarmFailureText(pool, tpl, s)
			}
		case prewarmBuilding:
			building = append(building, s.Name)
		}
	}
	prev := meta.FindStatusCondition(pool.Status.Conditions, v1alpha1.ConditionPythonEnvironmentsReady)
	set := func(status metav1.ConditionStatus, reason, msg string) {
		if prev == nil || prev.Reason != reason {
			eventType, event := corev1.EventTypeNormal, EventPrewarmed
			if reason == v1alpha1.ReasonPrewarmFailed {
				eventType, event = corev1.EventTypeWarning, EventPrewarmFailed
			}
			if reason != v1alpha1.ReasonPrewarming {
				r.event(pool, nil, eventType, event, "Prewarm", msg)
			}
		}
		setCondition(&pool.Status.Conditions, v1alpha1.ConditionPythonEnvironmentsReady, pool.Generation, r.now(), status, reason, msg)
	}
	switch {
	case len(failed) > 0:
		set(metav1.ConditionFalse, v1alpha1.ReasonPrewarmFailed, fmt.Sprintf("building the python environments failed in %d warm sandboxes (%s), which are leased without them: %s",
			len(failed), strings.Join(failed, ", "), failMsg))
	case len(building) > 0:
		set(metav1.ConditionFalse, v1alpha1.ReasonPrewarming, fmt.Sprintf("%d ready warm sandboxes are building the python environments", len(building)))
	default:
		set(metav1.ConditionTrue, v1alpha1.ReasonPrewarmed, fmt.Sprintf("every ready warm sandbox holds the pool's %d python environments", len(pool.Spec.PythonEnvironments)))
	}
}
