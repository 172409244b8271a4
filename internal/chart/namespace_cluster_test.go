package chart

import (
	"context"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
	psapi "k8s.io/pod-security-admission/api"
	"k8s.io/utils/ptr"
)

// TestNamespacePodSecurity installs the platform, the runsc installer
// included, into a namespace that does not exist yet, on the real API
// server (which enforces Pod Security labels): the release namespace is
// created enforcing restricted, the control plane's pods are admitted
// there, a pod that breaks restricted is refused there, and the
// installer's own namespace is privileged. A namespace that existed
// already keeps its labels.
func TestNamespacePodSecurity(t *testing.T) {
	cfg, cs := clusterClients(t)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	ns := testNamespaceFor(t, cs, "chart-pss")
	installerNS := ns + "-runsc-installer"
	t.Cleanup(func() {
		_ = cs.CoreV1().Namespaces().Delete(context.Background(), installerNS, metav1.DeleteOptions{})
	})
	var logs []string
	c := New(cfg)
	c.Log = func(format string, args ...any) {
		t.Logf("helm: "+format, args...)
		logs = append(logs, format)
	}
	// Never: nothing may be pulled from the internet by a test; no node
	// is in a Managed pool, so the installer runs nowhere.
	opts := Options{Namespace: ns, ReleaseName: DefaultReleaseName, Values: Values{
		ImageTag: "absent", ImagePullPolicy: "Never", Raw: "runscInstaller: {enabled: true}",
	}}
	rel, err := c.Install(ctx, opts)
	if err != nil {
		t.Fatal(err)
	}

	got, err := cs.CoreV1().Namespaces().Get(ctx, ns, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	want := RestrictedNamespaceLabels()
	want[LabelManagedBy] = ManagedByValue
	for k, v := range want {
		if got.Labels[k] != v {
			t.Errorf("release namespace %s: label %s=%q, want %q (labels %v)", ns, k, got.Labels[k], v, got.Labels)
		}
	}
	inst, err := cs.CoreV1().Namespaces().Get(ctx, installerNS, metav1.GetOptions{})
	if err != nil {
		t.Fatalf("the installer's namespace: %v", err)
	}
	if inst.Labels[psapi.EnforceLevelLabel] != string(psapi.LevelPrivileged) {
		t.Errorf("installer namespace %s labels %v, want enforce=privileged", installerNS, inst.Labels)
	}
	if _, err := cs.AppsV1().DaemonSets(installerNS).Get(ctx, "agentbox-runsc-installer", metav1.GetOptions{}); err != nil {
		t.Errorf("the installer DaemonSet: %v", err)
	}
	// What the API server adds to the installer's Namespace is no drift.
	if drift, err := LiveDrift(ctx, cfg, rel); err != nil || len(drift) != 0 {
		t.Errorf("drift right after install: %v %v", drift, err)
	}

	// The control plane's pods pass admission under restricted: the
	// ReplicaSet creates them (they never start, their image is absent).
	waitControlPlanePod(t, ctx, cs, ns)
	// And the API server does enforce it there.
	root := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "root", Namespace: ns},
		Spec: corev1.PodSpec{Containers: []corev1.Container{{
			Name: "c", Image: "absent", ImagePullPolicy: corev1.PullNever,
			SecurityContext: &corev1.SecurityContext{RunAsUser: ptr.To[int64](0)},
		}}},
	}
	_, err = cs.CoreV1().Pods(ns).Create(ctx, root, metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}})
	if !apierrors.IsForbidden(err) || !strings.Contains(err.Error(), "restricted") {
		t.Errorf("a root pod in the release namespace: %v, want it forbidden by PodSecurity restricted", err)
	}

	// Someone relaxes the namespace the platform created; the next
	// upgrade restores it, and leaves others' labels alone.
	patch := `{"metadata":{"labels":{"` + psapi.EnforceLevelLabel + `":"privileged","team":"infra"}}}`
	if _, err := cs.CoreV1().Namespaces().Patch(ctx, ns, types.MergePatchType, []byte(patch), metav1.PatchOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Upgrade(ctx, opts); err != nil {
		t.Fatal(err)
	}
	got, err = cs.CoreV1().Namespaces().Get(ctx, ns, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if got.Labels[psapi.EnforceLevelLabel] != string(psapi.LevelRestricted) || got.Labels["team"] != "infra" {
		t.Errorf("after the upgrade: labels %v, want enforce=restricted back and team=infra kept", got.Labels)
	}

	// A namespace its owner made is theirs: no label is added or changed.
	own := testNamespaceFor(t, cs, "chart-pss-own")
	if _, err := cs.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{
		Name: own, Labels: map[string]string{psapi.EnforceLevelLabel: string(psapi.LevelBaseline)},
	}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	logs = nil
	if _, err := c.Install(ctx, Options{Namespace: own, ReleaseName: DefaultReleaseName, Values: Values{ImageTag: "absent", ImagePullPolicy: "Never"}}); err != nil {
		t.Fatal(err)
	}
	got, err = cs.CoreV1().Namespaces().Get(ctx, own, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if got.Labels[psapi.EnforceLevelLabel] != string(psapi.LevelBaseline) || got.Labels[LabelManagedBy] != "" || got.Labels[psapi.WarnLevelLabel] != "" {
		t.Errorf("an existing namespace was relabelled: %v", got.Labels)
	}
	if !strings.Contains(strings.Join(logs, "\n"), "left as they are") {
		t.Errorf("the install did not say it left the namespace's labels alone: %q", logs)
	}
	if err := c.Uninstall(ctx, own, DefaultReleaseName, time.Minute, false); err != nil {
		t.Error(err)
	}
	if err := c.Uninstall(ctx, ns, DefaultReleaseName, time.Minute, false); err != nil {
		t.Error(err)
	}
}

// waitControlPlanePod waits until the control plane Deployment in ns has a
// pod, which means the API server admitted it.
func waitControlPlanePod(t *testing.T, ctx context.Context, cs kubernetes.Interface, ns string) {
	t.Helper()
	var last string
	err := wait.PollUntilContextTimeout(ctx, time.Second, 2*time.Minute, true, func(ctx context.Context) (bool, error) {
		pods, err := cs.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{LabelSelector: "app.kubernetes.io/component=controlplane"})
		if err != nil {
			return false, err
		}
		if len(pods.Items) > 0 {
			return true, nil
		}
		evs, err := cs.CoreV1().Events(ns).List(ctx, metav1.ListOptions{})
		if err == nil {
			for _, e := range evs.Items {
				if e.Reason == "FailedCreate" {
					last = e.Message
				}
			}
		}
		return false, nil
	})
	if err != nil {
		t.Fatalf("no control plane pod was admitted in namespace %s: %v (last FailedCreate: %s)", ns, err, last)
	}
}
