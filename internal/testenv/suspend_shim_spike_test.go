//go:build suspendspike

package testenv_test

// Step two of the suspend-with-memory spike (docs/notes/suspend-with-memory.md):
// a gVisor pod's sandbox is checkpointed, the pod deleted, and a NEW pod,
// which kubelet and containerd own as any other, is started from the
// checkpoint by the restoring runsc shim (toolchain.RestoreShim) because it
// carries testenv.RestoreAnnotation. Build the shim, then run it on a
// cluster with a node, as root:
//
//	.build/bin/agentbox-testenv build -spikes
//	.build/bin/agentbox-testenv exec -node -- go test -tags suspendspike -count=1 -v -run TestSuspendSpikeShim ./internal/testenv/

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/agentbox/terraform-provider-agentbox/internal/testenv"
	"github.com/agentbox/terraform-provider-agentbox/internal/testenv/toolchain"
)

func TestSuspendSpikeShimRestore(t *testing.T) {
	requireRoot(t)
	dir := cacheDir(t)
	if _, err := os.Stat(filepath.Join(toolchain.BinDir(dir), toolchain.RestoreShim)); err != nil {
		t.Skipf("the restoring shim is not built (.build/bin/agentbox-testenv build -spikes): %v", err)
	}
	cfg, _ := testenv.Shared(t)
	cs, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	const ns = "suspendspike-shim"
	run := filepath.Join(dir, "run")
	runsc := filepath.Join(toolchain.BinDir(dir), "runsc")
	clusterRoot := filepath.Join(run, "runsc", "k8s.io")
	bundles := filepath.Join(run, "containerd", "state", "io.containerd.runtime.v2.task", "k8s.io")
	// The node's restore folder (Cluster.RestoreDir): the shim restores
	// only below it.
	img := filepath.Join(run, "checkpoints", ns)
	t.Cleanup(func() { _ = os.RemoveAll(img) })
	// A host folder stands for the workspace volume, which a resume
	// restores before the pod starts: the same content at the same path.
	ws := filepath.Join(run, "suspendspike-ws")
	if err := os.MkdirAll(ws, 0o777); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(ws) })

	if _, err := cs.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cs.CoreV1().Namespaces().Delete(context.Background(), ns, metav1.DeleteOptions{}) })
	tag := os.Getenv("AGENTBOX_TEST_IMAGE_TAG")
	if tag == "" {
		tag = "dev"
	}
	// Both pods run on the restoring shim's RuntimeClass: without the
	// annotation it must behave as the stock shim.
	newPod := func(annotations map[string]string) *corev1.Pod {
		rc := testenv.RestoreRuntimeClass
		hostDir := corev1.HostPathDirectory
		mount := []corev1.VolumeMount{{Name: "ws", MountPath: "/workspace"}}
		py := "docker.io/agentbox-test/debian-python:" + tag
		return &corev1.Pod{
			ObjectMeta: metav1.ObjectMeta{Name: "spike", Namespace: ns, Annotations: annotations},
			Spec: corev1.PodSpec{
				RuntimeClassName:              &rc,
				TerminationGracePeriodSeconds: new(int64),
				Volumes:                       []corev1.Volume{{Name: "ws", VolumeSource: corev1.VolumeSource{HostPath: &corev1.HostPathVolumeSource{Path: ws, Type: &hostDir}}}},
				Containers: []corev1.Container{{
					Name: "counter", Image: toolchain.BusyboxImage, ImagePullPolicy: corev1.PullNever,
					Command: []string{"sh", "-c", "i=0; while :; do echo $i > /tmp/count; i=$((i+1)); sleep 0.1; done"},
				}, {
					Name: "python", Image: py, ImagePullPolicy: corev1.PullNever, VolumeMounts: mount,
					Command: []string{"python3", "-u", "-c", spikeREPL},
				}, {
					Name: "web", Image: py, ImagePullPolicy: corev1.PullNever,
					Command: []string{"python3", "-m", "http.server", "8080", "--bind", "0.0.0.0", "--directory", "/etc"},
				}},
			},
		}
	}
	pod := runPod(ctx, t, cs, newPod(nil))
	kexec := func(ctx context.Context, container string, cmd ...string) (string, error) {
		out, errOut, err := execContainer(ctx, cfg, cs, ns, "spike", container, cmd...)
		if err != nil {
			return "", fmt.Errorf("exec %v in %s: %w (stderr %q)", cmd, container, err, errOut)
		}
		return strings.TrimSpace(out), nil
	}
	must := func(container string) func(cmd ...string) string {
		return func(cmd ...string) string {
			t.Helper()
			out, err := kexec(ctx, container, cmd...)
			if err != nil {
				t.Fatal(err)
			}
			return out
		}
	}
	inPod := must("python")
	marks := 0
	repl := func(line string) string {
		marks++
		return inPod("python3", "-c", spikeREPLClient, line, fmt.Sprintf("@@%d", marks))
	}
	eventually(t, time.Minute, func() error {
		if out := inPod("cat", "/tmp/out"); !strings.Contains(out, "repl ready") {
			return fmt.Errorf("REPL not ready: %q", out)
		}
		return nil
	})
	repl("import os, hashlib")
	repl("x = 41 + 1")
	repl(fmt.Sprintf("blob = os.urandom(%d << 20)", spikeFillMiB))
	// The REPL keeps a file of the workspace open across the move.
	repl("note = open('/workspace/note', 'w+'); note.write('kept'); note.flush()")
	sum := repl(`print("sum", hashlib.sha256(blob).hexdigest())`)
	if !strings.HasPrefix(sum, "sum ") {
		t.Fatalf("REPL answered %q", sum)
	}
	web := func(ip string) error {
		hc := &http.Client{Timeout: 3 * time.Second}
		resp, err := hc.Get("http://" + ip + ":8080/hostname")
		if err != nil {
			return err
		}
		defer resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			return fmt.Errorf("GET /hostname: %s", resp.Status)
		}
		return nil
	}
	eventually(t, time.Minute, func() error { return web(pod.Status.PodIP) })
	oldUID, oldIP := pod.UID, pod.Status.PodIP
	id := pod.Status.ContainerStatuses[0].ContainerID
	id = id[strings.Index(id, "://")+3:]
	sandboxID, _ := readSpec(t, filepath.Join(bundles, id, "config.json"))["annotations"].(map[string]any)["io.kubernetes.cri.sandbox-id"].(string)
	logContainers(t, "before the checkpoint", pod)

	if err := os.WriteFile(filepath.Join(ws, "changed"), []byte("v1"), 0o644); err != nil {
		t.Fatal(err)
	}
	if got := inPod("cat", "/workspace/changed"); got != "v1" {
		t.Fatalf("workspace file before the checkpoint: %q", got)
	}
	before, err := strconv.Atoi(must("counter")("cat", "/tmp/count"))
	if err != nil {
		t.Fatal(err)
	}
	t0 := time.Now()
	mustRun(t, runsc, "--root", clusterRoot, "checkpoint", "--image-path", img, sandboxID)
	t.Logf("checkpoint of sandbox %s (stops it): %s, image %s, counter was at %d or more", sandboxID, time.Since(t0).Round(time.Millisecond), dirSize(t, img), before)

	// The idle stop deletes the pod right after its checkpoint.
	if err := cs.CoreV1().Pods(ns).Delete(ctx, "spike", metav1.DeleteOptions{GracePeriodSeconds: new(int64)}); err != nil {
		t.Fatal(err)
	}
	eventually(t, 2*time.Minute, func() error {
		_, err := cs.CoreV1().Pods(ns).Get(ctx, "spike", metav1.GetOptions{})
		if apierrors.IsNotFound(err) {
			return nil
		}
		return fmt.Errorf("pod spike still there: %v", err)
	})

	// The workspace changes while the sandbox is away, as a restore of the
	// workspace from its snapshot may change it.
	if err := os.WriteFile(filepath.Join(ws, "changed"), []byte("v2"), 0o644); err != nil {
		t.Fatal(err)
	}

	// The new pod: same name, containers, images and volume paths; its
	// own UID, sandbox, network namespace, IP and cgroup.
	t0 = time.Now()
	if _, err := cs.CoreV1().Pods(ns).Create(ctx, newPod(map[string]string{testenv.RestoreAnnotation: img}), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	var first int
	var firstOut, running time.Duration
	var lastErr error
	for deadline := time.Now().Add(2 * time.Minute); ; {
		if running == 0 {
			if p, err := cs.CoreV1().Pods(ns).Get(ctx, "spike", metav1.GetOptions{}); err == nil && p.Status.Phase == corev1.PodRunning {
				running = time.Since(t0)
			}
		}
		if time.Now().After(deadline) {
			dumpPod(ctx, t, cs, ns)
			shimLog(t, run)
			t.Fatalf("no output from the restored counter after 2m: %v", lastErr)
		}
		actx, acancel := context.WithTimeout(ctx, 10*time.Second)
		out, err := kexec(actx, "counter", "cat", "/tmp/count")
		acancel()
		if err == nil {
			if first, err = strconv.Atoi(out); err == nil {
				firstOut = time.Since(t0)
				break
			}
		}
		lastErr = err
		time.Sleep(50 * time.Millisecond)
	}
	for running == 0 {
		p, err := cs.CoreV1().Pods(ns).Get(ctx, "spike", metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if p.Status.Phase == corev1.PodRunning {
			running = time.Since(t0)
		} else if time.Since(t0) > time.Minute {
			t.Fatalf("the restored pod answers but is %s", p.Status.Phase)
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Logf("restored pod: first command output %s after the pod's creation (counter %d); the API showed it Running after %s", firstOut.Round(time.Millisecond), first, running.Round(time.Millisecond))
	if first < before {
		t.Errorf("counter restarted: %d after the restore, %d before the checkpoint", first, before)
	}
	restored, err := cs.CoreV1().Pods(ns).Get(ctx, "spike", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if restored.UID == oldUID {
		t.Fatalf("the pod was not replaced (UID %s)", restored.UID)
	}
	t.Logf("new pod %s, IP %s (was %s, %s)", restored.UID, restored.Status.PodIP, oldUID, oldIP)
	time.Sleep(time.Second)
	if later, _ := strconv.Atoi(must("counter")("cat", "/tmp/count")); later <= first {
		t.Errorf("counter stopped: %d, then %d a second later", first, later)
	}
	if got := repl(`print("x is", x)`); got != "x is 42" {
		t.Errorf("REPL after the restore: %q, want x is 42", got)
	}
	if got := repl(`print("sum", hashlib.sha256(blob).hexdigest())`); got != sum {
		t.Errorf("REPL's blob after the restore: %q, want %q", got, sum)
	}
	if got := repl(`note.seek(0); print("note", note.read())`); got != "note kept" {
		t.Errorf("REPL's open workspace file after the restore: %q, want note kept", got)
	}
	eventually(t, 30*time.Second, func() error {
		p, err := cs.CoreV1().Pods(ns).Get(ctx, "spike", metav1.GetOptions{})
		if err != nil {
			return err
		}
		restored = p
		if p.Status.PodIP == "" {
			return errors.New("no pod IP yet")
		}
		return web(p.Status.PodIP)
	})
	t.Logf("the server that listened before the checkpoint answers at the new pod IP %s", restored.Status.PodIP)

	// Files that differ in the new pod: the workspace file changed on the
	// host, /etc/hosts (kubelet's, naming the new IP).
	t.Logf("workspace file changed on the host while suspended (v1 -> v2) reads %q after the restore", inPod("cat", "/workspace/changed"))
	hosts := inPod("cat", "/etc/hosts")
	t.Logf("/etc/hosts after the restore names the new IP %s: %v, the old IP %s: %v", restored.Status.PodIP, strings.Contains(hosts, restored.Status.PodIP), oldIP, strings.Contains(hosts, oldIP))

	// What kubelet makes of it, a few seconds on.
	time.Sleep(5 * time.Second)
	restored, err = cs.CoreV1().Pods(ns).Get(ctx, "spike", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	logContainers(t, "after the restore", restored)
	if restored.Status.Phase != corev1.PodRunning {
		t.Errorf("restored pod is %s", restored.Status.Phase)
	}
	for _, s := range restored.Status.ContainerStatuses {
		if s.State.Running == nil || s.RestartCount != 0 {
			t.Errorf("container %s: state %+v, %d restarts", s.Name, s.State, s.RestartCount)
		}
	}
	// Which specs carried the annotation: the sandbox's and each
	// container's.
	cid := restored.Status.ContainerStatuses[0].ContainerID
	cid = cid[strings.Index(cid, "://")+3:]
	newSandbox, _ := readSpec(t, filepath.Join(bundles, cid, "config.json"))["annotations"].(map[string]any)["io.kubernetes.cri.sandbox-id"].(string)
	ids := map[string]string{"(sandbox)": newSandbox}
	for _, s := range restored.Status.ContainerStatuses {
		ids[s.Name] = s.ContainerID[strings.Index(s.ContainerID, "://")+3:]
	}
	for name, id := range ids {
		a := readSpec(t, filepath.Join(bundles, id, "config.json"))["annotations"].(map[string]any)
		t.Logf("OCI spec of %s %s: %s=%v, container-type %v, container-name %v", name, id[:12], testenv.RestoreAnnotation, a[testenv.RestoreAnnotation], a["io.kubernetes.cri.container-type"], a["io.kubernetes.cri.container-name"])
		if a[testenv.RestoreAnnotation] != img {
			t.Errorf("the OCI spec of %s lacks %s", name, testenv.RestoreAnnotation)
		}
	}
	var mounts []string
	for _, m := range readSpec(t, filepath.Join(bundles, ids["python"], "config.json"))["mounts"].([]any) {
		mounts = append(mounts, m.(map[string]any)["destination"].(string))
	}
	t.Logf("mounts of python: %v", mounts)
	evs, err := cs.CoreV1().Events(ns).List(ctx, metav1.ListOptions{})
	if err == nil {
		for _, e := range evs.Items {
			if e.InvolvedObject.UID == restored.UID {
				t.Logf("event: %s %s: %s", e.Type, e.Reason, e.Message)
			}
		}
	}
	shimLog(t, run)

	// A restore that cannot happen fails the pod's sandbox with the shim's
	// message; kubelet retries it, so the controller must give up and
	// resume without memory.
	if err := cs.CoreV1().Pods(ns).Delete(ctx, "spike", metav1.DeleteOptions{GracePeriodSeconds: new(int64)}); err != nil {
		t.Fatal(err)
	}
	bad := newPod(map[string]string{testenv.RestoreAnnotation: filepath.Join(run, "checkpoints", "missing")})
	bad.Name = "spike-bad"
	if _, err := cs.CoreV1().Pods(ns).Create(ctx, bad, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	eventually(t, time.Minute, func() error {
		evs, err := cs.CoreV1().Events(ns).List(ctx, metav1.ListOptions{FieldSelector: "involvedObject.name=spike-bad"})
		if err != nil {
			return err
		}
		for _, e := range evs.Items {
			if strings.Contains(e.Message, "no checkpoint image") || strings.Contains(e.Message, "checkpoint directory") {
				t.Logf("a pod naming a missing checkpoint: %s %s: %.500s", e.Type, e.Reason, e.Message)
				return nil
			}
		}
		return fmt.Errorf("no event about the missing checkpoint yet (%d events)", len(evs.Items))
	})
}

// shimLog logs what containerd's log says about restores (the shim's
// errors reach it).
func shimLog(t *testing.T, run string) {
	t.Helper()
	if b, err := os.ReadFile(filepath.Join(run, "containerd.log")); err == nil {
		for _, l := range strings.Split(string(b), "\n") {
			if strings.Contains(l, "estore") && !strings.Contains(l, "starting cri plugin") {
				t.Logf("containerd.log: %.1200s", l)
			}
		}
	}
}

func logContainers(t *testing.T, when string, p *corev1.Pod) {
	t.Helper()
	for _, s := range p.Status.ContainerStatuses {
		state := "waiting"
		switch {
		case s.State.Running != nil:
			state = "running since " + s.State.Running.StartedAt.Format(time.TimeOnly)
		case s.State.Terminated != nil:
			state = fmt.Sprintf("terminated %d %s", s.State.Terminated.ExitCode, s.State.Terminated.Reason)
		case s.State.Waiting != nil:
			state = "waiting " + s.State.Waiting.Reason
		}
		t.Logf("%s: pod %s, container %s: %s, ready %v, restarts %d", when, p.Status.Phase, s.Name, state, s.Ready, s.RestartCount)
	}
}

func dumpPod(ctx context.Context, t *testing.T, cs kubernetes.Interface, ns string) {
	t.Helper()
	if p, err := cs.CoreV1().Pods(ns).Get(ctx, "spike", metav1.GetOptions{}); err == nil {
		logContainers(t, "stuck", p)
		t.Logf("pod conditions: %+v", p.Status.Conditions)
	}
	if evs, err := cs.CoreV1().Events(ns).List(ctx, metav1.ListOptions{}); err == nil {
		for _, e := range evs.Items {
			t.Logf("event: %s %s %s: %s", e.InvolvedObject.Name, e.Type, e.Reason, e.Message)
		}
	}
}
