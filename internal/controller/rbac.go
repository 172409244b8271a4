package controller

// Every permission the controllers in this package use, in one place, so the
// chart's RBAC can be checked against a single list. The chart grants the
// namespaced ones (pods, claims, Secrets, Leases, Services, ConfigMaps,
// NetworkPolicies, Deployments) only in the namespaces the platform serves,
// by a Role in each (see ServedNamespaces), and the rest cluster-wide.
// Controllers
// write status and metadata, never spec: the agentbox kinds get update and
// patch only for their metadata (labels) and status.
//
// sandboxes/finalizers: update is needed to create children with
// blockOwnerDeletion (SetControllerReference sets it) on clusters that
// enable the OwnerReferencesPermissionEnforcement admission plugin.
//
// Pods and workspace claims are created and deleted; their specs are
// immutable in practice, so they are patched only to move them, with the
// TLS Secret, from a warm sandbox to the Sandbox adopting it (owner
// reference and labels). Secrets are updated when a serving certificate is
// re-issued. Leases (the sandboxes' activity clocks) are created, and
// updated only to remove an expired hold: the Compute API renews them and
// writes holds.
//
// Events go through the events.k8s.io API; the core group is listed too
// because client-go falls back to it on servers without events.k8s.io/v1.

// +kubebuilder:rbac:groups=agentbox.dev,resources=sandboxes,verbs=get;list;watch;create;update;patch;delete
// +kubebuilder:rbac:groups=agentbox.dev,resources=sandboxes/status,verbs=get;update;patch
// +kubebuilder:rbac:groups=agentbox.dev,resources=sandboxes/finalizers,verbs=update
// +kubebuilder:rbac:groups=agentbox.dev,resources=sandboxtemplates,verbs=get;list;watch
// +kubebuilder:rbac:groups="",resources=pods,verbs=get;list;watch;create;patch;delete
// +kubebuilder:rbac:groups="",resources=persistentvolumeclaims,verbs=get;list;watch;create;patch;delete
// +kubebuilder:rbac:groups="",resources=persistentvolumes,verbs=get;list;watch
//
// Node loss: a deleted Node is how a sandbox learns its node is gone
// (nodes are also read for node pools, below). A sandbox reports whether
// its namespace enforces the restricted Pod Security Standard; namespaces
// are only read, never labelled.
// +kubebuilder:rbac:groups="",resources=namespaces,verbs=get;list;watch
// +kubebuilder:rbac:groups="",resources=secrets,verbs=get;list;watch;create;update;patch
// +kubebuilder:rbac:groups=coordination.k8s.io,resources=leases,verbs=get;list;watch;create;update
//
// Warm pools: the pool controller creates its unassigned Sandboxes and
// deletes them on scale-down and template change; an adopter deletes the
// warm Sandbox it took over. The pool's spec (replicas, also through the
// scale subresource) is never written, only its status.
// +kubebuilder:rbac:groups=agentbox.dev,resources=sandboxwarmpools,verbs=get;list;watch
// +kubebuilder:rbac:groups=agentbox.dev,resources=sandboxwarmpools/status,verbs=get;update;patch
// +kubebuilder:rbac:groups=agentbox.dev,resources=sandboxwarmpools/finalizers,verbs=update
// +kubebuilder:rbac:groups=events.k8s.io,resources=events,verbs=create;patch
// +kubebuilder:rbac:groups="",resources=events,verbs=create;patch
//
// Node pools: the finalizer is a metadata write (patch), status is patched.
// A Managed pool creates, corrects and deletes its own RuntimeClass, and
// labels and taints the nodes it selects; nodes are only patched (with
// optimistic locking), never updated or created, and their status is left
// to kubelet. Sandboxes read their template's node pool through the same
// rights.
// +kubebuilder:rbac:groups=agentbox.dev,resources=gvisornodepools,verbs=get;list;watch;patch
// +kubebuilder:rbac:groups=agentbox.dev,resources=gvisornodepools/status,verbs=get;patch
// +kubebuilder:rbac:groups=agentbox.dev,resources=gvisornodepools/finalizers,verbs=update
// +kubebuilder:rbac:groups=node.k8s.io,resources=runtimeclasses,verbs=get;list;watch;create;patch;delete
// +kubebuilder:rbac:groups="",resources=nodes,verbs=get;list;watch;patch
//
// Egress proxies: the controller reads EgressProxies and writes their
// status. It creates per-sandbox proxy pods and Services (owned by the
// Sandbox, replaced when their spec changes), the proxy's policy
// ConfigMap, and NetworkPolicies for sandboxes and proxy pods; it reads
// the upstream credentials Secret only to check it exists (the proxy pod
// mounts it).
// +kubebuilder:rbac:groups=agentbox.dev,resources=egressproxies,verbs=get;list;watch
// +kubebuilder:rbac:groups=agentbox.dev,resources=egressproxies/status,verbs=get;update;patch
// +kubebuilder:rbac:groups=agentbox.dev,resources=egressproxies/finalizers,verbs=update
// +kubebuilder:rbac:groups="",resources=services,verbs=get;list;watch;create;update;patch;delete
// +kubebuilder:rbac:groups="",resources=configmaps,verbs=get;list;watch;create;update;patch;delete
// +kubebuilder:rbac:groups=networking.k8s.io,resources=networkpolicies,verbs=get;list;watch;create;update;patch;delete
// The control plane follows the proxies' access logs for their denials
// (EgressDenials).
// +kubebuilder:rbac:groups="",resources=pods/log,verbs=get
// A Shared proxy runs as a Deployment owned by its EgressProxy.
// +kubebuilder:rbac:groups=apps,resources=deployments,verbs=get;list;watch;create;update;patch;delete
//
// The snapshot check writes the control plane's status ConfigMap in the
// platform namespace, owned by the control plane's Deployment, which it
// reads and records its events on.
// +kubebuilder:rbac:groups="",resources=configmaps,verbs=get;create;update
// +kubebuilder:rbac:groups=apps,resources=deployments,verbs=get
