package controller

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/go-logr/logr"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	"github.com/agentbox/terraform-provider-agentbox/internal/computeapi"
	"github.com/agentbox/terraform-provider-agentbox/internal/filespace"
	"github.com/agentbox/terraform-provider-agentbox/internal/snapshot/archive"
	"github.com/agentbox/terraform-provider-agentbox/internal/store"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"
	"github.com/agentbox/terraform-provider-agentbox/internal/testenv/loopvol"
	"github.com/agentbox/terraform-provider-agentbox/internal/testenv/s3server"
)

// TestFilespaceFollowsTheAgent runs the filespace sync through the
// controller on the real cluster, with the real store (SQLite) and a gVisor
// pod's supervisor: the idle stop pushes the workspace into the agent's
// filespace; a change made to the filespace while the sandbox is stopped is
// pulled on resume; and a new sandbox for the same agent, after the first
// is deleted, starts with the agent's files, also when it adopts a warm
// sandbox.
func TestFilespaceFollowsTheAgent(t *testing.T) {
	t.Parallel()
	image := os.Getenv(EnvSandboxImage)
	if image == "" {
		t.Skipf("%s is not set: the filespace sync needs the real sandbox image's supervisor", EnvSandboxImage)
	}
	e, st, _ := platformEnv(t)
	e.template("tpl", func(tpl *v1alpha1.SandboxTemplate) {
		tpl.Spec.Image = image
		tpl.Spec.IdleTimeout = metav1.Duration{Duration: time.Hour}
	})
	sbx := e.sandbox("first", "tpl")
	agent := sbx.Spec.AgentID

	sbx, _ = e.waitPhase("first", v1alpha1.SandboxPhaseRunning, v1alpha1.ReasonRunning)
	sup := e.supervisor(t, sbx)
	if !e.workspaceWritable(t, sup) {
		t.Fatal("the workspace must be writable for this test")
	}
	run(t, e.ctx, sup, `mkdir -p notes && echo "written in the sandbox" > notes/a.txt`)

	// The idle stop pushes before the snapshot.
	e.setActivity("first", time.Now().Add(-2*time.Hour))
	e.waitPhase("first", v1alpha1.SandboxPhaseStopped, v1alpha1.ReasonStopped)
	n, err := st.GetFile(e.ctx, agent, "notes/a.txt")
	if err != nil {
		t.Fatalf("notes/a.txt is not in the filespace after the idle stop: %v", err)
	}
	if n.SizeBytes != int64(len("written in the sandbox\n")) {
		t.Errorf("pushed node %+v", n)
	}

	// Another writer (here a supervisor process on the host, as a sync
	// through the Compute API from another workspace would be) changes the
	// filespace while the sandbox is stopped; the resume pulls it.
	other := hostWorkspace(t)
	if _, err := filespace.Sync(e.ctx, other, st, filespace.Options{AgentID: agent, Direction: filespace.Pull}); err != nil {
		t.Fatal(err)
	}
	if _, err := other.PutFile(e.ctx, "notes/b.txt", strings.NewReader("written elsewhere\n"), 0); err != nil {
		t.Fatal(err)
	}
	if _, err := filespace.Sync(e.ctx, other, st, filespace.Options{AgentID: agent, Direction: filespace.Push}); err != nil {
		t.Fatal(err)
	}
	e.setActivity("first", time.Now())
	sbx, _ = e.waitPhase("first", v1alpha1.SandboxPhaseRunning, v1alpha1.ReasonRunning)
	sup = e.supervisor(t, sbx)
	if got := run(t, e.ctx, sup, `cat notes/a.txt notes/b.txt`); got != "written in the sandbox\nwritten elsewhere" {
		t.Errorf("workspace after the resume: %q", got)
	}
	e.checkEvent(sbx, EventFilespacePulled)

	// The agent's files outlive its sandbox.
	must(t, e.c.Delete(e.ctx, sbx))
	e.gone(&v1alpha1.Sandbox{}, "first")
	second := &v1alpha1.Sandbox{
		ObjectMeta: metav1.ObjectMeta{Name: "second", Namespace: e.ns},
		Spec:       v1alpha1.SandboxSpec{AgentID: agent, TemplateRef: v1alpha1.LocalObjectReference{Name: "tpl"}},
	}
	must(t, e.c.Create(e.ctx, second))
	sbx, _ = e.waitPhase("second", v1alpha1.SandboxPhaseRunning, v1alpha1.ReasonRunning)
	sup = e.supervisor(t, sbx)
	if got := run(t, e.ctx, sup, `cat notes/a.txt notes/b.txt`); got != "written in the sandbox\nwritten elsewhere" {
		t.Errorf("workspace of the agent's new sandbox: %q", got)
	}

	// Also when the new sandbox adopts a warm one: the warm workspace was
	// made before anyone knew the agent.
	must(t, e.c.Delete(e.ctx, sbx))
	e.gone(&v1alpha1.Sandbox{}, "second")
	e.template("pooled", func(tpl *v1alpha1.SandboxTemplate) {
		tpl.Spec.Image = image
		tpl.Spec.IdleTimeout = metav1.Duration{Duration: time.Hour}
	})
	must(t, e.c.Create(e.ctx, &v1alpha1.SandboxWarmPool{
		ObjectMeta: metav1.ObjectMeta{Name: "pool", Namespace: e.ns},
		Spec:       v1alpha1.SandboxWarmPoolSpec{TemplateRef: v1alpha1.LocalObjectReference{Name: "pooled"}, Replicas: 1},
	}))
	e.waitPoolFull("pool", 1)
	must(t, e.c.Create(e.ctx, &v1alpha1.Sandbox{
		ObjectMeta: metav1.ObjectMeta{Name: "third", Namespace: e.ns},
		Spec:       v1alpha1.SandboxSpec{AgentID: agent, TemplateRef: v1alpha1.LocalObjectReference{Name: "pooled"}},
	}))
	sbx, _ = e.waitPhase("third", v1alpha1.SandboxPhaseRunning, v1alpha1.ReasonAdoptedFromWarmPool)
	sup = e.supervisor(t, sbx)
	if got := run(t, e.ctx, sup, `cat notes/a.txt notes/b.txt`); got != "written in the sandbox\nwritten elsewhere" {
		t.Errorf("workspace of the agent's sandbox that adopted a warm one: %q", got)
	}
}

// hostWorkspace is a supervisor serving a temporary directory on the host.
func hostWorkspace(t *testing.T) *supervisorapi.Client {
	t.Helper()
	sup, err := supervisor.New(supervisor.Config{Workspace: t.TempDir(), Logger: slog.New(slog.DiscardHandler)})
	must(t, err)
	t.Cleanup(func() { sup.Close() })
	srv := httptest.NewServer(sup)
	t.Cleanup(srv.Close)
	return supervisorapi.NewClient(srv.URL, srv.Client())
}

// checkEvent fails the test unless an event of reason was recorded on sbx.
func (e *clusterEnv) checkEvent(sbx *v1alpha1.Sandbox, reason string) {
	e.t.Helper()
	e.eventually("event "+reason+" on "+sbx.Name, func() error {
		var list corev1.EventList
		if err := e.c.List(e.ctx, &list, client.InNamespace(e.ns)); err != nil {
			return err
		}
		for _, ev := range list.Items {
			if ev.Reason == reason && ev.InvolvedObject.UID == sbx.UID {
				return nil
			}
		}
		return fmt.Errorf("not recorded yet")
	})
}

// platformEnv is a cluster environment set up as the control plane is: the
// archive snapshot driver on a real S3 store on loopback, the store
// (SQLite) for the filespace, and the Compute API's supervisor pool, which
// it returns with the store.
func platformEnv(t *testing.T) (*clusterEnv, *store.Store, *computeapi.SupervisorPool) {
	t.Helper()
	return platformEnvAt(t, t.TempDir())
}

// platformEnvAt is platformEnv with the store's SQLite file in dir.
func platformEnvAt(t *testing.T, dir string) (*clusterEnv, *store.Store, *computeapi.SupervisorPool) {
	t.Helper()
	s3 := s3server.Start(t)
	arch, err := archive.New(archive.Config{
		Endpoint: s3.Endpoint, Bucket: s3.Bucket, Region: s3.Region,
		AccessKeyID: s3.AccessKeyID, SecretAccessKey: s3.SecretAccessKey,
	})
	must(t, err)
	t.Cleanup(arch.Close)
	dbPath := filepath.Join(dir, "agentbox.db")
	st, err := store.Open(context.Background(), dbPath, store.Options{})
	must(t, err)
	t.Cleanup(func() { st.Close() })
	var pool *computeapi.SupervisorPool
	// Closed before the store (cleanups run last first).
	agentEvents := computeapi.NewAgentEvents(st, logr.Discard())
	t.Cleanup(agentEvents.Close)
	e := newClusterEnv(t, withSnapshots(t, arch, &pool), func(r *SandboxReconciler) {
		r.Filespaces = filespace.Syncer{Store: st}
		r.WarmTakes = st
		r.AgentEvents = agentEvents
	})
	e.storePath, e.supervisors, e.agentEvents = dbPath, pool, agentEvents
	return e, st, pool
}

// TestStoreWithoutRoomOnCluster: the store's SQLite file on a real 256 MiB
// volume (ext4 on a loop device, as a chart's claim of that size is), and a
// gVisor sandbox whose workspace holds more than the store has room for.
// The idle stop's push is refused before it writes (the volume keeps its
// reserve, and the store goes on taking audit records); the sandbox turns
// Error/SyncFailed saying what to grow, stays without a pod while nobody
// calls, and the next activity starts it on its kept workspace, whole.
func TestStoreWithoutRoomOnCluster(t *testing.T) {
	t.Parallel()
	image := os.Getenv(EnvSandboxImage)
	if image == "" {
		t.Skipf("%s is not set: the filespace sync needs the real sandbox image's supervisor", EnvSandboxImage)
	}
	if err := loopvol.Check(); err != nil {
		t.Skipf("a store volume of a fixed size needs loop devices: %v", err)
	}
	const volSize = 256 << 20
	dir := t.TempDir()
	ctx := context.Background()
	img, mnt := filepath.Join(dir, "store.img"), filepath.Join(dir, "store")
	must(t, os.Mkdir(mnt, 0o755))
	must(t, loopvol.Format(ctx, img, volSize, 0o755))
	must(t, loopvol.Mount(ctx, img, mnt))
	// Registered before the store's own cleanup, so it runs after it.
	t.Cleanup(func() {
		if err := loopvol.Unmount(context.Background(), mnt); err != nil {
			t.Errorf("unmount the store's volume: %v", err)
		}
	})
	e, st, _ := platformEnvAt(t, mnt)
	e.template("tpl", func(tpl *v1alpha1.SandboxTemplate) {
		tpl.Spec.Image = image
		tpl.Spec.IdleTimeout = metav1.Duration{Duration: time.Hour}
	})
	e.sandbox("full", "tpl")
	sbx, _ := e.waitPhase("full", v1alpha1.SandboxPhaseRunning, v1alpha1.ReasonRunning)
	sup := e.supervisor(t, sbx)
	if !e.workspaceWritable(t, sup) {
		t.Fatal("the workspace must be writable for this test")
	}
	sum := run(t, e.ctx, sup, `dd if=/dev/urandom of=big.bin bs=1M count=200 2>/dev/null && sha256sum big.bin`)

	e.setActivity("full", time.Now().Add(-2*time.Hour))
	sbx = e.waitReason("full", v1alpha1.ReasonSyncFailed)
	ready := meta.FindStatusCondition(sbx.Status.Conditions, v1alpha1.ConditionReady)
	if sbx.Status.Phase != v1alpha1.SandboxPhaseError || !strings.Contains(ready.Message, "no room for filespace contents") ||
		!strings.Contains(ready.Message, "store.persistence.size") {
		t.Fatalf("after the refused push: phase %s, Ready %s: %s", sbx.Status.Phase, ready.Reason, ready.Message)
	}
	t.Logf("SyncFailed: %s", ready.Message)
	room, err := st.BlobRoom(e.ctx)
	must(t, err)
	if !room.Known || room.Free < room.Reserve {
		t.Errorf("the store's volume after the refused push: %+v; want its reserve free", room)
	}
	if _, err := st.GetFile(e.ctx, sbx.Spec.AgentID, "big.bin"); !errors.Is(err, store.ErrNotFound) {
		t.Errorf("big.bin in the filespace: %v", err)
	}
	if _, err := st.AppendAudit(e.ctx, store.AuditEntry{Caller: "test", CallerKind: "admin", Operation: "status", Result: "ok"}); err != nil {
		t.Errorf("an audit record after the refused push: %v", err)
	}

	// Parked: no pod comes back while nobody calls (it would turn idle at
	// once and fail its stop again).
	for end := time.Now().Add(10 * time.Second); time.Now().Before(end); time.Sleep(time.Second) {
		var pod corev1.Pod
		if err := e.get(PodName(sbx.WorkloadName()), &pod); err == nil && pod.DeletionTimestamp == nil {
			t.Fatalf("a pod %s came back without activity", pod.Name)
		}
	}

	e.setActivity("full", time.Now())
	sbx, _ = e.waitPhase("full", v1alpha1.SandboxPhaseRunning, v1alpha1.ReasonRunning)
	if got := run(t, e.ctx, e.supervisor(t, sbx), `sha256sum big.bin`); got != sum {
		t.Errorf("big.bin after the restart on the kept workspace: %q, want %q", got, sum)
	}
}
