package chart

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"strconv"
	"strings"

	"helm.sh/helm/v3/pkg/chartutil"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
)

// Access is what a client of the Compute API needs.
type Access struct {
	// Endpoint is https://<ClusterIP>:<port> of the agentbox-api Service,
	// or "" when the Service is missing.
	Endpoint string
	// ServiceDNS is agentbox-api.<namespace>.svc, which the API's serving
	// certificate names.
	ServiceDNS string
	// CACertificate is the platform CA (PEM), which the API's serving
	// certificate chains to; "" when its Secret is missing.
	CACertificate string
	// AdminToken is the first admin bearer token; "" when its Secret is
	// missing.
	AdminToken string
}

// ServiceDNS is the in-cluster name of the Compute API in namespace.
func ServiceDNS(namespace string) string { return APIService + "." + namespace + ".svc" }

// ReadAccess reads how to reach and trust the Compute API of rel. Objects
// deleted out of band leave their fields empty instead of failing, so that
// the caller can still report the drift and repair it.
func ReadAccess(ctx context.Context, cs kubernetes.Interface, rel *Release) (Access, error) {
	a := Access{ServiceDNS: ServiceDNS(rel.Namespace)}

	svc, err := cs.CoreV1().Services(rel.Namespace).Get(ctx, APIService, metav1.GetOptions{})
	switch {
	case apierrors.IsNotFound(err):
	case err != nil:
		return a, fmt.Errorf("reading Service %s/%s: %w", rel.Namespace, APIService, err)
	default:
		a.Endpoint = serviceEndpoint(svc)
	}

	ca, err := secretKey(ctx, cs, rel.Namespace, rel.CASecret(), CACertificateKey)
	if err != nil {
		return a, err
	}
	a.CACertificate = ca

	token, err := secretKey(ctx, cs, rel.Namespace, rel.AdminTokenSecret(), AdminTokenKey)
	if err != nil {
		return a, err
	}
	a.AdminToken = token
	return a, nil
}

func serviceEndpoint(svc *corev1.Service) string {
	ip := svc.Spec.ClusterIP
	if ip == "" || ip == corev1.ClusterIPNone {
		return ""
	}
	port := int32(443)
	for _, p := range svc.Spec.Ports {
		if p.Name == "https" {
			port = p.Port
		}
	}
	return "https://" + net.JoinHostPort(ip, strconv.Itoa(int(port)))
}

func secretKey(ctx context.Context, cs kubernetes.Interface, namespace, name, key string) (string, error) {
	s, err := cs.CoreV1().Secrets(namespace).Get(ctx, name, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		return "", nil
	}
	if err != nil {
		return "", fmt.Errorf("reading Secret %s/%s: %w", namespace, name, err)
	}
	return string(s.Data[key]), nil
}

// AccessSettings are the values Access follows: the Secrets that hold the CA
// and the admin token, and the Compute API Service's port. An upgrade that
// keeps them keeps Access, as long as the objects are there: the chart
// reuses the Secrets it generated (see templates/secrets.yaml), and Helm
// patches the Service rather than recreating it, so its ClusterIP stays
// (also when its type changes).
type AccessSettings struct {
	CASecret, AdminTokenSecret string
	// ServicePort is the port as JSON, so that 443 compares equal however
	// it was typed.
	ServicePort string
}

// AccessSettingsOf returns the AccessSettings the embedded chart derives
// from v and its defaults.
func AccessSettingsOf(v Values) (AccessSettings, error) {
	vals, err := v.Map()
	if err != nil {
		return AccessSettings{}, err
	}
	ch, err := Load()
	if err != nil {
		return AccessSettings{}, err
	}
	all, err := chartutil.CoalesceValues(ch, vals)
	if err != nil {
		return AccessSettings{}, fmt.Errorf("merging the chart's default values: %w", err)
	}
	r := &Release{values: all}
	port, _ := all.PathValue("service.port")
	b, err := json.Marshal(port)
	if err != nil {
		return AccessSettings{}, fmt.Errorf("service.port: %w", err)
	}
	return AccessSettings{CASecret: r.CASecret(), AdminTokenSecret: r.AdminTokenSecret(), ServicePort: string(b)}, nil
}

// DriftIsAbout reports whether line, a DriftItem's String, is about the
// object of kind in namespace with name.
func DriftIsAbout(line, kind, namespace, name string) bool {
	return strings.HasPrefix(line, DriftItem{Kind: kind, Namespace: namespace, Name: name}.object()+" ")
}
