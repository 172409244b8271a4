terraform {
  # optional() attributes with defaults in object variables.
  required_version = ">= 1.5"

  required_providers {
    agentbox = {
      source = "agentbox/agentbox"
    }
  }
}
