package controller

import (
	"context"
	"errors"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/uuid"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	"github.com/agentbox/terraform-provider-agentbox/internal/pki"
	"github.com/agentbox/terraform-provider-agentbox/internal/store"
)

// warmClient stands in for the API server where the fake client falls
// short or a test needs a fault: it assigns UIDs on create (ownership
// checks compare them), and fail, when set, can make a write fail as a
// control plane killed at that point would leave it.
type warmClient struct {
	client.Client
	mu   sync.Mutex
	fail func(verb string, obj client.Object) error
}

func (c *warmClient) check(verb string, obj client.Object) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.fail == nil {
		return nil
	}
	return c.fail(verb, obj)
}

func (c *warmClient) Create(ctx context.Context, obj client.Object, opts ...client.CreateOption) error {
	if err := c.check("create", obj); err != nil {
		return err
	}
	if obj.GetUID() == "" {
		obj.SetUID(uuid.NewUUID())
	}
	// The API server allocates a Service's ClusterIP on create.
	if svc, ok := obj.(*corev1.Service); ok && svc.Spec.ClusterIP == "" {
		svc.Spec.ClusterIP = fakeClusterIP
	}
	return c.Client.Create(ctx, obj, opts...)
}

func (c *warmClient) Patch(ctx context.Context, obj client.Object, patch client.Patch, opts ...client.PatchOption) error {
	if err := c.check("patch", obj); err != nil {
		return err
	}
	return c.Client.Patch(ctx, obj, patch, opts...)
}

func (c *warmClient) Delete(ctx context.Context, obj client.Object, opts ...client.DeleteOption) error {
	if err := c.check("delete", obj); err != nil {
		return err
	}
	return c.Client.Delete(ctx, obj, opts...)
}

type warmEnv struct {
	*fakeEnv
	wc    *warmClient
	pool  *SandboxWarmPoolReconciler
	store *store.Store
}

func newWarmEnv(t *testing.T, objs ...client.Object) *warmEnv {
	t.Helper()
	f := newFakeEnv(t, objs...)
	wc := &warmClient{Client: f.c}
	f.c, f.r.Client = wc, wc
	// As in the control plane, both controllers take warm sandboxes
	// through one store.
	st, err := store.OpenSQLite(context.Background(), filepath.Join(t.TempDir(), "agentbox.db"), store.Options{Now: f.clock.Now})
	must(t, err)
	t.Cleanup(func() { _ = st.Close() })
	f.r.WarmTakes = st
	p := &SandboxWarmPoolReconciler{Client: wc, Scheme: f.r.Scheme, Recorder: f.rec, Clock: f.clock, WarmTakes: st}
	return &warmEnv{fakeEnv: f, wc: wc, pool: p, store: st}
}

func unitPool(name, template string, replicas int32) *v1alpha1.SandboxWarmPool {
	return &v1alpha1.SandboxWarmPool{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: unitNS, UID: types.UID("uid-" + name), Generation: 1},
		Spec:       v1alpha1.SandboxWarmPoolSpec{TemplateRef: v1alpha1.LocalObjectReference{Name: template}, Replicas: replicas},
	}
}

func (w *warmEnv) reconcilePool(name string) ctrl.Result {
	w.t.Helper()
	res, err := w.pool.Reconcile(context.Background(), ctrl.Request{NamespacedName: types.NamespacedName{Namespace: unitNS, Name: name}})
	if err != nil {
		w.t.Fatalf("reconcile pool %s: %v", name, err)
	}
	return res
}

func (w *warmEnv) getPool(name string) *v1alpha1.SandboxWarmPool {
	w.t.Helper()
	var p v1alpha1.SandboxWarmPool
	must(w.t, w.c.Get(context.Background(), types.NamespacedName{Namespace: unitNS, Name: name}, &p))
	return &p
}

// warm lists the pool's sandboxes that are not deleted, sorted by name.
func (w *warmEnv) warm(pool string) []v1alpha1.Sandbox {
	w.t.Helper()
	var list v1alpha1.SandboxList
	must(w.t, w.c.List(context.Background(), &list, client.InNamespace(unitNS), client.MatchingLabels{v1alpha1.LabelWarmPool: pool}))
	out := list.Items[:0]
	for _, s := range list.Items {
		if s.DeletionTimestamp.IsZero() {
			out = append(out, s)
		}
	}
	return out
}

// settle runs the sandbox controller on each warm sandbox of the pool and
// makes its pod ready, as kubelet would, until all run.
func (w *warmEnv) settle(pool string) {
	w.t.Helper()
	for _, s := range w.warm(pool) {
		w.reconcile(s.Name)
		w.podReady(s.Name)
		w.reconcile(s.Name)
		w.wantPhase(s.Name, v1alpha1.SandboxPhaseRunning, v1alpha1.ReasonRunning)
	}
}

func (w *warmEnv) wantPool(name string, replicas, ready int32, reason string) *v1alpha1.SandboxWarmPool {
	w.t.Helper()
	p := w.getPool(name)
	c := meta.FindStatusCondition(p.Status.Conditions, v1alpha1.ConditionReady)
	if p.Status.Replicas != replicas || p.Status.ReadyReplicas != ready || c == nil || c.Reason != reason {
		w.t.Fatalf("pool %s: replicas %d ready %d condition %+v; want %d, %d, %s", name, p.Status.Replicas, p.Status.ReadyReplicas, c, replicas, ready, reason)
	}
	return p
}

var agentIDPattern = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._@:+-]*$`)

func TestUnitWarmPoolScale(t *testing.T) {
	w := newWarmEnv(t, unitTemplate("t"), unitPool("p", "t", 2))
	w.reconcilePool("p")
	p := w.wantPool("p", 2, 0, v1alpha1.ReasonScaling)
	if p.Status.Selector != v1alpha1.LabelWarmPool+"=p" || p.Status.ObservedGeneration != 1 {
		t.Errorf("selector %q, observedGeneration %d", p.Status.Selector, p.Status.ObservedGeneration)
	}
	warm := w.warm("p")
	if len(warm) != 2 {
		t.Fatalf("%d warm sandboxes, want 2", len(warm))
	}
	var tpl v1alpha1.SandboxTemplate
	must(t, w.c.Get(context.Background(), types.NamespacedName{Namespace: unitNS, Name: "t"}, &tpl))
	for _, s := range warm {
		if !strings.HasPrefix(s.Name, "p-") || !metav1.IsControlledBy(&s, p) || s.Labels[v1alpha1.LabelTemplate] != "t" ||
			s.Spec.TemplateRef.Name != "t" || s.Annotations[v1alpha1.AnnotationTemplateHash] != v1alpha1.TemplateHash(&tpl.Spec) ||
			!agentIDPattern.MatchString(s.Spec.AgentID) || !strings.HasPrefix(s.Spec.AgentID, "warm.p.") {
			t.Errorf("warm sandbox %+v", s.ObjectMeta)
		}
	}
	if warm[0].Spec.AgentID == warm[1].Spec.AgentID {
		t.Error("two warm sandboxes share a placeholder agent")
	}
	if evs := strings.Join(w.drainEvents(), "\n"); strings.Count(evs, EventWarmSandboxCreated) != 2 {
		t.Errorf("events %q, want two WarmSandboxCreated", evs)
	}

	// Ready once their pods are; the pods carry the pool's selector label.
	w.settle("p")
	w.reconcilePool("p")
	w.wantPool("p", 2, 2, v1alpha1.ReasonPoolFull)
	var pod corev1.Pod
	must(t, w.c.Get(context.Background(), types.NamespacedName{Namespace: unitNS, Name: warm[0].Name}, &pod))
	if pod.Labels[v1alpha1.LabelWarmPool] != "p" {
		t.Errorf("warm pod labels %v", pod.Labels)
	}
	if evs := strings.Join(w.drainEvents(), "\n"); !strings.Contains(evs, EventPoolFull) {
		t.Errorf("events %q lack PoolFull", evs)
	}
	rv := w.getPool("p").ResourceVersion
	w.reconcilePool("p")
	if w.getPool("p").ResourceVersion != rv || len(w.drainEvents()) != 0 {
		t.Error("a settled pool was rewritten or repeated events")
	}

	// Down to 1: a sandbox goes. Up to 3: two come.
	scale := func(n int32) {
		p := w.getPool("p")
		p.Spec.Replicas = n
		p.Generation++
		must(t, w.c.Update(context.Background(), p))
	}
	scale(1)
	w.reconcilePool("p")
	if got := len(w.warm("p")); got != 1 {
		t.Fatalf("%d warm sandboxes after scaling to 1", got)
	}
	w.wantPool("p", 1, 1, v1alpha1.ReasonPoolFull)
	scale(3)
	w.reconcilePool("p")
	if got := len(w.warm("p")); got != 3 {
		t.Fatalf("%d warm sandboxes after scaling to 3", got)
	}
	w.wantPool("p", 3, 1, v1alpha1.ReasonScaling)
	scale(0)
	w.reconcilePool("p")
	if got := len(w.warm("p")); got != 0 {
		t.Fatalf("%d warm sandboxes after scaling to 0", got)
	}
	w.wantPool("p", 0, 0, v1alpha1.ReasonPoolFull)
}

func TestUnitWarmPoolCreatesOnceWhileCacheLags(t *testing.T) {
	w := newWarmEnv(t, unitTemplate("t"), unitPool("p", "t", 2))
	w.reconcilePool("p")
	// The cache shows none of them yet: the pool must not make more.
	seen := map[string]bool{}
	if n := w.pool.pending(types.UID("uid-p"), seen); n != 2 {
		t.Fatalf("%d creates pending, want 2", n)
	}
	w.clock.Step(createExpiry + time.Second)
	if n := w.pool.pending(types.UID("uid-p"), seen); n != 0 {
		t.Fatalf("%d creates pending after expiry", n)
	}
}

func TestUnitWarmPoolTemplateChangeRolls(t *testing.T) {
	w := newWarmEnv(t, unitTemplate("t"), unitPool("p", "t", 2))
	w.reconcilePool("p")
	w.settle("p")
	old := map[string]bool{}
	for _, s := range w.warm("p") {
		old[s.Name] = true
	}
	var tpl v1alpha1.SandboxTemplate
	must(t, w.c.Get(context.Background(), types.NamespacedName{Namespace: unitNS, Name: "t"}, &tpl))
	tpl.Spec.Image = "agentbox/agentbox-sandbox:other"
	must(t, w.c.Update(context.Background(), &tpl))
	w.reconcilePool("p")
	warm := w.warm("p")
	if len(warm) != 2 {
		t.Fatalf("%d warm sandboxes after the roll", len(warm))
	}
	for _, s := range warm {
		if old[s.Name] || s.Annotations[v1alpha1.AnnotationTemplateHash] != v1alpha1.TemplateHash(&tpl.Spec) {
			t.Errorf("warm sandbox %s (hash %s) is from the old template", s.Name, s.Annotations[v1alpha1.AnnotationTemplateHash])
		}
	}
	w.wantPool("p", 2, 0, v1alpha1.ReasonScaling)
	if evs := strings.Join(w.drainEvents(), "\n"); strings.Count(evs, EventWarmSandboxDeleted) != 2 {
		t.Errorf("events %q, want two WarmSandboxDeleted", evs)
	}
}

func TestUnitWarmPoolTemplateNotFound(t *testing.T) {
	w := newWarmEnv(t, unitPool("p", "nope", 2))
	w.reconcilePool("p")
	w.wantPool("p", 0, 0, v1alpha1.ReasonTemplateNotFound)
	if len(w.warm("p")) != 0 {
		t.Error("created warm sandboxes without a template")
	}
	if evs := strings.Join(w.drainEvents(), "\n"); !strings.Contains(evs, EventTemplateNotFound) {
		t.Errorf("events %q lack TemplateNotFound", evs)
	}
	w.reconcilePool("p")
	if evs := w.drainEvents(); len(evs) != 0 {
		t.Errorf("repeated events %v", evs)
	}
	must(t, w.c.Create(context.Background(), unitTemplate("nope")))
	w.reconcilePool("p")
	w.wantPool("p", 2, 0, v1alpha1.ReasonScaling)
}

// readyPool makes a pool of n ready warm sandboxes of template t and
// returns their names.
func readyPool(t *testing.T, n int32, objs ...client.Object) (*warmEnv, []string) {
	t.Helper()
	w := newWarmEnv(t, append([]client.Object{unitTemplate("t"), unitPool("p", "t", n)}, objs...)...)
	w.reconcilePool("p")
	w.settle("p")
	w.reconcilePool("p")
	w.wantPool("p", n, n, v1alpha1.ReasonPoolFull)
	var names []string
	for _, s := range w.warm("p") {
		names = append(names, s.Name)
	}
	return w, names
}

type childUIDs struct{ pod, claim, secret types.UID }

func (w *warmEnv) children(name string) childUIDs {
	w.t.Helper()
	var pod corev1.Pod
	var claim corev1.PersistentVolumeClaim
	var secret corev1.Secret
	ctx := context.Background()
	must(w.t, w.c.Get(ctx, types.NamespacedName{Namespace: unitNS, Name: PodName(name)}, &pod))
	must(w.t, w.c.Get(ctx, types.NamespacedName{Namespace: unitNS, Name: WorkspaceClaimName(name)}, &claim))
	must(w.t, w.c.Get(ctx, types.NamespacedName{Namespace: unitNS, Name: TLSSecretName(name)}, &secret))
	return childUIDs{pod.UID, claim.UID, secret.UID}
}

// wantAdopted checks that sandbox x took over warm sandbox wName, whose
// children had the UIDs before: same objects, controlled and labelled by
// x, the warm sandbox gone, no pod of x's own.
func (w *warmEnv) wantAdopted(x, wName string, before childUIDs) {
	w.t.Helper()
	t := w.t
	ctx := context.Background()
	sbx := w.wantPhase(x, v1alpha1.SandboxPhaseRunning, v1alpha1.ReasonAdoptedFromWarmPool)
	if sbx.Status.Workload != wName || sbx.WorkloadName() != wName || sbx.Status.PodName != wName || sbx.Status.ServiceEndpoint == "" {
		t.Fatalf("status %+v", sbx.Status)
	}
	if got := w.children(wName); got != before {
		t.Errorf("children %+v, want the warm sandbox's %+v", got, before)
	}
	objs := []client.Object{&corev1.Pod{}, &corev1.PersistentVolumeClaim{}, &corev1.Secret{}}
	for i, name := range []string{PodName(wName), WorkspaceClaimName(wName), TLSSecretName(wName)} {
		must(t, w.c.Get(ctx, types.NamespacedName{Namespace: unitNS, Name: name}, objs[i]))
		assertControlledBy(t, objs[i], sbx)
		l := objs[i].GetLabels()
		if l[v1alpha1.LabelSandbox] != x || l[v1alpha1.LabelAgentIDHash] != v1alpha1.AgentIDHash(sbx.Spec.AgentID) {
			t.Errorf("%T %s labels %v", objs[i], name, l)
		}
		if _, ok := l[v1alpha1.LabelWarmPool]; ok {
			t.Errorf("%T %s still carries the pool label", objs[i], name)
		}
		if len(objs[i].GetOwnerReferences()) != 1 {
			t.Errorf("%T %s owners %+v", objs[i], name, objs[i].GetOwnerReferences())
		}
	}
	if w.exists(&v1alpha1.Sandbox{}, wName) {
		t.Error("the adopted warm sandbox was not deleted")
	}
	if w.exists(&corev1.Pod{}, PodName(x)) || w.exists(&corev1.Secret{}, TLSSecretName(x)) || w.exists(&corev1.PersistentVolumeClaim{}, WorkspaceClaimName(x)) {
		t.Error("the adopter made children of its own")
	}
	var lease coordinationv1.Lease
	if !w.exists(&lease, ActivityClockName(x)) {
		t.Error("the adopter has no Lease of its own")
	}
	// The certificate was issued for the warm sandbox's name, and stays
	// valid for the adopter, whose identity derives from the same name.
	var secret corev1.Secret
	must(t, w.c.Get(ctx, types.NamespacedName{Namespace: unitNS, Name: TLSSecretName(wName)}, &secret))
	if _, err := certRenewTime(secret.Data, w.r.CA, pki.SandboxID("", unitNS, wName), w.clock.Now()); err != nil {
		t.Errorf("certificate: %v", err)
	}
}

func TestUnitAdoption(t *testing.T) {
	w, names := readyPool(t, 1, unitSandbox("x", "t"))
	before := w.children(names[0])
	var secret corev1.Secret
	must(t, w.c.Get(context.Background(), types.NamespacedName{Namespace: unitNS, Name: TLSSecretName(names[0])}, &secret))
	w.drainEvents()

	w.reconcile("x")
	w.wantAdopted("x", names[0], before)
	var after corev1.Secret
	must(t, w.c.Get(context.Background(), types.NamespacedName{Namespace: unitNS, Name: TLSSecretName(names[0])}, &after))
	if string(after.Data["tls.crt"]) != string(secret.Data["tls.crt"]) {
		t.Error("the certificate was re-issued on adoption")
	}
	if evs := strings.Join(w.drainEvents(), "\n"); !strings.Contains(evs, EventAdoptedFromWarmPool) {
		t.Errorf("events %q lack AdoptedFromWarmPool", evs)
	}

	// Settled: once the Lease made on the first pass is seen, another
	// pass writes nothing.
	w.reconcile("x")
	rv := w.sandbox("x").ResourceVersion
	w.reconcile("x")
	if w.sandbox("x").ResourceVersion != rv {
		t.Error("a second pass rewrote the adopted sandbox")
	}

	// The pool replaces it.
	w.reconcilePool("p")
	warm := w.warm("p")
	if len(warm) != 1 || warm[0].Name == names[0] {
		t.Fatalf("pool after adoption: %v", warm)
	}

	// A sandbox of another template starts cold.
	must(t, w.c.Create(context.Background(), unitTemplate("other")))
	must(t, w.c.Create(context.Background(), unitSandbox("y", "other")))
	w.reconcile("y")
	if sbx := w.sandbox("y"); sbx.Status.Workload != "" || !w.exists(&corev1.Pod{}, "y") {
		t.Errorf("a sandbox of another template adopted: %+v", sbx.Status)
	}
}

func TestUnitAdoptionSkipsUnready(t *testing.T) {
	w := newWarmEnv(t, unitTemplate("t"), unitPool("p", "t", 1), unitSandbox("x", "t"))
	w.reconcilePool("p")
	for _, s := range w.warm("p") {
		w.reconcile(s.Name) // a pod, not ready
	}
	w.reconcile("x")
	if sbx := w.sandbox("x"); sbx.Status.Workload != "" || !w.exists(&corev1.Pod{}, "x") {
		t.Errorf("adopted a warm sandbox that is not ready: %+v", sbx.Status)
	}
}

func TestUnitAdoptionRace(t *testing.T) {
	t.Run("stale read", func(t *testing.T) {
		w, names := readyPool(t, 1, unitSandbox("x1", "t"), unitSandbox("x2", "t"))
		before := w.children(names[0])
		// Both read the warm sandbox before either claimed it.
		ctx := context.Background()
		x1, x2 := w.sandbox("x1"), w.sandbox("x2")
		read1, err := w.r.listWarm(ctx, x1)
		must(t, err)
		read2, err := w.r.listWarm(ctx, x2)
		must(t, err)
		var tpl v1alpha1.SandboxTemplate
		must(t, w.c.Get(ctx, types.NamespacedName{Namespace: unitNS, Name: "t"}, &tpl))
		if got, err := w.r.claim(ctx, x1, &tpl, read1); err != nil || got == nil {
			t.Fatalf("the first claim: %v, %v", got, err)
		}
		got, err := w.r.claim(ctx, x2, &tpl, read2)
		if got != nil || !apierrors.IsConflict(err) {
			t.Fatalf("the second claim: %v, %v; want a lost race", got, err)
		}
		if by := w.sandbox(names[0]).Annotations[v1alpha1.AnnotationAdoptedBy]; by != "x1" {
			t.Fatalf("claimed by %q", by)
		}
		// x1 finishes from its claim.
		w.reconcile("x1")
		w.wantAdopted("x1", names[0], before)
		// x2 then starts cold.
		w.reconcile("x2")
		if sbx := w.sandbox("x2"); sbx.Status.Workload != "" || !w.exists(&corev1.Pod{}, "x2") {
			t.Errorf("x2 after losing: %+v", sbx.Status)
		}
	})
	t.Run("concurrent", func(t *testing.T) {
		for range 20 {
			w, names := readyPool(t, 1, unitSandbox("x1", "t"), unitSandbox("x2", "t"))
			var wg sync.WaitGroup
			for _, x := range []string{"x1", "x2"} {
				wg.Add(1)
				go func() {
					defer wg.Done()
					// Errors are retried by the next pass below.
					_, _ = w.r.Reconcile(context.Background(), ctrl.Request{NamespacedName: types.NamespacedName{Namespace: unitNS, Name: x}})
				}()
			}
			wg.Wait()
			for range 3 {
				w.reconcile("x1")
				w.reconcile("x2")
			}
			adopted := 0
			for _, x := range []string{"x1", "x2"} {
				sbx := w.sandbox(x)
				switch sbx.Status.Workload {
				case names[0]:
					adopted++
				case "":
					if !w.exists(&corev1.Pod{}, x) {
						t.Errorf("%s neither adopted nor started cold", x)
					}
				default:
					t.Errorf("%s workload %q", x, sbx.Status.Workload)
				}
			}
			if adopted != 1 {
				t.Fatalf("%d sandboxes adopted the one warm sandbox", adopted)
			}
		}
	})
}

// errCrash is what the test's client returns where the control plane was
// killed.
var errCrash = errors.New("control plane killed here")

func TestUnitAdoptionResumesAfterCrash(t *testing.T) {
	// Each case kills the pass at one write of the adoption; the next pass,
	// and passes of the warm sandbox in between, must converge.
	steps := []struct {
		name string
		hit  func(verb string, obj client.Object) bool
	}{
		{"claim", func(verb string, obj client.Object) bool {
			_, ok := obj.(*v1alpha1.Sandbox)
			return verb == "patch" && ok && obj.GetAnnotations()[v1alpha1.AnnotationAdoptedBy] != ""
		}},
		{"move pod", func(verb string, obj client.Object) bool { _, ok := obj.(*corev1.Pod); return verb == "patch" && ok }},
		{"move claim", func(verb string, obj client.Object) bool {
			_, ok := obj.(*corev1.PersistentVolumeClaim)
			return verb == "patch" && ok
		}},
		{"move secret", func(verb string, obj client.Object) bool { _, ok := obj.(*corev1.Secret); return verb == "patch" && ok }},
		{"delete warm", func(verb string, obj client.Object) bool {
			_, ok := obj.(*v1alpha1.Sandbox)
			return verb == "delete" && ok
		}},
	}
	for _, step := range steps {
		t.Run(step.name, func(t *testing.T) {
			w, names := readyPool(t, 1, unitSandbox("x", "t"))
			before := w.children(names[0])
			w.wc.fail = func(verb string, obj client.Object) error {
				if step.hit(verb, obj) {
					return errCrash
				}
				return nil
			}
			_, err := w.r.Reconcile(context.Background(), ctrl.Request{NamespacedName: types.NamespacedName{Namespace: unitNS, Name: "x"}})
			if !errors.Is(err, errCrash) {
				t.Fatalf("pass killed at %s: %v", step.name, err)
			}
			w.wc.fail = nil
			// The warm sandbox's own pass must leave a claimed one alone.
			if w.exists(&v1alpha1.Sandbox{}, names[0]) {
				w.reconcile(names[0])
			}
			w.reconcilePool("p")
			w.reconcile("x")
			w.wantAdopted("x", names[0], before)
		})
	}
}

func TestUnitClaimedWarmSandboxIsLeftAlone(t *testing.T) {
	w, names := readyPool(t, 1)
	s := w.sandbox(names[0])
	s.Annotations[v1alpha1.AnnotationAdoptedBy] = "gone"
	must(t, w.c.Update(context.Background(), s))
	// Its certificate would be re-issued if its reconciler still ran.
	w.clock.Step(300 * 24 * time.Hour)
	before := w.children(names[0])
	var secret corev1.Secret
	must(t, w.c.Get(context.Background(), types.NamespacedName{Namespace: unitNS, Name: TLSSecretName(names[0])}, &secret))
	w.reconcile(names[0])
	var after corev1.Secret
	must(t, w.c.Get(context.Background(), types.NamespacedName{Namespace: unitNS, Name: TLSSecretName(names[0])}, &after))
	if after.ResourceVersion != secret.ResourceVersion || w.children(names[0]) != before {
		t.Error("the reconciler touched a claimed warm sandbox's children")
	}
	// Its adopter does not exist: the pool drops the claim and replaces it.
	w.reconcilePool("p")
	if w.exists(&v1alpha1.Sandbox{}, names[0]) {
		t.Error("a claim whose adopter is gone was kept")
	}
	if got := w.warm("p"); len(got) != 1 || got[0].Name == names[0] {
		t.Errorf("pool after dropping the claim: %d sandboxes", len(got))
	}
}

func TestUnitWarmSandboxNeverIdleStops(t *testing.T) {
	sbx := idleSandbox("w", time.Minute)
	sbx.Labels = map[string]string{v1alpha1.LabelWarmPool: "p", v1alpha1.LabelTemplate: "t"}
	f, d := newLifecycleEnv(t, sbx)
	f.reconcile("w")
	f.podReady("w")
	res := f.reconcile("w")
	if res.RequeueAfter > 0 && res.RequeueAfter <= time.Minute {
		t.Errorf("requeue %s: a warm sandbox is woken for an idle stop", res.RequeueAfter)
	}
	f.clock.Step(2 * time.Hour)
	f.reconcile("w")
	f.wantPhase("w", v1alpha1.SandboxPhaseRunning, v1alpha1.ReasonRunning)
	if len(d.taken) != 0 || !f.exists(&corev1.Pod{}, "w") {
		t.Errorf("the warm sandbox was stopped: snapshots %v", d.taken)
	}
}

func TestUnitTemplateHashIgnoresMetadata(t *testing.T) {
	a, b := unitTemplate("a"), unitTemplate("b")
	b.Generation = 7
	if v1alpha1.TemplateHash(&a.Spec) != v1alpha1.TemplateHash(&b.Spec) {
		t.Error("equal specs hash differently")
	}
	b.Spec.Image = "x"
	if v1alpha1.TemplateHash(&a.Spec) == v1alpha1.TemplateHash(&b.Spec) {
		t.Error("different specs hash the same")
	}
}
