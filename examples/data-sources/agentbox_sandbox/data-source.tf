# An agent's sandbox, created elsewhere: where it is in its lifecycle and
# where its supervisor listens while it runs.
data "agentbox_sandbox" "alice" {
  name      = "alice"
  namespace = "agents"
}

output "alice_phase" {
  value = data.agentbox_sandbox.alice.status.phase # e.g. "Running" or "Stopped"
}

output "alice_endpoint" {
  value = data.agentbox_sandbox.alice.status.service_endpoint
}
