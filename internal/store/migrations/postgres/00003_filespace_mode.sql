-- The permission bits of a filespace file (0755 for a script, say), so that
-- a pull restores them along with the content. 0: not recorded (nodes
-- written before this migration); a pull then keeps the workspace's mode.

-- +goose Up
ALTER TABLE filespace_nodes ADD COLUMN mode INTEGER NOT NULL DEFAULT 0 CHECK (mode >= 0 AND mode <= 511);

-- +goose Down
ALTER TABLE filespace_nodes DROP COLUMN mode;
