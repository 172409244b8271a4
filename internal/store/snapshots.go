package store

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"time"
)

// SnapshotStatus is where a workspace snapshot is in its life.
type SnapshotStatus string

const (
	SnapshotPending SnapshotStatus = "pending"
	SnapshotReady   SnapshotStatus = "ready"
	SnapshotFailed  SnapshotStatus = "failed"
)

// Snapshot records one workspace snapshot taken at idle stop or terminate
// (a workspace snapshot). The controller keeps the last ready one to
// resume from even when a later one fails.
type Snapshot struct {
	ID      string
	AgentID string
	// Name is the VolumeSnapshot's name, or the archive's object key.
	Name string
	// Driver is "csi" or "archive".
	Driver    string
	Status    SnapshotStatus
	SizeBytes int64
	CreatedAt time.Time
	ReadyAt   *time.Time
	// Error says why a failed snapshot failed.
	Error string
}

// PutSnapshot creates a snapshot record or updates its status, size, ready
// time and error. ID and AgentID are required; an empty CreatedAt means now.
// The agent of an existing record never changes.
func (s *Store) PutSnapshot(ctx context.Context, sn Snapshot) (Snapshot, error) {
	if sn.ID == "" || sn.AgentID == "" {
		return Snapshot{}, fmt.Errorf("%w: a snapshot needs an id and an agent id", ErrInvalid)
	}
	switch sn.Status {
	case SnapshotPending, SnapshotReady, SnapshotFailed:
	default:
		return Snapshot{}, fmt.Errorf("%w: snapshot status %q", ErrInvalid, sn.Status)
	}
	for f, v := range map[string]string{"snapshot id": sn.ID, "agent id": sn.AgentID, "name": sn.Name, "driver": sn.Driver, "error": sn.Error} {
		if err := checkText(f, v); err != nil {
			return Snapshot{}, err
		}
	}
	if sn.CreatedAt.IsZero() {
		sn.CreatedAt = s.now()
	}
	sn.CreatedAt = dbTime(sn.CreatedAt)
	res, err := s.wdb.ExecContext(ctx, `INSERT INTO snapshots
		(id, agent_id, name, driver, status, size_bytes, created_at, ready_at, error)
		VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)
		ON CONFLICT (id) DO UPDATE SET
			name = excluded.name, driver = excluded.driver, status = excluded.status,
			size_bytes = excluded.size_bytes, ready_at = excluded.ready_at, error = excluded.error
		WHERE snapshots.agent_id = excluded.agent_id`,
		sn.ID, sn.AgentID, sn.Name, sn.Driver, string(sn.Status), sn.SizeBytes, sn.CreatedAt, nullTime(sn.ReadyAt), sn.Error)
	if err != nil {
		return Snapshot{}, fmt.Errorf("put snapshot: %w", err)
	}
	if n, err := res.RowsAffected(); err != nil {
		return Snapshot{}, fmt.Errorf("put snapshot: %w", err)
	} else if n == 0 {
		return Snapshot{}, fmt.Errorf("%w: snapshot %s belongs to another agent", ErrConflict, sn.ID)
	}
	return s.GetSnapshot(ctx, sn.ID)
}

const snapshotColumns = `id, agent_id, name, driver, status, size_bytes, created_at, ready_at, error`

func scanSnapshot(row interface{ Scan(...any) error }) (Snapshot, error) {
	var (
		sn     Snapshot
		status string
		ready  sql.NullTime
	)
	if err := row.Scan(&sn.ID, &sn.AgentID, &sn.Name, &sn.Driver, &status, &sn.SizeBytes, &sn.CreatedAt, &ready, &sn.Error); err != nil {
		return Snapshot{}, err
	}
	sn.Status, sn.CreatedAt, sn.ReadyAt = SnapshotStatus(status), sn.CreatedAt.UTC(), timePtr(ready)
	return sn, nil
}

// GetSnapshot returns the snapshot with the given ID.
func (s *Store) GetSnapshot(ctx context.Context, id string) (Snapshot, error) {
	sn, err := scanSnapshot(s.db.QueryRowContext(ctx, `SELECT `+snapshotColumns+` FROM snapshots WHERE id = $1`, id))
	if errors.Is(err, sql.ErrNoRows) {
		return Snapshot{}, ErrNotFound
	}
	if err != nil {
		return Snapshot{}, fmt.Errorf("get snapshot: %w", err)
	}
	return sn, nil
}

// LatestSnapshot returns the agent's newest ready snapshot: the one to
// resume from.
func (s *Store) LatestSnapshot(ctx context.Context, agentID string) (Snapshot, error) {
	sn, err := scanSnapshot(s.db.QueryRowContext(ctx, `SELECT `+snapshotColumns+` FROM snapshots
		WHERE agent_id = $1 AND status = 'ready' ORDER BY created_at DESC, id DESC LIMIT 1`, agentID))
	if errors.Is(err, sql.ErrNoRows) {
		return Snapshot{}, ErrNotFound
	}
	if err != nil {
		return Snapshot{}, fmt.Errorf("latest snapshot: %w", err)
	}
	return sn, nil
}

// ListSnapshots lists an agent's snapshots, newest first.
func (s *Store) ListSnapshots(ctx context.Context, agentID string, limit int) ([]Snapshot, error) {
	rows, err := s.db.QueryContext(ctx, `SELECT `+snapshotColumns+` FROM snapshots
		WHERE agent_id = $1 ORDER BY created_at DESC, id DESC LIMIT $2`, agentID, pageSize(limit))
	if err != nil {
		return nil, fmt.Errorf("list snapshots: %w", err)
	}
	defer rows.Close()
	var out []Snapshot
	for rows.Next() {
		sn, err := scanSnapshot(rows)
		if err != nil {
			return nil, fmt.Errorf("list snapshots: %w", err)
		}
		out = append(out, sn)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("list snapshots: %w", err)
	}
	return out, nil
}

// DeleteSnapshot forgets a snapshot record, after its VolumeSnapshot or
// archive was deleted.
func (s *Store) DeleteSnapshot(ctx context.Context, id string) error {
	res, err := s.wdb.ExecContext(ctx, `DELETE FROM snapshots WHERE id = $1`, id)
	if err != nil {
		return fmt.Errorf("delete snapshot: %w", err)
	}
	if n, err := res.RowsAffected(); err != nil {
		return fmt.Errorf("delete snapshot: %w", err)
	} else if n == 0 {
		return ErrNotFound
	}
	return nil
}
