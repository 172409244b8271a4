# A sandbox is imported by "<namespace>/<name>", or by "<name>" in the provider's namespace.
terraform import agentbox_sandbox.alice agents/alice
