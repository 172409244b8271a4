output "namespace" {
  description = "Namespace of the control plane, the template, the warm pool and the egress proxy."
  value       = agentbox_platform.this.namespace
}

output "release_name" {
  description = "Name of the platform's Helm release."
  value       = agentbox_platform.this.release_name
}

output "chart_version" {
  description = "Version of the chart the platform runs."
  value       = agentbox_platform.this.chart_version
}

output "api_endpoint" {
  description = "https://<ClusterIP>:443 of the Compute API; its certificate verifies with ca_certificate."
  value       = agentbox_platform.this.api_endpoint
}

output "api_service_dns" {
  description = "In-cluster DNS name of the Compute API (port 443)."
  value       = agentbox_platform.this.api_service_dns
}

output "ca_certificate" {
  description = "The platform CA (PEM), which signs the Compute API's certificate."
  value       = agentbox_platform.this.ca_certificate
}

output "admin_token" {
  description = "The first admin bearer token of the Compute API."
  value       = agentbox_platform.this.admin_token
  sensitive   = true
}

output "node_pool_name" {
  description = "Name of the gVisor node pool."
  value       = agentbox_node_pool.this.name
}

output "runtime_class_name" {
  description = "RuntimeClass the sandboxes run with."
  value       = agentbox_node_pool.this.runtime_class_name
}

output "template_name" {
  description = "Name of the sandbox template, for agentbox_sandbox.template."
  value       = agentbox_sandbox_template.this.name
}

output "warm_pool_name" {
  description = "Name of the warm pool."
  value       = agentbox_warm_pool.this.name
}

output "warm_pool_ready_replicas" {
  description = "Warm sandboxes ready to be adopted when the apply finished."
  value       = agentbox_warm_pool.this.status.ready_replicas
}

output "egress_proxy_name" {
  description = "Name of the egress proxy, or null when allowed_domains is empty and the sandboxes have no egress."
  value       = one(agentbox_egress_proxy.this[*].name)
}
