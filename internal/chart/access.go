package chart

import (
	"context"
	"fmt"
	"net"
	"strconv"

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
