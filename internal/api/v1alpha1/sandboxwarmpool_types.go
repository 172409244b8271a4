package v1alpha1

import (
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// SandboxWarmPoolSpec is the desired state of a warm pool.
type SandboxWarmPoolSpec struct {
	// templateRef names the SandboxTemplate, in the pool's namespace, whose
	// sandboxes the pool keeps warm. A new Sandbox of the same template adopts
	// one of them instead of starting cold.
	// +required
	TemplateRef LocalObjectReference `json:"templateRef"`

	// replicas is how many ready, unassigned sandboxes the pool keeps. An
	// adopted sandbox leaves the pool and is replaced. It is the scale
	// subresource's spec, so `kubectl scale` and autoscalers can set it.
	// +required
	// +kubebuilder:validation:Minimum=0
	Replicas int32 `json:"replicas"`

	// coldStartWhenExhausted makes a pool lease that finds no ready sandbox
	// free start one from the template for its caller instead of waiting
	// for the pool to refill: the Compute API creates an ephemeral sandbox
	// of the pool (it counts in status.leasedReplicas and is deleted when
	// its lease ends, like any leased one) and hands it out once it is
	// ready, within the lease request's wait_seconds. A request without
	// wait_seconds is still answered at once.
	// +optional
	ColdStartWhenExhausted bool `json:"coldStartWhenExhausted,omitempty"`

	// pythonEnvironments are built in every warm sandbox of the pool (through
	// its supervisor, as POST /v1/agents/{id}/envs builds one, bounded by
	// the supervisor's build timeout) before a pool lease may take it, so
	// that the first execute of a leased sandbox finds them cached. They are
	// the pool's rather than the template's: they are what the pool's
	// callers will ask for, and changing them rebuilds nothing the template
	// makes (no warm sandbox is replaced; the missing environments are built
	// in place). A build that fails sets the sandbox's
	// PythonEnvironmentsReady condition to False (reason PrewarmFailed),
	// with an event, and the sandbox is leased all the same: a broken
	// requirement must not empty the pool. A warm sandbox counts in
	// readyReplicas (and towards the pool's Ready condition) only once
	// the environments are built in it, or their build has failed.
	// +optional
	// +listType=atomic
	// +kubebuilder:validation:MaxItems=8
	PythonEnvironments []WarmPythonEnvironment `json:"pythonEnvironments,omitempty"`

	// releasePolicy says what becomes of a sandbox when its pool lease is
	// released or expires. Delete (the default) deletes it with its
	// workspace. Reuse returns it to the pool for the next lease: its pod
	// is deleted and made again, so every process the holder started, its
	// /tmp, terminals, MCP servers and variables are gone; its workspace
	// is emptied and checked empty before the new supervisor starts,
	// except the cached Python environments, each kept only if its files
	// still match the seal its build recorded under a key commands cannot
	// read (a changed or unsealed one is removed, and so is the installer
	// environment and every bytecode cache). A sandbox whose reset fails or
	// takes longer than five minutes is deleted instead, with an event
	// saying why. Environments are code the next holder runs: a holder
	// that changes one while it is being built is not detected, so reuse
	// only between holders that may share built environments.
	// +optional
	// +kubebuilder:default=Delete
	ReleasePolicy ReleasePolicy `json:"releasePolicy,omitempty"`
}

// WarmPythonEnvironment is a Python environment a warm pool builds ahead.
type WarmPythonEnvironment struct {
	// name names the environment. Unset, it is the environment of its
	// requirement set, the one an execute with the same requirements uses.
	// +optional
	// +kubebuilder:validation:MaxLength=63
	// +kubebuilder:validation:Pattern=`^[A-Za-z0-9][A-Za-z0-9._-]*$`
	Name string `json:"name,omitempty"`

	// requirements are installed into it: names with version specifiers
	// from the template's package index ("pandas>=2.0"), never URLs or paths.
	// +required
	// +listType=atomic
	// +kubebuilder:validation:MinItems=1
	// +kubebuilder:validation:MaxItems=100
	// +kubebuilder:validation:items:MaxLength=256
	Requirements []string `json:"requirements"`
}

// ReleasePolicy says what becomes of a pool sandbox when its pool lease
// ends.
// +kubebuilder:validation:Enum=Delete;Reuse
type ReleasePolicy string

const (
	// ReleasePolicyDelete deletes the sandbox with its workspace; the pool
	// has made a replacement already.
	ReleasePolicyDelete ReleasePolicy = "Delete"
	// ReleasePolicyReuse returns the sandbox to the pool: its pod is made
	// anew (no process, /tmp, terminal, MCP server or variable of the
	// holder survives) and its workspace emptied, keeping only the cached
	// Python environments that verify unchanged since they were built.
	ReleasePolicyReuse ReleasePolicy = "Reuse"
)

// SandboxWarmPoolStatus is the observed state of a warm pool.
type SandboxWarmPoolStatus struct {
	// replicas is how many unassigned sandboxes the pool has, ready or not.
	// +optional
	Replicas int32 `json:"replicas,omitempty"`

	// readyReplicas is how many of them are ready to be adopted: running,
	// and, for a pool with pythonEnvironments, done with them (built, or
	// their build failed, in which case the Ready condition's message
	// says how many serve without them).
	// +optional
	ReadyReplicas int32 `json:"readyReplicas,omitempty"`

	// leasedReplicas is how many of the pool's sandboxes are leased out for
	// an ephemeral run. They are not counted in replicas (the pool has
	// replaced them) and are deleted when their lease ends.
	// +optional
	LeasedReplicas int32 `json:"leasedReplicas,omitempty"`

	// selector is the label selector, in string form, that matches the pool's
	// pods; the scale subresource reports it.
	// +optional
	Selector string `json:"selector,omitempty"`

	// conditions hold the Ready condition: True when readyReplicas reaches
	// spec.replicas; and, for a pool with pythonEnvironments, the
	// PythonEnvironmentsReady condition: False with reason PrewarmFailed
	// while a warm sandbox's build has failed, Prewarming while some are
	// being built, True once every ready one holds them.
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

// SandboxWarmPool keeps a number of sandboxes of one template started and
// unassigned, so that a new agent's sandbox is ready at once.
//
// +kubebuilder:object:root=true
// +kubebuilder:subresource:status
// +kubebuilder:subresource:scale:specpath=.spec.replicas,statuspath=.status.replicas,selectorpath=.status.selector
// +kubebuilder:resource:scope=Namespaced,shortName=sbxpool,categories=agentbox
// +kubebuilder:printcolumn:name="Template",type=string,JSONPath=`.spec.templateRef.name`
// +kubebuilder:printcolumn:name="Desired",type=integer,JSONPath=`.spec.replicas`
// +kubebuilder:printcolumn:name="Current",type=integer,JSONPath=`.status.replicas`
// +kubebuilder:printcolumn:name="Ready",type=integer,JSONPath=`.status.readyReplicas`
// +kubebuilder:printcolumn:name="Leased",type=integer,JSONPath=`.status.leasedReplicas`
// +kubebuilder:printcolumn:name="Age",type=date,JSONPath=`.metadata.creationTimestamp`
type SandboxWarmPool struct {
	metav1.TypeMeta `json:",inline"`
	// +optional
	metav1.ObjectMeta `json:"metadata,omitempty"`

	// spec is the desired pool.
	// +required
	Spec SandboxWarmPoolSpec `json:"spec"`

	// status is written by the control plane.
	// +optional
	Status SandboxWarmPoolStatus `json:"status,omitzero"`
}

// SandboxWarmPoolList is a list of SandboxWarmPools.
//
// +kubebuilder:object:root=true
type SandboxWarmPoolList struct {
	metav1.TypeMeta `json:",inline"`
	// +optional
	metav1.ListMeta `json:"metadata,omitempty"`
	// items are the warm pools.
	Items []SandboxWarmPool `json:"items"`
}
