package controller

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	k8sruntime "k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/intstr"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/tools/events"
	clocktesting "k8s.io/utils/clock/testing"
	"k8s.io/utils/ptr"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/client/fake"
	"sigs.k8s.io/controller-runtime/pkg/client/interceptor"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	"github.com/agentbox/terraform-provider-agentbox/internal/egressproxy"
	"github.com/agentbox/terraform-provider-agentbox/internal/pki"
)

// These tests check the objects the EgressProxy controller and the sandbox
// wiring produce, with the fake client. The NetworkPolicies in particular
// are checked here as objects, and against the labels of the pods they are
// meant to select: the local test cluster does not enforce NetworkPolicy,
// so no test can show them dropping traffic.

const fakeClusterIP = "10.96.0.42"

type egressEnv struct {
	t   *testing.T
	c   client.Client
	r   *EgressProxyReconciler
	sr  *SandboxReconciler
	rec *events.FakeRecorder
}

func newEgressEnv(t *testing.T, objs ...client.Object) *egressEnv {
	t.Helper()
	scheme := k8sruntime.NewScheme()
	must(t, clientgoscheme.AddToScheme(scheme))
	must(t, v1alpha1.AddToScheme(scheme))
	c := fake.NewClientBuilder().WithScheme(scheme).
		WithStatusSubresource(&v1alpha1.Sandbox{}, &v1alpha1.EgressProxy{}, &corev1.Pod{}).
		WithObjects(objs...).WithIndex(&v1alpha1.Sandbox{}, agentIDIndex, indexAgentID).
		// The API server allocates a Service's ClusterIP on create; the
		// fake does not.
		WithInterceptorFuncs(interceptor.Funcs{Create: func(ctx context.Context, c client.WithWatch, obj client.Object, opts ...client.CreateOption) error {
			if svc, ok := obj.(*corev1.Service); ok && svc.Spec.ClusterIP == "" {
				svc.Spec.ClusterIP = fakeClusterIP
			}
			return c.Create(ctx, obj, opts...)
		}}).Build()
	clk := clocktesting.NewFakeClock(time.Now())
	rec := events.NewFakeRecorder(100)
	ca, err := pki.NewCA("unit CA")
	must(t, err)
	return &egressEnv{
		t: t, c: c, rec: rec,
		r: &EgressProxyReconciler{Client: c, Scheme: scheme, Recorder: rec, Namespace: "agentbox-system",
			Image: "agentbox/agentbox-egress-proxy:test", Clock: clk},
		sr: &SandboxReconciler{Client: c, Scheme: scheme, Recorder: rec, Namespace: "agentbox-system",
			DefaultImage: "agentbox/agentbox-sandbox:dev", CA: ca, Clock: clk},
	}
}

func (e *egressEnv) reconcileProxy(name string) {
	e.t.Helper()
	if _, err := e.r.Reconcile(context.Background(), ctrl.Request{NamespacedName: types.NamespacedName{Namespace: unitNS, Name: name}}); err != nil {
		e.t.Fatalf("reconcile EgressProxy %s: %v", name, err)
	}
}

func (e *egressEnv) get(name string, obj client.Object) {
	e.t.Helper()
	must(e.t, e.c.Get(context.Background(), types.NamespacedName{Namespace: unitNS, Name: name}, obj))
}

func (e *egressEnv) proxyReady(name string) (*v1alpha1.EgressProxy, *metav1.Condition) {
	e.t.Helper()
	var ep v1alpha1.EgressProxy
	e.get(name, &ep)
	c := meta.FindStatusCondition(ep.Status.Conditions, v1alpha1.ConditionReady)
	if c == nil {
		e.t.Fatalf("EgressProxy %s has no Ready condition", name)
	}
	return &ep, c
}

func unitEgressProxy(name string) *v1alpha1.EgressProxy {
	return &v1alpha1.EgressProxy{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: unitNS, UID: types.UID("uid-" + name), Generation: 1},
		Spec: v1alpha1.EgressProxySpec{
			Mode:           v1alpha1.EgressProxyModePerAgent,
			AllowedDomains: []v1alpha1.Domain{"pypi.org", "*.pythonhosted.org"},
			DeniedDomains:  []v1alpha1.Domain{"evil.pythonhosted.org"},
			DeniedCIDRs:    []v1alpha1.CIDR{"203.0.113.0/24"},
			Upstream: &v1alpha1.EgressUpstream{
				URL:                  "http://upstream.corp.test:8080",
				CredentialsSecretRef: &v1alpha1.SecretKeySelector{Name: "upstream-creds", Key: "userpass"},
			},
		},
	}
}

func upstreamSecret() *corev1.Secret {
	return &corev1.Secret{
		ObjectMeta: metav1.ObjectMeta{Name: "upstream-creds", Namespace: unitNS},
		Data:       map[string][]byte{"userpass": []byte("corp:s3cret")},
	}
}

func proxiedTemplate(name, proxy string) *v1alpha1.SandboxTemplate {
	tpl := unitTemplate(name)
	tpl.Spec.EgressProxyRef = &v1alpha1.LocalObjectReference{Name: proxy}
	// A template's own proxy settings lose to the platform's.
	tpl.Spec.Env = []corev1.EnvVar{{Name: "HTTP_PROXY", Value: "http://elsewhere:1"}, {Name: "KEEP", Value: "1"}}
	return tpl
}

func selects(t *testing.T, sel *metav1.LabelSelector, lbls map[string]string) bool {
	t.Helper()
	s, err := metav1.LabelSelectorAsSelector(sel)
	must(t, err)
	return s.Matches(labels.Set(lbls))
}

func TestUnitEgressPerAgentObjects(t *testing.T) {
	e := newEgressEnv(t, unitEgressProxy("egress"), upstreamSecret(), proxiedTemplate("t", "egress"), unitSandbox("s", "t"))
	ctx := context.Background()

	// The sandbox controller creates the sandbox's pod with the proxy
	// variables, its Service and its NetworkPolicy.
	if _, err := e.sr.Reconcile(ctx, ctrl.Request{NamespacedName: types.NamespacedName{Namespace: unitNS, Name: "s"}}); err != nil {
		t.Fatal(err)
	}
	var sbxPod corev1.Pod
	e.get(PodName("s"), &sbxPod)
	env := map[string]string{}
	for _, v := range sbxPod.Spec.Containers[0].Env {
		if _, dup := env[v.Name]; dup {
			t.Errorf("%s set twice", v.Name)
		}
		env[v.Name] = v.Value
		// The downward API (the memory limit) is fine; a Secret would put
		// credentials within reach of the sandboxed code.
		if f := v.ValueFrom; f != nil && (f.SecretKeyRef != nil || f.ConfigMapKeyRef != nil) {
			t.Errorf("sandbox env %s takes its value from %+v", v.Name, v.ValueFrom)
		}
	}
	wantURL := "http://" + fakeClusterIP + ":3128"
	for _, n := range []string{"HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"} {
		if env[n] != wantURL {
			t.Errorf("%s = %q, want %q", n, env[n], wantURL)
		}
	}
	if env["NO_PROXY"] != egressNoProxy || env["no_proxy"] != egressNoProxy || env["KEEP"] != "1" {
		t.Errorf("NO_PROXY %q, no_proxy %q, KEEP %q", env["NO_PROXY"], env["no_proxy"], env["KEEP"])
	}
	// The upstream credentials never reach the sandbox.
	for _, v := range sbxPod.Spec.Volumes {
		if v.Secret != nil && v.Secret.SecretName == "upstream-creds" {
			t.Error("the sandbox pod mounts the upstream credentials")
		}
	}

	e.reconcileProxy("egress")

	// The policy ConfigMap parses with the proxy's own parser and holds the
	// spec's lists.
	var cm corev1.ConfigMap
	e.get(egressConfigMapName("egress"), &cm)
	fc, err := egressproxy.ParseFileConfig([]byte(cm.Data[egressPolicyKey]))
	if err != nil {
		t.Fatalf("policy file: %v", err)
	}
	if !slices.Equal(fc.AllowedDomains, []string{"*.pythonhosted.org", "pypi.org"}) ||
		!slices.Equal(fc.DeniedDomains, []string{"evil.pythonhosted.org"}) || !slices.Equal(fc.DeniedCIDRs, []string{"203.0.113.0/24"}) {
		t.Errorf("policy file %+v", fc)
	}

	var pod corev1.Pod
	e.get(EgressServiceName("s"), &pod)
	var sbx v1alpha1.Sandbox
	e.get("s", &sbx)
	if !metav1.IsControlledBy(&pod, &sbx) {
		t.Error("the proxy pod is not controlled by its Sandbox")
	}
	checkProxyPod(t, &pod)

	var svc corev1.Service
	e.get(EgressServiceName("s"), &svc)
	if !metav1.IsControlledBy(&svc, &sbx) || svc.Spec.Type != corev1.ServiceTypeClusterIP {
		t.Errorf("Service owner %v type %s", svc.OwnerReferences, svc.Spec.Type)
	}
	if !selects(t, &metav1.LabelSelector{MatchLabels: svc.Spec.Selector}, pod.Labels) ||
		selects(t, &metav1.LabelSelector{MatchLabels: svc.Spec.Selector}, sbxPod.Labels) {
		t.Errorf("Service selector %v must pick the proxy pod %v and not the sandbox %v", svc.Spec.Selector, pod.Labels, sbxPod.Labels)
	}
	if len(svc.Spec.Ports) != 1 || svc.Spec.Ports[0].Port != EgressProxyPort {
		t.Errorf("Service ports %+v", svc.Spec.Ports)
	}

	checkSandboxPolicy(t, e, &sbx, &sbxPod, &pod)
	checkProxyPolicy(t, e, &pod, &sbxPod)

	// Not ready yet: Progressing, no endpoints.
	ep, c := e.proxyReady("egress")
	if c.Status != metav1.ConditionFalse || c.Reason != v1alpha1.ReasonProxyProgressing || len(ep.Status.ReadyEndpoints) != 0 {
		t.Errorf("before the pod is ready: Ready %s/%s %q, endpoints %v", c.Status, c.Reason, c.Message, ep.Status.ReadyEndpoints)
	}
	pod.Status.Phase = corev1.PodRunning
	pod.Status.Conditions = []corev1.PodCondition{{Type: corev1.PodReady, Status: corev1.ConditionTrue}}
	must(t, e.c.Status().Update(ctx, &pod))
	e.reconcileProxy("egress")
	ep, c = e.proxyReady("egress")
	want := "http://s-egress." + unitNS + ".svc:3128"
	if c.Status != metav1.ConditionTrue || c.Reason != v1alpha1.ReasonProxyAvailable || !slices.Equal(ep.Status.ReadyEndpoints, []string{want}) {
		t.Errorf("ready pod: Ready %s/%s, endpoints %v, want [%s]", c.Status, c.Reason, ep.Status.ReadyEndpoints, want)
	}
	if ep.Status.ObservedGeneration != 1 {
		t.Errorf("observedGeneration %d", ep.Status.ObservedGeneration)
	}

	// Settled: another pass writes nothing.
	rv := ep.ResourceVersion
	e.reconcileProxy("egress")
	if ep, _ = e.proxyReady("egress"); ep.ResourceVersion != rv {
		t.Error("a settled proxy's status was rewritten")
	}
}

func checkProxyPod(t *testing.T, pod *corev1.Pod) {
	t.Helper()
	spec := pod.Spec
	if len(spec.Containers) != 1 {
		t.Fatalf("%d containers", len(spec.Containers))
	}
	ctr := spec.Containers[0]
	if ctr.Image != "agentbox/agentbox-egress-proxy:test" {
		t.Errorf("image %q", ctr.Image)
	}
	// Restricted Pod Security.
	sc := ctr.SecurityContext
	if sc == nil || !*sc.RunAsNonRoot || *sc.AllowPrivilegeEscalation || !*sc.ReadOnlyRootFilesystem ||
		len(sc.Capabilities.Drop) != 1 || sc.Capabilities.Drop[0] != "ALL" || sc.SeccompProfile.Type != corev1.SeccompProfileTypeRuntimeDefault {
		t.Errorf("container security context %+v", sc)
	}
	if *spec.AutomountServiceAccountToken || *spec.EnableServiceLinks || !*spec.SecurityContext.RunAsNonRoot {
		t.Error("the proxy pod gets an API token, service links or may run as root")
	}
	args := strings.Join(ctr.Args, " ")
	for _, want := range []string{
		"-listen=:3128", "-config=" + egressConfigDir + "/" + egressPolicyKey, "-upstream=http://upstream.corp.test:8080",
		"-upstream-credentials-file=" + egressUpstreamDir + "/credentials", "-agent=agent-s",
	} {
		if !slices.Contains(ctr.Args, want) {
			t.Errorf("args %q lack %q", args, want)
		}
	}
	if strings.Contains(args, "s3cret") {
		t.Error("the credentials are on the command line")
	}
	for _, v := range ctr.Env {
		if v.ValueFrom != nil && v.ValueFrom.SecretKeyRef != nil {
			t.Errorf("env %s comes from a Secret; credentials belong in a file", v.Name)
		}
	}
	// The credentials Secret's key is mounted as the file the flag names,
	// whatever the key is called; the policy ConfigMap beside it.
	mounts := map[string]string{}
	for _, m := range ctr.VolumeMounts {
		if !m.ReadOnly {
			t.Errorf("mount %s is writable", m.Name)
		}
		mounts[m.Name] = m.MountPath
	}
	var sawSecret, sawConfig bool
	for _, v := range spec.Volumes {
		switch {
		case v.Secret != nil:
			sawSecret = v.Secret.SecretName == "upstream-creds" && len(v.Secret.Items) == 1 &&
				v.Secret.Items[0] == (corev1.KeyToPath{Key: "userpass", Path: "credentials"}) && mounts[v.Name] == egressUpstreamDir
		case v.ConfigMap != nil:
			sawConfig = v.ConfigMap.Name == egressConfigMapName("egress") && mounts[v.Name] == egressConfigDir
		}
	}
	if !sawSecret || !sawConfig {
		t.Errorf("volumes %+v, mounts %v", spec.Volumes, mounts)
	}
	if pod.Annotations[annotationEgressPodHash] == "" {
		t.Error("no spec hash on the proxy pod")
	}
}

func checkSandboxPolicy(t *testing.T, e *egressEnv, sbx *v1alpha1.Sandbox, sbxPod, proxyPod *corev1.Pod) {
	t.Helper()
	var np networkingv1.NetworkPolicy
	e.get(SandboxNetworkPolicyName("s"), &np)
	if !metav1.IsControlledBy(&np, sbx) {
		t.Error("the sandbox's NetworkPolicy is not controlled by the Sandbox")
	}
	if !selects(t, &np.Spec.PodSelector, sbxPod.Labels) || selects(t, &np.Spec.PodSelector, proxyPod.Labels) {
		t.Errorf("selector %+v must pick the sandbox pod and not its proxy", np.Spec.PodSelector)
	}
	if !slices.Equal(np.Spec.PolicyTypes, []networkingv1.PolicyType{networkingv1.PolicyTypeIngress, networkingv1.PolicyTypeEgress}) {
		t.Errorf("policy types %v", np.Spec.PolicyTypes)
	}
	// Ingress: only the control plane, only on the supervisor port.
	if len(np.Spec.Ingress) != 1 || len(np.Spec.Ingress[0].From) != 1 || len(np.Spec.Ingress[0].Ports) != 1 ||
		np.Spec.Ingress[0].Ports[0].Port.IntValue() != v1alpha1.SupervisorPort {
		t.Fatalf("ingress %+v", np.Spec.Ingress)
	}
	from := np.Spec.Ingress[0].From[0]
	if !selects(t, from.NamespaceSelector, map[string]string{"kubernetes.io/metadata.name": "agentbox-system"}) ||
		selects(t, from.NamespaceSelector, map[string]string{"kubernetes.io/metadata.name": unitNS}) ||
		!selects(t, from.PodSelector, map[string]string{"app.kubernetes.io/component": "controlplane"}) {
		t.Errorf("ingress peer %+v", from)
	}
	// Egress: DNS on 53 UDP and TCP, and the proxy pod on its port; no
	// ipBlock anywhere.
	var dns, proxy bool
	for _, rule := range np.Spec.Egress {
		for _, peer := range rule.To {
			if peer.IPBlock != nil {
				t.Errorf("egress to ipBlock %+v", peer.IPBlock)
			}
			if peer.NamespaceSelector == nil && selects(t, peer.PodSelector, proxyPod.Labels) {
				proxy = len(rule.Ports) == 1 && rule.Ports[0].Port.IntValue() == EgressProxyPort
				other := map[string]string{v1alpha1.LabelEgressProxy: "egress", v1alpha1.LabelSandbox: "other"}
				if selects(t, peer.PodSelector, other) {
					t.Error("the sandbox may reach another sandbox's proxy")
				}
			}
			if peer.NamespaceSelector != nil && selects(t, peer.NamespaceSelector, map[string]string{"kubernetes.io/metadata.name": "kube-system"}) &&
				selects(t, peer.PodSelector, map[string]string{"k8s-app": "kube-dns"}) {
				var udp, tcp bool
				for _, p := range rule.Ports {
					udp = udp || (p.Port.IntValue() == 53 && *p.Protocol == corev1.ProtocolUDP)
					tcp = tcp || (p.Port.IntValue() == 53 && *p.Protocol == corev1.ProtocolTCP)
				}
				dns = udp && tcp && len(rule.Ports) == 2
			}
		}
	}
	if !dns || !proxy || len(np.Spec.Egress) != 2 {
		t.Errorf("egress %+v: dns %v, proxy %v", np.Spec.Egress, dns, proxy)
	}
}

func checkProxyPolicy(t *testing.T, e *egressEnv, proxyPod, sbxPod *corev1.Pod) {
	t.Helper()
	var np networkingv1.NetworkPolicy
	e.get(egressProxyNetworkPolicyName("egress"), &np)
	if !selects(t, &np.Spec.PodSelector, proxyPod.Labels) || selects(t, &np.Spec.PodSelector, sbxPod.Labels) {
		t.Errorf("selector %+v", np.Spec.PodSelector)
	}
	// Egress outside DNS goes only to ipBlocks that leave out every
	// cluster-internal range.
	mustExclude := []string{"10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "169.254.0.0/16", "127.0.0.0/8", "100.64.0.0/10"}
	var v4 bool
	for _, rule := range np.Spec.Egress {
		for _, peer := range rule.To {
			if peer.IPBlock == nil {
				if !selects(t, peer.PodSelector, map[string]string{"k8s-app": "kube-dns"}) {
					t.Errorf("egress to a pod peer %+v other than DNS", peer)
				}
				continue
			}
			all, err := netip.ParsePrefix(peer.IPBlock.CIDR)
			must(t, err)
			if all.Addr().Is4() {
				v4 = true
				for _, r := range mustExclude {
					if !slices.Contains(peer.IPBlock.Except, r) {
						t.Errorf("ipBlock %s does not exclude %s", peer.IPBlock.CIDR, r)
					}
				}
			}
		}
	}
	if !v4 {
		t.Errorf("no IPv4 egress rule: %+v", np.Spec.Egress)
	}
	// Ingress on the proxy port from sandbox pods only.
	for _, rule := range np.Spec.Ingress {
		for _, p := range rule.Ports {
			if p.Port.IntValue() != EgressProxyPort {
				continue
			}
			for _, peer := range rule.From {
				if !selects(t, peer.PodSelector, sbxPod.Labels) || selects(t, peer.PodSelector, map[string]string{"app": "web"}) {
					t.Errorf("proxy-port ingress peer %+v", peer)
				}
			}
		}
	}
}

func TestUnitEgressUpstreamSecretNotFound(t *testing.T) {
	e := newEgressEnv(t, unitEgressProxy("egress"), proxiedTemplate("t", "egress"), unitSandbox("s", "t"))
	e.reconcileProxy("egress")
	ep, c := e.proxyReady("egress")
	if c.Status != metav1.ConditionFalse || c.Reason != v1alpha1.ReasonUpstreamSecretNotFound || len(ep.Status.ReadyEndpoints) != 0 {
		t.Errorf("Ready %s/%s %q, endpoints %v", c.Status, c.Reason, c.Message, ep.Status.ReadyEndpoints)
	}
	var pod corev1.Pod
	if err := e.c.Get(context.Background(), types.NamespacedName{Namespace: unitNS, Name: EgressServiceName("s")}, &pod); !apierrors.IsNotFound(err) {
		t.Errorf("a proxy pod was created without its Secret: %v", err)
	}
	if evs := drain(e.rec); len(evs) != 1 || !strings.Contains(evs[0], EventUpstreamSecretNotFound) {
		t.Errorf("events %v", evs)
	}
	e.reconcileProxy("egress")
	if evs := drain(e.rec); len(evs) != 0 {
		t.Errorf("a second pass repeated events: %v", evs)
	}

	// A Secret without the key is no better.
	s := upstreamSecret()
	s.Data = map[string][]byte{"other": []byte("x:y")}
	must(t, e.c.Create(context.Background(), s))
	e.reconcileProxy("egress")
	if _, c = e.proxyReady("egress"); c.Reason != v1alpha1.ReasonUpstreamSecretNotFound || !strings.Contains(c.Message, "userpass") {
		t.Errorf("missing key: Ready %s %q", c.Reason, c.Message)
	}

	s.Data = map[string][]byte{"userpass": []byte("corp:s3cret")}
	must(t, e.c.Update(context.Background(), s))
	e.reconcileProxy("egress")
	e.get(EgressServiceName("s"), &pod)
	if _, c = e.proxyReady("egress"); c.Reason != v1alpha1.ReasonProxyProgressing {
		t.Errorf("with the Secret: Ready %s %q", c.Reason, c.Message)
	}
}

func drain(rec *events.FakeRecorder) []string {
	var out []string
	for {
		select {
		case e := <-rec.Events:
			out = append(out, e)
		default:
			return out
		}
	}
}

// A policy change reaches the running proxy through its ConfigMap, which
// it reloads; a change the pod spec carries (the upstream) replaces the
// pod.
func TestUnitEgressChanges(t *testing.T) {
	e := newEgressEnv(t, unitEgressProxy("egress"), upstreamSecret(), proxiedTemplate("t", "egress"), unitSandbox("s", "t"))
	ctx := context.Background()
	e.reconcileProxy("egress")
	var pod corev1.Pod
	e.get(EgressServiceName("s"), &pod)
	uid := pod.UID

	var ep v1alpha1.EgressProxy
	e.get("egress", &ep)
	ep.Spec.AllowedDomains = append(ep.Spec.AllowedDomains, "files.example.org")
	must(t, e.c.Update(ctx, &ep))
	e.reconcileProxy("egress")
	var cm corev1.ConfigMap
	e.get(egressConfigMapName("egress"), &cm)
	if !strings.Contains(cm.Data[egressPolicyKey], "files.example.org") {
		t.Errorf("ConfigMap not updated: %s", cm.Data[egressPolicyKey])
	}
	e.get(EgressServiceName("s"), &pod)
	if pod.UID != uid {
		t.Error("a policy change replaced the proxy pod")
	}

	e.get("egress", &ep)
	ep.Spec.Upstream.URL = "http://other-upstream.corp.test:3128"
	must(t, e.c.Update(ctx, &ep))
	e.reconcileProxy("egress")
	if err := e.c.Get(ctx, types.NamespacedName{Namespace: unitNS, Name: EgressServiceName("s")}, &pod); !apierrors.IsNotFound(err) {
		t.Fatalf("the proxy pod with the old upstream is still there: %v", err)
	}
	e.reconcileProxy("egress")
	e.get(EgressServiceName("s"), &pod)
	if !slices.Contains(pod.Spec.Containers[0].Args, "-upstream=http://other-upstream.corp.test:3128") {
		t.Errorf("new pod args %v", pod.Spec.Containers[0].Args)
	}
}

// A sandbox without a proxy may reach DNS and nothing else, and gets no
// proxy variables; a template naming a missing proxy holds the sandbox
// back.
func TestUnitSandboxEgressWithoutProxy(t *testing.T) {
	tpl := unitTemplate("t")
	tpl.Spec.Env = []corev1.EnvVar{{Name: "HTTP_PROXY", Value: "http://elsewhere:1"}}
	e := newEgressEnv(t, tpl, unitSandbox("s", "t"), proxiedTemplate("missing", "nope"), unitSandbox("m", "missing"))
	ctx := context.Background()
	_, err := e.sr.Reconcile(ctx, ctrl.Request{NamespacedName: types.NamespacedName{Namespace: unitNS, Name: "s"}})
	must(t, err)
	var np networkingv1.NetworkPolicy
	e.get(SandboxNetworkPolicyName("s"), &np)
	if len(np.Spec.Egress) != 1 || len(np.Spec.Egress[0].To) != 1 || np.Spec.Egress[0].To[0].NamespaceSelector == nil {
		t.Errorf("egress %+v, want DNS only", np.Spec.Egress)
	}
	var pod corev1.Pod
	e.get(PodName("s"), &pod)
	for _, v := range pod.Spec.Containers[0].Env {
		if v.Name == "HTTP_PROXY" && v.Value != "http://elsewhere:1" {
			t.Errorf("HTTP_PROXY %q", v.Value)
		}
	}

	res, err := e.sr.Reconcile(ctx, ctrl.Request{NamespacedName: types.NamespacedName{Namespace: unitNS, Name: "m"}})
	if err != nil || res.RequeueAfter <= 0 {
		t.Errorf("missing proxy: %+v, %v; want a requeue to wait for it, not an error", res, err)
	}
	var m v1alpha1.Sandbox
	e.get("m", &m)
	if c := meta.FindStatusCondition(m.Status.Conditions, v1alpha1.ConditionReady); m.Status.Phase != v1alpha1.SandboxPhasePending ||
		c == nil || c.Reason != v1alpha1.ReasonEgressProxyNotFound || !strings.Contains(c.Message, "EgressProxy") {
		t.Errorf("missing proxy: phase %s, Ready %+v", m.Status.Phase, c)
	}
	if err := e.c.Get(ctx, types.NamespacedName{Namespace: unitNS, Name: PodName("m")}, &pod); !apierrors.IsNotFound(err) {
		t.Errorf("a pod was created without its proxy: %v", err)
	}
}

// A Shared proxy is one Deployment and Service; each sandbox reaches it
// with its own credentials, which the proxy's client list holds while the
// sandbox uses the proxy.
func TestUnitEgressShared(t *testing.T) {
	ep := unitEgressProxy("egress")
	ep.Spec.Mode = v1alpha1.EgressProxyModeShared
	ep.Spec.Replicas = ptr.To[int32](2)
	e := newEgressEnv(t, ep, upstreamSecret(), proxiedTemplate("t", "egress"), unitSandbox("s", "t"), unitSandbox("s2", "t"))
	ctx := context.Background()
	for _, name := range []string{"s", "s2"} {
		if _, err := e.sr.Reconcile(ctx, ctrl.Request{NamespacedName: types.NamespacedName{Namespace: unitNS, Name: name}}); err != nil {
			t.Fatal(err)
		}
	}
	var sbxPod corev1.Pod
	e.get(PodName("s"), &sbxPod)
	env := sbxPod.Spec.Containers[0].Env
	pwAt, proxyAt := -1, -1
	for i, v := range env {
		switch v.Name {
		case egressPasswordEnv:
			pwAt = i
			if v.ValueFrom == nil || v.ValueFrom.SecretKeyRef == nil || v.ValueFrom.SecretKeyRef.Name != EgressCredentialsSecretName("s") || v.Value != "" {
				t.Errorf("%s = %+v, want it from the sandbox's credentials Secret", v.Name, v)
			}
		case "HTTP_PROXY":
			proxyAt = i
			if want := "http://s:$(" + egressPasswordEnv + ")@" + fakeClusterIP + ":3128"; v.Value != want {
				t.Errorf("HTTP_PROXY %q, want %q", v.Value, want)
			}
		}
	}
	if pwAt < 0 || proxyAt < pwAt {
		t.Errorf("the password variable (at %d) must come before HTTP_PROXY (at %d) for $(...) to expand", pwAt, proxyAt)
	}
	var creds corev1.Secret
	e.get(EgressCredentialsSecretName("s"), &creds)
	var sbx v1alpha1.Sandbox
	e.get("s", &sbx)
	if !metav1.IsControlledBy(&creds, &sbx) || len(creds.Data[egressPasswordKey]) < 32 {
		t.Errorf("credentials Secret owners %v, password length %d", creds.OwnerReferences, len(creds.Data[egressPasswordKey]))
	}

	e.reconcileProxy("egress")
	var clients corev1.Secret
	e.get(egressClientsSecretName("egress"), &clients)
	users, err := egressproxy.ParseClientCredentials(clients.Data[egressClientsKey])
	if err != nil {
		t.Fatalf("client credentials: %v", err)
	}
	if len(users) != 2 || users["s"] != string(creds.Data[egressPasswordKey]) || users["s2"] == "" || users["s2"] == users["s"] {
		t.Errorf("client credentials have users %d, s matches %v", len(users), users["s"] == string(creds.Data[egressPasswordKey]))
	}

	var dep appsv1.Deployment
	e.get("egress-egress", &dep)
	if *dep.Spec.Replicas != 2 || !selects(t, dep.Spec.Selector, dep.Spec.Template.Labels) {
		t.Errorf("replicas %d, selector %+v, template labels %v", *dep.Spec.Replicas, dep.Spec.Selector, dep.Spec.Template.Labels)
	}
	args := dep.Spec.Template.Spec.Containers[0].Args
	if !slices.Contains(args, "-client-credentials-file="+egressClientsDir+"/"+egressClientsKey) {
		t.Errorf("args %v", args)
	}
	for _, a := range args {
		if strings.HasPrefix(a, "-agent=") {
			t.Errorf("a shared proxy names one agent: %s", a)
		}
	}
	sharedPod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Labels: dep.Spec.Template.Labels}}
	var np networkingv1.NetworkPolicy
	e.get(SandboxNetworkPolicyName("s"), &np)
	reaches := false
	for _, rule := range np.Spec.Egress {
		for _, peer := range rule.To {
			if peer.NamespaceSelector == nil && selects(t, peer.PodSelector, sharedPod.Labels) {
				reaches = true
			}
		}
	}
	if !reaches {
		t.Errorf("the sandbox's policy does not reach the shared pods: %+v", np.Spec.Egress)
	}
	var svc corev1.Service
	e.get("egress-egress", &svc)
	if !selects(t, &metav1.LabelSelector{MatchLabels: svc.Spec.Selector}, sharedPod.Labels) {
		t.Errorf("Service selector %v", svc.Spec.Selector)
	}

	if _, c := e.proxyReady("egress"); c.Reason != v1alpha1.ReasonProxyProgressing {
		t.Errorf("no replica ready: Ready %s %q", c.Reason, c.Message)
	}
	dep.Status = appsv1.DeploymentStatus{ObservedGeneration: dep.Generation, Replicas: 2, UpdatedReplicas: 2, ReadyReplicas: 2}
	must(t, e.c.Status().Update(ctx, &dep))
	e.reconcileProxy("egress")
	got, c := e.proxyReady("egress")
	if c.Reason != v1alpha1.ReasonProxyAvailable || !slices.Equal(got.Status.ReadyEndpoints, []string{"http://egress-egress." + unitNS + ".svc:3128"}) {
		t.Errorf("ready: Ready %s %q, endpoints %v", c.Reason, c.Message, got.Status.ReadyEndpoints)
	}

	// A sandbox that is gone loses its access at once, before garbage
	// collection removes its Secret.
	must(t, e.c.Delete(ctx, &sbx))
	e.reconcileProxy("egress")
	e.get(egressClientsSecretName("egress"), &clients)
	users, err = egressproxy.ParseClientCredentials(clients.Data[egressClientsKey])
	must(t, err)
	if _, still := users["s"]; still || len(users) != 1 {
		t.Errorf("after deleting s the clients are %d, s still there: %v", len(users), still)
	}
}

// proxyPolicyExtraRules are the proxy NetworkPolicy's egress rules beyond
// the DNS rule and the everything-but-private rule every proxy gets.
func proxyPolicyExtraRules(t *testing.T, e *egressEnv, proxy string) []networkingv1.NetworkPolicyEgressRule {
	t.Helper()
	var np networkingv1.NetworkPolicy
	e.get(egressProxyNetworkPolicyName(proxy), &np)
	if len(np.Spec.Egress) < 2 || np.Spec.Egress[1].To[0].IPBlock == nil || np.Spec.Egress[1].To[0].IPBlock.CIDR != "0.0.0.0/0" {
		t.Fatalf("the proxy policy lost its base rules: %+v", np.Spec.Egress)
	}
	// The base rule keeps excepting every private range whatever holes
	// the extra rules make.
	for _, r := range privateRanges {
		if !slices.Contains(np.Spec.Egress[1].To[0].IPBlock.Except, r) {
			t.Errorf("the base rule no longer excepts %s", r)
		}
	}
	return np.Spec.Egress[2:]
}

// An upstream inside the cluster is let through by the proxy pods'
// NetworkPolicy, and only it: the pods behind its Service on the Service's
// target port, or the one address of an IP literal on the URL's port. The
// local cluster does not enforce NetworkPolicy, so this is checked on the
// objects and against the labels of the pods they are meant to select.
func TestUnitEgressUpstreamInCluster(t *testing.T) {
	squid := map[string]string{"app": "squid"}
	svc := func(ns, name string, port int32, target intstr.IntOrString, selector map[string]string) *corev1.Service {
		return &corev1.Service{
			ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns},
			Spec: corev1.ServiceSpec{Selector: selector, Ports: []corev1.ServicePort{
				{Name: "other", Port: 9999, TargetPort: intstr.FromInt32(1), Protocol: corev1.ProtocolTCP},
				{Name: "proxy", Port: port, TargetPort: target, Protocol: corev1.ProtocolTCP},
			}},
		}
	}
	cases := []struct {
		name     string
		url      string
		objs     []client.Object
		wantNS   string             // a pod rule in this namespace, or
		wantCIDR string             // an ipBlock rule, or neither
		wantPort intstr.IntOrString // the rule's one port
	}{
		{"Service in the proxy's namespace by its short name, named target port", "http://corp-proxy:3128",
			[]client.Object{svc(unitNS, "corp-proxy", 3128, intstr.FromString("http-proxy"), squid)}, unitNS, "", intstr.FromString("http-proxy")},
		{"Service in another namespace by its full name", "http://corp-proxy.infra.svc.cluster.local:8080",
			[]client.Object{svc("infra", "corp-proxy", 8080, intstr.FromInt32(3128), squid)}, "infra", "", intstr.FromInt32(3128)},
		{"Service as name.namespace, target port unset", "http://corp-proxy.infra:8080",
			[]client.Object{svc("infra", "corp-proxy", 8080, intstr.IntOrString{}, squid)}, "infra", "", intstr.FromInt32(8080)},
		{"Service with the default port of the scheme", "http://corp-proxy.infra.svc",
			[]client.Object{svc("infra", "corp-proxy", 80, intstr.FromInt32(3128), squid)}, "infra", "", intstr.FromInt32(3128)},
		{"IPv4 literal in a private range", "http://10.1.2.3:3128", nil, "", "10.1.2.3/32", intstr.FromInt32(3128)},
		{"IPv6 literal", "http://[fd00::5]:3128/", nil, "", "fd00::5/128", intstr.FromInt32(3128)},
		{"a name outside the cluster", "http://upstream.corp.test:8080", nil, "", "", intstr.IntOrString{}},
		{"the metadata address stays closed", "http://169.254.169.254:80", nil, "", "", intstr.IntOrString{}},
		{"loopback is the pod itself", "http://127.0.0.1:3128", nil, "", "", intstr.IntOrString{}},
		{"a name.namespace that is no Service", "http://proxy.corp:8080", nil, "", "", intstr.IntOrString{}},
		{"a name outside the cluster that looks like a Service's", "http://corp-proxy.infra.svc.example.com:8080",
			[]client.Object{svc("infra", "corp-proxy", 8080, intstr.FromInt32(3128), squid)}, "", "", intstr.IntOrString{}},
		{"a Service without a selector has no pods to select", "http://corp-proxy:3128",
			[]client.Object{svc(unitNS, "corp-proxy", 3128, intstr.FromInt32(3128), nil)}, "", "", intstr.IntOrString{}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			ep := unitEgressProxy("egress")
			ep.Spec.Upstream = &v1alpha1.EgressUpstream{URL: tc.url}
			e := newEgressEnv(t, append(tc.objs, ep)...)
			e.reconcileProxy("egress")
			extra := proxyPolicyExtraRules(t, e, "egress")
			if tc.wantNS == "" && tc.wantCIDR == "" {
				if len(extra) != 0 {
					t.Fatalf("extra egress rules %+v; want none", extra)
				}
				return
			}
			if len(extra) != 1 || len(extra[0].To) != 1 || len(extra[0].Ports) != 1 {
				t.Fatalf("extra egress rules %+v; want one rule, one peer, one port", extra)
			}
			rule := extra[0]
			if p := rule.Ports[0]; p.Protocol == nil || *p.Protocol != corev1.ProtocolTCP || p.Port == nil || *p.Port != tc.wantPort || p.EndPort != nil {
				t.Errorf("port %+v, want TCP %s", p, tc.wantPort.String())
			}
			peer := rule.To[0]
			if tc.wantCIDR != "" {
				if peer.IPBlock == nil || peer.IPBlock.CIDR != tc.wantCIDR || len(peer.IPBlock.Except) != 0 || peer.PodSelector != nil {
					t.Errorf("peer %+v, want ipBlock %s", peer, tc.wantCIDR)
				}
				return
			}
			if peer.IPBlock != nil || peer.NamespaceSelector == nil || peer.PodSelector == nil {
				t.Fatalf("peer %+v, want pods by selector", peer)
			}
			if !selects(t, peer.NamespaceSelector, map[string]string{"kubernetes.io/metadata.name": tc.wantNS}) ||
				selects(t, peer.NamespaceSelector, map[string]string{"kubernetes.io/metadata.name": "elsewhere"}) {
				t.Errorf("namespace selector %+v, want only %s", peer.NamespaceSelector, tc.wantNS)
			}
			if !selects(t, peer.PodSelector, map[string]string{"app": "squid", "pod-template-hash": "x"}) ||
				selects(t, peer.PodSelector, map[string]string{"app": "web"}) || selects(t, peer.PodSelector, nil) {
				t.Errorf("pod selector %+v, want the Service's pods only", peer.PodSelector)
			}
		})
	}
}

// The upstream's Service may come after the proxy: its watch finds the
// proxy, and the next pass adds the rule; a new selector follows.
func TestUnitEgressUpstreamServiceLater(t *testing.T) {
	ep := unitEgressProxy("egress")
	ep.Spec.Upstream = &v1alpha1.EgressUpstream{URL: "http://corp-proxy:3128"}
	other := unitEgressProxy("other")
	other.Spec.Upstream = &v1alpha1.EgressUpstream{URL: "http://corp-proxy.elsewhere:3128"}
	e := newEgressEnv(t, ep, other)
	ctx := context.Background()
	e.reconcileProxy("egress")
	if extra := proxyPolicyExtraRules(t, e, "egress"); len(extra) != 0 {
		t.Fatalf("a rule for a Service that does not exist: %+v", extra)
	}
	svc := &corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Name: "corp-proxy", Namespace: unitNS},
		Spec:       corev1.ServiceSpec{Selector: map[string]string{"app": "squid"}, Ports: []corev1.ServicePort{{Port: 3128}}},
	}
	must(t, e.c.Create(ctx, svc))
	reqs := e.r.proxiesForUpstreamService(ctx, svc)
	if len(reqs) != 1 || reqs[0].Name != "egress" || reqs[0].Namespace != unitNS {
		t.Errorf("the Service wakes %v; want only %s/egress", reqs, unitNS)
	}
	e.reconcileProxy("egress")
	extra := proxyPolicyExtraRules(t, e, "egress")
	if len(extra) != 1 || !selects(t, extra[0].To[0].PodSelector, map[string]string{"app": "squid"}) {
		t.Fatalf("rules %+v", extra)
	}
	svc.Spec.Selector = map[string]string{"app": "squid2"}
	must(t, e.c.Update(ctx, svc))
	e.reconcileProxy("egress")
	extra = proxyPolicyExtraRules(t, e, "egress")
	if len(extra) != 1 || selects(t, extra[0].To[0].PodSelector, map[string]string{"app": "squid"}) ||
		!selects(t, extra[0].To[0].PodSelector, map[string]string{"app": "squid2"}) {
		t.Errorf("the rule did not follow the new selector: %+v", extra)
	}
}

// allowedCIDRs reach the proxy through its policy file, and the proxy pods'
// NetworkPolicy lets them out to the same networks less the deniedCIDRs
// inside them. The spec's runtimeClassName wins over the control plane's.
func TestUnitEgressAllowedCIDRsAndRuntimeClass(t *testing.T) {
	ep := unitEgressProxy("egress")
	ep.Spec.Upstream = nil
	ep.Spec.AllowedCIDRs = []v1alpha1.AllowedCIDR{"198.18.0.7/32", "10.20.0.0/16", "fd12::/64", "10.30.0.0/16"}
	ep.Spec.DeniedCIDRs = []v1alpha1.CIDR{"10.20.5.0/24", "203.0.113.0/24", "10.30.0.0/15"}
	ep.Spec.RuntimeClassName = "gvisor-proxy"
	e := newEgressEnv(t, ep, proxiedTemplate("t", "egress"), unitSandbox("s", "t"))
	e.r.RuntimeClassName = "gvisor"
	e.reconcileProxy("egress")

	var cm corev1.ConfigMap
	e.get(egressConfigMapName("egress"), &cm)
	fc, err := egressproxy.ParseFileConfig([]byte(cm.Data[egressPolicyKey]))
	must(t, err)
	if want := []string{"10.20.0.0/16", "10.30.0.0/16", "198.18.0.7/32", "fd12::/64"}; !slices.Equal(fc.AllowedCIDRs, want) {
		t.Errorf("policy file allowedCIDRs %v, want %v", fc.AllowedCIDRs, want)
	}
	if _, err := egressproxy.ParseAllowedCIDRs(fc.AllowedCIDRs); err != nil {
		t.Errorf("the proxy would refuse the policy file: %v", err)
	}

	extra := proxyPolicyExtraRules(t, e, "egress")
	if len(extra) != 1 || len(extra[0].Ports) != 0 {
		t.Fatalf("extra rules %+v; want one rule for the allowed networks, on every port", extra)
	}
	var got []string
	for _, p := range extra[0].To {
		if p.IPBlock == nil || p.PodSelector != nil || p.NamespaceSelector != nil {
			t.Fatalf("peer %+v is not an ipBlock", p)
		}
		got = append(got, p.IPBlock.CIDR+" except "+strings.Join(p.IPBlock.Except, ","))
	}
	// 10.30.0.0/16 lies wholly inside a denied network and gets no block.
	if want := []string{"10.20.0.0/16 except 10.20.5.0/24", "198.18.0.7/32 except ", "fd12::/64 except "}; !slices.Equal(got, want) {
		t.Errorf("allowed blocks %q, want %q", got, want)
	}

	var pod corev1.Pod
	e.get(EgressServiceName("s"), &pod)
	if ptr.Deref(pod.Spec.RuntimeClassName, "") != "gvisor-proxy" {
		t.Errorf("proxy pod runtime class %v, want the spec's gvisor-proxy", pod.Spec.RuntimeClassName)
	}
}

// The CRD's rule for allowedCIDRs names the networks the proxy refuses to
// open, so that the API server and the proxy refuse the same things. The
// IPv4-mapped range is not in the CRD's list: isCIDR refuses those forms.
func TestUnitAllowedCIDRRuleMatchesProxy(t *testing.T) {
	b, err := os.ReadFile(filepath.Join("..", "..", "charts", "agentbox", "crds", "agentbox.dev_egressproxies.yaml"))
	must(t, err)
	crd := strings.Join(strings.Fields(string(b)), " ")
	for _, p := range egressproxy.NeverAllowedCIDRs {
		if p.Addr().Is4In6() {
			continue
		}
		if !strings.Contains(crd, "''"+p.String()+"''") {
			t.Errorf("the CRD's allowedCIDRs rule does not list %s", p)
		}
	}
}

// The proxy reads the destinations' CA bundle only as it starts, so a new
// bundle replaces the PerAgent proxy pods and rolls a Shared proxy's
// Deployment; a rotated credential value does neither (the proxy reloads
// its mounted Secret). A proxy without a bundle keeps the pod hash it had
// before the bundle counted, so an upgrade replaces no pod.
func TestUnitEgressDestinationCABundleRestarts(t *testing.T) {
	withCreds := func(ep *v1alpha1.EgressProxy) *v1alpha1.EgressProxy {
		ep.Spec.Credentials = []v1alpha1.EgressCredential{{
			Name: "api", Hosts: []v1alpha1.Domain{"pypi.org"}, SecretRef: v1alpha1.SecretKeySelector{Name: "tokens", Key: "api"},
			Header: &v1alpha1.EgressCredentialHeader{Name: "Authorization", ValueTemplate: "Bearer {{secret}}"},
		}}
		ep.Spec.DestinationCABundle = "-----BEGIN CERTIFICATE-----\nfirst\n-----END CERTIFICATE-----\n"
		return ep
	}
	tokens := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: "tokens", Namespace: unitNS}, Data: map[string][]byte{"api": []byte("v1")}}
	shared := withCreds(unitEgressProxy("shared"))
	shared.Spec.Mode = v1alpha1.EgressProxyModeShared
	e := newEgressEnv(t, withCreds(unitEgressProxy("egress")), shared, upstreamSecret(), tokens,
		proxiedTemplate("t", "egress"), unitSandbox("s", "t"))
	ctx := context.Background()
	e.reconcileProxy("egress")
	e.reconcileProxy("shared")
	var pod corev1.Pod
	e.get(EgressServiceName("s"), &pod)
	firstCA := pod.Annotations[annotationEgressDestinationCAHash]
	if firstCA == "" || pod.Annotations[annotationEgressPodHash] == "" {
		t.Fatalf("proxy pod annotations %v", pod.Annotations)
	}
	var dep appsv1.Deployment
	e.get(egressSharedName("shared"), &dep)
	if dep.Spec.Template.Annotations[annotationEgressDestinationCAHash] != firstCA {
		t.Errorf("Shared template annotations %v, want the bundle's hash %s", dep.Spec.Template.Annotations, firstCA)
	}
	firstTemplate := dep.Annotations[annotationEgressTemplateHash]

	// A rotated credential value: same pod, same template.
	tokens.Data["api"] = []byte("v2")
	must(t, e.c.Update(ctx, tokens))
	e.reconcileProxy("egress")
	e.reconcileProxy("shared")
	var again corev1.Pod
	e.get(EgressServiceName("s"), &again)
	if again.UID != pod.UID {
		t.Error("a rotated credential value replaced the proxy pod; the proxy reloads it")
	}
	e.get(egressSharedName("shared"), &dep)
	if dep.Annotations[annotationEgressTemplateHash] != firstTemplate {
		t.Error("a rotated credential value changed the Shared proxy's template")
	}

	// A new bundle: the pod goes, its successor has the new hash; the
	// Deployment's template changes, which rolls its pods.
	for _, name := range []string{"egress", "shared"} {
		var ep v1alpha1.EgressProxy
		e.get(name, &ep)
		ep.Spec.DestinationCABundle = "-----BEGIN CERTIFICATE-----\nsecond\n-----END CERTIFICATE-----\n"
		must(t, e.c.Update(ctx, &ep))
		e.reconcileProxy(name)
	}
	if err := e.c.Get(ctx, types.NamespacedName{Namespace: unitNS, Name: EgressServiceName("s")}, &again); !apierrors.IsNotFound(err) {
		t.Fatalf("the proxy pod that read the old bundle is still there: %v", err)
	}
	e.reconcileProxy("egress")
	e.get(EgressServiceName("s"), &again)
	if ca := again.Annotations[annotationEgressDestinationCAHash]; ca == "" || ca == firstCA {
		t.Errorf("new proxy pod's bundle hash %q, first was %q", ca, firstCA)
	}
	var cm corev1.ConfigMap
	e.get(egressConfigMapName("egress"), &cm)
	if !strings.Contains(cm.Data[egressDestinationsKey], "second") {
		t.Errorf("ConfigMap bundle %q", cm.Data[egressDestinationsKey])
	}
	e.get(egressSharedName("shared"), &dep)
	if dep.Annotations[annotationEgressTemplateHash] == firstTemplate ||
		dep.Spec.Template.Annotations[annotationEgressDestinationCAHash] == firstCA {
		t.Errorf("the Shared proxy's template did not change with the bundle: %v", dep.Spec.Template.Annotations)
	}

	// Without a bundle there is no annotation, and the hash is the spec's
	// alone, as before.
	plain := unitEgressProxy("plain")
	spec := egressPodSpec(plain, egressPodOptions{image: "img"})
	if a := egressPodAnnotations(plain); a != nil {
		t.Errorf("annotations without a bundle: %v", a)
	}
	b, err := json.Marshal(&spec)
	must(t, err)
	sum := sha256.Sum256(b)
	if got, err := podHash(&spec, nil); err != nil || got != hex.EncodeToString(sum[:8]) {
		t.Errorf("hash without annotations %q (%v), want the spec's %x", got, err, sum[:8])
	}
}
