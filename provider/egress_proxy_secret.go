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

// The Secret that holds an egress proxy's upstream_credentials_wo. The
// resource writes it, since a write-only value never reaches state, and owns
// it, so that it goes with the proxy.

const (
	// upstreamCredentialsKey is the key of the Secret the resource owns.
	upstreamCredentialsKey = "credentials"
	// upstreamSecretLabel marks a Secret as this resource's, naming the
	// proxy, so that a Secret someone else made is never overwritten.
	upstreamSecretLabel = "agentbox.dev/egress-proxy-upstream"
)

// upstreamSecretName names the Secret that holds upstream_credentials_wo.
// The controller's own objects end in "-egress", "-egress-policy" and
// "-egress-clients", so this suffix cannot collide with them.
func upstreamSecretName(proxy string) string { return proxy + "-egress-upstream" }

func ownedSecretRef(proxy string) *agentboxv1alpha1.SecretKeySelector {
	return &agentboxv1alpha1.SecretKeySelector{Name: upstreamSecretName(proxy), Key: upstreamCredentialsKey}
}

// writeUpstreamSecret creates or updates the Secret holding the upstream
// credentials, owned by the proxy so that the garbage collector removes it
// with the proxy. A Secret of that name that the resource did not make is
// left alone.
func writeUpstreamSecret(ctx context.Context, c client.Client, ep *agentboxv1alpha1.EgressProxy, creds string) error {
	sec := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: upstreamSecretName(ep.Name), Namespace: ep.Namespace}}
	err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		_, err := controllerutil.CreateOrUpdate(ctx, c, sec, func() error {
			if !sec.CreationTimestamp.IsZero() && sec.Labels[upstreamSecretLabel] != ep.Name {
				return fmt.Errorf("Secret %s/%s exists and was not made by this resource (no label %s=%s); rename or delete it",
					sec.Namespace, sec.Name, upstreamSecretLabel, ep.Name)
			}
			if sec.Labels == nil {
				sec.Labels = map[string]string{}
			}
			sec.Labels[upstreamSecretLabel] = ep.Name
			sec.Labels["app.kubernetes.io/managed-by"] = "terraform-provider-agentbox"
			sec.Type = corev1.SecretTypeOpaque
			sec.Data = map[string][]byte{upstreamCredentialsKey: []byte(creds)}
			return controllerutil.SetOwnerReference(ep, sec, scheme)
		})
		return err
	})
	if err != nil {
		return fmt.Errorf("write Secret %s/%s: %w", sec.Namespace, sec.Name, err)
	}
	return nil
}

// deleteUpstreamSecret deletes the resource's own Secret, if there is one.
func deleteUpstreamSecret(ctx context.Context, c client.Client, ep *agentboxv1alpha1.EgressProxy) error {
	var sec corev1.Secret
	key := k8stypes.NamespacedName{Namespace: ep.Namespace, Name: upstreamSecretName(ep.Name)}
	if err := c.Get(ctx, key, &sec); err != nil {
		if apierrors.IsNotFound(err) {
			return nil
		}
		return fmt.Errorf("get Secret %s: %w", key, err)
	}
	if sec.Labels[upstreamSecretLabel] != ep.Name {
		return nil
	}
	if err := c.Delete(ctx, &sec, client.Preconditions{UID: &sec.UID}); err != nil && !apierrors.IsNotFound(err) {
		return fmt.Errorf("delete Secret %s: %w", key, err)
	}
	return nil
}

// upstreamSecretInUse reports whether the proxy refers to the resource's own
// Secret and that Secret holds credentials.
func upstreamSecretInUse(ctx context.Context, c client.Client, ep *agentboxv1alpha1.EgressProxy) (bool, error) {
	if ep.Spec.Upstream == nil || ep.Spec.Upstream.CredentialsSecretRef == nil || *ep.Spec.Upstream.CredentialsSecretRef != *ownedSecretRef(ep.Name) {
		return false, nil
	}
	var sec corev1.Secret
	if err := c.Get(ctx, k8stypes.NamespacedName{Namespace: ep.Namespace, Name: upstreamSecretName(ep.Name)}, &sec); err != nil {
		if apierrors.IsNotFound(err) {
			return false, nil
		}
		return false, fmt.Errorf("get Secret %s/%s: %w", ep.Namespace, upstreamSecretName(ep.Name), err)
	}
	return sec.Labels[upstreamSecretLabel] == ep.Name && len(sec.Data[upstreamCredentialsKey]) > 0, nil
}

// upstreamSecretDiag reports a failed write, read or delete of the Secret.
func upstreamSecretDiag(diags *diag.Diagnostics, verb string, key k8stypes.NamespacedName, err error) {
	diags.AddError(fmt.Sprintf("Cannot %s the upstream credentials Secret of %s %s", verb, egressProxyKind, key), err.Error())
}
