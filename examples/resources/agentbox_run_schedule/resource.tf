# Every weekday at 03:00 Berlin time, run the agent's report in its own
# sandbox. A run still going at the next time makes that time skip
# (Forbid, the default); a time missed by more than ten minutes (the
# control plane was down) is skipped rather than run late.
resource "agentbox_run_schedule" "nightly_report" {
  name      = "nightly-report"
  namespace = "agents"
  schedule  = "0 3 * * 1-5"
  time_zone = "Europe/Berlin"

  agent_id        = agentbox_sandbox.reporter.agent_id
  command         = ["sh", "-c", "make report"]
  env             = { REPORT_MODE = "full" }
  timeout_seconds = 1800

  concurrency_policy        = "Forbid"
  starting_deadline_seconds = 600

  # The store keeps the records of the last 7 succeeded runs and the last
  # 3 that did not succeed.
  successful_runs_history_limit = 7
  failed_runs_history_limit     = 3
}

resource "agentbox_sandbox" "reporter" {
  name      = "reporter"
  namespace = "agents"
  agent_id  = "reporter"
  template  = "python"
}

# Every hour, run a clean-up as a job: each run gets a sandbox of its own,
# made from the template and deleted after, with one retry of a failed
# attempt and at most 20 minutes in all; its record is kept for a day.
resource "agentbox_run_schedule" "hourly_cleanup" {
  name      = "hourly-cleanup"
  namespace = "agents"
  schedule  = "@hourly"

  template                   = "python"
  backoff_limit              = 1
  active_deadline_seconds    = 1200
  ttl_seconds_after_finished = 86400
  command                    = ["python", "-m", "cleanup"]
}
