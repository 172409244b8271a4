# The agentbox quickstart: the platform, a Python sandbox template and one
# agent's sandbox, in a single apply. `make quickstart` runs it against the
# local test cluster; point `kubeconfig` at any cluster with gVisor to run it
# elsewhere.
terraform {
  required_version = ">= 1.5"
  required_providers {
    agentbox = {
      source = "agentbox/agentbox"
    }
  }
}

variable "kubeconfig" {
  description = "Path of the kubeconfig of the cluster to install into."
  type        = string
}

variable "image_tag" {
  description = "Tag of the agentbox images (the quickstart builds and imports \"dev\")."
  type        = string
  default     = "dev"
}

variable "agent_id" {
  description = "The agent that gets a sandbox."
  type        = string
  default     = "quickstart-agent"
}

variable "idle_timeout" {
  description = "How long the agent's sandbox may go without a call before it is stopped into a snapshot; null keeps the template's (1h). Set it to 1m to watch an idle stop and the resume that the next call brings."
  type        = string
  default     = null
}

provider "agentbox" {
  kubernetes = {
    config_path = var.kubeconfig
  }
  namespace = "agentbox-system"
}

# The control plane: CRDs, controllers, the Compute API, RBAC and a Service,
# installed from the chart embedded in the provider. With the chart's
# defaults, idle sandboxes are snapshotted into its embedded store, a volume
# of the control plane's own (snapshot_driver "archive/embedded"), which
# needs nothing outside the cluster.
resource "agentbox_platform" "this" {
  image_tag = var.image_tag
}

# A Python sandbox under gVisor, with restricted pod security and a 1Gi
# workspace at /workspace.
resource "agentbox_sandbox_template" "python" {
  name               = "python"
  runtime_class_name = "gvisor"
  workspace = {
    size = "1Gi"
  }

  # The template's kind exists once the platform's CRDs are installed.
  depends_on = [agentbox_platform.this]
}

resource "agentbox_sandbox" "agent" {
  name         = "quickstart-agent"
  agent_id     = var.agent_id
  template     = agentbox_sandbox_template.python.name
  idle_timeout = var.idle_timeout
}
