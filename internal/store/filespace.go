package store

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"io/fs"
	"time"
)

// FileNode is the metadata of one path in an agent's filespace (the
// AgentFsNode). UpdatedAt is the last-writer-wins clock: a write or a
// deletion replaces the stored node only if it is strictly newer, so an
// older write never overwrites a newer one and a deletion only takes
// effect when it is newer than the file. Deletions are kept as tombstones
// so that an older write cannot bring a deleted file back.
type FileNode struct {
	AgentID   string
	Path      string
	SizeBytes int64
	// SHA256 is the hex digest of the content.
	SHA256    string
	UpdatedAt time.Time
	Deleted   bool
	// Mode holds the file's permission bits (0o777 at most); zero means
	// not recorded.
	Mode fs.FileMode
}

// PutFiles applies a batch of writes and deletions to an agent's filespace
// in one transaction, last writer wins. applied[i] reports whether files[i]
// replaced what was stored (false: the stored node was as new or newer).
// Every file must belong to agentID and carry an UpdatedAt.
func (s *Store) PutFiles(ctx context.Context, agentID string, files []FileNode) (applied []bool, err error) {
	if agentID == "" {
		return nil, fmt.Errorf("%w: filespace agent id is empty", ErrInvalid)
	}
	for i, f := range files {
		if f.AgentID != agentID || f.Path == "" || f.UpdatedAt.IsZero() || f.SizeBytes < 0 {
			return nil, fmt.Errorf("%w: file %d (%q) needs agent %s, a path, a size and an UpdatedAt", ErrInvalid, i, f.Path, agentID)
		}
		if f.Mode&^fs.ModePerm != 0 {
			return nil, fmt.Errorf("%w: file %d (%q) has mode %v; only permission bits are kept", ErrInvalid, i, f.Path, f.Mode)
		}
		if err := checkText("path", f.Path); err != nil {
			return nil, err
		}
		if err := checkText("sha256", f.SHA256); err != nil {
			return nil, err
		}
	}
	applied = make([]bool, len(files))
	err = s.writeTx(ctx, func(tx *sql.Tx) error {
		stmt, err := tx.PrepareContext(ctx, `INSERT INTO filespace_nodes
			(agent_id, path, size_bytes, sha256, updated_at, deleted, mode) VALUES ($1, $2, $3, $4, $5, $6, $7)
			ON CONFLICT (agent_id, path) DO UPDATE SET
				size_bytes = excluded.size_bytes, sha256 = excluded.sha256,
				updated_at = excluded.updated_at, deleted = excluded.deleted, mode = excluded.mode
			WHERE excluded.updated_at > filespace_nodes.updated_at`)
		if err != nil {
			return fmt.Errorf("put files: %w", err)
		}
		defer stmt.Close()
		for i, f := range files {
			size, sum, mode := f.SizeBytes, f.SHA256, int64(f.Mode)
			if f.Deleted {
				size, sum, mode = 0, "", 0
			}
			res, err := stmt.ExecContext(ctx, agentID, f.Path, size, sum, dbTime(f.UpdatedAt), f.Deleted, mode)
			if err != nil {
				return fmt.Errorf("put file %q: %w", f.Path, err)
			}
			n, err := res.RowsAffected()
			if err != nil {
				return fmt.Errorf("put file %q: %w", f.Path, err)
			}
			applied[i] = n > 0
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	return applied, nil
}

// PutFile applies one write or deletion; see PutFiles.
func (s *Store) PutFile(ctx context.Context, f FileNode) (bool, error) {
	applied, err := s.PutFiles(ctx, f.AgentID, []FileNode{f})
	if err != nil {
		return false, err
	}
	return applied[0], nil
}

const fileColumns = `agent_id, path, size_bytes, sha256, updated_at, deleted, mode`

func scanFile(row interface{ Scan(...any) error }) (FileNode, error) {
	var f FileNode
	var mode int64
	if err := row.Scan(&f.AgentID, &f.Path, &f.SizeBytes, &f.SHA256, &f.UpdatedAt, &f.Deleted, &mode); err != nil {
		return FileNode{}, err
	}
	f.Mode = fs.FileMode(mode)
	f.UpdatedAt = f.UpdatedAt.UTC()
	return f, nil
}

// GetFile returns the node stored for a path, tombstones included.
func (s *Store) GetFile(ctx context.Context, agentID, path string) (FileNode, error) {
	f, err := scanFile(s.db.QueryRowContext(ctx, `SELECT `+fileColumns+` FROM filespace_nodes
		WHERE agent_id = $1 AND path = $2`, agentID, path))
	if errors.Is(err, sql.ErrNoRows) {
		return FileNode{}, ErrNotFound
	}
	if err != nil {
		return FileNode{}, fmt.Errorf("get file: %w", err)
	}
	return f, nil
}

// FileQuery selects an agent's filespace nodes for a pull.
type FileQuery struct {
	// ChangedAfter, when set, keeps only nodes updated strictly after it.
	ChangedAfter time.Time
	// IncludeDeleted lists tombstones too, which a pull needs to delete.
	IncludeDeleted bool
	// AfterPath pages: pass the last path of the previous page. Paths sort
	// by their bytes.
	AfterPath string
	Limit     int
}

// ListFiles lists an agent's filespace nodes in path order.
func (s *Store) ListFiles(ctx context.Context, agentID string, q FileQuery) ([]FileNode, error) {
	var w where
	w.add(`agent_id = %s`, agentID)
	if q.AfterPath != "" {
		w.add(`path > %s`, q.AfterPath)
	}
	if !q.IncludeDeleted {
		w.add(`NOT deleted`)
	}
	if !q.ChangedAfter.IsZero() {
		w.add(`updated_at > %s`, dbTime(q.ChangedAfter))
	}
	rows, err := s.db.QueryContext(ctx, `SELECT `+fileColumns+` FROM filespace_nodes`+w.String()+
		` ORDER BY path LIMIT `+w.arg(pageSize(q.Limit)), w.args...)
	if err != nil {
		return nil, fmt.Errorf("list files: %w", err)
	}
	defer rows.Close()
	var out []FileNode
	for rows.Next() {
		f, err := scanFile(rows)
		if err != nil {
			return nil, fmt.Errorf("list files: %w", err)
		}
		out = append(out, f)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("list files: %w", err)
	}
	return out, nil
}

// FilespaceUsage returns the number and total size of an agent's live
// files, for enforcing the workspace cap before a sync.
func (s *Store) FilespaceUsage(ctx context.Context, agentID string) (files, bytes int64, err error) {
	err = s.db.QueryRowContext(ctx, `SELECT COUNT(*), CAST(COALESCE(SUM(size_bytes), 0) AS BIGINT)
		FROM filespace_nodes WHERE agent_id = $1 AND NOT deleted`, agentID).Scan(&files, &bytes)
	if err != nil {
		return 0, 0, fmt.Errorf("filespace usage: %w", err)
	}
	return files, bytes, nil
}

// PurgeTombstones forgets deletions older than before, once every
// workspace has pulled them, and returns how many it removed.
func (s *Store) PurgeTombstones(ctx context.Context, agentID string, before time.Time) (int64, error) {
	res, err := s.wdb.ExecContext(ctx, `DELETE FROM filespace_nodes WHERE agent_id = $1 AND deleted AND updated_at < $2`,
		agentID, dbTime(before))
	if err != nil {
		return 0, fmt.Errorf("purge tombstones: %w", err)
	}
	n, err := res.RowsAffected()
	if err != nil {
		return 0, fmt.Errorf("purge tombstones: %w", err)
	}
	return n, nil
}
