package provider

import (
	"errors"
	"fmt"
	"net/http"
	"strings"
	"sync"

	"github.com/go-logr/logr"
	"github.com/hashicorp/terraform-plugin-framework/diag"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/runtime"
	k8stypes "k8s.io/apimachinery/pkg/types"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/rest"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/client/apiutil"
	ctrllog "sigs.k8s.io/controller-runtime/pkg/log"

	agentboxv1alpha1 "github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
)

// The client for the cluster's objects, and what its errors mean to the
// person running Terraform.

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
