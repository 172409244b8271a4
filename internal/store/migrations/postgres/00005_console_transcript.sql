-- A staff console session's transcript in both directions: what the staff
-- member typed (in) and what the terminal showed (out), in the order they
-- were recorded, each record with the time it was. It takes over from
-- console_sessions.transcript, which held the output alone and is still
-- read for sessions recorded before this migration; console_sessions'
-- transcript_truncated covers both.

-- +goose Up
CREATE TABLE console_transcript (
    session_id TEXT NOT NULL REFERENCES console_sessions (id) ON DELETE CASCADE,
    seq        BIGINT NOT NULL CHECK (seq >= 1),
    direction  TEXT NOT NULL CHECK (direction IN ('in', 'out')),
    at         TIMESTAMPTZ NOT NULL,
    data       BYTEA NOT NULL,
    PRIMARY KEY (session_id, seq)
);

-- +goose Down
DROP TABLE console_transcript;
