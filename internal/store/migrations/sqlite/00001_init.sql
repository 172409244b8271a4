-- The control plane's metadata and audit store, SQLite flavour. Times are
-- declared TIMESTAMP and hold Unix microseconds (the driver converts), so
-- ordering and last-writer-wins comparisons are integer comparisons.

-- +goose Up
CREATE TABLE api_tokens (
    id          TEXT PRIMARY KEY,
    token_hash  BLOB NOT NULL UNIQUE CHECK (length(token_hash) = 32),
    kind        TEXT NOT NULL CHECK (kind IN ('agent', 'admin', 'staff')),
    agent_id    TEXT NOT NULL DEFAULT '',
    subject     TEXT NOT NULL DEFAULT '',
    created_at  TIMESTAMP NOT NULL,
    expires_at  TIMESTAMP,
    revoked_at  TIMESTAMP,
    CHECK ((kind = 'agent') = (agent_id <> ''))
);
CREATE INDEX api_tokens_agent ON api_tokens (agent_id);

CREATE TABLE console_sessions (
    id                   TEXT PRIMARY KEY,
    staff_id             TEXT NOT NULL CHECK (staff_id <> ''),
    agent_id             TEXT NOT NULL CHECK (agent_id <> ''),
    reason               TEXT NOT NULL CHECK (reason <> ''),
    created_at           TIMESTAMP NOT NULL,
    expires_at           TIMESTAMP NOT NULL,
    connected_at         TIMESTAMP,
    disconnected_at      TIMESTAMP,
    snapshot_id          TEXT NOT NULL DEFAULT '',
    transcript           BLOB NOT NULL DEFAULT x'',
    transcript_truncated BOOLEAN NOT NULL DEFAULT 0
);
CREATE INDEX console_sessions_agent ON console_sessions (agent_id, created_at);

CREATE TABLE snapshots (
    id          TEXT PRIMARY KEY,
    agent_id    TEXT NOT NULL,
    name        TEXT NOT NULL DEFAULT '',
    driver      TEXT NOT NULL DEFAULT '',
    status      TEXT NOT NULL CHECK (status IN ('pending', 'ready', 'failed')),
    size_bytes  INTEGER NOT NULL DEFAULT 0,
    created_at  TIMESTAMP NOT NULL,
    ready_at    TIMESTAMP,
    error       TEXT NOT NULL DEFAULT ''
);
CREATE INDEX snapshots_agent ON snapshots (agent_id, created_at);

CREATE TABLE lease_events (
    id          INTEGER PRIMARY KEY,
    lease_id    TEXT NOT NULL,
    agent_id    TEXT NOT NULL,
    holder      TEXT NOT NULL DEFAULT '',
    request_id  TEXT NOT NULL DEFAULT '',
    event       TEXT NOT NULL CHECK (event IN ('acquire', 'heartbeat', 'release', 'expire')),
    at          TIMESTAMP NOT NULL,
    expires_at  TIMESTAMP
);
CREATE INDEX lease_events_agent ON lease_events (agent_id, id);
CREATE INDEX lease_events_lease ON lease_events (lease_id, id);
CREATE UNIQUE INDEX lease_events_acquire_request ON lease_events (agent_id, request_id)
    WHERE event = 'acquire' AND request_id <> '';

-- audit_head is the chain's single lock point and its tip: an append reads
-- and updates it in the same write transaction as the insert.
CREATE TABLE audit_head (
    id    INTEGER PRIMARY KEY CHECK (id = 1),
    seq   INTEGER NOT NULL,
    hash  BLOB NOT NULL
);
INSERT INTO audit_head (id, seq, hash) VALUES (1, 0, zeroblob(32));

CREATE TABLE audit_log (
    seq          INTEGER PRIMARY KEY,
    at           TIMESTAMP NOT NULL,
    caller       TEXT NOT NULL,
    caller_kind  TEXT NOT NULL DEFAULT '',
    agent_id     TEXT NOT NULL DEFAULT '',
    operation    TEXT NOT NULL,
    params_hash  TEXT NOT NULL DEFAULT '',
    duration_ns  INTEGER NOT NULL DEFAULT 0,
    result       TEXT NOT NULL DEFAULT '',
    status       INTEGER NOT NULL DEFAULT 0,
    request_id   TEXT NOT NULL DEFAULT '',
    detail       TEXT NOT NULL DEFAULT '',
    prev_hash    BLOB NOT NULL,
    hash         BLOB NOT NULL
);
CREATE INDEX audit_log_agent ON audit_log (agent_id, seq);
CREATE INDEX audit_log_caller ON audit_log (caller, seq);
CREATE INDEX audit_log_operation ON audit_log (operation, seq);
CREATE INDEX audit_log_at ON audit_log (at);

-- The hash chain makes tampering visible; these triggers make accidental
-- rewrites by the application impossible.
-- +goose StatementBegin
CREATE TRIGGER audit_log_no_update BEFORE UPDATE ON audit_log
BEGIN
    SELECT RAISE(ABORT, 'audit_log is append-only');
END;
-- +goose StatementEnd
-- +goose StatementBegin
CREATE TRIGGER audit_log_no_delete BEFORE DELETE ON audit_log
BEGIN
    SELECT RAISE(ABORT, 'audit_log is append-only');
END;
-- +goose StatementEnd

CREATE TABLE tool_catalogs (
    config_hash   TEXT PRIMARY KEY,
    server_name   TEXT NOT NULL DEFAULT '',
    tools         TEXT NOT NULL,
    refreshed_at  TIMESTAMP NOT NULL
);

CREATE TABLE filespace_nodes (
    agent_id    TEXT NOT NULL,
    path        TEXT NOT NULL,
    size_bytes  INTEGER NOT NULL DEFAULT 0,
    sha256      TEXT NOT NULL DEFAULT '',
    updated_at  TIMESTAMP NOT NULL,
    deleted     BOOLEAN NOT NULL DEFAULT 0,
    PRIMARY KEY (agent_id, path)
);
CREATE INDEX filespace_nodes_updated ON filespace_nodes (agent_id, updated_at);

-- +goose Down
DROP TABLE filespace_nodes;
DROP TABLE tool_catalogs;
DROP TABLE audit_log;
DROP TABLE audit_head;
DROP TABLE lease_events;
DROP TABLE snapshots;
DROP TABLE console_sessions;
DROP TABLE api_tokens;
