variable "corp_proxy_credentials" {
  description = "user:password for the company's outbound proxy."
  type        = string
  sensitive   = true
  ephemeral   = true
}

# One proxy that all sandboxes of the python template share: they may reach
# the Python package index and GitHub, nothing else, and only through the
# company's upstream proxy.
resource "agentbox_egress_proxy" "python" {
  name      = "python"
  namespace = "agents"
  mode      = "Shared"
  replicas  = 2

  allowed_domains = ["pypi.org", "*.pythonhosted.org", "github.com", "*.githubusercontent.com"]
  denied_domains  = ["gist.github.com"]
  # Refused after DNS resolution, on top of the private, loopback,
  # link-local and metadata ranges that are always refused.
  denied_cidrs = ["203.0.113.0/24"]

  upstream_url = "http://proxy.corp.example:3128"
  # Write-only (Terraform 1.11 or later): never stored in plan or state.
  # Bump the version to write a new value into the proxy's Secret.
  upstream_credentials_wo         = var.corp_proxy_credentials
  upstream_credentials_wo_version = 1

  # Apply returns once the proxy pods are ready (the default).
  wait_for_ready = true
  timeouts = {
    create = "5m"
  }
}

# A proxy per sandbox, with credentials from a Secret managed elsewhere.
resource "agentbox_egress_proxy" "isolated" {
  name            = "isolated"
  namespace       = "agents"
  allowed_domains = ["api.example.com"]

  upstream_url                = "http://proxy.corp.example:3128"
  upstream_credentials_secret = { name = "corp-proxy", key = "credentials" }
}

resource "agentbox_sandbox_template" "python" {
  name         = "python"
  namespace    = "agents"
  egress_proxy = agentbox_egress_proxy.python.name
}
