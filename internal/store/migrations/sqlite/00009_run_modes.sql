-- Pool and job runs. A job run retries a failed attempt up to
-- backoff_limit times, all within active_deadline_seconds of its creation
-- (0: no deadline). ttl_seconds_after_finished, when set, replaces the
-- platform's retention for the run: expires_at is set to its end plus the
-- TTL when it ends, and the record goes then. Every attempt of a run, in
-- any mode, is a row of run_attempts: opened when it starts, closed when
-- it ends (by the executor, by the run's end, or by the sweeper); the
-- rows go with their run.

-- +goose Up
ALTER TABLE runs ADD COLUMN backoff_limit INTEGER NOT NULL DEFAULT 0 CHECK (backoff_limit >= 0);
ALTER TABLE runs ADD COLUMN active_deadline_seconds INTEGER NOT NULL DEFAULT 0 CHECK (active_deadline_seconds >= 0);
ALTER TABLE runs ADD COLUMN ttl_seconds_after_finished INTEGER CHECK (ttl_seconds_after_finished >= 0);
ALTER TABLE runs ADD COLUMN expires_at TIMESTAMP;
CREATE INDEX runs_expires ON runs (expires_at) WHERE expires_at IS NOT NULL;

CREATE TABLE run_attempts (
    run_id       TEXT NOT NULL REFERENCES runs (id) ON DELETE CASCADE,
    attempt      INTEGER NOT NULL CHECK (attempt >= 1),
    sandbox      TEXT NOT NULL DEFAULT '',
    status       TEXT NOT NULL CHECK (status IN ('running', 'succeeded', 'failed', 'timed_out', 'cancelled')),
    exit_code    INTEGER,
    reason       TEXT NOT NULL DEFAULT '',
    message      TEXT NOT NULL DEFAULT '',
    output_bytes INTEGER NOT NULL DEFAULT 0 CHECK (output_bytes >= 0),
    started_at   TIMESTAMP NOT NULL,
    finished_at  TIMESTAMP,
    PRIMARY KEY (run_id, attempt)
);

-- +goose Down
DROP TABLE run_attempts;
DROP INDEX runs_expires;
ALTER TABLE runs DROP COLUMN expires_at;
ALTER TABLE runs DROP COLUMN ttl_seconds_after_finished;
ALTER TABLE runs DROP COLUMN active_deadline_seconds;
ALTER TABLE runs DROP COLUMN backoff_limit;
