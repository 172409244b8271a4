package v1alpha1

import (
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// SandboxSpec is the desired state of one agent's sandbox. Clients write it
// once; the control plane never writes it.
type SandboxSpec struct {
	// agentID is the agent that owns the sandbox. The Compute API routes an
	// agent's calls to the Sandbox with its agentID, so it cannot change.
	// It appears in API paths, so it is limited to letters, digits and
	// ". _ @ : + -", starting with a letter or digit.
	// +required
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=253
	// +kubebuilder:validation:Pattern=`^[A-Za-z0-9][A-Za-z0-9._@:+-]*$`
	// +kubebuilder:validation:XValidation:rule="self == oldSelf",message="agentID is immutable"
	AgentID string `json:"agentID"`

	// templateRef names the SandboxTemplate, in the sandbox's namespace, the
	// sandbox is created from. It cannot change: create a new Sandbox instead.
	// +required
	// +kubebuilder:validation:XValidation:rule="self == oldSelf",message="templateRef is immutable"
	TemplateRef LocalObjectReference `json:"templateRef"`

	// idleTimeout overrides the template's idle timeout for this sandbox.
	// +optional
	// +kubebuilder:validation:Type=string
	// +kubebuilder:validation:Pattern=`^([0-9]+(\.[0-9]+)?(ns|us|ms|s|m|h))+$`
	// +kubebuilder:validation:XValidation:rule="duration(self) > duration('0s')",message="idleTimeout must be positive"
	IdleTimeout *metav1.Duration `json:"idleTimeout,omitempty"`

	// ephemeral sandboxes keep no state: instead of being snapshotted when
	// they idle out or are released, they are destroyed, and their workspace
	// with them.
	// +optional
	Ephemeral bool `json:"ephemeral,omitempty"`
}

// SandboxPhase is a coarse summary of where a sandbox is in its lifecycle:
// Pending → Running → IdleStopping → Stopped → Resuming → Running, plus
// Error. The Ready condition's reason says why.
// +kubebuilder:validation:Enum=Pending;Running;IdleStopping;Stopped;Resuming;Error
type SandboxPhase string

const (
	// SandboxPhasePending: the sandbox's pod and workspace are being created
	// for the first time, or it waits for a missing template, proxy or node pool.
	SandboxPhasePending SandboxPhase = "Pending"
	// SandboxPhaseRunning: the pod is ready and its supervisor answers.
	SandboxPhaseRunning SandboxPhase = "Running"
	// SandboxPhaseIdleStopping: the idle timeout elapsed; the workspace is
	// being synced and snapshotted before the pod is deleted.
	SandboxPhaseIdleStopping SandboxPhase = "IdleStopping"
	// SandboxPhaseStopped: no pod runs; the workspace lives in
	// status.snapshot until activity resumes the sandbox.
	SandboxPhaseStopped SandboxPhase = "Stopped"
	// SandboxPhaseResuming: the workspace is being restored from the latest
	// snapshot and the pod started again.
	SandboxPhaseResuming SandboxPhase = "Resuming"
	// SandboxPhaseError: a step failed in a way the controller does not retry
	// on its own, such as a failed snapshot, or the sandbox's node was lost;
	// the Ready condition says which. The last good snapshot is kept. After
	// a node loss (reason NodeLost, see status.nodeLoss) the next call
	// resumes the sandbox on another node.
	SandboxPhaseError SandboxPhase = "Error"
)

// SandboxSnapshot records the snapshot a stopped sandbox resumes from.
type SandboxSnapshot struct {
	// name of the snapshot: a VolumeSnapshot in the sandbox's namespace, or
	// the archive's key when the platform uses the archive snapshot driver.
	// +required
	// +kubebuilder:validation:MinLength=1
	Name string `json:"name"`

	// sizeBytes is the snapshot's size as far as it is known; 0 when the
	// storage does not report it.
	// +optional
	// +kubebuilder:validation:Minimum=0
	SizeBytes int64 `json:"sizeBytes,omitempty"`

	// readyTime is when the snapshot became ready to restore from.
	// +optional
	ReadyTime *metav1.Time `json:"readyTime,omitempty"`

	// driver is the snapshot driver, and for the archive driver its store,
	// that took the snapshot: "volumesnapshot", "archive/s3" or
	// "archive/embedded". A sandbox resumes only through the same one; after
	// the platform's driver changed, it reports SnapshotDriverChanged
	// instead. Empty on snapshots taken before drivers were recorded.
	// +optional
	// +kubebuilder:validation:MaxLength=63
	Driver string `json:"driver,omitempty"`

	// checkpoint says the snapshot was taken by a periodic checkpoint of
	// the running sandbox (the template's checkpointInterval), not by an
	// idle stop: changes made after its readyTime are not in it.
	// +optional
	Checkpoint bool `json:"checkpoint,omitempty"`
}

// IdleStopRetry is the backoff of idle stops that could not be taken: each
// abandoned stop doubles the wait before the next attempt, from 30 seconds
// up to 30 minutes. It lives in status so that it survives a restart of the
// control plane.
type IdleStopRetry struct {
	// failures counts the idle stops abandoned in a row.
	// +required
	// +kubebuilder:validation:Minimum=1
	Failures int32 `json:"failures"`

	// nextAttemptTime is when the next idle stop may begin, if the sandbox
	// is still idle then.
	// +required
	NextAttemptTime metav1.Time `json:"nextAttemptTime"`
}

// SandboxNodeLoss records that the node a sandbox ran on no longer exists.
// Only a deleted Node object counts: a node that is merely NotReady may come
// back with the data, and deleting the Node (by the node lifecycle
// controller, an autoscaler or an operator) is how the cluster says it will
// not.
type SandboxNodeLoss struct {
	// nodeName is the node that was lost; empty when only the workspace
	// volume showed the loss and its node affinity names no single node.
	// +optional
	NodeName string `json:"nodeName,omitempty"`

	// time is when the controller found the node gone.
	// +required
	Time metav1.Time `json:"time"`

	// activityTime is the renewTime of the sandbox's activity Lease when the
	// loss was found. Any later renewal, which every call through the
	// Compute API makes, is the activity that resumes the sandbox on
	// another node; until then it stays in phase Error with reason
	// NodeLost, and takes no node's resources.
	// +optional
	ActivityTime *metav1.MicroTime `json:"activityTime,omitempty"`

	// workspaceLost says the workspace volume was node-local storage on the
	// lost node and went with it: the sandbox resumes from status.snapshot,
	// or with an empty workspace when there is none. False means network
	// storage, which another node mounts with the files as they were.
	// +optional
	WorkspaceLost bool `json:"workspaceLost,omitempty"`
}

// SandboxStatus is the observed state of a Sandbox, written by the control
// plane.
type SandboxStatus struct {
	// phase summarises the lifecycle state; the Ready condition carries the
	// reason.
	// +optional
	Phase SandboxPhase `json:"phase,omitempty"`

	// podName is the sandbox's current pod, empty while none exists.
	// +optional
	PodName string `json:"podName,omitempty"`

	// podIP is the current pod's IP address.
	// +optional
	PodIP string `json:"podIP,omitempty"`

	// nodeName is the node the sandbox's pod is scheduled to. It is kept
	// after the pod disappears until the controller has checked that node:
	// the pod garbage collector deletes the pods of a deleted node, and this
	// is how the controller still knows where the sandbox ran.
	// +optional
	NodeName string `json:"nodeName,omitempty"`

	// nodeLoss is set while the sandbox is in phase Error with reason
	// NodeLost: its node was deleted, and the next activity resumes it on
	// another node (and clears this).
	// +optional
	NodeLoss *SandboxNodeLoss `json:"nodeLoss,omitempty"`

	// serviceEndpoint is the supervisor's URL, https://<podIP>:8443. Its
	// certificate names the sandbox, not the IP.
	// +optional
	ServiceEndpoint string `json:"serviceEndpoint,omitempty"`

	// lastActivityTime is the last API activity the controller has seen (the
	// renewTime of the sandbox's Lease); idleness is measured from it.
	// +optional
	LastActivityTime *metav1.Time `json:"lastActivityTime,omitempty"`

	// snapshot is the latest good snapshot of the workspace, if any: an
	// idle stop's, or the newest periodic checkpoint of a running sandbox.
	// A stopped sandbox resumes from it, and so does one whose workspace
	// went with a lost node; it is replaced only once a newer one is ready.
	// +optional
	Snapshot *SandboxSnapshot `json:"snapshot,omitempty"`

	// workload is the name the sandbox's children (pod, workspace claim,
	// serving certificate Secret) and its supervisor's identity derive
	// from. It is set when the sandbox adopted a warm pool's sandbox, whose
	// running pod it took over under that sandbox's name; empty means the
	// sandbox's own name.
	// +optional
	Workload string `json:"workload,omitempty"`

	// checkpoints are the periodic checkpoints kept, oldest first, at most
	// the template's checkpointsKept. The newest is also status.snapshot
	// until an idle stop's snapshot supersedes them all.
	// +optional
	// +listType=atomic
	// +kubebuilder:validation:MaxItems=10
	Checkpoints []SandboxSnapshot `json:"checkpoints,omitempty"`

	// pendingCheckpoint names the checkpoint being taken, if any.
	// +optional
	PendingCheckpoint string `json:"pendingCheckpoint,omitempty"`

	// lastCheckpointTime is when the newest checkpoint attempt began; the
	// next is due a checkpointInterval later.
	// +optional
	LastCheckpointTime *metav1.Time `json:"lastCheckpointTime,omitempty"`

	// pendingSnapshot names the snapshot the idle stop in progress is
	// taking. It becomes status.snapshot when ready, and is cleared if it
	// fails or the stop is abandoned.
	// +optional
	PendingSnapshot string `json:"pendingSnapshot,omitempty"`

	// idleStopRetry is set while idle stops are being abandoned because the
	// snapshot cannot be taken; the IdleStopBlocked condition says why. It
	// is cleared when a stop succeeds.
	// +optional
	IdleStopRetry *IdleStopRetry `json:"idleStopRetry,omitempty"`

	// conditions hold the Ready condition, whose reason explains the phase,
	// the Leased condition, which says whether the exclusive lease is held,
	// and IdleStopBlocked while idle stops cannot be taken.
	// +optional
	// +listType=map
	// +listMapKey=type
	// +patchStrategy=merge
	// +patchMergeKey=type
	Conditions []metav1.Condition `json:"conditions,omitempty" patchStrategy:"merge" patchMergeKey:"type"`

	// observedGeneration is the metadata.generation the status describes.
	// +optional
	ObservedGeneration int64 `json:"observedGeneration,omitempty"`
}

// Sandbox is one agent's isolated environment: a gVisor pod with a
// persistent workspace that is stopped into a snapshot when idle and resumed
// on the next call.
//
// spec.agentID and spec.templateRef.name are selectable fields, so that
// the API server itself answers "the sandboxes of this agent" (kubectl get
// sandboxes --field-selector spec.agentID=...), as the control plane's
// cache indexes do.
//
// +kubebuilder:object:root=true
// +kubebuilder:subresource:status
// +kubebuilder:resource:scope=Namespaced,shortName=sbx,categories=agentbox
// +kubebuilder:selectablefield:JSONPath=`.spec.agentID`
// +kubebuilder:selectablefield:JSONPath=`.spec.templateRef.name`
// +kubebuilder:printcolumn:name="Agent",type=string,JSONPath=`.spec.agentID`
// +kubebuilder:printcolumn:name="Template",type=string,JSONPath=`.spec.templateRef.name`
// +kubebuilder:printcolumn:name="Phase",type=string,JSONPath=`.status.phase`
// +kubebuilder:printcolumn:name="Ready",type=string,JSONPath=`.status.conditions[?(@.type=="Ready")].status`
// +kubebuilder:printcolumn:name="Pod IP",type=string,JSONPath=`.status.podIP`,priority=1
// +kubebuilder:printcolumn:name="Node",type=string,JSONPath=`.status.nodeName`,priority=1
// +kubebuilder:printcolumn:name="Last Activity",type=date,JSONPath=`.status.lastActivityTime`,priority=1
// +kubebuilder:printcolumn:name="Age",type=date,JSONPath=`.metadata.creationTimestamp`
type Sandbox struct {
	metav1.TypeMeta `json:",inline"`
	// +optional
	metav1.ObjectMeta `json:"metadata,omitempty"`

	// spec is the desired sandbox.
	// +required
	Spec SandboxSpec `json:"spec"`

	// status is written by the control plane.
	// +optional
	Status SandboxStatus `json:"status,omitzero"`
}

// SandboxList is a list of Sandboxes.
//
// +kubebuilder:object:root=true
type SandboxList struct {
	metav1.TypeMeta `json:",inline"`
	// +optional
	metav1.ListMeta `json:"metadata,omitempty"`
	// items are the sandboxes.
	Items []Sandbox `json:"items"`
}

// WorkloadName is the name the sandbox's pod, workspace claim and serving
// certificate Secret are called by, and from which its supervisor's SPIFFE
// identity derives: status.workload once the sandbox has adopted a warm
// sandbox's running pod (a pod's spec, its certificate included, cannot be
// renamed), else the sandbox's own name. The controller and the Compute API
// both take it from here, so that the identity the API verifies is the one
// the controller issued. Trusting status for identity is sound because only
// the controller writes status; clients get no rights on sandboxes/status.
func (s *Sandbox) WorkloadName() string {
	if s.Status.Workload != "" {
		return s.Status.Workload
	}
	return s.Name
}

// KeepsAgentBefore reports whether a keeps the agent ahead of b when both
// are live Sandboxes with the same spec.agentID: the older one, by
// creationTimestamp, then by namespace and name (timestamps have whole
// seconds, so two made together tie). An agent has one sandbox; the
// controller refuses the others (ReasonDuplicateAgent) and the Compute
// API serves the agent from the one this picks, so both take it from
// here.
func KeepsAgentBefore(a, b *Sandbox) bool {
	if !a.CreationTimestamp.Equal(&b.CreationTimestamp) {
		return a.CreationTimestamp.Before(&b.CreationTimestamp)
	}
	if a.Namespace != b.Namespace {
		return a.Namespace < b.Namespace
	}
	return a.Name < b.Name
}
