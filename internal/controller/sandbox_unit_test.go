package controller

import (
	"bytes"
	"context"
	"net"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	k8sruntime "k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/tools/events"
	clocktesting "k8s.io/utils/clock/testing"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/client/fake"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	"github.com/agentbox/terraform-provider-agentbox/internal/pki"
)

// These tests use controller-runtime's fake client for paths a real
// cluster makes awkward to reach: a foreign object in the way, certificate
// rotation by the clock, pod states kubelet produces only on failure.

const unitNS = "team-a"

type fakeEnv struct {
	t     *testing.T
	c     client.Client
	r     *SandboxReconciler
	clock *clocktesting.FakeClock
	rec   *events.FakeRecorder
}

func newFakeEnv(t *testing.T, objs ...client.Object) *fakeEnv {
	t.Helper()
	scheme := k8sruntime.NewScheme()
	must(t, clientgoscheme.AddToScheme(scheme))
	must(t, v1alpha1.AddToScheme(scheme))
	c := fake.NewClientBuilder().WithScheme(scheme).
		WithStatusSubresource(&v1alpha1.Sandbox{}, &v1alpha1.SandboxWarmPool{}, &corev1.Pod{}).
		WithObjects(objs...).WithIndex(&v1alpha1.Sandbox{}, agentIDIndex, indexAgentID).Build()
	ca, err := pki.NewCA("unit CA")
	must(t, err)
	clk := clocktesting.NewFakeClock(time.Now())
	rec := events.NewFakeRecorder(100)
	r := &SandboxReconciler{
		Client: c, Scheme: scheme, Recorder: rec, Namespace: "agentbox-system",
		DefaultImage: "agentbox/agentbox-sandbox:dev", CA: ca, Clock: clk,
	}
	return &fakeEnv{t: t, c: c, r: r, clock: clk, rec: rec}
}

func unitSandbox(name, template string) *v1alpha1.Sandbox {
	return &v1alpha1.Sandbox{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: unitNS, UID: types.UID("uid-" + name), Generation: 1},
		Spec:       v1alpha1.SandboxSpec{AgentID: "agent-" + name, TemplateRef: v1alpha1.LocalObjectReference{Name: template}},
	}
}

func unitTemplate(name string) *v1alpha1.SandboxTemplate {
	return &v1alpha1.SandboxTemplate{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: unitNS}}
}

func (f *fakeEnv) reconcile(name string) ctrl.Result {
	f.t.Helper()
	res, err := f.r.Reconcile(context.Background(), ctrl.Request{NamespacedName: types.NamespacedName{Namespace: unitNS, Name: name}})
	if err != nil {
		f.t.Fatalf("reconcile %s: %v", name, err)
	}
	return res
}

func (f *fakeEnv) sandbox(name string) *v1alpha1.Sandbox {
	f.t.Helper()
	var sbx v1alpha1.Sandbox
	must(f.t, f.c.Get(context.Background(), types.NamespacedName{Namespace: unitNS, Name: name}, &sbx))
	return &sbx
}

func (f *fakeEnv) ready(name string) *metav1.Condition {
	f.t.Helper()
	c := meta.FindStatusCondition(f.sandbox(name).Status.Conditions, v1alpha1.ConditionReady)
	if c == nil {
		f.t.Fatalf("sandbox %s has no Ready condition", name)
	}
	return c
}

func (f *fakeEnv) drainEvents() []string {
	var out []string
	for {
		select {
		case e := <-f.rec.Events:
			out = append(out, e)
		default:
			return out
		}
	}
}

func TestUnitTemplateNotFound(t *testing.T) {
	f := newFakeEnv(t, unitSandbox("s", "nope"))
	f.reconcile("s")
	sbx := f.sandbox("s")
	c := f.ready("s")
	if sbx.Status.Phase != v1alpha1.SandboxPhasePending || c.Reason != v1alpha1.ReasonTemplateNotFound || c.Status != metav1.ConditionFalse {
		t.Errorf("phase %s, Ready %s/%s; want Pending, False/TemplateNotFound", sbx.Status.Phase, c.Status, c.Reason)
	}
	if got := sbx.Labels[v1alpha1.LabelAgentIDHash]; got != v1alpha1.AgentIDHash("agent-s") {
		t.Errorf("agent-ID label %q", got)
	}
	var secrets corev1.SecretList
	must(t, f.c.List(context.Background(), &secrets))
	if len(secrets.Items) != 0 {
		t.Errorf("created %d Secrets while waiting for the template", len(secrets.Items))
	}
	f.drainEvents()
	rv := sbx.ResourceVersion
	f.reconcile("s")
	if f.sandbox("s").ResourceVersion != rv {
		t.Error("a second reconcile rewrote the waiting sandbox")
	}
	if evs := f.drainEvents(); len(evs) != 0 {
		t.Errorf("a second reconcile repeated events: %v", evs)
	}
}

func TestUnitOwnershipConflict(t *testing.T) {
	foreign := &corev1.Secret{
		ObjectMeta: metav1.ObjectMeta{Name: TLSSecretName("s"), Namespace: unitNS},
		Data:       map[string][]byte{"password": []byte("hunter2")},
	}
	f := newFakeEnv(t, unitSandbox("s", "t"), unitTemplate("t"), foreign)
	res := f.reconcile("s")
	c := f.ready("s")
	if c.Reason != v1alpha1.ReasonOwnershipConflict || f.sandbox("s").Status.Phase != v1alpha1.SandboxPhaseError {
		t.Errorf("Ready %s: %s", c.Reason, c.Message)
	}
	if res.RequeueAfter == 0 {
		t.Error("a conflict is not looked at again")
	}
	var got corev1.Secret
	must(t, f.c.Get(context.Background(), client.ObjectKeyFromObject(foreign), &got))
	if string(got.Data["password"]) != "hunter2" || len(got.OwnerReferences) != 0 {
		t.Errorf("the foreign Secret was touched: %+v", got)
	}
	if err := f.c.Get(context.Background(), types.NamespacedName{Namespace: unitNS, Name: "s"}, &corev1.Pod{}); err == nil {
		t.Error("a pod was created despite the conflict")
	}
}

func TestUnitCertificateRotation(t *testing.T) {
	f := newFakeEnv(t, unitSandbox("s", "t"), unitTemplate("t"))
	res := f.reconcile("s")
	if res.RequeueAfter <= 0 || res.RequeueAfter > maxRequeue {
		t.Errorf("RequeueAfter %s, want the time to renewal capped at %s", res.RequeueAfter, maxRequeue)
	}
	secret := func() *corev1.Secret {
		var s corev1.Secret
		must(t, f.c.Get(context.Background(), types.NamespacedName{Namespace: unitNS, Name: TLSSecretName("s")}, &s))
		return &s
	}
	first := secret()

	// Still fresh: nothing is re-issued.
	f.clock.Step(24 * time.Hour)
	f.reconcile("s")
	if secret().ResourceVersion != first.ResourceVersion {
		t.Fatal("a fresh certificate was re-issued")
	}

	// Past two thirds of a year's lifetime: re-issued.
	f.clock.Step(250 * 24 * time.Hour)
	f.reconcile("s")
	second := secret()
	if bytes.Equal(second.Data["tls.crt"], first.Data["tls.crt"]) {
		t.Error("an ageing certificate was not re-issued")
	}
	if !strings.Contains(strings.Join(f.drainEvents(), "\n"), EventCertificateReissued) {
		t.Error("no CertificateReissued event")
	}

	// A new CA: re-issued, and ca.crt follows.
	f.clock.SetTime(time.Now())
	ca, err := pki.NewCA("rotated CA")
	must(t, err)
	f.r.CA = ca
	f.reconcile("s")
	third := secret()
	if !bytes.Equal(third.Data["ca.crt"], ca.CertPEM) {
		t.Error("ca.crt is not the new CA")
	}
	if _, err := certRenewTime(third.Data, ca, pki.SandboxID("", unitNS, "s"), time.Now()); err != nil {
		t.Errorf("certificate after CA rotation: %v", err)
	}
}

func TestUnitPodStates(t *testing.T) {
	f := newFakeEnv(t, unitSandbox("s", "t"), unitTemplate("t"))
	f.reconcile("s")
	ctx := context.Background()
	var pod corev1.Pod
	must(t, f.c.Get(ctx, types.NamespacedName{Namespace: unitNS, Name: "s"}, &pod))
	if got := pod.Spec.Containers[0].Image; got != f.r.DefaultImage {
		t.Errorf("image %q, want the default %q", got, f.r.DefaultImage)
	}
	if got := pod.Spec.Containers[0].ImagePullPolicy; got != corev1.PullIfNotPresent {
		t.Errorf("pull policy %q, want IfNotPresent", got)
	}
	if c := f.ready("s"); c.Reason != v1alpha1.ReasonCreating {
		t.Errorf("after create: %s", c.Reason)
	}
	if evs := strings.Join(f.drainEvents(), "\n"); !strings.Contains(evs, EventPodCreated) || !strings.Contains(evs, EventWorkspaceCreated) {
		t.Errorf("events %q lack PodCreated and WorkspaceCreated", evs)
	}

	setStatus := func(st corev1.PodStatus) {
		t.Helper()
		must(t, f.c.Get(ctx, client.ObjectKeyFromObject(&pod), &pod))
		pod.Status = st
		must(t, f.c.Status().Update(ctx, &pod))
	}

	setStatus(corev1.PodStatus{Phase: corev1.PodPending, Conditions: []corev1.PodCondition{{
		Type: corev1.PodScheduled, Status: corev1.ConditionFalse, Reason: "Unschedulable", Message: "0/1 nodes are available",
	}}})
	f.reconcile("s")
	if c := f.ready("s"); c.Reason != v1alpha1.ReasonCreating || !strings.Contains(c.Message, "Unschedulable") {
		t.Errorf("unschedulable: %s: %s", c.Reason, c.Message)
	}

	setStatus(corev1.PodStatus{Phase: corev1.PodPending, ContainerStatuses: []corev1.ContainerStatus{{
		Name: ContainerName, State: corev1.ContainerState{Waiting: &corev1.ContainerStateWaiting{
			Reason: "ImagePullBackOff", Message: `Back-off pulling image "x"`,
		}},
	}}})
	f.reconcile("s")
	if c := f.ready("s"); c.Reason != v1alpha1.ReasonPodFailed || !strings.Contains(c.Message, "ImagePullBackOff") {
		t.Errorf("image pull: %s: %s", c.Reason, c.Message)
	}
	if evs := f.drainEvents(); len(evs) != 1 || !strings.Contains(evs[0], EventPodFailed) {
		t.Errorf("events %q, want one PodFailed", evs)
	}

	setStatus(corev1.PodStatus{
		Phase: corev1.PodRunning, PodIP: "198.18.0.7",
		Conditions: []corev1.PodCondition{{Type: corev1.PodReady, Status: corev1.ConditionTrue}},
		ContainerStatuses: []corev1.ContainerStatus{{
			Name: ContainerName, Ready: true, State: corev1.ContainerState{Running: &corev1.ContainerStateRunning{}},
		}},
	})
	f.reconcile("s")
	sbx := f.sandbox("s")
	if c := f.ready("s"); c.Status != metav1.ConditionTrue || sbx.Status.Phase != v1alpha1.SandboxPhaseRunning ||
		sbx.Status.ServiceEndpoint != "https://198.18.0.7:8443" || sbx.Status.PodIP != "198.18.0.7" {
		t.Errorf("ready pod: %s %s/%s endpoint %q", sbx.Status.Phase, c.Status, c.Reason, sbx.Status.ServiceEndpoint)
	}

	// Evicted: the pod is removed and, on the next pass, created again.
	setStatus(corev1.PodStatus{Phase: corev1.PodFailed, Reason: "Evicted", Message: "The node was low on resource: memory."})
	f.reconcile("s")
	sbx = f.sandbox("s")
	if c := f.ready("s"); c.Reason != v1alpha1.ReasonPodFailed || !strings.Contains(c.Message, "Evicted") || sbx.Status.PodIP != "" {
		t.Errorf("evicted: %s: %s (podIP %q)", c.Reason, c.Message, sbx.Status.PodIP)
	}
	if err := f.c.Get(ctx, client.ObjectKeyFromObject(&pod), &corev1.Pod{}); err == nil {
		t.Fatal("the evicted pod was not deleted")
	}
	f.reconcile("s")
	// The fake client assigns no UIDs; a new pod is one without status.
	must(t, f.c.Get(ctx, client.ObjectKeyFromObject(&pod), &pod))
	if pod.Status.Phase != "" {
		t.Errorf("the evicted pod was not replaced (phase %s)", pod.Status.Phase)
	}
	if evs := strings.Join(f.drainEvents(), "\n"); !strings.Contains(evs, EventPodRecreated) {
		t.Errorf("events %q lack PodRecreated", evs)
	}
}

func TestUnitContainerProblem(t *testing.T) {
	status := func(cs corev1.ContainerStatus) *corev1.Pod {
		cs.Name = ContainerName
		return &corev1.Pod{Status: corev1.PodStatus{ContainerStatuses: []corev1.ContainerStatus{cs}}}
	}
	exited := &corev1.ContainerStateTerminated{ExitCode: 0, Reason: "Completed"}
	// installing is a pod whose init container has status init, and whose
	// sandbox container, if given, has status sandbox.
	installing := func(init corev1.ContainerStatus, sandbox *corev1.ContainerStatus) *corev1.Pod {
		init.Name = InstallContainerName
		pod := &corev1.Pod{Status: corev1.PodStatus{InitContainerStatuses: []corev1.ContainerStatus{init}}}
		if sandbox != nil {
			pod.Status.ContainerStatuses = []corev1.ContainerStatus{*sandbox}
		}
		return pod
	}
	for _, tc := range []struct {
		name    string
		pod     *corev1.Pod
		failed  bool
		message string
	}{
		{"creating", status(corev1.ContainerStatus{State: corev1.ContainerState{Waiting: &corev1.ContainerStateWaiting{Reason: "ContainerCreating"}}}), false, ""},
		{"running", status(corev1.ContainerStatus{State: corev1.ContainerState{Running: &corev1.ContainerStateRunning{}}}), false, ""},
		{"never pull", status(corev1.ContainerStatus{State: corev1.ContainerState{Waiting: &corev1.ContainerStateWaiting{Reason: "ErrImageNeverPull"}}}), true, "ErrImageNeverPull"},
		{"crash loop", status(corev1.ContainerStatus{
			RestartCount: 3, LastTerminationState: corev1.ContainerState{Terminated: exited},
			State: corev1.ContainerState{Waiting: &corev1.ContainerStateWaiting{Reason: "CrashLoopBackOff", Message: "back-off 40s"}},
		}), true, "CrashLoopBackOff: back-off 40s; it last exited with code 0 (Completed)"},
		{"just exited", status(corev1.ContainerStatus{State: corev1.ContainerState{Terminated: exited}}), true, "exited with code 0"},
		{"restarted, not ready", status(corev1.ContainerStatus{
			RestartCount: 1, LastTerminationState: corev1.ContainerState{Terminated: &corev1.ContainerStateTerminated{ExitCode: 2, Message: "bad flag"}},
			State: corev1.ContainerState{Running: &corev1.ContainerStateRunning{}},
		}), true, "exited with code 2: bad flag"},
		{"supervisor image missing", installing(corev1.ContainerStatus{State: corev1.ContainerState{Waiting: &corev1.ContainerStateWaiting{
			Reason: "ErrImageNeverPull", Message: `Container image "agentbox/agentbox-supervisor:dev" is not present`,
		}}}, nil), true, "the supervisor cannot be installed: container install-supervisor is waiting: ErrImageNeverPull: Container image \"agentbox/agentbox-supervisor:dev\""},
		{"install failed", installing(corev1.ContainerStatus{State: corev1.ContainerState{Terminated: &corev1.ContainerStateTerminated{
			ExitCode: 1, Message: "agentbox-supervisor -install: no space left on device",
		}}}, nil), true, "the supervisor cannot be installed: container install-supervisor exited with code 1: agentbox-supervisor -install: no space left on device"},
		{"installing", installing(corev1.ContainerStatus{State: corev1.ContainerState{Running: &corev1.ContainerStateRunning{}}},
			&corev1.ContainerStatus{Name: ContainerName, State: corev1.ContainerState{Waiting: &corev1.ContainerStateWaiting{Reason: "PodInitializing"}}}), false, ""},
		{"installed", installing(corev1.ContainerStatus{Ready: true, State: corev1.ContainerState{Terminated: exited}},
			&corev1.ContainerStatus{Name: ContainerName, State: corev1.ContainerState{Running: &corev1.ContainerStateRunning{}}}), false, ""},
		{"installed, then the sandbox crashed", installing(corev1.ContainerStatus{Ready: true, State: corev1.ContainerState{Terminated: exited}},
			&corev1.ContainerStatus{Name: ContainerName, State: corev1.ContainerState{Waiting: &corev1.ContainerStateWaiting{Reason: "CrashLoopBackOff"}}}), true,
			"container sandbox is waiting: CrashLoopBackOff"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			msg, failed := containerProblem(tc.pod)
			if failed != tc.failed || !strings.Contains(msg, tc.message) {
				t.Errorf("containerProblem = %q, %v; want failed=%v containing %q", msg, failed, tc.failed, tc.message)
			}
		})
	}
}

func TestUnitPodEnvPrecedence(t *testing.T) {
	r := &SandboxReconciler{Namespace: "platform", TrustDomain: "td.example"}
	tpl := unitTemplate("t")
	tpl.Spec.Env = []corev1.EnvVar{{Name: "A", Value: "1"}, {Name: "AGENTBOX_ALLOWED_CLIENT_IDS", Value: "spiffe://evil/x"}}
	tpl.Spec.Workspace.MountPath = "/home/agent"
	env := map[string]string{}
	for _, e := range r.podEnv(unitSandbox("s", "t"), tpl) {
		if _, dup := env[e.Name]; dup {
			t.Errorf("%s set twice", e.Name)
		}
		env[e.Name] = e.Value
	}
	if env["A"] != "1" {
		t.Error("the template's variable is missing")
	}
	if want := "spiffe://td.example/ns/platform/sa/agentbox-controlplane"; env["AGENTBOX_ALLOWED_CLIENT_IDS"] != want {
		t.Errorf("allowed client IDs %q, want %q", env["AGENTBOX_ALLOWED_CLIENT_IDS"], want)
	}
	if env["AGENTBOX_WORKDIR"] != "/home/agent" {
		t.Errorf("workdir %q, want the template's mount path", env["AGENTBOX_WORKDIR"])
	}
}

// The sandbox's container gets a liveness probe that runs the supervisor's
// own binary (the one the init container installed) in probe mode against its loopback health listener, whose
// address the pod's environment gives both; the probe's own timeout is
// within kubelet's, so that it reports a failure rather than being killed.
func TestUnitLivenessProbe(t *testing.T) {
	r := &SandboxReconciler{Namespace: "platform", TrustDomain: "td.example"}
	pod := r.desiredPod(unitSandbox("s", "t"), unitTemplate("t"))
	ctr := pod.Spec.Containers[0]
	p := ctr.LivenessProbe
	if p == nil || p.Exec == nil || len(p.Exec.Command) < 2 || p.Exec.Command[0] != "/agentbox/bin/agentbox-supervisor" || p.Exec.Command[1] != "-probe" {
		t.Fatalf("liveness probe %+v, want an exec of the supervisor with -probe", p)
	}
	timeout := 5 * time.Second // the supervisor's default -probe-timeout
	for i, a := range p.Exec.Command {
		if a == "-probe-timeout" && i+1 < len(p.Exec.Command) {
			d, err := time.ParseDuration(p.Exec.Command[i+1])
			if err != nil {
				t.Fatal(err)
			}
			timeout = d
		}
	}
	if timeout >= time.Duration(p.TimeoutSeconds)*time.Second {
		t.Errorf("-probe-timeout %v is not within kubelet's %ds", timeout, p.TimeoutSeconds)
	}
	if p.PeriodSeconds < 10 || p.FailureThreshold < 3 {
		t.Errorf("period %ds, threshold %d: too eager for a process start in gVisor each time", p.PeriodSeconds, p.FailureThreshold)
	}
	for _, e := range ctr.Env {
		if e.Name == "AGENTBOX_HEALTH_LISTEN" {
			host, _, err := net.SplitHostPort(e.Value)
			if ip := net.ParseIP(host); err != nil || ip == nil || !ip.IsLoopback() {
				t.Errorf("AGENTBOX_HEALTH_LISTEN=%q, want a loopback address", e.Value)
			}
			return
		}
	}
	t.Error("no AGENTBOX_HEALTH_LISTEN: the supervisor would serve no probe")
}

// A Sandbox deleted and re-created at once (terraform apply after someone
// deleted it) finds its predecessor's children still waiting for garbage
// collection. They are cleared and the new sandbox waits; it is no conflict.
func TestUnitLeftoverFromEarlierSandbox(t *testing.T) {
	yes := true
	old := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{
		Name: PodName("s"), Namespace: unitNS,
		OwnerReferences: []metav1.OwnerReference{{
			APIVersion: v1alpha1.GroupVersion.String(), Kind: "Sandbox", Name: "s", UID: "uid-of-the-earlier-sandbox", Controller: &yes,
		}},
	}}
	f := newFakeEnv(t, unitSandbox("s", "t"), unitTemplate("t"), old)
	res := f.reconcile("s")
	c := f.ready("s")
	if c.Reason != v1alpha1.ReasonCreating || f.sandbox("s").Status.Phase != v1alpha1.SandboxPhasePending {
		t.Errorf("phase %s, Ready %s: %s; want Pending, Creating", f.sandbox("s").Status.Phase, c.Reason, c.Message)
	}
	if res.RequeueAfter == 0 {
		t.Error("the sandbox does not look again once the leftover is gone")
	}
	if err := f.c.Get(context.Background(), client.ObjectKeyFromObject(old), &corev1.Pod{}); err == nil {
		t.Error("the earlier sandbox's pod was not deleted")
	}
	// With the leftover gone, the next pass creates the sandbox's own pod.
	f.reconcile("s")
	var pod corev1.Pod
	must(t, f.c.Get(context.Background(), client.ObjectKeyFromObject(old), &pod))
	if !metav1.IsControlledBy(&pod, f.sandbox("s")) {
		t.Errorf("pod owners %+v, want the new sandbox", pod.OwnerReferences)
	}
}
