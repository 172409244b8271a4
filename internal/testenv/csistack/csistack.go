// Package csistack runs a real CSI storage stack on the test cluster's node,
// as host processes beside kubelet: the test-only csihostpath driver
// (volumes are folders, snapshots are tar archives), registered with kubelet
// the way node-driver-registrar does it, and the Kubernetes CSI project's own
// csi-provisioner and csi-snapshotter sidecars, built from the Go module
// proxy by `make testenv`. With the snapshot-controller (package snapshotctl)
// the cluster then runs the whole CSI snapshot path with real data: a claim
// of the StorageClass is a folder (the mount point of a filesystem of the
// claim's size, so writes past it fail), a VolumeSnapshot of it is a tar archive
// cut by CSI CreateSnapshot, and a claim whose dataSource is that snapshot
// is provisioned with its contents.
//
// Each Start runs a driver of its own name, with its own StorageClass and
// VolumeSnapshotClass, so that tests in parallel, and packages sharing the
// cluster, never see each other's volumes.
package csistack

import (
	"bufio"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	snapshotv1 "github.com/kubernetes-csi/external-snapshotter/client/v6/apis/volumesnapshot/v1"
	snapclient "github.com/kubernetes-csi/external-snapshotter/client/v6/clientset/versioned"
	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/utils/ptr"

	"github.com/agentbox/terraform-provider-agentbox/internal/testenv"
	"github.com/agentbox/terraform-provider-agentbox/internal/testenv/loopvol"
	"github.com/agentbox/terraform-provider-agentbox/internal/testenv/toolchain"
)

// Stack is one CSI driver with its sidecars, running on the test node.
type Stack struct {
	// Driver is the CSI driver's name, the provisioner of StorageClass and
	// the driver of SnapshotClass.
	Driver string
	// StorageClass provisions volumes of the driver (reclaim Delete,
	// immediate binding).
	StorageClass string
	// SnapshotClass cuts snapshots with the driver (deletion policy Delete).
	SnapshotClass string

	dir   string
	cs    kubernetes.Interface
	snaps snapclient.Interface
	procs []*process
}

// startTimeout bounds each wait of Start: kubelet registers a plugin within
// a second or two of its socket appearing.
const startTimeout = time.Minute

// cleanupTimeout bounds how long the cleanup waits for the sidecars to
// delete the driver's volumes and snapshots once their claims and
// VolumeSnapshots are gone; a sandbox pod has a grace period to end first.
const cleanupTimeout = 2 * time.Minute

// Start runs a CSI driver, csi-provisioner and csi-snapshotter on the node
// of the cluster until the test ends, registers the driver with kubelet,
// and creates its CSIDriver, StorageClass and VolumeSnapshotClass. It skips
// the test when the cluster has no node or `make testenv` has not built the
// binaries.
//
// The snapshot CRDs must be installed (snapshotctl.Start does that), and
// Start must be called before anything that makes volumes of the stack:
// its cleanup, which runs after theirs, waits for the claims and
// VolumeSnapshots to go, and for the sidecars to delete the volumes and
// snapshots behind them, before it stops the processes, unmounts whatever
// is left and removes the folders.
func Start(tb testing.TB, cfg *rest.Config, kubeconfig string) *Stack {
	tb.Helper()
	if os.Geteuid() != 0 {
		tb.Skip("a CSI driver on the test node needs root (it mounts volumes)")
	}
	bins := stackBinaries(tb)
	ctx, cancel := context.WithTimeout(context.Background(), 2*startTimeout)
	defer cancel()
	cs, snaps, registry := nodeClients(ctx, tb, cfg, kubeconfig)

	b := make([]byte, 4)
	_, _ = rand.Read(b)
	name := "hostpath-" + hex.EncodeToString(b) + ".csi.agentbox.test"
	s := &Stack{Driver: name, StorageClass: name, SnapshotClass: name, cs: cs, snaps: snaps,
		dir: filepath.Join(testenv.StateDir(kubeconfig), "csi", name)}
	sock := filepath.Join(s.dir, "csi.sock")
	// sun_path holds 108 bytes with its terminating NUL.
	for _, p := range []string{sock, filepath.Join(registry, name+"-reg.sock")} {
		if len(p) > 107 {
			tb.Fatalf("socket path %s is too long for a unix socket; use a shorter AGENTBOX_TESTENV_DIR", p)
		}
	}
	// Registered first, so that a Start that fails halfway is undone too.
	tb.Cleanup(func() { s.cleanup(tb) })

	s.startDriver(ctx, tb, bins[toolchain.CSIHostPath], sock, registry)
	s.startSidecars(tb, bins, sock, kubeconfig)
	s.createClasses(ctx, tb)
	return s
}

// stackBinaries finds the stack's programs, and skips the test when
// `make testenv` has not built them.
func stackBinaries(tb testing.TB) map[string]string {
	tb.Helper()
	dir, err := toolchain.DefaultDir()
	if err != nil {
		tb.Skipf("no CSI stack: %v", err)
	}
	bins := map[string]string{}
	for _, name := range []string{toolchain.CSIHostPath, toolchain.CSIProvisioner, toolchain.CSISnapshotter} {
		bins[name] = filepath.Join(toolchain.BinDir(dir), name)
		if _, err := os.Stat(bins[name]); err != nil {
			tb.Skipf("no CSI stack: %s is not built; run `make testenv`", bins[name])
		}
	}
	return bins
}

// nodeClients returns the clients the stack uses and kubelet's plugin
// registry, and skips the test when the cluster has no node.
func nodeClients(ctx context.Context, tb testing.TB, cfg *rest.Config, kubeconfig string) (kubernetes.Interface, snapclient.Interface, string) {
	tb.Helper()
	cs, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		tb.Fatal(err)
	}
	if _, err := cs.CoreV1().Nodes().Get(ctx, testenv.NodeName, metav1.GetOptions{}); apierrors.IsNotFound(err) {
		tb.Skipf("no CSI stack: the test cluster has no node (start it with -node)")
	} else if err != nil {
		tb.Fatalf("get node %s: %v", testenv.NodeName, err)
	}
	registry := filepath.Join(testenv.KubeletDir(kubeconfig), "plugins_registry")
	if _, err := os.Stat(registry); err != nil {
		tb.Fatalf("kubelet's plugin registry: %v", err)
	}
	snaps, err := snapclient.NewForConfig(cfg)
	if err != nil {
		tb.Fatal(err)
	}
	return cs, snaps, registry
}

// startDriver creates the CSIDriver, starts csihostpath and waits for
// kubelet to register it.
func (s *Stack) startDriver(ctx context.Context, tb testing.TB, bin, sock, registry string) {
	tb.Helper()
	name := s.Driver
	// attachRequired false: no external-attacher runs, so nothing would
	// ever answer the VolumeAttachments kube-controller-manager would
	// otherwise wait for. fsGroupPolicy File: kubelet gives the pod's
	// fsGroup the volume, as it does for real CSI filesystems.
	driver := &storagev1.CSIDriver{
		ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec: storagev1.CSIDriverSpec{
			AttachRequired:       ptr.To(false),
			PodInfoOnMount:       ptr.To(false),
			FSGroupPolicy:        ptr.To(storagev1.FileFSGroupPolicy),
			VolumeLifecycleModes: []storagev1.VolumeLifecycleMode{storagev1.VolumeLifecyclePersistent},
		},
	}
	if _, err := s.cs.StorageV1().CSIDrivers().Create(ctx, driver, metav1.CreateOptions{}); err != nil {
		tb.Fatalf("create CSIDriver %s: %v", name, err)
	}
	s.start(tb, "csihostpath", bin,
		"-endpoint="+sock, "-registration-dir="+registry, "-dir="+s.dir, "-name="+name, "-node="+testenv.NodeName)
	registered := time.Now()
	s.wait(ctx, tb, "kubelet to register the CSI driver", func() error {
		n, err := s.cs.StorageV1().CSINodes().Get(ctx, testenv.NodeName, metav1.GetOptions{})
		if err != nil {
			return err
		}
		if !slices.ContainsFunc(n.Spec.Drivers, func(d storagev1.CSINodeDriver) bool { return d.Name == name }) {
			return fmt.Errorf("CSINode %s lists no driver %s", testenv.NodeName, name)
		}
		return nil
	})
	tb.Logf("csistack: driver %s registered with kubelet in %s", name, time.Since(registered).Round(time.Millisecond))
}

// startSidecars starts csi-provisioner and csi-snapshotter.
func (s *Stack) startSidecars(tb testing.TB, bins map[string]string, sock, kubeconfig string) {
	tb.Helper()
	// The retry and client limits are sized for cloud disks that take
	// minutes; here a call takes milliseconds, and the defaults would be
	// most of what a test measures.
	common := []string{"--csi-address=" + sock, "--kubeconfig=" + kubeconfig, "--leader-election=false",
		"--retry-interval-start=200ms", "--retry-interval-max=5s", "--kube-api-qps=50", "--kube-api-burst=100", "-v=4"}
	s.start(tb, toolchain.CSIProvisioner, bins[toolchain.CSIProvisioner], append(common, "--worker-threads=4")...)
	// Without the group snapshot CRDs (not installed: nothing here uses
	// them) the sidecar would wait for them.
	s.start(tb, toolchain.CSISnapshotter, bins[toolchain.CSISnapshotter], append(common, "--worker-threads=4",
		"--feature-gates=CSIVolumeGroupSnapshot=false")...)
}

// createClasses creates the stack's StorageClass and VolumeSnapshotClass.
func (s *Stack) createClasses(ctx context.Context, tb testing.TB) {
	tb.Helper()
	sc := &storagev1.StorageClass{
		ObjectMeta:        metav1.ObjectMeta{Name: s.StorageClass},
		Provisioner:       s.Driver,
		ReclaimPolicy:     ptr.To(corev1.PersistentVolumeReclaimDelete),
		VolumeBindingMode: ptr.To(storagev1.VolumeBindingImmediate),
	}
	if _, err := s.cs.StorageV1().StorageClasses().Create(ctx, sc, metav1.CreateOptions{}); err != nil {
		tb.Fatalf("create StorageClass %s: %v", sc.Name, err)
	}
	vsc := &snapshotv1.VolumeSnapshotClass{
		ObjectMeta:     metav1.ObjectMeta{Name: s.SnapshotClass},
		Driver:         s.Driver,
		DeletionPolicy: snapshotv1.VolumeSnapshotContentDelete,
	}
	if _, err := s.snaps.SnapshotV1().VolumeSnapshotClasses().Create(ctx, vsc, metav1.CreateOptions{}); err != nil {
		tb.Fatalf("create VolumeSnapshotClass %s (are the snapshot CRDs installed? snapshotctl.Start installs them): %v", vsc.Name, err)
	}
}

// VolumePath is the folder that holds the volume whose CSI volume handle
// (a PersistentVolume's spec.csi.volumeHandle) is handle: the mount point
// of its filesystem, which exists from CreateVolume to DeleteVolume.
func (s *Stack) VolumePath(handle string) string { return filepath.Join(s.dir, "volumes", handle) }

// SnapshotPath is the tar archive of the snapshot whose CSI snapshot handle
// (a VolumeSnapshotContent's status.snapshotHandle) is handle.
func (s *Stack) SnapshotPath(handle string) string {
	return filepath.Join(s.dir, "snapshots", handle, "data.tar")
}

// Output is what the stack's processes have logged, each under its name.
func (s *Stack) Output() string {
	var b strings.Builder
	for _, p := range s.procs {
		fmt.Fprintf(&b, "--- %s ---\n%s", p.name, p.output())
	}
	return b.String()
}

func (s *Stack) wait(ctx context.Context, tb testing.TB, what string, check func() error) {
	tb.Helper()
	var last error
	err := wait.PollUntilContextTimeout(ctx, 100*time.Millisecond, startTimeout, true, func(context.Context) (bool, error) {
		for _, p := range s.procs {
			if p.exited() {
				return false, fmt.Errorf("%s exited", p.name)
			}
		}
		last = check()
		return last == nil, nil
	})
	if err != nil {
		tb.Fatalf("waiting for %s: %v (last: %v)\n%s", what, err, last, s.Output())
	}
}

// cleanup undoes Start, also a partial one. The claims and VolumeSnapshots
// of the stack's classes are deleted first, with the pods that use those
// claims, and the sidecars are given time to delete the volumes and
// snapshots behind them, so that what the test leaves is cleaned the way a
// cluster cleans it; whatever still remains after that is removed by force.
func (s *Stack) cleanup(tb testing.TB) {
	ctx, cancel := context.WithTimeout(context.Background(), cleanupTimeout+time.Minute)
	defer cancel()
	start := time.Now()
	if len(s.procs) == 3 {
		if err := s.drain(ctx); err != nil {
			tb.Logf("csistack: the volumes and snapshots of %s were not all deleted through CSI within %s: %v", s.Driver, cleanupTimeout, err)
		}
	}
	for i := len(s.procs) - 1; i >= 0; i-- {
		s.procs[i].stop()
	}
	if tb.Failed() {
		tb.Logf("csistack output:\n%s", s.Output())
	}
	var errs []error
	if err := s.unmount(); err != nil {
		errs = append(errs, err)
	}
	// The loop devices go with their filesystems' last mounts; one a
	// crashed driver left without a mount is detached here.
	if _, err := loopvol.DetachUnder(s.dir, 10*time.Second); err != nil {
		errs = append(errs, err)
	}
	if err := os.RemoveAll(s.dir); err != nil {
		errs = append(errs, err)
	}
	bg := context.Background()
	if err := s.snaps.SnapshotV1().VolumeSnapshotClasses().Delete(bg, s.SnapshotClass, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
		errs = append(errs, err)
	}
	for _, err := range []error{
		s.cs.StorageV1().StorageClasses().Delete(bg, s.StorageClass, metav1.DeleteOptions{}),
		s.cs.StorageV1().CSIDrivers().Delete(bg, s.Driver, metav1.DeleteOptions{}),
	} {
		if err != nil && !apierrors.IsNotFound(err) {
			errs = append(errs, err)
		}
	}
	if err := errors.Join(errs...); err != nil {
		tb.Errorf("csistack: clean up driver %s: %v", s.Driver, err)
	}
	tb.Logf("csistack: driver %s cleaned up in %s", s.Driver, time.Since(start).Round(time.Millisecond))
}

// drain deletes the claims and VolumeSnapshots of the stack's classes and
// the pods using those claims, then waits until no PersistentVolume or
// VolumeSnapshotContent of the driver is left: the sidecars have called
// DeleteVolume and DeleteSnapshot for each.
func (s *Stack) drain(ctx context.Context) error {
	var errs []error
	vss, err := s.snaps.SnapshotV1().VolumeSnapshots("").List(ctx, metav1.ListOptions{})
	if err != nil {
		return err
	}
	for _, vs := range vss.Items {
		if ptr.Deref(vs.Spec.VolumeSnapshotClassName, "") == s.SnapshotClass && vs.DeletionTimestamp == nil {
			if err := s.snaps.SnapshotV1().VolumeSnapshots(vs.Namespace).Delete(ctx, vs.Name, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
				errs = append(errs, err)
			}
		}
	}
	pvcs, err := s.cs.CoreV1().PersistentVolumeClaims("").List(ctx, metav1.ListOptions{})
	if err != nil {
		return err
	}
	claims := map[string]bool{}
	for _, pvc := range pvcs.Items {
		if ptr.Deref(pvc.Spec.StorageClassName, "") != s.StorageClass {
			continue
		}
		claims[pvc.Namespace+"/"+pvc.Name] = true
		if err := s.cs.CoreV1().PersistentVolumeClaims(pvc.Namespace).Delete(ctx, pvc.Name, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
			errs = append(errs, err)
		}
	}
	if len(claims) > 0 {
		pods, err := s.cs.CoreV1().Pods("").List(ctx, metav1.ListOptions{})
		if err != nil {
			return err
		}
		for _, pod := range pods.Items {
			for _, v := range pod.Spec.Volumes {
				if v.PersistentVolumeClaim != nil && claims[pod.Namespace+"/"+v.PersistentVolumeClaim.ClaimName] {
					if err := s.cs.CoreV1().Pods(pod.Namespace).Delete(ctx, pod.Name, metav1.DeleteOptions{GracePeriodSeconds: ptr.To[int64](0)}); err != nil && !apierrors.IsNotFound(err) {
						errs = append(errs, err)
					}
					break
				}
			}
		}
	}
	if err := errors.Join(errs...); err != nil {
		return err
	}
	var left []string
	err = wait.PollUntilContextTimeout(ctx, 250*time.Millisecond, cleanupTimeout, true, func(ctx context.Context) (bool, error) {
		left = left[:0]
		pvs, err := s.cs.CoreV1().PersistentVolumes().List(ctx, metav1.ListOptions{})
		if err != nil {
			return false, nil
		}
		for _, pv := range pvs.Items {
			if pv.Spec.CSI != nil && pv.Spec.CSI.Driver == s.Driver {
				left = append(left, "PersistentVolume "+pv.Name)
			}
		}
		contents, err := s.snaps.SnapshotV1().VolumeSnapshotContents().List(ctx, metav1.ListOptions{})
		if err != nil {
			return false, nil
		}
		for _, c := range contents.Items {
			if c.Spec.Driver == s.Driver {
				left = append(left, "VolumeSnapshotContent "+c.Name)
			}
		}
		return len(left) == 0, nil
	})
	if err != nil {
		return fmt.Errorf("%w; left: %s", err, strings.Join(left, ", "))
	}
	return nil
}

// unmount removes every mount of one of the driver's volumes that kubelet
// did not have unpublished. A bind mount's root has the device and inode of
// the folder it shows, which is how they are recognised wherever kubelet
// put them.
func (s *Stack) unmount() error {
	vols, _ := os.ReadDir(filepath.Join(s.dir, "volumes"))
	type key struct{ dev, ino uint64 }
	ours := map[key]bool{}
	for _, v := range vols {
		var st syscall.Stat_t
		if syscall.Stat(filepath.Join(s.dir, "volumes", v.Name()), &st) == nil {
			ours[key{st.Dev, st.Ino}] = true
		}
	}
	if len(ours) == 0 {
		return nil
	}
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return err
	}
	defer f.Close()
	var errs []error
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) < 5 {
			continue
		}
		mp := strings.NewReplacer(`\040`, " ", `\011`, "\t", `\012`, "\n", `\134`, `\`).Replace(fields[4])
		var st syscall.Stat_t
		if syscall.Stat(mp, &st) != nil || !ours[key{st.Dev, st.Ino}] {
			continue
		}
		if err := syscall.Unmount(mp, syscall.MNT_DETACH); err != nil {
			errs = append(errs, fmt.Errorf("unmount %s: %w", mp, err))
		}
	}
	return errors.Join(errs...)
}

// process is one of the stack's host processes, with its output kept for
// failure reports.
type process struct {
	name string
	cmd  *exec.Cmd
	done chan struct{}
	mu   sync.Mutex
	log  strings.Builder
}

func (s *Stack) start(tb testing.TB, name, bin string, args ...string) {
	tb.Helper()
	p := &process{name: name, done: make(chan struct{})}
	p.cmd = exec.Command(bin, args...)
	// PATH: the driver runs tar.
	p.cmd.Env = []string{"PATH=" + os.Getenv("PATH")}
	out, err := p.cmd.StdoutPipe()
	if err != nil {
		tb.Fatal(err)
	}
	p.cmd.Stderr = p.cmd.Stdout
	if err := p.cmd.Start(); err != nil {
		tb.Fatalf("start %s: %v", bin, err)
	}
	s.procs = append(s.procs, p)
	go func() {
		sc := bufio.NewScanner(out)
		sc.Buffer(make([]byte, 64*1024), 1024*1024)
		for sc.Scan() {
			p.mu.Lock()
			p.log.WriteString(sc.Text() + "\n")
			p.mu.Unlock()
		}
		_ = p.cmd.Wait()
		close(p.done)
	}()
}

func (p *process) exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

func (p *process) output() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.log.String()
}

// stop ends the process (SIGTERM, then SIGKILL after 5 s) and waits for it.
func (p *process) stop() {
	if p.exited() {
		return
	}
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.done:
	case <-time.After(5 * time.Second):
		_ = p.cmd.Process.Kill()
		<-p.done
	}
}
