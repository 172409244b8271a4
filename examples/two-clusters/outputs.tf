output "api_endpoints" {
  description = "The Compute API of each cluster."
  value = {
    east = module.east.api_endpoint
    west = module.west.api_endpoint
  }
}

output "ca_certificates" {
  description = "The platform CA of each cluster, which signs its Compute API's certificate."
  value = {
    east = module.east.ca_certificate
    west = module.west.ca_certificate
  }
}

output "admin_tokens" {
  description = "The first admin token of each cluster's Compute API."
  value = {
    east = module.east.admin_token
    west = module.west.admin_token
  }
  sensitive = true
}
