-- A run's artifacts: the files its command left under its artifact paths,
-- uploaded to the platform's object store once the command ended and
-- before the run's end was written. One row per file found: uploaded
-- (object_key, sha256, uploaded_at set) or not (error says why, such as a
-- file over the size limit). run_artifact_collections says, per run,
-- whether the collection ran and, when the platform keeps no artifacts or
-- the collection failed as a whole, why (message). Both go with their run
-- (ON DELETE CASCADE); retention deletes the objects first.
--
-- run_events gains the type 'artifact': one event per file, written with
-- its row. SQLite cannot change a CHECK constraint, so the table is made
-- again with the new one and its rows copied.

-- +goose Up
CREATE TABLE run_artifacts (
    run_id      TEXT NOT NULL REFERENCES runs (id) ON DELETE CASCADE,
    path        TEXT NOT NULL,
    size        INTEGER NOT NULL CHECK (size >= 0),
    sha256      TEXT NOT NULL DEFAULT '',
    object_key  TEXT NOT NULL DEFAULT '',
    uploaded_at TIMESTAMP,
    error       TEXT NOT NULL DEFAULT '',
    PRIMARY KEY (run_id, path)
);
CREATE TABLE run_artifact_collections (
    run_id      TEXT PRIMARY KEY REFERENCES runs (id) ON DELETE CASCADE,
    state       TEXT NOT NULL CHECK (state IN ('collecting', 'collected', 'not_kept')),
    store       TEXT NOT NULL DEFAULT '',
    prefix      TEXT NOT NULL DEFAULT '',
    message     TEXT NOT NULL DEFAULT '',
    started_at  TIMESTAMP NOT NULL,
    finished_at TIMESTAMP
);
CREATE TABLE run_events_new (
    run_id TEXT NOT NULL REFERENCES runs (id) ON DELETE CASCADE,
    seq    INTEGER NOT NULL CHECK (seq >= 1),
    type   TEXT NOT NULL CHECK (type IN ('state', 'stdout', 'stderr', 'truncated', 'artifact', 'end')),
    data   TEXT NOT NULL,
    at     TIMESTAMP NOT NULL,
    PRIMARY KEY (run_id, seq)
);
INSERT INTO run_events_new (run_id, seq, type, data, at) SELECT run_id, seq, type, data, at FROM run_events;
DROP TABLE run_events;
ALTER TABLE run_events_new RENAME TO run_events;

-- +goose Down
CREATE TABLE run_events_old (
    run_id TEXT NOT NULL REFERENCES runs (id) ON DELETE CASCADE,
    seq    INTEGER NOT NULL CHECK (seq >= 1),
    type   TEXT NOT NULL CHECK (type IN ('state', 'stdout', 'stderr', 'truncated', 'end')),
    data   TEXT NOT NULL,
    at     TIMESTAMP NOT NULL,
    PRIMARY KEY (run_id, seq)
);
INSERT INTO run_events_old (run_id, seq, type, data, at)
    SELECT run_id, seq, type, data, at FROM run_events WHERE type <> 'artifact';
DROP TABLE run_events;
ALTER TABLE run_events_old RENAME TO run_events;
DROP TABLE run_artifact_collections;
DROP TABLE run_artifacts;
