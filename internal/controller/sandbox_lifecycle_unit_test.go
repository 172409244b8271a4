package controller

import (
	"context"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	"github.com/agentbox/terraform-provider-agentbox/internal/snapshot"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"
)

// recordingDriver is a snapshot driver whose outcome the test sets. The
// real drivers have their own tests against real storage; this one checks
// what the controller asks of a driver and when.
type recordingDriver struct {
	mu       sync.Mutex
	state    snapshot.State
	taken    []string
	deleted  []string
	restored []string
	prepared []string
	flushed  bool
}

func (d *recordingDriver) Name() string { return "recording" }

func (d *recordingDriver) Take(_ context.Context, req snapshot.Request) (snapshot.State, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.taken = append(d.taken, req.Name)
	return d.state, nil
}

func (d *recordingDriver) PrepareClaim(snap *v1alpha1.SandboxSnapshot, claim *corev1.PersistentVolumeClaim) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.prepared = append(d.prepared, snap.Name)
}

func (d *recordingDriver) Restore(_ context.Context, req snapshot.RestoreRequest) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.restored = append(d.restored, req.Snapshot.Name)
	return nil
}

func (d *recordingDriver) Delete(_ context.Context, _ *v1alpha1.Sandbox, name string) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.deleted = append(d.deleted, name)
	return nil
}

// lifecycleEnv is a fake cluster plus a real supervisor serving over plain
// HTTP, which every pod "IP" dials.
func newLifecycleEnv(t *testing.T, sbx *v1alpha1.Sandbox) (*fakeEnv, *recordingDriver) {
	t.Helper()
	sup, err := supervisor.New(supervisor.Config{
		Workspace: t.TempDir(),
		Logger:    slog.New(slog.NewTextHandler(io.Discard, nil)),
	})
	must(t, err)
	srv := httptest.NewServer(sup)
	t.Cleanup(srv.Close)
	f := newFakeEnv(t, sbx, unitTemplate("t"))
	d := &recordingDriver{}
	f.r.Snapshots = d
	f.r.Supervisors = dialerFunc(func(endpoint, id string) (*supervisorapi.Client, error) {
		d.mu.Lock()
		d.flushed = true
		d.mu.Unlock()
		return supervisorapi.NewClient(srv.URL, srv.Client()), nil
	})
	return f, d
}

type dialerFunc func(endpoint, id string) (*supervisorapi.Client, error)

func (f dialerFunc) Supervisor(endpoint, id string) (*supervisorapi.Client, error) {
	return f(endpoint, id)
}

func (f *fakeEnv) podReady(name string) {
	f.t.Helper()
	ctx := context.Background()
	var pod corev1.Pod
	must(f.t, f.c.Get(ctx, types.NamespacedName{Namespace: unitNS, Name: name}, &pod))
	pod.Status = corev1.PodStatus{
		Phase: corev1.PodRunning, PodIP: "198.18.0.7",
		Conditions: []corev1.PodCondition{{Type: corev1.PodReady, Status: corev1.ConditionTrue}},
		ContainerStatuses: []corev1.ContainerStatus{{
			Name: ContainerName, Ready: true, State: corev1.ContainerState{Running: &corev1.ContainerStateRunning{}},
		}},
	}
	must(f.t, f.c.Status().Update(ctx, &pod))
}

// renew does what the Compute API does on a call: move renewTime to now.
func (f *fakeEnv) renew(name string) {
	f.t.Helper()
	ctx := context.Background()
	var lease coordinationv1.Lease
	must(f.t, f.c.Get(ctx, types.NamespacedName{Namespace: unitNS, Name: LeaseName(name)}, &lease))
	lease.Spec.RenewTime = ptr.To(metav1.NewMicroTime(f.clock.Now()))
	must(f.t, f.c.Update(ctx, &lease))
}

func (f *fakeEnv) exists(obj client.Object, name string) bool {
	f.t.Helper()
	err := f.c.Get(context.Background(), types.NamespacedName{Namespace: unitNS, Name: name}, obj)
	if err != nil && !apierrors.IsNotFound(err) {
		f.t.Fatal(err)
	}
	return err == nil
}

func (f *fakeEnv) wantPhase(name string, phase v1alpha1.SandboxPhase, reason string) *v1alpha1.Sandbox {
	f.t.Helper()
	sbx := f.sandbox(name)
	c := f.ready(name)
	if sbx.Status.Phase != phase || c.Reason != reason {
		f.t.Fatalf("phase %s, reason %s (%s); want %s, %s", sbx.Status.Phase, c.Reason, c.Message, phase, reason)
	}
	return sbx
}

func idleSandbox(name string, timeout time.Duration) *v1alpha1.Sandbox {
	sbx := unitSandbox(name, "t")
	sbx.Spec.IdleTimeout = &metav1.Duration{Duration: timeout}
	return sbx
}

func TestUnitIdleStopAndResume(t *testing.T) {
	f, d := newLifecycleEnv(t, idleSandbox("s", time.Minute))
	f.reconcile("s") // children
	f.podReady("s")
	res := f.reconcile("s")
	f.wantPhase("s", v1alpha1.SandboxPhaseRunning, v1alpha1.ReasonRunning)
	if res.RequeueAfter <= 0 || res.RequeueAfter > time.Minute {
		t.Errorf("requeue %s; want the moment the sandbox turns idle, within the 1m timeout", res.RequeueAfter)
	}

	// Busy sandboxes are left alone.
	f.clock.Step(50 * time.Second)
	f.renew("s")
	f.clock.Step(50 * time.Second)
	f.reconcile("s")
	f.wantPhase("s", v1alpha1.SandboxPhaseRunning, v1alpha1.ReasonRunning)

	// Idle: the stop flushes, starts the snapshot and waits for it.
	f.clock.Step(20 * time.Second)
	res = f.reconcile("s")
	sbx := f.wantPhase("s", v1alpha1.SandboxPhaseIdleStopping, v1alpha1.ReasonIdleTimeout)
	if !d.flushed || len(d.taken) == 0 || sbx.Status.PendingSnapshot != d.taken[0] || res.RequeueAfter != snapshotPoll {
		t.Fatalf("flushed %v, taken %v, pending %q, requeue %s", d.flushed, d.taken, sbx.Status.PendingSnapshot, res.RequeueAfter)
	}
	first := d.taken[0]
	if !f.exists(&corev1.Pod{}, "s") {
		t.Fatal("the pod was deleted before the snapshot was ready")
	}

	// Activity during the stop does not abandon the snapshot half-way.
	f.renew("s")
	d.state = snapshot.State{Ready: true, SizeBytes: 4096}
	f.reconcile("s")
	sbx = f.wantPhase("s", v1alpha1.SandboxPhaseStopped, v1alpha1.ReasonStopped)
	if sbx.Status.Snapshot == nil || sbx.Status.Snapshot.Name != first || sbx.Status.Snapshot.SizeBytes != 4096 || sbx.Status.PendingSnapshot != "" {
		t.Fatalf("status after stop: snapshot %+v, pending %q", sbx.Status.Snapshot, sbx.Status.PendingSnapshot)
	}
	if f.exists(&corev1.Pod{}, "s") || f.exists(&corev1.PersistentVolumeClaim{}, WorkspaceClaimName("s")) {
		t.Fatal("pod or workspace claim left after the stop")
	}
	if evs := strings.Join(f.drainEvents(), "\n"); !strings.Contains(evs, EventIdleStopping) || !strings.Contains(evs, EventIdleStopped) {
		t.Errorf("events %q lack IdleStopping and IdleStopped", evs)
	}

	// The renewal during the stop wakes it: a claim marked for restore,
	// prepared by the driver, and a pod; Resuming until the restore is in.
	f.reconcile("s")
	var claim corev1.PersistentVolumeClaim
	if !f.exists(&claim, WorkspaceClaimName("s")) || claim.Annotations[AnnotationRestoreFrom] != first {
		t.Fatalf("claim after wake-up: annotations %v", claim.Annotations)
	}
	if len(d.prepared) != 1 || d.prepared[0] != first {
		t.Fatalf("prepared %v", d.prepared)
	}
	f.wantPhase("s", v1alpha1.SandboxPhaseResuming, v1alpha1.ReasonResuming)
	f.podReady("s")
	f.reconcile("s")
	f.wantPhase("s", v1alpha1.SandboxPhaseRunning, v1alpha1.ReasonRunning)
	if len(d.restored) != 1 || d.restored[0] != first {
		t.Fatalf("restored %v", d.restored)
	}
	f.exists(&claim, WorkspaceClaimName("s"))
	if _, ok := claim.Annotations[AnnotationRestoreFrom]; ok {
		t.Fatal("the restore-from mark stayed after the restore")
	}
	if evs := strings.Join(f.drainEvents(), "\n"); !strings.Contains(evs, EventResumed) {
		t.Errorf("events %q lack Resumed", evs)
	}

	// The next stop replaces the snapshot, and only then deletes the old.
	f.clock.Step(2 * time.Minute)
	f.reconcile("s")
	sbx = f.wantPhase("s", v1alpha1.SandboxPhaseStopped, v1alpha1.ReasonStopped)
	if sbx.Status.Snapshot.Name == first || len(d.deleted) != 1 || d.deleted[0] != first {
		t.Fatalf("second stop: snapshot %q, deleted %v", sbx.Status.Snapshot.Name, d.deleted)
	}
	// Parked: further passes change nothing.
	f.clock.Step(time.Hour)
	f.reconcile("s")
	f.wantPhase("s", v1alpha1.SandboxPhaseStopped, v1alpha1.ReasonStopped)
	if f.exists(&corev1.Pod{}, "s") {
		t.Fatal("a parked sandbox got a pod")
	}
}

func TestUnitSnapshotFailureKeepsClaimAndLastSnapshot(t *testing.T) {
	sbx := idleSandbox("s", time.Minute)
	f, d := newLifecycleEnv(t, sbx)
	f.reconcile("s")
	f.podReady("s")
	f.reconcile("s")
	// A good snapshot from an earlier stop.
	cur := f.sandbox("s")
	cur.Status.Snapshot = &v1alpha1.SandboxSnapshot{Name: "s-good"}
	must(t, f.c.Status().Update(context.Background(), cur))

	f.clock.Step(2 * time.Minute)
	d.state = snapshot.State{Failed: "the CSI driver reported: out of space"}
	f.reconcile("s")
	got := f.wantPhase("s", v1alpha1.SandboxPhaseError, v1alpha1.ReasonSnapshotFailed)
	if got.Status.Snapshot == nil || got.Status.Snapshot.Name != "s-good" || got.Status.PendingSnapshot != "" {
		t.Fatalf("after failure: snapshot %+v pending %q", got.Status.Snapshot, got.Status.PendingSnapshot)
	}
	if f.exists(&corev1.Pod{}, "s") {
		t.Fatal("the pod still runs after the failed stop")
	}
	if !f.exists(&corev1.PersistentVolumeClaim{}, WorkspaceClaimName("s")) {
		t.Fatal("the workspace claim, the only copy of the newest data, was deleted")
	}
	if len(d.deleted) != 1 || d.deleted[0] == "s-good" {
		t.Fatalf("deleted %v; want the failed snapshot only", d.deleted)
	}
	if !strings.Contains(f.ready("s").Message, "out of space") {
		t.Errorf("message %q does not carry the driver's reason", f.ready("s").Message)
	}
	// Still idle: it stays down.
	f.reconcile("s")
	f.wantPhase("s", v1alpha1.SandboxPhaseError, v1alpha1.ReasonSnapshotFailed)

	// Activity recovers it on the kept claim, with nothing to restore.
	f.renew("s")
	f.reconcile("s")
	f.podReady("s")
	f.reconcile("s")
	f.wantPhase("s", v1alpha1.SandboxPhaseRunning, v1alpha1.ReasonRunning)
	if len(d.restored) != 0 || len(d.prepared) != 0 {
		t.Fatalf("restored %v prepared %v; the kept claim needs neither", d.restored, d.prepared)
	}
	// And the next stop succeeds.
	d.state = snapshot.State{Ready: true}
	f.clock.Step(2 * time.Minute)
	f.reconcile("s")
	f.wantPhase("s", v1alpha1.SandboxPhaseStopped, v1alpha1.ReasonStopped)
}

func TestUnitEphemeralIdleStopKeepsNothing(t *testing.T) {
	sbx := idleSandbox("s", time.Minute)
	sbx.Spec.Ephemeral = true
	f, d := newLifecycleEnv(t, sbx)
	f.r.Snapshots = nil // ephemeral sandboxes need no driver
	f.reconcile("s")
	f.podReady("s")
	f.reconcile("s")
	f.clock.Step(2 * time.Minute)
	f.reconcile("s")
	got := f.wantPhase("s", v1alpha1.SandboxPhaseStopped, v1alpha1.ReasonStopped)
	if got.Status.Snapshot != nil || f.exists(&corev1.Pod{}, "s") || f.exists(&corev1.PersistentVolumeClaim{}, WorkspaceClaimName("s")) {
		t.Fatal("an ephemeral sandbox kept state after its idle stop")
	}
	f.renew("s")
	f.reconcile("s")
	var claim corev1.PersistentVolumeClaim
	if !f.exists(&claim, WorkspaceClaimName("s")) || claim.Annotations[AnnotationRestoreFrom] != "" || len(d.taken) != 0 {
		t.Fatalf("ephemeral restart: claim annotations %v, snapshots taken %v", claim.Annotations, d.taken)
	}
}

func TestUnitNoDriverNoStop(t *testing.T) {
	f, _ := newLifecycleEnv(t, idleSandbox("s", time.Minute))
	f.r.Snapshots = nil
	f.reconcile("s")
	f.podReady("s")
	f.reconcile("s")
	f.clock.Step(time.Hour)
	f.reconcile("s")
	f.wantPhase("s", v1alpha1.SandboxPhaseRunning, v1alpha1.ReasonRunning)
}

func TestSnapshotName(t *testing.T) {
	at := time.Unix(1_800_000_000, 0)
	if got := snapshotName("s", at); got != "s-1800000000" {
		t.Errorf("snapshotName = %q", got)
	}
	long := strings.Repeat("a", 253)
	got := snapshotName(long, at)
	if len(got) != 253 || !strings.HasSuffix(got, "-1800000000") || got == snapshotName(long[:252]+"b", at) {
		t.Errorf("long name %q (%d)", got, len(got))
	}
}

// TestUnitSyncFailure: seed 000's sync failure. The flush before the
// snapshot fails, is retried once, fails again: the pod stops without a
// snapshot, the claim stays, the sandbox is Error/SyncFailed, and the next
// activity brings it back on its claim.
func TestUnitSyncFailure(t *testing.T) {
	defer func(d time.Duration) { syncRetryDelay = d }(syncRetryDelay)
	syncRetryDelay = time.Millisecond
	f, d := newLifecycleEnv(t, idleSandbox("s", time.Minute))
	f.reconcile("s")
	f.podReady("s")
	f.reconcile("s")
	var calls int
	dead := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		calls++
		http.Error(w, `{"error":{"code":"internal","message":"syncfs: input/output error"}}`, http.StatusInternalServerError)
	}))
	defer dead.Close()
	f.r.Supervisors = dialerFunc(func(string, string) (*supervisorapi.Client, error) {
		return supervisorapi.NewClient(dead.URL, dead.Client()), nil
	})
	f.clock.Step(2 * time.Minute)
	f.reconcile("s")
	sbx := f.wantPhase("s", v1alpha1.SandboxPhaseError, v1alpha1.ReasonSyncFailed)
	if calls != 2 || len(d.taken) != 0 || sbx.Status.PendingSnapshot != "" {
		t.Fatalf("flush calls %d (want 2: one retry), snapshots taken %v, pending %q", calls, d.taken, sbx.Status.PendingSnapshot)
	}
	if f.exists(&corev1.Pod{}, "s") || !f.exists(&corev1.PersistentVolumeClaim{}, WorkspaceClaimName("s")) {
		t.Fatal("want the pod stopped and the claim kept")
	}
	if evs := strings.Join(f.drainEvents(), "\n"); !strings.Contains(evs, EventSyncFailed) {
		t.Errorf("events %q lack SyncFailed", evs)
	}
	f.renew("s")
	f.reconcile("s")
	if !f.exists(&corev1.Pod{}, "s") {
		t.Error("activity after a sync failure did not start the pod again")
	}
}
