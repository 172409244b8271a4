# A run schedule is imported by "<namespace>/<name>", or by "<name>" in the provider's namespace.
terraform import agentbox_run_schedule.nightly_report agents/nightly-report
