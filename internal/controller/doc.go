// Package controller holds the agentbox reconcilers, which turn the agentbox
// kinds into the Kubernetes objects that run them and report what they
// found. They write status and metadata of the agentbox kinds, never their
// spec: the spec belongs to the Terraform provider and other clients, and a
// controller that wrote it would show up as drift in every plan.
//
// Each reconciler is a group of files named for it:
//
//   - sandbox_*.go: the Sandbox reconciler. sandbox_controller.go holds the
//     pass (get, children, observe, status); its children, status, idle stop,
//     resume, filespace sync, adoption from a warm pool, node loss, the
//     agent's hold and the rest each have a file of their own.
//   - warmpool_*.go: the SandboxWarmPool reconciler, which keeps ready
//     sandboxes for adoption and pool leases.
//   - nodepool_*.go: the GVisorNodePool reconciler, which prepares nodes and
//     RuntimeClasses for gVisor.
//   - egressproxy_*.go: the EgressProxy reconciler, which runs the egress
//     proxies and the NetworkPolicies around sandboxes and proxies.
//   - snapshot_check.go: the control plane's periodic check that its snapshot
//     driver can work, which holds idle stops back while it cannot.
//
// What they share is written once: status.go (conditions, events, writing a
// status only on change, the setup every reconciler begins with),
// requests.go (watch mapping), metrics.go, and rbac.go, which holds every
// permission the reconcilers use.
package controller
