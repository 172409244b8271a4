package v1alpha1

import (
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// ReservedMountPaths are the folders the platform mounts into every sandbox
// container: the writable /tmp, the installed supervisor and the
// supervisor's serving certificate. A template's workspace and secret
// files may not be mounted at or inside them. The mountPath validation
// rules below repeat the list (a marker cannot name a Go value);
// TestReservedMountPathsInCRD keeps them the same.
var ReservedMountPaths = []string{"/tmp", "/agentbox/bin", "/etc/agentbox/tls"}

// SandboxTemplateSpec describes the sandboxes created from a template: what
// runs in the pod, where it is scheduled, its workspace and its policies.
// Changing a template affects sandboxes started (or resumed) afterwards; a
// running sandbox keeps the pod it has.
// +kubebuilder:validation:XValidation:rule="!has(self.secretFiles) || !has(self.workspace) || !has(self.workspace.mountPath) || !self.secretFiles.exists(f, f.mountPath == self.workspace.mountPath || f.mountPath.startsWith(self.workspace.mountPath + '/'))",message="secretFiles may not be mounted in the workspace: its snapshots would carry the Secrets' contents"
// +kubebuilder:validation:XValidation:rule="!has(self.python) || !has(self.python.environments) || !has(self.python.environments.maxSize) || quantity(string(self.python.environments.maxSize)).isLessThan(has(self.workspace) && has(self.workspace.size) ? quantity(string(self.workspace.size)) : quantity('1Gi'))",message="python.environments.maxSize must be smaller than workspace.size: the environments live on the workspace volume"
type SandboxTemplateSpec struct {
	// image is the sandbox container image: any Linux image (amd64). The
	// platform injects its supervisor, which replaces the image's
	// entrypoint and command; the image's environment and working
	// directory are kept, and the processes the supervisor starts get the
	// image's environment. The container runs as user 65532 on a read-only
	// root file system, with HOME the workspace unless env sets it.
	// python_exec and execute need python3 on the image's PATH, and a
	// terminal opened without a command needs bash or sh. Empty means the
	// platform's default sandbox image, as configured in the chart.
	// +optional
	// +kubebuilder:validation:MaxLength=1024
	Image string `json:"image,omitempty"`

	// imagePullPolicy of the sandbox container. Empty means IfNotPresent
	// for an image the template names, and the pull policy the platform
	// was installed with (the chart's image.sandbox.pullPolicy) for its
	// default image.
	// +optional
	// +kubebuilder:validation:Enum=Always;IfNotPresent;Never
	ImagePullPolicy corev1.PullPolicy `json:"imagePullPolicy,omitempty"`

	// runAsImageUser runs the sandbox as the user its image sets (USER in a
	// Dockerfile) instead of the platform's user 65532, for an image whose
	// files belong to a user of its own. That user must be given as a
	// number and must not be root: a sandbox never runs as root, and
	// Kubernetes cannot check a user name. An image whose user is root,
	// unset or a name stops the sandbox with reason ImageRunsAsRoot. The
	// sandbox keeps group 65532 for its workspace, /tmp and certificate.
	// +optional
	RunAsImageUser bool `json:"runAsImageUser,omitempty"`

	// runtimeClassName is the RuntimeClass the sandbox pods run with. It should
	// name a gVisor runtime; nodePoolRef, when set, takes precedence.
	// +optional
	// +kubebuilder:default=gvisor
	// +kubebuilder:validation:MaxLength=253
	// +kubebuilder:validation:Pattern=`^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$`
	RuntimeClassName string `json:"runtimeClassName,omitempty"`

	// resources are the compute requests and limits of the sandbox container.
	// Everything in the sandbox, including python_exec and MCP servers, shares
	// them. The init container that installs the supervisor asks for the same,
	// so that quotas and LimitRanges admit it whenever they admit the sandbox
	// container and the pod's requests stay these.
	// +optional
	Resources corev1.ResourceRequirements `json:"resources,omitempty"`

	// env is added to the sandbox container's environment, and every process
	// the sandbox's supervisor starts gets it: commands, python_exec and
	// execute runs, terminals and stdio MCP servers (each with its own env on
	// top), as they get the image's own environment. The platform's own
	// variables (such as HTTP_PROXY and GODEBUG) take precedence over entries
	// with the same name. Names starting with AGENTBOX_ configure the
	// supervisor, and GODEBUG is the supervisor's Go runtime setting: neither
	// is passed to the processes it starts.
	// +optional
	// +listType=map
	// +listMapKey=name
	// +kubebuilder:validation:MaxItems=256
	Env []corev1.EnvVar `json:"env,omitempty"`

	// secretFiles mounts Secrets into the sandbox as read-only files, one file
	// per key of the Secret under mountPath. None may be in the workspace,
	// whose snapshots would otherwise carry the Secrets' contents.
	// +optional
	// +listType=map
	// +listMapKey=mountPath
	// +kubebuilder:validation:MaxItems=32
	SecretFiles []SecretFile `json:"secretFiles,omitempty"`

	// workspace is the persistent volume mounted into the sandbox. It survives
	// idle stops through snapshots.
	// +optional
	// +kubebuilder:default={}
	Workspace WorkspaceSpec `json:"workspace,omitzero"`

	// idleTimeout is how long a sandbox may go without API activity before it
	// is snapshotted and stopped. Only idleness counts, never total age. A
	// Sandbox's own spec.idleTimeout overrides it.
	// +optional
	// +kubebuilder:default="1h"
	// +kubebuilder:validation:Type=string
	// +kubebuilder:validation:Pattern=`^([0-9]+(\.[0-9]+)?(ns|us|ms|s|m|h))+$`
	// +kubebuilder:validation:XValidation:rule="duration(self) > duration('0s')",message="idleTimeout must be positive"
	IdleTimeout metav1.Duration `json:"idleTimeout,omitzero"`

	// checkpointInterval, when set, saves the workspace of a running
	// sandbox this often, in the background and with the platform's
	// snapshot driver, without pausing the agent. Idle stops save it
	// anyway; checkpoints bound what a lost node costs: a sandbox whose
	// node is lost resumes from its newest checkpoint, and only the
	// changes made after it are lost. A sandbox with no API activity since
	// its newest checkpoint is not checkpointed again. Ephemeral sandboxes
	// and warm sandboxes waiting for an agent are never checkpointed. At
	// least 10s.
	// +optional
	// +kubebuilder:validation:Type=string
	// +kubebuilder:validation:Pattern=`^([0-9]+(\.[0-9]+)?(ns|us|ms|s|m|h))+$`
	// +kubebuilder:validation:XValidation:rule="duration(self) >= duration('10s')",message="checkpointInterval must be at least 10s"
	CheckpointInterval *metav1.Duration `json:"checkpointInterval,omitempty"`

	// checkpointsKept is how many checkpoints a running sandbox keeps, the
	// newest included; older ones are deleted as new ones become ready.
	// An idle stop's snapshot supersedes them all.
	// +optional
	// +kubebuilder:default=3
	// +kubebuilder:validation:Minimum=1
	// +kubebuilder:validation:Maximum=10
	CheckpointsKept int32 `json:"checkpointsKept,omitempty"`

	// python is the policy of the python_exec tool.
	// +optional
	// +kubebuilder:default={}
	Python PythonPolicy `json:"python,omitzero"`

	// mcpServers are the MCP servers the supervisor bridges in every
	// sandbox of this template: stdio servers it launches and restarts when
	// they exit, and remote Streamable HTTP servers it connects to.
	// +optional
	// +listType=map
	// +listMapKey=name
	// +kubebuilder:validation:MaxItems=64
	MCPServers []MCPServer `json:"mcpServers,omitempty"`

	// egressProxyRef names the EgressProxy, in the template's namespace, that
	// carries the sandboxes' outbound traffic. Without one a sandbox can reach
	// only DNS: it has no other egress.
	// +optional
	EgressProxyRef *LocalObjectReference `json:"egressProxyRef,omitempty"`

	// nodePoolRef names the GVisorNodePool the sandboxes run on. Its
	// RuntimeClass, and the scheduling that comes with it, replaces
	// runtimeClassName.
	// +optional
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=253
	// +kubebuilder:validation:Pattern=`^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$`
	NodePoolRef *string `json:"nodePoolRef,omitempty"`

	// nodeSelector further restricts the nodes the sandbox pods may run on. It
	// is added to the RuntimeClass's own scheduling.
	// +optional
	NodeSelector map[string]string `json:"nodeSelector,omitempty"`

	// tolerations are added to the sandbox pods, next to those of the
	// RuntimeClass.
	// +optional
	// +listType=atomic
	Tolerations []corev1.Toleration `json:"tolerations,omitempty"`
}

// SecretFile mounts one Secret into the sandbox.
type SecretFile struct {
	// secretName is the Secret, in the template's namespace, to mount.
	// +required
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=253
	// +kubebuilder:validation:Pattern=`^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$`
	SecretName string `json:"secretName"`

	// mountPath is the absolute directory the Secret's keys appear in, one
	// file per key. It may not be, or be inside, a folder the platform
	// mounts (/tmp, /agentbox/bin, /etc/agentbox/tls) or the workspace.
	// +required
	// +kubebuilder:validation:MinLength=2
	// +kubebuilder:validation:MaxLength=1024
	// +kubebuilder:validation:Pattern=`^/[^:]*[^/:]$`
	// +kubebuilder:validation:XValidation:rule="!['/tmp', '/agentbox/bin', '/etc/agentbox/tls'].exists(p, self == p || self.startsWith(p + '/'))",message="mountPath must not be /tmp, /agentbox/bin or /etc/agentbox/tls, or inside them: the platform mounts its own volumes there"
	MountPath string `json:"mountPath"`
}

// WorkspaceSpec describes a sandbox's persistent workspace volume.
type WorkspaceSpec struct {
	// size of the workspace volume, and the hard cap on what the sandbox may
	// write into it: writes beyond it fail.
	// +optional
	// +kubebuilder:default="1Gi"
	// +kubebuilder:validation:XValidation:rule="quantity(string(self)).isGreaterThan(quantity('0'))",message="size must be positive"
	Size resource.Quantity `json:"size,omitzero"`

	// storageClassName of the workspace PersistentVolumeClaim. Unset means the
	// cluster's default StorageClass.
	// +optional
	// +kubebuilder:validation:MaxLength=253
	StorageClassName *string `json:"storageClassName,omitempty"`

	// volumeSnapshotClassName is the VolumeSnapshotClass used to snapshot the
	// workspace when the sandbox idles out. Unset means the cluster's default
	// class for the volume's driver.
	// +optional
	// +kubebuilder:validation:MaxLength=253
	VolumeSnapshotClassName *string `json:"volumeSnapshotClassName,omitempty"`

	// mountPath is where the workspace is mounted in the sandbox, and the root
	// that file operations are confined to. It may not be, or be inside, a
	// folder the platform mounts (/tmp, /agentbox/bin, /etc/agentbox/tls).
	// +optional
	// +kubebuilder:default="/workspace"
	// +kubebuilder:validation:MinLength=2
	// +kubebuilder:validation:MaxLength=1024
	// +kubebuilder:validation:Pattern=`^/[^:]*[^/:]$`
	// +kubebuilder:validation:XValidation:rule="!['/tmp', '/agentbox/bin', '/etc/agentbox/tls'].exists(p, self == p || self.startsWith(p + '/'))",message="mountPath must not be /tmp, /agentbox/bin or /etc/agentbox/tls, or inside them: the platform mounts its own volumes there"
	MountPath string `json:"mountPath,omitempty"`
}

// PythonPolicy is the policy of the python_exec tool.
type PythonPolicy struct {
	// defaultTimeout applies to python_exec calls that give none. Above
	// maxTimeout it is cut to maxTimeout, so that setting only maxTimeout
	// lower is enough.
	// +optional
	// +kubebuilder:default="30s"
	// +kubebuilder:validation:Type=string
	// +kubebuilder:validation:Pattern=`^([0-9]+(\.[0-9]+)?(ns|us|ms|s|m|h))+$`
	// +kubebuilder:validation:XValidation:rule="duration(self) > duration('0s')",message="defaultTimeout must be positive"
	DefaultTimeout metav1.Duration `json:"defaultTimeout,omitzero"`

	// maxTimeout is the hard cap on a python_exec call's timeout; longer
	// requests are cut to it.
	// +optional
	// +kubebuilder:default="120s"
	// +kubebuilder:validation:Type=string
	// +kubebuilder:validation:Pattern=`^([0-9]+(\.[0-9]+)?(ns|us|ms|s|m|h))+$`
	// +kubebuilder:validation:XValidation:rule="duration(self) > duration('0s')",message="maxTimeout must be positive"
	MaxTimeout metav1.Duration `json:"maxTimeout,omitzero"`

	// indexURL is the Python package index that installs use. Empty means
	// the sandbox image's default (normally PyPI). The egress proxy must allow
	// its host.
	// +optional
	// +kubebuilder:validation:MaxLength=2048
	// +kubebuilder:validation:Pattern=`^https?://[^\s]+$`
	IndexURL string `json:"indexURL,omitempty"`

	// extraIndexURLs are further package indexes, consulted after indexURL.
	// +optional
	// +listType=atomic
	// +kubebuilder:validation:MaxItems=16
	// +kubebuilder:validation:items:MaxLength=2048
	// +kubebuilder:validation:items:Pattern=`^https?://[^\s]+$`
	ExtraIndexURLs []string `json:"extraIndexURLs,omitempty"`

	// trustedHosts are package index hosts, as host or host:port, that
	// installs may reach over plain HTTP or with a certificate they cannot
	// verify (pip's --trusted-host, uv's --allow-insecure-host): an
	// internal mirror served without TLS. A host left out is refused by the
	// installer when its index URL is not https. Trusting a host gives up
	// the transport's integrity for its packages, so name only hosts on a
	// network you control.
	// +optional
	// +listType=set
	// +kubebuilder:validation:MaxItems=16
	// +kubebuilder:validation:items:MaxLength=261
	// +kubebuilder:validation:items:Pattern=`^[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?(:[0-9]{1,5})?$`
	TrustedHosts []string `json:"trustedHosts,omitempty"`

	// allowedPackages lists the only distributions that may be installed, by
	// name. Empty allows every package.
	// +optional
	// +listType=set
	// +kubebuilder:validation:MaxItems=1024
	// +kubebuilder:validation:items:MaxLength=214
	// +kubebuilder:validation:items:Pattern=`^[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?$`
	AllowedPackages []string `json:"allowedPackages,omitempty"`

	// environments bounds the sandbox's cache of Python environments (built
	// for execute runs with requirements, or ahead of them through the
	// Compute API's /v1/agents/{id}/envs). They live in a hidden directory
	// of the workspace volume, so an idle stop keeps them and a resumed
	// sandbox does not rebuild them, and they count against the workspace's
	// size like its other files. Unset fields take the defaults.
	// +optional
	Environments *PythonEnvironments `json:"environments,omitempty"`
}

// Defaults of PythonEnvironments, applied by the controller.
const (
	DefaultPythonEnvironmentsMaxCount = 8
	DefaultPythonEnvironmentsTTL      = 7 * 24 * time.Hour
)

// PythonEnvironments bounds a sandbox's cached Python environments. Past
// any bound the least recently used idle environments are removed; an
// environment a run is using is never removed.
type PythonEnvironments struct {
	// maxCount is how many environments are kept. Defaults to 8.
	// +optional
	// +kubebuilder:validation:Minimum=1
	// +kubebuilder:validation:Maximum=64
	MaxCount int32 `json:"maxCount,omitempty"`

	// maxSize is the disk the environments may take together, on the
	// workspace volume. It must be smaller than workspace.size. Defaults to
	// half of workspace.size.
	// +optional
	// +kubebuilder:validation:XValidation:rule="quantity(string(self)).isGreaterThan(quantity('0'))",message="maxSize must be positive"
	MaxSize *resource.Quantity `json:"maxSize,omitempty"`

	// ttl removes an idle environment that has not been used for longer
	// than this (idle stops included). Defaults to 168h (7 days).
	// +optional
	// +kubebuilder:validation:Type=string
	// +kubebuilder:validation:Pattern=`^([0-9]+(\.[0-9]+)?(ns|us|ms|s|m|h))+$`
	// +kubebuilder:validation:XValidation:rule="duration(self) >= duration('1m')",message="ttl must be at least 1m"
	TTL *metav1.Duration `json:"ttl,omitempty"`
}

// MCPServer is an MCP server the sandbox's supervisor bridges to the
// Compute API's mcp_request: a stdio server it runs inside the sandbox
// (command), or a remote one it reaches over Streamable HTTP through the
// sandbox's egress proxy (url).
// +kubebuilder:validation:XValidation:rule="has(self.command) != has(self.url)",message="set exactly one of command (a stdio server) and url (a remote Streamable HTTP server)"
// +kubebuilder:validation:XValidation:rule="!has(self.url) || (!has(self.args) && !has(self.env))",message="args and env apply only to a stdio server (command), not to a remote one (url)"
type MCPServer struct {
	// name identifies the server in mcp_request calls.
	// +required
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=63
	// +kubebuilder:validation:Pattern=`^[a-z0-9]([-a-z0-9]*[a-z0-9])?$`
	Name string `json:"name"`

	// command is the executable to start, looked up in the sandbox's PATH.
	// Give command or url.
	// +optional
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=1024
	Command string `json:"command,omitempty"`

	// url is a remote MCP server's Streamable HTTP endpoint, http or
	// https. The supervisor connects to it through the sandbox's egress
	// proxy (which must allow its host), trusting the proxy's CA, and
	// sends the caller's user token as a bearer token on the requests of
	// the mcp_request call that carries one. Give command or url.
	// +optional
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=2048
	// +kubebuilder:validation:XValidation:rule="isURL(self) && (self.startsWith('http://') || self.startsWith('https://')) && url(self).getHostname() != ''",message="url must be an http or https URL with a host"
	URL string `json:"url,omitempty"`

	// args are passed to command.
	// +optional
	// +listType=atomic
	// +kubebuilder:validation:MaxItems=128
	Args []string `json:"args,omitempty"`

	// env is added to the server's environment. It is visible to everything
	// in the sandbox, so keep credentials in secretFiles instead.
	// +optional
	Env map[string]string `json:"env,omitempty"`

	// audience is the aud a user token must carry for mcp_request to pass
	// it to this server; it defaults to a remote server's url and a stdio
	// server's name. A caller gives the token in the X-Agentbox-User-Token
	// header; the Compute API verifies it (signature, expiry, revocation,
	// this audience, the sandbox's agent). A stdio server receives it in
	// the request's params._meta under the key "agentbox.dev/user-token",
	// never in its environment or a file; a remote server as the
	// Authorization bearer token of the call's requests. A call without
	// the header reaches the server without a token, whatever the caller
	// put into _meta.
	// +optional
	// +kubebuilder:validation:MaxLength=1024
	Audience string `json:"audience,omitempty"`
}

// SandboxTemplateStatus is the observed state of a SandboxTemplate.
type SandboxTemplateStatus struct {
	// conditions report whether the template's references resolve; see the
	// Ready condition.
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

// SandboxTemplate is a reusable description of a sandbox: image, resources,
// workspace, idle timeout and tool policies. Sandboxes and warm pools refer to
// it by name.
//
// +kubebuilder:object:root=true
// +kubebuilder:subresource:status
// +kubebuilder:resource:scope=Namespaced,shortName=sbxtpl,categories=agentbox
// +kubebuilder:printcolumn:name="Image",type=string,JSONPath=`.spec.image`
// +kubebuilder:printcolumn:name="Runtime",type=string,JSONPath=`.spec.runtimeClassName`
// +kubebuilder:printcolumn:name="Idle Timeout",type=string,JSONPath=`.spec.idleTimeout`
// +kubebuilder:printcolumn:name="Ready",type=string,JSONPath=`.status.conditions[?(@.type=="Ready")].status`
// +kubebuilder:printcolumn:name="Age",type=date,JSONPath=`.metadata.creationTimestamp`
type SandboxTemplate struct {
	metav1.TypeMeta `json:",inline"`
	// +optional
	metav1.ObjectMeta `json:"metadata,omitempty"`

	// spec is the desired template.
	// +required
	Spec SandboxTemplateSpec `json:"spec"`

	// status is written by the control plane.
	// +optional
	Status SandboxTemplateStatus `json:"status,omitzero"`
}

// SandboxTemplateList is a list of SandboxTemplates.
//
// +kubebuilder:object:root=true
type SandboxTemplateList struct {
	metav1.TypeMeta `json:",inline"`
	// +optional
	metav1.ListMeta `json:"metadata,omitempty"`
	// items are the templates.
	Items []SandboxTemplate `json:"items"`
}
