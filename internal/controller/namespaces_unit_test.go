package controller

import (
	"context"
	"strings"
	"testing"

	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
)

// The fake client would let the controllers create anything anywhere, so
// these show that nothing is even tried in a namespace the platform does
// not serve; the provider's TestAccPlatform_sandboxNamespaces shows the
// real control plane refused by RBAC there.

var servedElsewhere = ServedNamespaces{"agentbox-system", "agents"}

func TestUnitServedNamespaces(t *testing.T) {
	if !(ServedNamespaces{}).Serves("anything") || !ServedNamespaces(nil).Serves(unitNS) {
		t.Error("an empty list must serve every namespace")
	}
	if !servedElsewhere.Serves("agents") || servedElsewhere.Serves(unitNS) {
		t.Errorf("%v serves the wrong namespaces", servedElsewhere)
	}
	msg := servedElsewhere.notServedMessage("Sandbox", unitNS)
	for _, want := range []string{unitNS, "agentbox-system, agents", "sandboxNamespaces", "sandbox_namespaces"} {
		if !strings.Contains(msg, want) {
			t.Errorf("message %q does not name %q", msg, want)
		}
	}
}

func countIn(t *testing.T, c client.Client, list client.ObjectList) int {
	t.Helper()
	must(t, c.List(context.Background(), list, client.InNamespace(unitNS)))
	return meta.LenList(list)
}

func TestUnitSandboxNamespaceNotServed(t *testing.T) {
	f := newFakeEnv(t, unitSandbox("s", "python"), unitTemplate("python"))
	f.r.Namespaces = servedElsewhere
	f.reconcile("s")
	sbx := f.sandbox("s")
	c := f.ready("s")
	if sbx.Status.Phase != v1alpha1.SandboxPhasePending || c.Status != metav1.ConditionFalse || c.Reason != v1alpha1.ReasonNamespaceNotServed {
		t.Errorf("phase %s, Ready %s/%s; want Pending, False/NamespaceNotServed", sbx.Status.Phase, c.Status, c.Reason)
	}
	if len(sbx.Finalizers) != 0 {
		t.Errorf("finalizers %v: a sandbox not served gets none", sbx.Finalizers)
	}
	// The Compute API finds the agent's sandbox by this label, and answers
	// with the reason.
	if sbx.Labels[v1alpha1.LabelAgentIDHash] != v1alpha1.AgentIDHash("agent-s") {
		t.Errorf("agent-ID label %q", sbx.Labels[v1alpha1.LabelAgentIDHash])
	}
	for _, l := range []client.ObjectList{&corev1.PodList{}, &corev1.SecretList{}, &corev1.PersistentVolumeClaimList{}, &coordinationv1.LeaseList{}} {
		if n := countIn(t, f.c, l); n != 0 {
			t.Errorf("%d %T made in a namespace not served", n, l)
		}
	}
	if evs := f.drainEvents(); !eventsContain(evs, EventNamespaceNotServed) {
		t.Errorf("events %v, want %s", evs, EventNamespaceNotServed)
	}
	rv := sbx.ResourceVersion
	f.reconcile("s")
	if f.sandbox("s").ResourceVersion != rv {
		t.Error("a second reconcile rewrote the sandbox")
	}
	if evs := f.drainEvents(); len(evs) != 0 {
		t.Errorf("a second reconcile repeated events: %v", evs)
	}

	// Served, the same sandbox goes ahead.
	f.r.Namespaces = append(servedElsewhere, unitNS)
	f.reconcile("s")
	if c := f.ready("s"); c.Reason == v1alpha1.ReasonNamespaceNotServed {
		t.Errorf("still %s once served", c.Reason)
	}
	if n := countIn(t, f.c, &corev1.SecretList{}); n == 0 {
		t.Error("no serving certificate Secret once served")
	}
}

func TestUnitWarmPoolNamespaceNotServed(t *testing.T) {
	w := newWarmEnv(t, unitTemplate("python"), unitPool("p", "python", 2))
	w.pool.Namespaces = servedElsewhere
	w.reconcilePool("p")
	if got := w.warm("p"); len(got) != 0 {
		t.Errorf("%d warm sandboxes made in a namespace not served", len(got))
	}
	c := meta.FindStatusCondition(w.getPool("p").Status.Conditions, v1alpha1.ConditionReady)
	if c == nil || c.Status != metav1.ConditionFalse || c.Reason != v1alpha1.ReasonNamespaceNotServed {
		t.Errorf("Ready %+v, want False/NamespaceNotServed", c)
	}
	if evs := w.drainEvents(); !eventsContain(evs, EventNamespaceNotServed) {
		t.Errorf("events %v", evs)
	}
}

func TestUnitEgressProxyNamespaceNotServed(t *testing.T) {
	e := newEgressEnv(t, unitEgressProxy("web"))
	e.r.Namespaces = servedElsewhere
	e.reconcileProxy("web")
	_, c := e.proxyReady("web")
	if c.Status != metav1.ConditionFalse || c.Reason != v1alpha1.ReasonNamespaceNotServed {
		t.Errorf("Ready %s/%s, want False/NamespaceNotServed", c.Status, c.Reason)
	}
	for _, l := range []client.ObjectList{&corev1.ConfigMapList{}, &networkingv1.NetworkPolicyList{}, &corev1.PodList{}, &corev1.ServiceList{}} {
		if n := countIn(t, e.c, l); n != 0 {
			t.Errorf("%d %T made in a namespace not served", n, l)
		}
	}
}

func TestUnitManagedModeDisabled(t *testing.T) {
	p := newPoolEnv(t, managedPool("gv"), unitNode("n1", map[string]string{"pool": "gvisor"}, true, true))
	p.r.ManagedModeDisabled = true
	p.mustReconcile("gv")
	c := p.wantReady("gv", metav1.ConditionFalse, v1alpha1.ReasonManagedModeDisabled)
	if !strings.Contains(c.Message, "managedNodePools") {
		t.Errorf("message %q does not name the fix", c.Message)
	}
	if _, ok := p.runtimeClass(poolRuntimeClassName(managedPool("gv"))); ok {
		t.Error("RuntimeClass created without Managed mode")
	}
	if n := p.node("n1"); n.Labels[v1alpha1.LabelNodePool] != "" || hasTaint(n, poolTaint) {
		t.Errorf("node patched without Managed mode: labels %v, taints %v", n.Labels, n.Spec.Taints)
	}
	if fin := p.pool("gv").Finalizers; len(fin) != 0 {
		t.Errorf("finalizers %v", fin)
	}
}
