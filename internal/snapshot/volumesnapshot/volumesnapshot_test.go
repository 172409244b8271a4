package volumesnapshot_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	snapshotv1 "github.com/kubernetes-csi/external-snapshotter/client/v6/apis/volumesnapshot/v1"
	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/client/fake"
	"sigs.k8s.io/controller-runtime/pkg/client/interceptor"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	"github.com/agentbox/terraform-provider-agentbox/internal/snapshot"
	"github.com/agentbox/terraform-provider-agentbox/internal/snapshot/volumesnapshot"
)

const ns = "team-a"

func testScheme(t *testing.T) *runtime.Scheme {
	t.Helper()
	s := runtime.NewScheme()
	if err := clientgoscheme.AddToScheme(s); err != nil {
		t.Fatal(err)
	}
	if err := volumesnapshot.AddToScheme(s); err != nil {
		t.Fatal(err)
	}
	return s
}

func sandbox() *v1alpha1.Sandbox {
	return &v1alpha1.Sandbox{ObjectMeta: metav1.ObjectMeta{Name: "agent-1", Namespace: ns, UID: "uid-agent-1"}}
}

func claim() *corev1.PersistentVolumeClaim {
	return &corev1.PersistentVolumeClaim{ObjectMeta: metav1.ObjectMeta{Name: "agent-1-workspace", Namespace: ns}}
}

func request(class *string) snapshot.Request {
	tpl := &v1alpha1.SandboxTemplate{ObjectMeta: metav1.ObjectMeta{Name: "python", Namespace: ns}}
	tpl.Spec.Workspace.VolumeSnapshotClassName = class
	return snapshot.Request{Sandbox: sandbox(), Template: tpl, ClaimName: "agent-1-workspace", Name: "agent-1-1"}
}

type env struct {
	c   client.Client
	d   *volumesnapshot.Driver
	now time.Time
}

func newEnv(t *testing.T, funcs *interceptor.Funcs, objs ...client.Object) *env {
	t.Helper()
	e := &env{now: time.Now().Truncate(time.Second)}
	if funcs == nil {
		funcs = &interceptor.Funcs{}
	}
	if funcs.Create == nil {
		// The fake client leaves creationTimestamp unset; the API server
		// sets it, and the driver's deadlines count from it.
		funcs.Create = func(ctx context.Context, c client.WithWatch, obj client.Object, opts ...client.CreateOption) error {
			obj.SetCreationTimestamp(metav1.NewTime(e.now))
			return c.Create(ctx, obj, opts...)
		}
	}
	b := fake.NewClientBuilder().WithScheme(testScheme(t)).WithObjects(objs...).WithStatusSubresource(&snapshotv1.VolumeSnapshot{}).WithInterceptorFuncs(*funcs)
	e.c = b.Build()
	e.d = volumesnapshot.New(e.c, volumesnapshot.Options{ErrorGrace: time.Minute, CutTimeout: 5 * time.Minute, Now: func() time.Time { return e.now }})
	return e
}

func (e *env) get(t *testing.T) *snapshotv1.VolumeSnapshot {
	t.Helper()
	vs := &snapshotv1.VolumeSnapshot{}
	if err := e.c.Get(context.Background(), types.NamespacedName{Namespace: ns, Name: "agent-1-1"}, vs); err != nil {
		t.Fatal(err)
	}
	return vs
}

// setStatus plays the snapshot-controller's part.
func (e *env) setStatus(t *testing.T, st *snapshotv1.VolumeSnapshotStatus) {
	t.Helper()
	vs := e.get(t)
	vs.Status = st
	if err := e.c.Status().Update(context.Background(), vs); err != nil {
		t.Fatal(err)
	}
}

func (e *env) take(t *testing.T, req snapshot.Request) snapshot.State {
	t.Helper()
	st, err := e.d.Take(context.Background(), req)
	if err != nil {
		t.Fatalf("Take: %v", err)
	}
	return st
}

func TestTakeCreatesOwnedSnapshotAndReportsReady(t *testing.T) {
	e := newEnv(t, nil, claim())
	if e.d.Name() != "volumesnapshot" {
		t.Errorf("Name() = %q", e.d.Name())
	}
	req := request(ptr.To("csi-snap"))
	if st := e.take(t, req); st.Ready || st.Failed != "" {
		t.Fatalf("first Take = %+v, want pending", st)
	}
	vs := e.get(t)
	if got := ptr.Deref(vs.Spec.Source.PersistentVolumeClaimName, ""); got != "agent-1-workspace" {
		t.Errorf("source claim = %q", got)
	}
	if got := ptr.Deref(vs.Spec.VolumeSnapshotClassName, ""); got != "csi-snap" {
		t.Errorf("class = %q, want csi-snap", got)
	}
	if vs.Labels[v1alpha1.LabelSandbox] != "agent-1" {
		t.Errorf("labels = %v", vs.Labels)
	}
	ref := metav1.GetControllerOf(vs)
	if ref == nil || ref.Kind != "Sandbox" || ref.Name != "agent-1" || ref.UID != "uid-agent-1" || !ptr.Deref(ref.BlockOwnerDeletion, false) {
		t.Errorf("controller reference = %+v", ref)
	}
	// Calling again neither fails nor makes a second object.
	if st := e.take(t, req); st.Ready || st.Failed != "" {
		t.Fatalf("second Take = %+v, want pending", st)
	}
	list := &snapshotv1.VolumeSnapshotList{}
	if err := e.c.List(context.Background(), list); err != nil || len(list.Items) != 1 {
		t.Fatalf("list = %d items, %v", len(list.Items), err)
	}

	created := metav1.NewTime(time.Date(2026, 11, 22, 10, 0, 0, 0, time.UTC))
	size := resource.MustParse("1Gi")
	e.setStatus(t, &snapshotv1.VolumeSnapshotStatus{BoundVolumeSnapshotContentName: ptr.To("snapcontent-1"), CreationTime: &created, ReadyToUse: ptr.To(true), RestoreSize: &size})
	st := e.take(t, req)
	if !st.Ready || st.Failed != "" || st.SizeBytes != 1<<30 || !st.ReadyTime.Equal(created.Time) {
		t.Fatalf("Take on a ready snapshot = %+v", st)
	}
}

func TestTakeWithoutClassLeavesItToTheDefault(t *testing.T) {
	e := newEnv(t, nil, claim())
	e.take(t, request(nil))
	if c := e.get(t).Spec.VolumeSnapshotClassName; c != nil {
		t.Errorf("class = %q, want unset (the default class)", *c)
	}
	// A request without a template works the same way.
	e2 := newEnv(t, nil, claim())
	req := request(nil)
	req.Template = nil
	e2.take(t, req)
}

func TestTakeErrorIsFinalOnlyAfterGrace(t *testing.T) {
	e := newEnv(t, nil, claim())
	req := request(nil)
	e.take(t, req)
	e.now = e.get(t).CreationTimestamp.Time
	e.setStatus(t, &snapshotv1.VolumeSnapshotStatus{
		ReadyToUse: ptr.To(false),
		Error:      &snapshotv1.VolumeSnapshotError{Message: ptr.To(`volumesnapshotclass "x" not found`)},
	})
	if st := e.take(t, req); st.Failed != "" || st.Ready {
		t.Fatalf("Take with a fresh error = %+v, want pending: external-snapshotter retries", st)
	}
	e.now = e.now.Add(2 * time.Minute)
	st := e.take(t, req)
	if !strings.Contains(st.Failed, `volumesnapshotclass "x" not found`) {
		t.Fatalf("Take with a lasting error = %+v, want Failed with the message", st)
	}
	// An error that cleared (the sidecar's retry worked) is not a failure.
	e.setStatus(t, &snapshotv1.VolumeSnapshotStatus{ReadyToUse: ptr.To(true)})
	if st := e.take(t, req); !st.Ready {
		t.Fatalf("Take after recovery = %+v, want Ready", st)
	}
}

func TestTakeNeverCutFailsAfterCutTimeout(t *testing.T) {
	e := newEnv(t, nil, claim())
	req := request(ptr.To("no-such-driver"))
	e.take(t, req)
	created := e.get(t).CreationTimestamp.Time
	// Bound to a content that no sidecar serves: no error, no creation time.
	e.setStatus(t, &snapshotv1.VolumeSnapshotStatus{BoundVolumeSnapshotContentName: ptr.To("snapcontent-1"), ReadyToUse: ptr.To(false)})
	e.now = created.Add(4 * time.Minute)
	if st := e.take(t, req); st.Failed != "" {
		t.Fatalf("Take before the cut timeout = %+v", st)
	}
	e.now = created.Add(6 * time.Minute)
	if st := e.take(t, req); !strings.Contains(st.Failed, "no-such-driver") {
		t.Fatalf("Take after the cut timeout = %+v, want Failed naming the class", st)
	}
	// Once cut, a slow upload is waited for without a limit.
	cut := metav1.NewTime(created.Add(time.Minute))
	e.setStatus(t, &snapshotv1.VolumeSnapshotStatus{BoundVolumeSnapshotContentName: ptr.To("snapcontent-1"), CreationTime: &cut, ReadyToUse: ptr.To(false)})
	e.now = created.Add(time.Hour)
	if st := e.take(t, req); st.Failed != "" || st.Ready {
		t.Fatalf("Take on a cut, unready snapshot = %+v, want pending", st)
	}
}

func TestTakeMissingClaimFails(t *testing.T) {
	e := newEnv(t, nil)
	st := e.take(t, request(nil))
	if !strings.Contains(st.Failed, "agent-1-workspace") {
		t.Fatalf("Take without the claim = %+v, want Failed", st)
	}
	list := &snapshotv1.VolumeSnapshotList{}
	if err := e.c.List(context.Background(), list); err != nil || len(list.Items) != 0 {
		t.Fatalf("a snapshot was created: %d, %v", len(list.Items), err)
	}
}

func TestTakeAfterClaimDeletedStillReportsReady(t *testing.T) {
	// The controller deletes the claim once the snapshot is ready; after a
	// restart it asks again and must still hear Ready.
	e := newEnv(t, nil, claim())
	req := request(nil)
	e.take(t, req)
	e.setStatus(t, &snapshotv1.VolumeSnapshotStatus{ReadyToUse: ptr.To(true)})
	if err := e.c.Delete(context.Background(), claim()); err != nil {
		t.Fatal(err)
	}
	if st := e.take(t, req); !st.Ready {
		t.Fatalf("Take = %+v, want Ready", st)
	}
}

func TestTakeNameTakenBySomethingElse(t *testing.T) {
	other := &snapshotv1.VolumeSnapshot{
		ObjectMeta: metav1.ObjectMeta{Name: "agent-1-1", Namespace: ns},
		Spec:       snapshotv1.VolumeSnapshotSpec{Source: snapshotv1.VolumeSnapshotSource{PersistentVolumeClaimName: ptr.To("someone-else")}},
	}
	e := newEnv(t, nil, claim(), other)
	if st := e.take(t, request(nil)); !strings.Contains(st.Failed, "not sandbox agent-1's") {
		t.Fatalf("Take = %+v, want Failed", st)
	}
}

func TestTakeAPIErrors(t *testing.T) {
	boom := apierrors.NewServiceUnavailable("etcd is down")
	t.Run("get", func(t *testing.T) {
		e := newEnv(t, &interceptor.Funcs{Get: func(ctx context.Context, c client.WithWatch, key client.ObjectKey, obj client.Object, opts ...client.GetOption) error {
			return boom
		}}, claim())
		if _, err := e.d.Take(context.Background(), request(nil)); !errors.Is(err, boom) {
			t.Fatalf("Take = %v, want the API error wrapped", err)
		}
	})
	t.Run("create", func(t *testing.T) {
		e := newEnv(t, &interceptor.Funcs{Create: func(ctx context.Context, c client.WithWatch, obj client.Object, opts ...client.CreateOption) error {
			return boom
		}}, claim())
		if _, err := e.d.Take(context.Background(), request(nil)); !errors.Is(err, boom) {
			t.Fatalf("Take = %v, want the API error wrapped", err)
		}
	})
	t.Run("create lost a race", func(t *testing.T) {
		// Another writer created the snapshot between the Get and the Create.
		var e *env
		e = newEnv(t, &interceptor.Funcs{Create: func(ctx context.Context, c client.WithWatch, obj client.Object, opts ...client.CreateOption) error {
			if err := c.Create(ctx, obj, opts...); err != nil {
				return err
			}
			return apierrors.NewAlreadyExists(schema.GroupResource{Group: volumesnapshot.APIGroup, Resource: "volumesnapshots"}, obj.GetName())
		}}, claim())
		if st, err := e.d.Take(context.Background(), request(nil)); err != nil || st.Failed != "" {
			t.Fatalf("Take = %+v, %v; want pending", st, err)
		}
	})
	t.Run("being deleted", func(t *testing.T) {
		e := newEnv(t, nil, claim())
		e.take(t, request(nil))
		vs := e.get(t)
		vs.Finalizers = []string{"snapshot.storage.kubernetes.io/volumesnapshot-as-source-protection"}
		if err := e.c.Update(context.Background(), vs); err != nil {
			t.Fatal(err)
		}
		if err := e.c.Delete(context.Background(), vs); err != nil {
			t.Fatal(err)
		}
		if _, err := e.d.Take(context.Background(), request(nil)); err == nil || !strings.Contains(err.Error(), "being deleted") {
			t.Fatalf("Take = %v, want a retryable error", err)
		}
	})
}

func TestPrepareClaim(t *testing.T) {
	d := volumesnapshot.New(fake.NewClientBuilder().WithScheme(testScheme(t)).Build(), volumesnapshot.Options{})
	c := claim()
	d.PrepareClaim(&v1alpha1.SandboxSnapshot{Name: "agent-1-1"}, c)
	ds, ref := c.Spec.DataSource, c.Spec.DataSourceRef
	if ds == nil || ptr.Deref(ds.APIGroup, "") != "snapshot.storage.k8s.io" || ds.Kind != "VolumeSnapshot" || ds.Name != "agent-1-1" {
		t.Errorf("dataSource = %+v", ds)
	}
	if ref == nil || ptr.Deref(ref.APIGroup, "") != "snapshot.storage.k8s.io" || ref.Kind != "VolumeSnapshot" || ref.Name != "agent-1-1" || ref.Namespace != nil {
		t.Errorf("dataSourceRef = %+v", ref)
	}
	// Without a snapshot the claim is left alone.
	c2 := claim()
	d.PrepareClaim(nil, c2)
	if c2.Spec.DataSource != nil || c2.Spec.DataSourceRef != nil {
		t.Error("PrepareClaim(nil) changed the claim")
	}
	if err := d.Restore(context.Background(), snapshot.RestoreRequest{}); err != nil {
		t.Errorf("Restore = %v", err)
	}
}

func TestDelete(t *testing.T) {
	e := newEnv(t, nil, claim())
	e.take(t, request(nil))
	if err := e.d.Delete(context.Background(), sandbox(), "agent-1-1"); err != nil {
		t.Fatal(err)
	}
	vs := &snapshotv1.VolumeSnapshot{}
	if err := e.c.Get(context.Background(), types.NamespacedName{Namespace: ns, Name: "agent-1-1"}, vs); !apierrors.IsNotFound(err) {
		t.Fatalf("after Delete: %v", err)
	}
	if err := e.d.Delete(context.Background(), sandbox(), "agent-1-1"); err != nil {
		t.Fatalf("second Delete = %v, want nil", err)
	}
	boom := apierrors.NewForbidden(schema.GroupResource{Group: volumesnapshot.APIGroup, Resource: "volumesnapshots"}, "agent-1-1", errors.New("no"))
	e2 := newEnv(t, &interceptor.Funcs{Delete: func(ctx context.Context, c client.WithWatch, obj client.Object, opts ...client.DeleteOption) error {
		return boom
	}})
	if err := e2.d.Delete(context.Background(), sandbox(), "agent-1-1"); !errors.Is(err, boom) {
		t.Fatalf("Delete = %v, want the API error wrapped", err)
	}
}

func snapshotClass(name, driver string, isDefault bool) *snapshotv1.VolumeSnapshotClass {
	c := &snapshotv1.VolumeSnapshotClass{ObjectMeta: metav1.ObjectMeta{Name: name}, Driver: driver, DeletionPolicy: snapshotv1.VolumeSnapshotContentDelete}
	if isDefault {
		c.Annotations = map[string]string{"snapshot.storage.kubernetes.io/is-default-class": "true"}
	}
	return c
}

func storageClass(name, provisioner string, isDefault bool) *storagev1.StorageClass {
	c := &storagev1.StorageClass{ObjectMeta: metav1.ObjectMeta{Name: name}, Provisioner: provisioner}
	if isDefault {
		c.Annotations = map[string]string{"storageclass.kubernetes.io/is-default-class": "true"}
	}
	return c
}

// The check a control plane runs at start: the API must be served, and
// the class the driver uses must exist and fit the workspaces'
// StorageClass.
func TestCheck(t *testing.T) {
	ctx := context.Background()
	reason := func(err error) string {
		var p *snapshot.Problem
		if errors.As(err, &p) {
			return p.Reason
		}
		if err != nil {
			return "error: " + err.Error()
		}
		return ""
	}

	// No snapshot CRDs: the RESTMapper does not know the kind.
	bare := meta.NewDefaultRESTMapper(nil)
	c := fake.NewClientBuilder().WithScheme(testScheme(t)).WithRESTMapper(bare).Build()
	err := volumesnapshot.New(c, volumesnapshot.Options{APIReader: c}).Check(ctx)
	if reason(err) != v1alpha1.ReasonSnapshotAPIMissing || !strings.Contains(err.Error(), "VolumeSnapshot") {
		t.Fatalf("Check without the CRDs: %v", err)
	}
	t.Logf("without the CRDs: %v", err)

	for name, tc := range map[string]struct {
		class string
		objs  []client.Object
		want  string
	}{
		"default class of the default provisioner": {"", []client.Object{storageClass("local", "csi.example.com", true), snapshotClass("snap", "csi.example.com", true)}, ""},
		"no class at all":                          {"", []client.Object{storageClass("local", "csi.example.com", true)}, v1alpha1.ReasonVolumeSnapshotClassNotFound},
		"default class of another driver": {"", []client.Object{
			storageClass("local", "rancher.io/local-path", true), snapshotClass("snap", "csi.example.com", true),
		}, v1alpha1.ReasonVolumeSnapshotClassNotFound},
		"two defaults for the driver": {"", []client.Object{
			storageClass("local", "csi.example.com", true), snapshotClass("a", "csi.example.com", true), snapshotClass("b", "csi.example.com", true),
		}, v1alpha1.ReasonVolumeSnapshotClassNotFound},
		"no default StorageClass, a default class": {"", []client.Object{snapshotClass("snap", "csi.example.com", true)}, ""},
		"configured class missing":                 {"fast", []client.Object{snapshotClass("snap", "csi.example.com", true)}, v1alpha1.ReasonVolumeSnapshotClassNotFound},
		"configured class of another driver": {"fast", []client.Object{
			storageClass("local", "rancher.io/local-path", true), snapshotClass("fast", "csi.example.com", false),
		}, v1alpha1.ReasonVolumeSnapshotClassMismatch},
		"configured class fits": {"fast", []client.Object{storageClass("local", "csi.example.com", true), snapshotClass("fast", "csi.example.com", false)}, ""},
	} {
		t.Run(name, func(t *testing.T) {
			mapper := meta.NewDefaultRESTMapper(nil)
			mapper.Add(snapshotv1.SchemeGroupVersion.WithKind("VolumeSnapshot"), meta.RESTScopeNamespace)
			mapper.Add(snapshotv1.SchemeGroupVersion.WithKind("VolumeSnapshotClass"), meta.RESTScopeRoot)
			c := fake.NewClientBuilder().WithScheme(testScheme(t)).WithRESTMapper(mapper).WithObjects(tc.objs...).Build()
			err := volumesnapshot.New(c, volumesnapshot.Options{Class: tc.class, APIReader: c}).Check(ctx)
			if got := reason(err); got != tc.want {
				t.Fatalf("Check: %v (reason %q), want reason %q", err, got, tc.want)
			}
			if err != nil {
				t.Logf("%v", err)
			}
		})
	}
}

// With an API reader, a template's class that does not exist (or does not
// fit the claim's StorageClass) fails Take at once, before anything is
// created, with the reason.
func TestTakeChecksTheClassFirst(t *testing.T) {
	wc := claim()
	wc.Spec.StorageClassName = ptr.To("local")
	objs := []client.Object{wc, storageClass("local", "csi.example.com", true), snapshotClass("other", "csi.other.com", false)}
	e := newEnv(t, nil, objs...)
	e.d = volumesnapshot.New(e.c, volumesnapshot.Options{APIReader: e.c})
	for class, want := range map[string]string{"missing": v1alpha1.ReasonVolumeSnapshotClassNotFound, "other": v1alpha1.ReasonVolumeSnapshotClassMismatch} {
		st, err := e.d.Take(context.Background(), request(ptr.To(class)))
		var p *snapshot.Problem
		if !errors.As(err, &p) || p.Reason != want || st.Ready || st.Failed != "" {
			t.Errorf("Take with class %q = %+v, %v; want a %s problem", class, st, err, want)
		}
	}
	var list snapshotv1.VolumeSnapshotList
	if err := e.c.List(context.Background(), &list); err != nil || len(list.Items) != 0 {
		t.Errorf("%d VolumeSnapshots created (%v), want none", len(list.Items), err)
	}
}
