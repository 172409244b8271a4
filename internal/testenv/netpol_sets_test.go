package testenv

import "testing"

// Teardown destroys kube-router's ipsets by name, so the pattern must take
// every name it makes and nothing else on the host.
func TestKubeRouterSetNames(t *testing.T) {
	for name, want := range map[string]bool{
		"KUBE-SRC-ZOZ7MULF6K25JHPY":       true,
		"KUBE-DST-ABCDEFGHIJKLMNOP":       true,
		"inet6:KUBE-SRC-ZOZ7MULF6K25JHPY": true,
		"TMP-ABCDEFGHIJKLMNOP":            true,
		"kube-router-pod-subnets":         true,
		"TMP-mine":                        false,
		"KUBE-NODEPORTS":                  false,
		"my-set":                          false,
		"xKUBE-SRC-ABC":                   false,
	} {
		if got := kubeRouterSet.MatchString(name); got != want {
			t.Errorf("kubeRouterSet.MatchString(%q) = %v, want %v", name, got, want)
		}
	}
}
