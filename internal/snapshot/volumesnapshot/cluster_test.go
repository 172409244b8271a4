package volumesnapshot_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"testing"
	"time"

	snapshotv1 "github.com/kubernetes-csi/external-snapshotter/client/v6/apis/volumesnapshot/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/util/retry"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	"github.com/agentbox/terraform-provider-agentbox/internal/snapshot"
	"github.com/agentbox/terraform-provider-agentbox/internal/snapshot/volumesnapshot"
	"github.com/agentbox/terraform-provider-agentbox/internal/testenv"
	"github.com/agentbox/terraform-provider-agentbox/internal/testenv/snapshotctl"
)

// This test runs the real snapshot-controller but no CSI driver for its
// class, so that it can drive the driver through states a real CSI driver
// does not reach on cue: a snapshot that stays uncut, and a CreateSnapshot
// error. It plays the CSI driver's csi-snapshotter sidecar: it writes the
// VolumeSnapshotContent status (snapshotHandle, readyToUse, restoreSize,
// creationTime, or an error) that the sidecar would write after CSI
// CreateSnapshot, and removes the sidecar's finalizer where the sidecar
// would after DeleteSnapshot. Everything else is real: the CRDs with their
// validation, the API server, the snapshot-controller that creates the
// content from the claim's PersistentVolume and copies the content's status
// to the VolumeSnapshot, and the PersistentVolume controller that binds the
// claim. So readiness here proves the driver reads what the
// snapshot-controller reports, not that any bytes were copied.
//
// The bytes are proven elsewhere: TestVolumesnapshotIdleStopAndResume in
// internal/controller runs this driver under the sandbox controller on a
// real CSI stack (package csistack: a CSI driver on the test node with the
// real csi-snapshotter and csi-provisioner), where a sandbox's workspace
// goes into a VolumeSnapshot and comes back byte for byte on a claim
// provisioned from it.
const (
	clusterCSIDriver = "csi.agentbox.test"
	clusterSize      = "1Gi"
	// contentFinalizer is the one csi-snapshotter removes once the CSI
	// driver has deleted the stored snapshot.
	contentFinalizer = "snapshot.storage.kubernetes.io/volumesnapshotcontent-bound-protection"
	clusterWait      = time.Minute
)

type clusterEnv struct {
	ctx   context.Context
	c     client.Client
	d     *volumesnapshot.Driver
	ns    string
	grace time.Duration
	sbx   *v1alpha1.Sandbox
	tpl   *v1alpha1.SandboxTemplate
	claim string
}

func TestOnCluster(t *testing.T) {
	cfg, kubeconfig := testenv.Shared(t)
	snapshotctl.Start(t, cfg, kubeconfig)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	t.Cleanup(cancel)
	t.Log("no CSI driver runs for this test's class: the test stands in for its csi-snapshotter sidecar, writing VolumeSnapshotContent status and removing its finalizer; the CRDs, API server, snapshot-controller and PV binder are real (the real CSI data path is TestVolumesnapshotIdleStopAndResume in internal/controller)")

	// The VolumeSnapshot's owner must exist: the garbage collector deletes
	// dependents of a missing owner.
	_, file, _, _ := runtime.Caller(0)
	if err := testenv.ApplyCRDs(ctx, cfg, filepath.Join(filepath.Dir(file), "..", "..", "..", "charts", "agentbox", "crds", "*.yaml")); err != nil {
		t.Fatalf("install agentbox CRDs: %v", err)
	}
	c, err := client.New(cfg, client.Options{Scheme: testScheme(t)})
	if err != nil {
		t.Fatal(err)
	}
	b := make([]byte, 4)
	_, _ = rand.Read(b)
	e := &clusterEnv{ctx: ctx, c: c, ns: "vs-" + hex.EncodeToString(b), grace: 3 * time.Second}
	e.create(t, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: e.ns}})
	t.Cleanup(func() {
		_ = c.Delete(context.Background(), &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: e.ns}})
	})

	class := &snapshotv1.VolumeSnapshotClass{
		ObjectMeta:     metav1.ObjectMeta{Name: e.ns},
		Driver:         clusterCSIDriver,
		DeletionPolicy: snapshotv1.VolumeSnapshotContentDelete,
	}
	e.create(t, class)
	t.Cleanup(func() { _ = c.Delete(context.Background(), class) })

	e.sbx = &v1alpha1.Sandbox{
		ObjectMeta: metav1.ObjectMeta{Name: "agent-1", Namespace: e.ns},
		Spec:       v1alpha1.SandboxSpec{AgentID: "agent:agent-1@example.com", TemplateRef: v1alpha1.LocalObjectReference{Name: "python"}},
	}
	e.create(t, e.sbx)
	e.tpl = &v1alpha1.SandboxTemplate{ObjectMeta: metav1.ObjectMeta{Name: "python", Namespace: e.ns}}
	e.tpl.Spec.Workspace.VolumeSnapshotClassName = ptr.To(class.Name)
	e.d = volumesnapshot.New(c, volumesnapshot.Options{ErrorGrace: e.grace, CutTimeout: 10 * clusterWait})

	t.Run("ready, restore and delete", e.testReady)
	t.Run("content error fails after the grace", e.testFailed)
}

func (e *clusterEnv) testReady(t *testing.T) {
	e.boundClaim(t, "agent-1-workspace")
	req := e.request("agent-1-1")
	start := time.Now()
	if st := e.take(t, req); st.Ready || st.Failed != "" {
		t.Fatalf("first Take = %+v, want pending", st)
	}
	content := e.waitContent(t, req.Name)
	contentAfter := time.Since(start)
	if content.Spec.Driver != clusterCSIDriver || ptr.Deref(content.Spec.Source.VolumeHandle, "") != e.volumeHandle() {
		t.Fatalf("content spec = %+v, want driver %s and the claim's volume", content.Spec, clusterCSIDriver)
	}
	// Without the CSI side nothing becomes ready by itself.
	if st := e.take(t, req); st.Ready || st.Failed != "" {
		t.Fatalf("Take before the content is cut = %+v, want pending", st)
	}

	size := resource.MustParse(clusterSize)
	cut := time.Now().Truncate(time.Second)
	t.Logf("standing in for csi-snapshotter: marking VolumeSnapshotContent %s ready", content.Name)
	statusSet := time.Now()
	e.setContentStatus(t, content.Name, &snapshotv1.VolumeSnapshotContentStatus{
		SnapshotHandle: ptr.To("snap-" + req.Name),
		ReadyToUse:     ptr.To(true),
		RestoreSize:    ptr.To(size.Value()),
		CreationTime:   ptr.To(cut.UnixNano()),
	})
	var st snapshot.State
	e.eventually(t, "Take reports Ready", func() error {
		st = e.take(t, req)
		if !st.Ready {
			return fmt.Errorf("state %+v", st)
		}
		return nil
	})
	t.Logf("timings: content created %s after the first Take; Ready %s after the content status was set; %s in all",
		contentAfter.Round(time.Millisecond), time.Since(statusSet).Round(time.Millisecond), time.Since(start).Round(time.Millisecond))
	if st.Failed != "" || st.SizeBytes != size.Value() || !st.ReadyTime.Equal(cut) {
		t.Errorf("Take = %+v, want Ready with %d bytes at %s", st, size.Value(), cut)
	}

	// The restored claim cannot be provisioned here (no CSI driver serves
	// this class); what is tested is that the API server accepts the data
	// source and keeps both fields, which it drops when it does not allow
	// the kind.
	restored := &corev1.PersistentVolumeClaim{
		ObjectMeta: metav1.ObjectMeta{Name: "agent-1-workspace-restored", Namespace: e.ns},
		Spec: corev1.PersistentVolumeClaimSpec{
			AccessModes:      []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
			Resources:        corev1.VolumeResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceStorage: size}},
			StorageClassName: ptr.To(""),
		},
	}
	e.d.PrepareClaim(&v1alpha1.SandboxSnapshot{Name: req.Name, SizeBytes: st.SizeBytes}, restored)
	e.create(t, restored)
	got := &corev1.PersistentVolumeClaim{}
	if err := e.c.Get(e.ctx, client.ObjectKeyFromObject(restored), got); err != nil {
		t.Fatal(err)
	}
	ds, ref := got.Spec.DataSource, got.Spec.DataSourceRef
	if ds == nil || ptr.Deref(ds.APIGroup, "") != volumesnapshot.APIGroup || ds.Kind != "VolumeSnapshot" || ds.Name != req.Name {
		t.Errorf("stored dataSource = %+v", ds)
	}
	if ref == nil || ptr.Deref(ref.APIGroup, "") != volumesnapshot.APIGroup || ref.Kind != "VolumeSnapshot" || ref.Name != req.Name {
		t.Errorf("stored dataSourceRef = %+v", ref)
	}
	// A pending claim restoring from the snapshot keeps the
	// snapshot-controller from letting the snapshot go, and it does not
	// look again when the claim goes: the claim must be gone first, as it
	// is when the controller deletes a superseded snapshot.
	if err := e.c.Delete(e.ctx, restored); err != nil {
		t.Fatal(err)
	}
	e.eventually(t, "the restored claim to be gone", func() error {
		err := e.c.Get(e.ctx, client.ObjectKeyFromObject(restored), &corev1.PersistentVolumeClaim{})
		if apierrors.IsNotFound(err) {
			return nil
		}
		return fmt.Errorf("still there (get: %v)", err)
	})

	e.deleteSnapshot(t, req.Name, content.Name)
}

func (e *clusterEnv) testFailed(t *testing.T) {
	e.boundClaim(t, "agent-1-failed-workspace")
	req := e.request("agent-1-2")
	start := time.Now()
	if st := e.take(t, req); st.Ready || st.Failed != "" {
		t.Fatalf("first Take = %+v, want pending", st)
	}
	content := e.waitContent(t, req.Name)
	const msg = "rpc error: code = ResourceExhausted desc = snapshot quota exceeded (written by the test)"
	t.Logf("standing in for csi-snapshotter: reporting a CreateSnapshot error on VolumeSnapshotContent %s", content.Name)
	e.setContentStatus(t, content.Name, &snapshotv1.VolumeSnapshotContentStatus{
		ReadyToUse: ptr.To(false),
		Error:      &snapshotv1.VolumeSnapshotError{Message: ptr.To(msg), Time: ptr.To(metav1.Now())},
	})
	var errorSeen time.Duration
	var st snapshot.State
	e.eventually(t, "Take reports Failed", func() error {
		st = e.take(t, req)
		vs := e.volumeSnapshot(t, req.Name)
		age := time.Since(vs.CreationTimestamp.Time)
		if vs.Status != nil && vs.Status.Error != nil && errorSeen == 0 {
			errorSeen = time.Since(start)
		}
		if st.Failed == "" {
			return fmt.Errorf("state %+v, error on the VolumeSnapshot %v", st, vs.Status != nil && vs.Status.Error != nil)
		}
		if errorSeen == 0 {
			t.Fatalf("Take = %+v before the snapshot-controller copied the content's error", st)
		}
		// The driver counts from creationTimestamp, which has whole seconds.
		if age < e.grace {
			t.Fatalf("Take failed %s after creation, before the grace of %s: %+v", age, e.grace, st)
		}
		return nil
	})
	t.Logf("timings: error on the VolumeSnapshot %s after the first Take; Failed %s after the first Take (grace %s, counted from the whole-second creationTimestamp)",
		errorSeen.Round(time.Millisecond), time.Since(start).Round(time.Millisecond), e.grace)
	if st.Ready || !strings.Contains(st.Failed, msg) {
		t.Errorf("Take = %+v, want Failed quoting %q", st, msg)
	}
	e.deleteSnapshot(t, req.Name, content.Name)
}

// boundClaim makes the workspace claim called name, which the next
// requests snapshot. It is bound to a PersistentVolume of the CSI driver,
// which is where the content's volumeHandle comes from; the volume is
// pre-bound so that the real PV controller binds it without a provisioner.
//
// Each subtest snapshots a claim of its own. The snapshot-controller
// (v8.3.0) adds and removes a finalizer on the source claim through its
// informer cache, and a new snapshot of a claim it has just written can
// conflict on its stale copy. Once, in CI, the retry after that conflict
// found the content already made ("already exists, reusing"), cached it
// without a resourceVersion, and from then on ignored every update of the
// content: the error written to it never reached the VolumeSnapshot.
func (e *clusterEnv) boundClaim(t *testing.T, name string) {
	e.claim = name
	size := resource.MustParse(clusterSize)
	pv := &corev1.PersistentVolume{
		ObjectMeta: metav1.ObjectMeta{Name: e.ns + "-" + name},
		Spec: corev1.PersistentVolumeSpec{
			Capacity:                      corev1.ResourceList{corev1.ResourceStorage: size},
			AccessModes:                   []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
			PersistentVolumeReclaimPolicy: corev1.PersistentVolumeReclaimRetain,
			StorageClassName:              "",
			ClaimRef:                      &corev1.ObjectReference{Namespace: e.ns, Name: e.claim},
			PersistentVolumeSource: corev1.PersistentVolumeSource{
				CSI: &corev1.CSIPersistentVolumeSource{Driver: clusterCSIDriver, VolumeHandle: e.volumeHandle()},
			},
		},
	}
	e.create(t, pv)
	t.Cleanup(func() { _ = e.c.Delete(context.Background(), pv) })
	pvc := &corev1.PersistentVolumeClaim{
		ObjectMeta: metav1.ObjectMeta{Name: e.claim, Namespace: e.ns},
		Spec: corev1.PersistentVolumeClaimSpec{
			AccessModes:      []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
			Resources:        corev1.VolumeResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceStorage: size}},
			StorageClassName: ptr.To(""),
			VolumeName:       pv.Name,
		},
	}
	e.create(t, pvc)
	e.eventually(t, "claim Bound", func() error {
		if err := e.c.Get(e.ctx, client.ObjectKeyFromObject(pvc), pvc); err != nil {
			return err
		}
		if pvc.Status.Phase != corev1.ClaimBound {
			return fmt.Errorf("claim is %s", pvc.Status.Phase)
		}
		return nil
	})
}

func (e *clusterEnv) volumeHandle() string { return "vol-" + e.ns + "-" + e.claim }

func (e *clusterEnv) request(name string) snapshot.Request {
	return snapshot.Request{Sandbox: e.sbx, Template: e.tpl, ClaimName: e.claim, Name: name}
}

func (e *clusterEnv) take(t *testing.T, req snapshot.Request) snapshot.State {
	t.Helper()
	st, err := e.d.Take(e.ctx, req)
	if err != nil {
		t.Fatalf("Take(%s): %v", req.Name, err)
	}
	return st
}

func (e *clusterEnv) volumeSnapshot(t *testing.T, name string) *snapshotv1.VolumeSnapshot {
	t.Helper()
	vs := &snapshotv1.VolumeSnapshot{}
	if err := e.c.Get(e.ctx, types.NamespacedName{Namespace: e.ns, Name: name}, vs); err != nil {
		t.Fatal(err)
	}
	return vs
}

// waitContent returns the content the snapshot-controller made for
// VolumeSnapshot name and bound it to.
func (e *clusterEnv) waitContent(t *testing.T, name string) *snapshotv1.VolumeSnapshotContent {
	t.Helper()
	content := &snapshotv1.VolumeSnapshotContent{}
	e.eventually(t, "snapshot-controller binds a VolumeSnapshotContent", func() error {
		vs := e.volumeSnapshot(t, name)
		if vs.Status == nil || vs.Status.BoundVolumeSnapshotContentName == nil {
			return fmt.Errorf("VolumeSnapshot status %+v", vs.Status)
		}
		return e.c.Get(e.ctx, types.NamespacedName{Name: *vs.Status.BoundVolumeSnapshotContentName}, content)
	})
	return content
}

// setContentStatus writes what csi-snapshotter would after CreateSnapshot.
func (e *clusterEnv) setContentStatus(t *testing.T, name string, status *snapshotv1.VolumeSnapshotContentStatus) {
	t.Helper()
	err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		content := &snapshotv1.VolumeSnapshotContent{}
		if err := e.c.Get(e.ctx, types.NamespacedName{Name: name}, content); err != nil {
			return err
		}
		content.Status = status
		return e.c.Status().Update(e.ctx, content)
	})
	if err != nil {
		t.Fatalf("set status of VolumeSnapshotContent %s: %v", name, err)
	}
}

// deleteSnapshot deletes through the driver and waits until the
// VolumeSnapshot and its content are gone. With a Delete class the
// snapshot-controller deletes the content, whose finalizer only
// csi-snapshotter removes: the test does that in its place.
func (e *clusterEnv) deleteSnapshot(t *testing.T, name, contentName string) {
	t.Helper()
	start := time.Now()
	if err := e.d.Delete(e.ctx, e.sbx, name); err != nil {
		t.Fatalf("Delete(%s): %v", name, err)
	}
	e.eventually(t, "VolumeSnapshot and content gone", func() error {
		content := &snapshotv1.VolumeSnapshotContent{}
		err := e.c.Get(e.ctx, types.NamespacedName{Name: contentName}, content)
		switch {
		case err == nil && content.DeletionTimestamp != nil && slices.Contains(content.Finalizers, contentFinalizer):
			content.Finalizers = slices.DeleteFunc(content.Finalizers, func(f string) bool { return f == contentFinalizer })
			if err := e.c.Update(e.ctx, content); err != nil {
				return err
			}
			return fmt.Errorf("content %s: removed %s in csi-snapshotter's place", contentName, contentFinalizer)
		case err == nil:
			return fmt.Errorf("content %s still exists (deleting: %v)", contentName, content.DeletionTimestamp != nil)
		case !apierrors.IsNotFound(err):
			return err
		}
		vs := &snapshotv1.VolumeSnapshot{}
		err = e.c.Get(e.ctx, types.NamespacedName{Namespace: e.ns, Name: name}, vs)
		if err == nil {
			return fmt.Errorf("VolumeSnapshot %s still exists, finalizers %v", name, vs.Finalizers)
		}
		if !apierrors.IsNotFound(err) {
			return err
		}
		return nil
	})
	t.Logf("timings: VolumeSnapshot %s and its content gone %s after Delete", name, time.Since(start).Round(time.Millisecond))
	// A second Delete, as after a crash, finds nothing and is fine.
	if err := e.d.Delete(e.ctx, e.sbx, name); err != nil {
		t.Errorf("second Delete(%s): %v", name, err)
	}
}

func (e *clusterEnv) create(t *testing.T, obj client.Object) {
	t.Helper()
	if err := e.c.Create(e.ctx, obj); err != nil {
		t.Fatalf("create %T %s: %v", obj, obj.GetName(), err)
	}
}

// eventually polls check until it returns nil and fails the test with the
// last error otherwise.
func (e *clusterEnv) eventually(t *testing.T, what string, check func() error) {
	t.Helper()
	var last error
	err := wait.PollUntilContextTimeout(e.ctx, 200*time.Millisecond, clusterWait, true, func(context.Context) (bool, error) {
		last = check()
		return last == nil, nil
	})
	if err != nil {
		t.Fatalf("%s: %v (last: %v)", what, err, last)
	}
}
