# A gVisor node pool that the platform team manages elsewhere.
data "agentbox_node_pool" "gvisor" {
  name = "gvisor"
}

# Sandboxes of this template run on the pool's nodes.
resource "agentbox_sandbox_template" "python" {
  name               = "python"
  namespace          = "agents"
  node_pool          = data.agentbox_node_pool.gvisor.name
  runtime_class_name = data.agentbox_node_pool.gvisor.runtime_class_name
}

output "gvisor_nodes_ready" {
  value = data.agentbox_node_pool.gvisor.status.ready_nodes
}
