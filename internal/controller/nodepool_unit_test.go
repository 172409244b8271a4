package controller

import (
	"context"
	"errors"
	"slices"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	nodev1 "k8s.io/api/node/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	k8sruntime "k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/tools/events"
	clocktesting "k8s.io/utils/clock/testing"
	"k8s.io/utils/ptr"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/client/fake"
	"sigs.k8s.io/controller-runtime/pkg/client/interceptor"
	"sigs.k8s.io/controller-runtime/pkg/controller/controllerutil"
	"sigs.k8s.io/controller-runtime/pkg/event"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
)

// The node pool controller against the fake client: node states a test
// cluster's single node cannot take (NotReady, without runsc, many nodes),
// foreign RuntimeClasses, GKE mode, and API faults.

// poolEnv is newFakeEnv's counterpart for the node pool controller, which
// needs the GVisorNodePool status subresource and the RuntimeClass index
// that the sandbox's fake client lacks.
type poolEnv struct {
	t     *testing.T
	c     client.WithWatch
	r     *GVisorNodePoolReconciler
	rec   *events.FakeRecorder
	clock *clocktesting.FakeClock
}

func newPoolEnv(t *testing.T, objs ...client.Object) *poolEnv {
	t.Helper()
	scheme := k8sruntime.NewScheme()
	must(t, clientgoscheme.AddToScheme(scheme))
	must(t, v1alpha1.AddToScheme(scheme))
	c := fake.NewClientBuilder().WithScheme(scheme).
		WithStatusSubresource(&v1alpha1.GVisorNodePool{}).
		WithIndex(&v1alpha1.GVisorNodePool{}, runtimeClassIndex, func(o client.Object) []string {
			return []string{poolRuntimeClassName(o.(*v1alpha1.GVisorNodePool))}
		}).
		WithObjects(objs...).Build()
	clk := clocktesting.NewFakeClock(time.Now())
	rec := events.NewFakeRecorder(100)
	return &poolEnv{t: t, c: c, rec: rec, clock: clk,
		r: &GVisorNodePoolReconciler{Client: c, Scheme: scheme, Recorder: rec, Clock: clk}}
}

func (p *poolEnv) reconcile(name string) (ctrl.Result, error) {
	return p.r.Reconcile(context.Background(), ctrl.Request{NamespacedName: types.NamespacedName{Name: name}})
}

func (p *poolEnv) mustReconcile(name string) ctrl.Result {
	p.t.Helper()
	res, err := p.reconcile(name)
	if err != nil {
		p.t.Fatalf("reconcile %s: %v", name, err)
	}
	return res
}

func (p *poolEnv) pool(name string) *v1alpha1.GVisorNodePool {
	p.t.Helper()
	var pool v1alpha1.GVisorNodePool
	must(p.t, p.c.Get(context.Background(), types.NamespacedName{Name: name}, &pool))
	return &pool
}

func (p *poolEnv) node(name string) *corev1.Node {
	p.t.Helper()
	var n corev1.Node
	must(p.t, p.c.Get(context.Background(), types.NamespacedName{Name: name}, &n))
	return &n
}

func (p *poolEnv) runtimeClass(name string) (*nodev1.RuntimeClass, bool) {
	p.t.Helper()
	var rc nodev1.RuntimeClass
	err := p.c.Get(context.Background(), types.NamespacedName{Name: name}, &rc)
	if apierrors.IsNotFound(err) {
		return nil, false
	}
	must(p.t, err)
	return &rc, true
}

// wantReady checks the pool's Ready condition and returns it.
func (p *poolEnv) wantReady(name string, status metav1.ConditionStatus, reason string) *metav1.Condition {
	p.t.Helper()
	c := meta.FindStatusCondition(p.pool(name).Status.Conditions, v1alpha1.ConditionReady)
	if c == nil {
		p.t.Fatalf("pool %s has no Ready condition", name)
	}
	if c.Status != status || c.Reason != reason {
		p.t.Fatalf("pool %s Ready %s/%s (%s); want %s/%s", name, c.Status, c.Reason, c.Message, status, reason)
	}
	return c
}

func (p *poolEnv) update(obj client.Object, mutate func()) {
	p.t.Helper()
	must(p.t, p.c.Get(context.Background(), client.ObjectKeyFromObject(obj), obj))
	mutate()
	must(p.t, p.c.Update(context.Background(), obj))
}

// unitNode is a node with labels; ready sets kubelet's Ready condition and
// runsc lists the runsc handler the way containerd 2 reports it.
func unitNode(name string, labels map[string]string, ready, runsc bool) *corev1.Node {
	n := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: labels}}
	status := corev1.ConditionFalse
	if ready {
		status = corev1.ConditionTrue
	}
	n.Status.Conditions = []corev1.NodeCondition{{Type: corev1.NodeReady, Status: status}}
	n.Status.RuntimeHandlers = []corev1.NodeRuntimeHandler{{Name: "runc"}}
	if runsc {
		n.Status.RuntimeHandlers = append(n.Status.RuntimeHandlers, corev1.NodeRuntimeHandler{Name: v1alpha1.RunscHandler})
	}
	return n
}

var poolTaint = corev1.Taint{Key: "agentbox.dev/gvisor", Value: "true", Effect: corev1.TaintEffectNoSchedule}

func managedPool(name string) *v1alpha1.GVisorNodePool {
	return &v1alpha1.GVisorNodePool{
		ObjectMeta: metav1.ObjectMeta{Name: name, UID: types.UID("uid-" + name), Generation: 1},
		Spec: v1alpha1.GVisorNodePoolSpec{
			Mode:         v1alpha1.GVisorNodePoolModeManaged,
			NodeSelector: map[string]string{"pool": "gvisor"},
			Taint:        poolTaint.DeepCopy(),
			Overhead:     corev1.ResourceList{corev1.ResourceMemory: resource.MustParse("64Mi")},
		},
	}
}

func hasTaint(n *corev1.Node, t corev1.Taint) bool {
	return slices.ContainsFunc(n.Spec.Taints, func(x corev1.Taint) bool { return x.MatchTaint(&t) && x.Value == t.Value })
}

func eventsContain(evs []string, reasons ...string) bool {
	all := strings.Join(evs, "\n")
	for _, r := range reasons {
		if !strings.Contains(all, " "+r+" ") {
			return false
		}
	}
	return true
}

func TestUnitNodePoolManaged(t *testing.T) {
	foreign := corev1.Taint{Key: "example.com/maintenance", Effect: corev1.TaintEffectNoSchedule}
	a := unitNode("a", map[string]string{"pool": "gvisor"}, true, true)
	a.Spec.Taints = []corev1.Taint{foreign}
	b := unitNode("b", map[string]string{"pool": "gvisor"}, true, false)
	other := unitNode("other", map[string]string{"pool": "runc"}, true, true)
	p := newPoolEnv(t, managedPool("np"), a, b, other)

	p.mustReconcile("np")
	pool := p.pool("np")
	if !controllerutil.ContainsFinalizer(pool, v1alpha1.Finalizer) {
		t.Error("no finalizer")
	}
	c := p.wantReady("np", metav1.ConditionTrue, v1alpha1.ReasonNodesReady)
	if !slices.Equal(pool.Status.Nodes, []string{"a", "b"}) || pool.Status.ReadyNodes != 1 || pool.Status.ObservedGeneration != 1 || c.ObservedGeneration != 1 {
		t.Errorf("status %+v", pool.Status)
	}

	rc, ok := p.runtimeClass(v1alpha1.DefaultRuntimeClassName)
	if !ok {
		t.Fatal("no RuntimeClass")
	}
	if rc.Handler != v1alpha1.RunscHandler || !metav1.IsControlledBy(rc, pool) {
		t.Errorf("RuntimeClass handler %q, owners %+v", rc.Handler, rc.OwnerReferences)
	}
	if want := map[string]string{"pool": "gvisor", v1alpha1.LabelNodePool: "np"}; rc.Scheduling == nil || !mapsEqual(rc.Scheduling.NodeSelector, want) {
		t.Errorf("scheduling %+v, want nodeSelector %v", rc.Scheduling, want)
	} else if !tolerated(rc.Scheduling.Tolerations, &poolTaint) {
		t.Errorf("tolerations %+v do not tolerate the pool's taint", rc.Scheduling.Tolerations)
	}
	if rc.Overhead == nil || rc.Overhead.PodFixed.Memory().String() != "64Mi" {
		t.Errorf("overhead %+v", rc.Overhead)
	}

	for _, name := range []string{"a", "b"} {
		n := p.node(name)
		if n.Labels[v1alpha1.LabelNodePool] != "np" || !hasTaint(n, poolTaint) || n.Annotations[v1alpha1.AnnotationNodePoolTaint] != poolTaint.ToString() {
			t.Errorf("node %s: labels %v, taints %+v, annotations %v", name, n.Labels, n.Spec.Taints, n.Annotations)
		}
	}
	if !hasTaint(p.node("a"), foreign) {
		t.Error("a foreign taint was removed")
	}
	if n := p.node("other"); len(n.Spec.Taints) != 0 || n.Labels[v1alpha1.LabelNodePool] != "" {
		t.Errorf("an unselected node was touched: %+v", n)
	}
	if evs := drainEvents(p.rec); !eventsContain(evs, EventRuntimeClassCreated, EventNodeAdded, EventNodePoolReady) {
		t.Errorf("events %v", evs)
	}

	// Settled: a second pass writes nothing and tells nothing.
	rvs := map[string]string{"pool": p.pool("np").ResourceVersion, "a": p.node("a").ResourceVersion, "b": p.node("b").ResourceVersion, "rc": rc.ResourceVersion}
	p.clock.Step(time.Minute)
	p.mustReconcile("np")
	rc, _ = p.runtimeClass(v1alpha1.DefaultRuntimeClassName)
	now := map[string]string{"pool": p.pool("np").ResourceVersion, "a": p.node("a").ResourceVersion, "b": p.node("b").ResourceVersion, "rc": rc.ResourceVersion}
	if !mapsEqual(rvs, now) {
		t.Errorf("a settled pool was rewritten: %v -> %v", rvs, now)
	}
	if evs := drainEvents(p.rec); len(evs) != 0 {
		t.Errorf("a settled pool repeated events: %v", evs)
	}

	// Node b stops matching: it loses the label, the taint and the record.
	p.update(b, func() { b.Labels["pool"] = "runc" })
	p.mustReconcile("np")
	n := p.node("b")
	if _, ok := n.Labels[v1alpha1.LabelNodePool]; ok || hasTaint(n, poolTaint) || n.Annotations[v1alpha1.AnnotationNodePoolTaint] != "" {
		t.Errorf("node b kept pool state after leaving: labels %v taints %+v annotations %v", n.Labels, n.Spec.Taints, n.Annotations)
	}
	if got := p.pool("np").Status.Nodes; !slices.Equal(got, []string{"a"}) {
		t.Errorf("nodes %v", got)
	}
	if evs := drainEvents(p.rec); !eventsContain(evs, EventNodeRemoved) {
		t.Errorf("events %v", evs)
	}

	// A new taint replaces the pool's old one and leaves the foreign one.
	newTaint := corev1.Taint{Key: "agentbox.dev/sandbox-only", Effect: corev1.TaintEffectNoExecute}
	pool = p.pool("np")
	p.update(pool, func() { pool.Spec.Taint = newTaint.DeepCopy(); pool.Generation = 2 })
	p.mustReconcile("np")
	n = p.node("a")
	if hasTaint(n, poolTaint) || !hasTaint(n, newTaint) || !hasTaint(n, foreign) {
		t.Errorf("taints after a change of the pool's taint: %+v", n.Spec.Taints)
	}
	rc, _ = p.runtimeClass(v1alpha1.DefaultRuntimeClassName)
	if !tolerated(rc.Scheduling.Tolerations, &newTaint) {
		t.Errorf("RuntimeClass tolerations %+v not updated", rc.Scheduling.Tolerations)
	}
	if evs := drainEvents(p.rec); !eventsContain(evs, EventRuntimeClassUpdated) {
		t.Errorf("events %v", evs)
	}

	// Deletion: the RuntimeClass goes, the node is restored, the pool is
	// let go.
	must(t, p.c.Delete(context.Background(), p.pool("np")))
	p.mustReconcile("np")
	if err := p.c.Get(context.Background(), types.NamespacedName{Name: "np"}, &v1alpha1.GVisorNodePool{}); !apierrors.IsNotFound(err) {
		t.Errorf("pool still there after its finalizer ran: %v", err)
	}
	if _, ok := p.runtimeClass(v1alpha1.DefaultRuntimeClassName); ok {
		t.Error("RuntimeClass left behind")
	}
	n = p.node("a")
	if _, ok := n.Labels[v1alpha1.LabelNodePool]; ok || hasTaint(n, newTaint) || len(n.Annotations) != 0 {
		t.Errorf("node a after deletion: labels %v taints %+v annotations %v", n.Labels, n.Spec.Taints, n.Annotations)
	}
	if !slices.Equal(n.Spec.Taints, []corev1.Taint{foreign}) {
		t.Errorf("node a taints %+v, want only the foreign one", n.Spec.Taints)
	}
}

func mapsEqual(a, b map[string]string) bool {
	if len(a) != len(b) {
		return false
	}
	for k, v := range a {
		if w, ok := b[k]; !ok || w != v {
			return false
		}
	}
	return true
}

// The Ready reasons as nodes come and go and get runsc.
func TestUnitNodePoolReadiness(t *testing.T) {
	n := unitNode("n", map[string]string{"pool": "other"}, false, false)
	p := newPoolEnv(t, managedPool("np"), n)

	p.mustReconcile("np")
	p.wantReady("np", metav1.ConditionFalse, v1alpha1.ReasonNoMatchingNodes)
	if evs := drainEvents(p.rec); !eventsContain(evs, EventNodePoolNotReady) {
		t.Errorf("events %v", evs)
	}

	p.update(n, func() { n.Labels["pool"] = "gvisor" })
	p.mustReconcile("np")
	p.wantReady("np", metav1.ConditionFalse, v1alpha1.ReasonNodesNotReady)

	must(t, p.c.Get(context.Background(), client.ObjectKeyFromObject(n), n))
	n.Status.Conditions[0].Status = corev1.ConditionTrue
	must(t, p.c.Status().Update(context.Background(), n))
	p.mustReconcile("np")
	c := p.wantReady("np", metav1.ConditionFalse, v1alpha1.ReasonInstalling)
	if !strings.Contains(c.Message, v1alpha1.LabelRunscInstalled) {
		t.Errorf("the Installing message does not say how to mark a node: %s", c.Message)
	}
	if got := p.pool("np").Status; len(got.Nodes) != 1 || got.ReadyNodes != 0 {
		t.Errorf("status %+v", got)
	}

	// Runtimes that report no handlers rely on the operator's label.
	p.update(n, func() { n.Labels[v1alpha1.LabelRunscInstalled] = "true" })
	p.mustReconcile("np")
	c = p.wantReady("np", metav1.ConditionTrue, v1alpha1.ReasonNodesReady)
	if p.pool("np").Status.ReadyNodes != 1 {
		t.Error("readyNodes not 1")
	}
	if !c.LastTransitionTime.Time.Equal(p.clock.Now().Truncate(time.Second)) {
		t.Errorf("lastTransitionTime %s, want the controller's clock", c.LastTransitionTime)
	}
}

// A RuntimeClass of the pool's name that agentbox did not create.
func TestUnitNodePoolForeignRuntimeClass(t *testing.T) {
	t.Run("other handler", func(t *testing.T) {
		rc := &nodev1.RuntimeClass{ObjectMeta: metav1.ObjectMeta{Name: "gvisor"}, Handler: "kata"}
		p := newPoolEnv(t, managedPool("np"), rc, unitNode("a", map[string]string{"pool": "gvisor"}, true, true))
		p.mustReconcile("np")
		c := p.wantReady("np", metav1.ConditionFalse, v1alpha1.ReasonRuntimeClassConflict)
		if !strings.Contains(c.Message, "kata") {
			t.Errorf("message %q", c.Message)
		}
		got, _ := p.runtimeClass("gvisor")
		if got.Handler != "kata" || len(got.OwnerReferences) != 0 || got.Scheduling != nil {
			t.Errorf("the foreign RuntimeClass was changed: %+v", got)
		}
		if n := p.node("a"); n.Labels[v1alpha1.LabelNodePool] != "" || len(n.Spec.Taints) != 0 {
			t.Errorf("a node was prepared for a RuntimeClass the pool cannot use: %+v", n)
		}
		if evs := drainEvents(p.rec); !eventsContain(evs, EventRuntimeClassConflict) {
			t.Errorf("events %v", evs)
		}
	})
	t.Run("runsc handler", func(t *testing.T) {
		rc := &nodev1.RuntimeClass{ObjectMeta: metav1.ObjectMeta{Name: "gvisor"}, Handler: "runsc"}
		p := newPoolEnv(t, managedPool("np"), rc, unitNode("a", map[string]string{"pool": "gvisor"}, true, true))
		before, _ := p.runtimeClass("gvisor")
		p.mustReconcile("np")
		c := p.wantReady("np", metav1.ConditionTrue, v1alpha1.ReasonNodesReady)
		if !strings.Contains(c.Message, "not created by agentbox") {
			t.Errorf("message %q does not say the RuntimeClass is used as it is", c.Message)
		}
		if got, _ := p.runtimeClass("gvisor"); got.ResourceVersion != before.ResourceVersion {
			t.Error("a foreign runsc RuntimeClass was modified")
		}
	})
	t.Run("another pool's", func(t *testing.T) {
		first := managedPool("first")
		second := managedPool("second")
		second.Spec.NodeSelector = map[string]string{"pool": "second"}
		p := newPoolEnv(t, first, second, unitNode("a", map[string]string{"pool": "gvisor"}, true, true))
		p.mustReconcile("first")
		p.mustReconcile("second")
		p.wantReady("second", metav1.ConditionFalse, v1alpha1.ReasonRuntimeClassConflict)
		p.wantReady("first", metav1.ConditionTrue, v1alpha1.ReasonNodesReady)
	})
}

// Two pools selecting the same node: the first keeps it.
func TestUnitNodePoolNodeClaimedByOther(t *testing.T) {
	first := managedPool("first")
	second := managedPool("second")
	second.Spec.RuntimeClassName = "gvisor-second"
	second.Spec.Taint = nil
	p := newPoolEnv(t, first, second, unitNode("a", map[string]string{"pool": "gvisor"}, true, true))
	p.mustReconcile("first")
	p.mustReconcile("second")
	c := p.wantReady("second", metav1.ConditionFalse, v1alpha1.ReasonNoMatchingNodes)
	if !strings.Contains(c.Message, "a (by first)") {
		t.Errorf("message %q does not name the node's pool", c.Message)
	}
	if n := p.node("a"); n.Labels[v1alpha1.LabelNodePool] != "first" || !hasTaint(n, poolTaint) {
		t.Errorf("the second pool took the node: %+v", n)
	}
}

// A new runtimeClassName moves the pool to a new RuntimeClass and deletes
// the old one.
func TestUnitNodePoolRuntimeClassRenamed(t *testing.T) {
	p := newPoolEnv(t, managedPool("np"), unitNode("a", map[string]string{"pool": "gvisor"}, true, true))
	p.mustReconcile("np")
	pool := p.pool("np")
	p.update(pool, func() { pool.Spec.RuntimeClassName = "gvisor-2" })
	p.mustReconcile("np")
	if _, ok := p.runtimeClass("gvisor"); ok {
		t.Error("the old RuntimeClass is still there")
	}
	if rc, ok := p.runtimeClass("gvisor-2"); !ok || !metav1.IsControlledBy(rc, pool) {
		t.Errorf("new RuntimeClass %+v", rc)
	}
	if evs := drainEvents(p.rec); !eventsContain(evs, EventRuntimeClassDeleted, EventRuntimeClassCreated) {
		t.Errorf("events %v", evs)
	}
}

func gkePool(name string) *v1alpha1.GVisorNodePool {
	return &v1alpha1.GVisorNodePool{
		ObjectMeta: metav1.ObjectMeta{Name: name, UID: types.UID("uid-" + name), Generation: 1},
		Spec:       v1alpha1.GVisorNodePoolSpec{Mode: v1alpha1.GVisorNodePoolModeGKE},
	}
}

func TestUnitNodePoolGKE(t *testing.T) {
	gkeTaint := corev1.Taint{Key: v1alpha1.GKESandboxTaintKey, Value: v1alpha1.GKESandboxTaintValue, Effect: corev1.TaintEffectNoSchedule}
	sandboxNode := unitNode("gke-sandbox", map[string]string{v1alpha1.GKESandboxTaintKey: v1alpha1.GKESandboxTaintValue}, true, false)
	sandboxNode.Spec.Taints = []corev1.Taint{gkeTaint}
	plain := unitNode("gke-default", map[string]string{}, true, false)
	p := newPoolEnv(t, gkePool("gke"), sandboxNode, plain)

	p.mustReconcile("gke")
	c := p.wantReady("gke", metav1.ConditionFalse, v1alpha1.ReasonRuntimeClassNotFound)
	if !strings.Contains(c.Message, "GKE Sandbox") {
		t.Errorf("message %q", c.Message)
	}
	if _, ok := p.runtimeClass("gvisor"); ok {
		t.Error("a GKE pool created a RuntimeClass")
	}
	if evs := drainEvents(p.rec); !eventsContain(evs, EventRuntimeClassMissing) || !strings.HasPrefix(evs[0], corev1.EventTypeWarning) {
		t.Errorf("events %v", evs)
	}

	// GKE Sandbox is enabled: its RuntimeClass is adopted as it is.
	gke := &nodev1.RuntimeClass{
		ObjectMeta: metav1.ObjectMeta{Name: "gvisor"},
		Handler:    "gvisor",
		Scheduling: &nodev1.Scheduling{
			NodeSelector: map[string]string{v1alpha1.GKESandboxTaintKey: v1alpha1.GKESandboxTaintValue},
			Tolerations:  []corev1.Toleration{GKESandboxToleration},
		},
	}
	must(t, p.c.Create(context.Background(), gke))
	before, _ := p.runtimeClass("gvisor")
	p.mustReconcile("gke")
	c = p.wantReady("gke", metav1.ConditionTrue, v1alpha1.ReasonNodesReady)
	if pool := p.pool("gke"); !slices.Equal(pool.Status.Nodes, []string{"gke-sandbox"}) || pool.Status.ReadyNodes != 1 {
		t.Errorf("status %+v", pool.Status)
	}
	if !strings.Contains(c.Message, GKESandboxToleration.Key) {
		t.Errorf("message %q does not say the pods tolerate GKE's taint", c.Message)
	}
	if after, _ := p.runtimeClass("gvisor"); after.ResourceVersion != before.ResourceVersion || len(after.OwnerReferences) != 0 {
		t.Errorf("GKE's RuntimeClass was modified: %+v", after)
	}
	for _, name := range []string{"gke-sandbox", "gke-default"} {
		if n := p.node(name); n.Labels[v1alpha1.LabelNodePool] != "" || len(n.Annotations) != 0 {
			t.Errorf("GKE pool touched node %s: %+v", name, n.ObjectMeta)
		}
	}
	if n := p.node("gke-sandbox"); !slices.Equal(n.Spec.Taints, []corev1.Taint{gkeTaint}) {
		t.Errorf("GKE's taint changed: %+v", n.Spec.Taints)
	}

	// Deleting a GKE pool leaves GKE's RuntimeClass in place.
	must(t, p.c.Delete(context.Background(), p.pool("gke")))
	p.mustReconcile("gke")
	if _, ok := p.runtimeClass("gvisor"); !ok {
		t.Error("deleting a GKE pool deleted GKE's RuntimeClass")
	}
}

// A pool switched from Managed to GKE gives its nodes back and drops the
// RuntimeClass it made.
func TestUnitNodePoolManagedToGKE(t *testing.T) {
	p := newPoolEnv(t, managedPool("np"), unitNode("a", map[string]string{"pool": "gvisor"}, true, true))
	p.mustReconcile("np")
	pool := p.pool("np")
	p.update(pool, func() { pool.Spec.Mode = v1alpha1.GVisorNodePoolModeGKE })
	p.mustReconcile("np")
	if n := p.node("a"); n.Labels[v1alpha1.LabelNodePool] != "" || hasTaint(n, poolTaint) {
		t.Errorf("node kept the Managed pool's label or taint: %+v", n)
	}
	if _, ok := p.runtimeClass("gvisor"); ok {
		t.Error("the Managed RuntimeClass was kept, and would be mistaken for GKE's")
	}
	p.wantReady("np", metav1.ConditionFalse, v1alpha1.ReasonRuntimeClassNotFound)
}

// API faults: a failing call is reported and returned wrapped; a conflict
// is retried quietly; a failing status write is returned.
func TestUnitNodePoolAPIFaults(t *testing.T) {
	boom := apierrors.NewInternalError(errors.New("etcd is on fire"))
	t.Run("node patch fails", func(t *testing.T) {
		p := newPoolEnv(t, managedPool("np"), unitNode("a", map[string]string{"pool": "gvisor"}, true, true))
		p.r.Client = interceptor.NewClient(p.c, interceptor.Funcs{
			Patch: func(ctx context.Context, c client.WithWatch, obj client.Object, patch client.Patch, opts ...client.PatchOption) error {
				if _, ok := obj.(*corev1.Node); ok {
					return boom
				}
				return c.Patch(ctx, obj, patch, opts...)
			},
		})
		_, err := p.reconcile("np")
		if !apierrors.IsInternalError(err) || !strings.Contains(err.Error(), "node a") {
			t.Errorf("error %v, want the API error wrapped with the node", err)
		}
		c := p.wantReady("np", metav1.ConditionFalse, v1alpha1.ReasonReconcileError)
		if !strings.Contains(c.Message, "etcd is on fire") {
			t.Errorf("message %q", c.Message)
		}
		if evs := drainEvents(p.rec); !eventsContain(evs, EventNodePoolNotReady) {
			t.Errorf("events %v", evs)
		}
		// The same failure again writes nothing new.
		rv := p.pool("np").ResourceVersion
		_, _ = p.reconcile("np")
		if p.pool("np").ResourceVersion != rv {
			t.Error("a repeated failure rewrote the status")
		}
	})
	t.Run("node patch conflicts", func(t *testing.T) {
		p := newPoolEnv(t, managedPool("np"), unitNode("a", map[string]string{"pool": "gvisor"}, true, true))
		p.r.Client = interceptor.NewClient(p.c, interceptor.Funcs{
			Patch: func(ctx context.Context, c client.WithWatch, obj client.Object, patch client.Patch, opts ...client.PatchOption) error {
				if _, ok := obj.(*corev1.Node); ok {
					return apierrors.NewConflict(corev1.Resource("nodes"), obj.GetName(), errors.New("kubelet was first"))
				}
				return c.Patch(ctx, obj, patch, opts...)
			},
		})
		res, err := p.reconcile("np")
		if err != nil || res.RequeueAfter == 0 {
			t.Errorf("result %+v, error %v; want a quiet retry", res, err)
		}
		if c := meta.FindStatusCondition(p.pool("np").Status.Conditions, v1alpha1.ConditionReady); c != nil && c.Reason == v1alpha1.ReasonReconcileError {
			t.Errorf("a conflict was reported as an error: %s", c.Message)
		}
	})
	t.Run("RuntimeClass create fails", func(t *testing.T) {
		p := newPoolEnv(t, managedPool("np"))
		p.r.Client = interceptor.NewClient(p.c, interceptor.Funcs{
			Create: func(ctx context.Context, c client.WithWatch, obj client.Object, opts ...client.CreateOption) error {
				return apierrors.NewForbidden(nodev1.Resource("runtimeclasses"), obj.GetName(), errors.New("no RBAC"))
			},
		})
		_, err := p.reconcile("np")
		if !apierrors.IsForbidden(err) {
			t.Errorf("error %v", err)
		}
		p.wantReady("np", metav1.ConditionFalse, v1alpha1.ReasonReconcileError)
	})
	t.Run("status write fails", func(t *testing.T) {
		p := newPoolEnv(t, managedPool("np"), unitNode("a", map[string]string{"pool": "gvisor"}, true, true))
		p.r.Client = interceptor.NewClient(p.c, interceptor.Funcs{
			SubResourcePatch: func(ctx context.Context, c client.Client, sub string, obj client.Object, patch client.Patch, opts ...client.SubResourcePatchOption) error {
				return boom
			},
		})
		if _, err := p.reconcile("np"); !apierrors.IsInternalError(err) {
			t.Errorf("error %v", err)
		}
	})
	t.Run("finalizer blocked by a node", func(t *testing.T) {
		p := newPoolEnv(t, managedPool("np"), unitNode("a", map[string]string{"pool": "gvisor"}, true, true))
		p.mustReconcile("np")
		must(t, p.c.Delete(context.Background(), p.pool("np")))
		p.r.Client = interceptor.NewClient(p.c, interceptor.Funcs{
			Patch: func(ctx context.Context, c client.WithWatch, obj client.Object, patch client.Patch, opts ...client.PatchOption) error {
				if _, ok := obj.(*corev1.Node); ok {
					return boom
				}
				return c.Patch(ctx, obj, patch, opts...)
			},
		})
		if _, err := p.reconcile("np"); !apierrors.IsInternalError(err) {
			t.Errorf("error %v", err)
		}
		// The pool waits: letting it go now would strand the node's taint.
		if !controllerutil.ContainsFinalizer(p.pool("np"), v1alpha1.Finalizer) {
			t.Error("the finalizer was removed although the node was not restored")
		}
		p.r.Client = p.c
		p.mustReconcile("np")
		if n := p.node("a"); n.Labels[v1alpha1.LabelNodePool] != "" || hasTaint(n, poolTaint) {
			t.Errorf("node not restored: %+v", n)
		}
	})
}

func TestUnitNodePoolWatches(t *testing.T) {
	owned := managedPool("owner")
	renamed := managedPool("user")
	renamed.Spec.RuntimeClassName = "custom"
	p := newPoolEnv(t, owned, renamed)
	rc := &nodev1.RuntimeClass{ObjectMeta: metav1.ObjectMeta{Name: "custom", Labels: map[string]string{v1alpha1.LabelNodePool: "owner"}}}
	var names []string
	for _, r := range p.r.poolsForRuntimeClass(context.Background(), rc) {
		names = append(names, r.Name)
	}
	slices.Sort(names)
	if !slices.Equal(names, []string{"owner", "user"}) {
		t.Errorf("RuntimeClass custom maps to %v, want the pool that uses it and the one that made it", names)
	}

	base := unitNode("n", map[string]string{"a": "b"}, true, false)
	heartbeat := base.DeepCopy()
	heartbeat.Status.Conditions[0].LastHeartbeatTime = metav1.Now()
	heartbeat.ResourceVersion = "2"
	if nodeChanged.Update(event.UpdateEvent{ObjectOld: base, ObjectNew: heartbeat}) {
		t.Error("a kubelet heartbeat wakes every pool")
	}
	for name, mutate := range map[string]func(*corev1.Node){
		"label":    func(n *corev1.Node) { n.Labels["a"] = "c" },
		"taint":    func(n *corev1.Node) { n.Spec.Taints = []corev1.Taint{poolTaint} },
		"notready": func(n *corev1.Node) { n.Status.Conditions[0].Status = corev1.ConditionFalse },
		"runsc": func(n *corev1.Node) {
			n.Status.RuntimeHandlers = append(n.Status.RuntimeHandlers, corev1.NodeRuntimeHandler{Name: v1alpha1.RunscHandler})
		},
	} {
		changed := base.DeepCopy()
		mutate(changed)
		if !nodeChanged.Update(event.UpdateEvent{ObjectOld: base, ObjectNew: changed}) {
			t.Errorf("a %s change does not reach the pools", name)
		}
	}
}

func TestUnitApplyNodePool(t *testing.T) {
	managed := managedPool("m")
	managed.Spec.RuntimeClassName = "gvisor-m"
	spec := corev1.PodSpec{RuntimeClassName: ptr.To("gvisor"), NodeSelector: map[string]string{"zone": "a"}}
	applyNodePool(&spec, managed)
	if *spec.RuntimeClassName != "gvisor-m" || !mapsEqual(spec.NodeSelector, map[string]string{"zone": "a"}) || len(spec.Tolerations) != 0 {
		t.Errorf("Managed pool: %+v; want only the RuntimeClass, which carries the scheduling", spec)
	}

	gke := gkePool("g")
	gke.Spec.NodeSelector = map[string]string{"cloud.google.com/gke-nodepool": "sandbox", "zone": "b"}
	spec = corev1.PodSpec{NodeSelector: map[string]string{"zone": "a", "disk": "ssd"}, Tolerations: []corev1.Toleration{GKESandboxToleration}}
	applyNodePool(&spec, gke)
	applyNodePool(&spec, gke)
	if *spec.RuntimeClassName != v1alpha1.DefaultRuntimeClassName {
		t.Errorf("runtimeClassName %q", *spec.RuntimeClassName)
	}
	if want := map[string]string{"cloud.google.com/gke-nodepool": "sandbox", "zone": "b", "disk": "ssd"}; !mapsEqual(spec.NodeSelector, want) {
		t.Errorf("nodeSelector %v, want %v", spec.NodeSelector, want)
	}
	if len(spec.Tolerations) != 1 || spec.Tolerations[0] != GKESandboxToleration {
		t.Errorf("tolerations %+v, want GKE Sandbox's once", spec.Tolerations)
	}
}

func TestUnitScheduleOnNodePool(t *testing.T) {
	pool := managedPool("np")
	pool.Spec.RuntimeClassName = "gvisor-np"
	f := newFakeEnv(t, pool)
	tpl := unitTemplate("t")
	pod := &corev1.Pod{Spec: corev1.PodSpec{RuntimeClassName: ptr.To("gvisor")}}
	must(t, f.r.scheduleOnNodePool(context.Background(), tpl, pod))
	if *pod.Spec.RuntimeClassName != "gvisor" {
		t.Error("a template without nodePoolRef changed the pod")
	}
	tpl.Spec.NodePoolRef = ptr.To("np")
	must(t, f.r.scheduleOnNodePool(context.Background(), tpl, pod))
	if *pod.Spec.RuntimeClassName != "gvisor-np" {
		t.Errorf("runtimeClassName %q", *pod.Spec.RuntimeClassName)
	}
	tpl.Spec.NodePoolRef = ptr.To("missing")
	if err := f.r.scheduleOnNodePool(context.Background(), tpl, pod); !apierrors.IsNotFound(err) || !strings.Contains(err.Error(), "missing") {
		t.Errorf("error %v, want NotFound naming the pool", err)
	}
}
