-- run_events are what a run's followers read: its changes of state, the
-- lines of its output (redacted by the executor), and its end, in the order
-- they happened. seq numbers a run's events from 1 up, with no gaps; it is
-- assigned under the lock on the run's row, so two replicas appending to
-- one run cannot take the same number, and it is the id a follower resumes
-- from. The events go with their run (ON DELETE CASCADE), so retention
-- deletes them too.

-- +goose Up
CREATE TABLE run_events (
    run_id TEXT NOT NULL REFERENCES runs (id) ON DELETE CASCADE,
    seq    INTEGER NOT NULL CHECK (seq >= 1),
    type   TEXT NOT NULL CHECK (type IN ('state', 'stdout', 'stderr', 'truncated', 'end')),
    data   TEXT NOT NULL,
    at     TIMESTAMP NOT NULL,
    PRIMARY KEY (run_id, seq)
);

-- +goose Down
DROP TABLE run_events;
