package controller

import (
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
)

// TestSandboxWaitsForItsEgressProxy, on the real cluster: a sandbox behind
// a PerAgent proxy whose pod is ready, but whose proxy pod does not exist
// yet (the EgressProxy controller is not running), does not say Running;
// once the EgressProxy controller starts and its proxy pod is ready, it
// does.
func TestSandboxWaitsForItsEgressProxy(t *testing.T) {
	t.Parallel()
	image := os.Getenv(EnvSandboxImage)
	if image == "" {
		t.Skipf("%s is not set: the test runs the real sandbox image", EnvSandboxImage)
	}
	e := newClusterEnv(t)
	must(t, e.c.Create(e.ctx, &v1alpha1.EgressProxy{
		ObjectMeta: metav1.ObjectMeta{Name: "egress", Namespace: e.ns},
		Spec:       v1alpha1.EgressProxySpec{Mode: v1alpha1.EgressProxyModePerAgent, AllowedDomains: []v1alpha1.Domain{"example.invalid"}},
	}))
	e.template("tpl", func(tpl *v1alpha1.SandboxTemplate) {
		tpl.Spec.Image = image
		tpl.Spec.EgressProxyRef = &v1alpha1.LocalObjectReference{Name: "egress"}
	})
	e.sandbox("agent", "tpl")

	var pod corev1.Pod
	e.eventually("the sandbox's own pod to be ready", func() error {
		if err := e.get(PodName("agent"), &pod); err != nil {
			return err
		}
		if !podReady(&pod) {
			return fmt.Errorf("pod is %s", pod.Status.Phase)
		}
		return nil
	})
	// Two more passes' worth: it must still wait, and say what for.
	time.Sleep(3 * time.Second)
	var sbx v1alpha1.Sandbox
	must(t, e.get("agent", &sbx))
	c := meta.FindStatusCondition(sbx.Status.Conditions, v1alpha1.ConditionReady)
	if sbx.Status.Phase == v1alpha1.SandboxPhaseRunning || c == nil || c.Status != metav1.ConditionFalse ||
		!strings.Contains(c.Message, "waiting for its egress proxy pod "+EgressServiceName("agent")) {
		t.Fatalf("with its pod ready and no proxy: phase %s, Ready %+v", sbx.Status.Phase, c)
	}
	t.Logf("waiting as it should: %s: %s", c.Reason, c.Message)

	start := time.Now()
	e.startEgressManager(testEgressReconciler())
	e.waitReason("agent", v1alpha1.ReasonRunning)
	var proxyPod corev1.Pod
	must(t, e.get(EgressServiceName("agent"), &proxyPod))
	if !podReady(&proxyPod) {
		t.Errorf("the sandbox is Running and its proxy pod is not ready: %+v", proxyPod.Status)
	}
	t.Logf("Running %s after the egress proxy controller started", time.Since(start).Round(time.Millisecond))
}
