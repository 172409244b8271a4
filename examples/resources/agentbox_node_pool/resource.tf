# The platform installs the pool's CRD and runs the controller that prepares
# the nodes.
resource "agentbox_platform" "this" {}

# Nodes labelled sandbox=true run sandboxes under gVisor. The platform installs
# runsc on them, taints them so that other pods stay off, and creates the
# RuntimeClass "gvisor" that schedules sandbox pods there.
resource "agentbox_node_pool" "gvisor" {
  name               = "gvisor"
  mode               = "Managed"
  runtime_class_name = "gvisor"
  node_selector      = { "sandbox" = "true" }
  taint              = { key = "agentbox.dev/sandbox", value = "true", effect = "NoSchedule" }
  tolerations        = [{ key = "agentbox.dev/sandbox", operator = "Equal", value = "true", effect = "NoSchedule" }]
  overhead           = { cpu = "50m", memory = "32Mi" }

  depends_on = [agentbox_platform.this]
}

# On GKE, GKE Sandbox provides gVisor: the pool adopts its RuntimeClass.
resource "agentbox_node_pool" "gke" {
  name          = "gke-sandbox"
  mode          = "GKE"
  node_selector = { "cloud.google.com/gke-nodepool" = "sandbox-pool" }
}
