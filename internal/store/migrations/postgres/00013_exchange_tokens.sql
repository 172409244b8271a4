-- Exchange tokens act for users: they mint and revoke user tokens and
-- address no sandbox. api_tokens_kind_check is the name PostgreSQL gave
-- the column's CHECK in the first migration.

-- +goose Up
ALTER TABLE api_tokens DROP CONSTRAINT api_tokens_kind_check;
ALTER TABLE api_tokens ADD CONSTRAINT api_tokens_kind_check CHECK (kind IN ('agent', 'admin', 'staff', 'exchange'));

-- +goose Down
-- Exchange tokens cannot exist under the old constraint: they are dropped,
-- which revokes them.
DELETE FROM api_tokens WHERE kind = 'exchange';
ALTER TABLE api_tokens DROP CONSTRAINT api_tokens_kind_check;
ALTER TABLE api_tokens ADD CONSTRAINT api_tokens_kind_check CHECK (kind IN ('agent', 'admin', 'staff'));
