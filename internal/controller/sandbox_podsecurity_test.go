package controller

import (
	"fmt"
	"os"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	psapi "k8s.io/pod-security-admission/api"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	"github.com/agentbox/terraform-provider-agentbox/internal/chart"
	"github.com/agentbox/terraform-provider-agentbox/internal/testenv"
)

// TestSandboxInRestrictedNamespace runs a sandbox behind a PerAgent egress
// proxy in a namespace labelled as the platform labels the namespaces it
// creates, on the real API server, which enforces Pod Security labels:
// both pods are admitted and become ready, while a pod that breaks
// restricted is refused there. The sandbox reports the namespace enforcing
// restricted, and reports, with a warning, when its owner relaxes it.
func TestSandboxInRestrictedNamespace(t *testing.T) {
	t.Parallel()
	image := os.Getenv(EnvSandboxImage)
	if image == "" {
		t.Skipf("%s is not set: the sandbox pod must become ready", EnvSandboxImage)
	}
	proxyImage := os.Getenv(EnvEgressProxyImage)
	if proxyImage == "" {
		proxyImage = DefaultEgressProxyImage
	}
	e := newClusterEnv(t)
	setNamespaceLabels(e, chart.RestrictedNamespaceLabels())

	// Enforced: the API server refuses what restricted forbids here.
	root := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "root", Namespace: e.ns},
		Spec: corev1.PodSpec{Containers: []corev1.Container{{
			Name: "c", Image: image, ImagePullPolicy: corev1.PullNever,
			SecurityContext: &corev1.SecurityContext{RunAsUser: ptr.To[int64](0)},
		}}},
	}
	if err := e.c.Create(e.ctx, root, client.DryRunAll); !apierrors.IsForbidden(err) || !strings.Contains(err.Error(), "restricted") {
		t.Fatalf("a root pod in the test namespace: %v, want it forbidden by PodSecurity restricted", err)
	}

	e.startEgressManager(&EgressProxyReconciler{Namespace: testPlatformNamespace, Image: proxyImage, RuntimeClassName: testenv.RuntimeClass})
	must(t, e.c.Create(e.ctx, &v1alpha1.EgressProxy{
		ObjectMeta: metav1.ObjectMeta{Name: "egress", Namespace: e.ns},
		Spec:       v1alpha1.EgressProxySpec{Mode: v1alpha1.EgressProxyModePerAgent, AllowedDomains: []v1alpha1.Domain{"example.invalid"}},
	}))
	e.template("tpl", func(tpl *v1alpha1.SandboxTemplate) {
		tpl.Spec.Image = image
		tpl.Spec.EgressProxyRef = &v1alpha1.LocalObjectReference{Name: "egress"}
	})
	e.sandbox("strict", "tpl")
	sbx := e.waitReason("strict", v1alpha1.ReasonRunning)
	var proxyPod corev1.Pod
	e.eventually("the proxy pod to be ready", func() error {
		if err := e.get(EgressServiceName("strict"), &proxyPod); err != nil {
			return err
		}
		if !podReady(&proxyPod) {
			return fmt.Errorf("proxy pod is %s", proxyPod.Status.Phase)
		}
		return nil
	})
	if c := meta.FindStatusCondition(sbx.Status.Conditions, v1alpha1.ConditionPodSecurity); c == nil ||
		c.Status != metav1.ConditionTrue || c.Reason != v1alpha1.ReasonRestrictedEnforced {
		t.Errorf("PodSecurity condition %+v in a namespace enforcing restricted", c)
	}

	// Its owner relaxes the namespace: the sandbox says so, with a warning,
	// and the namespace is left as its owner set it.
	setNamespaceLabels(e, map[string]string{psapi.EnforceLevelLabel: string(psapi.LevelBaseline)})
	e.eventually("the PodSecurity condition to turn False", func() error {
		if err := e.get("strict", sbx); err != nil {
			return err
		}
		c := meta.FindStatusCondition(sbx.Status.Conditions, v1alpha1.ConditionPodSecurity)
		if c == nil || c.Status != metav1.ConditionFalse || c.Reason != v1alpha1.ReasonRestrictedNotEnforced ||
			!strings.Contains(c.Message, psapi.EnforceLevelLabel+"=baseline") {
			return fmt.Errorf("condition %+v", c)
		}
		return nil
	})
	e.eventually("a PodSecurityNotEnforced warning", func() error {
		var evs corev1.EventList
		if err := e.c.List(e.ctx, &evs, client.InNamespace(e.ns)); err != nil {
			return err
		}
		for _, ev := range evs.Items {
			if ev.Reason == EventPodSecurityNotEnforced && ev.Type == corev1.EventTypeWarning && ev.InvolvedObject.Name == "strict" {
				return nil
			}
		}
		return fmt.Errorf("none among %d events", len(evs.Items))
	})
	if c := readyReason(sbx); c != v1alpha1.ReasonRunning {
		t.Errorf("Ready reason %s: reporting the namespace must not stop the sandbox", c)
	}
	var ns corev1.Namespace
	must(t, e.c.Get(e.ctx, types.NamespacedName{Name: e.ns}, &ns))
	if ns.Labels[psapi.EnforceLevelLabel] != string(psapi.LevelBaseline) {
		t.Errorf("the namespace was relabelled: %v", ns.Labels)
	}
}

// setNamespaceLabels replaces the Pod Security labels of the test's
// namespace with labels.
func setNamespaceLabels(e *clusterEnv, labels map[string]string) {
	e.t.Helper()
	var ns corev1.Namespace
	must(e.t, e.c.Get(e.ctx, types.NamespacedName{Name: e.ns}, &ns))
	patch := client.MergeFrom(ns.DeepCopy())
	for k := range ns.Labels {
		if strings.HasPrefix(k, "pod-security.kubernetes.io/") {
			delete(ns.Labels, k)
		}
	}
	if ns.Labels == nil {
		ns.Labels = map[string]string{}
	}
	for k, v := range labels {
		ns.Labels[k] = v
	}
	must(e.t, e.c.Patch(e.ctx, &ns, patch))
}
