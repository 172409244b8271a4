package toolchain

// The NetworkPolicy enforcer of the test node: kube-router with only its
// firewall on. Security reports are filed against the release pinned here,
// so it stays test-only: it is built into the test cache alone, never into
// the chart or an image, and the cluster runs it with every listener off.
const (
	// KubeRouterVersion is the kube-router release; the kube-router wrapper
	// pins the same one.
	KubeRouterVersion = "v2.1.0"
	// KubeRouter is its file name under BinDir.
	KubeRouter = "kube-router"
)

func kubeRouter() component {
	return component{name: "kube-router", testOnly: true, binary: []binary{
		{KubeRouter, "github.com/cloudnativelabs/kube-router/v2/cmd/kube-router"},
	}, ldflags: "-s -w -X github.com/cloudnativelabs/kube-router/v2/pkg/version.Version=" + KubeRouterVersion}
}
