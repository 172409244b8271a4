# A Python sandbox: gVisor, restricted pod security, a 1Gi workspace at
# /workspace, stopped to a snapshot after an hour without activity.
resource "agentbox_sandbox_template" "python" {
  name      = "python"
  namespace = "agents"

  resources = {
    requests = { cpu = "250m", memory = "512Mi" }
    limits   = { memory = "2Gi" }
  }

  workspace = {
    size = "1Gi"
  }

  idle_timeout = "1h"

  python = {
    default_timeout = "30s"
    max_timeout     = "2m"
  }
}
