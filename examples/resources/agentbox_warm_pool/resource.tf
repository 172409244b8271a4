# Three started, unassigned sandboxes of the python template: a new agent's
# sandbox of that template adopts one of them instead of starting cold.
resource "agentbox_warm_pool" "python" {
  name      = "python"
  namespace = "agents"
  template  = agentbox_sandbox_template.python.name
  replicas  = 3

  # A pool lease that may wait (wait_seconds) and finds all three taken
  # gets a sandbox started for it rather than waiting for a refill.
  cold_start_when_exhausted = true

  # Apply returns once the three are ready (the default).
  wait_for_ready = true
  timeouts = {
    create = "10m"
    update = "10m"
  }
}

resource "agentbox_sandbox_template" "python" {
  name      = "python"
  namespace = "agents"
}
