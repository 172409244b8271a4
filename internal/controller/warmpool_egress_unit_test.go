package controller

import (
	"context"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
)

// TestUnitAdoptionMovesEgress: a sandbox that adopts a warm one whose
// template has a PerAgent proxy keeps the proxy its pod's HTTP_PROXY names
// (the Service moves to it), and its pod is selected by the adopter's own
// NetworkPolicy, made before the pod was relabelled.
func TestUnitAdoptionMovesEgress(t *testing.T) {
	w, wName := proxiedPool(t)
	var svc corev1.Service
	must(t, w.c.Get(context.Background(), keyOf(EgressServiceName(wName)), &svc))

	must(t, w.c.Create(context.Background(), unitSandbox("x", "t")))
	w.reconcile("x")
	w.reconcile("x")
	var moved corev1.Service
	must(t, w.c.Get(context.Background(), keyOf(EgressServiceName(wName)), &moved))
	x := w.sandbox("x")
	if moved.UID != svc.UID || !metav1.IsControlledBy(&moved, x) || moved.Labels[v1alpha1.LabelSandbox] != "x" {
		t.Errorf("proxy Service after adoption: uid %s (was %s), owner %+v, labels %v", moved.UID, svc.UID, moved.OwnerReferences, moved.Labels)
	}
	var pod corev1.Pod
	must(t, w.c.Get(context.Background(), keyOf(PodName(wName)), &pod))
	for _, v := range pod.Spec.Containers[0].Env {
		if v.Name == "HTTP_PROXY" && v.Value != "http://"+moved.Spec.ClusterIP+":3128" {
			t.Errorf("adopted pod's HTTP_PROXY %q no longer names its proxy Service", v.Value)
		}
	}
	var np networkingv1.NetworkPolicy
	must(t, w.c.Get(context.Background(), keyOf(SandboxNetworkPolicyName("x")), &np))
	if !metav1.IsControlledBy(&np, x) || !selects(t, &np.Spec.PodSelector, pod.Labels) {
		t.Errorf("the adopter's NetworkPolicy (owner %+v) does not select the adopted pod (labels %v)", np.OwnerReferences, pod.Labels)
	}
}

// proxiedPool is a ready pool of one whose template has a PerAgent proxy,
// and the name of its warm sandbox.
func proxiedPool(t *testing.T) (*warmEnv, string) {
	t.Helper()
	w, names := readyPool(t, 1, unitEgressProxy("egress"), upstreamSecret())
	// readyPool's template names no proxy; give it one and roll the pool.
	var tpl v1alpha1.SandboxTemplate
	must(t, w.c.Get(context.Background(), keyOf("t"), &tpl))
	tpl.Spec.EgressProxyRef = &v1alpha1.LocalObjectReference{Name: "egress"}
	must(t, w.c.Update(context.Background(), &tpl))
	w.reconcilePool("p")
	w.settle("p")
	warm := w.warm("p")
	if len(warm) != 1 || warm[0].Name == names[0] {
		t.Fatalf("pool after the roll: %+v", warm)
	}
	return w, warm[0].Name
}

func keyOf(name string) types.NamespacedName {
	return types.NamespacedName{Namespace: unitNS, Name: name}
}

// TestUnitAdopterWaitsForItsOwnProxy: the warm sandbox's proxy pod runs as
// its agent, so the adoption deletes it rather than move it, and the
// adopter does not serve until the proxy made for it is ready.
func TestUnitAdopterWaitsForItsOwnProxy(t *testing.T) {
	w, wName := proxiedPool(t)
	var old corev1.Pod
	must(t, w.c.Get(context.Background(), keyOf(EgressServiceName(wName)), &old))
	if !metav1.IsControlledBy(&old, w.sandbox(wName)) {
		t.Fatalf("the warm sandbox's proxy pod is owned by %+v", old.OwnerReferences)
	}

	must(t, w.c.Create(context.Background(), unitSandbox("x", "t")))
	w.reconcile("x")
	w.reconcile("x")
	var gone corev1.Pod
	if err := w.c.Get(context.Background(), keyOf(EgressServiceName(wName)), &gone); err == nil {
		t.Fatalf("the warm sandbox's proxy pod is still there after the adoption (owner %+v)", gone.OwnerReferences)
	}
	c := w.ready("x")
	if x := w.sandbox("x"); x.Status.Phase == v1alpha1.SandboxPhaseRunning || c.Reason != v1alpha1.ReasonAdoptedFromWarmPool ||
		!strings.Contains(c.Message, "waiting for its egress proxy pod "+EgressServiceName(wName)+" to be created") {
		t.Fatalf("adopter without its proxy: phase %s, %s: %s", x.Status.Phase, c.Reason, c.Message)
	}

	// The EgressProxy controller's pod for the adopter, once ready.
	w.podReady(PodName(wName))
	w.reconcile("x")
	w.wantPhase("x", v1alpha1.SandboxPhaseRunning, v1alpha1.ReasonAdoptedFromWarmPool)
}
