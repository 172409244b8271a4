package kube

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"math/big"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"k8s.io/client-go/rest"
)

const twoContexts = `apiVersion: v1
kind: Config
current-context: alpha
clusters:
- name: alpha
  cluster:
    server: https://alpha.example:6443
    insecure-skip-tls-verify: true
- name: beta
  cluster:
    server: https://beta.example:6443
    insecure-skip-tls-verify: true
users:
- name: alpha
  user:
    token: alpha-token
- name: beta
  user:
    token: beta-token
contexts:
- name: alpha
  context: {cluster: alpha, user: alpha}
- name: beta
  context: {cluster: beta, user: beta}
`

// isolate keeps the developer's own kubeconfig, KUBECONFIG and any in-cluster
// service account out of the test.
func isolate(t *testing.T) string {
	t.Helper()
	dir := t.TempDir()
	t.Setenv("KUBECONFIG", filepath.Join(dir, "absent"))
	t.Setenv("KUBERNETES_SERVICE_HOST", "")
	t.Setenv("KUBERNETES_SERVICE_PORT", "")
	t.Setenv("KUBERNETES_MASTER", "")
	return dir
}

func writeKubeconfig(t *testing.T, dir, content string) string {
	t.Helper()
	p := filepath.Join(dir, "kubeconfig")
	if err := os.WriteFile(p, []byte(content), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

func TestRESTConfig_kubeconfigContexts(t *testing.T) {
	dir := isolate(t)
	path := writeKubeconfig(t, dir, twoContexts)

	for _, tc := range []struct {
		context, host, token string
	}{
		{"", "https://alpha.example:6443", "alpha-token"},
		{"alpha", "https://alpha.example:6443", "alpha-token"},
		{"beta", "https://beta.example:6443", "beta-token"},
	} {
		t.Run("context="+tc.context, func(t *testing.T) {
			cfg, err := RESTConfig(Options{ConfigPath: path, ConfigContext: tc.context})
			if err != nil {
				t.Fatal(err)
			}
			if cfg.Host != tc.host || cfg.BearerToken != tc.token {
				t.Errorf("got host %q token %q, want %q %q", cfg.Host, cfg.BearerToken, tc.host, tc.token)
			}
		})
	}
}

func TestRESTConfig_defaultLoadingRules(t *testing.T) {
	dir := isolate(t)
	t.Setenv("KUBECONFIG", writeKubeconfig(t, dir, twoContexts))

	cfg, err := RESTConfig(Options{ConfigContext: "beta"})
	if err != nil {
		t.Fatal(err)
	}
	if cfg.Host != "https://beta.example:6443" {
		t.Errorf("host = %q, want the beta context from KUBECONFIG", cfg.Host)
	}
}

func TestRESTConfig_unknownContext(t *testing.T) {
	path := writeKubeconfig(t, isolate(t), twoContexts)

	_, err := RESTConfig(Options{ConfigPath: path, ConfigContext: "gamma"})
	if err == nil || !strings.Contains(err.Error(), "gamma") {
		t.Fatalf("want an error naming the missing context, got %v", err)
	}
}

func TestRESTConfig_explicitTokenOverridesKubeconfigUser(t *testing.T) {
	path := writeKubeconfig(t, isolate(t), twoContexts)

	cfg, err := RESTConfig(Options{ConfigPath: path, ConfigContext: "beta", Token: "override"})
	if err != nil {
		t.Fatal(err)
	}
	if cfg.Host != "https://beta.example:6443" || cfg.BearerToken != "override" {
		t.Errorf("got host %q token %q", cfg.Host, cfg.BearerToken)
	}
}

func TestRESTConfig_hostAndToken(t *testing.T) {
	dir := isolate(t)
	// A kubeconfig that would win if it were consulted.
	t.Setenv("KUBECONFIG", writeKubeconfig(t, dir, twoContexts))

	cfg, err := RESTConfig(Options{
		Host:       "https://explicit.example:6443",
		Token:      "explicit-token",
		Insecure:   true,
		ConfigPath: filepath.Join(dir, "ignored-because-host-is-set"),
	})
	if err != nil {
		t.Fatal(err)
	}
	if cfg.Host != "https://explicit.example:6443" || cfg.BearerToken != "explicit-token" || !cfg.Insecure {
		t.Errorf("got host %q token %q insecure %v", cfg.Host, cfg.BearerToken, cfg.Insecure)
	}
}

func TestRESTConfig_clientRateLimits(t *testing.T) {
	dir := isolate(t)
	t.Setenv("KUBECONFIG", writeKubeconfig(t, dir, twoContexts))
	for name, o := range map[string]Options{
		"explicit host": {Host: "https://explicit.example:6443", Token: "t"},
		"kubeconfig":    {},
	} {
		cfg, err := RESTConfig(o)
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		if cfg.QPS != DefaultQPS || cfg.Burst != DefaultBurst {
			t.Errorf("%s: QPS %v burst %d, want %d and %d", name, cfg.QPS, cfg.Burst, DefaultQPS, DefaultBurst)
		}
	}
}

func TestRESTConfig_clientCertificateAndCA(t *testing.T) {
	isolate(t)
	ca := newCert(t)
	client := newCert(t)

	cfg, err := RESTConfig(Options{
		Host:                 "https://127.0.0.1:6443",
		ClientCertificate:    client.cert,
		ClientKey:            client.key,
		ClusterCACertificate: ca.cert,
	})
	if err != nil {
		t.Fatal(err)
	}
	if string(cfg.CertData) != client.cert || string(cfg.KeyData) != client.key || string(cfg.CAData) != ca.cert {
		t.Error("certificate, key or CA data was not passed through unchanged")
	}
	// Building the TLS configuration parses every PEM block, which is what
	// the first request would do.
	tlsCfg, err := rest.TLSConfigFor(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if tlsCfg.RootCAs == nil || tlsCfg.GetClientCertificate == nil {
		t.Error("TLS configuration lacks the CA pool or the client certificate")
	}
	if _, err := NewClients(cfg); err != nil {
		t.Fatal(err)
	}
}

func TestRESTConfig_missingFile(t *testing.T) {
	missing := filepath.Join(isolate(t), "nope")

	_, err := RESTConfig(Options{ConfigPath: missing})
	if !errors.Is(err, os.ErrNotExist) || !strings.Contains(err.Error(), missing) {
		t.Fatalf("want a not-exist error naming %s, got %v", missing, err)
	}
}

func TestRESTConfig_nothingConfigured(t *testing.T) {
	isolate(t)

	_, err := RESTConfig(Options{})
	if !errors.Is(err, ErrNoConfig) {
		t.Fatalf("want ErrNoConfig, got %v", err)
	}
}

func TestRESTConfig_homeExpansion(t *testing.T) {
	dir := isolate(t)
	t.Setenv("HOME", dir)
	writeKubeconfig(t, dir, twoContexts)

	cfg, err := RESTConfig(Options{ConfigPath: "~/kubeconfig"})
	if err != nil {
		t.Fatal(err)
	}
	if cfg.Host != "https://alpha.example:6443" {
		t.Errorf("host = %q", cfg.Host)
	}
}

type pemPair struct{ cert, key string }

func newCert(t *testing.T) pemPair {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(1),
		Subject:               pkix.Name{CommonName: "agentbox-test"},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(time.Hour),
		IsCA:                  true,
		BasicConstraintsValid: true,
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature,
		ExtKeyUsage:           []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	keyDER, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	return pemPair{
		cert: string(pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})),
		key:  string(pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: keyDER})),
	}
}
