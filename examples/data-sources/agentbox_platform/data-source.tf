# A platform installed by another configuration (or with `helm install`):
# how this configuration's clients reach its Compute API.
data "agentbox_platform" "shared" {
  namespace    = "agentbox-system"
  release_name = "agentbox"
}

output "api_endpoint" {
  value = data.agentbox_platform.shared.api_endpoint
}

output "ca_certificate" {
  value = data.agentbox_platform.shared.ca_certificate
}

output "admin_token" {
  value     = data.agentbox_platform.shared.admin_token
  sensitive = true
}

# Fail the plan early if the release needs repair.
check "platform_healthy" {
  assert {
    condition     = length(data.agentbox_platform.shared.drift) == 0
    error_message = "The agentbox platform has drifted: ${join("; ", data.agentbox_platform.shared.drift)}"
  }
}
