package controller

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"strings"

	corev1 "k8s.io/api/core/v1"
	nodev1 "k8s.io/api/node/v1"
	"k8s.io/apimachinery/pkg/api/equality"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/klog/v2"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/controller/controllerutil"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
)

// The node pool reconciler's RuntimeClass: the one a Managed pool owns, and
// those it created under an earlier name.

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
