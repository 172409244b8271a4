package controller

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/client/interceptor"
	"sigs.k8s.io/controller-runtime/pkg/controller/controllerutil"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	"github.com/agentbox/terraform-provider-agentbox/internal/filespace"
	"github.com/agentbox/terraform-provider-agentbox/internal/snapshot"
	"github.com/agentbox/terraform-provider-agentbox/internal/store"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"
)

// TestUnitSlowSupervisorHoldsNoOtherSandbox: the first-serve filespace pull
// of a sandbox whose supervisor takes calls but does not answer them must
// not hold the pass, and so the worker: the pass lets go, the sandbox says
// it is pulling, another sandbox's pass goes on to Running meanwhile, and
// once the supervisor answers, the pull finishes and the sandbox serves
// with the agent's file in its workspace. The store is the real one
// (SQLite), and so is the supervisor behind the stalled listener.
func TestUnitSlowSupervisorHoldsNoOtherSandbox(t *testing.T) {
	ctx := context.Background()
	st, err := store.Open(ctx, filepath.Join(t.TempDir(), "agentbox.db"), store.Options{})
	must(t, err)
	t.Cleanup(func() { st.Close() })

	slow, quick := unitSandbox("slow", "t"), unitSandbox("quick", "t")
	// The slow sandbox's agent has a file to pull; the quick one's has
	// none, which is every new agent's case.
	content := "kept across sandboxes\n"
	sum := sha256.Sum256([]byte(content))
	digest := hex.EncodeToString(sum[:])
	_, err = st.PutBlob(ctx, digest, strings.NewReader(content))
	must(t, err)
	_, err = st.PutFile(ctx, store.FileNode{AgentID: slow.Spec.AgentID, Path: "notes.txt", SizeBytes: int64(len(content)),
		SHA256: digest, UpdatedAt: time.Now().Add(-time.Minute), Mode: 0o644})
	must(t, err)

	workspace := t.TempDir()
	sup, err := supervisor.New(supervisor.Config{Workspace: workspace, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	must(t, err)
	answer := make(chan struct{})
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-answer:
			sup.ServeHTTP(w, r)
		case <-r.Context().Done():
		}
	}))
	t.Cleanup(srv.Close)
	released := false
	release := func() {
		if !released {
			released = true
			close(answer)
		}
	}
	t.Cleanup(release)

	f := newFakeEnv(t, slow, quick, unitTemplate("t"))
	f.r.Filespaces = filespace.Syncer{Store: st}
	var dialMu sync.Mutex
	dialedMap := map[string]int{}
	dialed := func(endpoint string) int {
		dialMu.Lock()
		defer dialMu.Unlock()
		return dialedMap[endpoint]
	}
	f.r.Supervisors = dialerFunc(func(endpoint, id string) (*supervisorapi.Client, error) {
		dialMu.Lock()
		dialedMap[endpoint]++
		dialMu.Unlock()
		return supervisorapi.NewClient(srv.URL, srv.Client()), nil
	})

	for i, name := range []string{"slow", "quick"} {
		f.reconcile(name)
		var pod corev1.Pod
		must(t, f.c.Get(ctx, types.NamespacedName{Namespace: unitNS, Name: name}, &pod))
		pod.Status = corev1.PodStatus{
			Phase: corev1.PodRunning, PodIP: "198.18.0." + string(rune('1'+i)),
			Conditions:        []corev1.PodCondition{{Type: corev1.PodReady, Status: corev1.ConditionTrue}},
			ContainerStatuses: []corev1.ContainerStatus{{Name: ContainerName, Ready: true, State: corev1.ContainerState{Running: &corev1.ContainerStateRunning{}}}},
		}
		must(t, f.c.Status().Update(ctx, &pod))
	}

	// A pass that waited for the stalled supervisor would not return
	// until the pull's own bound, half an hour on: the guard here is only
	// against hanging the test.
	res := f.reconcileWithin("slow", time.Minute)
	if c := f.ready("slow"); c.Status != metav1.ConditionFalse || c.Reason != v1alpha1.ReasonCreating || !strings.Contains(c.Message, "pulling the agent's filespace") {
		t.Fatalf("slow sandbox while its supervisor stalls: %s %s: %s", c.Status, c.Reason, c.Message)
	}
	if res.RequeueAfter <= 0 || res.RequeueAfter > pullRecheck {
		t.Errorf("slow sandbox's pass asks to come back after %s; want within %s", res.RequeueAfter, pullRecheck)
	}
	// Another pass of it meanwhile starts no second pull.
	f.reconcileWithin("slow", time.Minute)
	if n := dialed("https://198.18.0.1:8443"); n > 1 {
		t.Errorf("the slow sandbox's supervisor was dialed %d times, want at most once", n)
	}

	f.reconcileWithin("quick", time.Minute)
	if q := f.sandbox("quick"); q.Status.Phase != v1alpha1.SandboxPhaseRunning {
		t.Fatalf("quick sandbox while the other's supervisor stalls: %s (%s)", q.Status.Phase, f.ready("quick").Message)
	}
	if f.sandbox("slow").Status.Phase == v1alpha1.SandboxPhaseRunning {
		t.Fatal("the slow sandbox serves before its pull ended")
	}
	// Nothing to pull: its supervisor is not even dialed.
	if n := dialed("https://198.18.0.2:8443"); n != 0 {
		t.Errorf("the quick sandbox's supervisor was dialed %d times for an empty filespace", n)
	}

	release()
	deadline := time.Now().Add(time.Minute)
	for f.sandbox("slow").Status.Phase != v1alpha1.SandboxPhaseRunning {
		if time.Now().After(deadline) {
			t.Fatalf("the slow sandbox did not serve after its supervisor answered: %s", f.ready("slow").Message)
		}
		time.Sleep(50 * time.Millisecond)
		f.reconcileWithin("slow", time.Minute)
	}
	got, err := os.ReadFile(filepath.Join(workspace, "notes.txt"))
	if err != nil || string(got) != content {
		t.Errorf("notes.txt in the workspace: %q, %v; want the agent's file", got, err)
	}
	if evs := strings.Join(f.drainEvents(), "\n"); !strings.Contains(evs, EventFilespacePulled) {
		t.Errorf("events %q lack FilespacePulled", evs)
	}
	if f.r.pulls.pending(slow.UID) {
		t.Error("the finished pull is still remembered")
	}
}

// reconcileWithin is reconcile, failing the test if the pass has not
// returned within d.
func (f *fakeEnv) reconcileWithin(name string, d time.Duration) ctrl.Result {
	f.t.Helper()
	type out struct {
		res ctrl.Result
		err error
	}
	done := make(chan out, 1)
	go func() {
		res, err := f.r.Reconcile(context.Background(), ctrl.Request{NamespacedName: client.ObjectKey{Namespace: unitNS, Name: name}})
		done <- out{res, err}
	}()
	select {
	case o := <-done:
		if o.err != nil {
			f.t.Fatalf("reconcile %s: %v", name, o.err)
		}
		return o.res
	case <-time.After(d):
		f.t.Fatalf("reconcile %s still running after %s", name, d)
		return ctrl.Result{}
	}
}

// TestUnitNewSandboxMetaInOneWrite: a new sandbox's agent-ID label and
// finalizer come in one patch of the Sandbox, not two: its first pass's
// writes are what a thousand new sandboxes queue for.
func TestUnitNewSandboxMetaInOneWrite(t *testing.T) {
	f := newFakeEnv(t, unitSandbox("s", "t"), unitTemplate("t"))
	f.r.Snapshots = &recordingDriver{}
	patches := 0
	f.r.Client = interceptor.NewClient(f.c.(client.WithWatch), interceptor.Funcs{
		Patch: func(ctx context.Context, c client.WithWatch, obj client.Object, patch client.Patch, opts ...client.PatchOption) error {
			if _, ok := obj.(*v1alpha1.Sandbox); ok {
				patches++
			}
			return c.Patch(ctx, obj, patch, opts...)
		},
	})
	f.reconcile("s")
	sbx := f.sandbox("s")
	if sbx.Labels[v1alpha1.LabelAgentIDHash] != v1alpha1.AgentIDHash(sbx.Spec.AgentID) || !controllerutil.ContainsFinalizer(sbx, v1alpha1.Finalizer) {
		t.Fatalf("labels %v, finalizers %v; want the agent-ID hash and the finalizer", sbx.Labels, sbx.Finalizers)
	}
	if patches != 1 {
		t.Errorf("%d patches of the Sandbox's metadata, want 1", patches)
	}
	patches = 0
	f.reconcile("s")
	if patches != 0 {
		t.Errorf("a second pass patched the Sandbox %d times", patches)
	}
}

// TestUnitResumeAnnouncedAfterSlowPull: a resumed sandbox whose filespace
// pull outlasts the pass that restored its workspace says Resuming until
// the pull ends, and then Resumed, once: the claim's restore mark is gone
// by then, so the pass that serves must know the resume from the status.
func TestUnitResumeAnnouncedAfterSlowPull(t *testing.T) {
	ctx := context.Background()
	f, d := newLifecycleEnv(t, idleSandbox("s", time.Minute))
	f.reconcile("s")
	f.podReady("s")
	f.reconcile("s")
	f.clock.Step(2 * time.Minute)
	f.reconcile("s")
	d.state = snapshot.State{Ready: true, SizeBytes: 4096}
	f.reconcile("s")
	f.wantPhase("s", v1alpha1.SandboxPhaseStopped, v1alpha1.ReasonStopped)
	f.drainEvents()

	// The agent has a file to pull, and its supervisor stalls until
	// released.
	st, err := store.Open(ctx, filepath.Join(t.TempDir(), "agentbox.db"), store.Options{})
	must(t, err)
	t.Cleanup(func() { st.Close() })
	content := "kept across sandboxes\n"
	sum := sha256.Sum256([]byte(content))
	digest := hex.EncodeToString(sum[:])
	_, err = st.PutBlob(ctx, digest, strings.NewReader(content))
	must(t, err)
	_, err = st.PutFile(ctx, store.FileNode{AgentID: f.sandbox("s").Spec.AgentID, Path: "notes.txt", SizeBytes: int64(len(content)),
		SHA256: digest, UpdatedAt: time.Now().Add(-time.Minute), Mode: 0o644})
	must(t, err)
	sup, err := supervisor.New(supervisor.Config{Workspace: t.TempDir(), Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	must(t, err)
	answer := make(chan struct{})
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-answer:
			sup.ServeHTTP(w, r)
		case <-r.Context().Done():
		}
	}))
	t.Cleanup(srv.Close)
	var once sync.Once
	release := func() { once.Do(func() { close(answer) }) }
	t.Cleanup(release)
	f.r.Filespaces = filespace.Syncer{Store: st}
	f.r.Supervisors = dialerFunc(func(endpoint, id string) (*supervisorapi.Client, error) {
		return supervisorapi.NewClient(srv.URL, srv.Client()), nil
	})

	f.renew("s")
	f.reconcile("s")
	f.podReady("s")
	f.reconcileWithin("s", time.Minute)
	if len(d.restored) != 1 {
		t.Fatalf("restored %v; want the workspace restored before the pull", d.restored)
	}
	f.wantPhase("s", v1alpha1.SandboxPhaseResuming, v1alpha1.ReasonResuming)
	if evs := strings.Join(f.drainEvents(), "\n"); strings.Contains(evs, EventResumed) {
		t.Fatalf("Resumed before the pull ended: %q", evs)
	}

	release()
	deadline := time.Now().Add(time.Minute)
	var evs []string
	for f.sandbox("s").Status.Phase != v1alpha1.SandboxPhaseRunning {
		if time.Now().After(deadline) {
			t.Fatalf("the resumed sandbox did not serve after its pull: %s", f.ready("s").Message)
		}
		time.Sleep(50 * time.Millisecond)
		f.reconcileWithin("s", time.Minute)
		evs = append(evs, f.drainEvents()...)
	}
	f.reconcileWithin("s", time.Minute)
	evs = append(evs, f.drainEvents()...)
	if n := strings.Count(strings.Join(evs, "\n"), EventResumed); n != 1 {
		t.Fatalf("%d Resumed events after the pull, want 1: %q", n, evs)
	}
}
