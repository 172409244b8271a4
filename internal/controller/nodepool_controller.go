package controller

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	nodev1 "k8s.io/api/node/v1"
	"k8s.io/apimachinery/pkg/api/equality"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/events"
	"k8s.io/utils/clock"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/builder"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/controller/controllerutil"
	"sigs.k8s.io/controller-runtime/pkg/event"
	"sigs.k8s.io/controller-runtime/pkg/handler"
	logf "sigs.k8s.io/controller-runtime/pkg/log"
	"sigs.k8s.io/controller-runtime/pkg/predicate"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
)

// NodePoolControllerName names the node pool controller, and its events'
// reporter.
const NodePoolControllerName = "agentbox-nodepool"

// runtimeClassIndex indexes GVisorNodePools by the RuntimeClass they use, so
// that a RuntimeClass event finds its pools, also the GKE pools that do not
// own it.
const runtimeClassIndex = "spec.runtimeClassName"

// Event reasons of the node pool controller.
const (
	EventRuntimeClassCreated  = "RuntimeClassCreated"
	EventRuntimeClassUpdated  = "RuntimeClassUpdated"
	EventRuntimeClassDeleted  = "RuntimeClassDeleted"
	EventRuntimeClassMissing  = "RuntimeClassNotFound"
	EventRuntimeClassConflict = "RuntimeClassConflict"
	EventNodeAdded            = "NodeAdded"
	EventNodeRemoved          = "NodeRemoved"
	EventNodePoolReady        = "NodePoolReady"
	EventNodePoolNotReady     = "NodePoolNotReady"
)

// labelManagedBy marks the RuntimeClasses agentbox created, so that a person
// looking at one knows not to edit it by hand.
const (
	labelManagedBy = "app.kubernetes.io/managed-by"
	managedByValue = "agentbox"
)

// gkeSandboxNodeSelector is what a GKE pool selects when neither its spec
// nor the adopted RuntimeClass say: GKE Sandbox labels its gVisor nodes so.
var gkeSandboxNodeSelector = map[string]string{v1alpha1.GKESandboxTaintKey: v1alpha1.GKESandboxTaintValue}

// GKESandboxToleration tolerates the taint GKE Sandbox puts on its gVisor
// nodes. Sandbox pods of a GKE pool get it (see applyNodePool): the pool
// adopts GKE's RuntimeClass without modifying it, so the controller cannot
// rely on that RuntimeClass carrying it, and never writes it into the pool's
// spec either.
var GKESandboxToleration = corev1.Toleration{
	Key:      v1alpha1.GKESandboxTaintKey,
	Operator: corev1.TolerationOpEqual,
	Value:    v1alpha1.GKESandboxTaintValue,
	Effect:   corev1.TaintEffectNoSchedule,
}

// GVisorNodePoolReconciler prepares gVisor node pools.
//
// In Managed mode it creates and owns the pool's RuntimeClass (handler
// runsc, the pool's scheduling and overhead), labels the selected nodes
// with agentbox.dev/node-pool=<pool> (which the RuntimeClass and the runsc
// installer DaemonSet select on) and puts the pool's taint on them. Nodes
// that stop being selected, and all of them when the pool is deleted, lose
// the label and the taint again; a finalizer holds the pool until that is
// done.
//
// In GKE mode it adopts GKE Sandbox's RuntimeClass as it is and touches no
// node: GKE manages both.
//
// Either way it reports the selected nodes and how many can run gVisor pods.
type GVisorNodePoolReconciler struct {
	client.Client
	Scheme *runtime.Scheme
	// Recorder receives events about the pools; SetupWithManager fills it
	// from the manager when nil.
	Recorder events.EventRecorder
	// Clock stamps conditions; nil means the real clock.
	Clock clock.PassiveClock
	// ManagedModeDisabled says the control plane has no right to patch
	// nodes or write RuntimeClasses (the chart's managedNodePools: false):
	// Managed pools then only get the ManagedModeDisabled condition.
	ManagedModeDisabled bool
}

// SetupWithManager registers the reconciler and its watches with mgr.
func (r *GVisorNodePoolReconciler) SetupWithManager(mgr ctrl.Manager) error {
	fillFromManager(mgr, NodePoolControllerName, &r.Client, &r.Scheme, &r.Recorder)
	if err := indexField(mgr, &v1alpha1.GVisorNodePool{}, runtimeClassIndex, func(o client.Object) []string {
		return []string{poolRuntimeClassName(o.(*v1alpha1.GVisorNodePool))}
	}, "node pools by runtime class"); err != nil {
		return err
	}
	return ctrl.NewControllerManagedBy(mgr).
		Named(NodePoolControllerName).
		For(&v1alpha1.GVisorNodePool{}).
		// Not Owns: a GKE pool's RuntimeClass, and a foreign one in a
		// Managed pool's way, are not owned, yet their appearance or
		// removal changes the pool's state.
		Watches(&nodev1.RuntimeClass{}, handler.EnqueueRequestsFromMapFunc(r.poolsForRuntimeClass)).
		Watches(&corev1.Node{}, handler.EnqueueRequestsFromMapFunc(r.allPools),
			builder.WithPredicates(nodeChanged)).
		Complete(r)
}

// poolsForRuntimeClass maps a RuntimeClass to the pools that use its name
// and to the pool that created it, which may since have moved to another
// name and must delete it.
func (r *GVisorNodePoolReconciler) poolsForRuntimeClass(ctx context.Context, o client.Object) []reconcile.Request {
	var list v1alpha1.GVisorNodePoolList
	if err := r.List(ctx, &list, client.MatchingFields{runtimeClassIndex: o.GetName()}); err != nil {
		logf.FromContext(ctx).Error(err, "list node pools of runtime class", "runtimeClass", o.GetName())
		return nil
	}
	reqs := requestsFor(list.Items)
	if owner := o.GetLabels()[v1alpha1.LabelNodePool]; owner != "" {
		reqs = append(reqs, reconcile.Request{NamespacedName: types.NamespacedName{Name: owner}})
	}
	return reqs
}

// allPools maps a node to every pool. Whether a node belongs to a pool
// depends on labels the node may just have lost, and for GKE pools on the
// adopted RuntimeClass; clusters have few pools, and the nodeChanged
// predicate keeps heartbeats out, so asking each pool is cheap and never
// misses one.
func (r *GVisorNodePoolReconciler) allPools(ctx context.Context, _ client.Object) []reconcile.Request {
	var list v1alpha1.GVisorNodePoolList
	if err := r.List(ctx, &list); err != nil {
		logf.FromContext(ctx).Error(err, "list node pools")
		return nil
	}
	return requestsFor(list.Items)
}

// nodeChanged passes node updates that can change a pool's view of the
// node: labels, annotations (the recorded taint), taints, readiness and the
// runtime handlers. Kubelet's periodic status updates pass only when one of
// them changed.
var nodeChanged = predicate.Funcs{
	UpdateFunc: func(e event.UpdateEvent) bool {
		oldNode, ok1 := e.ObjectOld.(*corev1.Node)
		newNode, ok2 := e.ObjectNew.(*corev1.Node)
		if !ok1 || !ok2 {
			return true
		}
		return !maps.Equal(oldNode.Labels, newNode.Labels) ||
			oldNode.Annotations[v1alpha1.AnnotationNodePoolTaint] != newNode.Annotations[v1alpha1.AnnotationNodePoolTaint] ||
			!equality.Semantic.DeepEqual(oldNode.Spec.Taints, newNode.Spec.Taints) ||
			nodeIsReady(oldNode) != nodeIsReady(newNode) ||
			nodeHasRunsc(oldNode) != nodeHasRunsc(newNode)
	},
}

func (r *GVisorNodePoolReconciler) now() time.Time { return nowOf(r.Clock) }

// poolRuntimeClassName is spec.runtimeClassName with the CRD's default for
// pools stored without defaulting (fake clients).
func poolRuntimeClassName(pool *v1alpha1.GVisorNodePool) string {
	if pool.Spec.RuntimeClassName == "" {
		return v1alpha1.DefaultRuntimeClassName
	}
	return pool.Spec.RuntimeClassName
}

// Reconcile brings one pool's RuntimeClass and nodes to what its spec asks
// and writes what it found into the status. It writes nothing when nothing
// changed.
func (r *GVisorNodePoolReconciler) Reconcile(ctx context.Context, req ctrl.Request) (ctrl.Result, error) {
	var pool v1alpha1.GVisorNodePool
	if found, err := fetch(ctx, r, req, &pool); !found {
		return ctrl.Result{}, err
	}
	if !pool.DeletionTimestamp.IsZero() {
		return ctrl.Result{}, r.finalize(ctx, &pool)
	}
	if r.ManagedModeDisabled && pool.Spec.Mode != v1alpha1.GVisorNodePoolModeGKE {
		return ctrl.Result{}, r.refuseManaged(ctx, &pool)
	}
	if !controllerutil.ContainsFinalizer(&pool, v1alpha1.Finalizer) {
		// Node labels and taints are not garbage-collected: only the
		// controller can take them off, so the pool waits for it.
		patch := client.MergeFrom(pool.DeepCopy())
		controllerutil.AddFinalizer(&pool, v1alpha1.Finalizer)
		if err := r.Patch(ctx, &pool, patch); err != nil {
			return ctrl.Result{}, fmt.Errorf("add finalizer to node pool %s: %w", pool.Name, err)
		}
	}

	base := pool.DeepCopy()
	pool.Status.ObservedGeneration = pool.Generation
	var err error
	if pool.Spec.Mode == v1alpha1.GVisorNodePoolModeGKE {
		err = r.reconcileGKE(ctx, &pool)
	} else {
		err = r.reconcileManaged(ctx, &pool)
	}
	if apierrors.IsConflict(err) || apierrors.IsAlreadyExists(err) {
		// A node or RuntimeClass changed under us (the node lifecycle
		// controller taints nodes too) or the cache is behind; the next
		// pass reads it afresh. Not worth flapping Ready over.
		logf.FromContext(ctx).V(1).Info("object changed concurrently; retrying", "reason", err.Error())
		return ctrl.Result{RequeueAfter: time.Second}, nil
	}
	if err != nil {
		r.setReady(&pool, metav1.ConditionFalse, v1alpha1.ReasonReconcileError, err.Error())
	}
	r.eventOnTransition(base, &pool)
	if serr := r.writeStatus(ctx, base, &pool); serr != nil {
		return ctrl.Result{}, errors.Join(err, serr)
	}
	return ctrl.Result{}, err
}

// writeStatus writes the pool's status if it differs from base's.
func (r *GVisorNodePoolReconciler) writeStatus(ctx context.Context, base, pool *v1alpha1.GVisorNodePool) error {
	return patchStatusIfChanged(ctx, r.Client, base, pool, base.Status, pool.Status, "node pool")
}

// reconcileManaged is the Managed mode: own the RuntimeClass, prepare the
// nodes, report them.
func (r *GVisorNodePoolReconciler) reconcileManaged(ctx context.Context, pool *v1alpha1.GVisorNodePool) error {
	if err := r.deleteStaleRuntimeClasses(ctx, pool, poolRuntimeClassName(pool)); err != nil {
		return err
	}
	rcNote, conflict, err := r.ensureRuntimeClass(ctx, pool)
	if err != nil {
		return err
	}
	if conflict != "" {
		// Nodes are left as they are: labelling them would steer the
		// installer onto them for a RuntimeClass that cannot be ours.
		pool.Status.Nodes, pool.Status.ReadyNodes = nil, 0
		r.setReady(pool, metav1.ConditionFalse, v1alpha1.ReasonRuntimeClassConflict, conflict)
		return nil
	}
	selected, claimed, err := r.prepareNodes(ctx, pool)
	if err != nil {
		return err
	}
	r.reportManaged(pool, selected, claimed, rcNote)
	return nil
}

// reportManaged sets a Managed pool's nodes and its Ready condition.
func (r *GVisorNodePoolReconciler) reportManaged(pool *v1alpha1.GVisorNodePool, selected []*corev1.Node, claimed []string, rcNote string) {
	ready, kubeletReady := 0, 0
	names := make([]string, 0, len(selected))
	for _, n := range selected {
		names = append(names, n.Name)
		if nodeIsReady(n) {
			kubeletReady++
			if nodeHasRunsc(n) {
				ready++
			}
		}
	}
	r.setNodes(pool, names, ready)

	notes := rcNote
	if len(claimed) > 0 {
		slices.Sort(claimed)
		notes += fmt.Sprintf("; nodes left to other pools: %s", strings.Join(claimed, ", "))
	}
	switch {
	case len(selected) == 0:
		r.setReady(pool, metav1.ConditionFalse, v1alpha1.ReasonNoMatchingNodes,
			fmt.Sprintf("no node matches nodeSelector %s%s", labels.SelectorFromSet(pool.Spec.NodeSelector), notes))
	case kubeletReady == 0:
		r.setReady(pool, metav1.ConditionFalse, v1alpha1.ReasonNodesNotReady,
			fmt.Sprintf("none of the %d selected nodes is Ready%s", len(selected), notes))
	case ready == 0:
		r.setReady(pool, metav1.ConditionFalse, v1alpha1.ReasonInstalling,
			fmt.Sprintf("%d of %d selected nodes are Ready, but none has runsc yet: waiting for a node to list the runtime handler %q "+
				"in status.runtimeHandlers (the runsc installer DaemonSet puts the binaries on the nodes) or to be labelled %s=true%s",
				kubeletReady, len(selected), v1alpha1.RunscHandler, v1alpha1.LabelRunscInstalled, notes))
	default:
		r.setReady(pool, metav1.ConditionTrue, v1alpha1.ReasonNodesReady,
			fmt.Sprintf("%d of %d selected nodes can run gVisor pods with RuntimeClass %s%s", ready, len(selected), poolRuntimeClassName(pool), notes))
	}
}

// reconcileGKE is the GKE mode: adopt GKE Sandbox's RuntimeClass without
// touching it, and report the nodes it schedules onto.
func (r *GVisorNodePoolReconciler) reconcileGKE(ctx context.Context, pool *v1alpha1.GVisorNodePool) error {
	// A pool that was Managed before keeps no RuntimeClass of its own, not
	// even one of the adopted name: that one would be agentbox's, not GKE's.
	// No node keeps its label or taint either.
	if err := r.releaseAll(ctx, pool); err != nil {
		return err
	}

	name := poolRuntimeClassName(pool)
	var rc nodev1.RuntimeClass
	if err := r.Get(ctx, types.NamespacedName{Name: name}, &rc); err != nil {
		if !apierrors.IsNotFound(err) {
			return fmt.Errorf("get RuntimeClass %s: %w", name, err)
		}
		r.setNodes(pool, nil, 0)
		r.setReady(pool, metav1.ConditionFalse, v1alpha1.ReasonRuntimeClassNotFound,
			fmt.Sprintf("RuntimeClass %s does not exist: enable GKE Sandbox on a node pool of the cluster, which creates it", name))
		return nil
	}

	// The pool's own nodeSelector narrows GKE's; without either, GKE
	// Sandbox's node label is what marks its nodes.
	sel := map[string]string{}
	if rc.Scheduling != nil {
		maps.Copy(sel, rc.Scheduling.NodeSelector)
	}
	maps.Copy(sel, pool.Spec.NodeSelector)
	if len(sel) == 0 {
		maps.Copy(sel, gkeSandboxNodeSelector)
	}
	selector := labels.SelectorFromSet(sel)
	var matching corev1.NodeList
	if err := r.List(ctx, &matching, client.MatchingLabelsSelector{Selector: selector}); err != nil {
		return fmt.Errorf("list nodes: %w", err)
	}
	names := make([]string, 0, len(matching.Items))
	ready := 0
	for i := range matching.Items {
		n := &matching.Items[i]
		if !n.DeletionTimestamp.IsZero() {
			continue
		}
		names = append(names, n.Name)
		// GKE installs runsc on every node it labels, so Ready is enough.
		if nodeIsReady(n) {
			ready++
		}
	}
	r.setNodes(pool, names, ready)
	note := ""
	if rc.Handler != v1alpha1.RunscHandler {
		note = fmt.Sprintf("; note: its handler is %q, not %q", rc.Handler, v1alpha1.RunscHandler)
	}
	switch {
	case len(names) == 0:
		r.setReady(pool, metav1.ConditionFalse, v1alpha1.ReasonNoMatchingNodes,
			fmt.Sprintf("RuntimeClass %s exists, but no node matches %s%s", name, selector, note))
	case ready == 0:
		r.setReady(pool, metav1.ConditionFalse, v1alpha1.ReasonNodesNotReady,
			fmt.Sprintf("none of the %d nodes matching %s is Ready%s", len(names), selector, note))
	default:
		r.setReady(pool, metav1.ConditionTrue, v1alpha1.ReasonNodesReady,
			fmt.Sprintf("%d of %d nodes matching %s are Ready; sandbox pods use the adopted RuntimeClass %s and tolerate %s=%s:%s%s",
				ready, len(names), selector, name, GKESandboxToleration.Key, GKESandboxToleration.Value, GKESandboxToleration.Effect, note))
	}
	return nil
}

// refuseManaged reports a Managed pool on a platform without the rights
// Managed mode needs. No finalizer is added: there is nothing on the nodes
// for it to take off.
func (r *GVisorNodePoolReconciler) refuseManaged(ctx context.Context, pool *v1alpha1.GVisorNodePool) error {
	base := pool.DeepCopy()
	pool.Status.ObservedGeneration = pool.Generation
	pool.Status.Nodes, pool.Status.ReadyNodes = nil, 0
	r.setReady(pool, metav1.ConditionFalse, v1alpha1.ReasonManagedModeDisabled,
		"the platform is installed without Managed node pools (chart value managedNodePools: false), so it may not label "+
			"or taint nodes nor create RuntimeClasses; set managedNodePools: true, or use mode GKE where GKE Sandbox provides gVisor")
	r.eventOnTransition(base, pool)
	return r.writeStatus(ctx, base, pool)
}

// finalize releases every node of a pool that is being deleted and deletes
// its RuntimeClass, then lets it go. The garbage collector would delete the
// RuntimeClass too, but only after the pool is gone; deleting it first means
// no sandbox pod is admitted onto nodes that are losing their label.
func (r *GVisorNodePoolReconciler) finalize(ctx context.Context, pool *v1alpha1.GVisorNodePool) error {
	if !controllerutil.ContainsFinalizer(pool, v1alpha1.Finalizer) {
		return nil
	}
	if r.ManagedModeDisabled {
		// Without the right to patch nodes, waiting would hold the pool
		// forever: it goes, and says what it leaves behind.
		r.event(pool, nil, corev1.EventTypeWarning, EventNodePoolNotReady, "Delete",
			fmt.Sprintf("nodes labelled %s=%s keep the label and the pool's taint: the platform may no longer patch nodes (managedNodePools: false)",
				v1alpha1.LabelNodePool, pool.Name))
	} else if err := r.releaseAll(ctx, pool); err != nil {
		return err
	}
	patch := client.MergeFrom(pool.DeepCopy())
	controllerutil.RemoveFinalizer(pool, v1alpha1.Finalizer)
	if err := r.Patch(ctx, pool, patch); err != nil && !apierrors.IsNotFound(err) {
		return fmt.Errorf("remove finalizer from node pool %s: %w", pool.Name, err)
	}
	return nil
}

// setNodes sets the node list (sorted, so that the status does not change
// with the cache's order) and the ready count.
func (r *GVisorNodePoolReconciler) setNodes(pool *v1alpha1.GVisorNodePool, names []string, ready int) {
	slices.Sort(names)
	if len(names) == 0 {
		names = nil
	}
	pool.Status.Nodes = names
	pool.Status.ReadyNodes = int32(ready)
}

func (r *GVisorNodePoolReconciler) setReady(pool *v1alpha1.GVisorNodePool, status metav1.ConditionStatus, reason, msg string) {
	setCondition(&pool.Status.Conditions, v1alpha1.ConditionReady, pool.Generation, r.now(), status, reason, msg)
}

// eventOnTransition records an event when the Ready condition's reason
// changed, so a state that lasts (a missing RuntimeClass) is told once.
func (r *GVisorNodePoolReconciler) eventOnTransition(base, pool *v1alpha1.GVisorNodePool) {
	prev := meta.FindStatusCondition(base.Status.Conditions, v1alpha1.ConditionReady)
	cur := meta.FindStatusCondition(pool.Status.Conditions, v1alpha1.ConditionReady)
	if cur == nil || (prev != nil && prev.Reason == cur.Reason && prev.Status == cur.Status) {
		return
	}
	switch {
	case cur.Status == metav1.ConditionTrue:
		r.event(pool, nil, corev1.EventTypeNormal, EventNodePoolReady, "Observe", cur.Message)
	case cur.Reason == v1alpha1.ReasonRuntimeClassNotFound:
		r.event(pool, nil, corev1.EventTypeWarning, EventRuntimeClassMissing, "Observe", cur.Message)
	case cur.Reason == v1alpha1.ReasonRuntimeClassConflict:
		r.event(pool, nil, corev1.EventTypeWarning, EventRuntimeClassConflict, "Observe", cur.Message)
	default:
		r.event(pool, nil, corev1.EventTypeWarning, EventNodePoolNotReady, "Observe", cur.Reason+": "+cur.Message)
	}
}

func (r *GVisorNodePoolReconciler) event(pool *v1alpha1.GVisorNodePool, related runtime.Object, eventType, reason, action, note string) {
	recordEvent(r.Recorder, pool, related, eventType, reason, action, note)
}
