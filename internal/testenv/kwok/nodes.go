package kwok

import (
	"context"
	"fmt"
	"runtime"
	"time"

	corev1 "k8s.io/api/core/v1"
	nodev1 "k8s.io/api/node/v1"
	storagev1 "k8s.io/api/storage/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
	"k8s.io/utils/ptr"
)

// The annotation kwok is started to manage nodes by.
const (
	ManageAnnotation      = "kwok.x-k8s.io/node"
	ManageAnnotationValue = "fake"
)

// NodeLabel marks the fake nodes; it is also the key of their taint, so a
// pod needs both NodeSelector and Toleration to land there.
const (
	NodeLabel      = "agentbox.dev/bench-node"
	NodeLabelValue = "kwok"
)

// StorageClass is the class whose claims kwok's volume stages bind, to
// volumes that exist only as API objects. The name is fixed by those stages.
const (
	StorageClass       = "kwok-volume"
	storageProvisioner = "kwok.x-k8s.io/volume"
)

// NodeSelector selects the fake nodes.
func NodeSelector() map[string]string { return map[string]string{NodeLabel: NodeLabelValue} }

// Toleration lets a pod onto the fake nodes.
func Toleration() corev1.Toleration {
	return corev1.Toleration{Key: NodeLabel, Operator: corev1.TolerationOpEqual, Value: NodeLabelValue, Effect: corev1.TaintEffectNoSchedule}
}

// NodeOptions size a fake node; zero values take the defaults.
type NodeOptions struct {
	// Pods is the pods capacity (default 2000).
	Pods int
	// CPU and Memory are its capacity and allocatable (default 1000 cores,
	// 4Ti): far beyond what any test asks for.
	CPU, Memory string
}

// AddNode registers a fake node that kwok manages, and waits until it is
// Ready. It is labelled and tainted with NodeLabel, so that only pods that
// select and tolerate it run there.
func AddNode(ctx context.Context, cs kubernetes.Interface, name string, opts NodeOptions) (*corev1.Node, error) {
	if opts.Pods == 0 {
		opts.Pods = 2000
	}
	if opts.CPU == "" {
		opts.CPU = "1000"
	}
	if opts.Memory == "" {
		opts.Memory = "4Ti"
	}
	cpu, err := resource.ParseQuantity(opts.CPU)
	if err != nil {
		return nil, fmt.Errorf("cpu %q: %w", opts.CPU, err)
	}
	mem, err := resource.ParseQuantity(opts.Memory)
	if err != nil {
		return nil, fmt.Errorf("memory %q: %w", opts.Memory, err)
	}
	capacity := corev1.ResourceList{
		corev1.ResourceCPU:    cpu,
		corev1.ResourceMemory: mem,
		corev1.ResourcePods:   *resource.NewQuantity(int64(opts.Pods), resource.DecimalSI),
	}
	node := &corev1.Node{
		ObjectMeta: metav1.ObjectMeta{
			Name:        name,
			Annotations: map[string]string{ManageAnnotation: ManageAnnotationValue},
			Labels: map[string]string{
				NodeLabel:              NodeLabelValue,
				corev1.LabelHostname:   name,
				corev1.LabelOSStable:   "linux",
				corev1.LabelArchStable: runtime.GOARCH,
			},
		},
		Spec: corev1.NodeSpec{Taints: []corev1.Taint{{Key: NodeLabel, Value: NodeLabelValue, Effect: corev1.TaintEffectNoSchedule}}},
		// node-initialize keeps a status that is already there.
		Status: corev1.NodeStatus{Capacity: capacity, Allocatable: capacity.DeepCopy()},
	}
	if _, err := cs.CoreV1().Nodes().Create(ctx, node, metav1.CreateOptions{}); err != nil {
		return nil, fmt.Errorf("create node %s: %w", name, err)
	}
	var ready *corev1.Node
	err = wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, time.Minute, true, func(ctx context.Context) (bool, error) {
		n, err := cs.CoreV1().Nodes().Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return false, nil
		}
		for _, c := range n.Status.Conditions {
			if c.Type == corev1.NodeReady && c.Status == corev1.ConditionTrue {
				ready = n
				return true, nil
			}
		}
		return false, nil
	})
	if err != nil {
		return nil, fmt.Errorf("node %s did not become Ready (is kwok running?): %w", name, err)
	}
	return ready, nil
}

// DeleteNode deletes a fake node and waits until it is gone. Pods still
// bound to it are garbage-collected by kube-controller-manager.
func DeleteNode(ctx context.Context, cs kubernetes.Interface, name string) error {
	if err := cs.CoreV1().Nodes().Delete(ctx, name, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
		return fmt.Errorf("delete node %s: %w", name, err)
	}
	return wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, time.Minute, true, func(ctx context.Context) (bool, error) {
		_, err := cs.CoreV1().Nodes().Get(ctx, name, metav1.GetOptions{})
		return apierrors.IsNotFound(err), nil
	})
}

// EnsureStorageClass creates StorageClass, which kwok's volume stages
// serve. It is never the default class.
func EnsureStorageClass(ctx context.Context, cs kubernetes.Interface) error {
	sc := &storagev1.StorageClass{
		ObjectMeta:        metav1.ObjectMeta{Name: StorageClass},
		Provisioner:       storageProvisioner,
		ReclaimPolicy:     ptr.To(corev1.PersistentVolumeReclaimDelete),
		VolumeBindingMode: ptr.To(storagev1.VolumeBindingImmediate),
	}
	if _, err := cs.StorageV1().StorageClasses().Create(ctx, sc, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		return fmt.Errorf("create StorageClass %s: %w", StorageClass, err)
	}
	return nil
}

// EnsureRuntimeClass creates a RuntimeClass whose scheduling puts its pods
// on the fake nodes: the API server adds NodeSelector and Toleration to
// every pod that names it. That reaches pods whose owner offers no way to
// set tolerations.
func EnsureRuntimeClass(ctx context.Context, cs kubernetes.Interface, name string) error {
	rc := &nodev1.RuntimeClass{
		ObjectMeta: metav1.ObjectMeta{Name: name},
		// kwok starts no containers; runsc is what the pods would run with
		// on a real gVisor node.
		Handler: "runsc",
		Scheduling: &nodev1.Scheduling{
			NodeSelector: NodeSelector(),
			Tolerations:  []corev1.Toleration{Toleration()},
		},
	}
	if _, err := cs.NodeV1().RuntimeClasses().Create(ctx, rc, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		return fmt.Errorf("create RuntimeClass %s: %w", name, err)
	}
	return nil
}
