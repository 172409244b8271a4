package controller

import (
	"context"
	"slices"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
)

// TestUnitRunAsImageUser: with runAsImageUser neither the pod nor the
// sandbox container names a user or group, so the image's applies, while
// runAsNonRoot, fsGroup and the init container's own user stay.
func TestUnitRunAsImageUser(t *testing.T) {
	tpl := unitTemplate("t")
	tpl.Spec.Image = "node:22"
	r := &SandboxReconciler{Namespace: "platform", TrustDomain: "td.example"}

	pod := r.desiredPod(unitSandbox("s", "t"), tpl)
	if sc := pod.Spec.SecurityContext; sc.RunAsUser == nil || *sc.RunAsUser != sandboxUID {
		t.Errorf("by default the pod runs as %v, want %d", sc.RunAsUser, sandboxUID)
	}

	tpl.Spec.RunAsImageUser = true
	pod = r.desiredPod(unitSandbox("s", "t"), tpl)
	psc, csc, isc := pod.Spec.SecurityContext, pod.Spec.Containers[0].SecurityContext, pod.Spec.InitContainers[0].SecurityContext
	if psc.RunAsUser != nil || psc.RunAsGroup != nil || csc.RunAsUser != nil || csc.RunAsGroup != nil {
		t.Errorf("pod %v/%v and container %v/%v name a user or group; the image's must apply", psc.RunAsUser, psc.RunAsGroup, csc.RunAsUser, csc.RunAsGroup)
	}
	if psc.RunAsNonRoot == nil || !*psc.RunAsNonRoot || csc.RunAsNonRoot == nil || !*csc.RunAsNonRoot {
		t.Error("runAsNonRoot was dropped with the user")
	}
	if psc.FSGroup == nil || *psc.FSGroup != sandboxUID {
		t.Errorf("fsGroup %v, want %d: the image's user reaches the workspace through it", psc.FSGroup, sandboxUID)
	}
	if isc.RunAsUser == nil || *isc.RunAsUser != sandboxUID {
		t.Errorf("the init container runs as %v, want its own %d", isc.RunAsUser, sandboxUID)
	}
}

// TestUnitImageRunsAsRoot: kubelet's refusal of a root image under
// runAsNonRoot becomes its own reason, which says what to change.
func TestUnitImageRunsAsRoot(t *testing.T) {
	tpl := unitTemplate("t")
	tpl.Spec.RunAsImageUser = true
	f := newFakeEnv(t, unitSandbox("s", "t"), tpl)
	f.reconcile("s")
	ctx := context.Background()
	var pod corev1.Pod
	must(t, f.c.Get(ctx, types.NamespacedName{Namespace: unitNS, Name: "s"}, &pod))
	pod.Status = corev1.PodStatus{Phase: corev1.PodPending, ContainerStatuses: []corev1.ContainerStatus{{
		Name: ContainerName, State: corev1.ContainerState{Waiting: &corev1.ContainerStateWaiting{
			Reason:  "CreateContainerConfigError",
			Message: `container has runAsNonRoot and image will run as root (pod: "s_ns(uid)", container: sandbox)`,
		}},
	}}}
	must(t, f.c.Status().Update(ctx, &pod))
	f.drainEvents()
	f.reconcile("s")
	c := f.ready("s")
	if c.Reason != v1alpha1.ReasonImageRunsAsRoot || f.sandbox("s").Status.Phase != v1alpha1.SandboxPhaseError {
		t.Fatalf("condition %s: %s, want %s in phase Error", c.Reason, c.Message, v1alpha1.ReasonImageRunsAsRoot)
	}
	for _, says := range []string{"image will run as root", "numeric non-root USER", "runAsImageUser off"} {
		if !strings.Contains(c.Message, says) {
			t.Errorf("message %q does not say %q", c.Message, says)
		}
	}
	if evs := f.drainEvents(); len(evs) != 1 || !strings.Contains(evs[0], v1alpha1.ReasonImageRunsAsRoot) {
		t.Errorf("events %q, want one %s", evs, v1alpha1.ReasonImageRunsAsRoot)
	}
}

// TestUnitSandboxPullPolicy: the platform's pull policy applies to its
// default image only; a named image is IfNotPresent; the template's own
// policy wins over both.
func TestUnitSandboxPullPolicy(t *testing.T) {
	r := &SandboxReconciler{Namespace: "platform", TrustDomain: "td.example", DefaultImage: "agentbox/agentbox-sandbox:dev", DefaultImagePullPolicy: corev1.PullNever}
	for _, tc := range []struct {
		image  string
		policy corev1.PullPolicy
		want   corev1.PullPolicy
	}{
		{"", "", corev1.PullNever},
		{"node:22", "", corev1.PullIfNotPresent},
		{"", corev1.PullAlways, corev1.PullAlways},
		{"node:22", corev1.PullAlways, corev1.PullAlways},
	} {
		tpl := unitTemplate("t")
		tpl.Spec.Image, tpl.Spec.ImagePullPolicy = tc.image, tc.policy
		if got := r.desiredPod(unitSandbox("s", "t"), tpl).Spec.Containers[0].ImagePullPolicy; got != tc.want {
			t.Errorf("image %q, template policy %q: %q, want %q", tc.image, tc.policy, got, tc.want)
		}
	}
}

// TestUnitReservedMountPaths: the folders the CRD and the provider refuse
// for a template's mounts are exactly those the pod mounts itself.
func TestUnitReservedMountPaths(t *testing.T) {
	_, mounts := podVolumes(unitSandbox("s", "t"), unitTemplate("t"))
	var platform []string
	for _, m := range mounts {
		if m.Name != volumeWorkspace {
			platform = append(platform, m.MountPath)
		}
	}
	slices.Sort(platform)
	reserved := slices.Sorted(slices.Values(v1alpha1.ReservedMountPaths))
	if !slices.Equal(platform, reserved) {
		t.Errorf("the pod mounts %v, the template refuses %v", platform, reserved)
	}
}
