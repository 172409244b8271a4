# The agentbox control plane, installed from the chart embedded in the
# provider into agentbox-system (created if missing).
resource "agentbox_platform" "this" {
  namespace = "agentbox-system"

  # Pull the platform images from your own mirror:
  # registry.example.com/agentbox/agentbox-controlplane:v0.1.0, ...
  image_registry = "registry.example.com"
  image_tag      = "v0.1.0"

  # Sandboxes run in agentbox-system and in these namespaces (which must
  # exist), and nowhere else: the control plane's rights over pods and
  # Secrets reach only there.
  sandbox_namespaces = ["agents"]

  # Any other chart value, as YAML; see the chart's values.yaml.
  values = yamlencode({
    resources = {
      requests = { cpu = "100m", memory = "128Mi" }
    }
    store = {
      persistence = { size = "5Gi" }
    }
  })

  timeouts = {
    create = "10m"
  }
}

# How clients reach the Compute API.
output "api_endpoint" {
  value = agentbox_platform.this.api_endpoint
}

output "ca_certificate" {
  value = agentbox_platform.this.ca_certificate
}

output "admin_token" {
  value     = agentbox_platform.this.admin_token
  sensitive = true
}
