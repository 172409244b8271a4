//go:build suspendspike

package testenv_test

// The suspend-with-memory spike (docs/notes/suspend-with-memory.md): a gVisor
// pod's sandbox is checkpointed with runsc and restored outside containerd
// with its processes running. It is build-tagged so that CI never runs it;
// run it on the shared cluster as root:
//
//	.build/bin/agentbox-testenv exec -node -- go test -tags suspendspike -count=1 -v -run TestSuspendSpike ./internal/testenv/

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/remotecommand"

	"github.com/agentbox/terraform-provider-agentbox/internal/testenv"
	"github.com/agentbox/terraform-provider-agentbox/internal/testenv/toolchain"
)

// spikeREPL is a Python REPL fed through a FIFO, so that a test can send it
// lines with exec and read its answers from a file inside the sandbox.
const spikeREPL = `import code, os, sys
os.mkfifo('/tmp/in')
sys.stdout = sys.stderr = open('/tmp/out', 'a', buffering=1)
print('repl ready')
interp = code.InteractiveInterpreter()
while True:
    with open('/tmp/in') as f:
        for line in f:
            interp.runsource(line)
`

// spikeREPLClient sends the REPL one line and a marker, and prints the
// line the REPL wrote before the marker (empty when it wrote none).
const spikeREPLClient = `import sys, time
line, m = sys.argv[1], sys.argv[2]
with open("/tmp/in", "w") as f:
    f.write(line + "\nprint(%r)\n" % m)
for _ in range(1200):
    out = open("/tmp/out").read().splitlines()
    if m in out:
        i = out.index(m)
        print(out[i-1] if i > 0 and not out[i-1].startswith("@@") else "")
        break
    time.sleep(0.05)
else:
    sys.exit("no answer to " + line)
`

// spikeFillMiB is how much random memory the REPL holds while checkpointed.
const spikeFillMiB = 256

// TestSuspendSpike restores into a new network namespace that has only lo.
func TestSuspendSpike(t *testing.T) { suspendSpike(t, "suspendspike", false, false) }

// TestSuspendSpikePodNetwork restores into the network namespace of another
// (runc) pod, with its own address, and reaches a server that listened
// before the checkpoint at that new address.
func TestSuspendSpikePodNetwork(t *testing.T) { suspendSpike(t, "suspendspike-net", true, false) }

// TestSuspendSpikeFreshRootfs also gives every container a fresh rootfs
// from its image, as a new pod would have, instead of the checkpointed
// one's.
func TestSuspendSpikeFreshRootfs(t *testing.T) { suspendSpike(t, "suspendspike-fresh", true, true) }

func suspendSpike(t *testing.T, ns string, podNetwork, freshRootfs bool) {
	requireRoot(t)
	dir := cacheDir(t)
	cfg, _ := testenv.Shared(t)
	cs, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	run := filepath.Join(dir, "run")
	runsc := filepath.Join(toolchain.BinDir(dir), "runsc")
	// The runsc shim keeps its state under its root/<containerd namespace>.
	clusterRoot := filepath.Join(run, "runsc", "k8s.io")
	work := t.TempDir()
	spikeRoot := filepath.Join(work, "runsc-root")

	if _, err := cs.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cs.CoreV1().Namespaces().Delete(context.Background(), ns, metav1.DeleteOptions{}) })
	rc := testenv.RuntimeClass
	tag := os.Getenv("AGENTBOX_TEST_IMAGE_TAG")
	if tag == "" {
		tag = "dev"
	}
	pod := runPod(ctx, t, cs, &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "spike", Namespace: ns},
		Spec: corev1.PodSpec{
			RuntimeClassName:              &rc,
			TerminationGracePeriodSeconds: new(int64),
			Containers: []corev1.Container{{
				Name: "counter", Image: toolchain.BusyboxImage, ImagePullPolicy: corev1.PullNever,
				Command: []string{"sh", "-c", "i=0; while :; do echo $i > /tmp/count; i=$((i+1)); sleep 0.1; done"},
			}, {
				Name: "python", Image: "docker.io/agentbox-test/debian-python:" + tag, ImagePullPolicy: corev1.PullNever,
				Command: []string{"python3", "-u", "-c", spikeREPL},
			}, {
				Name: "web", Image: "docker.io/agentbox-test/debian-python:" + tag, ImagePullPolicy: corev1.PullNever,
				Command: []string{"python3", "-m", "http.server", "8080", "--bind", "0.0.0.0", "--directory", "/etc"},
			}},
		},
	})
	kexec := func(container string, cmd ...string) string {
		t.Helper()
		out, errOut, err := execContainer(ctx, cfg, cs, ns, pod.Name, container, cmd...)
		if err != nil {
			t.Fatalf("exec %v in %s: %v (stderr %q)", cmd, container, err, errOut)
		}
		return strings.TrimSpace(out)
	}
	marks := 0
	repl := func(exec func(cmd ...string) string, line string) string {
		marks++
		return exec("python3", "-c", spikeREPLClient, line, fmt.Sprintf("@@%d", marks))
	}
	inPod := func(cmd ...string) string { return kexec("python", cmd...) }
	eventually(t, time.Minute, func() error {
		if out := inPod("cat", "/tmp/out"); !strings.Contains(out, "repl ready") {
			return fmt.Errorf("REPL not ready: %q", out)
		}
		return nil
	})
	repl(inPod, "import os, hashlib")
	repl(inPod, "x = 41 + 1")
	repl(inPod, fmt.Sprintf("blob = os.urandom(%d << 20)", spikeFillMiB))
	sum := repl(inPod, `print("sum", hashlib.sha256(blob).hexdigest())`)
	if !strings.HasPrefix(sum, "sum ") {
		t.Fatalf("REPL answered %q", sum)
	}
	t.Logf("REPL holds x=42 and %d MiB, %s", spikeFillMiB, sum)

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
	var counterID, pythonID, webID string
	for _, s := range pod.Status.ContainerStatuses {
		id := s.ContainerID[strings.Index(s.ContainerID, "://")+3:]
		switch s.Name {
		case "counter":
			counterID = id
		case "python":
			pythonID = id
		case "web":
			webID = id
		}
	}
	bundles := filepath.Join(run, "containerd", "state", "io.containerd.runtime.v2.task", "k8s.io")
	spec := readSpec(t, filepath.Join(bundles, counterID, "config.json"))
	sandboxID, _ := spec["annotations"].(map[string]any)["io.kubernetes.cri.sandbox-id"].(string)
	t.Logf("sandbox %s", sandboxID)

	// Kubernetes' checkpoint API goes through containerd's CRI, which wants
	// CRIU and the shim's standard Checkpoint call, which runsc's shim does
	// not implement.
	res := cs.CoreV1().RESTClient().Post().AbsPath("/api/v1/nodes", testenv.NodeName, "proxy", "checkpoint", ns, pod.Name, "counter").Do(ctx)
	if err := res.Error(); err == nil {
		t.Errorf("the kubelet checkpoint API worked on a gVisor pod; the notes say it cannot")
	} else {
		t.Logf("kubelet checkpoint API: %v", err)
	}

	// Everything a restore outside containerd needs from the pod, taken
	// while it runs: containerd and kubelet remove theirs with the sandbox.
	netns, newIP := "/var/run/netns/abx-"+ns, ""
	if podNetwork {
		// A runc pod lends its network namespace, as a new pod's sandbox
		// would: an address on the pod network, routes, a veth.
		donor := busyboxPod("netns-donor", ns, "sleep 3600")
		donor.Spec.RuntimeClassName = nil
		donor = runPod(ctx, t, cs, donor)
		newIP = donor.Status.PodIP
		id := donor.Status.ContainerStatuses[0].ContainerID
		id = id[strings.Index(id, "://")+3:]
		dspec := readSpec(t, filepath.Join(bundles, id, "config.json"))
		for _, n := range dspec["linux"].(map[string]any)["namespaces"].([]any) {
			if n := n.(map[string]any); n["type"] == "network" {
				netns = n["path"].(string)
			}
		}
		t.Logf("restoring into the network namespace %s of pod netns-donor, IP %s (was %s)", netns, newIP, pod.Status.PodIP)
	} else {
		name := filepath.Base(netns)
		mustRun(t, "ip", "netns", "add", name)
		t.Cleanup(func() { _ = exec.Command("ip", "netns", "del", name).Run() })
		mustRun(t, "ip", "-n", name, "link", "set", "lo", "up")
	}
	names := []string{"pause", "counter", "python", "web"}
	ctr := func(args ...string) []byte {
		t.Helper()
		out, err := exec.Command(filepath.Join(toolchain.BinDir(dir), "ctr"), append([]string{"-a", filepath.Join(run, "containerd", "containerd.sock"), "-n", "k8s.io"}, args...)...).Output()
		if err != nil {
			t.Fatalf("ctr %v: %v", args, err)
		}
		return out
	}
	for i, id := range []string{sandboxID, counterID, pythonID, webID} {
		b := filepath.Join(work, "b-"+names[i])
		rootfs := filepath.Join(bundles, id, "rootfs")
		if freshRootfs {
			rootfs = freshSnapshot(t, ctr, id, ns+"-"+names[i], filepath.Join(work, "fresh-"+names[i]))
		}
		prepareBundle(t, filepath.Join(bundles, id), rootfs, b, netns, "spike-pause")
	}

	count := func(exec func(cmd ...string) string) int {
		n, err := strconv.Atoi(exec("cat", "/tmp/count"))
		if err != nil {
			t.Fatalf("counter: %v", err)
		}
		return n
	}
	before := count(func(cmd ...string) string { return kexec("counter", cmd...) })
	img := filepath.Join(work, "ck")
	t0 := time.Now()
	mustRun(t, runsc, "--root", clusterRoot, "checkpoint", "--image-path", img, sandboxID)
	took := time.Since(t0)
	t.Logf("checkpoint (stops the sandbox): %s, image %s, counter was at %d or more", took.Round(time.Millisecond), dirSize(t, img), before)

	// The restore: the root (pause) container first, then each container
	// created and restored in the checkpoint's order; the sandbox resumes
	// after the last.
	sr := func(args ...string) []string {
		return append([]string{"--root", spikeRoot, "--platform=systrap"}, args...)
	}
	t.Cleanup(func() {
		for _, n := range []string{"web", "python", "counter", "pause"} {
			_ = exec.Command(runsc, sr("kill", "spike-"+n, "KILL")...).Run()
			_ = exec.Command(runsc, sr("delete", "--force", "spike-"+n)...).Run()
		}
	})
	// runsc keeps a null network namespace mounted in its root.
	t.Cleanup(func() { _ = exec.Command("umount", filepath.Join(spikeRoot, "null-netns")).Run() })
	t0 = time.Now()
	for _, n := range names {
		b := filepath.Join(work, "b-"+n)
		if n != "pause" {
			runDetached(t, b, runsc, sr("create", "spike-"+n)...)
		}
		runDetached(t, b, runsc, sr("restore", "--image-path", img, "--detach", "spike-"+n)...)
	}
	restored := time.Since(t0)
	spikeExec := func(id string) func(cmd ...string) string {
		return func(cmd ...string) string {
			out, err := exec.Command(runsc, sr(append([]string{"exec", id}, cmd...)...)...).CombinedOutput()
			if err != nil {
				t.Fatalf("runsc exec %v: %v: %s", cmd, err, out)
			}
			return strings.TrimSpace(string(out))
		}
	}
	first := count(spikeExec("spike-counter"))
	firstOut := time.Since(t0)
	t.Logf("restored in %s; first command output after %s (counter %d)", restored.Round(time.Millisecond), firstOut.Round(time.Millisecond), first)
	if first < before {
		t.Errorf("counter restarted: %d after the restore, %d before the checkpoint", first, before)
	}
	time.Sleep(time.Second)
	if later := count(spikeExec("spike-counter")); later <= first {
		t.Errorf("counter stopped: %d, then %d a second later", first, later)
	}
	if got := repl(spikeExec("spike-python"), `print("x is", x)`); got != "x is 42" {
		t.Errorf("REPL after the restore: %q, want x is 42", got)
	}
	if got := repl(spikeExec("spike-python"), `print("sum", hashlib.sha256(blob).hexdigest())`); got != sum {
		t.Errorf("REPL's blob after the restore: %q, want %q", got, sum)
	}
	if podNetwork {
		// The server's listening socket was restored; it must now accept
		// on the new address.
		t0 = time.Now()
		eventually(t, 30*time.Second, func() error { return web(newIP) })
		t.Logf("the server that listened before the checkpoint answers at the new address %s (%s)", newIP, time.Since(t0).Round(time.Millisecond))
	}
}

func execContainer(ctx context.Context, cfg *rest.Config, cs kubernetes.Interface, ns, pod, container string, cmd ...string) (string, string, error) {
	req := cs.CoreV1().RESTClient().Post().Resource("pods").Namespace(ns).Name(pod).SubResource("exec").
		VersionedParams(&corev1.PodExecOptions{Container: container, Command: cmd, Stdout: true, Stderr: true}, scheme.ParameterCodec)
	exe, err := remotecommand.NewSPDYExecutor(cfg, http.MethodPost, req.URL())
	if err != nil {
		return "", "", err
	}
	var stdout, stderr bytes.Buffer
	err = exe.StreamWithContext(ctx, remotecommand.StreamOptions{Stdout: &stdout, Stderr: &stderr})
	return stdout.String(), stderr.String(), err
}

func readSpec(t *testing.T, path string) map[string]any {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var spec map[string]any
	if err := json.Unmarshal(b, &spec); err != nil {
		t.Fatal(err)
	}
	return spec
}

// prepareBundle makes a bundle for a restore outside containerd out of a
// running container's: the same spec in a new network namespace, without
// the pod's cgroup, in sandbox sandboxID, its rootfs bind-mounted (which
// keeps containerd's overlay alive after containerd unmounts it) and each
// bind mount's source copied.
func prepareBundle(t *testing.T, from, fromRootfs, to, netns, sandboxID string) {
	t.Helper()
	rootfs := filepath.Join(to, "rootfs")
	if err := os.MkdirAll(rootfs, 0o755); err != nil {
		t.Fatal(err)
	}
	mustRun(t, "mount", "--bind", fromRootfs, rootfs)
	t.Cleanup(func() { _ = exec.Command("umount", "-l", rootfs).Run() })
	spec := readSpec(t, filepath.Join(from, "config.json"))
	linux := spec["linux"].(map[string]any)
	delete(linux, "cgroupsPath")
	for _, n := range linux["namespaces"].([]any) {
		if n := n.(map[string]any); n["type"] == "network" {
			n["path"] = netns
		}
	}
	spec["annotations"].(map[string]any)["io.kubernetes.cri.sandbox-id"] = sandboxID
	for i, m := range spec["mounts"].([]any) {
		m := m.(map[string]any)
		src, _ := m["source"].(string)
		if !filepath.IsAbs(src) || strings.HasPrefix(src, "/dev") || strings.HasPrefix(src, "/proc") || strings.HasPrefix(src, "/sys") {
			continue
		}
		if _, err := os.Stat(src); err != nil {
			continue
		}
		dst := filepath.Join(to, fmt.Sprintf("m%d", i))
		mustRun(t, "cp", "-a", src, dst)
		m["source"] = dst
	}
	b, err := json.Marshal(spec)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(to, "config.json"), b, 0o644); err != nil {
		t.Fatal(err)
	}
}

func mustRun(t *testing.T, name string, args ...string) {
	t.Helper()
	mustRunIn(t, "", name, args...)
}

func mustRunIn(t *testing.T, dir, name string, args ...string) {
	t.Helper()
	cmd := exec.Command(name, args...)
	cmd.Dir = dir
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("%s %s: %v: %s", name, strings.Join(args, " "), err, out)
	}
}

// freshSnapshot mounts at dir a new snapshot of the image container id
// runs from, as containerd would for a new container of that image.
func freshSnapshot(t *testing.T, ctr func(args ...string) []byte, id, key, dir string) string {
	t.Helper()
	var info struct{ Snapshotter, SnapshotKey string }
	if err := json.Unmarshal(ctr("containers", "info", id), &info); err != nil {
		t.Fatal(err)
	}
	var snap struct{ Parent string }
	if err := json.Unmarshal(ctr("snapshots", "--snapshotter", info.Snapshotter, "info", info.SnapshotKey), &snap); err != nil {
		t.Fatal(err)
	}
	var mounts []struct {
		Type, Source string
		Options      []string
	}
	if err := json.Unmarshal(ctr("snapshots", "--snapshotter", info.Snapshotter, "prepare", "--mounts", key, snap.Parent), &mounts); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ctr("snapshots", "--snapshotter", info.Snapshotter, "rm", key) })
	if len(mounts) != 1 {
		t.Fatalf("snapshot %s has %d mounts, want 1: %+v", key, len(mounts), mounts)
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	args := []string{"-t", mounts[0].Type, mounts[0].Source, dir}
	if len(mounts[0].Options) > 0 {
		args = append(args, "-o", strings.Join(mounts[0].Options, ","))
	}
	mustRun(t, "mount", args...)
	t.Cleanup(func() { _ = exec.Command("umount", dir).Run() })
	return dir
}

// runDetached runs a runsc command that leaves a sandbox behind. Its output
// goes to a file: the sandbox inherits the command's stdio, so a pipe would
// never reach EOF.
func runDetached(t *testing.T, dir, name string, args ...string) {
	t.Helper()
	log, err := os.CreateTemp(dir, "runsc-*.log")
	if err != nil {
		t.Fatal(err)
	}
	defer log.Close()
	cmd := exec.Command(name, args...)
	cmd.Dir, cmd.Stdout, cmd.Stderr = dir, log, log
	if err := cmd.Run(); err != nil {
		out, _ := os.ReadFile(log.Name())
		t.Fatalf("%s %s: %v: %s", name, strings.Join(args, " "), err, out)
	}
}

func dirSize(t *testing.T, dir string) string {
	t.Helper()
	var n int64
	entries, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range entries {
		if info, err := e.Info(); err == nil {
			n += info.Size()
		}
	}
	return fmt.Sprintf("%.1f MiB", float64(n)/(1<<20))
}
