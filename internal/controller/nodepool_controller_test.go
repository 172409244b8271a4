package controller

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/go-logr/logr/funcr"
	corev1 "k8s.io/api/core/v1"
	nodev1 "k8s.io/api/node/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/util/retry"
	"k8s.io/utils/ptr"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/config"
	"sigs.k8s.io/controller-runtime/pkg/controller/controllerutil"
	metricsserver "sigs.k8s.io/controller-runtime/pkg/metrics/server"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	"github.com/agentbox/terraform-provider-agentbox/internal/testenv"
	"github.com/agentbox/terraform-provider-agentbox/internal/testenv/toolchain"
)

// startNodePoolController runs a GVisorNodePoolReconciler in its own
// manager for the rest of the test. Its cache is cluster-wide: pools, nodes
// and RuntimeClasses are all cluster-scoped.
func startNodePoolController(e *clusterEnv) {
	t := e.t
	t.Helper()
	cfg, _ := testenv.Shared(t)
	// As in newClusterEnv: controller goroutines may log after the test has
	// returned, so the log is buffered and shown only on failure.
	var logMu sync.Mutex
	var logBuf bytes.Buffer
	logger := funcr.New(func(prefix, args string) {
		logMu.Lock()
		defer logMu.Unlock()
		fmt.Fprintln(&logBuf, time.Now().Format("15:04:05.000"), prefix, args)
	}, funcr.Options{Verbosity: 1})
	mgr, err := ctrl.NewManager(cfg, ctrl.Options{
		Scheme:                 e.c.Scheme(),
		Logger:                 logger,
		Metrics:                metricsserver.Options{BindAddress: "0"},
		HealthProbeBindAddress: "0",
		Controller:             config.Controller{SkipNameValidation: ptr.To(true)},
	})
	must(t, err)
	must(t, (&GVisorNodePoolReconciler{}).SetupWithManager(mgr))
	ctx, stop := context.WithCancel(e.ctx)
	done := make(chan error, 1)
	go func() { done <- mgr.Start(ctx) }()
	t.Cleanup(func() {
		stop()
		if err := <-done; err != nil {
			t.Errorf("node pool manager: %v", err)
		}
		if t.Failed() {
			logMu.Lock()
			t.Logf("node pool controller log:\n%s", logBuf.String())
			logMu.Unlock()
		}
	})
}

// testNode is the cluster's node that can run gVisor pods: the one node of
// the test cluster.
func testNode(e *clusterEnv) *corev1.Node {
	e.t.Helper()
	var nodes corev1.NodeList
	must(e.t, e.c.List(e.ctx, &nodes))
	for i := range nodes.Items {
		if nodeIsReady(&nodes.Items[i]) && nodes.Items[i].Labels[corev1.LabelHostname] != "" {
			return &nodes.Items[i]
		}
	}
	e.t.Fatalf("no Ready node among %d", len(nodes.Items))
	return nil
}

// restoreNode takes a pool's label, taint and taint record off the node,
// whatever state a failed test left them in, so that the shared node is as
// other tests expect it.
func restoreNode(c client.Client, nodeName, pool, taintKey string) error {
	return retry.RetryOnConflict(retry.DefaultRetry, func() error {
		var n corev1.Node
		if err := c.Get(context.Background(), types.NamespacedName{Name: nodeName}, &n); err != nil {
			return client.IgnoreNotFound(err)
		}
		patch := client.MergeFromWithOptions(n.DeepCopy(), client.MergeFromWithOptimisticLock{})
		changed := false
		if n.Labels[v1alpha1.LabelNodePool] == pool {
			delete(n.Labels, v1alpha1.LabelNodePool)
			delete(n.Annotations, v1alpha1.AnnotationNodePoolTaint)
			changed = true
		}
		if kept := slices.DeleteFunc(slices.Clone(n.Spec.Taints), func(t corev1.Taint) bool { return t.Key == taintKey }); len(kept) != len(n.Spec.Taints) {
			n.Spec.Taints = kept
			changed = true
		}
		if !changed {
			return nil
		}
		return c.Patch(context.Background(), &n, patch)
	})
}

// TestNodePoolManaged runs a Managed pool on the test cluster's node: it
// must get its RuntimeClass, label and taint the node, report it ready, run
// a gVisor pod through the RuntimeClass, and leave nothing behind when it
// is deleted.
//
// The node is shared with tests running in parallel, so the pool's taint
// is PreferNoSchedule under a key of its own: it never keeps their pods
// off the node. The RuntimeClass name is the test's own too, as the
// cluster's "gvisor" RuntimeClass is in use by the other tests.
func TestNodePoolManaged(t *testing.T) {
	t.Parallel()
	e := newClusterEnv(t)
	node := testNode(e)
	suffix := strings.TrimPrefix(e.ns, "ctrl-")
	poolName, rcName, taintKey := "np-"+suffix, "gvisor-np-"+suffix, "agentbox.test/np-"+suffix

	// Registered before the controller starts, so it runs after the
	// controller has stopped and cannot put anything back.
	t.Cleanup(func() {
		ctx := context.Background()
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

	overhead := corev1.ResourceList{corev1.ResourceCPU: resource.MustParse("50m"), corev1.ResourceMemory: resource.MustParse("32Mi")}
	taint := corev1.Taint{Key: taintKey, Value: "true", Effect: corev1.TaintEffectPreferNoSchedule}
	pool := &v1alpha1.GVisorNodePool{
		ObjectMeta: metav1.ObjectMeta{Name: poolName},
		Spec: v1alpha1.GVisorNodePoolSpec{
			Mode:             v1alpha1.GVisorNodePoolModeManaged,
			RuntimeClassName: rcName,
			NodeSelector:     map[string]string{corev1.LabelHostname: node.Labels[corev1.LabelHostname]},
			Taint:            &taint,
			Overhead:         overhead,
		},
	}
	start := time.Now()
	must(t, e.c.Create(e.ctx, pool))

	e.eventually("the pool to be Ready", func() error {
		if err := e.c.Get(e.ctx, client.ObjectKeyFromObject(pool), pool); err != nil {
			return err
		}
		c := meta.FindStatusCondition(pool.Status.Conditions, v1alpha1.ConditionReady)
		if c == nil {
			return errors.New("no Ready condition yet")
		}
		if c.Status != metav1.ConditionTrue {
			return fmt.Errorf("Ready %s/%s: %s", c.Status, c.Reason, c.Message)
		}
		return nil
	})
	t.Logf("node pool %s Ready after %s", poolName, time.Since(start).Round(time.Millisecond))
	c := meta.FindStatusCondition(pool.Status.Conditions, v1alpha1.ConditionReady)
	if c.Reason != v1alpha1.ReasonNodesReady || c.ObservedGeneration != pool.Generation || pool.Status.ObservedGeneration != pool.Generation {
		t.Errorf("Ready %s (generation %d), status generation %d, pool generation %d",
			c.Reason, c.ObservedGeneration, pool.Status.ObservedGeneration, pool.Generation)
	}
	if !slices.Equal(pool.Status.Nodes, []string{node.Name}) || pool.Status.ReadyNodes != 1 {
		t.Errorf("status nodes %v, readyNodes %d; want [%s], 1", pool.Status.Nodes, pool.Status.ReadyNodes, node.Name)
	}
	if !controllerutil.ContainsFinalizer(pool, v1alpha1.Finalizer) {
		t.Error("no finalizer: the node would keep its label and taint after the pool is deleted")
	}

	var rc nodev1.RuntimeClass
	must(t, e.c.Get(e.ctx, types.NamespacedName{Name: rcName}, &rc))
	if rc.Handler != v1alpha1.RunscHandler {
		t.Errorf("handler %q", rc.Handler)
	}
	if ref := metav1.GetControllerOf(&rc); ref == nil || ref.UID != pool.UID {
		t.Errorf("RuntimeClass controller %+v, want the pool", ref)
	}
	if rc.Scheduling == nil || rc.Scheduling.NodeSelector[v1alpha1.LabelNodePool] != poolName ||
		rc.Scheduling.NodeSelector[corev1.LabelHostname] != node.Labels[corev1.LabelHostname] {
		t.Errorf("scheduling %+v", rc.Scheduling)
	} else if !tolerated(rc.Scheduling.Tolerations, &taint) {
		t.Errorf("tolerations %+v do not tolerate the pool's taint", rc.Scheduling.Tolerations)
	}
	if rc.Overhead == nil || !rc.Overhead.PodFixed.Cpu().Equal(overhead[corev1.ResourceCPU]) || !rc.Overhead.PodFixed.Memory().Equal(overhead[corev1.ResourceMemory]) {
		t.Errorf("overhead %+v", rc.Overhead)
	}

	var n corev1.Node
	must(t, e.c.Get(e.ctx, types.NamespacedName{Name: node.Name}, &n))
	if n.Labels[v1alpha1.LabelNodePool] != poolName || n.Annotations[v1alpha1.AnnotationNodePoolTaint] != taint.ToString() {
		t.Errorf("node label %q, taint record %q", n.Labels[v1alpha1.LabelNodePool], n.Annotations[v1alpha1.AnnotationNodePoolTaint])
	}
	if !slices.ContainsFunc(n.Spec.Taints, func(x corev1.Taint) bool { return x.MatchTaint(&taint) && x.Value == taint.Value }) {
		t.Errorf("node taints %+v lack %s", n.Spec.Taints, taint.ToString())
	}

	// A pod that names only the RuntimeClass gets the pool's scheduling and
	// overhead from admission and runs under runsc on the node.
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "on-pool", Namespace: e.ns},
		Spec: corev1.PodSpec{
			RuntimeClassName:              ptr.To(rcName),
			TerminationGracePeriodSeconds: ptr.To[int64](0),
			AutomountServiceAccountToken:  ptr.To(false),
			Containers: []corev1.Container{{
				Name: "c", Image: toolchain.BusyboxImage, ImagePullPolicy: corev1.PullNever,
				Command: []string{"sleep", "3600"},
			}},
		},
	}
	podStart := time.Now()
	// Retried: the namespace's default ServiceAccount, which admission looks
	// up, may not exist yet this soon after the namespace.
	e.eventually("the pod to be created", func() error { return e.c.Create(e.ctx, pod) })
	if pod.Spec.NodeSelector[v1alpha1.LabelNodePool] != poolName || pod.Spec.Overhead.Cpu().IsZero() {
		t.Errorf("admission did not apply the RuntimeClass: nodeSelector %v, overhead %v", pod.Spec.NodeSelector, pod.Spec.Overhead)
	}
	e.eventually("a pod on the pool's RuntimeClass to run", func() error {
		if err := e.get(pod.Name, pod); err != nil {
			return err
		}
		if pod.Status.Phase != corev1.PodRunning {
			return fmt.Errorf("pod %s on node %q: %+v", pod.Status.Phase, pod.Spec.NodeName, pod.Status.ContainerStatuses)
		}
		return nil
	})
	t.Logf("pod on the pool's RuntimeClass running after %s", time.Since(podStart).Round(time.Millisecond))
	if pod.Spec.NodeName != node.Name {
		t.Errorf("pod on node %q", pod.Spec.NodeName)
	}
	must(t, client.IgnoreNotFound(e.c.Delete(e.ctx, pod, client.GracePeriodSeconds(0))))

	delStart := time.Now()
	must(t, e.c.Delete(e.ctx, pool))
	e.eventually("the pool, its RuntimeClass and its node label and taint to be gone", func() error {
		if err := e.c.Get(e.ctx, types.NamespacedName{Name: poolName}, &v1alpha1.GVisorNodePool{}); !apierrors.IsNotFound(err) {
			return fmt.Errorf("pool still there (%v)", err)
		}
		if err := e.c.Get(e.ctx, types.NamespacedName{Name: rcName}, &nodev1.RuntimeClass{}); !apierrors.IsNotFound(err) {
			return fmt.Errorf("RuntimeClass still there (%v)", err)
		}
		var n corev1.Node
		if err := e.c.Get(e.ctx, types.NamespacedName{Name: node.Name}, &n); err != nil {
			return err
		}
		if v, ok := n.Labels[v1alpha1.LabelNodePool]; ok {
			return fmt.Errorf("node still labelled %s=%s", v1alpha1.LabelNodePool, v)
		}
		if v, ok := n.Annotations[v1alpha1.AnnotationNodePoolTaint]; ok {
			return fmt.Errorf("node still has the taint record %q", v)
		}
		if slices.ContainsFunc(n.Spec.Taints, func(x corev1.Taint) bool { return x.Key == taintKey }) {
			return fmt.Errorf("node still tainted: %+v", n.Spec.Taints)
		}
		return nil
	})
	t.Logf("node pool %s cleaned up after %s", poolName, time.Since(delStart).Round(time.Millisecond))
}
