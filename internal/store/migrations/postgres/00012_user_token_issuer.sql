-- user_token_keys are the signing keys of the user tokens the Compute API
-- issues (POST /v1/token). They live here because every control plane
-- replica already shares this store and it outlives a restart, so all
-- replicas sign with, and publish, the same keys. Each key signs during
-- [not_before, not_after) and is published until its last token has
-- expired; id is not_before in Unix seconds, so replicas that rotate at
-- once create one key. private_jwk is the key as a JSON Web Key.
--
-- user_token_revocations are the revoked ids (jti) of issued tokens,
-- kept until the token would have expired anyway.

-- +goose Up
CREATE TABLE user_token_keys (
    id          TEXT PRIMARY KEY,
    algorithm   TEXT NOT NULL,
    private_jwk TEXT NOT NULL,
    not_before  TIMESTAMPTZ NOT NULL,
    not_after   TIMESTAMPTZ NOT NULL,
    created_at  TIMESTAMPTZ NOT NULL
);

CREATE TABLE user_token_revocations (
    jti        TEXT PRIMARY KEY,
    expires_at TIMESTAMPTZ NOT NULL,
    revoked_at TIMESTAMPTZ NOT NULL
);

CREATE INDEX user_token_revocations_expires ON user_token_revocations (expires_at);

-- +goose Down
DROP TABLE user_token_revocations;
DROP TABLE user_token_keys;
