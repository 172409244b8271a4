package controller

import (
	"context"
	"errors"
	"path/filepath"
	goruntime "runtime"
	"strings"
	"testing"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	nodev1 "k8s.io/api/node/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	k8sruntime "k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/tools/events"
	clocktesting "k8s.io/utils/clock/testing"
	"k8s.io/utils/ptr"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/client/interceptor"
	"sigs.k8s.io/controller-runtime/pkg/envtest"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	"github.com/agentbox/terraform-provider-agentbox/internal/pki"
	"github.com/agentbox/terraform-provider-agentbox/internal/testenv"
)

// TestExpiredHoldIsReclaimed runs the reconciler against a real
// kube-apiserver (envtest: etcd and apiserver on loopback, no node, so it
// needs neither the shared cluster nor its node) with a fake clock: a hold
// whose holder stops heartbeating is removed at its expiry, with an event
// and the Leased condition saying so.
func TestExpiredHoldIsReclaimed(t *testing.T) {
	c, scheme := startEnvtest(t)
	ctx := context.Background()

	const ns = "team-a"
	// What a pod needs to pass admission on an API server without a
	// controller manager: its namespace's default ServiceAccount and the
	// RuntimeClass it names.
	must(t, c.Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}))
	must(t, c.Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: "default", Namespace: ns}}))
	must(t, c.Create(ctx, &nodev1.RuntimeClass{ObjectMeta: metav1.ObjectMeta{Name: v1alpha1.DefaultRuntimeClassName}, Handler: "runsc"}))
	must(t, c.Create(ctx, &v1alpha1.SandboxTemplate{ObjectMeta: metav1.ObjectMeta{Name: "python", Namespace: ns}}))
	must(t, c.Create(ctx, &v1alpha1.Sandbox{
		ObjectMeta: metav1.ObjectMeta{Name: "sb-1", Namespace: ns},
		Spec:       v1alpha1.SandboxSpec{AgentID: "agent-1", TemplateRef: v1alpha1.LocalObjectReference{Name: "python"}},
	}))

	ca, err := pki.NewCA("lease test CA")
	must(t, err)
	// Whole seconds, so that times read back from the API compare equal.
	clk := clocktesting.NewFakeClock(time.Now().Truncate(time.Second))
	rec := events.NewFakeRecorder(100)
	r := &SandboxReconciler{Client: c, Scheme: scheme, Recorder: rec, Namespace: "agentbox-system",
		DefaultImage: "agentbox/agentbox-sandbox:dev", CA: ca, Clock: clk}
	key := types.NamespacedName{Namespace: ns, Name: "sb-1"}
	reconcile := func() ctrl.Result {
		t.Helper()
		res, err := r.Reconcile(ctx, ctrl.Request{NamespacedName: key})
		if err != nil {
			t.Fatalf("reconcile: %v", err)
		}
		return res
	}
	leased := func(status metav1.ConditionStatus, reason string) *metav1.Condition {
		t.Helper()
		var sbx v1alpha1.Sandbox
		must(t, c.Get(ctx, key, &sbx))
		cond := meta.FindStatusCondition(sbx.Status.Conditions, v1alpha1.ConditionLeased)
		if cond == nil || cond.Status != status || cond.Reason != reason {
			t.Fatalf("Leased condition = %+v, want %s/%s", cond, status, reason)
		}
		return cond
	}
	getLease := func() *coordinationv1.Lease {
		t.Helper()
		var l coordinationv1.Lease
		must(t, c.Get(ctx, types.NamespacedName{Namespace: ns, Name: ActivityClockName("sb-1")}, &l))
		return &l
	}

	reconcile() // creates the children, the Lease among them
	reconcile()
	leased(metav1.ConditionFalse, v1alpha1.ReasonLeaseReleased)

	// A hold as the Compute API writes it, 30 s long.
	l := getLease()
	acquired := metav1.NewMicroTime(clk.Now())
	l.Spec.HolderIdentity = ptr.To("run-7")
	l.Spec.LeaseDurationSeconds = ptr.To[int32](30)
	l.Spec.AcquireTime = &acquired
	l.Spec.RenewTime = &acquired
	l.Annotations = map[string]string{v1alpha1.AnnotationLeaseID: "abc", v1alpha1.AnnotationLeaseRequestID: "req-1"}
	must(t, c.Update(ctx, l))

	res := reconcile()
	if cond := leased(metav1.ConditionTrue, v1alpha1.ReasonLeaseHeld); !strings.Contains(cond.Message, `"run-7"`) {
		t.Errorf("Leased message %q does not name the holder", cond.Message)
	}
	if res.RequeueAfter != 30*time.Second {
		t.Errorf("requeue after %s with a hold expiring in 30s, want 30s", res.RequeueAfter)
	}

	// Not yet expired: the hold stays.
	clk.Step(29 * time.Second)
	if res := reconcile(); res.RequeueAfter != time.Second {
		t.Errorf("requeue after %s with 1s left, want 1s", res.RequeueAfter)
	}
	if h := ptr.Deref(getLease().Spec.HolderIdentity, ""); h != "run-7" {
		t.Fatalf("holder = %q before expiry, want run-7", h)
	}
	drainEvents(rec)

	clk.Step(time.Second)
	res = reconcile()
	l = getLease()
	if l.Spec.HolderIdentity != nil || l.Spec.LeaseDurationSeconds != nil || l.Spec.AcquireTime != nil ||
		l.Annotations[v1alpha1.AnnotationLeaseID] != "" || l.Annotations[v1alpha1.AnnotationLeaseRequestID] != "" {
		t.Errorf("Lease after expiry: spec %+v annotations %v", l.Spec, l.Annotations)
	}
	if h := l.Annotations[v1alpha1.AnnotationLeaseExpiredHolder]; h != "run-7" {
		t.Errorf("expired-holder annotation = %q, want run-7", h)
	}
	if !l.Spec.RenewTime.Time.Equal(acquired.Time) {
		t.Errorf("reclaim moved renewTime to %s; the activity clock must stay at %s", l.Spec.RenewTime, acquired)
	}
	leased(metav1.ConditionFalse, v1alpha1.ReasonLeaseExpired)
	if evs := drainEvents(rec); len(evs) != 1 || !strings.Contains(evs[0], EventLeaseExpired) || !strings.Contains(evs[0], "run-7") {
		t.Errorf("events = %q, want one %s naming the holder", evs, EventLeaseExpired)
	}
	if res.RequeueAfter > maxRequeue || res.RequeueAfter < time.Hour {
		t.Errorf("requeue after %s with no hold left; want the certificate's schedule", res.RequeueAfter)
	}

	// Settled: another pass changes nothing and says nothing more, even
	// one that starts from a status still showing the hold, as a lagging
	// cache would.
	var stale v1alpha1.Sandbox
	must(t, c.Get(ctx, key, &stale))
	meta.SetStatusCondition(&stale.Status.Conditions, metav1.Condition{Type: v1alpha1.ConditionLeased,
		Status: metav1.ConditionTrue, Reason: v1alpha1.ReasonLeaseHeld, Message: "stale"})
	must(t, c.Status().Update(ctx, &stale))
	reconcile()
	leased(metav1.ConditionFalse, v1alpha1.ReasonLeaseExpired)
	if evs := drainEvents(rec); len(evs) != 0 {
		t.Errorf("events after the reclaim settled: %q", evs)
	}
	var sbx v1alpha1.Sandbox
	must(t, c.Get(ctx, key, &sbx))
	if sbx.Generation != 1 {
		t.Errorf("the sandbox's spec was written (generation %d)", sbx.Generation)
	}
}

func drainEvents(rec *events.FakeRecorder) []string {
	var out []string
	for {
		select {
		case e := <-rec.Events:
			out = append(out, e)
		default:
			return out
		}
	}
}

// TestUnitReclaimLosesToHeartbeat: when a heartbeat renews the hold between
// the controller's read and its reclaim, the API server refuses the stale
// reclaim; the controller must then keep the hold and look again, not
// report an expiry that did not happen.
func TestUnitReclaimLosesToHeartbeat(t *testing.T) {
	f := newFakeEnv(t, unitSandbox("sb", "tpl"), unitTemplate("tpl"))
	f.reconcile("sb")
	var l coordinationv1.Lease
	must(t, f.c.Get(context.Background(), types.NamespacedName{Namespace: unitNS, Name: ActivityClockName("sb")}, &l))
	renewed := metav1.NewMicroTime(f.clock.Now().Add(-time.Minute))
	l.Spec.HolderIdentity = ptr.To("run-1")
	l.Spec.LeaseDurationSeconds = ptr.To[int32](10)
	l.Spec.RenewTime = &renewed
	must(t, f.c.Update(context.Background(), &l))
	f.drainEvents()

	f.r.Client = interceptor.NewClient(f.c.(client.WithWatch), interceptor.Funcs{
		Update: func(ctx context.Context, c client.WithWatch, obj client.Object, opts ...client.UpdateOption) error {
			if _, ok := obj.(*coordinationv1.Lease); ok {
				return apierrors.NewConflict(coordinationv1.Resource("leases"), obj.GetName(), errors.New("renewed meanwhile"))
			}
			return c.Update(ctx, obj, opts...)
		},
	})
	if res := f.reconcile("sb"); res.RequeueAfter != time.Second {
		t.Errorf("requeue after %s on a conflicting reclaim, want 1s", res.RequeueAfter)
	}
	must(t, f.c.Get(context.Background(), types.NamespacedName{Namespace: unitNS, Name: ActivityClockName("sb")}, &l))
	if ptr.Deref(l.Spec.HolderIdentity, "") != "run-1" {
		t.Errorf("holder = %v after a refused reclaim, want run-1", l.Spec.HolderIdentity)
	}
	for _, e := range f.drainEvents() {
		if strings.Contains(e, EventLeaseExpired) {
			t.Errorf("event %q for a reclaim that did not happen", e)
		}
	}
	if c := meta.FindStatusCondition(f.sandbox("sb").Status.Conditions, v1alpha1.ConditionLeased); c != nil && c.Reason == v1alpha1.ReasonLeaseExpired {
		t.Errorf("Leased = %+v for a reclaim that did not happen", c)
	}
}

// startEnvtest starts a kube-apiserver of its own for the test (envtest:
// etcd and the API server on loopback, no node) with the chart's CRDs, and
// returns a client of it.
func startEnvtest(t *testing.T) (client.Client, *k8sruntime.Scheme) {
	t.Helper()
	if testing.Short() {
		t.Skip("starts a kube-apiserver")
	}
	_, file, _, _ := goruntime.Caller(0)
	env := &envtest.Environment{
		BinaryAssetsDirectory: testenv.EnvtestAssets(t),
		CRDDirectoryPaths:     []string{filepath.Join(filepath.Dir(file), "..", "..", "charts", "agentbox", "crds")},
		ErrorIfCRDPathMissing: true,
	}
	cfg, err := env.Start()
	if err != nil {
		t.Fatalf("start envtest: %v", err)
	}
	t.Cleanup(func() { _ = env.Stop() })
	scheme := k8sruntime.NewScheme()
	must(t, clientgoscheme.AddToScheme(scheme))
	must(t, v1alpha1.AddToScheme(scheme))
	c, err := client.New(cfg, client.Options{Scheme: scheme})
	must(t, err)
	return c, scheme
}
