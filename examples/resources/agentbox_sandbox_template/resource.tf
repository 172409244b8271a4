# A Python sandbox: gVisor, restricted pod security, a 1Gi workspace at
# /workspace, stopped to a snapshot after an hour without activity, and
# checkpointed every five minutes while it runs, so that a lost node costs
# at most the last five minutes of work.
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

  idle_timeout        = "1h"
  checkpoint_interval = "5m"

  python = {
    default_timeout = "30s"
    max_timeout     = "2m"
  }
}
