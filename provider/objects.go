package provider

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"time"

	"github.com/go-logr/logr"
	"github.com/hashicorp/terraform-plugin-framework/diag"
	"github.com/hashicorp/terraform-plugin-framework/path"
	"github.com/hashicorp/terraform-plugin-framework/resource"
	"github.com/hashicorp/terraform-plugin-framework/tfsdk"
	"github.com/hashicorp/terraform-plugin-framework/types"
	"github.com/hashicorp/terraform-plugin-framework/types/basetypes"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/runtime"
	k8stypes "k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/wait"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/rest"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/client/apiutil"
	ctrllog "sigs.k8s.io/controller-runtime/pkg/log"

	agentboxv1alpha1 "github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
)

// scheme knows the built-in kinds and agentbox's own.
var scheme = func() *runtime.Scheme {
	s := runtime.NewScheme()
	if err := clientgoscheme.AddToScheme(s); err != nil {
		panic(err)
	}
	if err := agentboxv1alpha1.AddToScheme(s); err != nil {
		panic(err)
	}
	return s
}()

var ctrlLogOnce sync.Once

// newObjectClient builds a typed client whose REST mapper discovers lazily
// and again after a miss: agentbox_platform installs the CRDs in the same
// apply that creates the first objects, so they may not exist when the
// provider is configured.
func newObjectClient(cfg *rest.Config) (client.Client, error) {
	// controller-runtime logs through a global logger and, when nobody
	// ever sets one, prints a stack trace saying so into the provider's
	// output half a minute on. The provider reports through diagnostics
	// and tflog; what the client would log (API warnings) adds nothing.
	ctrlLogOnce.Do(func() { ctrllog.SetLogger(logr.Discard()) })
	hc, err := rest.HTTPClientFor(cfg)
	if err != nil {
		return nil, fmt.Errorf("creating HTTP client: %w", err)
	}
	mapper, err := apiutil.NewDynamicRESTMapper(cfg, hc)
	if err != nil {
		return nil, fmt.Errorf("creating REST mapper: %w", err)
	}
	c, err := client.New(cfg, client.Options{Scheme: scheme, Mapper: mapper, HTTPClient: hc})
	if err != nil {
		return nil, fmt.Errorf("creating client: %w", err)
	}
	return c, nil
}

// objectID is the Terraform ID of a namespaced object: "<namespace>/<name>".
func objectID(namespace, name string) string { return namespace + "/" + name }

// parseImportID accepts "<namespace>/<name>" or, for objects in the
// provider's default namespace, "<name>".
func parseImportID(id, defaultNamespace string) (k8stypes.NamespacedName, error) {
	parts := strings.Split(id, "/")
	switch {
	case len(parts) == 1 && parts[0] != "" && defaultNamespace != "":
		return k8stypes.NamespacedName{Namespace: defaultNamespace, Name: parts[0]}, nil
	case len(parts) == 2 && parts[0] != "" && parts[1] != "":
		return k8stypes.NamespacedName{Namespace: parts[0], Name: parts[1]}, nil
	}
	return k8stypes.NamespacedName{}, fmt.Errorf("import ID %q is not \"<namespace>/<name>\" or \"<name>\"", id)
}

// importObject sets the identifying attributes of an imported object; Read
// fills in the rest.
func importObject(ctx context.Context, d *providerData, req resource.ImportStateRequest, resp *resource.ImportStateResponse) {
	ns := ""
	if d != nil {
		ns, _ = d.Namespace()
	}
	key, err := parseImportID(req.ID, ns)
	if err != nil {
		resp.Diagnostics.AddError("Invalid import ID", err.Error())
		return
	}
	resp.Diagnostics.Append(resp.State.SetAttribute(ctx, path.Root("id"), objectID(key.Namespace, key.Name))...)
	resp.Diagnostics.Append(resp.State.SetAttribute(ctx, path.Root("namespace"), key.Namespace)...)
	resp.Diagnostics.Append(resp.State.SetAttribute(ctx, path.Root("name"), key.Name)...)
}

// objectsOrDiag returns the object client, or adds a diagnostic that says
// why the cluster cannot be reached.
func objectsOrDiag(d *providerData, diags *diag.Diagnostics) client.Client {
	if d == nil {
		diags.AddError("Provider not configured", "The agentbox provider was not configured. This is a bug in the provider.")
		return nil
	}
	c, err := d.Objects()
	if err != nil {
		diags.AddError("Cannot reach the cluster", err.Error())
		return nil
	}
	return c
}

// apiErrorDiag turns an API error into a diagnostic a person can act on; a
// missing CRD is the common case when the platform is not installed.
func apiErrorDiag(diags *diag.Diagnostics, action string, key k8stypes.NamespacedName, kind string, err error) {
	detail := err.Error()
	var noMatch *meta.NoKindMatchError
	switch {
	case errors.As(err, &noMatch) || meta.IsNoMatchError(err):
		detail = fmt.Sprintf("The cluster does not know the %s kind (agentbox.dev/v1alpha1): install the platform first "+
			"(the agentbox_platform resource, or the agentbox Helm chart), and make this resource depend on it.\n\n%s", kind, err)
	case apierrors.IsForbidden(err):
		detail = fmt.Sprintf("The provider's credentials may not %s %s objects in namespace %q.\n\n%s", strings.ToLower(action), kind, key.Namespace, err)
	case apierrors.IsInvalid(err):
		detail = fmt.Sprintf("The cluster rejected the %s:\n\n%s", kind, err)
	}
	diags.AddError(fmt.Sprintf("Cannot %s %s %s", strings.ToLower(action), kind, key), detail)
}

// waitGone waits until the object no longer exists, so that a destroy
// followed by a create of the same name does not collide with finalizers.
func waitGone(ctx context.Context, c client.Client, key k8stypes.NamespacedName, obj client.Object, timeout time.Duration) error {
	return wait.PollUntilContextTimeout(ctx, 500*time.Millisecond, timeout, true, func(ctx context.Context) (bool, error) {
		err := c.Get(ctx, key, obj)
		if apierrors.IsNotFound(err) {
			return true, nil
		}
		return false, ignoreTransient(err)
	})
}

// ignoreTransient keeps polling through errors that a retry can fix.
func ignoreTransient(err error) error {
	if err == nil || apierrors.IsServerTimeout(err) || apierrors.IsTimeout(err) || apierrors.IsTooManyRequests(err) ||
		apierrors.IsServiceUnavailable(err) || apierrors.IsInternalError(err) {
		return nil
	}
	var status apierrors.APIStatus
	if errors.As(err, &status) && status.Status().Code == http.StatusBadGateway {
		return nil
	}
	return err
}

// defaultNamespace plans the provider's namespace for a resource whose
// configuration names none. It belongs in ModifyPlan: only the resource
// instance serving a request is configured, and plan modifiers in a schema
// may come from another instance that never sees the provider's settings.
func defaultNamespace(ctx context.Context, d *providerData, config tfsdk.Config, planned *types.String, diags *diag.Diagnostics) {
	if !planned.IsUnknown() || d == nil {
		return
	}
	var configured basetypes.StringValue
	diags.Append(config.GetAttribute(ctx, path.Root("namespace"), &configured)...)
	if !configured.IsNull() {
		return
	}
	if ns, ok := d.Namespace(); ok {
		*planned = basetypes.NewStringValue(ns)
	}
}

// planObjectID plans the namespace and, with it, the ID of a resource that
// wraps one namespaced object, so plans show where the object will live.
func planObjectID(ctx context.Context, d *providerData, req resource.ModifyPlanRequest, resp *resource.ModifyPlanResponse) {
	if req.Plan.Raw.IsNull() {
		return
	}
	var ns, name basetypes.StringValue
	resp.Diagnostics.Append(req.Plan.GetAttribute(ctx, path.Root("namespace"), &ns)...)
	resp.Diagnostics.Append(req.Plan.GetAttribute(ctx, path.Root("name"), &name)...)
	defaultNamespace(ctx, d, req.Config, &ns, &resp.Diagnostics)
	if resp.Diagnostics.HasError() {
		return
	}
	resp.Diagnostics.Append(resp.Plan.SetAttribute(ctx, path.Root("namespace"), ns)...)
	if !ns.IsUnknown() && !name.IsUnknown() {
		resp.Diagnostics.Append(resp.Plan.SetAttribute(ctx, path.Root("id"), objectID(ns.ValueString(), name.ValueString()))...)
	}
}
