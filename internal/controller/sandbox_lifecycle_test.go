package controller

import (
	"context"
	"crypto/tls"
	"encoding/pem"
	"fmt"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/minio/minio-go/v7"
	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	"github.com/agentbox/terraform-provider-agentbox/internal/computeapi"
	apiclient "github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
	"github.com/agentbox/terraform-provider-agentbox/internal/pki"
	"github.com/agentbox/terraform-provider-agentbox/internal/snapshot"
	"github.com/agentbox/terraform-provider-agentbox/internal/store"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"
	"github.com/agentbox/terraform-provider-agentbox/internal/testenv/s3server"
)

// failableDriver passes every call to a real driver, except that Take
// reports a failed snapshot while fail is set: a real store does not fail
// on cue, and the controller's answer to a failure is what is under test.
type failableDriver struct {
	snapshot.Driver
	fail atomic.Bool
}

func (d *failableDriver) Take(ctx context.Context, req snapshot.Request) (snapshot.State, error) {
	if d.fail.Load() {
		return snapshot.State{Failed: "forced by the test"}, nil
	}
	return d.Driver.Take(ctx, req)
}

// withSnapshots gives the reconciler a snapshot driver and, as in the
// control plane, the Compute API's supervisor pool with the control plane's
// client certificate.
func withSnapshots(t *testing.T, d snapshot.Driver, pool **computeapi.SupervisorPool) func(*SandboxReconciler) {
	return func(r *SandboxReconciler) {
		leaf, err := r.CA.Issue(pki.LeafOptions{ID: pki.ControlPlaneID(testTrustDomain, testPlatformNamespace), Usage: pki.UsageClient})
		must(t, err)
		cert, err := leaf.TLSCertificate()
		must(t, err)
		p, err := computeapi.NewSupervisorPool(func() (*tls.Certificate, error) { return &cert, nil }, r.CA.Pool())
		must(t, err)
		t.Cleanup(p.Close)
		r.Supervisors = p
		r.Snapshots = d
		*pool = p
	}
}

// setActivity moves the sandbox's activity clock, the Lease's renewTime,
// as the Compute API does on every call: into the past to make the sandbox
// idle now, or to now to wake it.
func (e *clusterEnv) setActivity(name string, at time.Time) {
	e.t.Helper()
	var lease coordinationv1.Lease
	must(e.t, e.get(ActivityClockName(name), &lease))
	patch := client.MergeFrom(lease.DeepCopy())
	lease.Spec.RenewTime = ptr.To(metav1.NewMicroTime(at))
	must(e.t, e.c.Patch(e.ctx, &lease, patch))
}

// computeAPI serves the Compute API on loopback over TLS, as the control
// plane does beside the controller: same cluster, same supervisor pool.
func (e *clusterEnv) computeAPI(pool *computeapi.SupervisorPool) *apiclient.Client {
	return e.computeAPIWithStore(pool, nil)
}

// computeAPIWithStore is computeAPI with a store behind it (audit, lease
// history, the filespace), as the control plane has; configure changes the
// API's options.
func (e *clusterEnv) computeAPIWithStore(pool *computeapi.SupervisorPool, st *store.Store, configure ...func(*computeapi.Options)) *apiclient.Client {
	e.t.Helper()
	c, _ := e.startComputeAPI(pool, st, configure...)
	return c
}

// startComputeAPI is computeAPIWithStore that also returns what shuts the
// API down, as a control plane replica's shutdown does: its server stops
// taking calls and the Server closes (ending its runs' executors). It is
// idempotent, and runs at the test's end in any case.
func (e *clusterEnv) startComputeAPI(pool *computeapi.SupervisorPool, st *store.Store, configure ...func(*computeapi.Options)) (*apiclient.Client, func()) {
	e.t.Helper()
	const token = "lifecycle-test-token"
	admin, err := computeapi.NewAdminTokenAuthenticator(computeapi.HashToken(token))
	must(e.t, err)
	// Tokens the admin mints (agent, staff) are looked up in the store.
	var auth computeapi.Authenticator = admin
	if st != nil {
		auth = computeapi.ChainAuthenticators(admin, computeapi.NewStoreAuthenticator(st))
	}
	// Sandboxes are read from the manager's cache, as in the control
	// plane: straight reads go through client-go's rate limiter (5/s by
	// default), which would make a burst of calls queue for seconds.
	var sandboxes client.Reader = e.c
	if e.r != nil {
		sandboxes = e.r.Client
	}
	opts := computeapi.Options{
		Sandboxes: sandboxes, Leases: e.c, Supervisors: pool, Authenticator: auth, TrustDomain: testTrustDomain,
		ResumeTimeout: waitTimeout, Store: st, FilespacePushDelay: -1,
	}
	if st != nil {
		opts.AgentEvents = e.agentEvents
	}
	for _, c := range configure {
		c(&opts)
	}
	srv, err := computeapi.NewServer(opts)
	must(e.t, err)
	e.apiServer = srv
	hs := httptest.NewTLSServer(srv.Handler())
	var once sync.Once
	shutdown := func() {
		once.Do(func() {
			hs.Close()
			srv.Close()
		})
	}
	e.t.Cleanup(shutdown)
	e.apiCAPEM = pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: hs.Certificate().Raw})
	return e.apiClient(hs.URL, token), shutdown
}

// apiClient is a client of the API computeAPI serves, with token.
func (e *clusterEnv) apiClient(endpoint, token string) *apiclient.Client {
	e.t.Helper()
	c, err := apiclient.New(endpoint, token, e.apiCAPEM)
	must(e.t, err)
	e.t.Cleanup(c.CloseIdleConnections)
	return c
}

// cliEnv is the environment that points the agentbox CLI at the API
// computeAPI serves, with token.
func (e *clusterEnv) cliEnv(endpoint, token string) []string {
	e.t.Helper()
	caFile := filepath.Join(e.t.TempDir(), "api-ca.crt")
	must(e.t, os.WriteFile(caFile, e.apiCAPEM, 0o600))
	return append(os.Environ(), "AGENTBOX_ENDPOINT="+endpoint, "AGENTBOX_TOKEN="+token, "AGENTBOX_CA_FILE="+caFile)
}

// waitPhase waits for the sandbox to reach phase with the Ready reason
// reason, and returns it with how long that took.
func (e *clusterEnv) waitPhase(name string, phase v1alpha1.SandboxPhase, reason string) (*v1alpha1.Sandbox, time.Duration) {
	e.t.Helper()
	start := time.Now()
	var sbx v1alpha1.Sandbox
	e.eventually(fmt.Sprintf("sandbox %s to be %s/%s", name, phase, reason), func() error {
		if err := e.get(name, &sbx); err != nil {
			return err
		}
		if got := readyReason(&sbx); sbx.Status.Phase != phase || got != reason {
			return fmt.Errorf("%s/%s", sbx.Status.Phase, got)
		}
		return nil
	})
	return &sbx, time.Since(start)
}

func (e *clusterEnv) gone(obj client.Object, name string) {
	e.t.Helper()
	e.eventually(fmt.Sprintf("%T %s to be deleted", obj, name), func() error {
		if err := e.get(name, obj); !apierrors.IsNotFound(err) {
			return fmt.Errorf("still there (get: %v)", err)
		}
		return nil
	})
}

func run(t *testing.T, ctx context.Context, sup *supervisorapi.Client, script string) string {
	t.Helper()
	res, err := sup.RunCommand(ctx, supervisorapi.CommandRequest{Command: []string{"sh", "-c", script}, Cwd: "/workspace"})
	must(t, err)
	if res.ExitCode != 0 {
		t.Fatalf("%s: exit %d signal %q timed_out %v out_of_memory %v after %d ms: %s",
			script, res.ExitCode, res.Signal, res.TimedOut, res.OutOfMemory, res.DurationMS, res.Stderr)
	}
	return strings.TrimSpace(res.Stdout)
}

// TestIdleStopAndResume runs the whole idle lifecycle on the real cluster:
// a gVisor pod with the real supervisor, the archive driver against a real
// S3 store on loopback, and the controller in between. The workspace must
// survive a stop and resume byte for byte; a failed snapshot must keep both
// the claim and the last good snapshot and the sandbox serving, and the
// stop, retried after its backoff, must then go through.
func TestIdleStopAndResume(t *testing.T) {
	t.Parallel()
	image := os.Getenv(EnvSandboxImage)
	if image == "" {
		t.Skipf("%s is not set: idle stop needs the real sandbox image's supervisor", EnvSandboxImage)
	}
	store := s3server.Start(t)
	arch := s3Archive(t, store)
	drv := &failableDriver{Driver: arch}
	var pool *computeapi.SupervisorPool
	e := newClusterEnv(t, withSnapshots(t, drv, &pool))
	api := e.computeAPI(pool)
	e.template("tpl", func(tpl *v1alpha1.SandboxTemplate) {
		tpl.Spec.Image = image
		// Longer than the test: only setActivity makes the sandbox idle.
		tpl.Spec.IdleTimeout = metav1.Duration{Duration: time.Hour}
	})
	e.sandbox("idler", "tpl")

	sbx, firstStart := e.waitPhase("idler", v1alpha1.SandboxPhaseRunning, v1alpha1.ReasonRunning)
	sup := e.supervisor(t, sbx)
	if !e.workspaceWritable(t, sup) {
		t.Fatal("the workspace must be writable for this test")
	}
	const write = `mkdir -p notes && echo "first words" > notes/a.txt && head -c 4194304 /dev/urandom > blob && ln -s notes/a.txt link && chmod 0600 notes/a.txt`
	run(t, e.ctx, sup, write)
	const digest = `sha256sum blob notes/a.txt && stat -c '%a %N' notes/a.txt link`
	before := run(t, e.ctx, sup, digest)

	// Idle stop: flush, archive, then pod and claim go.
	e.setActivity("idler", time.Now().Add(-2*time.Hour))
	sbx, stopTook := e.waitPhase("idler", v1alpha1.SandboxPhaseStopped, v1alpha1.ReasonStopped)
	e.gone(&corev1.Pod{}, PodName("idler"))
	e.gone(&corev1.PersistentVolumeClaim{}, WorkspaceClaimName("idler"))
	first := sbx.Status.Snapshot
	if first == nil || first.Name == "" || sbx.Status.PendingSnapshot != "" {
		t.Fatalf("after the stop: snapshot %+v, pending %q", first, sbx.Status.PendingSnapshot)
	}
	obj, err := store.Client(t).StatObject(e.ctx, store.Bucket, arch.Key(sbx, first.Name), minio.StatObjectOptions{})
	if err != nil {
		t.Fatalf("the archive of %s is not in the store: %v", first.Name, err)
	}

	// The next call wakes it: a new claim, the archive restored into it
	// before the sandbox is Ready, and the call served then, one slower
	// call rather than an error.
	callStart := time.Now()
	res, err := api.RunCommand(e.ctx, sbx.Spec.AgentID, apiclient.RunCommandRequest{Command: []string{"sh", "-c", digest}})
	resumeTook := time.Since(callStart)
	if err != nil {
		t.Fatalf("run_command on the stopped sandbox: %v", err)
	}
	if after := strings.TrimSpace(res.Stdout); res.ExitCode != 0 || after != before {
		t.Errorf("workspace after resume (exit %d, %s):\n%s\nwant:\n%s", res.ExitCode, res.Stderr, after, before)
	}
	sbx, _ = e.waitPhase("idler", v1alpha1.SandboxPhaseRunning, v1alpha1.ReasonRunning)
	sup = e.supervisor(t, sbx)
	var claim corev1.PersistentVolumeClaim
	must(t, e.get(WorkspaceClaimName("idler"), &claim))
	if v, ok := claim.Annotations[AnnotationRestoreFrom]; ok {
		t.Errorf("claim still marked for restore from %q after the sandbox is Ready", v)
	}
	t.Logf("archive driver, real cluster: first start %s; idle stop %s (archive %d bytes); run_command on the stopped sandbox %s",
		firstStart.Round(time.Millisecond), stopTook.Round(time.Millisecond), obj.Size, resumeTook.Round(time.Millisecond))

	// A failed snapshot abandons the stop: the pod, the claim (the only
	// copy of the newest data) and the last good snapshot stay, the
	// sandbox keeps serving, and it says why.
	run(t, e.ctx, sup, `echo "second words" > notes/b.txt`)
	drv.fail.Store(true)
	e.setActivity("idler", time.Now().Add(-2*time.Hour))
	var blocked *metav1.Condition
	e.eventually("the idle stop to be abandoned", func() error {
		if err := e.get("idler", sbx); err != nil {
			return err
		}
		if blocked = meta.FindStatusCondition(sbx.Status.Conditions, v1alpha1.ConditionIdleStopBlocked); blocked == nil || sbx.Status.IdleStopRetry == nil {
			return fmt.Errorf("phase %s, no IdleStopBlocked condition yet", sbx.Status.Phase)
		}
		return nil
	})
	if sbx.Status.Phase != v1alpha1.SandboxPhaseRunning || readyReason(sbx) != v1alpha1.ReasonRunning || blocked.Reason != v1alpha1.ReasonSnapshotFailed ||
		!strings.Contains(blocked.Message, "forced by the test") {
		t.Fatalf("after the failed snapshot: phase %s/%s, IdleStopBlocked %+v", sbx.Status.Phase, readyReason(sbx), blocked)
	}
	if err := e.get(PodName("idler"), &corev1.Pod{}); err != nil {
		t.Fatalf("the pod went with a failed snapshot: %v", err)
	}
	if err := e.get(WorkspaceClaimName("idler"), &claim); err != nil {
		t.Fatalf("the claim went with a failed snapshot: %v", err)
	}
	if sbx.Status.Snapshot == nil || sbx.Status.Snapshot.Name != first.Name || sbx.Status.PendingSnapshot != "" {
		t.Errorf("after the failed snapshot: snapshot %+v, pending %q; want %s kept", sbx.Status.Snapshot, sbx.Status.PendingSnapshot, first.Name)
	}
	if _, err := store.Client(t).StatObject(e.ctx, store.Bucket, arch.Key(sbx, first.Name), minio.StatObjectOptions{}); err != nil {
		t.Errorf("the last good archive is gone after a failed snapshot: %v", err)
	}
	// Calls are served meanwhile, at once, from the same pod.
	callStart = time.Now()
	res, err = api.RunCommand(e.ctx, sbx.Spec.AgentID, apiclient.RunCommandRequest{Command: []string{"sh", "-c", "cat notes/a.txt notes/b.txt"}})
	if err != nil || res.ExitCode != 0 || res.Stdout != "first words\nsecond words\n" {
		t.Fatalf("run_command after the abandoned stop: %+v, %v", res, err)
	}
	t.Logf("run_command on the sandbox whose stop was abandoned: %s", time.Since(callStart).Round(time.Millisecond))

	// Once the snapshot works again, the retry after the backoff stops
	// the sandbox, and the next call resumes it with both files.
	drv.fail.Store(false)
	e.setActivity("idler", time.Now().Add(-2*time.Hour))
	sbx, retryTook := e.waitPhase("idler", v1alpha1.SandboxPhaseStopped, v1alpha1.ReasonStopped)
	if sbx.Status.IdleStopRetry != nil || meta.FindStatusCondition(sbx.Status.Conditions, v1alpha1.ConditionIdleStopBlocked) != nil {
		t.Errorf("after the retried stop: retry %+v, conditions %+v", sbx.Status.IdleStopRetry, sbx.Status.Conditions)
	}
	t.Logf("the retried stop finished %s after activity was set back (backoff %s)", retryTook.Round(time.Millisecond), idleStopRetryBase)
	res, err = api.RunCommand(e.ctx, sbx.Spec.AgentID, apiclient.RunCommandRequest{Command: []string{"sh", "-c", "cat notes/a.txt notes/b.txt"}})
	if err != nil || res.ExitCode != 0 || res.Stdout != "first words\nsecond words\n" {
		t.Fatalf("run_command after the retried stop: %+v, %v", res, err)
	}
	sbx, _ = e.waitPhase("idler", v1alpha1.SandboxPhaseRunning, v1alpha1.ReasonRunning)

	// Deleting the sandbox takes its archives with it.
	must(t, e.c.Delete(e.ctx, sbx))
	e.eventually("the archives to be deleted with the sandbox", func() error {
		for o := range store.Client(t).ListObjects(e.ctx, store.Bucket, minio.ListObjectsOptions{Recursive: true}) {
			if o.Err != nil {
				return o.Err
			}
			return fmt.Errorf("%s is still in the store", o.Key)
		}
		return nil
	})
}

// stallingDriver passes every call to a real driver, except that its first
// Take starts the real snapshot and then does not return until its context
// ends: the control plane is killed in the middle of the stop.
type stallingDriver struct {
	snapshot.Driver
	once    sync.Once
	stalled chan struct{}
	name    string // of the snapshot the stalled Take started
}

func (d *stallingDriver) Take(ctx context.Context, req snapshot.Request) (snapshot.State, error) {
	first := false
	d.once.Do(func() { first = true })
	if !first {
		return d.Driver.Take(ctx, req)
	}
	_, _ = d.Driver.Take(ctx, req)
	d.name = req.Name
	close(d.stalled)
	<-ctx.Done()
	return snapshot.State{}, ctx.Err()
}

// TestControlPlaneKilledMidStop kills the controller (and with it the
// archive driver's uploads) while a stop is taking its snapshot. Nothing
// may be deleted before a snapshot is ready, and a new control plane must
// finish the same stop, with the same snapshot name, and lose no file.
func TestControlPlaneKilledMidStop(t *testing.T) {
	t.Parallel()
	image := os.Getenv(EnvSandboxImage)
	if image == "" {
		t.Skipf("%s is not set: idle stop needs the real sandbox image's supervisor", EnvSandboxImage)
	}
	store := s3server.Start(t)
	first := s3Archive(t, store)
	stall := &stallingDriver{Driver: first, stalled: make(chan struct{})}
	var pool *computeapi.SupervisorPool
	e := newClusterEnv(t, withSnapshots(t, stall, &pool))
	e.template("tpl", func(tpl *v1alpha1.SandboxTemplate) {
		tpl.Spec.Image = image
		tpl.Spec.IdleTimeout = metav1.Duration{Duration: time.Hour}
	})
	e.sandbox("crash", "tpl")
	sbx, _ := e.waitPhase("crash", v1alpha1.SandboxPhaseRunning, v1alpha1.ReasonRunning)
	sup := e.supervisor(t, sbx)
	if !e.workspaceWritable(t, sup) {
		t.Fatal("the workspace must be writable for this test")
	}
	run(t, e.ctx, sup, `head -c 8388608 /dev/urandom > big && echo kept > small`)
	const digest = `sha256sum big small`
	before := run(t, e.ctx, sup, digest)

	e.setActivity("crash", time.Now().Add(-2*time.Hour))
	select {
	case <-stall.stalled:
	case <-time.After(waitTimeout):
		t.Fatal("the stop never reached the snapshot")
	}
	e.stop()
	first.Close()

	// The killed pass may or may not have written IdleStopping; either way
	// the snapshot's name is derived from the activity it follows, so the
	// next control plane takes up the same one.
	pending := stall.name
	if err := e.get(PodName("crash"), &corev1.Pod{}); err != nil {
		t.Errorf("the pod went before a snapshot was ready: %v", err)
	}
	if err := e.get(WorkspaceClaimName("crash"), &corev1.PersistentVolumeClaim{}); err != nil {
		t.Errorf("the claim went before a snapshot was ready: %v", err)
	}

	restarted := time.Now()
	e.startManager(withSnapshots(t, s3Archive(t, store), &pool))
	sbx, _ = e.waitPhase("crash", v1alpha1.SandboxPhaseStopped, v1alpha1.ReasonStopped)
	converged := time.Since(restarted)
	if sbx.Status.Snapshot == nil || sbx.Status.Snapshot.Name != pending {
		t.Errorf("the new control plane recorded snapshot %+v; want the interrupted stop's %s", sbx.Status.Snapshot, pending)
	}
	e.setActivity("crash", time.Now())
	sbx, _ = e.waitPhase("crash", v1alpha1.SandboxPhaseRunning, v1alpha1.ReasonRunning)
	if after := run(t, e.ctx, e.supervisor(t, sbx), digest); after != before {
		t.Errorf("workspace after the interrupted stop and resume:\n%s\nwant:\n%s", after, before)
	}
	t.Logf("control plane killed mid-stop: the next one finished the stop in %s", converged.Round(time.Millisecond))
}
