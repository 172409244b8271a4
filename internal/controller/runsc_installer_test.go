package controller

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	nodev1 "k8s.io/api/node/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/kubernetes"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/controller/controllerutil"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	"github.com/agentbox/terraform-provider-agentbox/internal/chart"
	"github.com/agentbox/terraform-provider-agentbox/internal/testenv/toolchain"
)

// EnvImageTag names the tag of the platform images `make test` built and
// imported into the test node, the runsc installer's among them.
const EnvImageTag = "AGENTBOX_TEST_IMAGE_TAG"

// TestRunscInstallerDaemonSet runs the chart's runsc installer DaemonSet,
// rendered from the real chart, on the test node: a Managed pool labels the
// node, the DaemonSet's pod runs there, and its init container puts the
// image's runsc and shim into a host folder, byte for byte the toolchain's
// (which the image was built from). A restarted pod then finds them up to
// date and leaves the files alone.
//
// hostBinDir is a folder of this test on the node (the node is this
// machine), never a system folder. The test is not parallel: while it runs,
// the node carries its pool's label, which parallel pool tests would see.
func TestRunscInstallerDaemonSet(t *testing.T) {
	tag := os.Getenv(EnvImageTag)
	if tag == "" {
		if os.Getenv("CI") != "" {
			t.Fatalf("%s is not set: `make test` builds and imports the platform images", EnvImageTag)
		}
		t.Skipf("needs the runsc installer image on the test node: run `make test` (sets %s)", EnvImageTag)
	}
	binDir, err := toolchain.DefaultDir()
	must(t, err)
	binDir = toolchain.BinDir(binDir)
	// Created before the cluster env, so it is removed after the namespace
	// and the pool are gone.
	hostBinDir := filepath.Join(t.TempDir(), "bin")
	must(t, os.Mkdir(hostBinDir, 0o755))

	e := newClusterEnv(t)
	node := testNode(e)
	suffix := strings.TrimPrefix(e.ns, "ctrl-")
	poolName, rcName, taintKey := "ri-"+suffix, "gvisor-ri-"+suffix, "agentbox.test/ri-"+suffix

	// The pod runs as root with a hostPath: not allowed by the restricted
	// or baseline Pod Security Standards, so the namespace says privileged,
	// as the installer's own namespace, which the chart creates, does.
	var ns corev1.Namespace
	must(t, e.c.Get(e.ctx, types.NamespacedName{Name: e.ns}, &ns))
	patch := client.MergeFrom(ns.DeepCopy())
	if ns.Labels == nil {
		ns.Labels = map[string]string{}
	}
	ns.Labels["pod-security.kubernetes.io/enforce"] = "privileged"
	must(t, e.c.Patch(e.ctx, &ns, patch))

	ds := renderInstaller(t, e.ns, tag, hostBinDir)

	// As in TestNodePoolManaged: registered before the controller starts,
	// so it runs after the controller has stopped.
	t.Cleanup(func() {
		ctx := context.Background()
		_ = client.IgnoreNotFound(e.c.Delete(ctx, ds))
		var p v1alpha1.GVisorNodePool
		if err := e.c.Get(ctx, types.NamespacedName{Name: poolName}, &p); err == nil {
			patch := client.MergeFrom(p.DeepCopy())
			controllerutil.RemoveFinalizer(&p, v1alpha1.Finalizer)
			_ = e.c.Patch(ctx, &p, patch)
			_ = e.c.Delete(ctx, &p)
		}
		_ = client.IgnoreNotFound(e.c.Delete(ctx, &nodev1.RuntimeClass{ObjectMeta: metav1.ObjectMeta{Name: rcName}}))
		if err := restoreNode(e.c, node.Name, poolName, taintKey); err != nil {
			t.Errorf("restore node %s: %v", node.Name, err)
		}
	})
	startNodePoolController(e)

	start := time.Now()
	must(t, e.c.Create(e.ctx, ds))
	// The taint is the pool's own and only PreferNoSchedule, so that it
	// keeps no other test's pod off the shared node; the installer
	// tolerates every taint anyway.
	taint := corev1.Taint{Key: taintKey, Value: "true", Effect: corev1.TaintEffectPreferNoSchedule}
	pool := &v1alpha1.GVisorNodePool{
		ObjectMeta: metav1.ObjectMeta{Name: poolName},
		Spec: v1alpha1.GVisorNodePoolSpec{
			Mode:             v1alpha1.GVisorNodePoolModeManaged,
			RuntimeClassName: rcName,
			NodeSelector:     map[string]string{corev1.LabelHostname: node.Labels[corev1.LabelHostname]},
			Taint:            &taint,
		},
	}
	must(t, e.c.Create(e.ctx, pool))
	e.eventually("the node to carry the pool's label", func() error {
		var n corev1.Node
		if err := e.c.Get(e.ctx, types.NamespacedName{Name: node.Name}, &n); err != nil {
			return err
		}
		if got := n.Labels[v1alpha1.LabelNodePool]; got != poolName {
			return fmt.Errorf("node label %s=%q", v1alpha1.LabelNodePool, got)
		}
		return nil
	})
	t.Logf("node labelled by pool %s after %s", poolName, time.Since(start).Round(time.Millisecond))

	pod := e.waitInstallerRunning(ds, "")
	t.Logf("installer pod %s Running after %s (install container ran %s)", pod.Name, time.Since(start).Round(time.Millisecond), initDuration(pod))
	t.Logf("install log:\n%s", e.installLog(pod))
	if pod.Spec.NodeName != node.Name {
		t.Errorf("installer pod on node %q, want %q", pod.Spec.NodeName, node.Name)
	}

	inodes := map[string]uint64{}
	for _, f := range []string{"runsc", "containerd-shim-runsc-v1"} {
		want, err := os.ReadFile(filepath.Join(binDir, f))
		must(t, err)
		p := filepath.Join(hostBinDir, f)
		got, err := os.ReadFile(p)
		if err != nil {
			t.Errorf("%s: %v", f, err)
			continue
		}
		if !bytes.Equal(got, want) {
			t.Errorf("%s is %d bytes, not the toolchain's %d", p, len(got), len(want))
		}
		fi, err := os.Stat(p)
		must(t, err)
		if fi.Mode().Perm() != 0o755 {
			t.Errorf("%s mode %s, want 0755", p, fi.Mode())
		}
		inodes[f] = fi.Sys().(*syscall.Stat_t).Ino
		t.Logf("%s: %.1f MB, identical to the toolchain's", p, float64(len(got))/1e6)
	}
	if entries, err := os.ReadDir(hostBinDir); err != nil || len(entries) != 2 {
		t.Errorf("host folder holds %d entries (%v), want just the two binaries", len(entries), err)
	}
	out, err := exec.CommandContext(e.ctx, filepath.Join(hostBinDir, "runsc"), "--version").CombinedOutput()
	if err != nil || !strings.Contains(string(out), "runsc version") {
		t.Errorf("installed runsc --version: %v\n%s", err, out)
	}
	t.Logf("installed runsc --version: %s", strings.ReplaceAll(strings.TrimSpace(string(out)), "\n", "; "))

	// A restarted pod (node reboot, DaemonSet update) installs again: the
	// files are up to date, so it must not touch them.
	restart := time.Now()
	must(t, e.c.Delete(e.ctx, pod, client.GracePeriodSeconds(0)))
	again := e.waitInstallerRunning(ds, pod.UID)
	t.Logf("replacement pod %s Running after %s", again.Name, time.Since(restart).Round(time.Millisecond))
	log := e.installLog(again)
	if strings.Contains(log, "installed ") || strings.Count(log, "is up to date") != 2 {
		t.Errorf("second install changed files:\n%s", log)
	}
	for f, ino := range inodes {
		fi, err := os.Stat(filepath.Join(hostBinDir, f))
		if err != nil || fi.Sys().(*syscall.Stat_t).Ino != ino {
			t.Errorf("%s replaced by the second install (%v)", f, err)
		}
	}
}

// renderInstaller renders the chart as a release in namespace with the
// installer enabled, in that same namespace (the test's, labelled
// privileged) rather than one of its own, and returns its DaemonSet. The
// pull policy is Never:
// the image must be the one imported into the node, and a missing one must
// fail here rather than be looked for in a registry.
func renderInstaller(t *testing.T, namespace, tag, hostBinDir string) *appsv1.DaemonSet {
	t.Helper()
	rel, err := chart.RenderInstall(namespace, chart.DefaultReleaseName, chart.Values{
		ImageTag: tag,
		Raw: fmt.Sprintf("runscInstaller: {enabled: true, namespace: %q, createNamespace: false, hostBinDir: %q, image: {pullPolicy: Never}}",
			namespace, hostBinDir),
	})
	must(t, err)
	dec := utilyaml.NewYAMLOrJSONDecoder(strings.NewReader(rel.Manifest), 4096)
	for {
		var ds appsv1.DaemonSet
		if err := dec.Decode(&ds); errors.Is(err, io.EOF) {
			break
		} else if err != nil {
			t.Fatalf("reading the rendered chart: %v", err)
		}
		if ds.Kind == "DaemonSet" && ds.Name == "agentbox-runsc-installer" {
			return &ds
		}
	}
	t.Fatal("the chart rendered no runsc installer DaemonSet")
	return nil
}

// waitInstallerRunning waits for a Running pod of ds other than the one
// with UID not, and returns it.
func (e *clusterEnv) waitInstallerRunning(ds *appsv1.DaemonSet, not types.UID) *corev1.Pod {
	e.t.Helper()
	var found *corev1.Pod
	e.eventually("the installer pod to be Running", func() error {
		var pods corev1.PodList
		if err := e.c.List(e.ctx, &pods, client.InNamespace(e.ns), client.MatchingLabels(ds.Spec.Selector.MatchLabels)); err != nil {
			return err
		}
		var states []string
		for i := range pods.Items {
			p := &pods.Items[i]
			if p.UID == not || p.DeletionTimestamp != nil {
				continue
			}
			if p.Status.Phase == corev1.PodFailed {
				e.t.Fatalf("installer pod %s failed: %+v\nlog:\n%s", p.Name, p.Status.InitContainerStatuses, e.installLog(p))
			}
			for _, s := range p.Status.InitContainerStatuses {
				if s.LastTerminationState.Terminated != nil && s.LastTerminationState.Terminated.ExitCode != 0 {
					e.t.Fatalf("install container of %s failed: %+v\nlog:\n%s", p.Name, s.LastTerminationState.Terminated, e.installLog(p))
				}
			}
			if p.Status.Phase == corev1.PodRunning {
				found = p
				return nil
			}
			states = append(states, fmt.Sprintf("%s %s %+v", p.Name, p.Status.Phase, p.Status.InitContainerStatuses))
		}
		var d appsv1.DaemonSet
		if err := e.c.Get(e.ctx, client.ObjectKeyFromObject(ds), &d); err != nil {
			return err
		}
		return fmt.Errorf("DaemonSet desired %d, current %d; pods: %v", d.Status.DesiredNumberScheduled, d.Status.CurrentNumberScheduled, states)
	})
	return found
}

// installLog is the install container's output.
func (e *clusterEnv) installLog(p *corev1.Pod) string {
	cs, err := kubernetes.NewForConfig(e.cfg)
	if err != nil {
		return err.Error()
	}
	b, err := cs.CoreV1().Pods(p.Namespace).GetLogs(p.Name, &corev1.PodLogOptions{Container: "install"}).Do(e.ctx).Raw()
	if err != nil {
		return fmt.Sprintf("(no log: %v)", err)
	}
	return strings.TrimSpace(string(b))
}

func initDuration(p *corev1.Pod) string {
	for _, s := range p.Status.InitContainerStatuses {
		if s.Name == "install" && s.State.Terminated != nil {
			return s.State.Terminated.FinishedAt.Sub(s.State.Terminated.StartedAt.Time).String()
		}
	}
	return "unknown"
}
