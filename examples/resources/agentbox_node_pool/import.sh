# A node pool is cluster-scoped: it is imported by its name.
terraform import agentbox_node_pool.gvisor gvisor
