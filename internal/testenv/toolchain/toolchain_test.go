package toolchain

import (
	"slices"
	"testing"
)

// The quickstart builds with ClusterOnly: what a cluster runs, and none of
// the servers that only tests start. Every component is one or the other,
// and Missing, which a cluster's start checks, asks only for the first.
func TestClusterOnlyLeavesOutWhatOnlyTestsStart(t *testing.T) {
	var cluster, tests []string
	for _, c := range components() {
		if c.testOnly {
			tests = append(tests, c.name)
		} else {
			cluster = append(cluster, c.name)
		}
	}
	for _, want := range []string{"etcd", "k8s", "containerd", "gvisor"} {
		if !slices.Contains(cluster, want) {
			t.Errorf("%s is not built for a cluster (cluster components: %v)", want, cluster)
		}
	}
	for _, want := range []string{"versitygw", "snapshot-controller", "csi-provisioner", "kube-router"} {
		if !slices.Contains(tests, want) {
			t.Errorf("%s is built for a cluster, though only tests start it (test-only: %v)", want, tests)
		}
	}
	if slices.ContainsFunc(TestPackages, func(p string) bool { return slices.Contains(ClusterPackages, p) }) {
		t.Errorf("a package is both a cluster's and the tests' own: %v, %v", ClusterPackages, TestPackages)
	}

	missing := Missing(t.TempDir())
	for _, m := range missing {
		for _, c := range components() {
			if c.testOnly && slices.ContainsFunc(c.binary, func(b binary) bool { return b.out == m }) {
				t.Errorf("Missing lists %s, which only tests start", m)
			}
		}
	}
	for _, want := range []string{"kube-apiserver", "runsc", LocalPathProvisioner, "images/pause.tar"} {
		if !slices.Contains(missing, want) {
			t.Errorf("Missing on an empty cache does not list %s: %v", want, missing)
		}
	}
}
