# A template that another configuration manages.
data "agentbox_sandbox_template" "python" {
  name      = "python"
  namespace = "agents"
}

# A sandbox of that template for one agent.
resource "agentbox_sandbox" "alice" {
  name      = "alice"
  namespace = data.agentbox_sandbox_template.python.namespace
  agent_id  = "alice@example.com"
  template  = data.agentbox_sandbox_template.python.name
}

output "workspace_size" {
  value = data.agentbox_sandbox_template.python.workspace.size
}
