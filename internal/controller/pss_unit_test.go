package controller

import (
	"context"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	psapi "k8s.io/pod-security-admission/api"
	"k8s.io/pod-security-admission/policy"
	"k8s.io/utils/ptr"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
)

// The pods the controllers create run in users' namespaces, which may
// enforce the restricted Pod Security Standard: a pod that fails it is
// refused by the API server and the sandbox never starts. These tests let
// the controllers create their pods against the fake client and evaluate
// what they created with the library the PodSecurity admission plugin uses.

// restrictedViolations evaluates a pod against restricted/latest and
// reports each failed check with its reason and detail.
func restrictedViolations(t *testing.T, what string, meta *metav1.ObjectMeta, spec *corev1.PodSpec) {
	t.Helper()
	ev, err := policy.NewEvaluator(policy.DefaultChecks(), nil)
	if err != nil {
		t.Fatal(err)
	}
	lv := psapi.LevelVersion{Level: psapi.LevelRestricted, Version: psapi.LatestVersion()}
	failed := 0
	for _, res := range ev.EvaluatePod(lv, meta, spec) {
		if !res.Allowed {
			failed++
			t.Errorf("%s violates restricted/latest: %s (%s)", what, res.ForbiddenReason, res.ForbiddenDetail)
		}
	}
	if failed == 0 {
		t.Logf("%s meets restricted/latest (%d containers, %d volumes)", what, len(spec.Containers), len(spec.Volumes))
	}
}

// checkCreatedPods evaluates every Pod and Deployment the fake client
// holds in unitNS, and fails unless the wanted ones are among them.
func checkCreatedPods(t *testing.T, c client.Client, wantPods, wantDeployments []string) {
	t.Helper()
	ctx := context.Background()
	var pods corev1.PodList
	must(t, c.List(ctx, &pods, client.InNamespace(unitNS)))
	seen := map[string]bool{}
	for i := range pods.Items {
		p := &pods.Items[i]
		seen["Pod "+p.Name] = true
		restrictedViolations(t, "Pod "+p.Name, &p.ObjectMeta, &p.Spec)
	}
	var deps appsv1.DeploymentList
	must(t, c.List(ctx, &deps, client.InNamespace(unitNS)))
	for i := range deps.Items {
		d := &deps.Items[i]
		seen["Deployment "+d.Name] = true
		restrictedViolations(t, "Deployment "+d.Name, &d.Spec.Template.ObjectMeta, &d.Spec.Template.Spec)
	}
	for _, n := range wantPods {
		if !seen["Pod "+n] {
			t.Errorf("the controller created no Pod %s (created: %v)", n, seen)
		}
	}
	for _, n := range wantDeployments {
		if !seen["Deployment "+n] {
			t.Errorf("the controller created no Deployment %s (created: %v)", n, seen)
		}
	}
}

// TestUnitSandboxPodRestricted covers the sandbox pod of a bare template,
// of one that uses every option adding volumes, variables and scheduling
// to the pod, and of one that runs as its image's user.
func TestUnitSandboxPodRestricted(t *testing.T) {
	full := unitTemplate("full")
	full.Spec.Image = "registry.example.com/team/python:3.13"
	full.Spec.ImagePullPolicy = corev1.PullAlways
	full.Spec.RuntimeClassName = "gvisor-custom"
	full.Spec.Env = []corev1.EnvVar{{Name: "A", Value: "1"}}
	full.Spec.SecretFiles = []v1alpha1.SecretFile{{SecretName: "gcp", MountPath: "/etc/gcp"}, {SecretName: "npmrc", MountPath: "/etc/npm"}}
	full.Spec.Workspace.MountPath = "/home/agent"
	full.Spec.NodeSelector = map[string]string{"pool": "gvisor"}
	full.Spec.Tolerations = []corev1.Toleration{{Key: "gvisor", Operator: corev1.TolerationOpExists}}
	full.Spec.Resources = corev1.ResourceRequirements{
		Requests: corev1.ResourceList{corev1.ResourceCPU: resource.MustParse("250m"), corev1.ResourceMemory: resource.MustParse("512Mi")},
		Limits:   corev1.ResourceList{corev1.ResourceMemory: resource.MustParse("1Gi")},
	}

	// The image's own user: restricted still, since runAsNonRoot stays.
	own := unitTemplate("own")
	own.Spec.Image = "node:22"
	own.Spec.RunAsImageUser = true

	f := newFakeEnv(t, unitTemplate("bare"), full, own, unitSandbox("plain", "bare"), unitSandbox("rich", "full"), unitSandbox("mine", "own"))
	f.reconcile("plain")
	f.reconcile("rich")
	f.reconcile("mine")
	checkCreatedPods(t, f.c, []string{PodName("plain"), PodName("rich"), PodName("mine")}, nil)
}

// TestUnitEgressProxyPodsRestricted covers both proxy modes: the PerAgent
// proxy pod beside a sandbox, the Shared proxy's Deployment, and the
// sandbox pods wired to each (proxy variables, Shared credentials).
func TestUnitEgressProxyPodsRestricted(t *testing.T) {
	ctx := context.Background()
	t.Run("PerAgent", func(t *testing.T) {
		e := newEgressEnv(t, unitEgressProxy("egress"), upstreamSecret(), proxiedTemplate("t", "egress"), unitSandbox("s", "t"))
		if _, err := e.sr.Reconcile(ctx, ctrl.Request{NamespacedName: types.NamespacedName{Namespace: unitNS, Name: "s"}}); err != nil {
			t.Fatal(err)
		}
		e.reconcileProxy("egress")
		checkCreatedPods(t, e.c, []string{PodName("s"), EgressServiceName("s")}, nil)
	})
	t.Run("Shared", func(t *testing.T) {
		ep := unitEgressProxy("egress")
		ep.Spec.Mode = v1alpha1.EgressProxyModeShared
		ep.Spec.Replicas = ptr.To[int32](2)
		e := newEgressEnv(t, ep, upstreamSecret(), proxiedTemplate("t", "egress"), unitSandbox("s", "t"))
		if _, err := e.sr.Reconcile(ctx, ctrl.Request{NamespacedName: types.NamespacedName{Namespace: unitNS, Name: "s"}}); err != nil {
			t.Fatal(err)
		}
		e.reconcileProxy("egress")
		checkCreatedPods(t, e.c, []string{PodName("s")}, []string{egressSharedName("egress")})
	})
}
