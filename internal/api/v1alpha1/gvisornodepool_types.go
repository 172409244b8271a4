package v1alpha1

import (
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// GVisorNodePoolMode says who provides gVisor on the pool's nodes.
// +kubebuilder:validation:Enum=Managed;GKE
type GVisorNodePoolMode string

const (
	// GVisorNodePoolModeManaged: the platform installs runsc on the selected
	// nodes with an installer DaemonSet, labels (and optionally taints) them,
	// and creates the RuntimeClass.
	GVisorNodePoolModeManaged GVisorNodePoolMode = "Managed"
	// GVisorNodePoolModeGKE: GKE Sandbox already provides gVisor; the pool
	// adopts its RuntimeClass and the sandbox.gke.io/runtime taint and runs no
	// installer.
	GVisorNodePoolModeGKE GVisorNodePoolMode = "GKE"
)

// GVisorNodePoolSpec is the desired state of a gVisor node pool.
// +kubebuilder:validation:XValidation:rule="self.mode != 'Managed' || (has(self.nodeSelector) && size(self.nodeSelector) > 0)",message="nodeSelector is required in Managed mode, so that runsc is not installed on every node by accident"
type GVisorNodePoolSpec struct {
	// mode is Managed (the platform installs gVisor) or GKE (GKE Sandbox
	// provides it).
	// +required
	Mode GVisorNodePoolMode `json:"mode"`

	// runtimeClassName is the RuntimeClass that sandboxes on this pool use.
	// In Managed mode the platform creates it with handler runsc; in GKE mode
	// it must already exist.
	// +optional
	// +kubebuilder:default=gvisor
	// +kubebuilder:validation:MaxLength=253
	// +kubebuilder:validation:Pattern=`^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$`
	RuntimeClassName string `json:"runtimeClassName,omitempty"`

	// nodeSelector selects the pool's nodes. It becomes the RuntimeClass's
	// scheduling nodeSelector, so sandbox pods land only on these nodes.
	// +optional
	NodeSelector map[string]string `json:"nodeSelector,omitempty"`

	// tolerations become the RuntimeClass's scheduling tolerations; they
	// should tolerate the pool's taint.
	// +optional
	// +listType=atomic
	Tolerations []corev1.Toleration `json:"tolerations,omitempty"`

	// taint is put on the pool's nodes in Managed mode to keep other pods off
	// them. Sandbox pods tolerate it through the RuntimeClass.
	// +optional
	Taint *corev1.Taint `json:"taint,omitempty"`

	// overhead is the RuntimeClass's pod overhead: the resources gVisor itself
	// needs per pod, added to every sandbox pod's requests.
	// +optional
	Overhead corev1.ResourceList `json:"overhead,omitempty"`
}

// GVisorNodePoolStatus is the observed state of a gVisor node pool.
type GVisorNodePoolStatus struct {
	// nodes are the names of the nodes the pool currently selects.
	// +optional
	// +listType=atomic
	Nodes []string `json:"nodes,omitempty"`

	// readyNodes is how many of them can run gVisor pods.
	// +optional
	ReadyNodes int32 `json:"readyNodes,omitempty"`

	// conditions hold the Ready condition.
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

// GVisorNodePool is a set of nodes prepared to run sandboxes under gVisor,
// and the RuntimeClass that schedules sandbox pods onto them.
//
// +kubebuilder:object:root=true
// +kubebuilder:subresource:status
// +kubebuilder:resource:scope=Cluster,shortName=gvnp,categories=agentbox
// +kubebuilder:printcolumn:name="Mode",type=string,JSONPath=`.spec.mode`
// +kubebuilder:printcolumn:name="Runtime Class",type=string,JSONPath=`.spec.runtimeClassName`
// +kubebuilder:printcolumn:name="Ready Nodes",type=integer,JSONPath=`.status.readyNodes`
// +kubebuilder:printcolumn:name="Ready",type=string,JSONPath=`.status.conditions[?(@.type=="Ready")].status`
// +kubebuilder:printcolumn:name="Age",type=date,JSONPath=`.metadata.creationTimestamp`
type GVisorNodePool struct {
	metav1.TypeMeta `json:",inline"`
	// +optional
	metav1.ObjectMeta `json:"metadata,omitempty"`

	// spec is the desired node pool.
	// +required
	Spec GVisorNodePoolSpec `json:"spec"`

	// status is written by the control plane.
	// +optional
	Status GVisorNodePoolStatus `json:"status,omitzero"`
}

// GVisorNodePoolList is a list of GVisorNodePools.
//
// +kubebuilder:object:root=true
type GVisorNodePoolList struct {
	metav1.TypeMeta `json:",inline"`
	// +optional
	metav1.ListMeta `json:"metadata,omitempty"`
	// items are the node pools.
	Items []GVisorNodePool `json:"items"`
}
