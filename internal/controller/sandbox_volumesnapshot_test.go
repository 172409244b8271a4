package controller

import (
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	snapshotv1 "github.com/kubernetes-csi/external-snapshotter/client/v6/apis/volumesnapshot/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	k8sruntime "k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	"github.com/agentbox/terraform-provider-agentbox/internal/computeapi"
	apiclient "github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
	"github.com/agentbox/terraform-provider-agentbox/internal/snapshot/volumesnapshot"
	"github.com/agentbox/terraform-provider-agentbox/internal/testenv"
	"github.com/agentbox/terraform-provider-agentbox/internal/testenv/csistack"
	"github.com/agentbox/terraform-provider-agentbox/internal/testenv/snapshotctl"
)

// TestVolumesnapshotIdleStopAndResume is TestIdleStopAndResume with the
// volumesnapshot driver, on a real CSI stack: the real snapshot-controller,
// csi-snapshotter and csi-provisioner, and the test node's CSI driver, whose
// volumes are folders and whose snapshots are tar archives of them. A gVisor
// sandbox's workspace goes into a VolumeSnapshot at idle stop, its pod and
// claim are deleted (and with the claim, through CSI, its volume), and the
// next Compute API call resumes it on a claim provisioned from the snapshot,
// every file intact.
func TestVolumesnapshotIdleStopAndResume(t *testing.T) {
	t.Parallel()
	image := os.Getenv(EnvSandboxImage)
	if image == "" {
		t.Skipf("%s is not set: idle stop needs the real sandbox image's supervisor", EnvSandboxImage)
	}
	cfg, kubeconfig := testenv.Shared(t)
	// Before newClusterEnv: the stack's cleanup then runs after the
	// namespace is deleted, and waits for CSI to delete what was in it.
	snapshotctl.Start(t, cfg, kubeconfig)
	stack := csistack.Start(t, cfg, kubeconfig)

	scheme := k8sruntime.NewScheme()
	must(t, clientgoscheme.AddToScheme(scheme))
	must(t, volumesnapshot.AddToScheme(scheme))
	c, err := client.New(cfg, client.Options{Scheme: scheme})
	must(t, err)
	drv := volumesnapshot.New(c, volumesnapshot.Options{})
	var pool *computeapi.SupervisorPool
	e := newClusterEnv(t, withSnapshots(t, drv, &pool))
	api := e.computeAPI(pool)
	e.template("tpl", func(tpl *v1alpha1.SandboxTemplate) {
		tpl.Spec.Image = image
		// Longer than the test: only setActivity makes the sandbox idle.
		tpl.Spec.IdleTimeout = metav1.Duration{Duration: time.Hour}
		tpl.Spec.Workspace.StorageClassName = ptr.To(stack.StorageClass)
		tpl.Spec.Workspace.VolumeSnapshotClassName = ptr.To(stack.SnapshotClass)
	})
	// Not "idler": the Compute API finds sandboxes by agent across
	// namespaces, and TestIdleStopAndResume runs beside this test.
	const name = "vs-idler"
	e.sandbox(name, "tpl")

	sbx, firstStart := e.waitPhase(name, v1alpha1.SandboxPhaseRunning, v1alpha1.ReasonRunning)
	sup := e.supervisor(t, sbx)
	// A CSI volume gets the pod's fsGroup from kubelet, unlike the default
	// class's hostPath-like volumes, so here it must be writable.
	if !e.workspaceWritable(t, sup) {
		t.Fatal("the CSI workspace is not writable by the sandbox user: kubelet did not apply the pod's fsGroup")
	}
	firstVolume := e.csiVolumeHandle(t, WorkspaceClaimName(name))
	const write = `mkdir -p notes && echo "first words" > notes/a.txt && head -c 4194304 /dev/urandom > blob && ln -s notes/a.txt link && chmod 0600 notes/a.txt`
	run(t, e.ctx, sup, write)
	const digest = `sha256sum blob notes/a.txt && stat -c '%a %u:%g %F %N' notes notes/a.txt link blob`
	before := run(t, e.ctx, sup, digest)

	// Idle stop: flush, VolumeSnapshot cut by csi-snapshotter, then pod and
	// claim go, and with the claim its volume.
	e.setActivity(name, time.Now().Add(-2*time.Hour))
	sbx, stopTook := e.waitPhase(name, v1alpha1.SandboxPhaseStopped, v1alpha1.ReasonStopped)
	e.gone(&corev1.Pod{}, PodName(name))
	e.gone(&corev1.PersistentVolumeClaim{}, WorkspaceClaimName(name))
	snap := sbx.Status.Snapshot
	if snap == nil || snap.Name == "" || sbx.Status.PendingSnapshot != "" {
		t.Fatalf("after the stop: snapshot %+v, pending %q", snap, sbx.Status.PendingSnapshot)
	}
	var vs snapshotv1.VolumeSnapshot
	must(t, c.Get(e.ctx, types.NamespacedName{Namespace: e.ns, Name: snap.Name}, &vs))
	if !ptr.Deref(vs.Status.ReadyToUse, false) || vs.Status.BoundVolumeSnapshotContentName == nil {
		t.Fatalf("VolumeSnapshot %s status %+v, want ready and bound", snap.Name, vs.Status)
	}
	var content snapshotv1.VolumeSnapshotContent
	must(t, c.Get(e.ctx, types.NamespacedName{Name: *vs.Status.BoundVolumeSnapshotContentName}, &content))
	handle := ptr.Deref(content.Status.SnapshotHandle, "")
	archive, err := os.Stat(stack.SnapshotPath(handle))
	if content.Spec.Driver != stack.Driver || err != nil {
		t.Fatalf("content %s: driver %s, snapshot %q on the node: %v; want the stack's driver %s and its archive", content.Name, content.Spec.Driver, handle, err, stack.Driver)
	}
	// The claim's volume is deleted through CSI DeleteVolume: after the
	// stop, the snapshot is the only copy of the workspace.
	e.eventually("the first volume to be deleted with its claim", func() error {
		if _, err := os.Stat(stack.VolumePath(firstVolume)); !os.IsNotExist(err) {
			return fmt.Errorf("%s still exists (stat: %v)", stack.VolumePath(firstVolume), err)
		}
		return nil
	})

	// The next call wakes it: a new claim provisioned from the snapshot
	// before the pod starts, and the call served then.
	callStart := time.Now()
	res, err := api.RunCommand(e.ctx, sbx.Spec.AgentID, apiclient.RunCommandRequest{Command: []string{"sh", "-c", digest}})
	resumeTook := time.Since(callStart)
	if err != nil {
		t.Fatalf("run_command on the stopped sandbox: %v", err)
	}
	if after := strings.TrimSpace(res.Stdout); res.ExitCode != 0 || after != before {
		t.Errorf("workspace after resume (exit %d, %s):\n%s\nwant:\n%s", res.ExitCode, res.Stderr, after, before)
	}
	sbx, _ = e.waitPhase(name, v1alpha1.SandboxPhaseRunning, v1alpha1.ReasonRunning)
	var claim corev1.PersistentVolumeClaim
	must(t, e.get(WorkspaceClaimName(name), &claim))
	if ds := claim.Spec.DataSource; ds == nil || ds.Kind != "VolumeSnapshot" || ds.Name != snap.Name {
		t.Errorf("resumed claim's dataSource = %+v, want VolumeSnapshot %s", ds, snap.Name)
	}
	if v, ok := claim.Annotations[AnnotationRestoreFrom]; ok {
		t.Errorf("claim still marked for restore from %q after the sandbox is Ready", v)
	}
	if second := e.csiVolumeHandle(t, claim.Name); second == firstVolume {
		t.Errorf("the resumed claim is on the first volume %s, which should have been deleted", firstVolume)
	}
	t.Logf("volumesnapshot driver, real CSI stack: first start %s; idle stop %s (VolumeSnapshot %s, tar archive %d bytes on the node); run_command on the stopped sandbox %s",
		firstStart.Round(time.Millisecond), stopTook.Round(time.Millisecond), snap.Name, archive.Size(), resumeTook.Round(time.Millisecond))

	// Deleting the sandbox takes its VolumeSnapshot, and through CSI
	// DeleteSnapshot the archive, with it.
	must(t, e.c.Delete(e.ctx, sbx))
	e.eventually("the snapshot to be deleted with the sandbox", func() error {
		err := c.Get(e.ctx, types.NamespacedName{Namespace: e.ns, Name: snap.Name}, &snapshotv1.VolumeSnapshot{})
		if !apierrors.IsNotFound(err) {
			return fmt.Errorf("VolumeSnapshot %s still there (get: %v)", snap.Name, err)
		}
		if _, err := os.Stat(stack.SnapshotPath(handle)); !os.IsNotExist(err) {
			return fmt.Errorf("archive %s still on the node (stat: %v)", stack.SnapshotPath(handle), err)
		}
		return nil
	})
}

// csiVolumeHandle returns the CSI volume handle of the bound claim name.
func (e *clusterEnv) csiVolumeHandle(t *testing.T, name string) string {
	t.Helper()
	var claim corev1.PersistentVolumeClaim
	must(t, e.get(name, &claim))
	var pv corev1.PersistentVolume
	must(t, e.c.Get(e.ctx, client.ObjectKey{Name: claim.Spec.VolumeName}, &pv))
	if pv.Spec.CSI == nil {
		t.Fatalf("claim %s is bound to %s, which is not a CSI volume", name, pv.Name)
	}
	return pv.Spec.CSI.VolumeHandle
}
