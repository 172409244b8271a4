package testenv_test

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/agentbox/terraform-provider-agentbox/internal/testenv/loopvol"
	"github.com/agentbox/terraform-provider-agentbox/internal/testenv/toolchain"
)

// testPVCSizeLimit checks that a claim of the default class is a real
// filesystem of the claim's size: a non-root gVisor pod that writes past it
// gets ENOSPC, and what it wrote before stays intact. Deleting the claim
// unmounts the volume, detaches its loop device and removes its image.
func testPVCSizeLimit(ctx context.Context, t *testing.T, cfg *rest.Config, cs kubernetes.Interface, ns, runDir string) {
	// The provisioner mounts each volume in the mount namespace it runs in,
	// and a pod sees the mount only if kubelet and containerd (which starts
	// the gVisor shim and gofer) share that namespace: the host's root
	// mount may be private, so no mount would propagate from another.
	var first string
	for _, name := range []string{toolchain.LocalPathProvisioner, "kubelet", "containerd"} {
		pid := pidOf(t, name, runDir)
		mntNS, err := os.Readlink(fmt.Sprintf("/proc/%d/ns/mnt", pid))
		if err != nil {
			t.Fatal(err)
		}
		t.Logf("%s (pid %d) runs in mount namespace %s", name, pid, mntNS)
		if first == "" {
			first = mntNS
		} else if mntNS != first {
			t.Errorf("%s runs in mount namespace %s, the provisioner in %s: pods would not see its volumes", name, mntNS, first)
		}
	}
	if b, err := os.ReadFile("/proc/self/mountinfo"); err == nil {
		for _, line := range strings.Split(string(b), "\n") {
			// Optional fields (shared:N, master:N) sit between the mount
			// options and the "-" separator; none means private.
			f := strings.Fields(line)
			if sep := slices.Index(f, "-"); sep >= 6 && f[4] == "/" {
				t.Logf("the host's root mount: propagation %q (empty: private)", strings.Join(f[6:sep], " "))
			}
		}
	}
	const claimMiB = 32
	claim := createClaim(ctx, t, cs, ns, "small", fmt.Sprintf("%dMi", claimMiB))
	pv := boundVolume(ctx, t, cs, claim)
	if pv.Spec.HostPath == nil {
		t.Fatalf("volume %s is not a hostPath volume: %+v", pv.Name, pv.Spec.PersistentVolumeSource)
	}
	path := pv.Spec.HostPath.Path
	if m, err := loopvol.Mounted(path); err != nil || !m {
		t.Fatalf("volume folder %s is not a mount point (%v)", path, err)
	}
	if devs := loopDevicesUnder(t, path); len(devs) != 1 {
		t.Fatalf("loop devices of volume %s: %v, want one", pv.Name, devs)
	}

	pod := busyboxPod("filler", ns, "sleep 3600")
	uid := int64(65532)
	pod.Spec.SecurityContext = &corev1.PodSecurityContext{RunAsUser: &uid, RunAsGroup: &uid}
	pod.Spec.Volumes = []corev1.Volume{{Name: "data", VolumeSource: corev1.VolumeSource{
		PersistentVolumeClaim: &corev1.PersistentVolumeClaimVolumeSource{ClaimName: claim.Name}}}}
	pod.Spec.Containers[0].VolumeMounts = []corev1.VolumeMount{{Name: "data", MountPath: "/data"}}
	runPod(ctx, t, cs, pod)

	// The pod sees the volume's filesystem, not the node's disk: the loop
	// mount existed before the pod's sandbox started.
	// The image links only a few of busybox's applets; the rest are called
	// through busybox itself.
	out, errOut, err := execIn(ctx, cfg, cs, ns, pod.Name, "busybox", "df", "-k", "/data")
	if err != nil {
		t.Fatalf("df: %v, stdout %q, stderr %q", err, out, errOut)
	}
	t.Logf("df -k /data inside the pod:\n%s", strings.TrimSpace(out))
	lines := strings.Split(strings.TrimSpace(out), "\n")
	fields := strings.Fields(lines[len(lines)-1])
	if len(fields) < 2 {
		t.Fatalf("df output %q", out)
	}
	if kib, err := strconv.Atoi(fields[1]); err != nil || kib > claimMiB*1024 || kib < claimMiB*1024/2 {
		t.Errorf("the pod's /data has %s KiB; want the claim's %d MiB less the filesystem's metadata", fields[1], claimMiB)
	}

	out, errOut, err = execIn(ctx, cfg, cs, ns, pod.Name, "sh", "-c", "echo kept > /data/kept && cat /data/kept")
	if err != nil || strings.TrimSpace(out) != "kept" {
		t.Fatalf("write a file: %v, stdout %q, stderr %q", err, out, errOut)
	}
	// Twice the claim's size: the write must stop at the size, not at the
	// node's disk.
	out, errOut, err = execIn(ctx, cfg, cs, ns, pod.Name, "busybox", "dd", "if=/dev/zero", "of=/data/big", "bs=1M", fmt.Sprintf("count=%d", 2*claimMiB))
	t.Logf("dd of %d MiB into the %d MiB claim: err %v, stderr %q", 2*claimMiB, claimMiB, err, strings.TrimSpace(errOut))
	if err == nil {
		t.Fatalf("dd of %d MiB into a %d MiB claim succeeded; stdout %q, stderr %q", 2*claimMiB, claimMiB, out, errOut)
	}
	if !strings.Contains(errOut, "No space left on device") {
		t.Errorf("dd failed with %q, want ENOSPC (No space left on device)", errOut)
	}
	out, errOut, err = execIn(ctx, cfg, cs, ns, pod.Name, "sh", "-c", "cat /data/kept && busybox stat -c %s /data/big")
	if err != nil {
		t.Fatalf("read back: %v, stdout %q, stderr %q", err, out, errOut)
	}
	got := strings.Fields(out)
	if len(got) != 2 || got[0] != "kept" {
		t.Fatalf("after the volume filled: %q, want the earlier file intact and the big file's size", out)
	}
	if n, err := strconv.ParseInt(got[1], 10, 64); err != nil || n > claimMiB<<20 {
		t.Errorf("the big file holds %s bytes; want at most the claim's %d MiB", got[1], claimMiB)
	}
	// The bytes are in the volume's image on the node, nowhere else.
	if b, err := os.ReadFile(filepath.Join(path, "kept")); err != nil || string(b) != "kept\n" {
		t.Errorf("the file on the node: %q, %v", b, err)
	}

	// A claim asking for less than a filesystem needs gets loopvol.MinSize.
	tiny := createClaim(ctx, t, cs, ns, "tiny", "1Mi")
	tinyPV := boundVolume(ctx, t, cs, tiny)
	if got := tinyPV.Spec.Capacity[corev1.ResourceStorage]; got.Value() != loopvol.MinSize {
		t.Errorf("a 1Mi claim's volume has capacity %s, want %d bytes", got.String(), int64(loopvol.MinSize))
	}

	zero := int64(0)
	if err := cs.CoreV1().Pods(ns).Delete(ctx, pod.Name, metav1.DeleteOptions{GracePeriodSeconds: &zero}); err != nil {
		t.Fatal(err)
	}
	for _, c := range []*corev1.PersistentVolumeClaim{claim, tiny} {
		if err := cs.CoreV1().PersistentVolumeClaims(ns).Delete(ctx, c.Name, metav1.DeleteOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	start := time.Now()
	for _, v := range []*corev1.PersistentVolume{pv, tinyPV} {
		eventually(t, 2*time.Minute, func() error {
			_, err := cs.CoreV1().PersistentVolumes().Get(ctx, v.Name, metav1.GetOptions{})
			if apierrors.IsNotFound(err) {
				return nil
			}
			return fmt.Errorf("volume %s still exists (%v)", v.Name, err)
		})
	}
	t.Logf("volumes deleted %s after their claims", time.Since(start).Round(time.Millisecond))
	for _, v := range []*corev1.PersistentVolume{pv, tinyPV} {
		p := v.Spec.HostPath.Path
		if m, _ := loopvol.Mounted(p); m {
			t.Errorf("volume %s still mounted at %s", v.Name, p)
		}
		if devs := loopDevicesUnder(t, p); len(devs) > 0 {
			t.Errorf("volume %s: loop devices %v still attached", v.Name, devs)
		}
		// The folder and its image, whatever it is called, share its name.
		entries, _ := os.ReadDir(filepath.Dir(p))
		for _, e := range entries {
			if strings.HasPrefix(e.Name(), filepath.Base(p)) {
				t.Errorf("volume %s: %s left on the node", v.Name, filepath.Join(filepath.Dir(p), e.Name()))
			}
		}
	}
}

func createClaim(ctx context.Context, t *testing.T, cs kubernetes.Interface, ns, name, size string) *corev1.PersistentVolumeClaim {
	t.Helper()
	pvc := &corev1.PersistentVolumeClaim{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns},
		Spec: corev1.PersistentVolumeClaimSpec{
			AccessModes: []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
			Resources:   corev1.VolumeResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceStorage: resource.MustParse(size)}},
		},
	}
	pvc, err := cs.CoreV1().PersistentVolumeClaims(ns).Create(ctx, pvc, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return pvc
}

func boundVolume(ctx context.Context, t *testing.T, cs kubernetes.Interface, claim *corev1.PersistentVolumeClaim) *corev1.PersistentVolume {
	t.Helper()
	var pv *corev1.PersistentVolume
	eventually(t, time.Minute, func() error {
		got, err := cs.CoreV1().PersistentVolumeClaims(claim.Namespace).Get(ctx, claim.Name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		if got.Status.Phase != corev1.ClaimBound {
			return fmt.Errorf("claim %s is %s", claim.Name, got.Status.Phase)
		}
		pv, err = cs.CoreV1().PersistentVolumes().Get(ctx, got.Spec.VolumeName, metav1.GetOptions{})
		return err
	})
	return pv
}

// loopDevicesUnder lists the attached loop devices whose backing file's
// path starts with prefix.
func loopDevicesUnder(t *testing.T, prefix string) []loopvol.Device {
	t.Helper()
	devs, err := loopvol.Devices()
	if err != nil {
		t.Fatal(err)
	}
	var ours []loopvol.Device
	for _, d := range devs {
		if strings.HasPrefix(d.Backing, prefix) {
			ours = append(ours, d)
		}
	}
	return ours
}

// crashProvisioner kills the cluster's volume provisioner, which has
// volumes mounted, and leaves a loop device attached to an image without a
// mount, as a provisioner killed between the two steps could: the cluster's
// teardown must clean both up.
func crashProvisioner(ctx context.Context, t *testing.T, runDir string) {
	t.Helper()
	pid := pidOf(t, toolchain.LocalPathProvisioner, runDir)
	if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	volumes := filepath.Join(runDir, "volumes")
	mounted := len(loopDevicesUnder(t, volumes+"/"))
	if mounted == 0 {
		t.Fatalf("no volume mounted below %s when the provisioner crashed; the test would prove nothing", volumes)
	}
	image := filepath.Join(volumes, "pvc-crashed.img")
	if err := loopvol.Format(ctx, image, 0, 0o777); err != nil {
		t.Fatal(err)
	}
	out, err := exec.CommandContext(ctx, "losetup", "--find", "--show", image).CombinedOutput()
	if err != nil {
		t.Fatalf("losetup %s: %v: %s", image, err, out)
	}
	t.Logf("provisioner (pid %d) killed with %d volume(s) on loop devices, and %s attached to %s with no mount",
		pid, mounted, strings.TrimSpace(string(out)), image)
}

// pidOf finds the cluster's process whose program is name: the one whose
// command line mentions runDir.
func pidOf(t *testing.T, name, runDir string) int {
	t.Helper()
	var pids []int
	procs, _ := os.ReadDir("/proc")
	for _, p := range procs {
		pid, err := strconv.Atoi(p.Name())
		if err != nil {
			continue
		}
		cmdline, err := os.ReadFile(filepath.Join("/proc", p.Name(), "cmdline"))
		if err == nil && filepath.Base(strings.SplitN(string(cmdline), "\x00", 2)[0]) == name &&
			strings.Contains(string(cmdline), runDir+"/") {
			pids = append(pids, pid)
		}
	}
	if len(pids) != 1 {
		t.Fatalf("processes %s of %s: %v, want one", name, runDir, pids)
	}
	return pids[0]
}
