package controller

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"strings"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/selection"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/controller/controllerutil"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	"github.com/agentbox/terraform-provider-agentbox/internal/store"
)

// Adoption from a warm pool.
//
// A new Sandbox X takes over a ready warm sandbox W of its template instead
// of starting a pod of its own. A pod's spec cannot change, and W's pod
// carries W's name, its serving certificate and its workspace claim, so X
// keeps W's name for them: status.workload records it, and every child name
// and the supervisor identity derive from it. The steps, each safe to run
// again after a crash:
//
//  1. claim W: take it through WarmTakes, so that of the new sandboxes,
//     pool leases and pool deletions racing for W exactly one wins, then
//     annotate it adopted-by=X (without WarmTakes, the annotation's
//     optimistic lock decides);
//  2. record status.workload=W on X, before anything moves, so that a pass
//     after a crash knows where X's children are;
//  3. move W's pod, workspace claim and TLS Secret to X: controller owner
//     reference and X's sandbox and agent labels (labels are mutable, and
//     nothing in the pod spec depends on X);
//  4. delete W, whose activity clock goes with it; X has its own.
//
// A pass that finds W claimed for X but no status.workload on X resumes at
// step 2; one that finds status.workload set resumes at step 3.

// EventAdoptedFromWarmPool is recorded on a Sandbox that took over a warm
// sandbox.
const EventAdoptedFromWarmPool = "AdoptedFromWarmPool"

// isWarm reports whether sbx is an unassigned sandbox of a warm pool.
func isWarm(sbx *v1alpha1.Sandbox) bool { return sbx.Labels[v1alpha1.LabelWarmPool] != "" }

// adopt runs the adoption steps that are due for sbx. It does nothing for a
// sandbox that started cold or has nothing to adopt; the caller then
// creates its children as usual.
func (r *SandboxReconciler) adopt(ctx context.Context, sbx *v1alpha1.Sandbox, tpl *v1alpha1.SandboxTemplate) error {
	if w := sbx.Status.Workload; w != "" {
		if w == sbx.Name {
			return nil
		}
		return r.moveFromWarm(ctx, sbx, tpl, w)
	}
	ok, err := r.mayAdopt(ctx, sbx, tpl)
	if err != nil || !ok {
		return err
	}
	warm, err := r.listWarm(ctx, sbx)
	if err != nil {
		return err
	}
	key, ignored := adoptEnvKey(sbx, tpl)
	if ignored != "" && len(warm) > 0 {
		r.warnPythonEnvIgnored(sbx, ignored)
	}
	warm = routeWarm(warm, key)
	var w *v1alpha1.Sandbox
	for i := range warm {
		if warm[i].Annotations[v1alpha1.AnnotationAdoptedBy] == sbx.Name {
			// Claimed by an earlier pass that did not get to record it.
			w = &warm[i]
			break
		}
	}
	if w == nil {
		if w, err = r.claim(ctx, sbx, tpl, warm); err != nil || w == nil {
			return err
		}
	}

	// Step 2, written now rather than with the rest of the status at the
	// end of the pass: once the children move, this is the only record of
	// where they are. The condition goes with it, so that a pass reading
	// this intermediate status still reports the adoption. A copy is
	// patched so that the pass's other status changes are not replaced by
	// the server's answer.
	routing := adoptionEnvRouting(w, key)
	if err := r.noteAdoptedEnvs(ctx, sbx, w, routing); err != nil {
		return err
	}
	before := sbx.DeepCopy()
	sbx.Status.Workload = w.Name
	msg := fmt.Sprintf("adopted warm sandbox %s of pool %s: taking over its running pod %s",
		w.Name, w.Labels[v1alpha1.LabelWarmPool], PodName(w.Name))
	if routing != "" {
		msg += fmt.Sprintf(" (routed by python environment %s: %s)", key, routing)
	}
	r.setNotServing(sbx, v1alpha1.SandboxPhasePending, v1alpha1.ReasonAdoptedFromWarmPool, msg)
	if err := r.Status().Patch(ctx, sbx.DeepCopy(), client.MergeFrom(before)); err != nil {
		return fmt.Errorf("record adoption of warm sandbox %s: %w", w.Name, err)
	}
	metricWarmAdoptions.Inc()
	if routing != "" {
		metricWarmAdoptionEnvRouting.WithLabelValues(routing).Inc()
	}
	r.event(sbx, w, corev1.EventTypeNormal, EventAdoptedFromWarmPool, "Adopt", msg)
	return r.moveFromWarm(ctx, sbx, tpl, w.Name)
}

// mayAdopt reports whether sbx is new enough to adopt: it never had a pod
// of its own, nor a snapshot to resume from, and is not warm itself.
func (r *SandboxReconciler) mayAdopt(ctx context.Context, sbx *v1alpha1.Sandbox, tpl *v1alpha1.SandboxTemplate) (bool, error) {
	if tpl == nil || isWarm(sbx) || sbx.Status.PodName != "" || sbx.Status.Snapshot != nil ||
		(sbx.Status.Phase != "" && sbx.Status.Phase != v1alpha1.SandboxPhasePending) {
		return false, nil
	}
	var pod corev1.Pod
	err := r.Get(ctx, types.NamespacedName{Namespace: sbx.Namespace, Name: PodName(sbx.Name)}, &pod)
	if err == nil {
		return false, nil
	}
	if !apierrors.IsNotFound(err) {
		return false, fmt.Errorf("get pod %s: %w", PodName(sbx.Name), err)
	}
	// A pod already moved to this sandbox under another name means the
	// status that records the adoption is newer than the cached Sandbox.
	// Going cold now would start a second pod; the next pass sees it.
	var pods corev1.PodList
	if err := r.List(ctx, &pods, client.InNamespace(sbx.Namespace),
		client.MatchingLabels{v1alpha1.LabelSandbox: sbx.Name}); err != nil {
		return false, fmt.Errorf("list pods of sandbox %s: %w", sbx.Name, err)
	}
	for i := range pods.Items {
		if _, proxy := pods.Items[i].Labels[v1alpha1.LabelEgressProxy]; proxy {
			// The sandbox's PerAgent egress proxy, which its controller
			// may well have started first.
			continue
		}
		if metav1.IsControlledBy(&pods.Items[i], sbx) {
			return false, apierrors.NewConflict(v1alpha1.GroupVersion.WithResource("sandboxes").GroupResource(), sbx.Name,
				fmt.Errorf("pod %s was adopted but the cached status does not say so yet", pods.Items[i].Name))
		}
	}
	return true, nil
}

// listWarm lists the warm sandboxes of sbx's template in its namespace,
// claimed or not, oldest first.
func (r *SandboxReconciler) listWarm(ctx context.Context, sbx *v1alpha1.Sandbox) ([]v1alpha1.Sandbox, error) {
	inPool, err := labels.NewRequirement(v1alpha1.LabelWarmPool, selection.Exists, nil)
	if err != nil {
		return nil, fmt.Errorf("select warm sandboxes: %w", err)
	}
	ofTemplate, err := labels.NewRequirement(v1alpha1.LabelTemplate, selection.Equals, []string{sbx.Spec.TemplateRef.Name})
	if err != nil {
		// Template names are DNS subdomains, which can be longer than a
		// label value; such a template simply has no warm pool to adopt
		// from.
		return nil, nil
	}
	var list v1alpha1.SandboxList
	if err := r.List(ctx, &list, client.InNamespace(sbx.Namespace),
		client.MatchingLabelsSelector{Selector: labels.NewSelector().Add(*inPool, *ofTemplate)}); err != nil {
		return nil, fmt.Errorf("list warm sandboxes: %w", err)
	}
	items := list.Items
	sort.SliceStable(items, func(i, j int) bool {
		ti, tj := items[i].CreationTimestamp, items[j].CreationTimestamp
		if !ti.Equal(&tj) {
			return ti.Before(&tj)
		}
		return items[i].Name < items[j].Name
	})
	return items, nil
}

// claim annotates the first adoptable warm sandbox as claimed by sbx and
// returns it, or nil when none can be had. The patch carries the
// resourceVersion read: a conflict means another sandbox claimed it first
// (or the pool deleted it), and the next one is tried.
func (r *SandboxReconciler) claim(ctx context.Context, sbx *v1alpha1.Sandbox, tpl *v1alpha1.SandboxTemplate, warm []v1alpha1.Sandbox) (*v1alpha1.Sandbox, error) {
	hash := v1alpha1.TemplateHash(&tpl.Spec)
	lost := 0
	for i := range warm {
		w := &warm[i]
		if ok, err := r.adoptable(ctx, w, hash); err != nil {
			return nil, err
		} else if !ok {
			continue
		}
		var patch client.Patch
		if r.WarmTakes != nil {
			ok, err := takeWarm(ctx, r.WarmTakes, w, store.WarmTakenByAdoption, sbx.Name, string(sbx.UID))
			if err != nil {
				return nil, err
			}
			if !ok {
				// Someone else's; its annotations are on the way.
				lost++
				continue
			}
			// It is ours whatever the cache says, so no lock: a conflict
			// now could only mean the cached copy is behind.
			patch = client.MergeFrom(w.DeepCopy())
		} else {
			patch = client.MergeFromWithOptions(w.DeepCopy(), client.MergeFromWithOptimisticLock{})
		}
		if w.Annotations == nil {
			w.Annotations = map[string]string{}
		}
		w.Annotations[v1alpha1.AnnotationAdoptedBy] = sbx.Name
		err := r.Patch(ctx, w, patch)
		if err == nil {
			return w, nil
		}
		if apierrors.IsConflict(err) || apierrors.IsNotFound(err) {
			lost++
			continue
		}
		return nil, fmt.Errorf("claim warm sandbox %s: %w", w.Name, err)
	}
	if lost > 0 {
		// Every claim lost, perhaps only to a stale cache: look again
		// shortly rather than start cold with warm sandboxes about.
		return nil, apierrors.NewConflict(v1alpha1.GroupVersion.WithResource("sandboxes").GroupResource(), sbx.Name,
			errors.New("lost the race for every warm sandbox tried"))
	}
	return nil, nil
}

// adoptable reports whether w can be claimed: an unclaimed warm sandbox of
// a pool, made from the template as it is now, whose pod is ready.
func (r *SandboxReconciler) adoptable(ctx context.Context, w *v1alpha1.Sandbox, hash string) (bool, error) {
	owner := metav1.GetControllerOf(w)
	if owner == nil || owner.Kind != "SandboxWarmPool" || !w.DeletionTimestamp.IsZero() ||
		w.Annotations[v1alpha1.AnnotationAdoptedBy] != "" || v1alpha1.PoolLeased(w) || w.Status.Workload != "" ||
		w.Annotations[v1alpha1.AnnotationTemplateHash] != hash || !sandboxReady(w) {
		return false, nil
	}
	var pod corev1.Pod
	if err := r.Get(ctx, types.NamespacedName{Namespace: w.Namespace, Name: PodName(w.Name)}, &pod); err != nil {
		if apierrors.IsNotFound(err) {
			return false, nil
		}
		return false, fmt.Errorf("get pod %s of warm sandbox %s: %w", PodName(w.Name), w.Name, err)
	}
	return metav1.IsControlledBy(&pod, w) && pod.DeletionTimestamp.IsZero() && podReady(&pod), nil
}

// sandboxReady reports whether a sandbox takes calls, as its status says.
func sandboxReady(sbx *v1alpha1.Sandbox) bool {
	return sbx.Status.Phase == v1alpha1.SandboxPhaseRunning && meta.IsStatusConditionTrue(sbx.Status.Conditions, v1alpha1.ConditionReady)
}

// moveFromWarm makes the children of the warm sandbox named warm sbx's, and
// deletes the warm sandbox. Once it is gone there is nothing left to do.
func (r *SandboxReconciler) moveFromWarm(ctx context.Context, sbx *v1alpha1.Sandbox, tpl *v1alpha1.SandboxTemplate, warm string) error {
	var w v1alpha1.Sandbox
	if err := r.Get(ctx, types.NamespacedName{Namespace: sbx.Namespace, Name: warm}, &w); err != nil {
		if apierrors.IsNotFound(err) {
			return nil
		}
		return fmt.Errorf("get adopted warm sandbox %s: %w", warm, err)
	}
	if by := w.Annotations[v1alpha1.AnnotationAdoptedBy]; by != sbx.Name {
		// Not ours: a Sandbox of that name that came later. Our children,
		// if any, were moved before the warm one was deleted.
		return nil
	}
	// Resuming an adoption a failed or killed pass left half-done: the
	// condition it set may since have become a ReconcileError.
	if readyReason(sbx) != v1alpha1.ReasonAdoptedFromWarmPool {
		r.setNotServing(sbx, v1alpha1.SandboxPhasePending, v1alpha1.ReasonAdoptedFromWarmPool,
			fmt.Sprintf("adopted warm sandbox %s; taking over its pod %s", w.Name, PodName(w.Name)))
	}
	// The adopter's NetworkPolicy selects its pods by its own name, so it
	// must exist before the pod is relabelled: the warm sandbox's policy
	// stops selecting the pod at that moment (and goes with the warm
	// sandbox), and the pod must never run unconfined in between.
	ep, err := templateEgressProxy(ctx, r.Client, tpl)
	if err != nil {
		return err
	}
	if err := applySandboxNetworkPolicy(ctx, r.Client, r.Scheme, sbx, ep, r.Namespace); err != nil {
		return err
	}
	// The pod's HTTP_PROXY names the warm sandbox's proxy Service by its
	// ClusterIP, so the Service (and the credentials behind it) move too;
	// the EgressProxy controller then points the Service's selector at the
	// adopter.
	children := []client.Object{
		&corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: PodName(warm)}},
		&corev1.PersistentVolumeClaim{ObjectMeta: metav1.ObjectMeta{Name: WorkspaceClaimName(warm)}},
		&corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: TLSSecretName(warm)}},
		&corev1.Service{ObjectMeta: metav1.ObjectMeta{Name: EgressServiceName(warm)}},
		&corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: EgressCredentialsSecretName(warm)}},
	}
	for _, obj := range children {
		if err := r.moveChild(ctx, sbx, &w, obj); err != nil {
			return err
		}
	}
	if err := r.dropWarmProxyPod(ctx, sbx, &w); err != nil {
		return err
	}
	if w.DeletionTimestamp.IsZero() {
		// Its children are no longer its own, so deleting it takes only its
		// activity clock along.
		if err := r.Delete(ctx, &w, client.Preconditions{UID: &w.UID}); err != nil && !apierrors.IsNotFound(err) {
			return fmt.Errorf("delete adopted warm sandbox %s: %w", w.Name, err)
		}
	}
	return nil
}

// dropWarmProxyPod deletes the PerAgent proxy pod of the adopted warm
// sandbox w instead of moving it: it runs as the warm sandbox's agent and
// would be replaced anyway, and while it still answered under the
// adopter's labels the adopter would look served by a proxy that is about
// to go. The EgressProxy controller makes the adopter's under the same
// name, and the adopter does not serve before that one is ready
// (egressProxyPending).
func (r *SandboxReconciler) dropWarmProxyPod(ctx context.Context, sbx, w *v1alpha1.Sandbox) error {
	var pod corev1.Pod
	name := EgressServiceName(w.Name)
	if err := r.Get(ctx, types.NamespacedName{Namespace: sbx.Namespace, Name: name}, &pod); err != nil {
		if apierrors.IsNotFound(err) {
			return nil
		}
		return fmt.Errorf("get proxy pod %s of warm sandbox %s: %w", name, w.Name, err)
	}
	if !metav1.IsControlledBy(&pod, w) || !pod.DeletionTimestamp.IsZero() {
		// Already the adopter's successor, or going.
		return nil
	}
	if err := r.Delete(ctx, &pod, client.Preconditions{UID: &pod.UID}); err != nil && !apierrors.IsNotFound(err) && !apierrors.IsConflict(err) {
		return fmt.Errorf("delete proxy pod %s of warm sandbox %s: %w", name, w.Name, err)
	}
	return nil
}

// moveChild gives obj, a child of the warm sandbox w, to sbx: controller
// reference and labels. A child already moved is left as it is.
func (r *SandboxReconciler) moveChild(ctx context.Context, sbx, w *v1alpha1.Sandbox, obj client.Object) error {
	kind := fmt.Sprintf("%T", obj)
	kind = kind[strings.LastIndexByte(kind, '.')+1:]
	name := obj.GetName()
	if err := r.Get(ctx, types.NamespacedName{Namespace: sbx.Namespace, Name: name}, obj); err != nil {
		if apierrors.IsNotFound(err) {
			// The warm sandbox had not made it, or lost it; the sandbox
			// creates it under the workload name as it would its own.
			return nil
		}
		return fmt.Errorf("get %s %s of warm sandbox %s: %w", kind, name, w.Name, err)
	}
	want := sandboxLabels(sbx)
	if metav1.IsControlledBy(obj, sbx) {
		if labelsHold(obj.GetLabels(), want) {
			return nil
		}
	} else if !metav1.IsControlledBy(obj, w) {
		owner := ""
		if ref := metav1.GetControllerOf(obj); ref != nil {
			owner = ref.Kind + "/" + ref.Name
		}
		return &ownershipConflictError{kind: kind, name: name, owner: owner}
	}
	patch := client.MergeFromWithOptions(obj.DeepCopyObject().(client.Object), client.MergeFromWithOptimisticLock{})
	refs := obj.GetOwnerReferences()[:0:0]
	for _, ref := range obj.GetOwnerReferences() {
		if ref.UID != w.UID {
			refs = append(refs, ref)
		}
	}
	obj.SetOwnerReferences(refs)
	if err := controllerutil.SetControllerReference(sbx, obj, r.Scheme); err != nil {
		return fmt.Errorf("set owner of %s %s: %w", kind, name, err)
	}
	l := obj.GetLabels()
	if l == nil {
		l = map[string]string{}
	}
	for k, v := range want {
		l[k] = v
	}
	delete(l, v1alpha1.LabelWarmPool)
	obj.SetLabels(l)
	if err := r.Patch(ctx, obj, patch); err != nil {
		return fmt.Errorf("move %s %s from warm sandbox %s: %w", kind, name, w.Name, err)
	}
	return nil
}

func labelsHold(have, want map[string]string) bool {
	for k, v := range want {
		if have[k] != v {
			return false
		}
	}
	_, warm := have[v1alpha1.LabelWarmPool]
	return !warm
}
