package controller

import (
	"reflect"
	"slices"
	"testing"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor"
)

// checkSupervisorInjected checks that a sandbox pod runs the supervisor it
// installs, not the image's own: an init container from supervisorImage
// installs it into an emptyDir, which the sandbox container mounts
// read-only and runs the supervisor from, as its whole command (no args,
// so neither the image's entrypoint nor its command run); the init
// container is as confined as the sandbox container and asks for the
// same resources.
func checkSupervisorInjected(t *testing.T, spec *corev1.PodSpec, supervisorImage string) {
	t.Helper()
	if len(spec.InitContainers) != 1 || len(spec.Containers) != 1 {
		t.Fatalf("%d init containers and %d containers, want 1 and 1", len(spec.InitContainers), len(spec.Containers))
	}
	ini, ctr := spec.InitContainers[0], spec.Containers[0]
	if ini.Name != InstallContainerName || ini.Image != supervisorImage {
		t.Errorf("init container %s from %s, want %s from %s", ini.Name, ini.Image, InstallContainerName, supervisorImage)
	}
	if want := []string{"/usr/local/bin/agentbox-supervisor", "-install", "/agentbox/bin",
		"-seal-key-from", "/agentbox/seal/env-seal.key", "-seal-key-to", "/tmp/.agentbox-env-seal.key"}; !slices.Equal(ini.Command, want) || len(ini.Args) != 0 {
		t.Errorf("init container runs %q %q, want %q", ini.Command, ini.Args, want)
	}
	if want := []string{"/agentbox/bin/agentbox-supervisor"}; !slices.Equal(ctr.Command, want) || len(ctr.Args) != 0 {
		t.Errorf("sandbox container runs %q %q, want %q alone", ctr.Command, ctr.Args, want)
	}
	if p := ctr.LivenessProbe; p == nil || p.Exec == nil || len(p.Exec.Command) == 0 || p.Exec.Command[0] != ctr.Command[0] {
		t.Errorf("liveness probe %+v does not run the installed supervisor", p)
	}
	volumes := map[string]corev1.Volume{}
	for _, v := range spec.Volumes {
		volumes[v.Name] = v
	}
	mountOf := func(c corev1.Container) (corev1.VolumeMount, bool) {
		for _, m := range c.VolumeMounts {
			if m.MountPath == "/agentbox/bin" {
				return m, true
			}
		}
		return corev1.VolumeMount{}, false
	}
	im, iok := mountOf(ini)
	cm, cok := mountOf(ctr)
	if !iok || !cok || im.Name != cm.Name || im.ReadOnly || !cm.ReadOnly {
		t.Errorf("/agentbox/bin: init container %+v, sandbox container %+v; want one volume, writable in the init container only", im, cm)
	}
	if v := volumes[im.Name]; v.EmptyDir == nil || v.EmptyDir.SizeLimit == nil || v.EmptyDir.SizeLimit.Cmp(resource.MustParse("64Mi")) != 0 {
		t.Errorf("volume %s is %+v, want an emptyDir of 64Mi", im.Name, v.VolumeSource)
	}
	// The supervisor volume, the seal key (the init container's alone)
	// and /tmp, through which the key reaches the supervisor; never the
	// workspace, but on a reused warm sandbox's reset.
	var paths []string
	for _, m := range ini.VolumeMounts {
		paths = append(paths, m.MountPath)
	}
	if want := []string{"/agentbox/bin", "/agentbox/seal", "/tmp"}; !slices.Equal(paths, want) {
		t.Errorf("init container mounts %q, want %q", paths, want)
	}
	for _, m := range ctr.VolumeMounts {
		if m.MountPath == "/agentbox/seal" || m.Name == volumeSealKey {
			t.Errorf("the sandbox container mounts the seal key: %+v", m)
		}
	}
	for _, v := range spec.Volumes {
		if v.Name == volumeTLS && (v.Secret == nil || len(v.Secret.Items) != 3) {
			t.Errorf("the TLS volume %+v must project the certificate files alone, not the seal key", v.VolumeSource)
		}
	}
	if !reflect.DeepEqual(ini.SecurityContext, ctr.SecurityContext) || ini.SecurityContext == nil {
		t.Errorf("init container security context %+v, want the sandbox container's %+v", ini.SecurityContext, ctr.SecurityContext)
	}
	if !equalResources(ini.Resources, ctr.Resources) {
		t.Errorf("init container resources %+v, want the sandbox container's %+v", ini.Resources, ctr.Resources)
	}
	if len(ini.Env) != 0 || len(ini.EnvFrom) != 0 {
		t.Errorf("init container env %+v %+v, want none: it needs no secret of the template's", ini.Env, ini.EnvFrom)
	}
}

// TestUnitSupervisorInjected covers the pod shape that lets any image be a
// sandbox, with the default and a configured supervisor image, and with
// and without resources.
func TestUnitSupervisorInjected(t *testing.T) {
	tpl := unitTemplate("t")
	tpl.Spec.Image = "node:22"
	r := &SandboxReconciler{Namespace: "platform", TrustDomain: "td.example"}
	pod := r.desiredPod(unitSandbox("s", "t"), tpl)
	checkSupervisorInjected(t, &pod.Spec, DefaultSupervisorImage)
	if got := pod.Spec.InitContainers[0].ImagePullPolicy; got != corev1.PullIfNotPresent {
		t.Errorf("default pull policy %q, want IfNotPresent", got)
	}
	if got := pod.Spec.Containers[0].Image; got != "node:22" {
		t.Errorf("sandbox image %q, want the template's", got)
	}

	tpl.Spec.Resources = corev1.ResourceRequirements{
		Requests: corev1.ResourceList{corev1.ResourceCPU: resource.MustParse("250m"), corev1.ResourceMemory: resource.MustParse("512Mi")},
		Limits:   corev1.ResourceList{corev1.ResourceCPU: resource.MustParse("250m"), corev1.ResourceMemory: resource.MustParse("512Mi")},
		Claims:   []corev1.ResourceClaim{{Name: "gpu"}},
	}
	r.SupervisorImage, r.SupervisorImagePullPolicy = "mirror.example/agentbox/agentbox-supervisor:1.2.3", corev1.PullAlways
	pod = r.desiredPod(unitSandbox("s", "t"), tpl)
	checkSupervisorInjected(t, &pod.Spec, r.SupervisorImage)
	if got := pod.Spec.InitContainers[0].ImagePullPolicy; got != corev1.PullAlways {
		t.Errorf("pull policy %q, want the configured Always", got)
	}
	if c := pod.Spec.InitContainers[0].Resources.Claims; len(c) != 0 {
		t.Errorf("init container claims %v, want none", c)
	}
	if tpl.Spec.Resources.Claims == nil {
		t.Error("building the pod changed the template's resources")
	}
}

// TestUnitPodEnvForAnyImage checks the variables a foreign image needs:
// HOME is the workspace unless the template sets one, GODEBUG keeps the
// supervisor's runtime lean and cannot be set by a template, and the
// supervisor is told to pass its whole environment on.
func TestUnitPodEnvForAnyImage(t *testing.T) {
	r := &SandboxReconciler{Namespace: "platform", TrustDomain: "td.example"}
	collect := func(env []corev1.EnvVar) map[string]string {
		t.Helper()
		out := map[string]string{}
		for _, e := range env {
			if _, dup := out[e.Name]; dup {
				t.Errorf("%s set twice", e.Name)
			}
			out[e.Name] = e.Value
		}
		return out
	}
	tpl := unitTemplate("t")
	tpl.Spec.Workspace.MountPath = "/home/agent"
	tpl.Spec.Env = []corev1.EnvVar{{Name: "GODEBUG", Value: "gctrace=1"}}
	env := collect(r.podEnv(unitSandbox("s", "t"), tpl))
	if env["HOME"] != "/home/agent" {
		t.Errorf("HOME %q, want the workspace /home/agent", env["HOME"])
	}
	if env["GODEBUG"] != "profstackdepth=0" {
		t.Errorf("GODEBUG %q, want the supervisor's profstackdepth=0", env["GODEBUG"])
	}
	if env["AGENTBOX_PASS_ENV"] != "*" {
		t.Errorf("AGENTBOX_PASS_ENV %q, want *", env["AGENTBOX_PASS_ENV"])
	}
	tpl.Spec.Env = []corev1.EnvVar{{Name: "HOME", Value: "/srv/home"}}
	if env := collect(r.podEnv(unitSandbox("s", "t"), tpl)); env["HOME"] != "/srv/home" {
		t.Errorf("HOME %q, want the template's /srv/home", env["HOME"])
	}
}

// TestUnitSupervisorPassEnv checks that what the controller configures
// makes the supervisor pass on what a command needs and nothing of its own:
// the pod's environment as the container runtime gives it (the image's ENV
// under the pod's env, and kubelet's variables), run through the
// supervisor's own parser and filter.
func TestUnitSupervisorPassEnv(t *testing.T) {
	r := &SandboxReconciler{Namespace: "platform", TrustDomain: "td.example"}
	tpl := unitTemplate("t")
	tpl.Spec.Env = []corev1.EnvVar{
		{Name: "GREETING", Value: "hello"},
		{Name: "ODD,NAME", Value: "commas are legal in names"},
		{Name: "PATH", Value: "/opt/tools/bin:/usr/bin:/bin"},
		{Name: "AGENTBOX_LOG_LEVEL", Value: "debug"},
	}
	// The image's ENV first, the pod's env over it, as the runtime merges
	// them, then kubelet's own.
	environ := []string{"NODE_VERSION=22.11.0", "PATH=/usr/local/node/bin:/usr/bin:/bin", "HOME=/root", "GODEBUG=madvdontneed=1"}
	var raw string
	for _, e := range r.podEnv(unitSandbox("s", "t"), tpl) {
		environ = append(environ, e.Name+"="+e.Value)
		if e.Name == "AGENTBOX_PASS_ENV" {
			raw = e.Value
		}
	}
	environ = append(environ, "KUBERNETES_SERVICE_HOST=10.96.0.1", "KUBERNETES_PORT=tcp://10.96.0.1:443", "HTTP_PROXY=http://10.0.0.9:3128")
	names, err := supervisor.ParseEnvNames(raw)
	if err != nil {
		t.Fatalf("the supervisor cannot read AGENTBOX_PASS_ENV %q: %v", raw, err)
	}
	if err := supervisor.CheckPassEnv(names); err != nil {
		t.Errorf("the supervisor refuses AGENTBOX_PASS_ENV %q: %v", raw, err)
	}
	got := supervisor.PassedEnv(names, environ)
	want := map[string]string{
		"NODE_VERSION": "22.11.0", "GREETING": "hello", "ODD,NAME": "commas are legal in names",
		"PATH": "/opt/tools/bin:/usr/bin:/bin", "HOME": "/workspace", "HTTP_PROXY": "http://10.0.0.9:3128",
	}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("commands get %v, want %v", got, want)
	}
}

// A reused warm sandbox's new pod resets the workspace in its init
// container, and says which lease's reset it ran.
func TestUnitPoolResetPod(t *testing.T) {
	tpl := unitTemplate("t")
	r := &SandboxReconciler{Namespace: "platform", TrustDomain: "td.example"}
	sbx := unitSandbox("s", "t")
	sbx.Annotations = map[string]string{v1alpha1.AnnotationPoolReset: "req-a"}
	pod := r.desiredPod(sbx, tpl)
	ini := pod.Spec.InitContainers[0]
	if n := len(ini.Command); n < 2 || ini.Command[n-2] != "-reset-workspace" || ini.Command[n-1] != "/workspace" {
		t.Errorf("init container runs %q, want -reset-workspace /workspace last", ini.Command)
	}
	workspace := false
	for _, m := range ini.VolumeMounts {
		workspace = workspace || (m.Name == volumeWorkspace && m.MountPath == "/workspace" && !m.ReadOnly)
	}
	if !workspace || pod.Annotations[v1alpha1.AnnotationPoolReset] != "req-a" {
		t.Errorf("reset pod: mounts %+v, annotations %v", ini.VolumeMounts, pod.Annotations)
	}
}
