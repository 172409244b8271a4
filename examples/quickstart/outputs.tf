# What the quickstart script needs to call the Compute API.
output "api_endpoint" {
  description = "The Compute API."
  value       = agentbox_platform.this.api_endpoint
}

output "ca_certificate" {
  description = "The platform CA, which signs the Compute API's certificate."
  value       = agentbox_platform.this.ca_certificate
}

output "admin_token" {
  description = "The first admin token of the Compute API."
  value       = agentbox_platform.this.admin_token
  sensitive   = true
}

output "agent_id" {
  value = agentbox_sandbox.agent.agent_id
}

output "snapshot_driver" {
  description = "Where idle sandboxes' workspaces are kept."
  value       = agentbox_platform.this.snapshot_driver
}
