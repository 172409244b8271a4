# How the module wires its variables into resources, planned against a mock
# of the provider: `terraform test` runs it without a cluster.
mock_provider "agentbox" {}

variables {
  node_pool = {
    node_selector = { sandbox = "true" }
    taint         = { key = "agentbox.dev/sandbox", value = "true" }
  }
}

run "defaults" {
  command = plan

  assert {
    condition     = agentbox_platform.this.values == null
    error_message = "The platform got chart values although no variable asks for any."
  }
  assert {
    condition     = length(agentbox_egress_proxy.this) == 0 && agentbox_sandbox_template.this.egress_proxy == null
    error_message = "An egress proxy was planned without allowed_domains."
  }
  assert {
    condition = length(agentbox_node_pool.this.tolerations) == 1 && alltrue([for t in agentbox_node_pool.this.tolerations :
      t.key == "agentbox.dev/sandbox" && t.operator == "Equal" && t.value == "true" && t.effect == "NoSchedule"
    ])
    error_message = "The sandboxes do not tolerate the pool's taint."
  }
  assert {
    condition     = agentbox_sandbox_template.this.node_pool == "gvisor" && agentbox_warm_pool.this.template == "python" && agentbox_warm_pool.this.replicas == 1
    error_message = "The template, node pool and warm pool are not wired together."
  }
}

run "egress" {
  command = plan

  variables {
    allowed_domains = ["pypi.org"]
    egress_mode     = "Shared"
    egress_replicas = 3
  }

  assert {
    condition     = agentbox_egress_proxy.this[0].replicas == 3 && agentbox_sandbox_template.this.egress_proxy == "python"
    error_message = "The template does not go through a Shared proxy of 3 replicas."
  }
}

run "per_agent_egress_has_no_replicas" {
  command = plan

  variables {
    allowed_domains = ["pypi.org"]
    egress_replicas = 3
  }

  assert {
    condition     = agentbox_egress_proxy.this[0].mode == "PerAgent" && agentbox_egress_proxy.this[0].replicas == null
    error_message = "A PerAgent proxy got replicas, which the provider refuses."
  }
}

run "chart_values" {
  command = plan

  variables {
    image_repositories = { sandbox = "mirror/agentbox-sandbox", supervisor = "mirror/agentbox-supervisor" }
    install_runsc      = true
    platform_values    = "metrics:\n  enabled: false\n"
  }

  assert {
    condition = yamldecode(agentbox_platform.this.values) == {
      image          = { sandbox = { repository = "mirror/agentbox-sandbox" }, supervisor = { repository = "mirror/agentbox-supervisor" } }
      runscInstaller = { enabled = true }
      metrics        = { enabled = false }
    }
    error_message = "The chart values do not combine the module's variables and platform_values."
  }
}

run "platform_values_overlap" {
  command = plan

  variables {
    install_runsc   = true
    platform_values = "runscInstaller: {enabled: false}"
  }

  expect_failures = [agentbox_platform.this]
}

run "managed_needs_node_selector" {
  command = plan

  variables {
    node_pool = {}
  }

  expect_failures = [var.node_pool]
}

run "gke_has_no_taint" {
  command = plan

  variables {
    node_pool = {
      mode          = "GKE"
      node_selector = { "cloud.google.com/gke-nodepool" = "sandbox-pool" }
      taint         = { key = "k", value = "v" }
    }
  }

  expect_failures = [var.node_pool]
}

run "credentials_need_upstream" {
  command = plan

  variables {
    allowed_domains             = ["pypi.org"]
    upstream_credentials_secret = { name = "corp-proxy", key = "credentials" }
  }

  expect_failures = [agentbox_egress_proxy.this]
}
