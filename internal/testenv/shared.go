package testenv

import (
	"os"
	"path/filepath"
	"testing"

	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/agentbox/terraform-provider-agentbox/internal/testenv/toolchain"
)

// EnvKubeconfig names the variable through which `make test` hands the one
// shared cluster to every test package. One node per machine: kubelet,
// containerd, the bridge and iptables are machine-wide, so packages running
// in parallel share a cluster and keep to their own namespaces.
const EnvKubeconfig = "AGENTBOX_TEST_KUBECONFIG"

// Shared returns the admin configuration of the shared test cluster. Without
// one it skips the test, except in CI, where a missing cluster is a failure:
// CI machines can always run it.
func Shared(t testing.TB) (*rest.Config, string) {
	t.Helper()
	path := os.Getenv(EnvKubeconfig)
	if path == "" {
		if os.Getenv("CI") != "" {
			t.Fatalf("%s is not set; run the tests with `make test`, which starts the test cluster", EnvKubeconfig)
		}
		t.Skipf("no test cluster: run `make test`, or start one with `agentbox-testenv up -node` and set %s", EnvKubeconfig)
	}
	cfg, err := clientcmd.BuildConfigFromFlags("", path)
	if err != nil {
		t.Fatalf("load %s=%s: %v", EnvKubeconfig, path, err)
	}
	return cfg, path
}

// EnvNetworkPolicy is set to "1" in the environment of a command that
// `agentbox-testenv exec -netpol` runs: the shared cluster's node enforces
// NetworkPolicies.
const EnvNetworkPolicy = "AGENTBOX_TEST_NETWORK_POLICY"

// RequireNetworkPolicy skips a test that proves a NetworkPolicy holds when
// the shared cluster does not enforce them, except in CI, where `make test`
// always starts the cluster with the enforcer: there it is a failure.
func RequireNetworkPolicy(t testing.TB) {
	t.Helper()
	if os.Getenv(EnvNetworkPolicy) == "1" {
		return
	}
	if os.Getenv("CI") != "" {
		t.Fatalf("the shared cluster does not enforce NetworkPolicies (%s is not 1); `make test` starts it with -netpol", EnvNetworkPolicy)
	}
	t.Skipf("the shared cluster does not enforce NetworkPolicies: start it with `agentbox-testenv up -node -netpol` and set %s=1", EnvNetworkPolicy)
}

// EnvtestAssets returns the folder holding the kube-apiserver and etcd that
// envtest runs: KUBEBUILDER_ASSETS when set, else the toolchain `make
// testenv` builds. It skips the test when they are missing, except in CI.
func EnvtestAssets(t testing.TB) string {
	t.Helper()
	bin := os.Getenv("KUBEBUILDER_ASSETS")
	if bin == "" {
		dir, err := toolchain.DefaultDir()
		if err != nil {
			t.Skip(err)
		}
		bin = toolchain.BinDir(dir)
	}
	for _, b := range []string{"kube-apiserver", "etcd"} {
		if _, err := os.Stat(filepath.Join(bin, b)); err != nil {
			if os.Getenv("CI") != "" {
				t.Fatalf("%s is not built; run `make testenv`", b)
			}
			t.Skipf("%s is not built; run `make testenv`", b)
		}
	}
	return bin
}
