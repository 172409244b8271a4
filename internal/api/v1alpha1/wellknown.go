package v1alpha1

import (
	"crypto/sha256"
	"encoding/hex"
	"net"
	"strconv"
)

// Labels the control plane puts on the objects it creates, so that they can
// be selected without reading every Sandbox.
const (
	// LabelSandbox carries the name of the Sandbox an object (pod, PVC,
	// Secret, Lease, proxy) belongs to.
	LabelSandbox = GroupName + "/sandbox"

	// LabelAgentIDHash carries AgentIDHash(spec.agentID). Agent IDs may be
	// longer than a label value or contain characters labels do not allow, so
	// the hash stands in for them.
	LabelAgentIDHash = GroupName + "/agent-id-hash"

	// LabelTemplate carries the name of the SandboxTemplate a sandbox's pod
	// was made from; warm-pool adoption matches on it.
	LabelTemplate = GroupName + "/template"

	// LabelWarmPool carries the name of the SandboxWarmPool an unassigned
	// sandbox belongs to. Adoption removes it.
	LabelWarmPool = GroupName + "/warm-pool"

	// LabelEgressProxy carries the name of the EgressProxy that proxy pods and
	// Services implement.
	LabelEgressProxy = GroupName + "/egress-proxy"

	// LabelNodePool carries, on nodes, the name of the GVisorNodePool that
	// prepared them; the pool's RuntimeClass schedules onto it.
	LabelNodePool = GroupName + "/node-pool"
)

// Finalizer is put on Sandboxes (and the other kinds whose children live
// outside their namespace or need ordered teardown) so the control plane can
// delete snapshots, leases and proxies before the object goes away.
const Finalizer = GroupName + "/finalizer"

// SupervisorPort is the port the in-pod supervisor serves HTTPS (mTLS) on.
const SupervisorPort = 8443

// DefaultRuntimeClassName is the RuntimeClass sandboxes use unless told
// otherwise; GKE Sandbox names its RuntimeClass the same.
const DefaultRuntimeClassName = "gvisor"

// GKESandboxTaintKey is the taint GKE Sandbox puts on its gVisor nodes; a
// GVisorNodePool in GKE mode tolerates it.
const GKESandboxTaintKey = "sandbox.gke.io/runtime"

// AgentIDHash is the value of LabelAgentIDHash for an agent ID: the first 32
// hex digits (128 bits) of its SHA-256. Writers and readers of the label must
// both use it.
func AgentIDHash(agentID string) string {
	sum := sha256.Sum256([]byte(agentID))
	return hex.EncodeToString(sum[:16])
}

// SupervisorEndpoint is the value of status.serviceEndpoint for a pod IP.
func SupervisorEndpoint(podIP string) string {
	return "https://" + net.JoinHostPort(podIP, strconv.Itoa(SupervisorPort))
}

// LeaseName names a sandbox's coordination.k8s.io Lease, its activity clock:
// the controller creates it and the Compute API renews it, so both take the
// name from here.
func LeaseName(sandbox string) string { return sandbox }
