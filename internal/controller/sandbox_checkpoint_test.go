package controller

import (
	"fmt"
	"maps"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/minio/minio-go/v7"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	"github.com/agentbox/terraform-provider-agentbox/internal/computeapi"
	"github.com/agentbox/terraform-provider-agentbox/internal/testenv"
	"github.com/agentbox/terraform-provider-agentbox/internal/testenv/kwok"
	"github.com/agentbox/terraform-provider-agentbox/internal/testenv/s3server"
)

// TestCheckpointBoundsNodeLoss: a template with checkpointInterval saves
// the workspace of a running sandbox in the background; files written
// before the checkpoint survive the loss of the sandbox's node and its
// node-local workspace, files written after it are lost, and the status
// and an event say which checkpoint was used and what was lost.
//
// It keeps checkpointsKept (2) too: after three or more checkpoints,
// status.checkpoints never listed more than two, and the archives of the
// pruned ones are gone from the store while the two kept are there. And
// each call is followed by a checkpoint begun after it, although the
// Compute API renews the activity clock at most every 30 s: what the calls
// wrote is there after the node loss.
//
// The checkpoint is taken on the real node, through the real supervisor,
// into the archive store. The node then lost is kwok's (the real one
// cannot be deleted from under the shared cluster): the workspace is
// taken away with the pod, as a dead node takes it, and its next volume is
// on the fake node, so the sandbox comes back there and that node is
// deleted. The next call through the Compute API resumes it on the real
// node from the newest checkpoint.
//
// Not parallel, for the same reason as TestNodeLossKeepsNetworkWorkspace:
// kwok processes of two tests would both play every fake node.
func TestCheckpointBoundsNodeLoss(t *testing.T) {
	image := os.Getenv(EnvSandboxImage)
	if image == "" {
		t.Skipf("%s is not set: checkpoints are read through the real sandbox image's supervisor", EnvSandboxImage)
	}
	const checkpointsKept = 2
	nodes := startFakeNodes(t)
	store := s3server.Start(t)
	d := s3Archive(t, store)
	var pool *computeapi.SupervisorPool
	e := newClusterEnv(t, withSnapshots(t, d, &pool))
	const name = "ckpt"
	vols := newWorkspaceVolumes(e, WorkspaceClaimName(name))
	tpl := e.template("tpl", func(tpl *v1alpha1.SandboxTemplate) {
		tpl.Spec.Image = image
		tpl.Spec.IdleTimeout = metav1.Duration{Duration: time.Hour}
		tpl.Spec.CheckpointInterval = &metav1.Duration{Duration: 10 * time.Second}
		tpl.Spec.CheckpointsKept = checkpointsKept
		tpl.Spec.Workspace = v1alpha1.WorkspaceSpec{Size: resource.MustParse(nodeLossWorkspaceSize), StorageClassName: &vols.class}
		tpl.Spec.Tolerations = []corev1.Toleration{kwok.Toleration()}
	})
	vols.on(testenv.NodeName, true)
	sbx := e.sandbox(name, "tpl")
	agent := sbx.Spec.AgentID
	api := e.computeAPI(pool)
	e.waitPhase(name, v1alpha1.SandboxPhaseRunning, v1alpha1.ReasonRunning)
	e.waitOnNode(name, testenv.NodeName)

	const kept = `mkdir -p notes && echo "before the checkpoint" > notes/a.txt && head -c 262144 /dev/urandom > blob && sha256sum blob`
	digest := apiRun(t, e.ctx, api, agent, kept)
	wroteAt := time.Now()

	// The call was activity: within an interval or two a checkpoint is
	// begun and becomes the sandbox's snapshot, while it keeps serving.
	var ck v1alpha1.SandboxSnapshot
	e.eventually("a checkpoint taken after the files were written", func() error {
		if err := e.get(name, sbx); err != nil {
			return err
		}
		s := sbx.Status.Snapshot
		if s == nil || !s.Checkpoint || s.ReadyTime == nil || s.ReadyTime.Time.Before(wroteAt.Truncate(time.Second)) {
			return fmt.Errorf("status.snapshot %+v, pending %q", s, sbx.Status.PendingCheckpoint)
		}
		if sbx.Status.Phase != v1alpha1.SandboxPhaseRunning {
			return fmt.Errorf("phase %s during the checkpoint", sbx.Status.Phase)
		}
		ck = *s
		return nil
	})
	t.Logf("checkpoint %s ready %s after the write (%s, driver %s)", ck.Name, ck.ReadyTime.Sub(wroteAt).Round(time.Second), formatBytes(ck.SizeBytes), ck.Driver)
	e.wantEvent(EventCheckpointed, ck.Name)
	st, err := api.Status(e.ctx, agent)
	must(t, err)
	if st.Snapshot == nil || st.Snapshot.Name != ck.Name || !st.Snapshot.Checkpoint {
		t.Errorf("the Compute API's status shows snapshot %+v; want checkpoint %s", st.Snapshot, ck.Name)
	}

	// Two more calls, each followed by a checkpoint begun after it, whatever
	// the API's throttle of activity renewals let through; with
	// checkpointsKept 2 the oldest are pruned, from the status and from
	// the store.
	taken := []string{ck.Name}
	most := 0
	observe := func() error {
		if err := e.get(name, sbx); err != nil {
			return err
		}
		most = max(most, len(sbx.Status.Checkpoints))
		return nil
	}
	for i := 1; i <= 2; i++ {
		apiRun(t, e.ctx, api, agent, fmt.Sprintf("echo %d >> notes/calls", i))
		// Begin times are whole seconds: the next second is surely after.
		after := time.Now().Truncate(time.Second).Add(time.Second)
		e.eventually(fmt.Sprintf("a checkpoint begun after call %d", i), func() error {
			if err := observe(); err != nil {
				return err
			}
			last, s := sbx.Status.LastCheckpointTime, sbx.Status.Snapshot
			if sbx.Status.PendingCheckpoint != "" || last == nil || last.Time.Before(after) || s == nil || s.Name != checkpointName(name, last.Time) {
				return fmt.Errorf("status.snapshot %+v, pending %q, last begun %v", s, sbx.Status.PendingCheckpoint, last)
			}
			ck = *s
			return nil
		})
		taken = append(taken, ck.Name)
	}

	// No further checkpoint may take what comes next.
	must(t, e.c.Get(e.ctx, client.ObjectKeyFromObject(tpl), tpl))
	tpl.Spec.CheckpointInterval = &metav1.Duration{Duration: time.Hour}
	must(t, e.c.Update(e.ctx, tpl))
	e.eventually("no checkpoint under way", func() error {
		if err := observe(); err != nil {
			return err
		}
		if sbx.Status.PendingCheckpoint != "" {
			return fmt.Errorf("pending %q", sbx.Status.PendingCheckpoint)
		}
		return nil
	})
	ck = *sbx.Status.Snapshot
	var listed []string
	for _, c := range sbx.Status.Checkpoints {
		listed = append(listed, c.Name)
	}
	if most > checkpointsKept || len(listed) != checkpointsKept || listed[len(listed)-1] != ck.Name {
		t.Errorf("status.checkpoints %v (at most %d listed), snapshot %s; want the newest %d", listed, most, ck.Name, checkpointsKept)
	}
	// The controller deletes what a checkpoint supersedes before it
	// records the checkpoint, so the store is already pruned.
	keys := map[string]bool{}
	for o := range store.Client(t).ListObjects(e.ctx, store.Bucket, minio.ListObjectsOptions{Recursive: true}) {
		must(t, o.Err)
		keys[o.Key] = true
	}
	pruned := 0
	for _, n := range slices.Compact(slices.Sorted(slices.Values(append(taken, listed...)))) {
		want := slices.Contains(listed, n)
		if !want {
			pruned++
		}
		if k := d.Key(sbx, n); keys[k] != want {
			t.Errorf("archive %s of checkpoint %s in the store: %v, want %v (the store holds %v)", k, n, keys[k], want, slices.Sorted(maps.Keys(keys)))
		}
	}
	if pruned == 0 {
		t.Errorf("no checkpoint pruned: taken %v, kept %v", taken, listed)
	}
	t.Logf("checkpoints %v taken after the calls; %v kept, %d pruned", taken, listed, pruned)
	apiRun(t, e.ctx, api, agent, `echo "after the checkpoint" > notes/b.txt`)

	// The workspace goes with the pod, and the sandbox comes back on the
	// fake node, which is then lost.
	lost := nodes.add("kwok-ckpt")
	vols.on(lost, false)
	var claim corev1.PersistentVolumeClaim
	must(t, e.get(WorkspaceClaimName(name), &claim))
	must(t, e.c.Delete(e.ctx, &claim))
	var pod corev1.Pod
	must(t, e.get(PodName(name), &pod))
	must(t, e.c.Delete(e.ctx, &pod))
	e.waitOnNode(name, lost)
	nodes.lose(lost)
	sbx, _ = e.waitPhase(name, v1alpha1.SandboxPhaseError, v1alpha1.ReasonNodeLost)
	msg := readyMessage(sbx)
	for _, want := range []string{"node " + lost, "newest checkpoint " + ck.Name, "changes made after that checkpoint are lost"} {
		if !strings.Contains(msg, want) {
			t.Errorf("NodeLost message %q lacks %q", msg, want)
		}
	}
	e.wantEvent(EventNodeLost, "newest checkpoint "+ck.Name)

	// The next call resumes it on the real node, from the checkpoint.
	vols.on(testenv.NodeName, true)
	got := apiRun(t, e.ctx, api, agent, `cat notes/a.txt && sha256sum blob && cat notes/calls && if [ -e notes/b.txt ]; then echo "b.txt is there"; fi`)
	if want := "before the checkpoint\n" + digest + "\n1\n2"; got != want {
		t.Errorf("workspace after the resume from checkpoint %s:\n%s\nwant:\n%s", ck.Name, got, want)
	}
	e.wantEvent(EventResuming, "newest checkpoint "+ck.Name)
}

// wantEvent fails the test unless an event of reason whose message holds
// text was recorded in the test's namespace.
func (e *clusterEnv) wantEvent(reason, text string) {
	e.t.Helper()
	e.eventually("event "+reason+" naming "+text, func() error {
		var evs corev1.EventList
		if err := e.c.List(e.ctx, &evs, client.InNamespace(e.ns)); err != nil {
			return err
		}
		for _, ev := range evs.Items {
			if ev.Reason == reason && strings.Contains(ev.Message, text) {
				return nil
			}
		}
		return fmt.Errorf("none among %d events", len(evs.Items))
	})
}
