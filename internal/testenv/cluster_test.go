package testenv_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apiextv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	apiextclient "k8s.io/apiextensions-apiserver/pkg/client/clientset/clientset"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/remotecommand"

	"github.com/agentbox/terraform-provider-agentbox/internal/testenv"
	"github.com/agentbox/terraform-provider-agentbox/internal/testenv/loopvol"
	"github.com/agentbox/terraform-provider-agentbox/internal/testenv/toolchain"
)

// cacheDir returns the toolchain cache, or skips outside CI when it has not
// been built, since building it takes minutes.
func cacheDir(t *testing.T) string {
	t.Helper()
	dir, err := toolchain.DefaultDir()
	if err != nil {
		t.Fatal(err)
	}
	if missing := toolchain.Missing(dir); len(missing) > 0 {
		if os.Getenv("CI") != "" {
			t.Fatalf("toolchain incomplete (%v): CI must run `make testenv` first", missing)
		}
		t.Skipf("toolchain not built (missing %v): run `make testenv`", missing)
	}
	return dir
}

func requireRoot(t *testing.T) {
	t.Helper()
	if os.Geteuid() != 0 {
		if os.Getenv("CI") != "" {
			t.Fatal("the node needs root, and CI runs as root on these machines")
		}
		t.Skip("a test node needs root")
	}
}

// TestNode starts a cluster with a real node and checks what the rest of the
// project relies on, then that teardown leaves nothing behind.
func TestNode(t *testing.T) {
	requireRoot(t)
	dir := cacheDir(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	c, err := testenv.Start(ctx, testenv.Options{Dir: dir, Node: true, Log: testWriter{t}})
	if errors.Is(err, testenv.ErrRunning) {
		t.Fatalf("%v: this test starts its own node and there can be one per machine", err)
	}
	if err != nil {
		t.Fatal(err)
	}
	stopped := false
	t.Cleanup(func() {
		if !stopped {
			_ = c.Stop(context.Background())
		}
	})
	cs := kubernetes.NewForConfigOrDie(c.Config)
	ns := "testenv"
	if _, err := cs.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}

	t.Run("CRD", func(t *testing.T) { testCRD(ctx, t, c.Config) })
	t.Run("GVisorPodExec", func(t *testing.T) { testGVisorExec(ctx, t, c.Config, cs, ns) })
	t.Run("ServiceRoutes", func(t *testing.T) { testService(ctx, t, c.Config, cs, ns) })
	t.Run("PVCWritableByNonRoot", func(t *testing.T) { testPVC(ctx, t, c.Config, cs, ns) })
	t.Run("PVCSizeLimit", func(t *testing.T) { testPVCSizeLimit(ctx, t, c.Config, cs, ns, c.LogDir()) })

	logDir := c.LogDir()
	// The claim of PVCWritableByNonRoot is still mounted, with its pod: the
	// teardown must clean its volume up without the provisioner's help.
	crashProvisioner(ctx, t, logDir)
	if err := c.Stop(ctx); err != nil {
		t.Fatalf("stop: %v", err)
	}
	stopped = true
	if err := c.Stop(ctx); err != nil {
		t.Fatalf("second stop: %v", err)
	}
	assertClean(t, logDir)

	// A second cluster right after the first must not collide with leftovers.
	c2, err := testenv.Start(ctx, testenv.Options{Dir: dir, Log: testWriter{t}})
	if err != nil {
		t.Fatalf("restart after teardown: %v", err)
	}
	if _, err := kubernetes.NewForConfigOrDie(c2.Config).CoreV1().Namespaces().Get(ctx, "default", metav1.GetOptions{}); err != nil {
		t.Errorf("second cluster: %v", err)
	}
	if err := c2.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	assertClean(t, logDir)
}

func testCRD(ctx context.Context, t *testing.T, cfg *rest.Config) {
	ext := apiextclient.NewForConfigOrDie(cfg)
	crd := &apiextv1.CustomResourceDefinition{
		ObjectMeta: metav1.ObjectMeta{Name: "widgets.example.agentbox.dev"},
		Spec: apiextv1.CustomResourceDefinitionSpec{
			Group: "example.agentbox.dev",
			Names: apiextv1.CustomResourceDefinitionNames{Plural: "widgets", Singular: "widget", Kind: "Widget", ListKind: "WidgetList"},
			Scope: apiextv1.NamespaceScoped,
			Versions: []apiextv1.CustomResourceDefinitionVersion{{
				Name: "v1", Served: true, Storage: true,
				Schema: &apiextv1.CustomResourceValidation{OpenAPIV3Schema: &apiextv1.JSONSchemaProps{
					Type: "object",
					Properties: map[string]apiextv1.JSONSchemaProps{
						"spec": {Type: "object", Properties: map[string]apiextv1.JSONSchemaProps{"size": {Type: "integer"}}},
					},
				}},
			}},
		},
	}
	if _, err := ext.ApiextensionsV1().CustomResourceDefinitions().Create(ctx, crd, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	eventually(t, 30*time.Second, func() error {
		got, err := ext.ApiextensionsV1().CustomResourceDefinitions().Get(ctx, crd.Name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		for _, cond := range got.Status.Conditions {
			if cond.Type == apiextv1.Established && cond.Status == apiextv1.ConditionTrue {
				return nil
			}
		}
		return fmt.Errorf("CRD not Established")
	})
	gvr := schema.GroupVersionResource{Group: "example.agentbox.dev", Version: "v1", Resource: "widgets"}
	obj := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "example.agentbox.dev/v1", "kind": "Widget",
		"metadata": map[string]any{"name": "w1"},
		"spec":     map[string]any{"size": int64(3)},
	}}
	dyn := dynamic.NewForConfigOrDie(cfg)
	if _, err := dyn.Resource(gvr).Namespace("default").Create(ctx, obj, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	got, err := dyn.Resource(gvr).Namespace("default").Get(ctx, "w1", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if size, _, _ := unstructured.NestedInt64(got.Object, "spec", "size"); size != 3 {
		t.Errorf("spec.size = %d, want 3", size)
	}
	// The schema is enforced: a string where an integer belongs is refused.
	bad := obj.DeepCopy()
	bad.SetName("w2")
	_ = unstructured.SetNestedField(bad.Object, "three", "spec", "size")
	if _, err := dyn.Resource(gvr).Namespace("default").Create(ctx, bad, metav1.CreateOptions{}); err == nil {
		t.Error("an object that violates the CRD schema was accepted")
	}
}

func busyboxPod(name, ns string, cmd string) *corev1.Pod {
	rc := testenv.RuntimeClass
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns, Labels: map[string]string{"app": name}},
		Spec: corev1.PodSpec{
			RuntimeClassName:              &rc,
			TerminationGracePeriodSeconds: new(int64),
			Containers: []corev1.Container{{
				Name: "main", Image: toolchain.BusyboxImage, ImagePullPolicy: corev1.PullNever,
				Command: []string{"/bin/sh", "-c", cmd},
			}},
		},
	}
}

func runPod(ctx context.Context, t *testing.T, cs kubernetes.Interface, pod *corev1.Pod) *corev1.Pod {
	t.Helper()
	start := time.Now()
	if _, err := cs.CoreV1().Pods(pod.Namespace).Create(ctx, pod, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	var got *corev1.Pod
	eventually(t, 2*time.Minute, func() error {
		var err error
		got, err = cs.CoreV1().Pods(pod.Namespace).Get(ctx, pod.Name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		if got.Status.Phase != corev1.PodRunning {
			return fmt.Errorf("pod %s is %s: %+v", pod.Name, got.Status.Phase, got.Status.ContainerStatuses)
		}
		return nil
	})
	t.Logf("pod %s Running in %s with IP %s", pod.Name, time.Since(start).Round(time.Millisecond), got.Status.PodIP)
	return got
}

func execIn(ctx context.Context, cfg *rest.Config, cs kubernetes.Interface, ns, pod string, cmd ...string) (string, string, error) {
	req := cs.CoreV1().RESTClient().Post().Resource("pods").Namespace(ns).Name(pod).SubResource("exec").
		VersionedParams(&corev1.PodExecOptions{Container: "main", Command: cmd, Stdout: true, Stderr: true}, scheme.ParameterCodec)
	exe, err := remotecommand.NewSPDYExecutor(cfg, http.MethodPost, req.URL())
	if err != nil {
		return "", "", err
	}
	var stdout, stderr bytes.Buffer
	err = exe.StreamWithContext(ctx, remotecommand.StreamOptions{Stdout: &stdout, Stderr: &stderr})
	return stdout.String(), stderr.String(), err
}

func testGVisorExec(ctx context.Context, t *testing.T, cfg *rest.Config, cs kubernetes.Interface, ns string) {
	runPod(ctx, t, cs, busyboxPod("gvisor", ns, "sleep 3600"))
	out, errOut, err := execIn(ctx, cfg, cs, ns, "gvisor", "uname", "-r")
	if err != nil {
		t.Fatalf("exec: %v (stderr %q)", err, errOut)
	}
	if !strings.Contains(out, "gvisor") {
		t.Fatalf("uname -r in a gvisor pod = %q, want the gVisor kernel", out)
	}
	t.Logf("uname -r inside the pod: %s", strings.TrimSpace(out))
	// The pod reaches the apiserver through the kubernetes Service.
	out, errOut, err = execIn(ctx, cfg, cs, ns, "gvisor", "sh", "-c", "nc -w 3 $KUBERNETES_SERVICE_HOST $KUBERNETES_SERVICE_PORT </dev/null && echo connected")
	if err != nil || !strings.Contains(out, "connected") {
		t.Fatalf("pod to apiserver: %v, stdout %q, stderr %q", err, out, errOut)
	}
}

func testService(ctx context.Context, t *testing.T, cfg *rest.Config, cs kubernetes.Interface, ns string) {
	runPod(ctx, t, cs, busyboxPod("web", ns, "mkdir -p /tmp/www && echo hello-from-web > /tmp/www/index.html && exec httpd -f -p 8080 -h /tmp/www"))
	svc := &corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Name: "web", Namespace: ns},
		Spec: corev1.ServiceSpec{
			Selector: map[string]string{"app": "web"},
			Ports:    []corev1.ServicePort{{Port: 80, TargetPort: intstr.FromInt32(8080)}},
		},
	}
	svc, err := cs.CoreV1().Services(ns).Create(ctx, svc, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	url := "http://" + svc.Spec.ClusterIP + "/index.html"
	// From the host, through kube-proxy's rules.
	eventually(t, time.Minute, func() error {
		hc := &http.Client{Timeout: 2 * time.Second}
		resp, err := hc.Get(url)
		if err != nil {
			return err
		}
		defer resp.Body.Close()
		body, _ := io.ReadAll(resp.Body)
		if !strings.Contains(string(body), "hello-from-web") {
			return fmt.Errorf("GET %s = %s %q", url, resp.Status, body)
		}
		return nil
	})
	// From another pod, which is how the platform's pods talk.
	runPod(ctx, t, cs, busyboxPod("client", ns, "sleep 3600"))
	eventually(t, time.Minute, func() error {
		// busybox's wget segfaults on these images; a raw request through nc
		// exercises the same path.
		req := fmt.Sprintf(`printf 'GET /index.html HTTP/1.0\r\n\r\n' | nc -w 3 %s 80`, svc.Spec.ClusterIP)
		out, errOut, err := execIn(ctx, cfg, cs, ns, "client", "sh", "-c", req)
		if err != nil || !strings.Contains(out, "hello-from-web") {
			return fmt.Errorf("pod to Service: %v, stdout %q, stderr %q", err, out, errOut)
		}
		return nil
	})
}

// testPVC checks that a claim of the default class binds and that a
// non-root gVisor pod, as sandboxes run, can write to it.
func testPVC(ctx context.Context, t *testing.T, cfg *rest.Config, cs kubernetes.Interface, ns string) {
	pvc := &corev1.PersistentVolumeClaim{
		ObjectMeta: metav1.ObjectMeta{Name: "data", Namespace: ns},
		Spec: corev1.PersistentVolumeClaimSpec{
			AccessModes: []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
			Resources:   corev1.VolumeResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("1Gi")}},
		},
	}
	if _, err := cs.CoreV1().PersistentVolumeClaims(ns).Create(ctx, pvc, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	eventually(t, time.Minute, func() error {
		got, err := cs.CoreV1().PersistentVolumeClaims(ns).Get(ctx, "data", metav1.GetOptions{})
		if err != nil {
			return err
		}
		if got.Status.Phase != corev1.ClaimBound {
			return fmt.Errorf("PVC is %s", got.Status.Phase)
		}
		return nil
	})
	pod := busyboxPod("writer", ns, "sleep 3600")
	uid := int64(65532)
	pod.Spec.SecurityContext = &corev1.PodSecurityContext{RunAsUser: &uid, RunAsGroup: &uid, FSGroup: &uid}
	pod.Spec.Volumes = []corev1.Volume{{Name: "data", VolumeSource: corev1.VolumeSource{
		PersistentVolumeClaim: &corev1.PersistentVolumeClaimVolumeSource{ClaimName: "data"}}}}
	pod.Spec.Containers[0].VolumeMounts = []corev1.VolumeMount{{Name: "data", MountPath: "/data"}}
	runPod(ctx, t, cs, pod)
	out, errOut, err := execIn(ctx, cfg, cs, ns, "writer", "sh", "-c", "cd /data && echo kept > file && cat file && id -u")
	if err != nil || !strings.Contains(out, "kept") || !strings.Contains(out, "65532") {
		t.Fatalf("write as uid 65532: %v, stdout %q, stderr %q", err, out, errOut)
	}
}

// assertClean checks the host for anything the cluster could have left.
func assertClean(t *testing.T, runDir string) {
	t.Helper()
	procs, _ := os.ReadDir("/proc")
	for _, p := range procs {
		cmdline, err := os.ReadFile("/proc/" + p.Name() + "/cmdline")
		if err == nil && bytes.Contains(cmdline, []byte(runDir)) && p.Name() != fmt.Sprint(os.Getpid()) {
			t.Errorf("process %s still runs: %s", p.Name(), bytes.ReplaceAll(cmdline, []byte{0}, []byte{' '}))
		}
	}
	mounts, _ := os.ReadFile("/proc/self/mountinfo")
	for _, line := range strings.Split(string(mounts), "\n") {
		if strings.Contains(line, runDir+"/") || strings.Contains(line, "runsc") {
			t.Errorf("mount left behind: %s", line)
		}
	}
	if err := exec.Command("ip", "link", "show", testenv.Bridge).Run(); err == nil {
		t.Errorf("bridge %s left behind", testenv.Bridge)
	}
	if out, _ := exec.Command("ip", "-4", "addr", "show", "dev", "lo").Output(); strings.Contains(string(out), testenv.NodeIP) {
		t.Errorf("node address %s left on lo", testenv.NodeIP)
	}
	devs, err := loopvol.Devices()
	if err != nil {
		t.Error(err)
	}
	for _, d := range devs {
		if strings.HasPrefix(d.Backing, runDir+"/") {
			t.Errorf("loop device %s of %s left attached", d.Path, d.Backing)
		}
	}
	// The logs stay for a post-mortem; the data (volume images among it)
	// goes.
	if entries, _ := os.ReadDir(runDir); len(entries) > 0 {
		for _, e := range entries {
			if !strings.HasSuffix(e.Name(), ".log") {
				t.Errorf("left in %s: %s", runDir, e.Name())
			}
		}
	}
	if out, _ := exec.Command("ip", "route", "show", testenv.TestRange).Output(); len(bytes.TrimSpace(out)) > 0 {
		t.Errorf("route left behind: %s", out)
	}
	for _, table := range []string{"filter", "nat", "mangle"} {
		out, _ := exec.Command("iptables", "-w", "-t", table, "-S").Output()
		for _, line := range strings.Split(string(out), "\n") {
			if strings.Contains(line, "KUBE-") || strings.Contains(line, "CNI-") || strings.Contains(line, "AGENTBOX-") {
				t.Errorf("iptables %s rule left behind: %s", table, line)
			}
		}
	}
}

func eventually(t *testing.T, timeout time.Duration, f func() error) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	var err error
	for time.Now().Before(deadline) {
		if err = f(); err == nil {
			return
		}
		time.Sleep(250 * time.Millisecond)
	}
	t.Fatalf("after %s: %v", timeout, err)
}

type testWriter struct{ t *testing.T }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimRight(string(p), "\n"))
	return len(p), nil
}
