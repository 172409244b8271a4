-- File contents of the agents' filespaces, content-addressed by SHA-256 so
-- that every control-plane replica reads the same bytes and identical files
-- are stored once. A blob is written in chunks, each in its own short
-- transaction, under an upload ID; the filespace_blobs row that names the
-- upload is inserted last, so a blob is visible only once it is whole.

-- +goose Up
CREATE TABLE filespace_blob_chunks (
    upload_id   TEXT NOT NULL,
    seq         INTEGER NOT NULL,
    data        BYTEA NOT NULL,
    created_at  TIMESTAMPTZ NOT NULL,
    PRIMARY KEY (upload_id, seq)
);
CREATE INDEX filespace_blob_chunks_created ON filespace_blob_chunks (created_at);

CREATE TABLE filespace_blobs (
    sha256      TEXT PRIMARY KEY CHECK (length(sha256) = 64),
    upload_id   TEXT NOT NULL UNIQUE,
    size_bytes  BIGINT NOT NULL CHECK (size_bytes >= 0),
    chunks      INTEGER NOT NULL CHECK (chunks >= 0),
    created_at  TIMESTAMPTZ NOT NULL
);

-- +goose Down
DROP TABLE filespace_blobs;
DROP TABLE filespace_blob_chunks;
