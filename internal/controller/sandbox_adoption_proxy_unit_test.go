package controller

import (
	"context"
	"testing"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
	ctrl "sigs.k8s.io/controller-runtime"
)

// TestUnitProxyPodFirstDoesNotBlockTheSandbox: the egress proxy controller
// may create a sandbox's PerAgent proxy pod, which the Sandbox controls,
// before the sandbox controller creates the sandbox's own pod. That pod is
// not a warm sandbox's pod moved to this one, and must not stop the
// sandbox from starting.
func TestUnitProxyPodFirstDoesNotBlockTheSandbox(t *testing.T) {
	e := newEgressEnv(t, unitEgressProxy("egress"), upstreamSecret(), proxiedTemplate("t", "egress"), unitSandbox("s", "t"))
	e.reconcileProxy("egress")
	var proxyPod corev1.Pod
	must(t, e.c.Get(context.Background(), types.NamespacedName{Namespace: unitNS, Name: EgressServiceName("s")}, &proxyPod))
	for range 2 {
		if _, err := e.sr.Reconcile(context.Background(), ctrl.Request{NamespacedName: types.NamespacedName{Namespace: unitNS, Name: "s"}}); err != nil {
			t.Fatal(err)
		}
	}
	var pod corev1.Pod
	if err := e.c.Get(context.Background(), types.NamespacedName{Namespace: unitNS, Name: PodName("s")}, &pod); err != nil {
		t.Fatalf("the sandbox's pod was not created after its proxy pod: %v", err)
	}
}
