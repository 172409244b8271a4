package chart

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"strings"
	"testing"
	"time"

	autoscalingv2 "k8s.io/api/autoscaling/v2"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/utils/ptr"

	"github.com/agentbox/terraform-provider-agentbox/internal/testenv"
)

// testNamespaceFor gives each test its own namespace on the shared cluster
// and deletes it afterwards (the kept CA Secret included).
func testNamespaceFor(t *testing.T, cs kubernetes.Interface, prefix string) string {
	t.Helper()
	b := make([]byte, 3)
	_, _ = rand.Read(b)
	ns := prefix + "-" + hex.EncodeToString(b)
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if err := cs.CoreV1().Namespaces().Delete(ctx, ns, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
			t.Logf("deleting namespace %s: %v", ns, err)
		}
	})
	return ns
}

func clusterClients(t *testing.T) (*rest.Config, kubernetes.Interface) {
	t.Helper()
	cfg, _ := testenv.Shared(t)
	cs, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return cfg, cs
}

func testClient(t *testing.T, cfg *rest.Config) *Client {
	c := New(cfg)
	c.Log = func(format string, args ...any) { t.Logf("helm: "+format, args...) }
	return c
}

// TestLifecycleWithoutWait installs, repairs, upgrades and uninstalls a
// release without waiting for the control plane, so it needs no images.
//
// No test here runs the real control plane's controllers; the provider's
// tests do (TestAccPlatform_basic), each platform serving its own
// namespaces. TestControlPlaneNetworkPolicy
// runs the control plane pod but keeps it from ever leading, so that only
// its listeners serve.
func TestLifecycleWithoutWait(t *testing.T) {
	cfg, cs := clusterClients(t)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	ns := testNamespaceFor(t, cs, "chart-lifecycle")
	c := testClient(t, cfg)
	// Never: nothing may be pulled from the internet by a test.
	opts := Options{Namespace: ns, ReleaseName: DefaultReleaseName, Values: Values{ImageTag: "absent", ImagePullPolicy: "Never"}}

	rel, err := c.Install(ctx, opts)
	if err != nil {
		t.Fatal(err)
	}
	if rel.Revision != 1 || rel.Status != "deployed" || rel.ChartVersion != Version() || rel.AppVersion != AppVersion() {
		t.Errorf("release %+v", rel)
	}
	if len(rel.CRDs) != 6 {
		t.Errorf("CRDs %v", rel.CRDs)
	}
	if _, err := c.Install(ctx, opts); err == nil || !strings.Contains(err.Error(), "already exists") {
		t.Errorf("second install: %v", err)
	}

	drift, err := LiveDrift(ctx, cfg, rel)
	if err != nil {
		t.Fatal(err)
	}
	if len(drift) != 0 {
		t.Errorf("drift right after install: %v", drift)
	}

	access, err := ReadAccess(ctx, cs, rel)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(access.Endpoint, "https://") || !strings.HasSuffix(access.Endpoint, ":443") ||
		access.ServiceDNS != "agentbox-api."+ns+".svc" || !strings.HasPrefix(access.CACertificate, "-----BEGIN CERTIFICATE-----") ||
		len(access.AdminToken) != 48 {
		t.Errorf("access %+v", access)
	}

	// Out-of-band deletions show up as drift, and an upgrade repairs them.
	if err := cs.AppsV1().Deployments(ns).Delete(ctx, ControlPlaneDeployment, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := cs.CoreV1().Secrets(ns).Delete(ctx, DefaultAdminTokenSecret, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	waitGone(t, ctx, func() error {
		_, err := cs.AppsV1().Deployments(ns).Get(ctx, ControlPlaneDeployment, metav1.GetOptions{})
		return err
	})
	drift, err = LiveDrift(ctx, cfg, rel)
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, d := range drift {
		got = append(got, d.String())
	}
	want := []string{"Deployment " + ns + "/agentbox-controlplane is missing", "Secret " + ns + "/agentbox-admin-token is missing"}
	if strings.Join(got, "\n") != strings.Join(want, "\n") {
		t.Errorf("drift\n got %q\nwant %q", got, want)
	}

	rel, err = c.Upgrade(ctx, opts)
	if err != nil {
		t.Fatal(err)
	}
	if rel.Revision != 2 || rel.Status != "deployed" {
		t.Errorf("after upgrade: %+v", rel)
	}
	if drift, err := LiveDrift(ctx, cfg, rel); err != nil || len(drift) != 0 {
		t.Errorf("drift after repair: %v %v", drift, err)
	}
	repaired, err := ReadAccess(ctx, cs, rel)
	if err != nil {
		t.Fatal(err)
	}
	if repaired.CACertificate != access.CACertificate {
		t.Error("the CA changed on upgrade")
	}
	if len(repaired.AdminToken) != 48 || repaired.AdminToken == access.AdminToken {
		t.Errorf("the deleted admin token was not generated again: %q", repaired.AdminToken)
	}

	// Out-of-band changes to fields the release sets are drift; what others
	// legitimately own is not, and an upgrade to the same values undoes the
	// changes while keeping the rest.
	changeOutOfBand(t, ctx, cs, ns)
	drift, err = LiveDrift(ctx, cfg, rel)
	if err != nil {
		t.Fatal(err)
	}
	got = nil
	for _, d := range drift {
		got = append(got, d.String())
	}
	want = []string{
		"Deployment " + ns + "/agentbox-controlplane changed out of band: spec.replicas, spec.template.spec.containers[0].env[2].value",
		"Service " + ns + "/agentbox-api changed out of band: metadata.labels[app.kubernetes.io/component]",
	}
	if strings.Join(got, "\n") != strings.Join(want, "\n") {
		t.Errorf("drift\n got %q\nwant %q", got, want)
	}
	// Under an autoscaler the replicas are its business.
	hpa := &autoscalingv2.HorizontalPodAutoscaler{
		ObjectMeta: metav1.ObjectMeta{Name: "controlplane", Namespace: ns},
		Spec: autoscalingv2.HorizontalPodAutoscalerSpec{
			ScaleTargetRef: autoscalingv2.CrossVersionObjectReference{APIVersion: "apps/v1", Kind: "Deployment", Name: ControlPlaneDeployment},
			MinReplicas:    ptr.To[int32](1), MaxReplicas: 3,
		},
	}
	if _, err := cs.AutoscalingV2().HorizontalPodAutoscalers(ns).Create(ctx, hpa, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	drift, err = LiveDrift(ctx, cfg, rel)
	if err != nil {
		t.Fatal(err)
	}
	if len(drift) != 2 || drift[0].Reason != ReasonChanged+": spec.template.spec.containers[0].env[2].value" {
		t.Errorf("drift under an autoscaler: %v", drift)
	}
	rel, err = c.Upgrade(ctx, opts)
	if err != nil {
		t.Fatal(err)
	}
	if drift, err := LiveDrift(ctx, cfg, rel); err != nil || len(drift) != 0 {
		t.Errorf("drift after repairing changes: %v %v", drift, err)
	}
	checkRepaired(t, ctx, cs, ns)
	if err := cs.AutoscalingV2().HorizontalPodAutoscalers(ns).Delete(ctx, hpa.Name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	if repaired, err = ReadAccess(ctx, cs, rel); err != nil || repaired.AdminToken != rotatedToken {
		t.Errorf("the rotated admin token did not survive the upgrade: %v", err)
	}

	// A changed value reaches the cluster; generated secrets stay.
	opts.Values.Raw = "trustDomain: example.org\n"
	rel, err = c.Upgrade(ctx, opts)
	if err != nil {
		t.Fatal(err)
	}
	d, err := cs.AppsV1().Deployments(ns).Get(ctx, ControlPlaneDeployment, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(strings.Join(d.Spec.Template.Spec.Containers[0].Args, " "), "--trust-domain=example.org") {
		t.Errorf("args %q", d.Spec.Template.Spec.Containers[0].Args)
	}
	again, err := ReadAccess(ctx, cs, rel)
	if err != nil {
		t.Fatal(err)
	}
	if again.CACertificate != access.CACertificate || again.AdminToken != repaired.AdminToken {
		t.Error("an upgrade rotated the generated secrets")
	}
	back, err := ValuesFromConfig(rel.Config)
	if err != nil {
		t.Fatal(err)
	}
	if back.ImageTag != "absent" || back.ImagePullPolicy != "Never" || back.Raw != "trustDomain: example.org\n" {
		t.Errorf("values from the release: %+v", back)
	}

	if err := c.Uninstall(ctx, ns, DefaultReleaseName, time.Minute, true); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Status(ctx, ns, DefaultReleaseName); !errors.Is(err, ErrNotFound) {
		t.Errorf("status after uninstall: %v", err)
	}
	if _, err := cs.CoreV1().Secrets(ns).Get(ctx, DefaultCASecret, metav1.GetOptions{}); err != nil {
		t.Errorf("the CA Secret did not survive uninstall: %v", err)
	}
	if err := c.Uninstall(ctx, ns, DefaultReleaseName, time.Minute, true); err != nil {
		t.Errorf("uninstalling twice: %v", err)
	}
	// The kept CA is adopted by a new release of the same name.
	rel, err = c.Install(ctx, opts)
	if err != nil {
		t.Fatal(err)
	}
	if reinstalled, err := ReadAccess(ctx, cs, rel); err != nil || reinstalled.CACertificate != access.CACertificate {
		t.Errorf("reinstall did not reuse the kept CA: %v", err)
	}
	if err := c.Uninstall(ctx, ns, DefaultReleaseName, time.Minute, true); err != nil {
		t.Fatal(err)
	}
}

// TestDriftWithoutDryRun refreshes where the API server will not do the
// dry run: a refresh must not fail then, and still sees missing objects.
func TestDriftWithoutDryRun(t *testing.T) {
	cfg, cs := clusterClients(t)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	ns := testNamespaceFor(t, cs, "chart-nodryrun")
	c := testClient(t, cfg)
	// Overriding a variable of the chart through extraEnv repeats its name,
	// which Kubernetes accepts and server-side apply cannot merge.
	opts := Options{Namespace: ns, ReleaseName: DefaultReleaseName, Values: Values{
		ImageTag: "absent", ImagePullPolicy: "Never",
		Raw: "extraEnv: [{name: AGENTBOX_SNAPSHOT_DRIVER, value: archive-of-my-own}]\n",
	}}
	rel, err := c.Install(ctx, opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := c.Uninstall(context.Background(), ns, DefaultReleaseName, time.Minute, true); err != nil {
			t.Error(err)
		}
	})
	if drift, err := LiveDrift(ctx, cfg, rel); err != nil || len(drift) != 0 {
		t.Errorf("drift with a repeated variable: %v %v", drift, err)
	}

	// Credentials that may read everything and write nothing, as a plan in
	// CI often has.
	reader := "drift-reader-" + ns
	role := &rbacv1.ClusterRole{
		ObjectMeta: metav1.ObjectMeta{Name: reader},
		Rules:      []rbacv1.PolicyRule{{APIGroups: []string{"*"}, Resources: []string{"*"}, Verbs: []string{"get", "list", "watch"}}},
	}
	binding := &rbacv1.ClusterRoleBinding{
		ObjectMeta: metav1.ObjectMeta{Name: reader},
		RoleRef:    rbacv1.RoleRef{APIGroup: "rbac.authorization.k8s.io", Kind: "ClusterRole", Name: reader},
		Subjects:   []rbacv1.Subject{{APIGroup: "rbac.authorization.k8s.io", Kind: "User", Name: reader}},
	}
	if _, err := cs.RbacV1().ClusterRoles().Create(ctx, role, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cs.RbacV1().ClusterRoles().Delete(context.Background(), reader, metav1.DeleteOptions{}) })
	if _, err := cs.RbacV1().ClusterRoleBindings().Create(ctx, binding, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = cs.RbacV1().ClusterRoleBindings().Delete(context.Background(), reader, metav1.DeleteOptions{})
	})
	readOnly := rest.CopyConfig(cfg)
	readOnly.Impersonate = rest.ImpersonationConfig{UserName: reader}

	svc, err := cs.CoreV1().Services(ns).Get(ctx, APIService, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	delete(svc.Labels, "app.kubernetes.io/component")
	if _, err := cs.CoreV1().Services(ns).Update(ctx, svc, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := cs.CoreV1().ServiceAccounts(ns).Delete(ctx, "agentbox-controlplane", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	// RBAC takes effect at once, but the impersonated user's first request
	// may race the binding's arrival in the authorizer's cache.
	var drift []DriftItem
	for i := 0; i < 50; i++ {
		if drift, err = LiveDrift(ctx, readOnly, rel); !apierrors.IsForbidden(err) {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	if err != nil {
		t.Fatal(err)
	}
	if len(drift) != 1 || drift[0].String() != "ServiceAccount "+ns+"/agentbox-controlplane is missing" {
		t.Errorf("read-only drift %v", drift)
	}
	// With the rights to patch, the change shows too.
	drift, err = LiveDrift(ctx, cfg, rel)
	if err != nil {
		t.Fatal(err)
	}
	if len(drift) != 2 || drift[0].String() != "Service "+ns+"/agentbox-api changed out of band: metadata.labels[app.kubernetes.io/component]" {
		t.Errorf("drift %v", drift)
	}

	// An object recreated with another value of an immutable field cannot
	// be updated to the release's: that is drift too, with the API
	// server's word for it.
	const rb = "agentbox-controlplane-leader-election"
	old, err := cs.RbacV1().RoleBindings(ns).Get(ctx, rb, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if err := cs.RbacV1().RoleBindings(ns).Delete(ctx, rb, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	recreated := &rbacv1.RoleBinding{
		ObjectMeta: metav1.ObjectMeta{Name: rb, Namespace: ns, Labels: old.Labels, Annotations: old.Annotations},
		RoleRef:    rbacv1.RoleRef{APIGroup: "rbac.authorization.k8s.io", Kind: "ClusterRole", Name: reader},
		Subjects:   old.Subjects,
	}
	if _, err := cs.RbacV1().RoleBindings(ns).Create(ctx, recreated, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	drift, err = LiveDrift(ctx, cfg, rel)
	if err != nil {
		t.Fatal(err)
	}
	prefix := "RoleBinding " + ns + "/" + rb + " " + ReasonRejected + ": "
	if len(drift) != 3 || !strings.HasPrefix(drift[0].String(), prefix) || !strings.Contains(drift[0].Reason, "roleRef") {
		t.Errorf("drift %v", drift)
	}
}

// TestInstallNotReadyIsUndone waits for a control plane whose image cannot
// be pulled: the error says why, and the release is gone.
func TestInstallNotReadyIsUndone(t *testing.T) {
	cfg, cs := clusterClients(t)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	ns := testNamespaceFor(t, cs, "chart-notready")
	c := testClient(t, cfg)
	opts := Options{
		Namespace: ns, ReleaseName: DefaultReleaseName, Wait: true, Timeout: 2 * time.Minute,
		Values: Values{ImageTag: "absent", ImagePullPolicy: "Never"},
	}
	_, err := c.Install(ctx, opts)
	if err == nil {
		t.Fatal("install of an absent image succeeded")
	}
	t.Log(err)
	// The image can never appear, so the wait gives up before the timeout.
	for _, want := range []string{"did not become ready: pod agentbox-controlplane-", "cannot start: ErrImageNeverPull"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error does not mention %q", want)
		}
	}
	if _, err := c.Status(ctx, ns, DefaultReleaseName); !errors.Is(err, ErrNotFound) {
		t.Errorf("failed install left a release: %v", err)
	}
}

// TestUpgradeNotReadyRollsBack upgrades to a control plane that cannot
// start: the release returns to the revision before.
func TestUpgradeNotReadyRollsBack(t *testing.T) {
	cfg, cs := clusterClients(t)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	ns := testNamespaceFor(t, cs, "chart-rollback")
	c := testClient(t, cfg)
	opts := Options{Namespace: ns, ReleaseName: DefaultReleaseName, Values: Values{ImageTag: "absent", ImagePullPolicy: "Never"}}
	if _, err := c.Install(ctx, opts); err != nil {
		t.Fatal(err)
	}
	bad := opts
	bad.Wait, bad.Timeout = true, 2*time.Minute
	bad.Values.ImageTag = "absent-too"
	if _, err := c.Upgrade(ctx, bad); err == nil || !strings.Contains(err.Error(), "ErrImageNeverPull") {
		t.Fatalf("upgrade: %v", err)
	}
	rel, err := c.Status(ctx, ns, DefaultReleaseName)
	if err != nil {
		t.Fatal(err)
	}
	back, err := ValuesFromConfig(rel.Config)
	if err != nil {
		t.Fatal(err)
	}
	// Revision 3 is the rollback to revision 1's values.
	if rel.Revision != 3 || rel.Status != "deployed" || back.ImageTag != "absent" {
		t.Errorf("after the failed upgrade: revision %d, status %s, tag %s", rel.Revision, rel.Status, back.ImageTag)
	}
	if err := c.Uninstall(ctx, ns, DefaultReleaseName, time.Minute, true); err != nil {
		t.Fatal(err)
	}
}

// rotatedToken is what changeOutOfBand puts in the admin token Secret.
const rotatedToken = "rotatedrotatedrotatedrotatedrotatedrotatedrotate"

// changeOutOfBand edits release objects the way people and controllers do:
// two fields the release sets (drift), and fields it does not set or that
// legitimately change (not drift).
func changeOutOfBand(t *testing.T, ctx context.Context, cs kubernetes.Interface, ns string) {
	t.Helper()
	d, err := cs.AppsV1().Deployments(ns).Get(ctx, ControlPlaneDeployment, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	d.Spec.Replicas = ptr.To[int32](2)
	c := &d.Spec.Template.Spec.Containers[0]
	if c.Env[2].Name != "AGENTBOX_SANDBOX_IMAGE_PULL_POLICY" {
		t.Fatalf("env %v", c.Env)
	}
	c.Env[2].Value = "Always"
	// What `kubectl rollout restart` does: not a field the release sets.
	d.Spec.Template.Annotations = map[string]string{"kubectl.kubernetes.io/restartedAt": time.Now().Format(time.RFC3339)}
	if _, err := cs.AppsV1().Deployments(ns).Update(ctx, d, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	svc, err := cs.CoreV1().Services(ns).Get(ctx, APIService, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	delete(svc.Labels, "app.kubernetes.io/component")
	svc.Annotations = map[string]string{"example.com/owner": "someone else"}
	if _, err := cs.CoreV1().Services(ns).Update(ctx, svc, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	sec, err := cs.CoreV1().Secrets(ns).Get(ctx, DefaultAdminTokenSecret, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	sec.Data[AdminTokenKey] = []byte(rotatedToken)
	if _, err := cs.CoreV1().Secrets(ns).Update(ctx, sec, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
}

// checkRepaired checks that an upgrade undid changeOutOfBand's drift and
// kept what others own.
func checkRepaired(t *testing.T, ctx context.Context, cs kubernetes.Interface, ns string) {
	t.Helper()
	d, err := cs.AppsV1().Deployments(ns).Get(ctx, ControlPlaneDeployment, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if *d.Spec.Replicas != 1 || d.Spec.Template.Spec.Containers[0].Env[2].Value != "Never" {
		t.Errorf("deployment not repaired: replicas %d, env %v", *d.Spec.Replicas, d.Spec.Template.Spec.Containers[0].Env[2])
	}
	if d.Spec.Template.Annotations["kubectl.kubernetes.io/restartedAt"] == "" {
		t.Error("the upgrade removed the restart annotation, which the release does not set")
	}
	svc, err := cs.CoreV1().Services(ns).Get(ctx, APIService, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if svc.Labels["app.kubernetes.io/component"] != "controlplane" || svc.Annotations["example.com/owner"] != "someone else" {
		t.Errorf("service not repaired: labels %v annotations %v", svc.Labels, svc.Annotations)
	}
}

func waitGone(t *testing.T, ctx context.Context, get func() error) {
	t.Helper()
	for {
		err := get()
		if apierrors.IsNotFound(err) {
			return
		}
		select {
		case <-ctx.Done():
			t.Fatalf("object not gone: %v", err)
		case <-time.After(200 * time.Millisecond):
		}
	}
}

// TestHAWithoutWait installs a highly available release (two replicas on
// PostgreSQL, without waiting for them) and checks that the API server
// takes its PodDisruptionBudget, pod anti-affinity and NetworkPolicy as
// rendered: no drift, and the budget counts the control plane pods.
func TestHAWithoutWait(t *testing.T) {
	cfg, cs := clusterClients(t)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	ns := testNamespaceFor(t, cs, "chart-ha")
	c := testClient(t, cfg)
	// Never: nothing may be pulled from the internet by a test.
	opts := Options{Namespace: ns, ReleaseName: DefaultReleaseName, Values: Values{ImageTag: "absent", ImagePullPolicy: "Never", Raw: haValues}}
	rel, err := c.Install(ctx, opts)
	if err != nil {
		t.Fatal(err)
	}
	if drift, err := LiveDrift(ctx, cfg, rel); err != nil || len(drift) != 0 {
		t.Errorf("drift right after install: %v %v", drift, err)
	}
	if _, err := cs.NetworkingV1().NetworkPolicies(ns).Get(ctx, "agentbox-controlplane", metav1.GetOptions{}); err != nil {
		t.Errorf("network policy: %v", err)
	}
	// The disruption controller finds the Deployment's pods through the
	// budget's selector (they exist, Pending or not, once the ReplicaSet
	// made them).
	deadline := time.Now().Add(time.Minute)
	for {
		pdb, err := cs.PolicyV1().PodDisruptionBudgets(ns).Get(ctx, "agentbox-controlplane", metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if pdb.Status.ExpectedPods == 2 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("budget status %+v, want 2 expected pods", pdb.Status)
		}
		time.Sleep(time.Second)
	}
	if err := c.Uninstall(ctx, ns, DefaultReleaseName, time.Minute, true); err != nil {
		t.Fatal(err)
	}
}
