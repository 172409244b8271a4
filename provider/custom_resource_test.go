package provider

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/terraform-plugin-framework/diag"
	"github.com/hashicorp/terraform-plugin-framework/resource"
	"github.com/hashicorp/terraform-plugin-framework/tfsdk"
	"github.com/hashicorp/terraform-plugin-go/tftypes"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
	k8stypes "k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/client/fake"
	"sigs.k8s.io/controller-runtime/pkg/client/interceptor"

	agentboxv1alpha1 "github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
)

// The shared steps' error paths, against a fake client: the acceptance
// tests drive the happy paths through terraform on a real cluster.

func onlyError(t *testing.T, diags diag.Diagnostics) diag.Diagnostic {
	t.Helper()
	if len(diags) != 1 || diags[0].Severity() != diag.SeverityError {
		t.Fatalf("want one error, got %v", diags)
	}
	return diags[0]
}

func TestCRKindCreateExistingSaysImport(t *testing.T) {
	ctx := context.Background()
	pool := &agentboxv1alpha1.SandboxWarmPool{ObjectMeta: metav1.ObjectMeta{Namespace: "team", Name: "py"}}
	gv := &agentboxv1alpha1.GVisorNodePool{ObjectMeta: metav1.ObjectMeta{Name: "gvisor"}}
	c := fake.NewClientBuilder().WithScheme(scheme).WithObjects(pool.DeepCopy(), gv.DeepCopy()).Build()
	for _, tc := range []struct {
		kind          crKind
		obj           client.Object
		summary, want string
	}{
		{warmPoolCR, pool, "SandboxWarmPool already exists",
			"team/py exists already. Import it with `terraform import agentbox_warm_pool.<name> team/py`."},
		{nodePoolCR, gv, "GVisorNodePool already exists",
			"gvisor exists already. Import it with `terraform import agentbox_node_pool.<name> gvisor`."},
	} {
		var diags diag.Diagnostics
		if tc.kind.create(ctx, c, tc.obj, &diags) {
			t.Fatalf("%s: create of an existing object succeeded", tc.kind.kind)
		}
		d := onlyError(t, diags)
		if d.Summary() != tc.summary || d.Detail() != tc.want {
			t.Errorf("%s: got %q / %q, want %q / %q", tc.kind.kind, d.Summary(), d.Detail(), tc.summary, tc.want)
		}
	}
}

func TestCRKindReadMissingRemovesFromState(t *testing.T) {
	ctx := context.Background()
	var sr resource.SchemaResponse
	NewWarmPoolResource().Schema(ctx, resource.SchemaRequest{}, &sr)
	typ := sr.Schema.Type().TerraformType(ctx)
	resp := &resource.ReadResponse{State: tfsdk.State{Schema: sr.Schema, Raw: tftypes.NewValue(typ, tftypes.UnknownValue)}}
	c := fake.NewClientBuilder().WithScheme(scheme).Build()

	var obj agentboxv1alpha1.SandboxWarmPool
	if warmPoolCR.read(ctx, c, k8stypes.NamespacedName{Namespace: "team", Name: "gone"}, &obj, resp) {
		t.Fatal("read of a missing object succeeded")
	}
	if resp.Diagnostics.HasError() || !resp.State.Raw.IsNull() {
		t.Errorf("want the resource removed without an error, got state %v and %v", resp.State.Raw, resp.Diagnostics)
	}
}

func TestUpdateObjectRetriesConflicts(t *testing.T) {
	ctx := context.Background()
	key := k8stypes.NamespacedName{Namespace: "team", Name: "py"}
	conflicts := 2
	c := fake.NewClientBuilder().WithScheme(scheme).
		WithObjects(&agentboxv1alpha1.SandboxWarmPool{ObjectMeta: metav1.ObjectMeta{Namespace: key.Namespace, Name: key.Name}}).
		WithInterceptorFuncs(interceptor.Funcs{Update: func(ctx context.Context, c client.WithWatch, obj client.Object, opts ...client.UpdateOption) error {
			if conflicts > 0 {
				conflicts--
				return apierrors.NewConflict(schema.GroupResource{Resource: "sandboxwarmpools"}, obj.GetName(), nil)
			}
			return c.Update(ctx, obj, opts...)
		}}).Build()

	var obj agentboxv1alpha1.SandboxWarmPool
	var diags diag.Diagnostics
	if !updateObject(ctx, warmPoolCR, c, key, &obj, func() { obj.Spec.Replicas = 3 }, &diags) {
		t.Fatalf("update failed: %v", diags)
	}
	var got agentboxv1alpha1.SandboxWarmPool
	if err := c.Get(ctx, key, &got); err != nil || got.Spec.Replicas != 3 || conflicts != 0 {
		t.Errorf("want replicas 3 after two conflicts, got %d (%d conflicts left, %v)", got.Spec.Replicas, conflicts, err)
	}

	diags = nil
	missing := k8stypes.NamespacedName{Namespace: "team", Name: "gone"}
	if updateObject(ctx, warmPoolCR, c, missing, &obj, func() {}, &diags) {
		t.Fatal("update of a missing object succeeded")
	}
	if d := onlyError(t, diags); d.Summary() != "Cannot update SandboxWarmPool team/gone" {
		t.Errorf("got %q", d.Summary())
	}
}

func TestCRKindDelete(t *testing.T) {
	ctx := context.Background()
	c := fake.NewClientBuilder().WithScheme(scheme).
		WithObjects(&agentboxv1alpha1.SandboxWarmPool{ObjectMeta: metav1.ObjectMeta{Namespace: "team", Name: "py"}}).Build()

	var diags diag.Diagnostics
	warmPoolCR.delete(ctx, c, &agentboxv1alpha1.SandboxWarmPool{ObjectMeta: metav1.ObjectMeta{Namespace: "team", Name: "py"}}, time.Minute, &diags)
	if diags.HasError() {
		t.Fatalf("delete: %v", diags)
	}
	err := c.Get(ctx, k8stypes.NamespacedName{Namespace: "team", Name: "py"}, &agentboxv1alpha1.SandboxWarmPool{})
	if !apierrors.IsNotFound(err) {
		t.Errorf("want the pool gone, got %v", err)
	}
	// A destroy of what is gone already succeeds: someone else deleted it.
	warmPoolCR.delete(ctx, c, &agentboxv1alpha1.SandboxWarmPool{ObjectMeta: metav1.ObjectMeta{Namespace: "team", Name: "py"}}, time.Minute, &diags)
	if diags.HasError() {
		t.Errorf("delete of a missing object: %v", diags)
	}
}

// TestCRKindDeleteTimeoutNamesTheObject: a node pool whose finalizer nobody
// removes is still there when the wait ends, and the error says what may be
// holding it.
func TestCRKindDeleteTimeoutNamesTheObject(t *testing.T) {
	ctx := context.Background()
	gv := &agentboxv1alpha1.GVisorNodePool{ObjectMeta: metav1.ObjectMeta{Name: "gvisor", Finalizers: []string{agentboxv1alpha1.Finalizer}}}
	c := fake.NewClientBuilder().WithScheme(scheme).WithObjects(gv).Build()

	var diags diag.Diagnostics
	nodePoolCR.delete(ctx, c, &agentboxv1alpha1.GVisorNodePool{ObjectMeta: metav1.ObjectMeta{Name: "gvisor"}}, time.Millisecond, &diags)
	d := onlyError(t, diags)
	if d.Summary() != "GVisorNodePool gvisor was not deleted within 1ms" {
		t.Errorf("summary %q", d.Summary())
	}
	if !strings.HasSuffix(d.Detail(), "nothing removes the pool's finalizer "+agentboxv1alpha1.Finalizer+".") {
		t.Errorf("detail %q does not name the finalizer", d.Detail())
	}
}

func TestWaitReadyTimeoutKeepsLastStatus(t *testing.T) {
	ctx := context.Background()
	key := k8stypes.NamespacedName{Namespace: "team", Name: "py"}
	c := fake.NewClientBuilder().WithScheme(scheme).WithObjects(&agentboxv1alpha1.SandboxWarmPool{
		ObjectMeta: metav1.ObjectMeta{Namespace: key.Namespace, Name: key.Name},
		Spec:       agentboxv1alpha1.SandboxWarmPoolSpec{Replicas: 2},
		Status:     agentboxv1alpha1.SandboxWarmPoolStatus{ReadyReplicas: 1},
	}).Build()

	var pool agentboxv1alpha1.SandboxWarmPool
	var diags diag.Diagnostics
	var refreshed int32
	waitReady(ctx, warmPoolCR, c, key, &pool, 2*time.Second, func() (bool, string) {
		return false, "still filling"
	}, func() { refreshed = pool.Status.ReadyReplicas }, &diags)
	d := onlyError(t, diags)
	if d.Summary() != "SandboxWarmPool team/py did not become ready" || !strings.Contains(d.Detail(), "still filling") {
		t.Errorf("got %q / %q", d.Summary(), d.Detail())
	}
	if refreshed != 1 {
		t.Errorf("refresh saw %d ready replicas, want the last status seen (1)", refreshed)
	}
}
