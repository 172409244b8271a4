package controller

import (
	"context"
	"fmt"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/event"
	logf "sigs.k8s.io/controller-runtime/pkg/log"
	"sigs.k8s.io/controller-runtime/pkg/predicate"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
)

// One sandbox per agent. The Compute API routes an agent's calls by
// spec.agentID, so a second live Sandbox with the same agent ID (made by
// kubectl, Terraform or the API, in any namespace the platform serves)
// would split the agent's state between two workspaces. Agent IDs are the
// platform's own: a Sandbox in a namespace it does not serve belongs to
// another platform on the cluster, or to none, and keeps nothing here. Nothing stops the second object from being
// stored (the platform runs no admission webhook), so the controller
// refuses it instead: the older Sandbox (v1alpha1.KeepsAgentBefore) keeps
// the agent, the newer one gets phase Error with reason DuplicateAgent, a
// DuplicateAgent event and no pod. It is not deleted: it belongs to
// whoever made it, and it starts by itself once the older one is deleted.

// agentIDIndex indexes Sandboxes by spec.agentID, so that the duplicate
// check and its watch find an agent's sandboxes in any namespace without
// depending on the agent-ID label, which a new Sandbox does not carry yet.
const agentIDIndex = "spec.agentID"

// EventDuplicateAgent is recorded on a Sandbox refused because an older
// one has its agent.
const EventDuplicateAgent = "DuplicateAgent"

func indexAgentID(o client.Object) []string {
	return []string{o.(*v1alpha1.Sandbox).Spec.AgentID}
}

// agentKeeper returns the live Sandbox that keeps sbx's agent when it is
// not sbx itself, else nil. A Sandbox being deleted keeps nothing: the
// next one takes over as soon as the deletion starts.
func (r *SandboxReconciler) agentKeeper(ctx context.Context, sbx *v1alpha1.Sandbox) (*v1alpha1.Sandbox, error) {
	var list v1alpha1.SandboxList
	if err := r.List(ctx, &list, client.MatchingFields{agentIDIndex: sbx.Spec.AgentID}); err != nil {
		return nil, fmt.Errorf("list the sandboxes of agent %q: %w", sbx.Spec.AgentID, err)
	}
	keeper := sbx
	for i := range list.Items {
		o := &list.Items[i]
		if o.UID == sbx.UID || o.Spec.AgentID != sbx.Spec.AgentID || !o.DeletionTimestamp.IsZero() || !r.Namespaces.Serves(o.Namespace) {
			continue
		}
		if v1alpha1.KeepsAgentBefore(o, keeper) {
			keeper = o
		}
	}
	if keeper == sbx {
		return nil, nil
	}
	return keeper, nil
}

// refuseDuplicate reports sbx as a duplicate of keeper's agent and deletes
// a pod it started before the older sandbox was seen (two made in the same
// second): serving the agent from two pods is what the refusal prevents.
func (r *SandboxReconciler) refuseDuplicate(ctx context.Context, sbx, keeper *v1alpha1.Sandbox) error {
	base := sbx.DeepCopy()
	sbx.Status.ObservedGeneration = sbx.Generation
	msg := fmt.Sprintf("agent %q already has Sandbox %s/%s, created before this one, and an agent has one sandbox: "+
		"this one starts no pod, and starts by itself once %s/%s is deleted", sbx.Spec.AgentID,
		keeper.Namespace, keeper.Name, keeper.Namespace, keeper.Name)
	var pod corev1.Pod
	err := r.Get(ctx, client.ObjectKey{Namespace: sbx.Namespace, Name: PodName(workloadName(sbx))}, &pod)
	switch {
	case apierrors.IsNotFound(err):
	case err != nil:
		return fmt.Errorf("get pod of duplicate sandbox %s: %w", sbx.Name, err)
	case metav1.IsControlledBy(&pod, sbx) && pod.DeletionTimestamp.IsZero():
		if err := r.Delete(ctx, &pod, client.Preconditions{UID: &pod.UID}); client.IgnoreNotFound(err) != nil {
			return fmt.Errorf("delete pod of duplicate sandbox %s: %w", sbx.Name, err)
		}
		r.event(sbx, &pod, corev1.EventTypeWarning, EventPodDeleted, "Delete",
			fmt.Sprintf("deleted pod %s: agent %q belongs to Sandbox %s/%s", pod.Name, sbx.Spec.AgentID, keeper.Namespace, keeper.Name))
	}
	r.setNotServing(sbx, v1alpha1.SandboxPhaseError, v1alpha1.ReasonDuplicateAgent, msg)
	r.eventOnNewReason(readyReason(base), sbx, keeper, corev1.EventTypeWarning, EventDuplicateAgent, "Refuse", msg)
	return r.writeStatus(ctx, base, sbx)
}

// sandboxesOfAgent maps a Sandbox to the other Sandboxes of its agent: a
// duplicate is refused when an older one appears, and starts when the one
// that kept the agent is deleted.
func (r *SandboxReconciler) sandboxesOfAgent(ctx context.Context, o client.Object) []reconcile.Request {
	sbx, ok := o.(*v1alpha1.Sandbox)
	if !ok {
		return nil
	}
	var list v1alpha1.SandboxList
	if err := r.List(ctx, &list, client.MatchingFields{agentIDIndex: sbx.Spec.AgentID}); err != nil {
		logf.FromContext(ctx).Error(err, "list the sandboxes of an agent", "sandbox", client.ObjectKeyFromObject(sbx))
		return nil
	}
	var reqs []reconcile.Request
	for i := range list.Items {
		if list.Items[i].UID != sbx.UID {
			reqs = append(reqs, reconcile.Request{NamespacedName: client.ObjectKeyFromObject(&list.Items[i])})
		}
	}
	return reqs
}

// agentMembershipChanged passes the Sandbox events that can change which
// sandbox keeps an agent: one appears, one goes, one starts being deleted.
// Status writes, the bulk of the events, pass nothing.
var agentMembershipChanged = predicate.Funcs{
	CreateFunc: func(event.CreateEvent) bool { return true },
	DeleteFunc: func(event.DeleteEvent) bool { return true },
	UpdateFunc: func(e event.UpdateEvent) bool {
		return e.ObjectOld.GetDeletionTimestamp().IsZero() != e.ObjectNew.GetDeletionTimestamp().IsZero()
	},
	GenericFunc: func(event.GenericEvent) bool { return false },
}
