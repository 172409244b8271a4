# The agentbox platform on one cluster: the control plane, a gVisor node
# pool, a sandbox template on it, a warm pool of that template and, when
# allowed_domains is set, the egress proxy the template's sandboxes go
# through. The caller configures the agentbox provider and passes it in.

locals {
  image_repositories = {
    for key, repository in {
      controlPlane = var.image_repositories.control_plane
      sandbox      = var.image_repositories.sandbox
      supervisor   = var.image_repositories.supervisor
      egressProxy  = var.image_repositories.egress_proxy
    } : key => { repository = repository } if repository != null
  }

  # Chart values that come from this module's variables. merge() skips the
  # nulls, so a key appears only when its variable asks for it.
  module_values = merge(
    length(local.image_repositories) > 0 ? { image = local.image_repositories } : null,
    var.install_runsc ? { runscInstaller = { enabled = true } } : null,
  )
  user_values = var.platform_values == null ? {} : yamldecode(var.platform_values)
  values      = merge(local.module_values, local.user_values)

  # Sandboxes must tolerate the taint that keeps other pods off the pool.
  tolerations = var.node_pool.tolerations != null ? var.node_pool.tolerations : (
    var.node_pool.taint == null ? [] : [{
      key                = var.node_pool.taint.key
      operator           = var.node_pool.taint.value == null ? "Exists" : "Equal"
      value              = var.node_pool.taint.value
      effect             = var.node_pool.taint.effect
      toleration_seconds = null
    }]
  )

  create_egress_proxy = length(var.allowed_domains) > 0
}

resource "agentbox_platform" "this" {
  namespace         = var.namespace
  release_name      = var.release_name
  image_registry    = var.image_registry
  image_tag         = var.image_tag
  image_pull_policy = var.image_pull_policy
  replicas          = var.replicas
  wait              = var.wait_for_ready
  # The platform stores values as given: null rather than "{}" keeps a
  # configuration without values free of a diff.
  values = length(local.values) > 0 ? yamlencode(local.values) : null

  lifecycle {
    precondition {
      condition     = length(setintersection(keys(local.module_values), keys(local.user_values))) == 0
      error_message = "platform_values sets ${join(", ", setintersection(keys(local.module_values), keys(local.user_values)))}, which this module sets from image_repositories or install_runsc; use those variables instead."
    }
  }
}

# Cluster-scoped. It needs the platform's CRDs, and its destroy needs the
# platform's controllers, which take the pool's labels and taint off the
# nodes, so it comes after the platform and goes before it.
resource "agentbox_node_pool" "this" {
  name               = var.node_pool.name
  mode               = var.node_pool.mode
  runtime_class_name = var.node_pool.runtime_class_name
  node_selector      = length(var.node_pool.node_selector) > 0 ? var.node_pool.node_selector : null
  taint              = var.node_pool.taint
  tolerations        = length(local.tolerations) > 0 ? local.tolerations : null
  overhead           = var.node_pool.overhead
  wait_for_ready     = var.wait_for_ready

  depends_on = [agentbox_platform.this]
}

resource "agentbox_egress_proxy" "this" {
  count = local.create_egress_proxy ? 1 : 0

  name            = var.template_name
  namespace       = agentbox_platform.this.namespace
  mode            = var.egress_mode
  replicas        = var.egress_mode == "Shared" ? var.egress_replicas : null
  allowed_domains = var.allowed_domains
  denied_domains  = length(var.denied_domains) > 0 ? var.denied_domains : null

  upstream_url                = var.upstream_url
  upstream_credentials_secret = var.upstream_credentials_secret
  wait_for_ready              = var.wait_for_ready

  lifecycle {
    precondition {
      condition     = var.upstream_credentials_secret == null || var.upstream_url != null
      error_message = "upstream_credentials_secret needs upstream_url: the credentials are for the upstream proxy."
    }
  }
}

resource "agentbox_sandbox_template" "this" {
  name               = var.template_name
  namespace          = agentbox_platform.this.namespace
  image              = var.template_image
  node_pool          = agentbox_node_pool.this.name
  runtime_class_name = agentbox_node_pool.this.runtime_class_name
  egress_proxy       = one(agentbox_egress_proxy.this[*].name)
  env                = length(var.template_env) > 0 ? var.template_env : null
  resources          = var.template_resources
  idle_timeout       = var.idle_timeout

  workspace = {
    size               = var.workspace_size
    storage_class_name = var.workspace_storage_class
  }
}

resource "agentbox_warm_pool" "this" {
  name           = var.template_name
  namespace      = agentbox_sandbox_template.this.namespace
  template       = agentbox_sandbox_template.this.name
  replicas       = var.warm_pool_size
  wait_for_ready = var.wait_for_ready
}
