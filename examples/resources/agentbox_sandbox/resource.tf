# One sandbox per agent. The Compute API routes calls for agent_id here.
resource "agentbox_sandbox" "alice" {
  name      = "alice"
  namespace = "agents"
  agent_id  = "alice@example.com"
  template  = agentbox_sandbox_template.python.name

  timeouts = {
    create = "10m"
  }
}

resource "agentbox_sandbox_template" "python" {
  name      = "python"
  namespace = "agents"
}
