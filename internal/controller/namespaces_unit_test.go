package controller

import (
	"context"
	"strings"
	"testing"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	ctrl "sigs.k8s.io/controller-runtime"
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

// TestUnitPlatformsShareACluster: two platforms on one cluster, each
// serving its own namespaces, both see every Sandbox. The one that does
// not serve a sandbox leaves it to the one that does: it waits out the
// grace on a new one, never writes NamespaceNotServed over the other's
// status, never takes a finalizer off, and the other platform's sandbox of
// the same agent ID is no duplicate of its own.
func TestUnitPlatformsShareACluster(t *testing.T) {
	sbx := unitSandbox("s", "python")
	f := newFakeEnv(t, unitTemplate("python"))
	sbx.CreationTimestamp = metav1.NewTime(f.clock.Now())
	must(t, f.c.Create(context.Background(), sbx))
	f.r.Namespaces, f.r.Snapshots = ServedNamespaces{unitNS}, &recordingDriver{}
	other := &SandboxReconciler{Client: f.c, Scheme: f.r.Scheme, Recorder: f.rec, Namespace: "agentbox-system",
		DefaultImage: f.r.DefaultImage, CA: f.r.CA, Clock: f.clock, Namespaces: servedElsewhere, Snapshots: &recordingDriver{}}
	reconcileBy := func(r *SandboxReconciler, name string) ctrl.Result {
		t.Helper()
		res, err := r.Reconcile(context.Background(), ctrl.Request{NamespacedName: types.NamespacedName{Namespace: unitNS, Name: name}})
		must(t, err)
		return res
	}

	// Just made: the other platform leaves it for the one that serves it.
	if res := reconcileBy(other, "s"); res.RequeueAfter <= 0 || res.RequeueAfter > notServedGrace {
		t.Errorf("the other platform on a new sandbox: %+v, want a look again within %s", res, notServedGrace)
	}
	if c := meta.FindStatusCondition(f.sandbox("s").Status.Conditions, v1alpha1.ConditionReady); c != nil {
		t.Errorf("the other platform wrote Ready %+v within the grace", c)
	}
	f.reconcile("s")
	served := f.sandbox("s")
	if c := f.ready("s"); c.Reason == v1alpha1.ReasonNamespaceNotServed || len(served.Finalizers) == 0 {
		t.Fatalf("the serving platform: Ready %s, finalizers %v", c.Reason, served.Finalizers)
	}
	f.clock.Step(2 * notServedGrace)
	f.drainEvents()
	if res := reconcileBy(other, "s"); res != (ctrl.Result{}) {
		t.Errorf("the other platform on a served sandbox: %+v", res)
	}
	if got := f.sandbox("s"); got.ResourceVersion != served.ResourceVersion {
		t.Errorf("the other platform rewrote a sandbox it does not serve: Ready %+v", f.ready("s"))
	}
	if evs := f.drainEvents(); len(evs) != 0 {
		t.Errorf("the other platform recorded %v", evs)
	}

	// The other platform's sandbox of the same agent, older, in a
	// namespace it serves, takes nothing from this one.
	twin := unitSandbox("twin", "python")
	twin.Namespace, twin.Spec.AgentID = "agents", sbx.Spec.AgentID
	twin.CreationTimestamp = metav1.NewTime(f.clock.Now().Add(-time.Hour))
	must(t, f.c.Create(context.Background(), twin))
	f.reconcile("s")
	if c := f.ready("s"); c.Reason == v1alpha1.ReasonDuplicateAgent {
		t.Errorf("refused as a duplicate of another platform's sandbox: %s", c.Message)
	}

	// Deleted: only the serving platform finalizes it (its snapshots are
	// in its store).
	must(t, f.c.Delete(context.Background(), f.sandbox("s")))
	reconcileBy(other, "s")
	if got := f.sandbox("s"); len(got.Finalizers) == 0 {
		t.Error("the other platform took the finalizer off a sandbox it does not serve")
	}

	// Nobody takes up a sandbox in a namespace nobody serves: once the
	// grace is over, the first platform to look tells it.
	lone := unitSandbox("lone", "python")
	lone.CreationTimestamp = metav1.NewTime(f.clock.Now())
	must(t, f.c.Create(context.Background(), lone))
	reconcileBy(other, "lone")
	f.clock.Step(notServedGrace)
	reconcileBy(other, "lone")
	if c := f.ready("lone"); c.Reason != v1alpha1.ReasonNamespaceNotServed {
		t.Errorf("a sandbox nobody serves, after the grace: Ready %s", c.Reason)
	}
}
