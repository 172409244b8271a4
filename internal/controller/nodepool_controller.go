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
	"k8s.io/klog/v2"
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
	if err := r.Get(ctx, req.NamespacedName, &pool); err != nil {
		return ctrl.Result{}, client.IgnoreNotFound(err)
	}
	if !pool.DeletionTimestamp.IsZero() {
		return ctrl.Result{}, r.finalize(ctx, &pool)
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

// desiredRuntimeClass is a Managed pool's RuntimeClass.
//
// Its nodeSelector adds the pool's own node label to spec.nodeSelector, so
// sandbox pods land only on nodes the controller has prepared (labelled,
// tainted, handed to the installer), never on a node that has just come to
// match. Its tolerations add one for the pool's taint when spec.tolerations
// do not already tolerate it: without it no sandbox pod could ever be
// scheduled onto the pool, and the spec is not the controller's to fix.
func desiredRuntimeClass(pool *v1alpha1.GVisorNodePool) *nodev1.RuntimeClass {
	sel := maps.Clone(pool.Spec.NodeSelector)
	if sel == nil {
		sel = map[string]string{}
	}
	sel[v1alpha1.LabelNodePool] = pool.Name
	tols := copyTolerations(pool.Spec.Tolerations)
	if t := pool.Spec.Taint; t != nil && !tolerated(tols, t) {
		tols = append(tols, corev1.Toleration{Key: t.Key, Operator: corev1.TolerationOpEqual, Value: t.Value, Effect: t.Effect})
		if t.Value == "" {
			tols[len(tols)-1].Operator = corev1.TolerationOpExists
		}
	}
	rc := &nodev1.RuntimeClass{
		ObjectMeta: metav1.ObjectMeta{
			Name: poolRuntimeClassName(pool),
			Labels: map[string]string{
				v1alpha1.LabelNodePool: pool.Name,
				labelManagedBy:         managedByValue,
			},
		},
		Handler:    v1alpha1.RunscHandler,
		Scheduling: &nodev1.Scheduling{NodeSelector: sel, Tolerations: tols},
	}
	if len(pool.Spec.Overhead) > 0 {
		rc.Overhead = &nodev1.Overhead{PodFixed: pool.Spec.Overhead.DeepCopy()}
	}
	return rc
}

func tolerated(tols []corev1.Toleration, taint *corev1.Taint) bool {
	for i := range tols {
		if tols[i].ToleratesTaint(klog.Background(), taint, false) {
			return true
		}
	}
	return false
}

// ensureRuntimeClass creates or corrects a Managed pool's RuntimeClass. It
// returns a note for the Ready message, and a conflict message when the name
// is taken by a RuntimeClass the pool cannot use.
//
// A same-name RuntimeClass that someone else created with handler runsc is
// used as it is: it already runs pods under gVisor, and taking it over would
// change the scheduling of whatever else uses it. Its own scheduling then
// applies, which the note says.
func (r *GVisorNodePoolReconciler) ensureRuntimeClass(ctx context.Context, pool *v1alpha1.GVisorNodePool) (note, conflict string, err error) {
	want := desiredRuntimeClass(pool)
	var have nodev1.RuntimeClass
	if err := r.Get(ctx, types.NamespacedName{Name: want.Name}, &have); err != nil {
		if !apierrors.IsNotFound(err) {
			return "", "", fmt.Errorf("get RuntimeClass %s: %w", want.Name, err)
		}
		if err := controllerutil.SetControllerReference(pool, want, r.Scheme); err != nil {
			return "", "", fmt.Errorf("set owner of RuntimeClass %s: %w", want.Name, err)
		}
		if err := r.Create(ctx, want); err != nil {
			return "", "", fmt.Errorf("create RuntimeClass %s: %w", want.Name, err)
		}
		r.event(pool, want, corev1.EventTypeNormal, EventRuntimeClassCreated, "Create",
			fmt.Sprintf("created RuntimeClass %s (handler %s)", want.Name, want.Handler))
		return "", "", nil
	}

	if !metav1.IsControlledBy(&have, pool) {
		if ref := metav1.GetControllerOf(&have); ref != nil && ref.Kind == "GVisorNodePool" && strings.HasPrefix(ref.APIVersion, v1alpha1.GroupName+"/") {
			if ref.Name != pool.Name {
				return "", fmt.Sprintf("RuntimeClass %s belongs to GVisorNodePool %s; give this pool another runtimeClassName", have.Name, ref.Name), nil
			}
			// An earlier pool of this name left it; the garbage collector
			// removes it, and the RuntimeClass watch brings us back then.
			return "", fmt.Sprintf("RuntimeClass %s of an earlier GVisorNodePool %s is being deleted", have.Name, ref.Name), nil
		}
		if have.Handler != v1alpha1.RunscHandler {
			return "", fmt.Sprintf("RuntimeClass %s exists with handler %q and is not managed by agentbox; it is left alone. "+
				"Delete it, or give the pool another runtimeClassName", have.Name, have.Handler), nil
		}
		return fmt.Sprintf("; RuntimeClass %s was not created by agentbox and is used as it is, with its own scheduling and overhead", have.Name), "", nil
	}

	if have.Handler != want.Handler {
		// The handler is immutable, and no one but us should have made ours
		// with another; start it afresh.
		if err := r.Delete(ctx, &have, client.Preconditions{UID: &have.UID}); err != nil && !apierrors.IsNotFound(err) {
			return "", "", fmt.Errorf("delete RuntimeClass %s with handler %q: %w", have.Name, have.Handler, err)
		}
		return "", "", apierrors.NewConflict(nodev1.Resource("runtimeclasses"), have.Name, errors.New("re-created with handler runsc"))
	}
	if equality.Semantic.DeepEqual(have.Scheduling, want.Scheduling) && equality.Semantic.DeepEqual(have.Overhead, want.Overhead) &&
		have.Labels[v1alpha1.LabelNodePool] == pool.Name && have.Labels[labelManagedBy] == managedByValue {
		return "", "", nil
	}
	patch := client.MergeFromWithOptions(have.DeepCopy(), client.MergeFromWithOptimisticLock{})
	have.Scheduling = want.Scheduling
	have.Overhead = want.Overhead
	if have.Labels == nil {
		have.Labels = map[string]string{}
	}
	maps.Copy(have.Labels, want.Labels)
	if err := r.Patch(ctx, &have, patch); err != nil {
		return "", "", fmt.Errorf("update RuntimeClass %s: %w", have.Name, err)
	}
	r.event(pool, &have, corev1.EventTypeNormal, EventRuntimeClassUpdated, "Update",
		fmt.Sprintf("updated the scheduling and overhead of RuntimeClass %s to the pool's spec", have.Name))
	return "", "", nil
}

// deleteStaleRuntimeClasses deletes the RuntimeClasses the pool created
// other than keep: after spec.runtimeClassName changed, after a switch to
// GKE mode, and (keep empty) when the pool is deleted. Ownership is checked,
// not just the label, since anyone can put a label on a RuntimeClass.
func (r *GVisorNodePoolReconciler) deleteStaleRuntimeClasses(ctx context.Context, pool *v1alpha1.GVisorNodePool, keep string) error {
	var list nodev1.RuntimeClassList
	if err := r.List(ctx, &list, client.MatchingLabels{v1alpha1.LabelNodePool: pool.Name}); err != nil {
		return fmt.Errorf("list RuntimeClasses of node pool %s: %w", pool.Name, err)
	}
	for i := range list.Items {
		rc := &list.Items[i]
		if rc.Name == keep || !metav1.IsControlledBy(rc, pool) {
			continue
		}
		if err := r.Delete(ctx, rc, client.Preconditions{UID: &rc.UID}); err != nil && !apierrors.IsNotFound(err) {
			return fmt.Errorf("delete RuntimeClass %s that the pool no longer uses: %w", rc.Name, err)
		}
		why := "the pool no longer uses it"
		if keep != "" {
			why = "the pool now uses " + keep
		}
		r.event(pool, rc, corev1.EventTypeNormal, EventRuntimeClassDeleted, "Delete",
			fmt.Sprintf("deleted RuntimeClass %s: %s", rc.Name, why))
	}
	return nil
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

// finalize releases every node of a pool that is being deleted and deletes
// its RuntimeClass, then lets it go. The garbage collector would delete the
// RuntimeClass too, but only after the pool is gone; deleting it first means
// no sandbox pod is admitted onto nodes that are losing their label.
func (r *GVisorNodePoolReconciler) finalize(ctx context.Context, pool *v1alpha1.GVisorNodePool) error {
	if !controllerutil.ContainsFinalizer(pool, v1alpha1.Finalizer) {
		return nil
	}
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
