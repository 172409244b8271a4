# An egress proxy is imported by "<namespace>/<name>", or by "<name>" in the provider's namespace.
# Write-only credentials cannot be imported: after the import, the first apply writes
# upstream_credentials_wo into the proxy's Secret, and every credentials[].value_wo
# (imported with a null value_wo_version) into the Secret <name>-egress-injected.
terraform import agentbox_egress_proxy.python agents/python
