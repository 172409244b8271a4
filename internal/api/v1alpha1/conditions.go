package v1alpha1

// Condition types. Every agentbox resource reports one summary condition,
// Ready; its reason, one of the constants below, says why it has the status
// it has, and its message gives the detail. A Sandbox also reports Leased.
const (
	// ConditionReady is True when the object does what its spec asks: a
	// Sandbox's supervisor answers, a warm pool is full, a proxy has ready
	// endpoints, a node pool has ready nodes, a template's references resolve.
	ConditionReady = "Ready"

	// ConditionLeased is True while someone holds the Sandbox's exclusive
	// lease, taken through the Compute API and stored as the
	// holder of the sandbox's coordination.k8s.io Lease; its message names
	// the holder. It is independent of Ready: a stopped sandbox can be
	// leased.
	ConditionLeased = "Leased"

	// ConditionIdleStopBlocked is True on a Sandbox whose last idle stop
	// could not be taken and was abandoned: the sandbox stays Running and
	// keeps serving calls, and status.idleStopRetry says when the next stop
	// is tried. Its reason is one of the snapshot check reasons below, or
	// SnapshotFailed; its message says why and names the fix. It is removed
	// when an idle stop succeeds.
	ConditionIdleStopBlocked = "IdleStopBlocked"

	// ConditionPodSecurity says whether the Sandbox's namespace enforces
	// the restricted Pod Security Standard
	// (pod-security.kubernetes.io/enforce=restricted). The sandbox's own
	// pod meets restricted either way; the controller builds it so. What
	// the label decides is whether the API server would admit other pods
	// there that do not, pods that could mount the sandboxes' Secrets and
	// workspace volumes. It is independent of Ready: a sandbox runs in a
	// namespace that does not enforce restricted, and says so here and in
	// a PodSecurityNotEnforced event. The platform labels only namespaces
	// it creates (the release namespace, when the provider's
	// agentbox_platform creates it); a namespace its owner made is never
	// relabelled, since the label is a policy for every pod in it.
	ConditionPodSecurity = "PodSecurity"
)

// Reasons of a Sandbox's PodSecurity condition.
const (
	// ReasonRestrictedEnforced (status True): the namespace's enforce label
	// is restricted.
	ReasonRestrictedEnforced = "RestrictedEnforced"

	// ReasonRestrictedNotEnforced (status False): the namespace enforces
	// baseline or privileged, or has no enforce label (then the cluster's
	// PodSecurity admission default applies, privileged unless configured
	// otherwise). The message names the label's value.
	ReasonRestrictedNotEnforced = "RestrictedNotEnforced"
)

// Reasons of a Sandbox's Leased condition.
const (
	// ReasonLeaseHeld (status True): a holder has the lease and its last
	// heartbeat (or the sandbox's last activity) is within the lease's TTL.
	ReasonLeaseHeld = "Held"

	// ReasonLeaseReleased (status False): nobody holds the lease; its last
	// holder released it, or it was never acquired.
	ReasonLeaseReleased = "Released"

	// ReasonLeaseExpired (status False): the last holder stopped
	// heartbeating and the TTL ran out, so the controller removed the hold
	// and the sandbox is free for the next acquire. It stays until the
	// lease is acquired again (the Lease's lease-expired-holder annotation
	// records it until then).
	ReasonLeaseExpired = "Expired"
)

// Reasons shared by several kinds.
const (
	// ReasonReconcileError: an API call the controller made failed. The
	// message carries the error; the controller retries with backoff.
	ReasonReconcileError = "ReconcileError"

	// ReasonTemplateNotFound: the SandboxTemplate named in spec.templateRef
	// does not exist (Sandbox, SandboxWarmPool). The object waits for it.
	ReasonTemplateNotFound = "TemplateNotFound"

	// ReasonEgressProxyNotFound: the template's egressProxyRef names no
	// EgressProxy (SandboxTemplate, Sandbox). Sandboxes wait rather than start
	// without their proxy.
	ReasonEgressProxyNotFound = "EgressProxyNotFound"

	// ReasonNodePoolNotFound: the template's nodePoolRef names no
	// GVisorNodePool (SandboxTemplate, Sandbox).
	ReasonNodePoolNotFound = "NodePoolNotFound"

	// ReasonNamespaceNotServed (Sandbox, SandboxWarmPool, EgressProxy, RunSchedule):
	// the object is in a namespace the platform does not serve. The
	// control plane's rights over pods, Secrets and the sandboxes' other
	// children reach only the namespaces the platform lists (the chart's
	// sandboxNamespaces, agentbox_platform's sandbox_namespaces, and always
	// the platform's own namespace), so it makes nothing here: a Sandbox
	// stays Pending without a pod, a warm pool makes no sandboxes, a proxy
	// runs no pods. The message names the served namespaces; the fix is to
	// add this one to the list, or to create the object in a served
	// namespace. A NamespaceNotServed event goes with it.
	ReasonNamespaceNotServed = "NamespaceNotServed"
)

// Reasons of a SandboxTemplate's Ready condition.
const (
	// ReasonTemplateResolved: every reference in the template resolves.
	ReasonTemplateResolved = "Resolved"
)

// Reasons of a Sandbox's Ready condition. Each phase has its own reason, so
// the condition tells the same story as status.phase, in more detail.
const (
	// ReasonCreating (phase Pending): the pod and workspace are being created,
	// or the pod is not ready yet, or (behind a PerAgent egress proxy) the
	// sandbox's proxy pod is not: a sandbox serves once the proxy its
	// HTTP_PROXY names answers.
	ReasonCreating = "Creating"

	// ReasonAdoptedFromWarmPool (phase Pending or Running): the sandbox took
	// over a ready sandbox from a warm pool of its template instead of
	// starting cold. Pending while the warm sandbox's pod, workspace claim
	// and certificate are moved over (status.workload names it), Running
	// (status True) once they are and the pod is ready; it stays until the
	// pod next changes, such as at an idle stop.
	ReasonAdoptedFromWarmPool = "AdoptedFromWarmPool"

	// ReasonRunning (phase Running, status True): the pod is ready and the
	// supervisor answers on its endpoint.
	ReasonRunning = "Running"

	// ReasonIdleTimeout (phase IdleStopping): the sandbox was idle for its
	// idle timeout; the workspace is being synced and snapshotted before the
	// pod is deleted. Activity that arrives while the pod still runs
	// abandons the stop (the sandbox is no longer idle): the snapshot in
	// progress is discarded and the sandbox is Running again at once, so a
	// call never waits for a stop to finish and a resume to follow.
	ReasonIdleTimeout = "IdleTimeout"

	// ReasonStopped (phase Stopped): the pod and workspace volume are gone and
	// status.snapshot holds the workspace. The next activity resumes it.
	ReasonStopped = "Stopped"

	// ReasonResuming (phase Resuming): the workspace is being restored from
	// the latest snapshot and the pod started.
	ReasonResuming = "Resuming"

	// ReasonSnapshotFailed: the snapshot taken at idle stop could not be
	// started or failed. While the pod still runs, which is the usual case,
	// the stop is abandoned: the sandbox stays Running and serving, and this
	// is the reason of its IdleStopBlocked condition (status True) until a
	// later stop, retried with backoff, succeeds. Only when the pod was
	// already gone is it the Ready reason of phase Error: the workspace
	// claim is kept (it holds the only copy of the newest data) and so is
	// the last good snapshot, and the next activity starts the pod again on
	// the kept claim.
	ReasonSnapshotFailed = "SnapshotFailed"

	// ReasonRestoreFailed (phase Error): the workspace could not be restored
	// from the snapshot on resume because the snapshot is gone from its
	// store. The pod runs but the sandbox takes no calls: serving an empty
	// workspace in place of the agent's would lose data silently. Delete
	// the Sandbox to start afresh. Transient restore errors are retried
	// and reported as ReconcileError instead.
	ReasonRestoreFailed = "RestoreFailed"

	// ReasonSnapshotDriverChanged (phase Error): the sandbox is stopped
	// and its snapshot was taken by another snapshot driver or store
	// (status.snapshot.driver) than the platform runs now, which cannot
	// restore it. Nothing is created for it; configure the platform's
	// snapshot driver back to resume it, or delete the Sandbox to start
	// afresh without its workspace.
	ReasonSnapshotDriverChanged = "SnapshotDriverChanged"

	// ReasonSyncFailed (phase Error): making the workspace's last writes
	// durable before an idle stop's snapshot (the push into the agent's
	// filespace, then the supervisor's flush) failed, also on the one
	// retry; the pod was stopped without a snapshot, the workspace claim
	// is kept, and the next activity starts the sandbox on it.
	ReasonSyncFailed = "SyncFailed"

	// ReasonPodFailed (phase Error): the pod failed (evicted, or refused by
	// kubelet at admission), or its container cannot run: the message
	// carries kubelet's reason, such as ImagePullBackOff, ErrImageNeverPull
	// or CrashLoopBackOff, and the container's last exit. A stopped pod is deleted and created again; a
	// container that cannot start is retried by kubelet, and the sandbox
	// turns Running as soon as the pod is ready.
	ReasonPodFailed = "PodFailed"

	// ReasonImageRunsAsRoot (phase Error): the template runs the sandbox as
	// its image's user (runAsImageUser), and kubelet refused to start the
	// container because that user is root, is unset (so root), or is a name
	// it cannot check is not root. A sandbox never runs as root: give the
	// image a numeric non-root USER, or turn runAsImageUser off to run it
	// as user 65532. The message carries kubelet's words.
	ReasonImageRunsAsRoot = "ImageRunsAsRoot"

	// ReasonNodeLost (phase Error): the node the sandbox ran on no longer
	// exists (its Node object was deleted). It is the same whether the
	// controller sees the pod on the deleted node, or finds the pod already
	// removed by the pod garbage collector (status.nodeName still names the
	// node), or finds the workspace volume pinned to a node that is gone.
	// The pod is force-deleted, since no kubelet will confirm a graceful
	// deletion. A workspace on node-local storage of that node is lost
	// with it: its claim is deleted, and the sandbox will resume from its
	// last snapshot, or, without one, with an empty workspace (its files
	// are lost, as the message says). A workspace on network storage is
	// kept, to be mounted on another node with its files. status.nodeLoss
	// records the loss. The sandbox then waits, holding no node: the next
	// activity (any call through the Compute API, which waits for the
	// resume) starts it on another node. A warm pool's unassigned sandbox
	// has no caller and starts again at once.
	ReasonNodeLost = "NodeLost"

	// ReasonOwnershipConflict (phase Error): an object the sandbox needs
	// (its pod, workspace claim, TLS Secret or Lease) exists under the name
	// the controller gives it but is not controlled by the Sandbox. The
	// controller neither adopts nor overwrites it, and proceeds once it is
	// deleted or renamed.
	ReasonOwnershipConflict = "OwnershipConflict"

	// ReasonDuplicateAgent (phase Error): another live Sandbox has the same
	// spec.agentID and is older (by creationTimestamp, then namespace and
	// name); an agent has one sandbox, and the older keeps it. This one
	// gets no pod (one it had is deleted), and a DuplicateAgent event says
	// which sandbox has the agent. It starts by itself once that one is
	// deleted. The Compute API serves the agent's calls from the older one.
	// The refusal is the controller's, after the object is stored: the
	// platform runs no admission webhook, so kubectl, Terraform and the
	// API can all create the second object, and it then waits here.
	ReasonDuplicateAgent = "DuplicateAgent"
)

// Reasons of the control plane's snapshot check, which runs at start and
// every minute and which the control plane publishes in the ConfigMap
// agentbox-controlplane-status of its namespace (key snapshot.reason), as
// events on its Deployment, and, while it fails, as the reason of the
// IdleStopBlocked condition of sandboxes whose idle stop it holds back.
// A Sandbox's IdleStopBlocked condition may also have the reason
// SnapshotFailed: the check passed, but the snapshot of that sandbox could
// not be started or failed while its pod still ran.
const (
	// ReasonSnapshotDriverReady: the configured driver can take and
	// restore snapshots.
	ReasonSnapshotDriverReady = "SnapshotDriverReady"

	// ReasonSnapshotAPIMissing: the volumesnapshot driver is configured
	// but the cluster does not serve snapshot.storage.k8s.io/v1
	// VolumeSnapshots: the CSI snapshot CRDs and snapshot-controller are not
	// installed. Install them, or use the archive driver.
	ReasonSnapshotAPIMissing = "SnapshotAPIMissing"

	// ReasonVolumeSnapshotClassNotFound: the VolumeSnapshotClass the driver
	// would use does not exist: the one configured (or named by the
	// template), or, when none is, a default class.
	ReasonVolumeSnapshotClassNotFound = "VolumeSnapshotClassNotFound"

	// ReasonVolumeSnapshotClassMismatch: the VolumeSnapshotClass's CSI
	// driver is not the provisioner of the workspaces' StorageClass, so it
	// cannot snapshot them.
	ReasonVolumeSnapshotClassMismatch = "VolumeSnapshotClassMismatch"

	// ReasonSnapshotStoreUnavailable: the archive driver's store cannot be
	// used: the S3 bucket does not answer or does not exist, or the
	// embedded store's directory is not writable.
	ReasonSnapshotStoreUnavailable = "SnapshotStoreUnavailable"

	// ReasonSnapshotCheckFailed: the check itself could not run, for
	// example because the API server did not answer; it is tried again.
	ReasonSnapshotCheckFailed = "SnapshotCheckFailed"
)

// Reasons of a SandboxWarmPool's Ready condition.
const (
	// ReasonPoolFull (status True): status.readyReplicas has reached
	// spec.replicas.
	ReasonPoolFull = "PoolFull"

	// ReasonScaling: the pool is starting or removing sandboxes to reach
	// spec.replicas.
	ReasonScaling = "Scaling"
)

// Reasons of a RunSchedule's Ready condition. NamespaceNotServed and
// ReconcileError apply too.
const (
	// ReasonScheduled (status True): the schedule is valid and starts runs
	// at its times; status.nextScheduleTime is the next.
	ReasonScheduled = "Scheduled"

	// ReasonSuspended: spec.suspend is set; no run starts.
	ReasonSuspended = "Suspended"

	// ReasonInvalidSchedule: spec.schedule is not a cron expression the
	// control plane reads; the message says what is wrong. Nothing starts
	// until the spec is fixed.
	ReasonInvalidSchedule = "InvalidSchedule"

	// ReasonInvalidTimeZone: spec.timeZone is not an IANA time zone name.
	ReasonInvalidTimeZone = "InvalidTimeZone"

	// ReasonRunsUnavailable: the control plane runs without the store that
	// runs are recorded in, so it cannot start any.
	ReasonRunsUnavailable = "RunsUnavailable"
)

// Reasons of an EgressProxy's Ready condition.
const (
	// ReasonProxyAvailable (status True): the proxy pods are ready and
	// status.readyEndpoints lists them.
	ReasonProxyAvailable = "ProxyAvailable"

	// ReasonProxyProgressing: proxy pods are being created or are not ready.
	ReasonProxyProgressing = "ProxyProgressing"

	// ReasonUpstreamSecretNotFound: the Secret or key named in
	// spec.upstream.credentialsSecretRef does not exist.
	ReasonUpstreamSecretNotFound = "UpstreamSecretNotFound"

	// ReasonCredentialSecretNotFound: the Secret or key named in a
	// spec.credentials entry's secretRef does not exist.
	ReasonCredentialSecretNotFound = "CredentialSecretNotFound"
)

// Reasons of a GVisorNodePool's Ready condition.
const (
	// ReasonNodesReady (status True): the RuntimeClass exists and at least one
	// selected node can run gVisor pods.
	ReasonNodesReady = "NodesReady"

	// ReasonInstalling (Managed mode): selected nodes are Ready, but none of
	// them has runsc yet: none lists the runsc runtime handler in
	// status.runtimeHandlers or carries agentbox.dev/runsc-installed=true.
	// The runsc installer DaemonSet, when enabled, is putting it there.
	ReasonInstalling = "Installing"

	// ReasonNoMatchingNodes: spec.nodeSelector selects no node.
	ReasonNoMatchingNodes = "NoMatchingNodes"

	// ReasonRuntimeClassNotFound (GKE mode): the RuntimeClass to adopt does
	// not exist; GKE Sandbox is not enabled on any node pool.
	ReasonRuntimeClassNotFound = "RuntimeClassNotFound"

	// ReasonRuntimeClassConflict (Managed mode): a RuntimeClass of that name
	// exists and the pool cannot use it: it is not managed by agentbox and
	// has a handler other than runsc, or another GVisorNodePool owns it.
	// The pool touches neither the RuntimeClass nor any node until it is
	// resolved.
	ReasonRuntimeClassConflict = "RuntimeClassConflict"

	// ReasonNodesNotReady: the pool selects nodes, but none of them is Ready
	// (kubelet reports the node NotReady or has stopped reporting).
	ReasonNodesNotReady = "NodesNotReady"

	// ReasonManagedModeDisabled (Managed mode): the platform was installed
	// without the rights Managed pools need (the chart's managedNodePools
	// is false): it may not label or taint nodes, nor create RuntimeClasses.
	// The pool touches nothing; the fix is managedNodePools: true, or mode
	// GKE where GKE Sandbox provides gVisor.
	ReasonManagedModeDisabled = "ManagedModeDisabled"
)

// ErrorResumesOnActivity reports whether a Sandbox in phase Error whose
// Ready condition has reason starts again by itself at its next activity
// (a renewal of its Lease, which every Compute API call makes), so that a
// call waits for it rather than failing: an idle stop that failed after
// the pod was gone (SyncFailed, SnapshotFailed; the workspace claim was
// kept) and a lost node (NodeLost). Every other Error reason needs a
// person.
func ErrorResumesOnActivity(reason string) bool {
	switch reason {
	case ReasonSyncFailed, ReasonSnapshotFailed, ReasonNodeLost:
		return true
	}
	return false
}

// ConditionPythonEnvironmentsReady reports the pre-warm of a warm pool's
// pythonEnvironments: on a warm Sandbox of such a pool, whether it holds
// them; on the pool, whether all its ready sandboxes do. A pool lease takes
// a warm sandbox once the condition is True or its reason PrewarmFailed,
// never while it is Prewarming.
const ConditionPythonEnvironmentsReady = "PythonEnvironmentsReady"

// Reasons of the PythonEnvironmentsReady condition.
const (
	// ReasonPrewarmed (status True): every environment was built.
	ReasonPrewarmed = "Prewarmed"
	// ReasonPrewarming: the environments are being built.
	ReasonPrewarming = "Prewarming"
	// ReasonPrewarmFailed: a build failed (the message has the installer's
	// error); the sandbox is leased all the same, and the build is not
	// tried again until the pool's environments change.
	ReasonPrewarmFailed = "PrewarmFailed"
)

// AnnotationPrewarmEnvs, on a warm sandbox, carries its pool's
// pythonEnvironments (JSON) for the Sandbox controller to build;
// AnnotationPrewarmFailed records, for the same value's hash, the error of
// a build that failed, so that it is not retried in a loop.
const (
	AnnotationPrewarmEnvs   = GroupName + "/prewarm-python-environments"
	AnnotationPrewarmFailed = GroupName + "/prewarm-failed"
)
