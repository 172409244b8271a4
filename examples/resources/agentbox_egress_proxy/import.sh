# An egress proxy is imported by "<namespace>/<name>", or by "<name>" in the provider's namespace.
# Write-only credentials cannot be imported: after the import, the first apply writes
# upstream_credentials_wo into the proxy's Secret.
terraform import agentbox_egress_proxy.python agents/python
