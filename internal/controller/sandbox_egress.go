package controller

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"net"
	"strconv"

	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/controller/controllerutil"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
)

// egressNoProxy keeps loopback off the proxy: servers a tool starts inside
// the sandbox are reached directly. Nothing else is: the NetworkPolicy
// lets the sandbox reach only its proxy and DNS.
const egressNoProxy = "localhost,127.0.0.1,::1"

// egressEnvNames are the variables wireEgress sets. Both spellings: curl
// reads only the lower-case http_proxy, other tools only upper case.
var egressEnvNames = []string{"HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "http_proxy", "https_proxy", "no_proxy"}

// wireEgress prepares a sandbox pod about to be created for its egress:
// the sandbox's NetworkPolicy exists before the pod does, so the pod never
// runs unconfined, and when the template names an EgressProxy the pod gets
// HTTP_PROXY, HTTPS_PROXY and NO_PROXY pointing at its proxy Service.
//
// The proxy is addressed by its Service's ClusterIP rather than its DNS
// name: the address is fixed for the Service's life, and a sandbox does
// not depend on cluster DNS to leave. The Service is created here if the
// EgressProxy controller has not done so yet (they build the same object).
func (r *SandboxReconciler) wireEgress(ctx context.Context, sbx *v1alpha1.Sandbox, tpl *v1alpha1.SandboxTemplate, pod *corev1.Pod) error {
	ep, err := templateEgressProxy(ctx, r.Client, tpl)
	if err != nil {
		return err
	}
	if err := applySandboxNetworkPolicy(ctx, r.Client, r.Scheme, sbx, ep, r.Namespace); err != nil {
		return err
	}
	if ep == nil {
		return nil
	}
	if hasCredentials(ep) {
		// The proxy answers the credentials' HTTPS destinations with
		// certificates from its CA; the sandbox must trust it from its
		// first request.
		if err := ensureEgressCA(ctx, r.Client, r.Scheme, ep); err != nil {
			return err
		}
		setEgressTrust(pod, ep)
	}
	if proxyMode(ep) == v1alpha1.EgressProxyModeShared {
		return r.wireSharedEgress(ctx, sbx, ep, pod)
	}
	svc, err := applyPerAgentService(ctx, r.Client, r.Scheme, ep, sbx)
	if err != nil {
		return err
	}
	if svc.Spec.ClusterIP == "" || svc.Spec.ClusterIP == corev1.ClusterIPNone {
		return fmt.Errorf("proxy Service %s has no ClusterIP yet", svc.Name)
	}
	setEgressEnv(pod, "http://"+net.JoinHostPort(svc.Spec.ClusterIP, strconv.Itoa(EgressProxyPort)), nil)
	if pod.Annotations == nil {
		pod.Annotations = map[string]string{}
	}
	// The proxy pod is named like its Service (desiredPerAgentProxyPod).
	pod.Annotations[annotationEgressProxyPod] = svc.Name
	return nil
}

// annotationEgressProxyPod on a sandbox pod names the PerAgent egress proxy
// pod its HTTP_PROXY leads to. A sandbox does not serve before that proxy
// is ready: a Service without a ready endpoint refuses connections, and the
// agent's first fetch would fail although the sandbox said it was ready.
const annotationEgressProxyPod = v1alpha1.GroupName + "/egress-proxy-pod"

// egressProxyPending says what a sandbox whose pod is ready still waits for
// before it first serves: its PerAgent egress proxy pod, ready. Empty when
// it waits for nothing. The proxy pod is the Sandbox's, so its changes
// bring the sandbox back here.
func (r *SandboxReconciler) egressProxyPending(ctx context.Context, sbx *v1alpha1.Sandbox, pod *corev1.Pod) (string, error) {
	name := pod.Annotations[annotationEgressProxyPod]
	if name == "" {
		return "", nil
	}
	var proxy corev1.Pod
	err := r.Get(ctx, types.NamespacedName{Namespace: sbx.Namespace, Name: name}, &proxy)
	switch {
	case apierrors.IsNotFound(err):
		return fmt.Sprintf("pod %s is ready; waiting for its egress proxy pod %s to be created", pod.Name, name), nil
	case err != nil:
		return "", fmt.Errorf("get egress proxy pod %s: %w", name, err)
	case !proxy.DeletionTimestamp.IsZero() || !metav1.IsControlledBy(&proxy, sbx):
		// An adopted warm sandbox's, on its way out.
		return fmt.Sprintf("pod %s is ready; waiting for its egress proxy pod %s to be replaced for agent %s", pod.Name, name, sbx.Spec.AgentID), nil
	case !podReady(&proxy):
		why := ""
		for _, cs := range proxy.Status.ContainerStatuses {
			if msg, failed := statusProblem(cs); failed {
				why = ": " + msg
				break
			}
		}
		return fmt.Sprintf("pod %s is ready; waiting for its egress proxy pod %s to become ready%s", pod.Name, name, why), nil
	}
	return "", nil
}

// wireSharedEgress points the sandbox at its Shared proxy with its own
// credentials: the password comes from the sandbox's credentials Secret
// into a variable, and HTTP_PROXY refers to it, so the pod spec holds no
// password. The proxy accepts the credentials once the EgressProxy
// controller has added them to the proxy's client list; until then (a few
// seconds) the proxy answers 407.
func (r *SandboxReconciler) wireSharedEgress(ctx context.Context, sbx *v1alpha1.Sandbox, ep *v1alpha1.EgressProxy, pod *corev1.Pod) error {
	user, err := ensureEgressCredentials(ctx, r.Client, r.Scheme, ep, sbx)
	if err != nil {
		return err
	}
	svc, err := applySharedService(ctx, r.Client, r.Scheme, ep)
	if err != nil {
		return err
	}
	if svc.Spec.ClusterIP == "" || svc.Spec.ClusterIP == corev1.ClusterIPNone {
		return fmt.Errorf("proxy Service %s has no ClusterIP yet", svc.Name)
	}
	password := corev1.EnvVar{Name: egressPasswordEnv, ValueFrom: &corev1.EnvVarSource{SecretKeyRef: &corev1.SecretKeySelector{
		LocalObjectReference: corev1.LocalObjectReference{Name: EgressCredentialsSecretName(sbx.WorkloadName())},
		Key:                  egressPasswordKey,
	}}}
	setEgressEnv(pod, "http://"+user+":$("+egressPasswordEnv+")@"+net.JoinHostPort(svc.Spec.ClusterIP, strconv.Itoa(EgressProxyPort)), &password)
	return nil
}

// ensureEgressCredentials creates the sandbox's Shared-proxy credentials
// if they are missing and returns its user name. An existing password is
// never changed: running sandboxes hold it.
func ensureEgressCredentials(ctx context.Context, c client.Client, scheme *runtime.Scheme, ep *v1alpha1.EgressProxy, sbx *v1alpha1.Sandbox) (string, error) {
	user := sbx.WorkloadName()
	name := EgressCredentialsSecretName(user)
	var s corev1.Secret
	err := c.Get(ctx, types.NamespacedName{Namespace: sbx.Namespace, Name: name}, &s)
	if err == nil {
		if !metav1.IsControlledBy(&s, sbx) {
			return "", ownershipError(&s)
		}
		if s.Labels[labelEgressCredentials] != ep.Name {
			patch := client.MergeFrom(s.DeepCopy())
			s.Labels = mergeLabels(s.Labels, map[string]string{labelEgressCredentials: ep.Name})
			if err := c.Patch(ctx, &s, patch); err != nil {
				return "", fmt.Errorf("label proxy credentials %s: %w", name, err)
			}
		}
		return string(s.Data[egressUserKey]), nil
	}
	if !apierrors.IsNotFound(err) {
		return "", fmt.Errorf("get proxy credentials %s: %w", name, err)
	}
	pw := make([]byte, 24)
	if _, err := rand.Read(pw); err != nil {
		return "", fmt.Errorf("generate a proxy password: %w", err)
	}
	lbls := sandboxLabels(sbx)
	lbls[labelEgressCredentials] = ep.Name
	s = corev1.Secret{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: sbx.Namespace, Labels: lbls},
		Type:       corev1.SecretTypeOpaque,
		// Hex, so that it needs no escaping in a proxy URL.
		Data: map[string][]byte{egressUserKey: []byte(user), egressPasswordKey: []byte(hex.EncodeToString(pw))},
	}
	if err := controllerutil.SetControllerReference(sbx, &s, scheme); err != nil {
		return "", fmt.Errorf("set owner of %s: %w", name, err)
	}
	if err := c.Create(ctx, &s); err != nil {
		return "", fmt.Errorf("create proxy credentials %s: %w", name, err)
	}
	return user, nil
}

// errEgressProxyNotFound says the template's proxy is missing. It is not
// an apierrors NotFound, so that the caller does not take it for a
// missing node pool.
type errEgressProxyNotFound struct{ template, proxy string }

func (e *errEgressProxyNotFound) Error() string {
	return fmt.Sprintf("template %s names EgressProxy %s, which does not exist; the sandbox waits for it", e.template, e.proxy)
}

// templateEgressProxy returns the EgressProxy a template names, nil when it
// names none.
func templateEgressProxy(ctx context.Context, c client.Client, tpl *v1alpha1.SandboxTemplate) (*v1alpha1.EgressProxy, error) {
	if tpl == nil || tpl.Spec.EgressProxyRef == nil {
		return nil, nil
	}
	var ep v1alpha1.EgressProxy
	key := types.NamespacedName{Namespace: tpl.Namespace, Name: tpl.Spec.EgressProxyRef.Name}
	if err := c.Get(ctx, key, &ep); err != nil {
		if apierrors.IsNotFound(err) {
			return nil, &errEgressProxyNotFound{template: tpl.Name, proxy: key.Name}
		}
		return nil, fmt.Errorf("get EgressProxy %s: %w", key.Name, err)
	}
	return &ep, nil
}

// setEgressEnv puts the proxy variables on the pod's sandbox container,
// replacing the template's values of the same names: a template must not
// route around the proxy (the NetworkPolicy would drop it anyway).
// password, when not nil, is the variable proxyURL refers to with $(...).
func setEgressEnv(pod *corev1.Pod, proxyURL string, password *corev1.EnvVar) {
	for i := range pod.Spec.Containers {
		c := &pod.Spec.Containers[i]
		if c.Name != ContainerName {
			continue
		}
		drop := map[string]bool{egressPasswordEnv: true}
		for _, n := range egressEnvNames {
			drop[n] = true
		}
		env := c.Env[:0]
		for _, e := range c.Env {
			if !drop[e.Name] {
				env = append(env, e)
			}
		}
		// Before the variables that refer to it: $(VAR) expands only
		// variables defined earlier.
		if password != nil {
			env = append(env, *password)
		}
		for _, kv := range [][2]string{
			{"HTTP_PROXY", proxyURL}, {"HTTPS_PROXY", proxyURL}, {"NO_PROXY", egressNoProxy},
			{"http_proxy", proxyURL}, {"https_proxy", proxyURL}, {"no_proxy", egressNoProxy},
		} {
			env = append(env, corev1.EnvVar{Name: kv[0], Value: kv[1]})
		}
		c.Env = env
	}
}

// ownershipError is what applyOwned returns for an object of the right
// name that another owner (or nobody) controls: it is never adopted.
func ownershipError(obj client.Object) error {
	kind := fmt.Sprintf("%T", obj)
	owner := ""
	if ref := metav1.GetControllerOf(obj); ref != nil {
		owner = ref.Kind + "/" + ref.Name
	}
	return &ownershipConflictError{kind: kind[len("*v1."):], name: obj.GetName(), owner: owner}
}

// applyOwned creates obj as a child of owner, or, when it exists and owner
// controls it, applies mutate to it and updates it if that changed
// anything. An object of that name controlled by someone else is left
// alone and reported.
// applySharedService creates or corrects a Shared proxy's Service, which
// both the proxy's controller and the first sandbox to need it may create.
func applySharedService(ctx context.Context, c client.Client, scheme *runtime.Scheme, ep *v1alpha1.EgressProxy) (*corev1.Service, error) {
	want := desiredSharedService(ep)
	svc := &corev1.Service{ObjectMeta: metav1.ObjectMeta{Name: want.Name, Namespace: want.Namespace}}
	if err := applyOwned(ctx, c, scheme, ep, svc, func() {
		svc.Labels = mergeLabels(svc.Labels, want.Labels)
		svc.Spec.Type, svc.Spec.Selector, svc.Spec.Ports = want.Spec.Type, want.Spec.Selector, want.Spec.Ports
	}); err != nil {
		return nil, err
	}
	return svc, nil
}

func applyOwned(ctx context.Context, c client.Client, scheme *runtime.Scheme, owner, obj client.Object, mutate func()) error {
	_, err := controllerutil.CreateOrUpdate(ctx, c, obj, func() error {
		if obj.GetResourceVersion() != "" && !metav1.IsControlledBy(obj, owner) {
			return ownershipError(obj)
		}
		mutate()
		return controllerutil.SetControllerReference(owner, obj, scheme)
	})
	if err != nil {
		return fmt.Errorf("apply %T %s: %w", obj, obj.GetName(), err)
	}
	return nil
}

// applySandboxNetworkPolicy creates or corrects the sandbox's
// NetworkPolicy; ep is the template's proxy, nil for none.
func applySandboxNetworkPolicy(ctx context.Context, c client.Client, scheme *runtime.Scheme, sbx *v1alpha1.Sandbox, ep *v1alpha1.EgressProxy, platformNamespace string) error {
	want := desiredSandboxNetworkPolicy(sbx, ep, platformNamespace)
	np := &networkingv1.NetworkPolicy{ObjectMeta: metav1.ObjectMeta{Name: want.Name, Namespace: want.Namespace}}
	return applyOwned(ctx, c, scheme, sbx, np, func() {
		np.Labels = mergeLabels(np.Labels, want.Labels)
		np.Spec = want.Spec
	})
}

// applyPerAgentService creates or corrects the sandbox's proxy Service and
// returns it, with its ClusterIP.
func applyPerAgentService(ctx context.Context, c client.Client, scheme *runtime.Scheme, ep *v1alpha1.EgressProxy, sbx *v1alpha1.Sandbox) (*corev1.Service, error) {
	want := desiredPerAgentProxyService(ep, sbx)
	svc := &corev1.Service{ObjectMeta: metav1.ObjectMeta{Name: want.Name, Namespace: want.Namespace}}
	err := applyOwned(ctx, c, scheme, sbx, svc, func() {
		svc.Labels = mergeLabels(svc.Labels, want.Labels)
		// Only the fields the controller decides; the API server's
		// defaults (ClusterIP, families, session affinity) stay.
		svc.Spec.Type = want.Spec.Type
		svc.Spec.Selector = want.Spec.Selector
		svc.Spec.Ports = want.Spec.Ports
	})
	return svc, err
}

func mergeLabels(have, want map[string]string) map[string]string {
	if have == nil {
		have = map[string]string{}
	}
	for k, v := range want {
		have[k] = v
	}
	return have
}
