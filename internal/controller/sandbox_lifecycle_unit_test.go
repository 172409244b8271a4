package controller

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
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
	takeErr  error
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
	return d.state, d.takeErr
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
	// A sandbox behind a PerAgent proxy serves once its proxy pod is
	// ready: stand in for the EgressProxy controller, which these tests
	// do not run.
	if name := pod.Annotations[annotationEgressProxyPod]; name != "" {
		// Owned like the sandbox's pod: by the Sandbox it serves.
		proxy := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: unitNS, OwnerReferences: pod.OwnerReferences}}
		if err := f.c.Create(ctx, proxy); err != nil && !apierrors.IsAlreadyExists(err) {
			f.t.Fatal(err)
		}
		must(f.t, f.c.Get(ctx, client.ObjectKeyFromObject(proxy), proxy))
		proxy.Status = corev1.PodStatus{Phase: corev1.PodRunning,
			Conditions: []corev1.PodCondition{{Type: corev1.PodReady, Status: corev1.ConditionTrue}}}
		must(f.t, f.c.Status().Update(ctx, proxy))
	}
}

// renew does what the Compute API does on a call: move renewTime to now.
func (f *fakeEnv) renew(name string) {
	f.t.Helper()
	ctx := context.Background()
	var lease coordinationv1.Lease
	must(f.t, f.c.Get(ctx, types.NamespacedName{Namespace: unitNS, Name: ActivityClockName(name)}, &lease))
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

	// The snapshot becomes ready: pod and claim go.
	d.state = snapshot.State{Ready: true, SizeBytes: 4096}
	f.reconcile("s")
	sbx = f.wantPhase("s", v1alpha1.SandboxPhaseStopped, v1alpha1.ReasonStopped)
	if sbx.Status.Snapshot == nil || sbx.Status.Snapshot.Name != first || sbx.Status.Snapshot.SizeBytes != 4096 || sbx.Status.PendingSnapshot != "" ||
		sbx.Status.Snapshot.Driver != "recording" {
		t.Fatalf("status after stop: snapshot %+v, pending %q", sbx.Status.Snapshot, sbx.Status.PendingSnapshot)
	}
	if f.exists(&corev1.Pod{}, "s") || f.exists(&corev1.PersistentVolumeClaim{}, WorkspaceClaimName("s")) {
		t.Fatal("pod or workspace claim left after the stop")
	}
	if evs := strings.Join(f.drainEvents(), "\n"); !strings.Contains(evs, EventIdleStopping) || !strings.Contains(evs, EventIdleStopped) {
		t.Errorf("events %q lack IdleStopping and IdleStopped", evs)
	}

	// Activity wakes it: a claim marked for restore, prepared by the
	// driver, and a pod; Resuming until the restore is in.
	f.renew("s")
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

// A snapshot that fails while the pod runs abandons the stop: the sandbox
// stays Running and serving, says why in IdleStopBlocked, and the stop is
// tried again with exponential backoff until it works.
func TestUnitSnapshotFailureAbandonsStop(t *testing.T) {
	sbx := idleSandbox("s", time.Minute)
	f, d := newLifecycleEnv(t, sbx)
	f.reconcile("s")
	f.podReady("s")
	f.reconcile("s")
	// A good snapshot from an earlier stop.
	cur := f.sandbox("s")
	cur.Status.Snapshot = &v1alpha1.SandboxSnapshot{Name: "s-good", Driver: "recording"}
	must(t, f.c.Status().Update(context.Background(), cur))

	f.clock.Step(2 * time.Minute)
	d.state = snapshot.State{Failed: "the CSI driver reported: out of space"}
	res := f.reconcile("s")
	got := f.wantPhase("s", v1alpha1.SandboxPhaseRunning, v1alpha1.ReasonRunning)
	if f.ready("s").Status != metav1.ConditionTrue || got.Status.ServiceEndpoint == "" {
		t.Fatalf("after the failed snapshot: Ready %+v, endpoint %q; want serving", f.ready("s"), got.Status.ServiceEndpoint)
	}
	if got.Status.Snapshot == nil || got.Status.Snapshot.Name != "s-good" || got.Status.PendingSnapshot != "" {
		t.Fatalf("after failure: snapshot %+v pending %q", got.Status.Snapshot, got.Status.PendingSnapshot)
	}
	if !f.exists(&corev1.Pod{}, "s") || !f.exists(&corev1.PersistentVolumeClaim{}, WorkspaceClaimName("s")) {
		t.Fatal("the pod or the claim went with a failed snapshot")
	}
	if len(d.taken) != 1 || len(d.deleted) != 1 || d.deleted[0] != d.taken[0] {
		t.Fatalf("taken %v deleted %v; want the failed snapshot deleted, and only it", d.taken, d.deleted)
	}
	blocked := meta.FindStatusCondition(got.Status.Conditions, v1alpha1.ConditionIdleStopBlocked)
	if blocked == nil || blocked.Status != metav1.ConditionTrue || blocked.Reason != v1alpha1.ReasonSnapshotFailed || !strings.Contains(blocked.Message, "out of space") {
		t.Fatalf("IdleStopBlocked %+v; want True, SnapshotFailed, with the driver's reason", blocked)
	}
	retry := got.Status.IdleStopRetry
	if retry == nil || retry.Failures != 1 || retry.NextAttemptTime.Time.Sub(f.clock.Now()) > idleStopRetryBase || res.RequeueAfter != idleStopRetryBase {
		t.Fatalf("retry %+v, requeue %s; want one failure and the next attempt %s on", retry, res.RequeueAfter, idleStopRetryBase)
	}
	if evs := strings.Join(f.drainEvents(), "\n"); !strings.Contains(evs, EventIdleStopAbandoned) {
		t.Errorf("events %q lack IdleStopAbandoned", evs)
	}

	// Before the backoff runs out, nothing is tried; the sandbox serves.
	f.clock.Step(10 * time.Second)
	res = f.reconcile("s")
	f.wantPhase("s", v1alpha1.SandboxPhaseRunning, v1alpha1.ReasonRunning)
	if len(d.taken) != 1 || res.RequeueAfter <= 0 || res.RequeueAfter > 20*time.Second {
		t.Fatalf("taken %v, requeue %s during the backoff", d.taken, res.RequeueAfter)
	}

	// The second attempt, under another name, fails too: the wait doubles.
	f.clock.Step(21 * time.Second)
	res = f.reconcile("s")
	got = f.wantPhase("s", v1alpha1.SandboxPhaseRunning, v1alpha1.ReasonRunning)
	if len(d.taken) != 2 || d.taken[1] == d.taken[0] || got.Status.IdleStopRetry.Failures != 2 || res.RequeueAfter != 2*idleStopRetryBase {
		t.Fatalf("taken %v, retry %+v, requeue %s", d.taken, got.Status.IdleStopRetry, res.RequeueAfter)
	}

	// Then it works: the sandbox stops, and the backoff and the condition go.
	d.state = snapshot.State{Ready: true}
	f.clock.Step(2 * idleStopRetryBase)
	f.reconcile("s")
	got = f.wantPhase("s", v1alpha1.SandboxPhaseStopped, v1alpha1.ReasonStopped)
	if got.Status.IdleStopRetry != nil || meta.FindStatusCondition(got.Status.Conditions, v1alpha1.ConditionIdleStopBlocked) != nil {
		t.Fatalf("after a good stop: retry %+v, conditions %+v", got.Status.IdleStopRetry, got.Status.Conditions)
	}
	if got.Status.Snapshot.Name != d.taken[2] {
		t.Fatalf("snapshot %q, want %q", got.Status.Snapshot.Name, d.taken[2])
	}
}

// A snapshot that cannot even start (the driver's Take fails, here with a
// problem the driver diagnosed) abandons the stop with the problem's
// reason.
func TestUnitTakeErrorAbandonsStop(t *testing.T) {
	f, d := newLifecycleEnv(t, idleSandbox("s", time.Minute))
	f.reconcile("s")
	f.podReady("s")
	f.reconcile("s")
	d.takeErr = &snapshot.Problem{Reason: v1alpha1.ReasonVolumeSnapshotClassNotFound, Message: "VolumeSnapshotClass fast does not exist"}
	f.clock.Step(2 * time.Minute)
	f.reconcile("s")
	got := f.wantPhase("s", v1alpha1.SandboxPhaseRunning, v1alpha1.ReasonRunning)
	blocked := meta.FindStatusCondition(got.Status.Conditions, v1alpha1.ConditionIdleStopBlocked)
	if blocked == nil || blocked.Reason != v1alpha1.ReasonVolumeSnapshotClassNotFound || !strings.Contains(blocked.Message, "fast does not exist") {
		t.Fatalf("IdleStopBlocked %+v", blocked)
	}
	// A plain error (the store did not answer) is SnapshotFailed.
	d.takeErr = errors.New("dial tcp: connection refused")
	f.clock.Step(idleStopRetryBase)
	f.reconcile("s")
	got = f.wantPhase("s", v1alpha1.SandboxPhaseRunning, v1alpha1.ReasonRunning)
	if blocked := meta.FindStatusCondition(got.Status.Conditions, v1alpha1.ConditionIdleStopBlocked); blocked == nil ||
		blocked.Reason != v1alpha1.ReasonSnapshotFailed || !strings.Contains(blocked.Message, "connection refused") {
		t.Fatalf("IdleStopBlocked %+v", blocked)
	}
}

// A snapshot that fails after the pod went (deleted by someone else during
// the stop) abandons the stop too: the claim still holds the workspace,
// and a new pod starts on it.
func TestUnitFailureWithoutPodRestartsOnClaim(t *testing.T) {
	f, d := newLifecycleEnv(t, idleSandbox("s", time.Minute))
	f.reconcile("s")
	f.podReady("s")
	f.reconcile("s")
	f.clock.Step(2 * time.Minute)
	f.reconcile("s")
	f.wantPhase("s", v1alpha1.SandboxPhaseIdleStopping, v1alpha1.ReasonIdleTimeout)
	must(t, f.c.Delete(context.Background(), &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: unitNS, Name: "s"}}))
	d.takeErr = errors.New("archive: Take needs the sandbox's supervisor")
	f.reconcile("s")
	f.wantPhase("s", v1alpha1.SandboxPhasePending, v1alpha1.ReasonCreating)
	f.reconcile("s")
	if !f.exists(&corev1.Pod{}, "s") || !f.exists(&corev1.PersistentVolumeClaim{}, WorkspaceClaimName("s")) {
		t.Fatal("no pod was started on the kept claim")
	}
	f.podReady("s")
	f.reconcile("s")
	f.wantPhase("s", v1alpha1.SandboxPhaseRunning, v1alpha1.ReasonRunning)
}

// Activity during a stop whose pod still runs calls the stop off: the
// sandbox serves again at once, and the snapshot in progress is discarded.
func TestUnitActivityCallsOffStop(t *testing.T) {
	f, d := newLifecycleEnv(t, idleSandbox("s", time.Minute))
	f.reconcile("s")
	f.podReady("s")
	f.reconcile("s")
	f.clock.Step(2 * time.Minute)
	f.reconcile("s")
	sbx := f.wantPhase("s", v1alpha1.SandboxPhaseIdleStopping, v1alpha1.ReasonIdleTimeout)
	pending := sbx.Status.PendingSnapshot
	f.drainEvents()

	f.renew("s")
	res := f.reconcile("s")
	got := f.wantPhase("s", v1alpha1.SandboxPhaseRunning, v1alpha1.ReasonRunning)
	if got.Status.PendingSnapshot != "" || len(d.deleted) != 1 || d.deleted[0] != pending || got.Status.ServiceEndpoint == "" {
		t.Fatalf("pending %q, deleted %v, endpoint %q", got.Status.PendingSnapshot, d.deleted, got.Status.ServiceEndpoint)
	}
	if got.Status.IdleStopRetry != nil || meta.FindStatusCondition(got.Status.Conditions, v1alpha1.ConditionIdleStopBlocked) != nil {
		t.Fatal("a stop called off by activity counted as a failure")
	}
	if evs := strings.Join(f.drainEvents(), "\n"); !strings.Contains(evs, EventIdleStopCancelled) {
		t.Errorf("events %q lack IdleStopCancelled", evs)
	}
	if res.RequeueAfter <= 0 || res.RequeueAfter > time.Minute {
		t.Errorf("requeue %s; want the next idle moment", res.RequeueAfter)
	}
	// Nothing changes on the next pass.
	before := f.sandbox("s").ResourceVersion
	f.reconcile("s")
	if after := f.sandbox("s").ResourceVersion; after != before {
		t.Error("the pass after the call-off wrote the status again")
	}
	// Idle again later: a new stop goes through.
	d.state = snapshot.State{Ready: true}
	f.clock.Step(2 * time.Minute)
	f.reconcile("s")
	f.wantPhase("s", v1alpha1.SandboxPhaseStopped, v1alpha1.ReasonStopped)
}

// fixedHealth is a snapshot check with a fixed answer.
type fixedHealth struct{ p *snapshot.Problem }

func (h *fixedHealth) Problem() *snapshot.Problem { return h.p }

// While the control plane's snapshot check fails, no stop is begun: the
// sandbox serves on and says why, and stops once the check passes.
func TestUnitFailedCheckHoldsStopsBack(t *testing.T) {
	f, d := newLifecycleEnv(t, idleSandbox("s", time.Minute))
	health := &fixedHealth{p: &snapshot.Problem{Reason: v1alpha1.ReasonSnapshotAPIMissing, Message: "the cluster does not serve VolumeSnapshots"}}
	f.r.SnapshotHealth = health
	f.reconcile("s")
	f.podReady("s")
	f.reconcile("s")
	f.drainEvents()
	f.clock.Step(2 * time.Minute)
	res := f.reconcile("s")
	got := f.wantPhase("s", v1alpha1.SandboxPhaseRunning, v1alpha1.ReasonRunning)
	blocked := meta.FindStatusCondition(got.Status.Conditions, v1alpha1.ConditionIdleStopBlocked)
	if blocked == nil || blocked.Reason != v1alpha1.ReasonSnapshotAPIMissing || !strings.Contains(blocked.Message, "VolumeSnapshots") {
		t.Fatalf("IdleStopBlocked %+v", blocked)
	}
	if len(d.taken) != 0 || d.flushed || res.RequeueAfter != heldBackRecheck {
		t.Fatalf("taken %v, flushed %v, requeue %s; want nothing done and a look again in %s", d.taken, d.flushed, res.RequeueAfter, heldBackRecheck)
	}
	f.reconcile("s")
	if evs := f.drainEvents(); len(evs) != 1 || !strings.Contains(evs[0], EventIdleStopBlocked) {
		t.Errorf("events %q; want one IdleStopBlocked", evs)
	}
	// Busy again, and the check passes: the condition goes, although no
	// stop happened.
	f.renew("s")
	health.p = nil
	f.reconcile("s")
	got = f.wantPhase("s", v1alpha1.SandboxPhaseRunning, v1alpha1.ReasonRunning)
	if meta.FindStatusCondition(got.Status.Conditions, v1alpha1.ConditionIdleStopBlocked) != nil {
		t.Error("IdleStopBlocked stayed after the check passed")
	}
	f.clock.Step(2 * time.Minute)
	d.state = snapshot.State{Ready: true}
	f.reconcile("s")
	got = f.wantPhase("s", v1alpha1.SandboxPhaseStopped, v1alpha1.ReasonStopped)
	if meta.FindStatusCondition(got.Status.Conditions, v1alpha1.ConditionIdleStopBlocked) != nil {
		t.Error("IdleStopBlocked stayed after a good stop")
	}
}

// A stopped sandbox whose snapshot another driver took is not resumed
// into an empty workspace: it waits in Error, saying what to do.
func TestUnitSnapshotDriverChanged(t *testing.T) {
	sbx := idleSandbox("s", time.Minute)
	f, d := newLifecycleEnv(t, sbx)
	f.reconcile("s")
	f.podReady("s")
	f.reconcile("s")
	d.state = snapshot.State{Ready: true}
	f.clock.Step(2 * time.Minute)
	f.reconcile("s")
	cur := f.wantPhase("s", v1alpha1.SandboxPhaseStopped, v1alpha1.ReasonStopped)
	cur.Status.Snapshot.Driver = "archive/s3"
	must(t, f.c.Status().Update(context.Background(), cur))
	f.drainEvents()

	f.renew("s")
	f.reconcile("s")
	f.wantPhase("s", v1alpha1.SandboxPhaseError, v1alpha1.ReasonSnapshotDriverChanged)
	if msg := f.ready("s").Message; !strings.Contains(msg, "archive/s3") || !strings.Contains(msg, "recording") {
		t.Errorf("message %q does not name both drivers", msg)
	}
	if f.exists(&corev1.PersistentVolumeClaim{}, WorkspaceClaimName("s")) || f.exists(&corev1.Pod{}, "s") || len(d.restored) != 0 {
		t.Fatal("a claim or pod was made for a restore that cannot work")
	}
	f.reconcile("s")
	if evs := f.drainEvents(); len(evs) != 1 || !strings.Contains(evs[0], EventSnapshotDriverChanged) {
		t.Errorf("events %q; want one SnapshotDriverChanged", evs)
	}
	// The driver back as it was: the sandbox resumes.
	cur = f.sandbox("s")
	cur.Status.Snapshot.Driver = "recording"
	must(t, f.c.Status().Update(context.Background(), cur))
	f.reconcile("s")
	f.podReady("s")
	f.reconcile("s")
	f.wantPhase("s", v1alpha1.SandboxPhaseRunning, v1alpha1.ReasonRunning)
	if len(d.restored) != 1 {
		t.Fatalf("restored %v", d.restored)
	}
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
	if got := snapshotName("s", at, 0); got != "s-1800000000" {
		t.Errorf("snapshotName = %q", got)
	}
	if got := snapshotName("s", at, 3); got != "s-1800000000-3" {
		t.Errorf("snapshotName of a retry = %q", got)
	}
	long := strings.Repeat("a", 253)
	got := snapshotName(long, at, 0)
	if len(got) != 253 || !strings.HasSuffix(got, "-1800000000") || got == snapshotName(long[:252]+"b", at, 0) {
		t.Errorf("long name %q (%d)", got, len(got))
	}
	if got := snapshotName(long, at, 12); len(got) != 253 || !strings.HasSuffix(got, "-1800000000-12") {
		t.Errorf("long name of a retry %q (%d)", got, len(got))
	}
	for n, want := range map[int32]time.Duration{1: 30 * time.Second, 2: time.Minute, 3: 2 * time.Minute, 7: 30 * time.Minute, 40: 30 * time.Minute} {
		if got := idleStopBackoff(n); got != want {
			t.Errorf("idleStopBackoff(%d) = %s, want %s", n, got, want)
		}
	}
}

// TestUnitSyncFailure: the sync failure of an idle stop. The flush before the
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
	// Without activity it stays stopped: starting the pod again would stop
	// it again at once, the sandbox being idle, in a loop of failed syncs.
	f.reconcile("s")
	f.reconcile("s")
	if f.exists(&corev1.Pod{}, "s") {
		t.Fatal("the pod was started again without activity after a sync failure")
	}
	f.wantPhase("s", v1alpha1.SandboxPhaseError, v1alpha1.ReasonSyncFailed)
	f.renew("s")
	f.reconcile("s")
	if !f.exists(&corev1.Pod{}, "s") {
		t.Error("activity after a sync failure did not start the pod again")
	}
}

// staleReader serves the stored Sandbox while the client, standing for
// the manager's cache, still serves an older copy.
type staleReader struct{ live *v1alpha1.Sandbox }

func (s staleReader) Get(_ context.Context, _ client.ObjectKey, obj client.Object, _ ...client.GetOption) error {
	s.live.DeepCopyInto(obj.(*v1alpha1.Sandbox))
	return nil
}

func (s staleReader) List(context.Context, client.ObjectList, ...client.ListOption) error {
	return errors.New("not used")
}

// TestUnitStopFinishedOnce: the pass that the stop's own deletions wake may
// read the sandbox from a cache that still says IdleStopping. It must not
// finish the stop a second time: one IdleStopped event, one stop counted.
func TestUnitStopFinishedOnce(t *testing.T) {
	f, d := newLifecycleEnv(t, idleSandbox("s", time.Minute))
	f.reconcile("s")
	f.podReady("s")
	f.reconcile("s")
	f.clock.Step(2 * time.Minute)
	f.reconcile("s")
	stale := f.wantPhase("s", v1alpha1.SandboxPhaseIdleStopping, v1alpha1.ReasonIdleTimeout)
	d.state = snapshot.State{Ready: true, SizeBytes: 4096}
	stops := testutil.ToFloat64(metricIdleStops)
	f.reconcile("s")
	live := f.wantPhase("s", v1alpha1.SandboxPhaseStopped, v1alpha1.ReasonStopped)
	f.drainEvents()

	// The cache still has the sandbox as it was before the stop finished.
	f.r.APIReader = staleReader{live: live}
	cached := live.DeepCopy()
	cached.Status = stale.Status
	must(t, f.c.Status().Update(context.Background(), cached))
	f.clock.Step(10 * time.Millisecond)
	f.reconcile("s")
	if evs := strings.Join(f.drainEvents(), "\n"); strings.Contains(evs, EventIdleStopped) {
		t.Errorf("a stale pass finished the stop again: %q", evs)
	}
	if got := testutil.ToFloat64(metricIdleStops) - stops; got != 1 {
		t.Errorf("idle stops counted %v times, want once", got)
	}
}

// TestUnitStopNotBegunFromStaleCache: a stop that begins and ends in one
// pass (its sync failed) never stores IdleStopping, so the pass that the
// pod's deletion wakes can read a cache that still says Running and idle.
// It must not begin a second stop from there: it goes round again on a
// fresh read, leaving the pod and the snapshots alone.
func TestUnitStopNotBegunFromStaleCache(t *testing.T) {
	f, d := newLifecycleEnv(t, idleSandbox("s", time.Minute))
	f.reconcile("s")
	f.podReady("s")
	f.reconcile("s")
	cached := f.wantPhase("s", v1alpha1.SandboxPhaseRunning, v1alpha1.ReasonRunning)
	f.clock.Step(2 * time.Minute)
	f.drainEvents()

	// The API server has moved on from what the cache holds.
	live := cached.DeepCopy()
	live.ResourceVersion += "0"
	live.Status.Phase = v1alpha1.SandboxPhaseError
	f.r.APIReader = staleReader{live: live}
	res := f.reconcile("s")
	if res.RequeueAfter != cacheRetry {
		t.Errorf("requeue after %s, want %s: the pass must run again on a fresh read", res.RequeueAfter, cacheRetry)
	}
	if evs := strings.Join(f.drainEvents(), "\n"); strings.Contains(evs, EventIdleStopping) {
		t.Errorf("a stale pass began a stop: %q", evs)
	}
	if len(d.taken) != 0 || !f.exists(&corev1.Pod{}, "s") {
		t.Errorf("a stale pass took snapshots %v or deleted the pod (exists %v)", d.taken, f.exists(&corev1.Pod{}, "s"))
	}

	// Once the cache has caught up, the stop begins.
	f.r.APIReader = nil
	f.reconcile("s")
	if evs := strings.Join(f.drainEvents(), "\n"); !strings.Contains(evs, EventIdleStopping) {
		t.Errorf("with a fresh cache the stop did not begin: %q", evs)
	}
}
