# The same agentbox platform on two clusters, from one module: each module
# instance gets the agentbox provider configured for its cluster. The
# module configures no provider of its own, so one configuration can hold
# any number of clusters.
terraform {
  required_version = ">= 1.5"
  required_providers {
    agentbox = {
      source = "agentbox/agentbox"
    }
  }
}

provider "agentbox" {
  alias = "east"
  kubernetes = {
    config_path    = var.kubeconfig
    config_context = var.east_context
  }
}

provider "agentbox" {
  alias = "west"
  kubernetes = {
    config_path    = var.kubeconfig
    config_context = var.west_context
  }
}

# A self-managed cluster whose sandbox nodes are labelled sandbox=true and
# already have runsc; the pool taints them so that only sandboxes run there.
module "east" {
  source    = "../modules/agentbox-platform"
  providers = { agentbox = agentbox.east }

  namespace    = var.east_namespace
  release_name = var.east_release_name
  image_tag    = var.image_tag

  node_pool = {
    name          = "gvisor-east"
    node_selector = { "sandbox" = "true" }
    taint         = { key = "agentbox.dev/sandbox", value = "true", effect = "NoSchedule" }
  }

  template_resources = {
    requests = { cpu = "250m", memory = "512Mi" }
    limits   = { memory = "2Gi" }
  }
  warm_pool_size  = var.east_warm_pool_size
  allowed_domains = var.allowed_domains
}

# A second cluster with more traffic: a larger warm pool and a shared,
# replicated egress proxy.
module "west" {
  source    = "../modules/agentbox-platform"
  providers = { agentbox = agentbox.west }

  namespace    = var.west_namespace
  release_name = var.west_release_name
  image_tag    = var.image_tag

  node_pool = {
    name          = "gvisor-west"
    node_selector = { "sandbox" = "true" }
    taint         = { key = "agentbox.dev/sandbox", value = "true", effect = "NoSchedule" }
  }

  warm_pool_size  = var.west_warm_pool_size
  allowed_domains = var.allowed_domains
  egress_mode     = "Shared"
  egress_replicas = 2
}
