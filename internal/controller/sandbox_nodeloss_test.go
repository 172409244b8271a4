package controller

import (
	"context"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/rand"
	"k8s.io/client-go/kubernetes"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	"github.com/agentbox/terraform-provider-agentbox/internal/computeapi"
	apiclient "github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
	"github.com/agentbox/terraform-provider-agentbox/internal/snapshot/archive"
	"github.com/agentbox/terraform-provider-agentbox/internal/testenv"
	"github.com/agentbox/terraform-provider-agentbox/internal/testenv/kwok"
	"github.com/agentbox/terraform-provider-agentbox/internal/testenv/s3server"
)

// fakeNodes runs kwok for the test and registers its fake nodes: they look
// like any node to the scheduler and the controller, and can be deleted as
// a lost node is. Called before newClusterEnv, so that its cleanup (delete
// what is left of them, stop kwok) runs after the namespace's.
type fakeNodes struct {
	t  *testing.T
	cs kubernetes.Interface
}

func startFakeNodes(t *testing.T) *fakeNodes {
	t.Helper()
	cfg, kubeconfig := testenv.Shared(t)
	cs, err := kubernetes.NewForConfig(cfg)
	must(t, err)
	k, err := kwok.Start(t.Context(), kubeconfig, t.TempDir())
	must(t, err)
	f := &fakeNodes{t: t, cs: cs}
	t.Cleanup(func() {
		if err := k.Stop(); err != nil {
			t.Errorf("stop kwok: %v", err)
		}
		if t.Failed() {
			t.Logf("kwok log:\n%s", k.Log())
		}
	})
	return f
}

// add registers a fake node and returns its name.
func (f *fakeNodes) add(prefix string) string {
	f.t.Helper()
	name := prefix + "-" + rand.String(5)
	f.t.Cleanup(func() {
		if err := kwok.DeleteNode(context.Background(), f.cs, name); err != nil {
			f.t.Errorf("delete fake node %s: %v", name, err)
		}
	})
	if _, err := kwok.AddNode(f.t.Context(), f.cs, name, kwok.NodeOptions{Pods: 10}); err != nil {
		f.t.Fatal(err)
	}
	return name
}

// lose deletes the Node object, as the node lifecycle controller, an
// autoscaler or an operator does for a node that is gone for good.
func (f *fakeNodes) lose(name string) {
	f.t.Helper()
	if err := kwok.DeleteNode(f.t.Context(), f.cs, name); err != nil {
		f.t.Fatal(err)
	}
}

// workspaceVolumes hands out volumes of one StorageClass with no
// provisioner, each bound in advance to the sandbox's workspace claim.
// Node-local ones are pinned to one node: that is how the test decides
// which node the next pod of the sandbox lands on. Volumes on the real node
// are folders of the test that any user may write; those on fake nodes
// exist as API objects only.
type workspaceVolumes struct {
	e     *clusterEnv
	class string
	claim string
	n     int
}

const nodeLossWorkspaceSize = "64Mi"

func newWorkspaceVolumes(e *clusterEnv, claim string) *workspaceVolumes {
	e.t.Helper()
	class := "nodeloss-" + e.ns
	sc := &storagev1.StorageClass{
		ObjectMeta:        metav1.ObjectMeta{Name: class},
		Provisioner:       "kubernetes.io/no-provisioner",
		ReclaimPolicy:     ptr.To(corev1.PersistentVolumeReclaimRetain),
		VolumeBindingMode: ptr.To(storagev1.VolumeBindingImmediate),
	}
	must(e.t, e.c.Create(e.ctx, sc))
	e.t.Cleanup(func() { _ = e.c.Delete(context.Background(), sc) })
	return &workspaceVolumes{e: e, class: class, claim: claim}
}

// on creates the volume the sandbox's next workspace claim binds to, on
// node.
func (v *workspaceVolumes) on(node string, real bool) {
	v.e.t.Helper()
	path := "/fake-node/" + node + "/workspace"
	if real {
		path = v.folder()
	}
	v.create(path, &corev1.VolumeNodeAffinity{Required: &corev1.NodeSelector{NodeSelectorTerms: []corev1.NodeSelectorTerm{{
		MatchExpressions: []corev1.NodeSelectorRequirement{{Key: corev1.LabelHostname, Operator: corev1.NodeSelectorOpIn, Values: []string{node}}},
	}}}})
}

// shared creates a volume with no node affinity, as network storage has,
// for the sandbox's next workspace claim.
func (v *workspaceVolumes) shared() {
	v.e.t.Helper()
	v.create(v.folder(), nil)
}

// folder is a folder of the test on this machine, the real node.
func (v *workspaceVolumes) folder() string {
	path := v.e.t.TempDir()
	// The sandbox runs as a non-root user, and kubelet applies no fsGroup
	// to hostPath volumes.
	must(v.e.t, os.Chmod(path, 0o777))
	return path
}

func (v *workspaceVolumes) create(path string, affinity *corev1.VolumeNodeAffinity) {
	v.e.t.Helper()
	v.n++
	pv := &corev1.PersistentVolume{
		ObjectMeta: metav1.ObjectMeta{Name: fmt.Sprintf("%s-%d", v.class, v.n)},
		Spec: corev1.PersistentVolumeSpec{
			Capacity:                      corev1.ResourceList{corev1.ResourceStorage: resource.MustParse(nodeLossWorkspaceSize)},
			AccessModes:                   []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
			PersistentVolumeReclaimPolicy: corev1.PersistentVolumeReclaimRetain,
			StorageClassName:              v.class,
			ClaimRef:                      &corev1.ObjectReference{Kind: "PersistentVolumeClaim", APIVersion: "v1", Namespace: v.e.ns, Name: v.claim},
			PersistentVolumeSource: corev1.PersistentVolumeSource{
				HostPath: &corev1.HostPathVolumeSource{Path: path, Type: ptr.To(corev1.HostPathDirectory)},
			},
			NodeAffinity: affinity,
		},
	}
	must(v.e.t, v.e.c.Create(v.e.ctx, pv))
	v.e.t.Cleanup(func() { _ = v.e.c.Delete(context.Background(), pv) })
}

// waitOnNode waits until the sandbox's pod is ready on node and its status
// names that node, and returns the sandbox.
func (e *clusterEnv) waitOnNode(name, node string) *v1alpha1.Sandbox {
	e.t.Helper()
	var sbx v1alpha1.Sandbox
	e.eventually(fmt.Sprintf("sandbox %s's pod to be ready on node %s", name, node), func() error {
		var pod corev1.Pod
		if err := e.get(PodName(name), &pod); err != nil {
			return err
		}
		if pod.Spec.NodeName != node || !podReady(&pod) {
			return fmt.Errorf("pod on node %q, phase %s, ready %v", pod.Spec.NodeName, pod.Status.Phase, podReady(&pod))
		}
		if err := e.get(name, &sbx); err != nil {
			return err
		}
		if sbx.Status.NodeName != node {
			return fmt.Errorf("status.nodeName %q", sbx.Status.NodeName)
		}
		return nil
	})
	return &sbx
}

// wantNodeLost checks what a sandbox reports after losing node together
// with its node-local workspace, and that the pod and claim are gone.
func (e *clusterEnv) wantNodeLost(name, node, snap string) {
	e.t.Helper()
	sbx, _ := e.waitPhase(name, v1alpha1.SandboxPhaseError, v1alpha1.ReasonNodeLost)
	if loss := sbx.Status.NodeLoss; loss == nil || loss.NodeName != node || !loss.WorkspaceLost || loss.ActivityTime == nil {
		e.t.Errorf("status.nodeLoss %+v, want node %s and its workspace lost", loss, node)
	}
	msg := readyMessage(sbx)
	if !strings.Contains(msg, "node "+node) || !strings.Contains(msg, "last snapshot "+snap) {
		e.t.Errorf("NodeLost message %q does not name node %s and snapshot %s", msg, node, snap)
	}
	e.gone(&corev1.Pod{}, PodName(name))
	e.gone(&corev1.PersistentVolumeClaim{}, WorkspaceClaimName(name))
	var evs corev1.EventList
	must(e.t, e.c.List(e.ctx, &evs, client.InNamespace(e.ns)))
	for _, ev := range evs.Items {
		if ev.Reason == EventNodeLost && ev.Type == corev1.EventTypeWarning && strings.Contains(ev.Message, node) {
			return
		}
	}
	e.t.Errorf("no Warning event %s naming node %s", EventNodeLost, node)
}

func readyMessage(sbx *v1alpha1.Sandbox) string {
	for _, c := range sbx.Status.Conditions {
		if c.Type == v1alpha1.ConditionReady {
			return c.Message
		}
	}
	return ""
}

// s3Archive is an archive snapshot driver on the test's S3 store, closed
// when the test ends.
func s3Archive(t *testing.T, store *s3server.Server) *archive.Driver {
	t.Helper()
	d, err := archive.New(archive.Config{
		Endpoint: store.Endpoint, Bucket: store.Bucket, Region: store.Region,
		AccessKeyID: store.AccessKeyID, SecretAccessKey: store.SecretAccessKey,
	})
	must(t, err)
	t.Cleanup(d.Close)
	return d
}

// TestNodeLossResumesOnAnotherNode loses, twice, the node a sandbox is
// resuming on, with its workspace on that node's local storage: first
// while the controller watches (it sees the pod on the deleted node), then
// while the control plane is down, so that the pod garbage collector
// removes the pod before the controller is back (status.nodeName tells it
// where the sandbox ran). Each time the sandbox must end in Error/NodeLost,
// hold no node, and resume on the real node from its last snapshot with
// its files at the next call through the Compute API.
//
// The lost nodes are kwok's: the scheduler puts the pod there because its
// workspace volume is pinned there, and kwok reports the pod ready. No
// supervisor answers there, so the resume onto the fake node never
// finishes its restore: the loss comes while the sandbox is Resuming.
func TestNodeLossResumesOnAnotherNode(t *testing.T) {
	t.Parallel()
	image := os.Getenv(EnvSandboxImage)
	if image == "" {
		t.Skipf("%s is not set: the resume needs the real sandbox image's supervisor", EnvSandboxImage)
	}
	nodes := startFakeNodes(t)
	store := s3server.Start(t)
	newArchive := func() *archive.Driver { return s3Archive(t, store) }
	var pool *computeapi.SupervisorPool
	e := newClusterEnv(t, withSnapshots(t, newArchive(), &pool))
	const name = "lost"
	vols := newWorkspaceVolumes(e, WorkspaceClaimName(name))
	e.template("tpl", func(tpl *v1alpha1.SandboxTemplate) {
		tpl.Spec.Image = image
		// Longer than the test: only setActivity makes the sandbox idle.
		tpl.Spec.IdleTimeout = metav1.Duration{Duration: time.Hour}
		tpl.Spec.Workspace = v1alpha1.WorkspaceSpec{Size: resource.MustParse(nodeLossWorkspaceSize), StorageClassName: &vols.class}
		// Lets the pod onto the fake nodes; where it goes is the volume's
		// choice.
		tpl.Spec.Tolerations = []corev1.Toleration{kwok.Toleration()}
	})
	vols.on(testenv.NodeName, true)
	sbx := e.sandbox(name, "tpl")
	agent := sbx.Spec.AgentID
	api := e.computeAPI(pool)

	e.waitPhase(name, v1alpha1.SandboxPhaseRunning, v1alpha1.ReasonRunning)
	e.waitOnNode(name, testenv.NodeName)
	const write = `mkdir -p notes && echo "written before the node was lost" > notes/a.txt && head -c 1048576 /dev/urandom > blob`
	const digest = `cat notes/a.txt && sha256sum blob`
	before := apiRun(t, e.ctx, api, agent, write+" && "+digest)

	// An idle stop puts the files in a snapshot.
	e.setActivity(name, time.Now().Add(-2*time.Hour))
	sbx, _ = e.waitPhase(name, v1alpha1.SandboxPhaseStopped, v1alpha1.ReasonStopped)
	snap := sbx.Status.Snapshot.Name

	// Activity resumes it onto a fake node, where its new workspace
	// volume is; that node is then deleted.
	lostA := nodes.add("kwok-lost-a")
	vols.on(lostA, false)
	e.setActivity(name, time.Now())
	if got := e.waitOnNode(name, lostA); got.Status.Phase != v1alpha1.SandboxPhaseResuming {
		// The restore cannot reach a supervisor on the fake node, so the
		// reason may be Resuming or ReconcileError; the phase stays.
		t.Fatalf("on the fake node: phase %s, want Resuming", got.Status.Phase)
	}
	lostAt := time.Now()
	nodes.lose(lostA)
	e.wantNodeLost(name, lostA, snap)
	t.Logf("node %s deleted: Error/NodeLost after %s", lostA, time.Since(lostAt).Round(time.Millisecond))

	// The next call resumes it on the real node, from the snapshot.
	vols.on(testenv.NodeName, true)
	callAt := time.Now()
	if after := apiRun(t, e.ctx, api, agent, digest); after != before {
		t.Errorf("workspace after the resume on another node:\n%s\nwant:\n%s", after, before)
	}
	t.Logf("the call that resumed it on %s took %s", testenv.NodeName, time.Since(callAt).Round(time.Millisecond))
	sbx = e.waitOnNode(name, testenv.NodeName)
	if sbx.Status.Phase != v1alpha1.SandboxPhaseRunning || sbx.Status.NodeLoss != nil {
		t.Errorf("after the resume: phase %s, nodeLoss %+v", sbx.Status.Phase, sbx.Status.NodeLoss)
	}

	// Again, with the control plane down while the node goes: the pod
	// garbage collector removes the pod of the deleted node first.
	e.setActivity(name, time.Now().Add(-2*time.Hour))
	sbx, _ = e.waitPhase(name, v1alpha1.SandboxPhaseStopped, v1alpha1.ReasonStopped)
	snap = sbx.Status.Snapshot.Name
	lostB := nodes.add("kwok-lost-b")
	vols.on(lostB, false)
	e.setActivity(name, time.Now())
	e.waitOnNode(name, lostB)
	e.stop()
	lostAt = time.Now()
	nodes.lose(lostB)
	e.gone(&corev1.Pod{}, PodName(name))
	t.Logf("node %s deleted with the control plane down: the pod garbage collector removed the pod after %s",
		lostB, time.Since(lostAt).Round(time.Millisecond))
	e.startManager(withSnapshots(t, newArchive(), &pool))
	e.wantNodeLost(name, lostB, snap)

	vols.on(testenv.NodeName, true)
	api = e.computeAPI(pool)
	if after := apiRun(t, e.ctx, api, agent, digest); after != before {
		t.Errorf("workspace after the second resume on another node:\n%s\nwant:\n%s", after, before)
	}
	e.waitOnNode(name, testenv.NodeName)
}

// apiRun runs script in the agent's sandbox through the Compute API and
// returns its trimmed output; it fails the test unless the call and the
// script succeed.
func apiRun(t *testing.T, ctx context.Context, api *apiclient.Client, agent, script string) string {
	t.Helper()
	res, err := api.RunCommand(ctx, agent, apiclient.RunCommandRequest{Command: []string{"sh", "-c", script}})
	if err != nil {
		t.Fatalf("run_command %q: %v", script, err)
	}
	if res.ExitCode != 0 {
		t.Fatalf("%s: exit %d: %s", script, res.ExitCode, res.Stderr)
	}
	return strings.TrimSpace(res.Stdout)
}

// TestNodeLossKeepsNetworkWorkspace loses the node a sandbox runs on when
// its workspace volume is not tied to that node: the claim is kept, and
// the next call through the Compute API starts the sandbox on another node
// with the files the agent wrote, from the claim itself (there is no
// snapshot driver, so nothing else could hold them).
//
// The stand-in for network storage is a hostPath volume of this machine
// with no node affinity: like a network volume, the scheduler and the
// controller take it to be mountable on any node, and on this one-machine
// cluster the real node and the fake one do reach the same folder. The
// sandbox is moved onto the fake node the way a drain moves it: its
// template now selects that node, and its pod is deleted.
//
// Not parallel: every kwok process plays the kubelet of every fake node,
// so this test and TestNodeLossResumesOnAnotherNode, each with its own
// kwok, do not run at once.
func TestNodeLossKeepsNetworkWorkspace(t *testing.T) {
	image := os.Getenv(EnvSandboxImage)
	if image == "" {
		t.Skipf("%s is not set: the sandbox must run the real supervisor", EnvSandboxImage)
	}
	nodes := startFakeNodes(t)
	var pool *computeapi.SupervisorPool
	e := newClusterEnv(t, withSnapshots(t, nil, &pool))
	const name = "net"
	vols := newWorkspaceVolumes(e, WorkspaceClaimName(name))
	vols.shared()
	tpl := e.template("tpl", func(tpl *v1alpha1.SandboxTemplate) {
		tpl.Spec.Image = image
		tpl.Spec.Workspace = v1alpha1.WorkspaceSpec{Size: resource.MustParse(nodeLossWorkspaceSize), StorageClassName: &vols.class}
		tpl.Spec.Tolerations = []corev1.Toleration{kwok.Toleration()}
		tpl.Spec.NodeSelector = map[string]string{corev1.LabelHostname: testenv.NodeName}
	})
	sbx := e.sandbox(name, "tpl")
	agent := sbx.Spec.AgentID
	api := e.computeAPI(pool)
	e.waitPhase(name, v1alpha1.SandboxPhaseRunning, v1alpha1.ReasonRunning)
	e.waitOnNode(name, testenv.NodeName)
	const digest = `cat notes/a.txt && sha256sum blob`
	before := apiRun(t, e.ctx, api, agent,
		`mkdir -p notes && echo "kept on network storage" > notes/a.txt && head -c 1048576 /dev/urandom > blob && `+digest)
	var claim corev1.PersistentVolumeClaim
	must(t, e.get(WorkspaceClaimName(name), &claim))

	lost := nodes.add("kwok-net")
	e.selectNodes(tpl, map[string]string{corev1.LabelHostname: lost})
	var pod corev1.Pod
	must(t, e.get(PodName(name), &pod))
	must(t, e.c.Delete(e.ctx, &pod))
	e.waitOnNode(name, lost)
	e.waitPhase(name, v1alpha1.SandboxPhaseRunning, v1alpha1.ReasonRunning)

	e.selectNodes(tpl, map[string]string{corev1.LabelHostname: testenv.NodeName})
	nodes.lose(lost)
	sbx, _ = e.waitPhase(name, v1alpha1.SandboxPhaseError, v1alpha1.ReasonNodeLost)
	if loss := sbx.Status.NodeLoss; loss == nil || loss.NodeName != lost || loss.WorkspaceLost {
		t.Errorf("status.nodeLoss %+v, want node %s with its workspace kept", loss, lost)
	}
	if msg := readyMessage(sbx); !strings.Contains(msg, "is kept") {
		t.Errorf("NodeLost message %q does not say the workspace is kept", msg)
	}
	e.gone(&corev1.Pod{}, PodName(name))
	var kept corev1.PersistentVolumeClaim
	if err := e.get(WorkspaceClaimName(name), &kept); err != nil || kept.UID != claim.UID || !kept.DeletionTimestamp.IsZero() {
		t.Fatalf("the workspace claim on network storage was not kept: %v", err)
	}

	if after := apiRun(t, e.ctx, api, agent, digest); after != before {
		t.Errorf("workspace after the resume on another node:\n%s\nwant:\n%s", after, before)
	}
	e.waitOnNode(name, testenv.NodeName)
	must(t, e.get(WorkspaceClaimName(name), &kept))
	if kept.UID != claim.UID {
		t.Error("the sandbox resumed on a new claim, not the kept one")
	}
}

// selectNodes sets the template's node selector, which the sandbox's next
// pod is created with.
func (e *clusterEnv) selectNodes(tpl *v1alpha1.SandboxTemplate, sel map[string]string) {
	e.t.Helper()
	must(e.t, e.get(tpl.Name, tpl))
	patch := client.MergeFrom(tpl.DeepCopy())
	tpl.Spec.NodeSelector = sel
	must(e.t, e.c.Patch(e.ctx, tpl, patch))
}
