package testenv_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/agentbox/terraform-provider-agentbox/internal/testenv"
	"github.com/agentbox/terraform-provider-agentbox/internal/testenv/csistack"
	"github.com/agentbox/terraform-provider-agentbox/internal/testenv/snapshotctl"
)

// envCSICrash makes TestCSIStackCrashHelper run: it is the test process
// that TestTeardownAfterCrashedCSIStack kills.
const envCSICrash = "AGENTBOX_TEST_CSI_CRASH"

// crashReady is what the helper prints once a pod has a CSI volume mounted.
const crashReady = "csi volume mounted; crashing"

// TestTeardownAfterCrashedCSIStack kills a test process that runs a CSI
// stack (driver, sidecars, snapshot-controller) with a pod on one of its
// volumes, so that none of the test's cleanups run, and checks that the
// cluster's teardown still leaves no process, mount or folder of it.
func TestTeardownAfterCrashedCSIStack(t *testing.T) {
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
	runDir := c.LogDir()

	cmd := exec.CommandContext(ctx, os.Args[0], "-test.run=^TestCSIStackCrashHelper$", "-test.v", "-test.count=1")
	cmd.Env = append(os.Environ(), envCSICrash+"=1", testenv.EnvKubeconfig+"="+c.Kubeconfig)
	out, err := cmd.CombinedOutput()
	var exit *exec.ExitError
	if !errors.As(err, &exit) || !strings.Contains(string(out), crashReady) {
		t.Fatalf("the helper did not crash with a mounted CSI volume (%v):\n%s", err, out)
	}
	if ws, ok := exit.Sys().(syscall.WaitStatus); !ok || ws.Signal() != syscall.SIGKILL {
		t.Fatalf("the helper ended with %v, not SIGKILL:\n%s", err, out)
	}
	for _, line := range strings.Split(string(out), "\n") {
		if strings.Contains(line, "into the 32 MiB CSI volume") {
			t.Logf("helper: %s", strings.TrimSpace(line))
		}
	}
	mounts := csiMounts(t, runDir)
	if len(mounts) == 0 {
		t.Fatalf("no CSI mount under %s after the crash; the test would prove nothing", runDir)
	}
	t.Logf("left by the crashed test: %d CSI mount(s), e.g. %s", len(mounts), mounts[0])

	start := time.Now()
	if err := c.Stop(ctx); err != nil {
		t.Fatalf("stop: %v", err)
	}
	stopped = true
	t.Logf("teardown after the crash took %s", time.Since(start).Round(time.Millisecond))
	assertClean(t, runDir)
}

// TestCSIStackCrashHelper is run, and killed, by
// TestTeardownAfterCrashedCSIStack. On its way it checks that the CSI
// driver's volume is a filesystem of the claim's size, as the default
// class's are (TestNode's PVCSizeLimit): a gVisor pod writing past it gets
// ENOSPC. A failure here ends the helper without the crash, which fails
// the calling test with this output.
func TestCSIStackCrashHelper(t *testing.T) {
	if os.Getenv(envCSICrash) == "" {
		t.Skip("run by TestTeardownAfterCrashedCSIStack")
	}
	cfg, kubeconfig := testenv.Shared(t)
	snapshotctl.Start(t, cfg, kubeconfig)
	stack := csistack.Start(t, cfg, kubeconfig)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	cs := kubernetes.NewForConfigOrDie(cfg)
	ns := "csi-crash"
	if _, err := cs.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	pvc := &corev1.PersistentVolumeClaim{
		ObjectMeta: metav1.ObjectMeta{Name: "data", Namespace: ns},
		Spec: corev1.PersistentVolumeClaimSpec{
			AccessModes:      []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
			StorageClassName: &stack.StorageClass,
			Resources:        corev1.VolumeResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("32Mi")}},
		},
	}
	if _, err := cs.CoreV1().PersistentVolumeClaims(ns).Create(ctx, pvc, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	pod := busyboxPod("user", ns, "echo kept > /data/file && sleep 3600")
	pod.Spec.Volumes = []corev1.Volume{{Name: "data", VolumeSource: corev1.VolumeSource{
		PersistentVolumeClaim: &corev1.PersistentVolumeClaimVolumeSource{ClaimName: "data"}}}}
	pod.Spec.Containers[0].VolumeMounts = []corev1.VolumeMount{{Name: "data", MountPath: "/data"}}
	runPod(ctx, t, cs, pod)
	// Through busybox: the image links only a few of its applets.
	out, errOut, err := execIn(ctx, cfg, cs, ns, pod.Name, "busybox", "dd", "if=/dev/zero", "of=/data/big", "bs=1M", "count=64")
	if err == nil || !strings.Contains(errOut, "No space left on device") {
		t.Fatalf("dd of 64 MiB into a 32 MiB CSI volume: %v, stdout %q, stderr %q; want ENOSPC", err, out, errOut)
	}
	t.Logf("dd of 64 MiB into the 32 MiB CSI volume: %s", strings.TrimSpace(errOut))
	if out, errOut, err := execIn(ctx, cfg, cs, ns, pod.Name, "cat", "/data/file"); err != nil || out != "kept\n" {
		t.Fatalf("the file written before the volume filled: %v, stdout %q, stderr %q", err, out, errOut)
	}
	fmt.Println(crashReady)
	// SIGKILL: no deferred call, cleanup or signal handler runs, as when a
	// test binary is killed for its timeout.
	_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
	select {}
}

// csiMounts lists the mount points of CSI volumes below dir.
func csiMounts(t *testing.T, dir string) []string {
	t.Helper()
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	var mounts []string
	for _, line := range strings.Split(string(b), "\n") {
		if f := strings.Fields(line); len(f) > 4 && strings.HasPrefix(f[4], dir+"/") && strings.Contains(f[4], "/kubernetes.io~csi/") {
			mounts = append(mounts, f[4])
		}
	}
	return mounts
}
