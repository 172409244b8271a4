package controller

import (
	"context"
	"crypto/rand"
	"fmt"
	"strings"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/controller/controllerutil"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	"github.com/agentbox/terraform-provider-agentbox/internal/pki"
)

// The Sandbox reconciler's children: reading them, telling its own from a
// foreign object or one left by an earlier Sandbox of the same name, and
// creating the serving certificate, the activity clock, the workspace claim
// and the pod.

// getPod reads the sandbox's pod; nil when it has none.
func (r *SandboxReconciler) getPod(ctx context.Context, sbx *v1alpha1.Sandbox) (*corev1.Pod, error) {
	var pod corev1.Pod
	found, err := r.getChild(ctx, sbx, PodName(workloadName(sbx)), &pod)
	if err != nil || !found {
		return nil, err
	}
	return &pod, nil
}

func (r *SandboxReconciler) getTemplate(ctx context.Context, sbx *v1alpha1.Sandbox) (*v1alpha1.SandboxTemplate, error) {
	var tpl v1alpha1.SandboxTemplate
	key := types.NamespacedName{Namespace: sbx.Namespace, Name: sbx.Spec.TemplateRef.Name}
	if err := r.Get(ctx, key, &tpl); err != nil {
		if apierrors.IsNotFound(err) {
			return nil, nil
		}
		return nil, fmt.Errorf("get SandboxTemplate %s: %w", key.Name, err)
	}
	return &tpl, nil
}

// leftoverChildError says that a child's name is still held by the child
// of an earlier Sandbox with the same name, which is being deleted.
type leftoverChildError struct{ kind, name string }

func (e *leftoverChildError) Error() string {
	return fmt.Sprintf("waiting for %s %s of an earlier sandbox of this name to be deleted", e.kind, e.name)
}

// leftoverRetry is short: garbage collection of a pod takes seconds.
const leftoverRetry = time.Second

// ownershipConflictError says that a child's name is taken by an object the
// sandbox does not control. The controller never adopts or overwrites it:
// it might be a user's Secret or pod that happens to share the name.
type ownershipConflictError struct {
	kind, name, owner string
}

func (e *ownershipConflictError) Error() string {
	owner := "no controller"
	if e.owner != "" {
		owner = "controller " + e.owner
	}
	return fmt.Sprintf("%s %s already exists and is not controlled by this Sandbox (it has %s); delete or rename it", e.kind, e.name, owner)
}

// getChild reads the child named name into obj. It reports whether it
// exists, and an ownershipConflictError if it exists but is not this
// sandbox's.
func (r *SandboxReconciler) getChild(ctx context.Context, sbx *v1alpha1.Sandbox, name string, obj client.Object) (bool, error) {
	kind := fmt.Sprintf("%T", obj)
	kind = kind[strings.LastIndexByte(kind, '.')+1:]
	if err := r.Get(ctx, types.NamespacedName{Namespace: sbx.Namespace, Name: name}, obj); err != nil {
		if apierrors.IsNotFound(err) {
			return false, nil
		}
		return false, fmt.Errorf("get %s %s: %w", kind, name, err)
	}
	if ref := metav1.GetControllerOf(obj); ref != nil && ref.Kind == "Sandbox" && ref.Name == sbx.Name &&
		ref.UID != sbx.UID && strings.HasPrefix(ref.APIVersion, v1alpha1.GroupName+"/") {
		// Left by an earlier Sandbox of this name, which no longer exists
		// (names are unique), so the garbage collector removes it anyway;
		// deleting it now saves waiting for its next pass.
		if obj.GetDeletionTimestamp() == nil {
			if err := r.Delete(ctx, obj, client.PropagationPolicy(metav1.DeletePropagationBackground)); err != nil && !apierrors.IsNotFound(err) {
				return true, fmt.Errorf("delete %s %s left by an earlier sandbox: %w", kind, name, err)
			}
		}
		return true, &leftoverChildError{kind: kind, name: name}
	}
	if !metav1.IsControlledBy(obj, sbx) {
		owner := ""
		if ref := metav1.GetControllerOf(obj); ref != nil {
			owner = ref.Kind + "/" + ref.Name
		}
		return true, &ownershipConflictError{kind: kind, name: name, owner: owner}
	}
	return true, nil
}

// create makes obj a child of sbx and creates it.
func (r *SandboxReconciler) create(ctx context.Context, sbx *v1alpha1.Sandbox, obj client.Object) error {
	if err := controllerutil.SetControllerReference(sbx, obj, r.Scheme); err != nil {
		return fmt.Errorf("set owner of %s: %w", obj.GetName(), err)
	}
	if err := r.Create(ctx, obj); err != nil {
		// AlreadyExists means the cache had not seen it yet; the retry sees
		// it, and whether it is ours.
		return fmt.Errorf("create %T %s: %w", obj, obj.GetName(), err)
	}
	return nil
}

// ensureTLSSecret makes sure the sandbox has a valid serving certificate and
// returns how long until it must be re-issued.
func (r *SandboxReconciler) ensureTLSSecret(ctx context.Context, sbx *v1alpha1.Sandbox) (time.Duration, error) {
	var secret corev1.Secret
	name := TLSSecretName(workloadName(sbx))
	found, err := r.getChild(ctx, sbx, name, &secret)
	if err != nil {
		return 0, err
	}
	id := pki.SandboxID(r.TrustDomain, sbx.Namespace, workloadName(sbx))
	now := r.now()
	why := ""
	if found {
		renewAt, err := certRenewTime(secret.Data, r.CA, id, now)
		if err == nil && now.Before(renewAt) {
			return renewAt.Sub(now), r.ensureSealKey(ctx, &secret)
		}
		if err != nil {
			why = err.Error()
		} else {
			why = "it is in the last third of its lifetime"
		}
	}

	data, err := tlsSecretData(r.CA, id)
	if err != nil {
		return 0, err
	}
	// The seal key outlives certificates: environments sealed under it
	// must still verify after a renewal.
	if k := secret.Data[sealKeyKey]; len(k) > 0 {
		data[sealKeyKey] = k
	} else if data[sealKeyKey], err = newSealKey(); err != nil {
		return 0, err
	}
	if !found {
		secret = corev1.Secret{
			ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: sbx.Namespace, Labels: sandboxLabels(sbx)},
			Type:       corev1.SecretTypeTLS,
			Data:       data,
		}
		if err := r.create(ctx, sbx, &secret); err != nil {
			return 0, err
		}
		r.event(sbx, &secret, corev1.EventTypeNormal, EventCertificateIssued, "Issue",
			fmt.Sprintf("issued serving certificate for %s into Secret %s", id, name))
	} else {
		// A running supervisor keeps the certificate it started with; the
		// new one is used from the pod's next start. Certificates outlive
		// pods by far (a year against an idle timeout of hours), so this
		// matters only after a CA rotation, which restarts sandboxes anyway.
		secret.Data = data
		if err := r.Update(ctx, &secret); err != nil {
			return 0, fmt.Errorf("update Secret %s: %w", name, err)
		}
		r.event(sbx, &secret, corev1.EventTypeNormal, EventCertificateReissued, "Issue",
			fmt.Sprintf("re-issued serving certificate for %s into Secret %s: %s", id, name, why))
	}
	renewAt, err := certRenewTime(data, r.CA, id, now)
	if err != nil {
		return 0, fmt.Errorf("check the certificate just issued: %w", err)
	}
	return renewAt.Sub(now), nil
}

// ensureActivityClock creates the activity clock, the Lease whose
// renewTime records the sandbox's last activity, if it is missing, and
// returns it when it already existed (a new one holds nothing to look at).
// It never renews it: renewals come from the Compute API on activity, and
// a renew by the controller would make every sandbox look busy.
func (r *SandboxReconciler) ensureActivityClock(ctx context.Context, sbx *v1alpha1.Sandbox) (*coordinationv1.Lease, error) {
	var activityClock coordinationv1.Lease
	found, err := r.getChild(ctx, sbx, ActivityClockName(sbx.Name), &activityClock)
	if err != nil {
		return nil, err
	}
	if found {
		return &activityClock, nil
	}
	return nil, r.create(ctx, sbx, desiredActivityClock(sbx, r.now()))
}

// ensureWorkspace creates the workspace claim if it is missing, from the
// latest snapshot when there is one, and returns it. It reports false while
// an old claim is still being deleted: a pod must not be bound to a claim
// that is going away.
func (r *SandboxReconciler) ensureWorkspace(ctx context.Context, prevReason string, sbx *v1alpha1.Sandbox, tpl *v1alpha1.SandboxTemplate) (*corev1.PersistentVolumeClaim, bool, error) {
	var pvc corev1.PersistentVolumeClaim
	found, err := r.getChild(ctx, sbx, WorkspaceClaimName(workloadName(sbx)), &pvc)
	if err != nil {
		return nil, false, err
	}
	if found {
		return &pvc, pvc.DeletionTimestamp.IsZero(), nil
	}
	if snap := sbx.Status.Snapshot; snap != nil && !sbx.Spec.Ephemeral {
		if err := r.checkSnapshotDriver(sbx, snap.Name); err != nil {
			return nil, false, err
		}
	}
	want := desiredWorkspaceClaim(sbx, tpl)
	r.prepareRestore(sbx, want)
	if err := r.create(ctx, sbx, want); err != nil {
		return nil, false, err
	}
	size := want.Spec.Resources.Requests[corev1.ResourceStorage]
	if snap := restoring(want); snap != "" {
		r.event(sbx, want, corev1.EventTypeNormal, EventResuming, "Resume",
			fmt.Sprintf("activity on the stopped sandbox: created workspace claim %s (%s) to restore snapshot %s into", want.Name, size.String(), snap))
	} else {
		r.event(sbx, want, corev1.EventTypeNormal, EventWorkspaceCreated, "Create",
			fmt.Sprintf("created workspace claim %s (%s)", want.Name, size.String()))
	}
	return want, true, nil
}

func (r *SandboxReconciler) createPod(ctx context.Context, sbx *v1alpha1.Sandbox, tpl *v1alpha1.SandboxTemplate) error {
	pod := r.desiredPod(sbx, tpl)
	if err := r.wireEgress(ctx, sbx, tpl, pod); err != nil {
		return err
	}
	if err := r.scheduleOnNodePool(ctx, tpl, pod); err != nil {
		return err
	}
	if err := r.create(ctx, sbx, pod); err != nil {
		return err
	}
	image := pod.Spec.Containers[0].Image
	// A sandbox that had a pod before lost it out of band (deleted, evicted,
	// failed); saying so tells an operator why it restarted.
	if sbx.Status.PodName != "" {
		r.event(sbx, pod, corev1.EventTypeNormal, EventPodRecreated, "Create",
			fmt.Sprintf("recreated pod %s (image %s) after the previous one went away; the workspace is kept", pod.Name, image))
	} else {
		// A first start, not a resume (which comes from Stopped with
		// a snapshot) and not a pool filling up.
		if sbx.Status.Workload == "" && !isWarm(sbx) && sbx.Status.Snapshot == nil &&
			(sbx.Status.Phase == "" || sbx.Status.Phase == v1alpha1.SandboxPhasePending) {
			metricColdStarts.Inc()
		}
		r.event(sbx, pod, corev1.EventTypeNormal, EventPodCreated, "Create",
			fmt.Sprintf("created pod %s (image %s, runtime class %s)", pod.Name, image, *pod.Spec.RuntimeClassName))
	}
	return nil
}

// newSealKey makes a sandbox's environment seal key.
func newSealKey() ([]byte, error) {
	k := make([]byte, 32)
	if _, err := rand.Read(k); err != nil {
		return nil, fmt.Errorf("make the environment seal key: %w", err)
	}
	return k, nil
}

// ensureSealKey adds the environment seal key to a TLS Secret made before
// there was one.
func (r *SandboxReconciler) ensureSealKey(ctx context.Context, secret *corev1.Secret) error {
	if len(secret.Data[sealKeyKey]) > 0 {
		return nil
	}
	k, err := newSealKey()
	if err != nil {
		return err
	}
	patch := client.MergeFrom(secret.DeepCopy())
	if secret.Data == nil {
		secret.Data = map[string][]byte{}
	}
	secret.Data[sealKeyKey] = k
	if err := r.Patch(ctx, secret, patch); err != nil {
		return fmt.Errorf("add the environment seal key to Secret %s: %w", secret.Name, err)
	}
	return nil
}
