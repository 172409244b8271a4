provider "agentbox" {
  kubernetes = {
    config_path    = "~/.kube/config"
    config_context = "prod-agents"
  }

  # Resources that set no namespace of their own go here.
  namespace = "agentbox-system"
}
