package controller

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"os"
	"sort"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/controller/controllerutil"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	"github.com/agentbox/terraform-provider-agentbox/internal/egressproxy"
	"github.com/agentbox/terraform-provider-agentbox/internal/pki"
)

// Credential injection at the egress proxy (spec.credentials): the
// credentials' Secrets are mounted into the proxy pods only, and the
// proxy terminates TLS for their HTTPS destinations with certificates
// from a CA of the EgressProxy's own. The CA's key is in a Secret mounted
// into the proxy pods; its certificate, in a ConfigMap, is mounted into
// the sandboxes and named by the variables the usual TLS stacks read.

const (
	egressCredentialsDir    = "/etc/agentbox/egress-credentials"
	egressCADir             = "/etc/agentbox/egress-ca"
	egressVolumeCredentials = "credentials"
	egressVolumeCA          = "intercept-ca"
	// egressDestinationsKey is the policy ConfigMap key of the
	// destinations' CA bundle (spec.destinationCABundle).
	egressDestinationsKey = "destinations.pem"

	// egressTrustDir is where a sandbox finds the proxy's CA: ca.crt
	// alone, and ca-bundle.crt with the public roots too, for the
	// variables that replace the roots rather than add to them.
	egressTrustDir       = "/etc/agentbox/egress-trust"
	egressVolumeTrust    = "agentbox-egress-trust"
	egressTrustCAKey     = "ca.crt"
	egressTrustBundleKey = "ca-bundle.crt"

	// annotationEgressDestinationCAHash, on a proxy pod and on a Shared
	// proxy's pod template, is the hash of spec.destinationCABundle. The
	// proxy reads the bundle only as it starts, so unlike the policy a new
	// bundle must replace the pods: as an annotation it counts in the pod
	// hash and changes the Deployment's template.
	annotationEgressDestinationCAHash = v1alpha1.GroupName + "/egress-destination-ca-hash"
)

// egressPodAnnotations are the proxy pods' annotations that stand for
// inputs the proxy reads only at startup; nil when there are none.
func egressPodAnnotations(ep *v1alpha1.EgressProxy) map[string]string {
	if ep.Spec.DestinationCABundle == "" {
		return nil
	}
	sum := sha256.Sum256([]byte(ep.Spec.DestinationCABundle))
	return map[string]string{annotationEgressDestinationCAHash: hex.EncodeToString(sum[:8])}
}

// egressTrustEnv are the variables pointing a sandbox's TLS clients at
// the proxy's CA: OpenSSL and Go (SSL_CERT_FILE), Python requests, curl,
// and Node, which adds NODE_EXTRA_CA_CERTS to its own roots.
var egressTrustEnv = [][2]string{
	{"SSL_CERT_FILE", egressTrustDir + "/" + egressTrustBundleKey},
	{"REQUESTS_CA_BUNDLE", egressTrustDir + "/" + egressTrustBundleKey},
	{"CURL_CA_BUNDLE", egressTrustDir + "/" + egressTrustBundleKey},
	{"NODE_EXTRA_CA_CERTS", egressTrustDir + "/" + egressTrustCAKey},
}

// egressCASecretName names the Secret of an EgressProxy's interception CA.
func egressCASecretName(proxy string) string { return proxy + "-egress-ca" }

// egressTrustConfigMapName names the ConfigMap of that CA's certificate,
// for the sandboxes.
func egressTrustConfigMapName(proxy string) string { return proxy + "-egress-trust" }

func hasCredentials(ep *v1alpha1.EgressProxy) bool { return ep != nil && len(ep.Spec.Credentials) > 0 }

// systemRootFiles are where Linux distributions keep their root bundle
// (the list crypto/x509 reads).
var systemRootFiles = []string{
	"/etc/ssl/certs/ca-certificates.crt",
	"/etc/pki/tls/certs/ca-bundle.crt",
	"/etc/ssl/ca-bundle.pem",
	"/etc/pki/tls/cacert.pem",
	"/etc/pki/ca-trust/extracted/pem/tls-ca-bundle.pem",
	"/etc/ssl/cert.pem",
}

// systemRoots returns the control plane's public roots, which go into the
// sandboxes' bundle beside the proxy's CA: setting SSL_CERT_FILE replaces
// the roots of the sandbox's image, and destinations without credentials
// (tunnelled, verified by the sandbox itself) still need them.
func systemRoots() []byte {
	for _, f := range systemRootFiles {
		if b, err := os.ReadFile(f); err == nil && len(b) > 0 {
			return b
		}
	}
	return nil
}

// ensureEgressCA creates the EgressProxy's interception CA if it has none,
// and the sandboxes' trust ConfigMap from it. The CA is made once and
// kept: running sandboxes trust it. Both the EgressProxy controller and
// the first sandbox to need it may get here; creation races end in
// AlreadyExists and a re-read.
func ensureEgressCA(ctx context.Context, c client.Client, scheme *runtime.Scheme, ep *v1alpha1.EgressProxy) error {
	name := egressCASecretName(ep.Name)
	var s corev1.Secret
	err := c.Get(ctx, types.NamespacedName{Namespace: ep.Namespace, Name: name}, &s)
	if apierrors.IsNotFound(err) {
		// Declared apart, so that the re-read below sets the err the
		// function goes on to check rather than one scoped to this block.
		ca, caErr := pki.NewCA("agentbox egress proxy " + ep.Namespace + "/" + ep.Name)
		if caErr != nil {
			return caErr
		}
		keyPEM, keyErr := ca.KeyPEM()
		if keyErr != nil {
			return keyErr
		}
		s = corev1.Secret{
			ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ep.Namespace, Labels: map[string]string{v1alpha1.LabelEgressProxy: ep.Name}},
			Type:       corev1.SecretTypeTLS,
			Data:       map[string][]byte{corev1.TLSCertKey: ca.CertPEM, corev1.TLSPrivateKeyKey: keyPEM},
		}
		if err := controllerutil.SetControllerReference(ep, &s, scheme); err != nil {
			return fmt.Errorf("set owner of %s: %w", name, err)
		}
		if err := c.Create(ctx, &s); err != nil && !apierrors.IsAlreadyExists(err) {
			return fmt.Errorf("create egress CA Secret %s: %w", name, err)
		}
		err = c.Get(ctx, types.NamespacedName{Namespace: ep.Namespace, Name: name}, &s)
	}
	if err != nil {
		return fmt.Errorf("get egress CA Secret %s: %w", name, err)
	}
	if !metav1.IsControlledBy(&s, ep) {
		return ownershipError(&s)
	}
	caPEM := s.Data[corev1.TLSCertKey]
	if _, err := pki.LoadCA(caPEM, s.Data[corev1.TLSPrivateKeyKey]); err != nil {
		return fmt.Errorf("egress CA Secret %s: %w", name, err)
	}
	bundle := append(bytes.TrimRight(append([]byte(nil), caPEM...), "\n"), '\n')
	bundle = append(bundle, systemRoots()...)
	cm := &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: egressTrustConfigMapName(ep.Name), Namespace: ep.Namespace}}
	return applyOwned(ctx, c, scheme, ep, cm, func() {
		cm.Labels = mergeLabels(cm.Labels, map[string]string{v1alpha1.LabelEgressProxy: ep.Name})
		cm.Data = map[string]string{egressTrustCAKey: string(caPEM), egressTrustBundleKey: string(bundle)}
	})
}

// setEgressTrust mounts the proxy's CA into the sandbox container and
// points the TLS variables at it, replacing a template's values of the
// same names (they would make the intercepted destinations fail).
func setEgressTrust(pod *corev1.Pod, ep *v1alpha1.EgressProxy) {
	pod.Spec.Volumes = append(pod.Spec.Volumes, corev1.Volume{Name: egressVolumeTrust, VolumeSource: corev1.VolumeSource{
		ConfigMap: &corev1.ConfigMapVolumeSource{
			LocalObjectReference: corev1.LocalObjectReference{Name: egressTrustConfigMapName(ep.Name)},
			DefaultMode:          ptr.To[int32](0o444),
		},
	}})
	for i := range pod.Spec.Containers {
		c := &pod.Spec.Containers[i]
		if c.Name != ContainerName {
			continue
		}
		c.VolumeMounts = append(c.VolumeMounts, corev1.VolumeMount{Name: egressVolumeTrust, MountPath: egressTrustDir, ReadOnly: true})
		drop := map[string]bool{}
		for _, kv := range egressTrustEnv {
			drop[kv[0]] = true
		}
		env := c.Env[:0]
		for _, e := range c.Env {
			if !drop[e.Name] {
				env = append(env, e)
			}
		}
		for _, kv := range egressTrustEnv {
			env = append(env, corev1.EnvVar{Name: kv[0], Value: kv[1]})
		}
		c.Env = env
	}
}

// egressFileCredentials are the spec's credentials in the proxy's policy
// file format, each value read from its Secret key mounted under
// egressCredentialsDir by the credential's name.
func egressFileCredentials(ep *v1alpha1.EgressProxy) []egressproxy.FileCredential {
	out := make([]egressproxy.FileCredential, 0, len(ep.Spec.Credentials))
	for _, c := range ep.Spec.Credentials {
		hosts := make([]string, 0, len(c.Hosts))
		for _, h := range c.Hosts {
			hosts = append(hosts, string(h))
		}
		sort.Strings(hosts)
		fc := egressproxy.FileCredential{Name: c.Name, Hosts: hosts, SecretFile: egressCredentialsDir + "/" + c.Name}
		if c.Header != nil {
			fc.Header = &egressproxy.FileCredentialHeader{Name: c.Header.Name, ValueTemplate: c.Header.ValueTemplate}
		}
		if c.BasicAuth != nil {
			fc.BasicAuth = &egressproxy.FileCredentialBasic{Username: c.BasicAuth.Username}
		}
		out = append(out, fc)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out
}

// egressCredentialInputs are the proxy's arguments, volumes and mounts for
// credentials: the CA, and one projected volume of every credential's
// Secret key, each under the credential's name. Nothing when the spec has
// no credentials.
func egressCredentialInputs(ep *v1alpha1.EgressProxy) ([]string, []corev1.Volume, []corev1.VolumeMount) {
	var args []string
	var volumes []corev1.Volume
	var mounts []corev1.VolumeMount
	if ep.Spec.DestinationCABundle != "" {
		args = append(args, "-destination-ca-file="+egressConfigDir+"/"+egressDestinationsKey)
	}
	if !hasCredentials(ep) {
		return args, volumes, mounts
	}
	args = append(args,
		"-intercept-ca-cert-file="+egressCADir+"/"+corev1.TLSCertKey,
		"-intercept-ca-key-file="+egressCADir+"/"+corev1.TLSPrivateKeyKey)
	volumes = append(volumes, corev1.Volume{Name: egressVolumeCA, VolumeSource: corev1.VolumeSource{Secret: &corev1.SecretVolumeSource{
		SecretName: egressCASecretName(ep.Name), DefaultMode: ptr.To[int32](0o440),
	}}})
	mounts = append(mounts, corev1.VolumeMount{Name: egressVolumeCA, MountPath: egressCADir, ReadOnly: true})
	creds := append([]v1alpha1.EgressCredential(nil), ep.Spec.Credentials...)
	sort.Slice(creds, func(i, j int) bool { return creds[i].Name < creds[j].Name })
	sources := make([]corev1.VolumeProjection, 0, len(creds))
	for _, c := range creds {
		sources = append(sources, corev1.VolumeProjection{Secret: &corev1.SecretProjection{
			LocalObjectReference: corev1.LocalObjectReference{Name: c.SecretRef.Name},
			Items:                []corev1.KeyToPath{{Key: c.SecretRef.Key, Path: c.Name}},
		}})
	}
	volumes = append(volumes, corev1.Volume{Name: egressVolumeCredentials, VolumeSource: corev1.VolumeSource{Projected: &corev1.ProjectedVolumeSource{
		Sources: sources, DefaultMode: ptr.To[int32](0o440),
	}}})
	mounts = append(mounts, corev1.VolumeMount{Name: egressVolumeCredentials, MountPath: egressCredentialsDir, ReadOnly: true})
	return args, volumes, mounts
}

// checkCredentialSecrets reports, with a message, the first credential
// whose Secret or key is missing.
func (r *EgressProxyReconciler) checkCredentialSecrets(ctx context.Context, ep *v1alpha1.EgressProxy) (string, bool, error) {
	for _, c := range ep.Spec.Credentials {
		var s corev1.Secret
		if err := r.Get(ctx, types.NamespacedName{Namespace: ep.Namespace, Name: c.SecretRef.Name}, &s); err != nil {
			if apierrors.IsNotFound(err) {
				return fmt.Sprintf("Secret %s named by credential %s does not exist; the proxies start when it does", c.SecretRef.Name, c.Name), true, nil
			}
			return "", false, fmt.Errorf("get credential Secret %s: %w", c.SecretRef.Name, err)
		}
		if len(s.Data[c.SecretRef.Key]) == 0 {
			return fmt.Sprintf("Secret %s has no key %q (or it is empty) named by credential %s", c.SecretRef.Name, c.SecretRef.Key, c.Name), true, nil
		}
	}
	return "", false, nil
}
