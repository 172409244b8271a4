# --- Platform (the Helm release of the control plane) ---

variable "namespace" {
  description = "Namespace of the control plane, created if missing. The template, warm pool and egress proxy live here too."
  type        = string
  default     = "agentbox-system"
  nullable    = false

  validation {
    condition     = length(var.namespace) <= 63 && can(regex("^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", var.namespace))
    error_message = "namespace must be a Kubernetes namespace name: at most 63 lower-case letters, digits and '-', starting and ending with a letter or digit."
  }
}

variable "release_name" {
  description = "Name of the platform's Helm release."
  type        = string
  default     = "agentbox"
  nullable    = false

  validation {
    condition     = length(var.release_name) <= 53 && can(regex("^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$", var.release_name))
    error_message = "release_name must be a Helm release name: at most 53 lower-case letters, digits, '-' and '.', starting and ending with a letter or digit."
  }
}

variable "image_registry" {
  description = "Registry, optionally with a path, put in front of every platform image repository, e.g. \"registry.example.com/mirror\". Null means Docker Hub."
  type        = string
  default     = null
}

variable "image_tag" {
  description = "Tag of the four platform images (control plane, sandbox, supervisor, egress proxy), which are built together. Null means the chart's appVersion."
  type        = string
  default     = null

  validation {
    condition     = var.image_tag == null || can(regex("^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$", var.image_tag))
    error_message = "image_tag must be an image tag: letters, digits, '_', '.' and '-', at most 128, not starting with '.' or '-'."
  }
}

variable "image_repositories" {
  description = "Repositories of the platform images, for mirrors that rename them. Each is put after image_registry; unset ones keep the chart's (agentbox/agentbox-controlplane, agentbox/agentbox-sandbox, agentbox/agentbox-supervisor, agentbox/agentbox-egress-proxy)."
  type = object({
    control_plane = optional(string)
    sandbox       = optional(string)
    supervisor    = optional(string)
    egress_proxy  = optional(string)
  })
  default  = {}
  nullable = false
}

variable "image_pull_policy" {
  description = "Pull policy of the platform images. Null means the chart's IfNotPresent."
  type        = string
  default     = null

  validation {
    condition     = var.image_pull_policy == null || contains(["Always", "IfNotPresent", "Never"], coalesce(var.image_pull_policy, "IfNotPresent"))
    error_message = "image_pull_policy must be one of Always, IfNotPresent and Never."
  }
}

variable "replicas" {
  description = "Control plane replicas. More than one needs a PostgreSQL store (store.dsn in platform_values)."
  type        = number
  default     = 1
  nullable    = false

  validation {
    condition     = var.replicas >= 1 && floor(var.replicas) == var.replicas
    error_message = "replicas must be a whole number of at least 1."
  }
}

variable "install_runsc" {
  description = "Run the chart's runsc installer DaemonSet on the node pool's nodes (Managed mode). It copies runsc onto the nodes as root, from a namespace of its own that the chart creates allowing privileged pods (the platform's namespace stays restricted); leave it off when the node image already has gVisor."
  type        = bool
  default     = false
  nullable    = false
}

variable "platform_values" {
  description = "Further chart values as YAML (see the chart's values.yaml), merged last by the platform. It must not set the keys this module sets from its own variables: image (when image_repositories is set) and runscInstaller (when install_runsc is true)."
  type        = string
  default     = null

  validation {
    condition     = var.platform_values == null || can(keys(yamldecode(var.platform_values)))
    error_message = "platform_values must be a YAML mapping of chart values, e.g. yamlencode({ metrics = { enabled = false } })."
  }
}

variable "wait_for_ready" {
  description = "Make apply wait until the control plane, the node pool, the egress proxy and the warm pool are ready. False returns once Kubernetes accepted the objects."
  type        = bool
  default     = true
  nullable    = false
}

# --- gVisor node pool ---

variable "node_pool" {
  description = <<-EOT
    The gVisor node pool that runs the sandboxes. mode Managed (the default) needs node_selector; GKE adopts GKE Sandbox's RuntimeClass and
    uses no taint. When taint is set and tolerations is not, the sandboxes tolerate the taint.
  EOT
  type = object({
    name               = optional(string, "gvisor")
    mode               = optional(string, "Managed")
    runtime_class_name = optional(string, "gvisor")
    node_selector      = optional(map(string), {})
    taint = optional(object({
      key    = string
      value  = optional(string)
      effect = optional(string, "NoSchedule")
    }))
    tolerations = optional(list(object({
      key                = optional(string)
      operator           = optional(string)
      value              = optional(string)
      effect             = optional(string)
      toleration_seconds = optional(number)
    })))
    overhead = optional(map(string))
  })
  nullable = false

  validation {
    condition     = contains(["Managed", "GKE"], var.node_pool.mode)
    error_message = "node_pool.mode must be Managed or GKE."
  }
  validation {
    condition     = var.node_pool.mode != "Managed" || length(var.node_pool.node_selector) > 0
    error_message = "node_pool.node_selector is required in Managed mode: it selects the nodes that get runsc and run the sandboxes."
  }
  validation {
    condition     = var.node_pool.mode != "GKE" || var.node_pool.taint == null
    error_message = "node_pool.taint is not used in GKE mode: GKE Sandbox taints its nodes itself."
  }
}

# --- Sandbox template ---

variable "template_name" {
  description = "Name of the sandbox template; the warm pool and the egress proxy get the same name."
  type        = string
  default     = "python"
  nullable    = false

  validation {
    condition     = length(var.template_name) <= 63 && can(regex("^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", var.template_name))
    error_message = "template_name must be at most 63 lower-case letters, digits and '-', starting and ending with a letter or digit."
  }
}

variable "template_image" {
  description = "Container image of the sandboxes: any Linux image (amd64); the platform injects its supervisor, which replaces the image's entrypoint and command. Null means the platform's default sandbox image (Python 3)."
  type        = string
  default     = null
}

variable "template_resources" {
  description = "CPU and memory of each sandbox pod, as Kubernetes quantities, e.g. { requests = { cpu = \"250m\", memory = \"512Mi\" }, limits = { memory = \"2Gi\" } }."
  type = object({
    requests = optional(map(string))
    limits   = optional(map(string))
  })
  default = null
}

variable "template_env" {
  description = "Environment variables of the sandboxes (plain values, not secrets)."
  type        = map(string)
  default     = {}
  nullable    = false
}

variable "workspace_size" {
  description = "Size of each sandbox's persistent workspace volume, a Kubernetes quantity."
  type        = string
  default     = "1Gi"
  nullable    = false

  validation {
    condition     = can(regex("^[0-9]+(\\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$", var.workspace_size))
    error_message = "workspace_size must be a Kubernetes quantity such as 512Mi or 10Gi."
  }
}

variable "workspace_storage_class" {
  description = "StorageClass of the workspace volumes. Null means the cluster's default class."
  type        = string
  default     = null
}

variable "idle_timeout" {
  description = "How long a sandbox may go without API activity before it is snapshotted and stopped, a Go duration such as 30m or 1h."
  type        = string
  default     = "1h"
  nullable    = false

  validation {
    condition     = can(regex("^([0-9]+(\\.[0-9]+)?(ns|us|µs|ms|s|m|h))+$", var.idle_timeout))
    error_message = "idle_timeout must be a Go duration such as 30m, 1h or 1h30m."
  }
}

# --- Warm pool ---

variable "warm_pool_size" {
  description = "How many started, unassigned sandboxes of the template to keep ready, so that a new agent's sandbox starts warm. 0 keeps none."
  type        = number
  default     = 1
  nullable    = false

  validation {
    condition     = var.warm_pool_size >= 0 && floor(var.warm_pool_size) == var.warm_pool_size
    error_message = "warm_pool_size must be a whole number of at least 0."
  }
}

# --- Egress ---

variable "allowed_domains" {
  description = "The only host names the sandboxes may reach, through an egress proxy; \"*.example.com\" matches every subdomain. Empty creates no proxy: sandboxes then reach nothing outside the cluster but DNS."
  type        = list(string)
  default     = []
  nullable    = false

  validation {
    condition     = alltrue([for d in var.allowed_domains : length(d) <= 253 && can(regex("^(\\*\\.)?[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$", d))])
    error_message = "allowed_domains must be lower-case DNS names, optionally starting with \"*.\"."
  }
}

variable "denied_domains" {
  description = "Host names refused even when allowed_domains matches them."
  type        = list(string)
  default     = []
  nullable    = false
}

variable "egress_mode" {
  description = "PerAgent runs one proxy per sandbox, so agents never share a proxy process; Shared runs one proxy Deployment of egress_replicas pods for all."
  type        = string
  default     = "PerAgent"
  nullable    = false

  validation {
    condition     = contains(["PerAgent", "Shared"], var.egress_mode)
    error_message = "egress_mode must be PerAgent or Shared."
  }
}

variable "egress_replicas" {
  description = "Proxy pods in Shared mode (ignored in PerAgent mode)."
  type        = number
  default     = 1
  nullable    = false

  validation {
    condition     = var.egress_replicas >= 1 && var.egress_replicas <= 100 && floor(var.egress_replicas) == var.egress_replicas
    error_message = "egress_replicas must be a whole number from 1 to 100."
  }
}

variable "upstream_url" {
  description = "An upstream HTTP proxy (http:// or https:// URL of a host and optional port) that the egress proxy chains to. Null means it connects directly."
  type        = string
  default     = null

  validation {
    condition     = var.upstream_url == null || can(regex("^https?://[^/@]+$", coalesce(var.upstream_url, "http://x")))
    error_message = "upstream_url must be an http:// or https:// URL of a host and optional port, without a path or credentials."
  }
}

variable "upstream_credentials_secret" {
  description = "An existing Secret in the namespace whose key holds the upstream proxy's credentials as user:password. Requires upstream_url."
  type = object({
    name = string
    key  = string
  })
  default = null
}
