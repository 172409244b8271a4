package controller

import (
	"context"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	ctrl "sigs.k8s.io/controller-runtime"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
)

// TestUnitSandboxWaitsForItsProxy: a sandbox behind a PerAgent egress
// proxy does not say Running while its proxy pod is not ready (its first
// fetch would find the Service without an endpoint); it does as soon as
// the proxy is, and a proxy that goes away later does not take it out of
// service.
func TestUnitSandboxWaitsForItsProxy(t *testing.T) {
	e := newEgressEnv(t, unitEgressProxy("egress"), upstreamSecret(), proxiedTemplate("t", "egress"), unitSandbox("s", "t"))
	ctx := context.Background()
	reconcile := func() {
		t.Helper()
		if _, err := e.sr.Reconcile(ctx, ctrl.Request{NamespacedName: types.NamespacedName{Namespace: unitNS, Name: "s"}}); err != nil {
			t.Fatal(err)
		}
	}
	ready := func() *metav1.Condition {
		t.Helper()
		var sbx v1alpha1.Sandbox
		e.get("s", &sbx)
		return meta.FindStatusCondition(sbx.Status.Conditions, v1alpha1.ConditionReady)
	}
	setReady := func(name string, ok bool, waiting string) {
		t.Helper()
		var pod corev1.Pod
		e.get(name, &pod)
		st := corev1.ConditionFalse
		if ok {
			st = corev1.ConditionTrue
		}
		pod.Status = corev1.PodStatus{Phase: corev1.PodRunning, PodIP: "198.18.0.9",
			Conditions: []corev1.PodCondition{{Type: corev1.PodReady, Status: st}}}
		if waiting != "" {
			pod.Status.ContainerStatuses = []corev1.ContainerStatus{{Name: "proxy",
				State: corev1.ContainerState{Waiting: &corev1.ContainerStateWaiting{Reason: waiting}}}}
		}
		must(t, e.c.Status().Update(ctx, &pod))
	}

	reconcile()
	var sbxPod corev1.Pod
	e.get(PodName("s"), &sbxPod)
	if got := sbxPod.Annotations[annotationEgressProxyPod]; got != EgressServiceName("s") {
		t.Fatalf("the sandbox pod names proxy pod %q, want %q", got, EgressServiceName("s"))
	}
	setReady(PodName("s"), true, "")

	// The sandbox's pod is ready before the proxy pod exists.
	reconcile()
	if c := ready(); c.Status != metav1.ConditionFalse || !strings.Contains(c.Message, "waiting for its egress proxy pod "+EgressServiceName("s")+" to be created") {
		t.Errorf("without a proxy pod: %s %s: %s", c.Status, c.Reason, c.Message)
	}
	e.reconcileProxy("egress")
	setReady(EgressServiceName("s"), false, "ImagePullBackOff")
	reconcile()
	if c := ready(); c.Status != metav1.ConditionFalse || c.Reason != v1alpha1.ReasonCreating ||
		!strings.Contains(c.Message, "to become ready: container proxy is waiting: ImagePullBackOff") {
		t.Errorf("proxy pod not ready: %s %s: %s", c.Status, c.Reason, c.Message)
	}
	setReady(EgressServiceName("s"), true, "")
	reconcile()
	if c := ready(); c.Status != metav1.ConditionTrue || c.Reason != v1alpha1.ReasonRunning {
		t.Errorf("proxy pod ready: %s %s: %s", c.Status, c.Reason, c.Message)
	}

	// Serving, it stays so while the proxy pod is replaced.
	setReady(EgressServiceName("s"), false, "")
	reconcile()
	if c := ready(); c.Status != metav1.ConditionTrue {
		t.Errorf("a serving sandbox left service with its proxy: %s %s: %s", c.Status, c.Reason, c.Message)
	}
}
