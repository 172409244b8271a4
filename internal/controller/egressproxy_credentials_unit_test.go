package controller

import (
	"slices"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	"github.com/agentbox/terraform-provider-agentbox/internal/egressproxy"
)

// The proxy pod of an EgressProxy with credentials gets the CA and the
// credentials' Secret keys as files, and its policy file names those
// files but holds no value; the policy file is one the proxy accepts.
func TestEgressCredentialsInProxyPod(t *testing.T) {
	ep := &v1alpha1.EgressProxy{
		ObjectMeta: metav1.ObjectMeta{Name: "egress", Namespace: "ns"},
		Spec: v1alpha1.EgressProxySpec{
			AllowedDomains: []v1alpha1.Domain{"api.example.com"},
			Credentials: []v1alpha1.EgressCredential{
				{Name: "zeta", Hosts: []v1alpha1.Domain{"api.example.com"}, SecretRef: v1alpha1.SecretKeySelector{Name: "tokens", Key: "z"},
					BasicAuth: &v1alpha1.EgressCredentialBasicAuth{Username: "bot"}},
				{Name: "alpha", Hosts: []v1alpha1.Domain{"*.example.com"}, SecretRef: v1alpha1.SecretKeySelector{Name: "tokens", Key: "a"},
					Header: &v1alpha1.EgressCredentialHeader{Name: "Authorization", ValueTemplate: "Bearer {{secret}}"}},
			},
			DestinationCABundle: "-----BEGIN CERTIFICATE-----\n...",
		},
	}
	spec := egressPodSpec(ep, egressPodOptions{image: "img"})
	args := spec.Containers[0].Args
	for _, want := range []string{
		"-intercept-ca-cert-file=" + egressCADir + "/tls.crt", "-intercept-ca-key-file=" + egressCADir + "/tls.key",
		"-destination-ca-file=" + egressConfigDir + "/" + egressDestinationsKey,
	} {
		if !slices.Contains(args, want) {
			t.Errorf("args %v lack %s", args, want)
		}
	}
	var projected *corev1.ProjectedVolumeSource
	var caSecret string
	for _, v := range spec.Volumes {
		switch v.Name {
		case egressVolumeCredentials:
			projected = v.Projected
		case egressVolumeCA:
			caSecret = v.Secret.SecretName
		}
	}
	if caSecret != "egress-egress-ca" {
		t.Errorf("CA volume from %q", caSecret)
	}
	if projected == nil || len(projected.Sources) != 2 || projected.Sources[0].Secret.Items[0].Path != "alpha" ||
		projected.Sources[0].Secret.Items[0].Key != "a" || projected.Sources[1].Secret.Items[0].Path != "zeta" {
		t.Fatalf("credentials volume %+v", projected)
	}

	cm, err := desiredEgressConfigMap(ep)
	if err != nil {
		t.Fatal(err)
	}
	if cm.Data[egressDestinationsKey] != ep.Spec.DestinationCABundle {
		t.Errorf("ConfigMap lacks the destinations' bundle: %v", cm.Data)
	}
	fc, err := egressproxy.ParseFileConfig([]byte(cm.Data[egressPolicyKey]))
	if err != nil {
		t.Fatal(err)
	}
	if len(fc.Credentials) != 2 || fc.Credentials[0].SecretFile != egressCredentialsDir+"/alpha" ||
		fc.Credentials[0].Header.ValueTemplate != "Bearer {{secret}}" || fc.Credentials[1].BasicAuth.Username != "bot" {
		t.Errorf("policy file credentials %+v", fc.Credentials)
	}

	// Without credentials, the pod is as before: no CA, no credentials.
	ep.Spec.Credentials, ep.Spec.DestinationCABundle = nil, ""
	spec = egressPodSpec(ep, egressPodOptions{image: "img"})
	if strings.Contains(strings.Join(spec.Containers[0].Args, " "), "intercept") || len(spec.Volumes) != 1 {
		t.Errorf("a proxy without credentials got %v, %d volumes", spec.Containers[0].Args, len(spec.Volumes))
	}
}

// A sandbox of a proxy with credentials trusts the proxy's CA, whatever
// its template set for the same variables.
func TestEgressTrustInSandboxPod(t *testing.T) {
	ep := &v1alpha1.EgressProxy{ObjectMeta: metav1.ObjectMeta{Name: "egress"}}
	pod := &corev1.Pod{Spec: corev1.PodSpec{Containers: []corev1.Container{{
		Name: ContainerName, Env: []corev1.EnvVar{{Name: "SSL_CERT_FILE", Value: "/elsewhere"}, {Name: "KEEP", Value: "1"}},
	}}}}
	setEgressTrust(pod, ep)
	c := pod.Spec.Containers[0]
	got := map[string]string{}
	n := 0
	for _, e := range c.Env {
		got[e.Name] = e.Value
		if e.Name == "SSL_CERT_FILE" {
			n++
		}
	}
	if n != 1 || got["SSL_CERT_FILE"] != egressTrustDir+"/ca-bundle.crt" || got["NODE_EXTRA_CA_CERTS"] != egressTrustDir+"/ca.crt" ||
		got["REQUESTS_CA_BUNDLE"] == "" || got["CURL_CA_BUNDLE"] == "" || got["KEEP"] != "1" {
		t.Errorf("env %v", c.Env)
	}
	if len(c.VolumeMounts) != 1 || c.VolumeMounts[0].MountPath != egressTrustDir || pod.Spec.Volumes[0].ConfigMap.Name != "egress-egress-trust" {
		t.Errorf("mounts %v, volumes %v", c.VolumeMounts, pod.Spec.Volumes)
	}
}
