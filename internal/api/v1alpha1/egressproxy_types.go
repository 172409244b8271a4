package v1alpha1

import (
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// EgressProxyMode says whether each sandbox gets its own proxy or they share
// one.
// +kubebuilder:validation:Enum=PerAgent;Shared
type EgressProxyMode string

const (
	// EgressProxyModePerAgent runs one proxy pod and Service per sandbox, so
	// one agent's traffic never shares a process or an upstream session with
	// another's.
	EgressProxyModePerAgent EgressProxyMode = "PerAgent"
	// EgressProxyModeShared runs one proxy Deployment and Service that every
	// sandbox referring to the proxy uses.
	EgressProxyModeShared EgressProxyMode = "Shared"
)

// Domain is a DNS name in lower case, optionally starting with "*." to match
// every subdomain (but not the name itself).
// +kubebuilder:validation:MinLength=1
// +kubebuilder:validation:MaxLength=253
// +kubebuilder:validation:Pattern=`^(\*\.)?([a-z0-9]([-a-z0-9]*[a-z0-9])?\.)*[a-z0-9]([-a-z0-9]*[a-z0-9])?$`
type Domain string

// CIDR is an IPv4 or IPv6 network in CIDR notation, such as 10.0.0.0/8.
// +kubebuilder:validation:MinLength=1
// +kubebuilder:validation:MaxLength=43
// +kubebuilder:validation:XValidation:rule="isCIDR(self)",message="must be a CIDR such as 10.0.0.0/8"
type CIDR string

// AllowedCIDR is a network an egress proxy may reach although it lies in
// the private ranges the proxy denies by default, such as an in-cluster
// service. It may not overlap the addresses that are never reachable:
// "this network" (0.0.0.0/8, ::/128), loopback, link-local (with the cloud
// metadata addresses); isCIDR already refuses IPv4-mapped IPv6, which could
// name those again.
// +kubebuilder:validation:MinLength=1
// +kubebuilder:validation:MaxLength=43
// +kubebuilder:validation:XValidation:rule="isCIDR(self)",message="must be a CIDR such as 10.0.0.0/8"
// +kubebuilder:validation:XValidation:rule="!isCIDR(self) || ['0.0.0.0/8', '127.0.0.0/8', '169.254.0.0/16', '100.100.100.200/32', '::/128', '::1/128', 'fe80::/10', 'fd00:ec2::254/128'].all(f, !cidr(f).containsCIDR(cidr(self)) && !cidr(self).containsCIDR(cidr(f)))",message="must not overlap 0.0.0.0/8, loopback, link-local or the metadata addresses"
type AllowedCIDR string

// EgressProxySpec is the desired state of an egress proxy.
// +kubebuilder:validation:XValidation:rule="!has(self.replicas) || (has(self.mode) && self.mode == 'Shared')",message="replicas applies only to mode Shared"
type EgressProxySpec struct {
	// mode is PerAgent (a proxy per sandbox) or Shared (one proxy for all).
	// +optional
	// +kubebuilder:default=PerAgent
	Mode EgressProxyMode `json:"mode,omitempty"`

	// allowedDomains are the only destinations the proxy lets through, by
	// host name; "*.example.com" matches every subdomain of example.com.
	// Empty denies everything.
	// +optional
	// +listType=set
	// +kubebuilder:validation:MaxItems=1024
	AllowedDomains []Domain `json:"allowedDomains,omitempty"`

	// deniedDomains are refused even when allowedDomains matches them.
	// +optional
	// +listType=set
	// +kubebuilder:validation:MaxItems=1024
	DeniedDomains []Domain `json:"deniedDomains,omitempty"`

	// deniedCIDRs are refused after DNS resolution, in addition to the
	// private, loopback, link-local and metadata ranges that are always denied.
	// +optional
	// +listType=set
	// +kubebuilder:validation:MaxItems=256
	DeniedCIDRs []CIDR `json:"deniedCIDRs,omitempty"`

	// allowedCIDRs are networks inside the default denied ranges that the
	// proxy may reach anyway, such as an in-cluster service named in
	// allowedDomains. Only allowlisted names get there; deniedCIDRs still
	// win over them. The proxy pods' NetworkPolicy lets them out to these
	// networks too.
	// +optional
	// +listType=set
	// +kubebuilder:validation:MaxItems=256
	AllowedCIDRs []AllowedCIDR `json:"allowedCIDRs,omitempty"`

	// runtimeClassName of the proxy pods, such as the gVisor RuntimeClass
	// the sandboxes use. Unset leaves the control plane's choice (by default
	// the cluster's default runtime).
	// +optional
	// +kubebuilder:validation:MaxLength=253
	// +kubebuilder:validation:Pattern=`^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$`
	RuntimeClassName string `json:"runtimeClassName,omitempty"`

	// upstream is a proxy the egress proxy chains to. Without one it connects
	// to destinations directly.
	// +optional
	Upstream *EgressUpstream `json:"upstream,omitempty"`

	// replicas is the number of proxy pods in Shared mode; defaults to 1.
	// +optional
	// +kubebuilder:validation:Minimum=1
	// +kubebuilder:validation:Maximum=100
	Replicas *int32 `json:"replicas,omitempty"`
}

// EgressUpstream is the proxy an egress proxy chains to.
type EgressUpstream struct {
	// url of the upstream HTTP proxy, such as http://proxy.example.com:8080.
	// It must not carry credentials: those belong in credentialsSecretRef.
	// +required
	// +kubebuilder:validation:MaxLength=2048
	// +kubebuilder:validation:Pattern=`^https?://[^/@\s]+/?$`
	URL string `json:"url"`

	// credentialsSecretRef selects the Secret key holding "user:password" for
	// the upstream, sent as Proxy-Authorization. The credentials reach only
	// the proxy pods, never the sandboxes.
	// +optional
	CredentialsSecretRef *SecretKeySelector `json:"credentialsSecretRef,omitempty"`
}

// EgressProxyStatus is the observed state of an egress proxy.
type EgressProxyStatus struct {
	// readyEndpoints are the proxy URLs (http://<service>.<namespace>.svc:<port>)
	// whose pods are ready.
	// +optional
	// +listType=atomic
	ReadyEndpoints []string `json:"readyEndpoints,omitempty"`

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

// EgressProxy is the HTTP(S) proxy that is the sandboxes' only way out: it
// allows listed domains, denies private and listed networks after DNS
// resolution, can chain to an upstream with credentials, and logs every
// request.
//
// +kubebuilder:object:root=true
// +kubebuilder:subresource:status
// +kubebuilder:resource:scope=Namespaced,shortName=egp,categories=agentbox
// +kubebuilder:printcolumn:name="Mode",type=string,JSONPath=`.spec.mode`
// +kubebuilder:printcolumn:name="Ready",type=string,JSONPath=`.status.conditions[?(@.type=="Ready")].status`
// +kubebuilder:printcolumn:name="Upstream",type=string,JSONPath=`.spec.upstream.url`,priority=1
// +kubebuilder:printcolumn:name="Age",type=date,JSONPath=`.metadata.creationTimestamp`
type EgressProxy struct {
	metav1.TypeMeta `json:",inline"`
	// +optional
	metav1.ObjectMeta `json:"metadata,omitempty"`

	// spec is the desired proxy.
	// +required
	Spec EgressProxySpec `json:"spec"`

	// status is written by the control plane.
	// +optional
	Status EgressProxyStatus `json:"status,omitzero"`
}

// EgressProxyList is a list of EgressProxies.
//
// +kubebuilder:object:root=true
type EgressProxyList struct {
	metav1.TypeMeta `json:",inline"`
	// +optional
	metav1.ListMeta `json:"metadata,omitempty"`
	// items are the egress proxies.
	Items []EgressProxy `json:"items"`
}
