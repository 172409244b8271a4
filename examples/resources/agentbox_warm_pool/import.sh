# A warm pool is imported by "<namespace>/<name>", or by "<name>" in the provider's namespace.
terraform import agentbox_warm_pool.python agents/python
