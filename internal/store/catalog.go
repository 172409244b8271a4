package store

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"time"
)

// ToolCatalog is the cached tool list of one MCP server configuration
// (the MCP tool catalog). It is keyed by a hash of the server's configuration, so a
// changed configuration misses the cache and is discovered afresh, and
// listing tools never has to wake an idle sandbox.
type ToolCatalog struct {
	// ConfigHash identifies the MCP server configuration (the caller's
	// hash of its canonical form).
	ConfigHash string
	// ServerName is informational: the configuration's server name.
	ServerName string
	// Tools is the server's tools/list result, stored verbatim.
	Tools       json.RawMessage
	RefreshedAt time.Time
}

// PutToolCatalog stores or replaces the catalog for a configuration hash.
// An empty RefreshedAt means now.
func (s *Store) PutToolCatalog(ctx context.Context, c ToolCatalog) (ToolCatalog, error) {
	if c.ConfigHash == "" {
		return ToolCatalog{}, fmt.Errorf("%w: a tool catalog needs a config hash", ErrInvalid)
	}
	if !json.Valid(c.Tools) {
		return ToolCatalog{}, fmt.Errorf("%w: tool catalog of %s is not JSON", ErrInvalid, c.ConfigHash)
	}
	for f, v := range map[string]string{"config hash": c.ConfigHash, "server name": c.ServerName, "tools": string(c.Tools)} {
		if err := checkText(f, v); err != nil {
			return ToolCatalog{}, err
		}
	}
	if c.RefreshedAt.IsZero() {
		c.RefreshedAt = s.now()
	}
	c.RefreshedAt = dbTime(c.RefreshedAt)
	_, err := s.wdb.ExecContext(ctx, `INSERT INTO tool_catalogs (config_hash, server_name, tools, refreshed_at)
		VALUES ($1, $2, $3, $4)
		ON CONFLICT (config_hash) DO UPDATE SET
			server_name = excluded.server_name, tools = excluded.tools, refreshed_at = excluded.refreshed_at`,
		c.ConfigHash, c.ServerName, string(c.Tools), c.RefreshedAt)
	if err != nil {
		return ToolCatalog{}, fmt.Errorf("put tool catalog: %w", err)
	}
	return c, nil
}

// GetToolCatalog returns the cached catalog for a configuration hash, or
// ErrNotFound when that configuration was never discovered.
func (s *Store) GetToolCatalog(ctx context.Context, configHash string) (ToolCatalog, error) {
	var (
		c     ToolCatalog
		tools string
	)
	err := s.db.QueryRowContext(ctx, `SELECT config_hash, server_name, tools, refreshed_at
		FROM tool_catalogs WHERE config_hash = $1`, configHash).Scan(&c.ConfigHash, &c.ServerName, &tools, &c.RefreshedAt)
	if errors.Is(err, sql.ErrNoRows) {
		return ToolCatalog{}, ErrNotFound
	}
	if err != nil {
		return ToolCatalog{}, fmt.Errorf("get tool catalog: %w", err)
	}
	c.Tools, c.RefreshedAt = json.RawMessage(tools), c.RefreshedAt.UTC()
	return c, nil
}

// DeleteToolCatalog drops a cached catalog, so that the next listing
// discovers it again (an explicit refresh).
func (s *Store) DeleteToolCatalog(ctx context.Context, configHash string) error {
	if _, err := s.wdb.ExecContext(ctx, `DELETE FROM tool_catalogs WHERE config_hash = $1`, configHash); err != nil {
		return fmt.Errorf("delete tool catalog: %w", err)
	}
	return nil
}
