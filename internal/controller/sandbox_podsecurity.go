package controller

import (
	"context"
	"fmt"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	psapi "k8s.io/pod-security-admission/api"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/event"
	logf "sigs.k8s.io/controller-runtime/pkg/log"
	"sigs.k8s.io/controller-runtime/pkg/predicate"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
)

// EventPodSecurityNotEnforced is recorded when a sandbox's namespace is
// found not to enforce the restricted Pod Security Standard.
const EventPodSecurityNotEnforced = "PodSecurityNotEnforced"

// reportPodSecurity sets the sandbox's PodSecurity condition from its
// namespace's enforce label, and records an event when it turns False. It
// reports and never relabels: the namespace's owner decides the policy of
// every pod in it, and a label the platform put there could refuse their
// other workloads (see v1alpha1.ConditionPodSecurity). A failure to read
// the namespace is logged and leaves the condition as it was: reporting
// must not hold the sandbox up.
func (r *SandboxReconciler) reportPodSecurity(ctx context.Context, prev *metav1.Condition, sbx *v1alpha1.Sandbox) {
	var ns corev1.Namespace
	if err := r.Get(ctx, types.NamespacedName{Name: sbx.Namespace}, &ns); err != nil {
		logf.FromContext(ctx).Error(err, "read the sandbox's namespace for its Pod Security labels")
		return
	}
	level := ns.Labels[psapi.EnforceLevelLabel]
	status, reason := metav1.ConditionTrue, v1alpha1.ReasonRestrictedEnforced
	msg := fmt.Sprintf("namespace %s enforces the restricted Pod Security Standard (%s=%s)", ns.Name, psapi.EnforceLevelLabel, level)
	if level != string(psapi.LevelRestricted) {
		what := fmt.Sprintf("%s=%s", psapi.EnforceLevelLabel, level)
		if level == "" {
			what = fmt.Sprintf("no %s label, so the cluster's default applies, which is privileged unless the PodSecurity admission configuration says otherwise", psapi.EnforceLevelLabel)
		}
		status, reason = metav1.ConditionFalse, v1alpha1.ReasonRestrictedNotEnforced
		msg = fmt.Sprintf("namespace %s does not enforce the restricted Pod Security Standard (%s). "+
			"The sandbox's pod meets restricted, but the API server also admits pods there that do not, and they could mount the sandboxes' Secrets and workspace volumes. "+
			"Label the namespace %s=restricted, or run sandboxes in one that is", ns.Name, what, psapi.EnforceLevelLabel)
	}
	setCondition(&sbx.Status.Conditions, v1alpha1.ConditionPodSecurity, sbx.Generation, r.now(), status, reason, msg)
	if status == metav1.ConditionFalse && (prev == nil || prev.Status != metav1.ConditionFalse) {
		r.event(sbx, nil, corev1.EventTypeWarning, EventPodSecurityNotEnforced, "Check", msg)
	}
}

// sandboxesInNamespace maps a namespace to its sandboxes.
func (r *SandboxReconciler) sandboxesInNamespace(ctx context.Context, o client.Object) []reconcile.Request {
	var list v1alpha1.SandboxList
	if err := r.List(ctx, &list, client.InNamespace(o.GetName())); err != nil {
		logf.FromContext(ctx).Error(err, "list sandboxes of namespace", "namespace", o.GetName())
		return nil
	}
	return requestsFor(list.Items)
}

// enforceLevelChanged passes namespace updates that change the enforce
// label, the only part of a namespace sandboxes look at; a namespace's
// sandboxes see it when they are created.
var enforceLevelChanged = predicate.Funcs{
	CreateFunc:  func(event.CreateEvent) bool { return false },
	DeleteFunc:  func(event.DeleteEvent) bool { return false },
	GenericFunc: func(event.GenericEvent) bool { return false },
	UpdateFunc: func(e event.UpdateEvent) bool {
		return e.ObjectOld.GetLabels()[psapi.EnforceLevelLabel] != e.ObjectNew.GetLabels()[psapi.EnforceLevelLabel]
	},
}
