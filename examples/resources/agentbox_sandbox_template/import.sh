# A template is imported by "<namespace>/<name>", or by "<name>" in the provider's namespace.
terraform import agentbox_sandbox_template.python agents/python
