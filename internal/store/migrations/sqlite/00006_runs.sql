-- runs are the records of run-to-completion jobs: a command executed to its
-- end in a sandbox. Every change of state is one conditional UPDATE on its
-- row, so replicas racing to finish, cancel or sweep a run cannot both
-- win. command holds argv, cwd, the timeout and the NAMES of the
-- environment variables, never their values: those may be secrets.

-- +goose Up
CREATE TABLE runs (
    id                  TEXT PRIMARY KEY,
    request_id          TEXT NOT NULL DEFAULT '',
    caller              TEXT NOT NULL,
    holder              TEXT NOT NULL DEFAULT '',
    workflow_id         TEXT NOT NULL DEFAULT '',
    schedule            TEXT NOT NULL DEFAULT '',
    mode                TEXT NOT NULL CHECK (mode IN ('agent', 'pool', 'job')),
    agent_id            TEXT NOT NULL DEFAULT '',
    sandbox             TEXT NOT NULL DEFAULT '',
    template            TEXT NOT NULL DEFAULT '',
    pool                TEXT NOT NULL DEFAULT '',
    command             TEXT NOT NULL,
    status              TEXT NOT NULL CHECK (status IN
                            ('queued', 'running', 'succeeded', 'failed', 'timed_out', 'cancelled')),
    attempts            INTEGER NOT NULL DEFAULT 0 CHECK (attempts >= 0),
    exit_code           INTEGER,
    reason              TEXT NOT NULL DEFAULT '',
    message             TEXT NOT NULL DEFAULT '',
    output_bytes        INTEGER NOT NULL DEFAULT 0 CHECK (output_bytes >= 0),
    cancel_requested_by TEXT NOT NULL DEFAULT '',
    cancelled_by        TEXT NOT NULL DEFAULT '',
    executor            TEXT NOT NULL DEFAULT '',
    created_at          TIMESTAMP NOT NULL,
    started_at          TIMESTAMP,
    finished_at         TIMESTAMP,
    heartbeat_at        TIMESTAMP
);
-- One run per start request of a caller: a retried start gets the run its
-- first try made.
CREATE UNIQUE INDEX runs_request ON runs (caller, request_id) WHERE request_id <> '';
-- Listing is newest first, by (created_at, id), with or without a filter.
CREATE INDEX runs_created ON runs (created_at DESC, id DESC);
CREATE INDEX runs_agent ON runs (agent_id, created_at DESC, id DESC);
CREATE INDEX runs_status ON runs (status, created_at DESC, id DESC);
CREATE INDEX runs_caller ON runs (caller, created_at DESC, id DESC);
-- Retention deletes finished runs by when they finished.
CREATE INDEX runs_finished ON runs (finished_at) WHERE finished_at IS NOT NULL;

-- +goose Down
DROP TABLE runs;
