package controller

import (
	"context"
	"strings"
	"testing"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client/fake"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	"github.com/agentbox/terraform-provider-agentbox/internal/snapshot"
)

// Node loss as the API server shows it, played against the fake client:
// the sandbox's pod is bound to a node, its workspace to a volume, and the
// Node object goes away. The real cluster's versions, with kwok nodes and a
// call through the Compute API, are TestNodeLossResumesOnAnotherNode and
// TestNodeLossKeepsNetworkWorkspace.

// nodeLossEnv is a running sandbox "s" whose pod is on node-a and whose
// workspace claim is bound to volume pv-s, pinned to node-a when local.
func nodeLossEnv(t *testing.T, local bool, snap string) (*fakeEnv, *recordingDriver) {
	t.Helper()
	ctx := context.Background()
	f, d := newLifecycleEnv(t, idleSandbox("s", time.Hour))
	must(t, f.c.Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "node-a", Labels: map[string]string{corev1.LabelHostname: "node-a"}}}))
	must(t, f.c.Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "node-b", Labels: map[string]string{corev1.LabelHostname: "node-b"}}}))
	pv := &corev1.PersistentVolume{ObjectMeta: metav1.ObjectMeta{Name: "pv-s"}}
	if local {
		pv.Spec.NodeAffinity = &corev1.VolumeNodeAffinity{Required: &corev1.NodeSelector{
			NodeSelectorTerms: []corev1.NodeSelectorTerm{{MatchExpressions: []corev1.NodeSelectorRequirement{{
				Key: corev1.LabelHostname, Operator: corev1.NodeSelectorOpIn, Values: []string{"node-a"},
			}}}},
		}}
	}
	must(t, f.c.Create(ctx, pv))
	f.reconcile("s")
	var claim corev1.PersistentVolumeClaim
	if !f.exists(&claim, WorkspaceClaimName("s")) {
		t.Fatal("no workspace claim")
	}
	claim.Spec.VolumeName = "pv-s"
	must(t, f.c.Update(ctx, &claim))
	f.schedule("s", "node-a")
	f.podReady("s")
	if snap != "" {
		sbx := f.sandbox("s")
		sbx.Status.Snapshot = &v1alpha1.SandboxSnapshot{Name: snap, ReadyTime: &metav1.Time{Time: time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC)}}
		must(t, f.c.Status().Update(ctx, sbx))
	}
	f.reconcile("s")
	if sbx := f.wantPhase("s", v1alpha1.SandboxPhaseRunning, v1alpha1.ReasonRunning); sbx.Status.NodeName != "node-a" {
		t.Fatalf("status.nodeName %q, want node-a", sbx.Status.NodeName)
	}
	f.drainEvents()
	return f, d
}

// schedule binds the sandbox's pod to node, as the scheduler does.
func (f *fakeEnv) schedule(name, node string) {
	f.t.Helper()
	var pod corev1.Pod
	must(f.t, f.c.Get(context.Background(), types.NamespacedName{Namespace: unitNS, Name: name}, &pod))
	pod.Spec.NodeName = node
	must(f.t, f.c.Update(context.Background(), &pod))
}

func (f *fakeEnv) deleteNode(name string) {
	f.t.Helper()
	must(f.t, f.c.Delete(context.Background(), &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: name}}))
}

func (f *fakeEnv) renewTime(name string) *metav1.MicroTime {
	f.t.Helper()
	var lease coordinationv1.Lease
	must(f.t, f.c.Get(context.Background(), types.NamespacedName{Namespace: unitNS, Name: ActivityClockName(name)}, &lease))
	return lease.Spec.RenewTime
}

// wantLost checks the state a sandbox waits in after the loss of node-a.
func (f *fakeEnv) wantLost(name string, workspaceLost bool) *v1alpha1.Sandbox {
	f.t.Helper()
	sbx := f.wantPhase(name, v1alpha1.SandboxPhaseError, v1alpha1.ReasonNodeLost)
	loss := sbx.Status.NodeLoss
	if loss == nil || loss.NodeName != "node-a" || loss.WorkspaceLost != workspaceLost || loss.ActivityTime == nil ||
		!loss.ActivityTime.Equal(f.renewTime(name)) {
		f.t.Fatalf("status.nodeLoss %+v, want node-a, workspaceLost %v, the Lease's renewTime %s", loss, workspaceLost, f.renewTime(name))
	}
	if sbx.Status.PodName != "" || sbx.Status.ServiceEndpoint != "" || sbx.Status.NodeName != "" {
		f.t.Errorf("a lost sandbox still names pod %q, endpoint %q, node %q", sbx.Status.PodName, sbx.Status.ServiceEndpoint, sbx.Status.NodeName)
	}
	if f.exists(&corev1.Pod{}, name) {
		f.t.Error("the pod of the lost node is still there")
	}
	return sbx
}

// TestUnitNodeLossLocalStorage: the workspace was on the lost node's local
// storage. The pod and claim go, the sandbox waits in Error/NodeLost, and
// the next activity resumes it from its last snapshot.
func TestUnitNodeLossLocalStorage(t *testing.T) {
	f, d := nodeLossEnv(t, true, "s-snap-1")
	f.deleteNode("node-a")
	f.reconcile("s")
	sbx := f.wantLost("s", true)
	if f.exists(&corev1.PersistentVolumeClaim{}, WorkspaceClaimName("s")) {
		t.Fatal("the claim stranded on the lost node was kept")
	}
	msg := f.ready("s").Message
	for _, want := range []string{"node node-a", "no longer exists", "last snapshot s-snap-1", "2030-01-02T03:04:05Z", "changes made after that snapshot are lost", "next call"} {
		if !strings.Contains(msg, want) {
			t.Errorf("message %q lacks %q", msg, want)
		}
	}
	if evs := strings.Join(f.drainEvents(), "\n"); !strings.Contains(evs, "Warning "+EventNodeLost) || !strings.Contains(evs, "s-snap-1") {
		t.Errorf("events %q lack a NodeLost warning naming the snapshot", evs)
	}

	// Without activity it waits, holding no node, however long.
	f.clock.Step(3 * time.Hour)
	f.reconcile("s")
	f.reconcile("s")
	if got := f.wantLost("s", true); f.ready("s").Message != msg || !got.Status.NodeLoss.Time.Equal(&sbx.Status.NodeLoss.Time) {
		t.Errorf("waiting changed the status: %+v", got.Status)
	}
	if f.exists(&corev1.PersistentVolumeClaim{}, WorkspaceClaimName("s")) || len(d.prepared) != 0 {
		t.Fatal("a sandbox waiting after a node loss got a new workspace")
	}

	// The next call: a claim restoring the last snapshot, then a pod on a
	// node that exists.
	f.renew("s")
	f.reconcile("s")
	var claim corev1.PersistentVolumeClaim
	if !f.exists(&claim, WorkspaceClaimName("s")) || claim.Annotations[AnnotationRestoreFrom] != "s-snap-1" || claim.Spec.VolumeName != "" {
		t.Fatalf("new claim: annotations %v, volume %q", claim.Annotations, claim.Spec.VolumeName)
	}
	if len(d.prepared) != 1 || d.prepared[0] != "s-snap-1" {
		t.Errorf("driver prepared %v, want the last snapshot", d.prepared)
	}
	if got := f.wantPhase("s", v1alpha1.SandboxPhaseResuming, v1alpha1.ReasonResuming); got.Status.NodeLoss != nil {
		t.Errorf("status.nodeLoss %+v kept after the resume began", got.Status.NodeLoss)
	}
	if evs := strings.Join(f.drainEvents(), "\n"); !strings.Contains(evs, "after the loss of node node-a") {
		t.Errorf("events %q do not say why the sandbox resumed", evs)
	}
	f.schedule("s", "node-b")
	f.podReady("s")
	f.reconcile("s")
	if got := f.wantPhase("s", v1alpha1.SandboxPhaseRunning, v1alpha1.ReasonRunning); got.Status.NodeName != "node-b" {
		t.Errorf("status.nodeName %q, want node-b", got.Status.NodeName)
	}
	if len(d.restored) != 1 || d.restored[0] != "s-snap-1" {
		t.Errorf("restored %v, want the last snapshot", d.restored)
	}
}

// TestUnitNodeLossNoSnapshot: node-local storage and no snapshot: the
// files are lost, and the condition says so.
func TestUnitNodeLossNoSnapshot(t *testing.T) {
	f, d := nodeLossEnv(t, true, "")
	f.deleteNode("node-a")
	f.reconcile("s")
	f.wantLost("s", true)
	if msg := f.ready("s").Message; !strings.Contains(msg, "no snapshot, so its files are lost") || !strings.Contains(msg, "empty workspace") {
		t.Errorf("message %q does not say the files are lost", msg)
	}
	f.clock.Step(time.Minute)
	f.renew("s")
	f.reconcile("s")
	var claim corev1.PersistentVolumeClaim
	if !f.exists(&claim, WorkspaceClaimName("s")) || claim.Annotations[AnnotationRestoreFrom] != "" || len(d.prepared) != 0 {
		t.Fatalf("new claim: annotations %v, prepared %v; want an empty workspace", claim.Annotations, d.prepared)
	}
	f.wantPhase("s", v1alpha1.SandboxPhasePending, v1alpha1.ReasonCreating)
}

// TestUnitNodeLossNetworkStorage: a volume with no node affinity is
// mounted on the next node as it is; the claim is kept and nothing is
// restored.
func TestUnitNodeLossNetworkStorage(t *testing.T) {
	f, d := nodeLossEnv(t, false, "s-snap-1")
	var claim corev1.PersistentVolumeClaim
	f.exists(&claim, WorkspaceClaimName("s"))
	f.deleteNode("node-a")
	f.reconcile("s")
	f.wantLost("s", false)
	if msg := f.ready("s").Message; !strings.Contains(msg, "is kept") || !strings.Contains(msg, "with its files") {
		t.Errorf("message %q does not say the workspace is kept", msg)
	}
	var kept corev1.PersistentVolumeClaim
	if !f.exists(&kept, WorkspaceClaimName("s")) || kept.UID != claim.UID {
		t.Fatal("the claim on network storage was not kept")
	}
	f.reconcile("s")
	if f.exists(&corev1.Pod{}, "s") {
		t.Fatal("a pod was started without activity")
	}

	f.clock.Step(time.Minute)
	f.renew("s")
	f.reconcile("s")
	if !f.exists(&corev1.Pod{}, "s") || !f.exists(&kept, WorkspaceClaimName("s")) || kept.UID != claim.UID {
		t.Fatal("the next activity did not start a pod on the kept claim")
	}
	f.wantPhase("s", v1alpha1.SandboxPhasePending, v1alpha1.ReasonCreating)
	f.schedule("s", "node-b")
	f.podReady("s")
	f.reconcile("s")
	f.wantPhase("s", v1alpha1.SandboxPhaseRunning, v1alpha1.ReasonRunning)
	if len(d.prepared)+len(d.restored) != 0 {
		t.Errorf("prepared %v, restored %v: the kept claim needs neither", d.prepared, d.restored)
	}
}

// TestUnitNodeLossAfterPodGC: the pod garbage collector removed the pod of
// the deleted node before the controller looked; status.nodeName tells it
// where the sandbox ran.
func TestUnitNodeLossAfterPodGC(t *testing.T) {
	f, _ := nodeLossEnv(t, true, "s-snap-1")
	must(t, f.c.Delete(context.Background(), &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: unitNS, Name: PodName("s")}}))
	f.deleteNode("node-a")
	f.reconcile("s")
	f.wantLost("s", true)
	if f.exists(&corev1.PersistentVolumeClaim{}, WorkspaceClaimName("s")) {
		t.Fatal("the claim stranded on the lost node was kept")
	}
}

// TestUnitNodeLossStrandedVolumeOnly: the controller learns of the loss
// through the workspace volume alone: the pod is gone, nothing recorded
// its node (it was never scheduled), and the volume is pinned to a node
// that no longer exists.
func TestUnitNodeLossStrandedVolumeOnly(t *testing.T) {
	f, _ := nodeLossEnv(t, true, "s-snap-1")
	ctx := context.Background()
	must(t, f.c.Delete(ctx, &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: unitNS, Name: PodName("s")}}))
	sbx := f.sandbox("s")
	sbx.Status.NodeName = ""
	must(t, f.c.Status().Update(ctx, sbx))
	f.deleteNode("node-a")
	f.reconcile("s")
	f.wantLost("s", true)
}

// TestUnitNoLossWhileTheNodeExists: a pod that is not ready, or that went
// away, on a node that still exists is not a node loss.
func TestUnitNoLossWhileTheNodeExists(t *testing.T) {
	f, _ := nodeLossEnv(t, true, "s-snap-1")
	ctx := context.Background()
	var pod corev1.Pod
	f.exists(&pod, PodName("s"))
	pod.Status.Conditions = []corev1.PodCondition{{Type: corev1.PodReady, Status: corev1.ConditionFalse}}
	must(t, f.c.Status().Update(ctx, &pod))
	f.reconcile("s")
	if sbx := f.sandbox("s"); sbx.Status.NodeLoss != nil || readyReason(sbx) == v1alpha1.ReasonNodeLost {
		t.Fatalf("a pod that is not ready on an existing node counted as a node loss: %+v", sbx.Status)
	}
	must(t, f.c.Delete(ctx, &pod))
	f.reconcile("s")
	sbx := f.sandbox("s")
	if sbx.Status.NodeLoss != nil || readyReason(sbx) == v1alpha1.ReasonNodeLost || sbx.Status.NodeName != "" {
		t.Fatalf("a deleted pod on an existing node counted as a node loss: %+v", sbx.Status)
	}
	if !f.exists(&corev1.Pod{}, PodName("s")) || !f.exists(&corev1.PersistentVolumeClaim{}, WorkspaceClaimName("s")) {
		t.Fatal("the pod was not created again on the kept claim")
	}
}

// TestUnitNodeGoneOnlyFromTheCache: a node the cache has not seen (it has
// just joined) is confirmed by a direct read before anything is deleted.
func TestUnitNodeGoneOnlyFromTheCache(t *testing.T) {
	f, _ := nodeLossEnv(t, true, "s-snap-1")
	direct := fake.NewClientBuilder().WithScheme(f.r.Scheme).WithObjects(
		&corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "node-a", Labels: map[string]string{corev1.LabelHostname: "node-a"}}}).Build()
	f.r.APIReader = direct
	f.deleteNode("node-a") // from the "cache" only
	f.reconcile("s")
	f.wantPhase("s", v1alpha1.SandboxPhaseRunning, v1alpha1.ReasonRunning)
	if !f.exists(&corev1.Pod{}, PodName("s")) || !f.exists(&corev1.PersistentVolumeClaim{}, WorkspaceClaimName("s")) {
		t.Fatal("a stale cache cost the sandbox its pod or workspace")
	}
}

// TestUnitNodeLossWarmSandbox: an unassigned warm sandbox has nobody to
// call it; it starts again at once.
func TestUnitNodeLossWarmSandbox(t *testing.T) {
	f, _ := nodeLossEnv(t, true, "")
	ctx := context.Background()
	sbx := f.sandbox("s")
	sbx.Labels = map[string]string{v1alpha1.LabelWarmPool: "p", v1alpha1.LabelAgentIDHash: v1alpha1.AgentIDHash(sbx.Spec.AgentID)}
	must(t, f.c.Update(ctx, sbx))
	f.deleteNode("node-a")
	f.reconcile("s")
	f.wantPhase("s", v1alpha1.SandboxPhaseError, v1alpha1.ReasonNodeLost)
	if msg := f.ready("s").Message; !strings.Contains(msg, "warm sandbox starts again") {
		t.Errorf("message %q", msg)
	}
	f.reconcile("s")
	if !f.exists(&corev1.PersistentVolumeClaim{}, WorkspaceClaimName("s")) {
		t.Fatal("the warm sandbox did not start again")
	}
	if got := f.sandbox("s"); got.Status.NodeLoss != nil || got.Status.Phase == v1alpha1.SandboxPhaseError {
		t.Fatalf("warm sandbox after the restart: %+v", got.Status)
	}
}

// TestUnitNodeLossDuringIdleStop: the node goes while the stop's snapshot
// is being taken. A snapshot already ready is kept as the newest; one that
// is not is deleted, and the last good one stays.
func TestUnitNodeLossDuringIdleStop(t *testing.T) {
	for _, ready := range []bool{true, false} {
		name := map[bool]string{true: "ready", false: "unfinished"}[ready]
		t.Run(name, func(t *testing.T) {
			f, d := nodeLossEnv(t, true, "s-old")
			f.clock.Step(2 * time.Hour)
			f.reconcile("s")
			sbx := f.wantPhase("s", v1alpha1.SandboxPhaseIdleStopping, v1alpha1.ReasonIdleTimeout)
			pending := sbx.Status.PendingSnapshot
			d.state = snapshot.State{Ready: ready}
			f.deleteNode("node-a")
			f.reconcile("s")
			got := f.wantLost("s", true)
			if got.Status.PendingSnapshot != "" {
				t.Errorf("pending snapshot %q kept", got.Status.PendingSnapshot)
			}
			want, deleted := "s-old", pending
			if ready {
				want, deleted = pending, "s-old"
			}
			if got.Status.Snapshot == nil || got.Status.Snapshot.Name != want {
				t.Errorf("snapshot %+v, want %s", got.Status.Snapshot, want)
			}
			if len(d.deleted) != 1 || d.deleted[0] != deleted {
				t.Errorf("deleted %v, want %s", d.deleted, deleted)
			}
			if !strings.Contains(f.ready("s").Message, want) {
				t.Errorf("message %q does not name snapshot %s", f.ready("s").Message, want)
			}
		})
	}
}

// TestUnitStoppedSandboxLosesNothing: a stopped sandbox's workspace is in
// its snapshot; a node deleted under the pod its stop removed only means
// that pod goes by force.
func TestUnitStoppedSandboxLosesNothing(t *testing.T) {
	f, d := nodeLossEnv(t, true, "s-old")
	// The pod's deletion waits on its kubelet, like a finalizer.
	var pod corev1.Pod
	f.exists(&pod, PodName("s"))
	pod.Finalizers = []string{"test/kubelet"}
	must(t, f.c.Update(context.Background(), &pod))
	d.state = snapshot.State{Ready: true}
	f.clock.Step(2 * time.Hour)
	f.reconcile("s")
	f.wantPhase("s", v1alpha1.SandboxPhaseStopped, v1alpha1.ReasonStopped)
	f.reconcile("s")
	if !f.exists(&pod, PodName("s")) || pod.DeletionTimestamp.IsZero() {
		t.Fatal("want the stopped sandbox's pod still terminating")
	}
	f.deleteNode("node-a")
	f.reconcile("s")
	if sbx := f.wantPhase("s", v1alpha1.SandboxPhaseStopped, v1alpha1.ReasonStopped); sbx.Status.NodeLoss != nil || sbx.Status.NodeName != "" {
		t.Fatalf("a stopped sandbox recorded a node loss: %+v, node %q", sbx.Status.NodeLoss, sbx.Status.NodeName)
	}
}
