package provider

import (
	"context"
	"fmt"
	"time"

	"github.com/hashicorp/terraform-plugin-framework/diag"
	"github.com/hashicorp/terraform-plugin-framework/resource"
	"github.com/hashicorp/terraform-plugin-framework/types"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	k8stypes "k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/util/retry"
	"sigs.k8s.io/controller-runtime/pkg/client"
)

// The steps that every resource wrapping one agentbox custom resource takes
// (agentbox_sandbox_template, _warm_pool, _egress_proxy, _sandbox and
// _node_pool), written once so that each says the same thing in the same
// case: an object that exists already is one to import, an object gone from
// the cluster is gone from state, and a wait that times out says what it
// saw last.

// crKind is one custom resource kind as its Terraform resource shows it.
type crKind struct {
	// kind is the Kubernetes kind, as diagnostics name it.
	kind string
	// tfType is the resource type without the provider's prefix.
	tfType string
	// clusterScoped objects have no namespace, and their ID is the name.
	clusterScoped bool
	// foregroundDelete makes a destroy wait for the object's dependents
	// too, not only for the object.
	foregroundDelete bool
	// deleteTimeoutHint is added to the error of a destroy that times out.
	deleteTimeoutHint string
}

// crObject is a pointer to a custom resource's Go type.
type crObject[T any] interface {
	*T
	client.Object
}

// modelSource is where a model is read from: a plan or a state.
type modelSource interface {
	Get(ctx context.Context, target any) diag.Diagnostics
}

// modelAndClient reads the plan or state into m and returns the object
// client, or nil when either failed (the diagnostics then say why).
func modelAndClient(ctx context.Context, d *providerData, from modelSource, m any, diags *diag.Diagnostics) client.Client {
	diags.Append(from.Get(ctx, m)...)
	c := objectsOrDiag(d, diags)
	if diags.HasError() {
		return nil
	}
	return c
}

// id is the Terraform ID of the object key names, which diagnostics name it
// by too.
func (k crKind) id(key k8stypes.NamespacedName) string {
	if k.clusterScoped {
		return key.Name
	}
	return objectID(key.Namespace, key.Name)
}

// create creates obj; false if it could not, with a diagnostic that says
// why.
func (k crKind) create(ctx context.Context, c client.Client, obj client.Object, diags *diag.Diagnostics) bool {
	key := client.ObjectKeyFromObject(obj)
	err := c.Create(ctx, obj)
	switch {
	case err == nil:
		return true
	case apierrors.IsAlreadyExists(err):
		diags.AddError(k.kind+" already exists",
			fmt.Sprintf("%s exists already. Import it with `terraform import agentbox_%s.<name> %s`.", k.id(key), k.tfType, k.id(key)))
	default:
		apiErrorDiag(diags, "Create", key, k.kind, err)
	}
	return false
}

// read gets the object key names into obj. An object gone from the cluster
// is removed from state, so that the next plan creates it again; read then
// returns false, as it does on an error.
func (k crKind) read(ctx context.Context, c client.Client, key k8stypes.NamespacedName, obj client.Object, resp *resource.ReadResponse) bool {
	err := c.Get(ctx, key, obj)
	switch {
	case err == nil:
		return true
	case apierrors.IsNotFound(err):
		resp.State.RemoveResource(ctx)
	default:
		apiErrorDiag(&resp.Diagnostics, "Read", key, k.kind, err)
	}
	return false
}

// updateObject gets the object key names into obj, lets change set what
// Terraform owns and writes it back. The controller or a scaler may write
// the object at any time; retrying on conflict keeps Terraform's values the
// last word. It returns false, with a diagnostic, if the update failed.
func updateObject[T any, PT crObject[T]](ctx context.Context, k crKind, c client.Client, key k8stypes.NamespacedName, obj PT,
	change func(), diags *diag.Diagnostics) bool {
	err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		// Zeroed first, so that a retry starts from the object as it is
		// now, not from fields of the previous attempt.
		*obj = *new(T)
		if err := c.Get(ctx, key, obj); err != nil {
			return err
		}
		change()
		return c.Update(ctx, obj)
	})
	if err != nil {
		apiErrorDiag(diags, "Update", key, k.kind, err)
		return false
	}
	return true
}

// noDeleteWait is the timeout of a destroy that does not wait for the
// object to be gone.
const noDeleteWait time.Duration = 0

// delete deletes obj, which names the object, and waits up to timeout until
// it is gone, so that a destroy followed by a create of the same name does
// not collide with finalizers. An object that is gone already counts as
// deleted.
func (k crKind) delete(ctx context.Context, c client.Client, obj client.Object, timeout time.Duration, diags *diag.Diagnostics) {
	key := client.ObjectKeyFromObject(obj)
	var opts []client.DeleteOption
	if k.foregroundDelete {
		opts = append(opts, client.PropagationPolicy(metav1.DeletePropagationForeground))
	}
	if err := c.Delete(ctx, obj, opts...); err != nil {
		if !apierrors.IsNotFound(err) {
			apiErrorDiag(diags, "Delete", key, k.kind, err)
		}
		return
	}
	if timeout == noDeleteWait {
		return
	}
	if err := waitGone(ctx, c, key, obj, timeout); err != nil {
		diags.AddError(fmt.Sprintf("%s %s was not deleted within %s", k.kind, k.id(key), timeout), err.Error()+k.deleteTimeoutHint)
	}
}

// waitReady polls obj until ready says it is ready, then lets refresh take
// the status from the last obj seen; on timeout the error carries the last
// progress ready reported.
func waitReady[T any, PT crObject[T]](ctx context.Context, k crKind, c client.Client, key k8stypes.NamespacedName, obj PT,
	timeout time.Duration, ready func() (done bool, progress string), refresh func(), diags *diag.Diagnostics) {
	err := waitObject(ctx, c, key, obj, timeout, ready)
	if obj.GetName() != "" {
		refresh()
	}
	if err != nil {
		diags.AddError(fmt.Sprintf("%s %s did not become ready", k.kind, k.id(key)), err.Error())
	}
}

// defaultWaitForReady gives an imported resource's wait_for_ready its
// default: the attribute is Terraform's own, so the object does not hold it.
func defaultWaitForReady(v *types.Bool) {
	if v.IsNull() {
		*v = types.BoolValue(true)
	}
}
