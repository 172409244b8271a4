package controller

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"sort"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/events"
	"k8s.io/utils/clock"
	"k8s.io/utils/ptr"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/controller/controllerutil"
	"sigs.k8s.io/controller-runtime/pkg/handler"
	logf "sigs.k8s.io/controller-runtime/pkg/log"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
)

// EgressProxyControllerName names the controller, and its events'
// reporter.
const EgressProxyControllerName = "agentbox-egressproxy"

// Event reasons of the EgressProxy controller.
const (
	EventProxyCreated           = "ProxyCreated"
	EventProxyAvailable         = "ProxyAvailable"
	EventUpstreamSecretNotFound = "UpstreamSecretNotFound"
	// EventCredentialSecretNotFound: a credential's Secret or key is missing.
	EventCredentialSecretNotFound = "CredentialSecretNotFound"
)

// annotationEgressPodHash, on a proxy pod, is the hash of the pod spec it
// was made from, with its startup annotations (egressPodAnnotations). Pod
// specs are immutable, so a pod whose hash differs from the current one (a
// new upstream, image, credentials Secret or destinations' CA bundle) is
// replaced. Policy changes and rotated credential values do not replace
// pods: they reach the proxy through its ConfigMap and Secret volumes,
// which it reloads.
const annotationEgressPodHash = v1alpha1.GroupName + "/egress-pod-hash"

// EgressProxyReconciler runs the proxies EgressProxies describe. In
// PerAgent mode each sandbox whose template names the proxy gets its own
// proxy pod and ClusterIP Service, owned by the Sandbox so that they go
// with it; the proxy's policy ConfigMap and its pods' NetworkPolicy are
// the EgressProxy's. It also keeps the NetworkPolicy of each of those
// sandboxes in line (the Sandbox controller creates it with the pod).
// In Shared mode it runs one Deployment and Service for all of them, and
// keeps the proxy's client credentials in step with the sandboxes'.
type EgressProxyReconciler struct {
	client.Client
	Scheme *runtime.Scheme
	// Recorder receives events; SetupWithManager fills it from the manager
	// when nil.
	Recorder events.EventRecorder
	// Namespace is the platform namespace, whose control plane pods may
	// reach the sandboxes' supervisors and scrape the proxies.
	Namespace string
	// Image is the proxy image; empty means DefaultEgressProxyImage.
	Image string
	// BaseDeniedCIDRs, when non-nil, replace the proxy's built-in denied
	// ranges (private, loopback, link-local, metadata); each EgressProxy's
	// deniedCIDRs are denied on top. Leave it nil in production; a test
	// cluster whose "internet" is its own pod network sets it.
	BaseDeniedCIDRs []string
	// RuntimeClassName of the proxy pods; empty runs them on the cluster's
	// default runtime. The proxy is platform code, not the agent's, so
	// gVisor is defence in depth here rather than a requirement.
	RuntimeClassName string
	// ClusterDomain is the cluster's DNS domain, by which an upstream may
	// be named as a Service; empty means DefaultClusterDomain.
	ClusterDomain string
	// Clock is the controller's notion of now; nil means the real clock.
	Clock clock.PassiveClock
	// Namespaces are the namespaces the platform serves; a proxy elsewhere
	// runs nothing and only gets the NamespaceNotServed condition. Empty
	// serves every namespace.
	Namespaces ServedNamespaces
}

// SetupWithManager registers the reconciler and its watches with mgr.
func (r *EgressProxyReconciler) SetupWithManager(mgr ctrl.Manager) error {
	if r.Namespace == "" {
		return errors.New("egress proxy controller: no platform namespace")
	}
	fillFromManager(mgr, EgressProxyControllerName, &r.Client, &r.Scheme, &r.Recorder)
	proxyOf := func(_ context.Context, o client.Object) []reconcile.Request {
		if name := o.GetLabels()[v1alpha1.LabelEgressProxy]; name != "" {
			return []reconcile.Request{{NamespacedName: types.NamespacedName{Namespace: o.GetNamespace(), Name: name}}}
		}
		return nil
	}
	return ctrl.NewControllerManagedBy(mgr).
		Named(EgressProxyControllerName).
		For(&v1alpha1.EgressProxy{}).
		Owns(&corev1.ConfigMap{}).
		Owns(&networkingv1.NetworkPolicy{}).
		Owns(&appsv1.Deployment{}).
		// Proxy pods and Services are the sandboxes' children; the label
		// leads back to the proxy.
		Watches(&corev1.Pod{}, handler.EnqueueRequestsFromMapFunc(proxyOf)).
		// A Service is also watched as some proxy's upstream, whose
		// selector and ports go into the proxy pods' NetworkPolicy.
		Watches(&corev1.Service{}, handler.EnqueueRequestsFromMapFunc(func(ctx context.Context, o client.Object) []reconcile.Request {
			return append(proxyOf(ctx, o), r.proxiesForUpstreamService(ctx, o)...)
		})).
		Watches(&v1alpha1.Sandbox{}, handler.EnqueueRequestsFromMapFunc(r.proxyForSandbox)).
		Watches(&v1alpha1.SandboxTemplate{}, handler.EnqueueRequestsFromMapFunc(proxyForTemplate)).
		Watches(&corev1.Secret{}, handler.EnqueueRequestsFromMapFunc(r.proxiesForSecret)).
		Complete(r)
}

func proxyForTemplate(_ context.Context, o client.Object) []reconcile.Request {
	tpl, ok := o.(*v1alpha1.SandboxTemplate)
	if !ok || tpl.Spec.EgressProxyRef == nil {
		return nil
	}
	return []reconcile.Request{{NamespacedName: types.NamespacedName{Namespace: tpl.Namespace, Name: tpl.Spec.EgressProxyRef.Name}}}
}

func (r *EgressProxyReconciler) proxyForSandbox(ctx context.Context, o client.Object) []reconcile.Request {
	var tpl v1alpha1.SandboxTemplate
	sbx := o.(*v1alpha1.Sandbox)
	if err := r.Get(ctx, types.NamespacedName{Namespace: sbx.Namespace, Name: sbx.Spec.TemplateRef.Name}, &tpl); err != nil {
		return nil
	}
	return proxyForTemplate(ctx, &tpl)
}

// proxiesForSecret wakes the proxies whose upstream credentials a Secret
// holds, so that a proxy waiting for its Secret starts when it appears.
func (r *EgressProxyReconciler) proxiesForSecret(ctx context.Context, o client.Object) []reconcile.Request {
	var list v1alpha1.EgressProxyList
	if err := r.List(ctx, &list, client.InNamespace(o.GetNamespace())); err != nil {
		logf.FromContext(ctx).Error(err, "list egress proxies", "namespace", o.GetNamespace())
		return nil
	}
	var reqs []reconcile.Request
	// A sandbox's Shared-proxy credentials, or the proxy's client list.
	for _, key := range []string{labelEgressCredentials, v1alpha1.LabelEgressProxy} {
		if name := o.GetLabels()[key]; name != "" {
			reqs = append(reqs, reconcile.Request{NamespacedName: types.NamespacedName{Namespace: o.GetNamespace(), Name: name}})
		}
	}
	for i := range list.Items {
		if up := list.Items[i].Spec.Upstream; up != nil && up.CredentialsSecretRef != nil && up.CredentialsSecretRef.Name == o.GetName() {
			reqs = append(reqs, reconcile.Request{NamespacedName: client.ObjectKeyFromObject(&list.Items[i])})
		}
		for _, c := range list.Items[i].Spec.Credentials {
			if c.SecretRef.Name == o.GetName() {
				reqs = append(reqs, reconcile.Request{NamespacedName: client.ObjectKeyFromObject(&list.Items[i])})
				break
			}
		}
	}
	return reqs
}

func (r *EgressProxyReconciler) image() string {
	if r.Image == "" {
		return DefaultEgressProxyImage
	}
	return r.Image
}

// Reconcile brings one EgressProxy's objects to what its spec asks and
// reports the ready endpoints. It creates only what is missing, updates
// only what differs and writes status only when it changed.
func (r *EgressProxyReconciler) Reconcile(ctx context.Context, req ctrl.Request) (ctrl.Result, error) {
	var ep v1alpha1.EgressProxy
	// Once it is deleted, owner references remove the ConfigMap and
	// NetworkPolicy; the sandboxes' proxies go with the sandboxes.
	if live, err := fetchLive(ctx, r, req, &ep); !live {
		return ctrl.Result{}, err
	}
	if !r.Namespaces.Serves(ep.Namespace) {
		return r.refuseNamespace(ctx, &ep)
	}
	base := ep.DeepCopy()
	ep.Status.ObservedGeneration = ep.Generation
	result, err := r.reconcileProxy(ctx, readyReasonOf(base.Status.Conditions), &ep)
	if cacheBehind(ctx, err) {
		return ctrl.Result{RequeueAfter: cacheRetry}, nil
	}
	if err != nil {
		r.setReady(&ep, metav1.ConditionFalse, v1alpha1.ReasonReconcileError, err.Error())
	}
	if serr := patchStatusIfChanged(ctx, r.Client, base, &ep, base.Status, ep.Status, "EgressProxy"); serr != nil {
		return ctrl.Result{}, errors.Join(err, serr)
	}
	return result, err
}

// refuseNamespace reports a proxy in a namespace the platform does not
// serve, once no other platform has taken it up (notServedNow). No policy,
// Secret check or proxy pod: none is allowed there.
func (r *EgressProxyReconciler) refuseNamespace(ctx context.Context, ep *v1alpha1.EgressProxy) (ctrl.Result, error) {
	if tell, wait := notServedNow(ep.CreationTimestamp, ep.Status.Conditions, nowOf(r.Clock)); !tell {
		return ctrl.Result{RequeueAfter: wait}, nil
	}
	base := ep.DeepCopy()
	ep.Status.ObservedGeneration = ep.Generation
	msg := r.Namespaces.notServedMessage("EgressProxy", ep.Namespace)
	ep.Status.ReadyEndpoints = nil
	r.setReady(ep, metav1.ConditionFalse, v1alpha1.ReasonNamespaceNotServed, msg)
	r.event(ep, nil, corev1.EventTypeWarning, EventNamespaceNotServed, "Wait", msg)
	return ctrl.Result{}, patchStatusIfChanged(ctx, r.Client, base, ep, base.Status, ep.Status, "EgressProxy")
}

// reconcileProxy runs a pass over the proxy: its policy objects, its
// upstream credentials Secret, and then the proxies of its sandboxes,
// PerAgent or Shared, with the status they come to.
func (r *EgressProxyReconciler) reconcileProxy(ctx context.Context, prevReason string, ep *v1alpha1.EgressProxy) (ctrl.Result, error) {
	if err := r.applyPolicy(ctx, ep); err != nil {
		return ctrl.Result{}, err
	}
	if msg, missing, err := r.checkUpstreamSecret(ctx, ep); err != nil {
		return ctrl.Result{}, err
	} else if missing {
		// Pods would hang in ContainerCreating on the missing volume; no
		// pod is made until the Secret exists (its watch wakes us).
		ep.Status.ReadyEndpoints = nil
		r.setReady(ep, metav1.ConditionFalse, v1alpha1.ReasonUpstreamSecretNotFound, msg)
		r.eventOnNewReason(prevReason, ep, corev1.EventTypeWarning, EventUpstreamSecretNotFound, "Wait", msg)
		return ctrl.Result{}, nil
	}
	if msg, missing, err := r.checkCredentialSecrets(ctx, ep); err != nil {
		return ctrl.Result{}, err
	} else if missing {
		ep.Status.ReadyEndpoints = nil
		r.setReady(ep, metav1.ConditionFalse, v1alpha1.ReasonCredentialSecretNotFound, msg)
		r.eventOnNewReason(prevReason, ep, corev1.EventTypeWarning, EventCredentialSecretNotFound, "Wait", msg)
		return ctrl.Result{}, nil
	}
	if hasCredentials(ep) {
		if err := ensureEgressCA(ctx, r.Client, r.Scheme, ep); err != nil {
			return ctrl.Result{}, err
		}
	}

	sandboxes, err := r.sandboxesOf(ctx, ep)
	if err != nil {
		return ctrl.Result{}, err
	}
	if proxyMode(ep) == v1alpha1.EgressProxyModeShared {
		return ctrl.Result{}, r.reconcileShared(ctx, prevReason, ep, sandboxes)
	}
	return ctrl.Result{}, r.reconcilePerAgentProxies(ctx, prevReason, ep, sandboxes)
}

// applyPolicy creates or corrects the proxy's policy ConfigMap and the
// NetworkPolicy of its pods.
func (r *EgressProxyReconciler) applyPolicy(ctx context.Context, ep *v1alpha1.EgressProxy) error {
	cm, err := desiredEgressConfigMap(ep)
	if err != nil {
		return err
	}
	have := &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: cm.Name, Namespace: cm.Namespace}}
	if err := applyOwned(ctx, r.Client, r.Scheme, ep, have, func() {
		have.Labels = mergeLabels(have.Labels, cm.Labels)
		have.Data = cm.Data
	}); err != nil {
		return err
	}
	upstreamRule, err := r.upstreamRule(ctx, ep)
	if err != nil {
		return err
	}
	wantNP := desiredProxyNetworkPolicy(ep, r.Namespace, upstreamRule)
	np := &networkingv1.NetworkPolicy{ObjectMeta: metav1.ObjectMeta{Name: wantNP.Name, Namespace: wantNP.Namespace}}
	return applyOwned(ctx, r.Client, r.Scheme, ep, np, func() {
		np.Labels = mergeLabels(np.Labels, wantNP.Labels)
		np.Spec = wantNP.Spec
	})
}

// reconcilePerAgentProxies runs a PerAgent proxy: a proxy of each sandbox
// of its own, and the ready endpoints and Ready condition from them.
func (r *EgressProxyReconciler) reconcilePerAgentProxies(ctx context.Context, prevReason string, ep *v1alpha1.EgressProxy, sandboxes []v1alpha1.Sandbox) error {
	var ready []string
	var waiting []string
	for i := range sandboxes {
		sbx := &sandboxes[i]
		ok, err := r.reconcilePerAgent(ctx, ep, sbx)
		var conflict *ownershipConflictError
		if errors.As(err, &conflict) {
			// One sandbox's foreign object must not hold up the others.
			waiting = append(waiting, conflict.Error())
			continue
		}
		if err != nil {
			return err
		}
		if ok {
			ready = append(ready, egressProxyEndpoint(EgressServiceName(sbx.WorkloadName()), sbx.Namespace))
		} else {
			waiting = append(waiting, EgressServiceName(sbx.WorkloadName()))
		}
	}
	sort.Strings(ready)
	ep.Status.ReadyEndpoints = ready
	switch {
	case len(waiting) > 0:
		sort.Strings(waiting)
		r.setReady(ep, metav1.ConditionFalse, v1alpha1.ReasonProxyProgressing,
			fmt.Sprintf("%d of %d sandbox proxies ready; waiting for %v", len(ready), len(sandboxes), waiting))
	case len(sandboxes) == 0:
		r.setReady(ep, metav1.ConditionTrue, v1alpha1.ReasonProxyAvailable,
			"no sandbox uses this proxy yet; each sandbox of a template naming it gets its own proxy")
	default:
		msg := fmt.Sprintf("all %d sandbox proxies are ready", len(ready))
		r.setReady(ep, metav1.ConditionTrue, v1alpha1.ReasonProxyAvailable, msg)
		r.eventOnNewReason(prevReason, ep, corev1.EventTypeNormal, EventProxyAvailable, "Ready", msg)
	}
	return nil
}

// upstreamRule is the proxy pods' egress rule to an in-cluster upstream,
// looking up the Service the upstream's host names, if it names one.
func (r *EgressProxyReconciler) upstreamRule(ctx context.Context, ep *v1alpha1.EgressProxy) (*networkingv1.NetworkPolicyEgressRule, error) {
	if ep.Spec.Upstream == nil {
		return nil, nil
	}
	host, _, err := upstreamHostPort(ep.Spec.Upstream)
	if err != nil {
		return nil, err
	}
	var svc *corev1.Service
	if key, ok := upstreamServiceKey(host, ep.Namespace, r.ClusterDomain); ok {
		var s corev1.Service
		switch err := r.Get(ctx, key, &s); {
		case err == nil:
			svc = &s
		case apierrors.IsNotFound(err):
			// A name outside the cluster, or a Service still to come (its
			// watch brings us back); the default rule covers public names.
		default:
			return nil, fmt.Errorf("get upstream Service %s: %w", key, err)
		}
	}
	return upstreamEgressRule(ep, svc)
}

// proxiesForUpstreamService wakes the proxies whose upstream a Service
// is, so that their NetworkPolicy follows its selector and ports.
func (r *EgressProxyReconciler) proxiesForUpstreamService(ctx context.Context, o client.Object) []reconcile.Request {
	var list v1alpha1.EgressProxyList
	if err := r.List(ctx, &list); err != nil {
		logf.FromContext(ctx).Error(err, "list egress proxies")
		return nil
	}
	var reqs []reconcile.Request
	for i := range list.Items {
		ep := &list.Items[i]
		if ep.Spec.Upstream == nil {
			continue
		}
		host, _, err := upstreamHostPort(ep.Spec.Upstream)
		if err != nil {
			continue
		}
		if key, ok := upstreamServiceKey(host, ep.Namespace, r.ClusterDomain); ok && key.Name == o.GetName() && key.Namespace == o.GetNamespace() {
			reqs = append(reqs, reconcile.Request{NamespacedName: client.ObjectKeyFromObject(ep)})
		}
	}
	return reqs
}

// checkUpstreamSecret reports, with a message, when the upstream
// credentials Secret or its key is missing.
func (r *EgressProxyReconciler) checkUpstreamSecret(ctx context.Context, ep *v1alpha1.EgressProxy) (string, bool, error) {
	if ep.Spec.Upstream == nil || ep.Spec.Upstream.CredentialsSecretRef == nil {
		return "", false, nil
	}
	ref := ep.Spec.Upstream.CredentialsSecretRef
	var s corev1.Secret
	if err := r.Get(ctx, types.NamespacedName{Namespace: ep.Namespace, Name: ref.Name}, &s); err != nil {
		if apierrors.IsNotFound(err) {
			return fmt.Sprintf("Secret %s named in spec.upstream.credentialsSecretRef does not exist; the proxies start when it does", ref.Name), true, nil
		}
		return "", false, fmt.Errorf("get upstream credentials Secret %s: %w", ref.Name, err)
	}
	if _, ok := s.Data[ref.Key]; !ok {
		return fmt.Sprintf("Secret %s has no key %q named in spec.upstream.credentialsSecretRef", ref.Name, ref.Key), true, nil
	}
	return "", false, nil
}

// sandboxesOf lists the live sandboxes whose template names ep. A warm
// sandbox being adopted is left out: its children are moving.
func (r *EgressProxyReconciler) sandboxesOf(ctx context.Context, ep *v1alpha1.EgressProxy) ([]v1alpha1.Sandbox, error) {
	var tpls v1alpha1.SandboxTemplateList
	if err := r.List(ctx, &tpls, client.InNamespace(ep.Namespace)); err != nil {
		return nil, fmt.Errorf("list sandbox templates: %w", err)
	}
	uses := map[string]bool{}
	for _, t := range tpls.Items {
		if t.Spec.EgressProxyRef != nil && t.Spec.EgressProxyRef.Name == ep.Name {
			uses[t.Name] = true
		}
	}
	if len(uses) == 0 {
		return nil, nil
	}
	var list v1alpha1.SandboxList
	if err := r.List(ctx, &list, client.InNamespace(ep.Namespace)); err != nil {
		return nil, fmt.Errorf("list sandboxes: %w", err)
	}
	var out []v1alpha1.Sandbox
	for _, s := range list.Items {
		if uses[s.Spec.TemplateRef.Name] && s.DeletionTimestamp.IsZero() && s.Annotations[v1alpha1.AnnotationAdoptedBy] == "" {
			out = append(out, s)
		}
	}
	return out, nil
}

// reconcilePerAgent ensures one sandbox's proxy Service, pod and
// NetworkPolicy, and reports whether its proxy pod is ready.
func (r *EgressProxyReconciler) reconcilePerAgent(ctx context.Context, ep *v1alpha1.EgressProxy, sbx *v1alpha1.Sandbox) (bool, error) {
	if err := applySandboxNetworkPolicy(ctx, r.Client, r.Scheme, sbx, ep, r.Namespace); err != nil {
		return false, err
	}
	if _, err := applyPerAgentService(ctx, r.Client, r.Scheme, ep, sbx); err != nil {
		return false, err
	}
	want := desiredPerAgentProxyPod(ep, sbx, egressPodOptions{image: r.image(), baseDeniedCIDRs: r.BaseDeniedCIDRs, runtimeClass: r.RuntimeClassName})
	hash, err := podHash(&want.Spec, want.Annotations)
	if err != nil {
		return false, err
	}
	want.Annotations = mergeLabels(want.Annotations, map[string]string{annotationEgressPodHash: hash})

	var pod corev1.Pod
	err = r.Get(ctx, client.ObjectKeyFromObject(want), &pod)
	switch {
	case apierrors.IsNotFound(err):
		if err := controllerutil.SetControllerReference(sbx, want, r.Scheme); err != nil {
			return false, fmt.Errorf("set owner of %s: %w", want.Name, err)
		}
		if err := r.Create(ctx, want); err != nil {
			return false, fmt.Errorf("create proxy pod %s: %w", want.Name, err)
		}
		r.event(ep, want, corev1.EventTypeNormal, EventProxyCreated, "Create",
			fmt.Sprintf("created proxy pod %s for sandbox %s", want.Name, sbx.Name))
		return false, nil
	case err != nil:
		return false, fmt.Errorf("get proxy pod %s: %w", want.Name, err)
	}
	if !pod.DeletionTimestamp.IsZero() {
		// Going, whoever owns it: an adopted warm sandbox's proxy pod
		// is deleted rather than moved, and its successor takes the name.
		return false, nil
	}
	if !metav1.IsControlledBy(&pod, sbx) {
		return false, ownershipError(&pod)
	}
	if pod.Annotations[annotationEgressPodHash] != hash || pod.Status.Phase == corev1.PodFailed || pod.Status.Phase == corev1.PodSucceeded {
		// Replaced rather than patched: a pod's spec is immutable. The
		// Service keeps its address, so the sandbox needs no restart.
		if err := r.Delete(ctx, &pod, client.Preconditions{UID: &pod.UID}); err != nil && !apierrors.IsNotFound(err) && !apierrors.IsConflict(err) {
			return false, fmt.Errorf("replace proxy pod %s: %w", pod.Name, err)
		}
		return false, nil
	}
	return podReady(&pod), nil
}

// podHash is the first 16 hex digits of the SHA-256 of spec's JSON
// followed by the annotations, sorted. Without annotations it is the
// spec's hash alone, so pods made before annotations counted keep their
// hash and are not replaced by an upgrade.
func podHash(spec *corev1.PodSpec, annotations map[string]string) (string, error) {
	b, err := json.Marshal(spec)
	if err != nil {
		return "", fmt.Errorf("hash proxy pod spec: %w", err)
	}
	h := sha256.New()
	h.Write(b)
	keys := make([]string, 0, len(annotations))
	for k := range annotations {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		fmt.Fprintf(h, "\x00%s=%s", k, annotations[k])
	}
	return hex.EncodeToString(h.Sum(nil)[:8]), nil
}

func (r *EgressProxyReconciler) setReady(ep *v1alpha1.EgressProxy, status metav1.ConditionStatus, reason, msg string) {
	setCondition(&ep.Status.Conditions, v1alpha1.ConditionReady, ep.Generation, nowOf(r.Clock), status, reason, msg)
}

// eventOnNewReason records an event only when the Ready reason has just
// changed from prevReason (see readyReasonIsNew). Call it after setReady.
func (r *EgressProxyReconciler) eventOnNewReason(prevReason string, ep *v1alpha1.EgressProxy, eventType, reason, action, note string) {
	if readyReasonIsNew(ep.Status.Conditions, prevReason) {
		r.event(ep, nil, eventType, reason, action, note)
	}
}

func (r *EgressProxyReconciler) event(ep *v1alpha1.EgressProxy, related runtime.Object, eventType, reason, action, note string) {
	recordEvent(r.Recorder, ep, related, eventType, reason, action, note)
}

// reconcileShared runs a Shared proxy: the client credentials Secret
// gathered from the sandboxes' own, the Deployment and the Service, and
// each sandbox's NetworkPolicy.
func (r *EgressProxyReconciler) reconcileShared(ctx context.Context, prevReason string, ep *v1alpha1.EgressProxy, sandboxes []v1alpha1.Sandbox) error {
	for i := range sandboxes {
		if err := applySandboxNetworkPolicy(ctx, r.Client, r.Scheme, &sandboxes[i], ep, r.Namespace); err != nil {
			return err
		}
	}
	var creds corev1.SecretList
	if err := r.List(ctx, &creds, client.InNamespace(ep.Namespace), client.MatchingLabels{labelEgressCredentials: ep.Name}); err != nil {
		return fmt.Errorf("list proxy credentials: %w", err)
	}
	// Only the credentials of sandboxes that use the proxy now: a sandbox
	// moved to another template loses its access here.
	live := map[string]bool{}
	for _, s := range sandboxes {
		live[s.Name] = true
	}
	var inUse []corev1.Secret
	for _, s := range creds.Items {
		if live[s.Labels[v1alpha1.LabelSandbox]] {
			inUse = append(inUse, s)
		}
	}
	clients := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: egressClientsSecretName(ep.Name), Namespace: ep.Namespace}}
	data := egressClientsData(inUse)
	if err := applyOwned(ctx, r.Client, r.Scheme, ep, clients, func() {
		clients.Labels = mergeLabels(clients.Labels, map[string]string{v1alpha1.LabelEgressProxy: ep.Name})
		clients.Data = map[string][]byte{egressClientsKey: data}
	}); err != nil {
		return err
	}

	want, err := desiredSharedDeployment(ep, egressPodOptions{image: r.image(), baseDeniedCIDRs: r.BaseDeniedCIDRs, runtimeClass: r.RuntimeClassName})
	if err != nil {
		return err
	}
	dep := &appsv1.Deployment{ObjectMeta: metav1.ObjectMeta{Name: want.Name, Namespace: want.Namespace}}
	if err := applyOwned(ctx, r.Client, r.Scheme, ep, dep, func() {
		dep.Labels = mergeLabels(dep.Labels, want.Labels)
		dep.Spec.Replicas = want.Spec.Replicas
		if dep.Spec.Selector == nil {
			dep.Spec.Selector = want.Spec.Selector // immutable once set
		}
		if dep.Annotations[annotationEgressTemplateHash] != want.Annotations[annotationEgressTemplateHash] {
			dep.Annotations = mergeLabels(dep.Annotations, want.Annotations)
			dep.Spec.Template = want.Spec.Template
		}
	}); err != nil {
		return err
	}
	svc, err := applySharedService(ctx, r.Client, r.Scheme, ep)
	if err != nil {
		return err
	}

	replicas := ptr.Deref(want.Spec.Replicas, 1)
	ready := dep.Status.ReadyReplicas
	rolledOut := dep.Status.ObservedGeneration >= dep.Generation && dep.Status.UpdatedReplicas >= replicas
	ep.Status.ReadyEndpoints = nil
	if ready > 0 {
		ep.Status.ReadyEndpoints = []string{egressProxyEndpoint(svc.Name, svc.Namespace)}
	}
	if ready >= replicas && rolledOut {
		msg := fmt.Sprintf("%d of %d proxy replicas ready, serving %d sandboxes", ready, replicas, len(sandboxes))
		r.setReady(ep, metav1.ConditionTrue, v1alpha1.ReasonProxyAvailable, msg)
		r.eventOnNewReason(prevReason, ep, corev1.EventTypeNormal, EventProxyAvailable, "Ready", msg)
		return nil
	}
	r.setReady(ep, metav1.ConditionFalse, v1alpha1.ReasonProxyProgressing,
		fmt.Sprintf("%d of %d proxy replicas ready in Deployment %s", ready, replicas, dep.Name))
	return nil
}
