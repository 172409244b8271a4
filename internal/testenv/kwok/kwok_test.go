package kwok_test

import (
	"context"
	"fmt"
	"net"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/rand"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
	"k8s.io/utils/ptr"

	"github.com/agentbox/terraform-provider-agentbox/internal/testenv"
	"github.com/agentbox/terraform-provider-agentbox/internal/testenv/kwok"
	"github.com/agentbox/terraform-provider-agentbox/internal/testenv/toolchain"
)

// TestFakeNodeRunsPod starts kwok on the shared cluster, registers a fake
// node, and runs a pod with a claim there: the scheduler places it, kwok
// binds the claim and makes the pod Running, and deleting them and the node
// leaves nothing behind.
func TestFakeNodeRunsPod(t *testing.T) {
	cfg, kubeconfig := testenv.Shared(t) // skips without a cluster, before kwok is built
	cs, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	// A cold build of kwok takes minutes, longer on a busy machine.
	ctx, cancel := context.WithTimeout(context.Background(), 25*time.Minute)
	defer cancel()

	t0 := time.Now()
	in, err := kwok.Ensure(ctx, "", t.Logf)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("kwok %s ready in %s: %s", kwok.Version, time.Since(t0).Round(time.Millisecond), in.Binary)
	k, err := in.Start(ctx, kubeconfig, t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := k.Stop(); err != nil {
			t.Error(err)
		}
		if t.Failed() {
			t.Logf("kwok log:\n%s", k.Log())
		}
	})

	nodeName := "kwok-test-" + rand.String(5)
	t1 := time.Now()
	node, err := kwok.AddNode(ctx, cs, nodeName, kwok.NodeOptions{})
	if err != nil {
		t.Fatal(err)
	}
	nodeGone := false
	t.Cleanup(func() {
		if !nodeGone {
			_ = kwok.DeleteNode(context.Background(), cs, nodeName)
		}
	})
	t.Logf("node %s Ready after %s", nodeName, time.Since(t1).Round(time.Millisecond))
	if got := node.Status.Allocatable.Pods().Value(); got != 2000 {
		t.Errorf("node allocatable pods %d, want 2000", got)
	}
	if !hasTaint(node, kwok.NodeLabel) {
		t.Errorf("node taints %v, want %s", node.Spec.Taints, kwok.NodeLabel)
	}

	if err := kwok.EnsureStorageClass(ctx, cs); err != nil {
		t.Fatal(err)
	}
	ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{GenerateName: "kwok-test-"}}
	ns, err = cs.CoreV1().Namespaces().Create(ctx, ns, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = cs.CoreV1().Namespaces().Delete(context.Background(), ns.Name, metav1.DeleteOptions{})
	})

	claim := &corev1.PersistentVolumeClaim{
		ObjectMeta: metav1.ObjectMeta{Name: "data", Namespace: ns.Name},
		Spec: corev1.PersistentVolumeClaimSpec{
			StorageClassName: ptr.To(kwok.StorageClass),
			AccessModes:      []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
			Resources:        corev1.VolumeResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("1Gi")}},
		},
	}
	if _, err := cs.CoreV1().PersistentVolumeClaims(ns.Name).Create(ctx, claim, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "p", Namespace: ns.Name},
		Spec: corev1.PodSpec{
			NodeSelector: kwok.NodeSelector(),
			Tolerations:  []corev1.Toleration{kwok.Toleration()},
			Containers:   []corev1.Container{{Name: "c", Image: toolchain.PauseImage}},
			Volumes: []corev1.Volume{{Name: "data", VolumeSource: corev1.VolumeSource{
				PersistentVolumeClaim: &corev1.PersistentVolumeClaimVolumeSource{ClaimName: claim.Name},
			}}},
		},
	}
	t2 := time.Now()
	if _, err := cs.CoreV1().Pods(ns.Name).Create(ctx, pod, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	var running *corev1.Pod
	if err := wait.PollUntilContextTimeout(ctx, 100*time.Millisecond, 2*time.Minute, true, func(ctx context.Context) (bool, error) {
		p, err := cs.CoreV1().Pods(ns.Name).Get(ctx, pod.Name, metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		running = p
		return p.Status.Phase == corev1.PodRunning, nil
	}); err != nil {
		t.Fatalf("pod not Running: %v; status %+v", err, running.Status)
	}
	t.Logf("pod Running on %s after %s, IP %s", running.Spec.NodeName, time.Since(t2).Round(time.Millisecond), running.Status.PodIP)
	if running.Spec.NodeName != nodeName {
		t.Errorf("pod on node %q, want %q", running.Spec.NodeName, nodeName)
	}
	_, cidr, _ := net.ParseCIDR(kwok.PodCIDR)
	if ip := net.ParseIP(running.Status.PodIP); ip == nil || !cidr.Contains(ip) {
		t.Errorf("pod IP %q outside %s", running.Status.PodIP, kwok.PodCIDR)
	}
	bound, err := cs.CoreV1().PersistentVolumeClaims(ns.Name).Get(ctx, claim.Name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if bound.Status.Phase != corev1.ClaimBound || bound.Spec.VolumeName == "" {
		t.Errorf("claim %s/%s, want Bound", bound.Status.Phase, bound.Spec.VolumeName)
	}

	// kwok's pod-delete stage finishes a graceful delete, as a kubelet does.
	if err := cs.CoreV1().Pods(ns.Name).Delete(ctx, pod.Name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := waitGone(ctx, func(ctx context.Context) error {
		_, err := cs.CoreV1().Pods(ns.Name).Get(ctx, pod.Name, metav1.GetOptions{})
		return err
	}); err != nil {
		t.Fatalf("pod not deleted: %v", err)
	}
	if err := cs.CoreV1().PersistentVolumeClaims(ns.Name).Delete(ctx, claim.Name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := waitGone(ctx, func(ctx context.Context) error {
		_, err := cs.CoreV1().PersistentVolumes().Get(ctx, bound.Spec.VolumeName, metav1.GetOptions{})
		return err
	}); err != nil {
		t.Fatalf("volume %s not deleted: %v", bound.Spec.VolumeName, err)
	}

	if err := kwok.DeleteNode(ctx, cs, nodeName); err != nil {
		t.Fatal(err)
	}
	nodeGone = true
}

func hasTaint(n *corev1.Node, key string) bool {
	for _, t := range n.Spec.Taints {
		if t.Key == key && t.Effect == corev1.TaintEffectNoSchedule {
			return true
		}
	}
	return false
}

func waitGone(ctx context.Context, get func(context.Context) error) error {
	var last error
	err := wait.PollUntilContextTimeout(ctx, 100*time.Millisecond, time.Minute, true, func(ctx context.Context) (bool, error) {
		last = get(ctx)
		return apierrors.IsNotFound(last), nil
	})
	if err != nil {
		return fmt.Errorf("%w (last: %v)", err, last)
	}
	return nil
}
