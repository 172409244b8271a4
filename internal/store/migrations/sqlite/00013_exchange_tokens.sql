-- Exchange tokens act for users: they mint and revoke user tokens and
-- address no sandbox. SQLite cannot alter a CHECK constraint, so the table
-- is rebuilt with the new kind allowed (nothing references it).

-- +goose Up
CREATE TABLE api_tokens_new (
    id          TEXT PRIMARY KEY,
    token_hash  BLOB NOT NULL UNIQUE CHECK (length(token_hash) = 32),
    kind        TEXT NOT NULL CHECK (kind IN ('agent', 'admin', 'staff', 'exchange')),
    agent_id    TEXT NOT NULL DEFAULT '',
    subject     TEXT NOT NULL DEFAULT '',
    created_at  TIMESTAMP NOT NULL,
    expires_at  TIMESTAMP,
    revoked_at  TIMESTAMP,
    CHECK ((kind = 'agent') = (agent_id <> ''))
);
INSERT INTO api_tokens_new SELECT id, token_hash, kind, agent_id, subject, created_at, expires_at, revoked_at FROM api_tokens;
DROP TABLE api_tokens;
ALTER TABLE api_tokens_new RENAME TO api_tokens;
CREATE INDEX api_tokens_agent ON api_tokens (agent_id);

-- +goose Down
-- Exchange tokens cannot exist under the old constraint: they are dropped,
-- which revokes them.
CREATE TABLE api_tokens_old (
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
INSERT INTO api_tokens_old SELECT id, token_hash, kind, agent_id, subject, created_at, expires_at, revoked_at FROM api_tokens WHERE kind <> 'exchange';
DROP TABLE api_tokens;
ALTER TABLE api_tokens_old RENAME TO api_tokens;
CREATE INDEX api_tokens_agent ON api_tokens (agent_id);
