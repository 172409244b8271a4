package toolchain

// The CSI side of the test node. The sidecars are the Kubernetes CSI
// project's own, built from the Go module proxy; the driver is this
// repository's test-only csihostpath, because the proxy serves neither
// csi-driver-host-path nor node-driver-registrar.
const (
	// ExternalProvisionerVersion is the csi-provisioner release; the
	// csi-provisioner wrapper pins the same one.
	ExternalProvisionerVersion = "v5.3.0"
	// CSIProvisioner is the sidecar that calls a CSI driver's CreateVolume
	// and DeleteVolume for claims of its StorageClasses, also to restore a
	// claim from a VolumeSnapshot.
	CSIProvisioner = "csi-provisioner"
	// CSIHostPath is the test node's CSI driver, built from
	// internal/testenv/csihostpath.
	CSIHostPath        = "agentbox-csi-hostpath"
	csiHostPathPackage = "github.com/agentbox/terraform-provider-agentbox/internal/testenv/csihostpath"
)

func csiProvisioner() component {
	return component{name: "csi-provisioner", testOnly: true, binary: []binary{
		{CSIProvisioner, "github.com/kubernetes-csi/external-provisioner/v5/cmd/csi-provisioner"},
	}, ldflags: "-s -w -X main.version=" + ExternalProvisionerVersion}
}
