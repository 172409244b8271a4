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

variable "corp_ca_pem" {
  description = "PEM certificate of the company's private CA."
  type        = string
}

variable "github_token" {
  description = "Token the agents' requests to the GitHub API carry; the sandboxes never see it."
  type        = string
  sensitive   = true
  ephemeral   = true
}

# Credentials the proxy puts into the agents' requests, so that no sandbox
# holds them: a sandbox sends a placeholder (or nothing) and the proxy adds
# the secret for the listed hosts only.
resource "agentbox_egress_proxy" "github" {
  name            = "github"
  namespace       = "agents"
  allowed_domains = ["api.github.com", "registry.corp.example"]

  credentials = [
    {
      name   = "github-api"
      hosts  = ["api.github.com"]
      header = { name = "Authorization", value_template = "Bearer {{secret}}" }
      # Write-only: kept in the Secret github-egress-injected that the
      # resource owns, never in plan or state. Bump the version to rotate.
      value_wo         = var.github_token
      value_wo_version = 1
    },
    {
      name       = "registry"
      hosts      = ["registry.corp.example"]
      basic_auth = { username = "agents" }
      # A Secret managed elsewhere, in the proxy's namespace.
      secret_ref = { name = "registry-password", key = "password" }
    },
  ]
  # The private CA that signs registry.corp.example.
  destination_ca_bundle = var.corp_ca_pem
}

resource "agentbox_sandbox_template" "python" {
  name         = "python"
  namespace    = "agents"
  egress_proxy = agentbox_egress_proxy.python.name
}
