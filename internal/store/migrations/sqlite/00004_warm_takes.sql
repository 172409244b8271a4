-- warm_takes decides who gets a ready warm sandbox: a pool lease, a new
-- Sandbox adopting it, or the pool retiring it. The primary key admits one
-- taker per sandbox, so the decision is one row insert instead of an
-- optimistic-lock write to the API server; the Kubernetes objects are made
-- to say so right after. A row outlives its sandbox only until the pool's
-- controller notices the sandbox is gone.

-- +goose Up
CREATE TABLE warm_takes (
    sandbox_uid TEXT PRIMARY KEY,
    namespace   TEXT NOT NULL,
    pool        TEXT NOT NULL,
    sandbox     TEXT NOT NULL,
    taker       TEXT NOT NULL CHECK (taker IN ('lease', 'adopt', 'retire')),
    holder      TEXT NOT NULL DEFAULT '',
    request_id  TEXT NOT NULL DEFAULT '',
    lease_id    TEXT NOT NULL DEFAULT '',
    ttl_seconds INTEGER NOT NULL DEFAULT 0 CHECK (ttl_seconds >= 0),
    taken_at    TIMESTAMP NOT NULL
);
CREATE INDEX warm_takes_pool ON warm_takes (namespace, pool);
-- One pool lease per acquire request: two tries of the same acquire racing
-- each other must not take two sandboxes.
CREATE UNIQUE INDEX warm_takes_lease_request ON warm_takes (namespace, pool, holder, request_id)
    WHERE taker = 'lease';

-- +goose Down
DROP TABLE warm_takes;
