// Package kube turns connection settings into Kubernetes client configuration.
//
// It deliberately knows nothing about Terraform, so that the same rules apply
// wherever the platform is reached from and can be tested with plain values.
package kube

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
)

// ErrNoConfig means neither explicit settings nor a kubeconfig file nor an
// in-cluster service account were found.
var ErrNoConfig = errors.New("no Kubernetes configuration found")

// Options says how to reach a cluster.
//
// Precedence: when Host is set, only the explicit fields are used and
// ConfigPath and ConfigContext are ignored, so a kubeconfig lying around (for
// example from KUBECONFIG in CI) can never mix its credentials into an
// explicitly configured connection. Otherwise the kubeconfig at ConfigPath, or
// the default one (KUBECONFIG, then ~/.kube/config, then in-cluster) when
// ConfigPath is empty, is loaded and any explicit credential fields override
// those of its selected context.
type Options struct {
	ConfigPath    string
	ConfigContext string

	Host  string
	Token string
	// PEM-encoded data, not file names.
	ClientCertificate    string
	ClientKey            string
	ClusterCACertificate string
	Insecure             bool
}

// RESTConfig builds a client configuration from o. It does not contact the
// cluster.
func RESTConfig(o Options) (*rest.Config, error) {
	overrides := &clientcmd.ConfigOverrides{
		AuthInfo: clientcmdapi.AuthInfo{
			Token:                 o.Token,
			ClientCertificateData: bytesOrNil(o.ClientCertificate),
			ClientKeyData:         bytesOrNil(o.ClientKey),
		},
		ClusterInfo: clientcmdapi.Cluster{
			Server:                   o.Host,
			CertificateAuthorityData: bytesOrNil(o.ClusterCACertificate),
			InsecureSkipTLSVerify:    o.Insecure,
		},
	}

	if o.Host != "" {
		cfg, err := clientcmd.NewDefaultClientConfig(*clientcmdapi.NewConfig(), overrides).ClientConfig()
		if err != nil {
			return nil, fmt.Errorf("configuring Kubernetes client for host %q: %w", o.Host, err)
		}
		return withClientRate(cfg), nil
	}

	overrides.CurrentContext = o.ConfigContext
	rules := &clientcmd.ClientConfigLoadingRules{
		// No MigrationRules: a provider must never rewrite files in the
		// user's home directory. No WarnIfAllMissing: ErrNoConfig says it
		// better than a klog line on stderr.
	}
	if o.ConfigPath != "" {
		path, err := expandHome(o.ConfigPath)
		if err != nil {
			return nil, err
		}
		if _, err := os.Stat(path); err != nil {
			return nil, fmt.Errorf("reading kubeconfig: %w", err)
		}
		rules.ExplicitPath = path
	} else {
		rules.Precedence = clientcmd.NewDefaultClientConfigLoadingRules().Precedence
	}

	cfg, err := clientcmd.NewNonInteractiveDeferredLoadingClientConfig(rules, overrides).ClientConfig()
	switch {
	case clientcmd.IsEmptyConfig(err):
		return nil, fmt.Errorf("%w: looked in %s and for an in-cluster service account",
			ErrNoConfig, strings.Join(rules.GetLoadingPrecedence(), ", "))
	case err != nil:
		where := "the default kubeconfig"
		if rules.ExplicitPath != "" {
			where = rules.ExplicitPath
		}
		return nil, fmt.Errorf("loading Kubernetes configuration from %s: %w", where, err)
	}
	return withClientRate(cfg), nil
}

// Client-side rate limits. client-go's defaults (5 requests/s, burst 10) are
// meant for controllers that share an apiserver with many others; Terraform
// reads every resource of a plan through one provider process, so with them
// a plan of 200 sandboxes spent 39 s waiting on the limiter, not the server.
// The apiserver's own priority and fairness still protects it; the burst is
// the helm provider's default burst_limit.
const (
	DefaultQPS   = 50
	DefaultBurst = 100
)

// withClientRate raises the rate limits only where neither the kubeconfig nor
// a caller chose them.
func withClientRate(cfg *rest.Config) *rest.Config {
	if cfg.QPS == 0 {
		cfg.QPS = DefaultQPS
	}
	if cfg.Burst == 0 {
		cfg.Burst = DefaultBurst
	}
	return cfg
}

// Clients are the untyped and core clients most callers need; anything more
// specific can be built from the same *rest.Config.
type Clients struct {
	Kubernetes kubernetes.Interface
	Dynamic    dynamic.Interface
}

// NewClients builds Clients from cfg. It does not contact the cluster.
func NewClients(cfg *rest.Config) (*Clients, error) {
	k, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return nil, fmt.Errorf("creating Kubernetes client: %w", err)
	}
	d, err := dynamic.NewForConfig(cfg)
	if err != nil {
		return nil, fmt.Errorf("creating dynamic Kubernetes client: %w", err)
	}
	return &Clients{Kubernetes: k, Dynamic: d}, nil
}

// expandHome accepts the "~/.kube/config" spelling users copy from kubectl
// documentation; Go's file functions would otherwise look for a "~" folder.
func expandHome(p string) (string, error) {
	if p != "~" && !strings.HasPrefix(p, "~/") {
		return p, nil
	}
	home, err := os.UserHomeDir()
	if err != nil {
		return "", fmt.Errorf("expanding %q: %w", p, err)
	}
	return filepath.Join(home, strings.TrimPrefix(p, "~")), nil
}

// bytesOrNil keeps unset fields nil, because clientcmd decides whether an
// override replaces the kubeconfig's value by its length and an empty cluster
// is detected with reflect.DeepEqual.
func bytesOrNil(s string) []byte {
	if s == "" {
		return nil
	}
	return []byte(s)
}
