package provider

import (
	"context"
	"fmt"

	"github.com/hashicorp/terraform-plugin-framework/diag"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	k8stypes "k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/util/retry"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/controller/controllerutil"

	agentboxv1alpha1 "github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
)

// The Secrets that hold an egress proxy's write-only values: the upstream
// credentials (upstream_credentials_wo) and the injected credentials
// (credentials[].value_wo). The resource writes them, since a write-only
// value never reaches state, and owns them, so that they go with the proxy.

const (
	// upstreamCredentialsKey is the key of the upstream Secret.
	upstreamCredentialsKey = "credentials"
	// upstreamSecretLabel and injectedSecretLabel mark a Secret as this
	// resource's, naming the proxy, so that a Secret someone else made is
	// never overwritten.
	upstreamSecretLabel = "agentbox.dev/egress-proxy-upstream"
	injectedSecretLabel = "agentbox.dev/egress-proxy-injected"
)

// upstreamSecretName names the Secret that holds upstream_credentials_wo.
// The controller's own objects end in "-egress", "-egress-policy",
// "-egress-clients", "-egress-ca" and "-egress-trust", so neither this
// suffix nor "-egress-injected" can collide with them.
func upstreamSecretName(proxy string) string { return proxy + "-egress-upstream" }

func ownedSecretRef(proxy string) *agentboxv1alpha1.SecretKeySelector {
	return &agentboxv1alpha1.SecretKeySelector{Name: upstreamSecretName(proxy), Key: upstreamCredentialsKey}
}

// ownedSecret is one of the Secrets the resource owns.
type ownedSecret struct {
	name, label string
}

func upstreamSecret(proxy string) ownedSecret {
	return ownedSecret{upstreamSecretName(proxy), upstreamSecretLabel}
}

func injectedSecret(proxy string) ownedSecret {
	return ownedSecret{injectedSecretName(proxy), injectedSecretLabel}
}

// write creates or updates the Secret with the data data returns from
// the data it has (nil for a new Secret), owned by the proxy so that the
// garbage collector removes it with the proxy. A Secret of that name that
// the resource did not make is left alone.
func (o ownedSecret) write(ctx context.Context, c client.Client, ep *agentboxv1alpha1.EgressProxy,
	data func(have map[string][]byte) map[string][]byte) error {
	sec := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: o.name, Namespace: ep.Namespace}}
	err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		_, err := controllerutil.CreateOrUpdate(ctx, c, sec, func() error {
			if !sec.CreationTimestamp.IsZero() && sec.Labels[o.label] != ep.Name {
				return fmt.Errorf("Secret %s/%s exists and was not made by this resource (no label %s=%s); rename or delete it",
					sec.Namespace, sec.Name, o.label, ep.Name)
			}
			if sec.Labels == nil {
				sec.Labels = map[string]string{}
			}
			sec.Labels[o.label] = ep.Name
			sec.Labels["app.kubernetes.io/managed-by"] = "terraform-provider-agentbox"
			sec.Type = corev1.SecretTypeOpaque
			sec.Data = data(sec.Data)
			return controllerutil.SetOwnerReference(ep, sec, scheme)
		})
		return err
	})
	if err != nil {
		return fmt.Errorf("write Secret %s/%s: %w", sec.Namespace, sec.Name, err)
	}
	return nil
}

// delete deletes the Secret, if there is one and it is the resource's.
func (o ownedSecret) delete(ctx context.Context, c client.Client, ep *agentboxv1alpha1.EgressProxy) error {
	var sec corev1.Secret
	key := k8stypes.NamespacedName{Namespace: ep.Namespace, Name: o.name}
	if err := c.Get(ctx, key, &sec); err != nil {
		if apierrors.IsNotFound(err) {
			return nil
		}
		return fmt.Errorf("get Secret %s: %w", key, err)
	}
	if sec.Labels[o.label] != ep.Name {
		return nil
	}
	if err := c.Delete(ctx, &sec, client.Preconditions{UID: &sec.UID}); err != nil && !apierrors.IsNotFound(err) {
		return fmt.Errorf("delete Secret %s: %w", key, err)
	}
	return nil
}

// keys reports which keys of the Secret hold a value; none when the
// Secret is missing or not the resource's.
func (o ownedSecret) keys(ctx context.Context, c client.Client, ep *agentboxv1alpha1.EgressProxy) (map[string]bool, error) {
	var sec corev1.Secret
	if err := c.Get(ctx, k8stypes.NamespacedName{Namespace: ep.Namespace, Name: o.name}, &sec); err != nil {
		if apierrors.IsNotFound(err) {
			return nil, nil
		}
		return nil, fmt.Errorf("get Secret %s/%s: %w", ep.Namespace, o.name, err)
	}
	if sec.Labels[o.label] != ep.Name {
		return nil, nil
	}
	out := map[string]bool{}
	for k, v := range sec.Data {
		out[k] = len(v) > 0
	}
	return out, nil
}

// writeUpstreamSecret writes the upstream credentials into the resource's
// upstream Secret.
func writeUpstreamSecret(ctx context.Context, c client.Client, ep *agentboxv1alpha1.EgressProxy, creds string) error {
	return upstreamSecret(ep.Name).write(ctx, c, ep, func(map[string][]byte) map[string][]byte {
		return map[string][]byte{upstreamCredentialsKey: []byte(creds)}
	})
}

// deleteUpstreamSecret deletes the resource's upstream Secret, if there is one.
func deleteUpstreamSecret(ctx context.Context, c client.Client, ep *agentboxv1alpha1.EgressProxy) error {
	return upstreamSecret(ep.Name).delete(ctx, c, ep)
}

// upstreamSecretInUse reports whether the proxy refers to the resource's own
// Secret and that Secret holds credentials.
func upstreamSecretInUse(ctx context.Context, c client.Client, ep *agentboxv1alpha1.EgressProxy) (bool, error) {
	if ep.Spec.Upstream == nil || ep.Spec.Upstream.CredentialsSecretRef == nil || *ep.Spec.Upstream.CredentialsSecretRef != *ownedSecretRef(ep.Name) {
		return false, nil
	}
	keys, err := upstreamSecret(ep.Name).keys(ctx, c, ep)
	return keys[upstreamCredentialsKey], err
}

// upstreamSecretDiag reports a failed write, read or delete of the Secret.
func upstreamSecretDiag(diags *diag.Diagnostics, verb string, key k8stypes.NamespacedName, err error) {
	diags.AddError(fmt.Sprintf("Cannot %s the upstream credentials Secret of %s %s", verb, egressProxyKind, key), err.Error())
}

// injectedValue is one credential's value_wo and whether to write it.
type injectedValue struct {
	value   string
	rewrite bool
}

// syncInjectedSecret makes the resource's injected-credentials Secret hold
// one key per credential given by value_wo: the configuration's value when
// the credential asks for a rewrite or its key is missing, the value it
// has otherwise. Keys of other credentials go, and with no such credential
// the Secret goes.
func syncInjectedSecret(ctx context.Context, c client.Client, ep *agentboxv1alpha1.EgressProxy, want map[string]injectedValue) error {
	if len(want) == 0 {
		return injectedSecret(ep.Name).delete(ctx, c, ep)
	}
	return injectedSecret(ep.Name).write(ctx, c, ep, func(have map[string][]byte) map[string][]byte {
		out := make(map[string][]byte, len(want))
		for name, w := range want {
			if old := have[name]; len(old) > 0 && !w.rewrite {
				out[name] = old
			} else {
				out[name] = []byte(w.value)
			}
		}
		return out
	})
}

// injectedSecretDiag reports a failed write, read or delete of the Secret
// of the injected credentials.
func injectedSecretDiag(diags *diag.Diagnostics, verb string, key k8stypes.NamespacedName, err error) {
	diags.AddError(fmt.Sprintf("Cannot %s the injected credentials Secret of %s %s", verb, egressProxyKind, key), err.Error())
}
