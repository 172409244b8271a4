package v1alpha1

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"net"
	"strconv"
	"strings"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/validation"
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
	// sandbox (and its pod) belongs to. An adopting Sandbox takes the pod
	// over without it, and the warm Sandbox is deleted.
	LabelWarmPool = GroupName + "/warm-pool"

	// LabelEgressProxy carries the name of the EgressProxy that proxy pods and
	// Services implement.
	LabelEgressProxy = GroupName + "/egress-proxy"

	// LabelNodePool carries, on nodes, the name of the GVisorNodePool that
	// prepared them; the pool's RuntimeClass schedules onto it.
	LabelNodePool = GroupName + "/node-pool"

	// LabelRunID carries, on the sandbox the Compute API makes for a job
	// run, the run's id: the sandbox lives as long as the run, and the
	// run sweeper deletes one whose run has ended or is gone.
	LabelRunID = GroupName + "/run-id"
)

// Annotations of warm-pool sandboxes.
const (
	// AnnotationAdoptedBy, on a warm sandbox, names the Sandbox that has
	// claimed it. The control plane's store decides the claim first (a
	// warm take), so of the new Sandboxes, pool leases and pool deletions
	// racing for the same warm one exactly one wins; the annotation then
	// says who. The warm sandbox's own reconciler leaves its children
	// alone from then on, and the winner moves them over and deletes it.
	AnnotationAdoptedBy = GroupName + "/adopted-by"

	// AnnotationTemplateHash, on a warm sandbox, is TemplateHash of the
	// template spec its pod was made from. The pool replaces warm sandboxes
	// whose hash is not the template's current one, and adoption skips them.
	AnnotationTemplateHash = GroupName + "/template-hash"
)

// Annotations of a warm sandbox leased straight from its pool for one
// ephemeral run (a pool lease). The control plane's store decides
// which caller gets the sandbox (a warm take, shared with adoption and the
// pool's deletions, so exactly one of them wins); the Compute API then
// writes the sandbox's Lease hold and, after it, these annotations. From
// then on the pool no longer counts the sandbox (it makes a replacement),
// adoption skips it, and once the hold ends (released, expired, or never
// taken) the Sandbox controller deletes it: no state survives a run.
const (
	// AnnotationPoolLeaseHolder is the holder the lease was acquired for.
	AnnotationPoolLeaseHolder = GroupName + "/pool-lease-holder"
	// AnnotationPoolLeaseRequestID is the acquire's request ID; the hold
	// on the sandbox's Lease carries the same one while it lasts.
	AnnotationPoolLeaseRequestID = GroupName + "/pool-lease-request-id"
	// AnnotationPoolLeasedAt is when the sandbox was taken (RFC 3339). A
	// sandbox taken but never held past PoolLeaseGrace is deleted: the
	// replica that took it died before writing the hold, and no lease call
	// of its holder (each of which writes a missing hold) came since.
	AnnotationPoolLeasedAt = GroupName + "/pool-leased-at"
)

// PoolLeaseGrace is how long a sandbox taken from its pool may go without
// the Lease hold of the acquire that took it. It covers the hold's write,
// with its retries, many times over.
const PoolLeaseGrace = time.Minute

// AnnotationPoolColdStart, set to "true" on a sandbox of a warm pool, says
// that the Compute API created it for one pool lease that found the pool
// exhausted (the pool's spec.coldStartWhenExhausted). It carries the pool
// lease annotations from its creation, so the pool never counts or hands
// it out; the lease's hold is written once it is ready, so it may go
// without one for PoolColdStartGrace rather than PoolLeaseGrace.
const AnnotationPoolColdStart = GroupName + "/pool-cold-start"

// PoolColdStartGrace is how long a cold-started pool sandbox may go
// without the hold of the lease it was made for: the longest a pool lease
// waits for it (five minutes, the Compute API's bound on wait_seconds)
// plus PoolLeaseGrace for the hold's write.
const PoolColdStartGrace = 5*time.Minute + PoolLeaseGrace

// AnnotationCreatedByRequest, on a Sandbox the Compute API's
// deploy_or_resume created, is the request ID of the call that created
// it: a retry with the same request ID is told the sandbox was created
// for it, any other call that it existed already.
const AnnotationCreatedByRequest = GroupName + "/created-by-request"

// AnnotationPoolReset is on a warm sandbox of a Reuse pool whose pool
// lease ended and that is being readied for its next holder; the value is
// the ended lease's request ID. Its pod is recreated with the workspace
// reset (the same annotation on the pod says which lease's reset it ran),
// and the sandbox is takeable again only once the new pod serves.
const AnnotationPoolReset = GroupName + "/pool-reset"

// AnnotationPoolResetAt is when the reset began (RFC 3339); a reset that
// has not finished within PoolResetTimeout deletes the sandbox.
const AnnotationPoolResetAt = GroupName + "/pool-reset-at"

// AnnotationPoolReusedAt is when a warm sandbox last came back to its
// pool from a lease (RFC 3339).
const AnnotationPoolReusedAt = GroupName + "/pool-reused-at"

// PoolResetTimeout bounds a reused sandbox's reset: the old pod's end, the
// new pod's start and the workspace's reset in its init container.
const PoolResetTimeout = 5 * time.Minute

// PoolLeased reports whether a warm sandbox has been leased from its pool.
func PoolLeased(s *Sandbox) bool { return s.Annotations[AnnotationPoolLeaseRequestID] != "" }

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

// ActivityRenewInterval is the most the Compute API lets pass between two
// renewals of a sandbox's activity clock while it is called: calls within
// it after a renewal are not written. So a renewTime says only that the
// sandbox may have been used until this long after it; the controller
// reads it that way (a checkpoint begun within it may have missed calls).
const ActivityRenewInterval = 30 * time.Second

// Annotations on a sandbox's Lease that describe the current exclusive
// hold (an exclusive lease) beside spec.holderIdentity. The Compute API writes them
// with the holder and the controller removes them when it reclaims an
// expired hold, so both take the keys from here.
const (
	// AnnotationLeaseRequestID is the request ID of the acquire that
	// started the hold; a retry with the same holder and request ID gets
	// the same hold back.
	AnnotationLeaseRequestID = GroupName + "/lease-request-id"
	// AnnotationLeaseID names the hold; heartbeat and release must present
	// it.
	AnnotationLeaseID = GroupName + "/lease-id"
	// AnnotationLeaseExpiredHolder names the holder whose hold the
	// controller reclaimed after it expired. It stays until the next
	// acquire, so that the Sandbox's Leased condition can say Expired from
	// the Lease alone rather than from its own earlier status, which a
	// lagging cache may not show yet.
	AnnotationLeaseExpiredHolder = GroupName + "/lease-expired-holder"
	// AnnotationLeaseReleasedRequestID is the request ID of the hold the
	// holder last released, kept until the next acquire. It is how the
	// controller tells a sandbox leased from its pool whose run is over
	// (and which it deletes at once) from one whose acquire has not
	// written its hold yet.
	AnnotationLeaseReleasedRequestID = GroupName + "/lease-released-request-id"
)

// AnnotationWokenAt, on a sandbox's Lease, is the renewTime that the
// Compute API wrote to wake the sandbox (a call to a stopped or starting
// sandbox), in RFC 3339 with microseconds as renewTime itself is stored.
// While renewTime still equals it, the last activity is a call that waits
// for the sandbox to serve, so the controller measures the sandbox's
// idleness from when it began to serve: a resume slower than the idle
// timeout must not be stopped again before the call that woke it runs.
// Any later renewal (a call, a hold) moves renewTime past it.
const AnnotationWokenAt = GroupName + "/woken-at"

// LeaseWoken reports whether a Lease's renewTime is still the wake its
// AnnotationWokenAt records: no activity since the Compute API woke it.
func LeaseWoken(annotations map[string]string, renewTime *metav1.MicroTime) bool {
	v, ok := annotations[AnnotationWokenAt]
	if !ok || renewTime == nil {
		return false
	}
	t, err := time.Parse(metav1.RFC3339Micro, v)
	return err == nil && t.Equal(renewTime.Truncate(time.Microsecond))
}

// LeaseHoldExpiry returns the holder of a sandbox Lease and when the hold
// expires: renewTime plus leaseDurationSeconds, the Kubernetes Lease rule.
// The holder is empty when nobody holds it. A hold missing its renewTime or
// duration expires at the zero time, so a malformed hold can never keep a
// sandbox busy.
func LeaseHoldExpiry(spec *coordinationv1.LeaseSpec) (holder string, expiry time.Time) {
	if spec.HolderIdentity == nil || *spec.HolderIdentity == "" {
		return "", time.Time{}
	}
	if spec.RenewTime == nil || spec.LeaseDurationSeconds == nil {
		return *spec.HolderIdentity, time.Time{}
	}
	return *spec.HolderIdentity, spec.RenewTime.Add(time.Duration(*spec.LeaseDurationSeconds) * time.Second)
}

// Node pool metadata on nodes. The GVisorNodePool controller writes
// AnnotationNodePoolTaint (with LabelNodePool) on the nodes it prepares and
// removes it when a node leaves the pool; LabelRunscInstalled belongs to
// whoever installed runsc and is only read.
const (
	// LabelRunscInstalled, set to "true" on a node, tells the GVisorNodePool
	// controller that runsc is installed there. It is needed only where the
	// node does not list runsc among status.runtimeHandlers (container
	// runtimes older than containerd 2.0 report no handlers); an operator or
	// an installer of one's own sets it, the controller only reads it.
	LabelRunscInstalled = GroupName + "/runsc-installed"

	// AnnotationNodePoolTaint records, on a node, the taint a Managed pool
	// put there, as key=value:effect. It is how the controller tells its own
	// taint from the ones others (the node lifecycle controller, operators)
	// put on the node, so that it removes only its own when the pool's taint
	// changes, the node leaves the pool, or the pool is deleted.
	AnnotationNodePoolTaint = GroupName + "/node-pool-taint"
)

// RunscHandler is the CRI runtime handler of gVisor: the handler of the
// RuntimeClasses Managed pools create, and the name under which nodes list
// it in status.runtimeHandlers.
const RunscHandler = "runsc"

// GKESandboxTaintValue is the value of GKE Sandbox's node taint
// (GKESandboxTaintKey=gvisor:NoSchedule).
const GKESandboxTaintValue = "gvisor"

// TemplateHash is the value of AnnotationTemplateHash for a template spec:
// the first 16 hex digits of the SHA-256 of its JSON. A hash rather than
// metadata.generation, because a template deleted and created again starts
// over at generation 1 with a possibly different spec.
func TemplateHash(spec *SandboxTemplateSpec) string {
	b, err := json.Marshal(spec)
	if err != nil {
		// A spec that does not marshal cannot have come from the API; an
		// empty hash matches no warm sandbox, so they are all replaced.
		return ""
	}
	sum := sha256.Sum256(b)
	return hex.EncodeToString(sum[:8])
}

// The ConfigMap in which the control plane publishes its state, in the
// platform namespace, for the Terraform provider (agentbox_platform warns
// when the snapshot check fails) and for people (kubectl get configmap
// agentbox-controlplane-status -o yaml). The leader writes it at start and
// whenever the result of its snapshot check changes, and at least every ten
// minutes; the control plane Deployment owns it, so it goes with the
// platform.
const (
	ControlPlaneStatusConfigMap = "agentbox-controlplane-status"

	// StatusKeySnapshotDriver is the snapshot driver the control plane
	// runs, as snapshots record it: "volumesnapshot", "archive/s3" or
	// "archive/embedded".
	StatusKeySnapshotDriver = "snapshot.driver"
	// StatusKeySnapshotReady is "true" when the driver can take and
	// restore snapshots, else "false": idle stops are then not begun.
	StatusKeySnapshotReady = "snapshot.ready"
	// StatusKeySnapshotReason is one of the snapshot check reasons
	// (ReasonSnapshotDriverReady, ReasonSnapshotAPIMissing, ...).
	StatusKeySnapshotReason = "snapshot.reason"
	// StatusKeySnapshotMessage says what is wrong and how to fix it.
	StatusKeySnapshotMessage = "snapshot.message"
	// StatusKeySnapshotCheckedAt is when the check last ran (RFC 3339).
	StatusKeySnapshotCheckedAt = "snapshot.checkedAt"
	// StatusKeyReportedBy names the control plane pod that wrote it.
	StatusKeyReportedBy = "reportedBy"
)

// DefaultCheckpointsKept is how many checkpoints a running sandbox keeps
// when its template does not say; the CRD's default for checkpointsKept.
const DefaultCheckpointsKept = 3

// The Python environment inventory of a sandbox: one annotation per cached
// environment, AnnotationPythonEnvPrefix followed by the environment's
// name (for an environment asked for by requirements alone, the stable
// key of its requirement set), whose value is PythonEnvBuilt, or
// PythonEnvBuilding followed by "@" and the Unix time the build was seen
// to start (PythonEnvBuildingAt). The Compute API writes them as it learns
// of a change (an environment built, deleted, or missing from a list or an
// execute's answer, or evicted, as the keep-alive health call of a free
// warm sandbox tells), so that a pool lease, a pool run or an adopting
// Sandbox can prefer a sandbox that holds the environment its caller asks
// for without asking every sandbox. It is a hint. A building mark older
// than PythonEnvBuildingMaxAge was left by a call that never saw its build
// end (an API replica that died meanwhile): it reads as absent, and the
// next write to the sandbox's inventory removes it. A mark of plain
// PythonEnvBuilding (written before marks carried their time) reads as
// building. Names longer than an annotation name allows are not recorded.
const (
	AnnotationPythonEnvPrefix = "pyenv." + GroupName + "/"
	PythonEnvBuilt            = "built"
	PythonEnvBuilding         = "building"
)

// A new Sandbox may name the Python environment its agent will use, so
// that when it adopts a warm sandbox of its template it takes one that
// holds that environment (by its inventory), else one building it, else
// any, as a pool lease naming one does. It names it by
// AnnotationPythonEnvName (an environment name, as env_name in execute)
// or AnnotationPythonRequirements (the requirement set, separated by
// whitespace, as requirements in execute; its key is worked out under the
// template's package indexes), not both. The Sandbox controller writes how
// the adoption went into AnnotationPythonEnvRouting: hit, building or
// miss, as a pool lease's routing.result. A job-mode run sets the first
// two from its pool_env_name or pool_requirements.
const (
	AnnotationPythonEnvName      = GroupName + "/python-env-name"
	AnnotationPythonRequirements = GroupName + "/python-requirements"
	AnnotationPythonEnvRouting   = GroupName + "/python-env-routing"
)

// PythonEnvBuildingMaxAge bounds how long a building mark counts: twice
// the supervisor's default build timeout (five minutes), past which no
// build the mark could describe is still running.
const PythonEnvBuildingMaxAge = 10 * time.Minute

// PythonEnvBuildingAt is the inventory value of an environment whose build
// was seen to start at t.
func PythonEnvBuildingAt(t time.Time) string {
	return PythonEnvBuilding + "@" + strconv.FormatInt(t.Unix(), 10)
}

// PythonEnvAnnotation is the inventory annotation of the environment
// named name, or "" when the name does not fit an annotation's name part.
func PythonEnvAnnotation(name string) string {
	if len(validation.IsQualifiedName(AnnotationPythonEnvPrefix+name)) > 0 {
		return ""
	}
	return AnnotationPythonEnvPrefix + name
}

// PythonEnvState is the state sb's inventory records for the environment
// named name: PythonEnvBuilt, PythonEnvBuilding or "" (none, or a building
// mark past PythonEnvBuildingMaxAge).
func PythonEnvState(sb *Sandbox, name string) string {
	return PythonEnvStateAt(sb, name, time.Now())
}

// PythonEnvStateAt is PythonEnvState at now.
func PythonEnvStateAt(sb *Sandbox, name string, now time.Time) string {
	key := PythonEnvAnnotation(name)
	if key == "" {
		return ""
	}
	return PythonEnvValueState(sb.Annotations[key], now)
}

// PythonEnvValueState is the state an inventory annotation's value
// records at now: PythonEnvBuilt, PythonEnvBuilding or "".
func PythonEnvValueState(v string, now time.Time) string {
	switch v {
	case PythonEnvBuilt, PythonEnvBuilding:
		return v
	}
	at, ok := strings.CutPrefix(v, PythonEnvBuilding+"@")
	if !ok {
		return ""
	}
	sec, err := strconv.ParseInt(at, 10, 64)
	if err != nil || now.Sub(time.Unix(sec, 0)) > PythonEnvBuildingMaxAge {
		return ""
	}
	return PythonEnvBuilding
}

// PrewarmEnvsAnnotation is the value of AnnotationPrewarmEnvs for a pool's
// environments; "" for none.
func PrewarmEnvsAnnotation(envs []WarmPythonEnvironment) string {
	if len(envs) == 0 {
		return ""
	}
	// Plain data: a marshal error cannot happen.
	b, _ := json.Marshal(envs)
	return string(b)
}

// PrewarmEnvs are the environments a warm sandbox is to build ahead, as
// its AnnotationPrewarmEnvs says; nil for none, or for a value that does
// not parse.
func PrewarmEnvs(sb *Sandbox) []WarmPythonEnvironment {
	v := sb.Annotations[AnnotationPrewarmEnvs]
	if v == "" {
		return nil
	}
	var envs []WarmPythonEnvironment
	if json.Unmarshal([]byte(v), &envs) != nil {
		return nil
	}
	return envs
}

// PrewarmSettled reports whether a warm sandbox is done with its pool's
// environments: it has none to build, or its PythonEnvironmentsReady
// condition says they were built (or that a build failed: a sandbox whose
// build failed is leased all the same, rather than never).
func PrewarmSettled(sb *Sandbox) bool {
	if sb.Annotations[AnnotationPrewarmEnvs] == "" {
		return true
	}
	for _, c := range sb.Status.Conditions {
		if c.Type == ConditionPythonEnvironmentsReady {
			return c.Status == metav1.ConditionTrue || c.Reason == ReasonPrewarmFailed
		}
	}
	return false
}
