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

	// credentials are secrets the proxy adds to requests bound for their
	// hosts, so that the sandbox never holds them. The values stay in
	// Secrets mounted only into the proxy pods. For HTTPS destinations
	// with a credential the proxy terminates TLS with a certificate from a
	// CA of its own, which the control plane creates (Secret
	// <name>-egress-ca) and puts into the sandboxes' trust store; other
	// destinations stay end-to-end encrypted tunnels.
	// +optional
	// +listType=map
	// +listMapKey=name
	// +kubebuilder:validation:MaxItems=64
	Credentials []EgressCredential `json:"credentials,omitempty"`

	// destinationCABundle holds PEM certificates that verify the
	// destinations of credentials instead of the system roots, for
	// destinations with a private CA. Read when a proxy pod starts; a
	// bundle without a certificate stops the proxy from starting, with the
	// error in its log and the sandbox's status.
	// +optional
	// +kubebuilder:validation:MaxLength=262144
	DestinationCABundle string `json:"destinationCABundle,omitempty"`
}

// EgressCredential is a secret added to requests bound for some hosts,
// either in a header or as HTTP basic authentication.
// +kubebuilder:validation:XValidation:rule="has(self.header) != has(self.basicAuth)",message="give exactly one of header and basicAuth"
type EgressCredential struct {
	// name identifies the credential in the proxy's access log and
	// metrics; it is not secret.
	// +required
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=63
	// +kubebuilder:validation:Pattern=`^[a-z0-9]([-a-z0-9]*[a-z0-9])?$`
	Name string `json:"name"`

	// hosts the credential is sent to, in the syntax of allowedDomains.
	// Only hosts the proxy also allows are reached.
	// +required
	// +listType=set
	// +kubebuilder:validation:MinItems=1
	// +kubebuilder:validation:MaxItems=64
	Hosts []Domain `json:"hosts"`

	// secretRef selects the Secret key holding the value, in the proxy's
	// namespace.
	// +required
	SecretRef SecretKeySelector `json:"secretRef"`

	// header sends the value in a request header, replacing any header
	// of that name the sandbox sent (such as a placeholder).
	// +optional
	Header *EgressCredentialHeader `json:"header,omitempty"`

	// basicAuth sends the value as HTTP basic authentication.
	// +optional
	BasicAuth *EgressCredentialBasicAuth `json:"basicAuth,omitempty"`
}

// EgressCredentialHeader is a header carrying a credential.
// +kubebuilder:validation:XValidation:rule="!(self.name.lowerAscii() in ['host', 'connection', 'proxy-connection', 'keep-alive', 'proxy-authenticate', 'proxy-authorization', 'te', 'trailer', 'transfer-encoding', 'upgrade', 'content-length'])",message="must be a header that reaches the destination"
type EgressCredentialHeader struct {
	// name of the header, such as Authorization or X-Api-Key.
	// +required
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=256
	// +kubebuilder:validation:Pattern=`^[-!#$%&'*+.^_|~0-9A-Za-z]+$`
	Name string `json:"name"`

	// valueTemplate is the header's value with {{secret}} where the
	// secret goes, such as "Bearer {{secret}}"; unset sends the secret
	// alone.
	// +optional
	// +kubebuilder:validation:MaxLength=4096
	// +kubebuilder:validation:XValidation:rule="self.contains('{{secret}}')",message="must contain {{secret}}"
	ValueTemplate string `json:"valueTemplate,omitempty"`
}

// EgressCredentialBasicAuth sends a credential as HTTP basic
// authentication.
type EgressCredentialBasicAuth struct {
	// username sent with the secret as the password. Unset, the secret
	// holds "user:password".
	// +optional
	// +kubebuilder:validation:MaxLength=256
	// +kubebuilder:validation:Pattern=`^[^:\r\n]*$`
	Username string `json:"username,omitempty"`
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
