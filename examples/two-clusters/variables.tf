variable "kubeconfig" {
  description = "Path of a kubeconfig that has a context for each cluster."
  type        = string
  default     = "~/.kube/config"
}

variable "east_context" {
  description = "Kubeconfig context of the east cluster."
  type        = string
  default     = "agents-east"
}

variable "west_context" {
  description = "Kubeconfig context of the west cluster."
  type        = string
  default     = "agents-west"
}

variable "east_namespace" {
  description = "Namespace of the platform on the east cluster."
  type        = string
  default     = "agentbox-system"
}

variable "west_namespace" {
  description = "Namespace of the platform on the west cluster."
  type        = string
  default     = "agentbox-system"
}

variable "east_release_name" {
  description = "Helm release name of the platform on the east cluster."
  type        = string
  default     = "agentbox"
}

variable "west_release_name" {
  description = "Helm release name of the platform on the west cluster."
  type        = string
  default     = "agentbox"
}

variable "image_tag" {
  description = "Tag of the platform images on both clusters; null means the chart's appVersion."
  type        = string
  default     = null
}

variable "east_warm_pool_size" {
  description = "Warm sandboxes kept ready on the east cluster."
  type        = number
  default     = 2
}

variable "west_warm_pool_size" {
  description = "Warm sandboxes kept ready on the west cluster."
  type        = number
  default     = 5
}

variable "allowed_domains" {
  description = "Host names the sandboxes of both clusters may reach."
  type        = list(string)
  default     = ["pypi.org", "*.pythonhosted.org"]
}
