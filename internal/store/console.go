package store

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strings"
	"time"
)

// ConsoleSession is a staff member's time-boxed console access to one
// agent's sandbox (seed 000's staff console). It is minted with a reason,
// connected at most once, and keeps a truncated transcript.
type ConsoleSession struct {
	ID      string
	StaffID string
	AgentID string
	// Reason is required: every access must say why.
	Reason    string
	CreatedAt time.Time
	ExpiresAt time.Time
	// ConnectedAt and DisconnectedAt are set when the PTY opens and closes.
	ConnectedAt    *time.Time
	DisconnectedAt *time.Time
	// SnapshotID is the sandbox's latest snapshot when the console
	// connected, so an investigation can tell what state staff saw.
	SnapshotID string
	// Transcript is the command stream and output, up to the store's cap.
	Transcript          []byte
	TranscriptTruncated bool
}

// Expired reports whether the session may no longer be used at now.
func (c ConsoleSession) Expired(now time.Time) bool { return !now.Before(c.ExpiresAt) }

// CreateConsoleSession mints a console session lasting ttl from now. Staff
// id, agent id and a non-blank reason are required.
func (s *Store) CreateConsoleSession(ctx context.Context, staffID, agentID, reason string, ttl time.Duration) (ConsoleSession, error) {
	if staffID == "" || agentID == "" || strings.TrimSpace(reason) == "" {
		return ConsoleSession{}, fmt.Errorf("%w: a console session needs a staff id, an agent id and a reason", ErrInvalid)
	}
	if ttl <= 0 {
		return ConsoleSession{}, fmt.Errorf("%w: console session lifetime %s", ErrInvalid, ttl)
	}
	for f, v := range map[string]string{"staff id": staffID, "agent id": agentID, "reason": reason} {
		if err := checkText(f, v); err != nil {
			return ConsoleSession{}, err
		}
	}
	now := s.now()
	c := ConsoleSession{
		ID: newID(), StaffID: staffID, AgentID: agentID, Reason: reason,
		CreatedAt: now, ExpiresAt: dbTime(now.Add(ttl)), Transcript: []byte{},
	}
	_, err := s.wdb.ExecContext(ctx, `INSERT INTO console_sessions
		(id, staff_id, agent_id, reason, created_at, expires_at) VALUES ($1, $2, $3, $4, $5, $6)`,
		c.ID, c.StaffID, c.AgentID, c.Reason, c.CreatedAt, c.ExpiresAt)
	if err != nil {
		return ConsoleSession{}, fmt.Errorf("create console session: %w", err)
	}
	return c, nil
}

const consoleColumns = `id, staff_id, agent_id, reason, created_at, expires_at,
	connected_at, disconnected_at, snapshot_id, transcript, transcript_truncated`

func scanConsole(row interface{ Scan(...any) error }) (ConsoleSession, error) {
	var (
		c          ConsoleSession
		conn, disc sql.NullTime
	)
	if err := row.Scan(&c.ID, &c.StaffID, &c.AgentID, &c.Reason, &c.CreatedAt, &c.ExpiresAt,
		&conn, &disc, &c.SnapshotID, &c.Transcript, &c.TranscriptTruncated); err != nil {
		return ConsoleSession{}, err
	}
	c.CreatedAt, c.ExpiresAt = c.CreatedAt.UTC(), c.ExpiresAt.UTC()
	c.ConnectedAt, c.DisconnectedAt = timePtr(conn), timePtr(disc)
	if c.Transcript == nil {
		c.Transcript = []byte{}
	}
	return c, nil
}

// GetConsoleSession returns a session whatever its state.
func (s *Store) GetConsoleSession(ctx context.Context, id string) (ConsoleSession, error) {
	return getConsole(ctx, s.db, id)
}

func getConsole(ctx context.Context, q interface {
	QueryRowContext(context.Context, string, ...any) *sql.Row
}, id string) (ConsoleSession, error) {
	c, err := scanConsole(q.QueryRowContext(ctx, `SELECT `+consoleColumns+` FROM console_sessions WHERE id = $1`, id))
	if errors.Is(err, sql.ErrNoRows) {
		return ConsoleSession{}, ErrNotFound
	}
	if err != nil {
		return ConsoleSession{}, fmt.Errorf("get console session: %w", err)
	}
	return c, nil
}

// ConnectConsoleSession marks the session connected now and records the
// snapshot the sandbox was at. It fails with ErrExpired after the session's
// expiry and ErrConflict if it was connected before: a session opens one
// PTY, and a new one needs a new session with its own reason.
func (s *Store) ConnectConsoleSession(ctx context.Context, id, snapshotID string) (ConsoleSession, error) {
	if err := checkText("snapshot id", snapshotID); err != nil {
		return ConsoleSession{}, err
	}
	var c ConsoleSession
	err := s.writeTx(ctx, func(tx *sql.Tx) error {
		var err error
		if c, err = getConsole(ctx, tx, id); err != nil {
			return err
		}
		now := s.now()
		if c.Expired(now) {
			return ErrExpired
		}
		if c.ConnectedAt != nil {
			return fmt.Errorf("%w: console session %s was already connected", ErrConflict, id)
		}
		// The WHERE repeats the check so that, on PostgreSQL, of two
		// replicas racing to connect only one succeeds.
		res, err := tx.ExecContext(ctx, `UPDATE console_sessions SET connected_at = $2, snapshot_id = $3
			WHERE id = $1 AND connected_at IS NULL`, id, now, snapshotID)
		if err != nil {
			return fmt.Errorf("connect console session: %w", err)
		}
		if n, err := res.RowsAffected(); err != nil {
			return fmt.Errorf("connect console session: %w", err)
		} else if n == 0 {
			return fmt.Errorf("%w: console session %s was already connected", ErrConflict, id)
		}
		c.ConnectedAt, c.SnapshotID = &now, snapshotID
		return nil
	})
	if err != nil {
		return ConsoleSession{}, err
	}
	return c, nil
}

// DisconnectConsoleSession records when the console closed. Only the first
// disconnect counts; the session cannot be used again either way.
func (s *Store) DisconnectConsoleSession(ctx context.Context, id string) (ConsoleSession, error) {
	var c ConsoleSession
	err := s.writeTx(ctx, func(tx *sql.Tx) error {
		if _, err := tx.ExecContext(ctx, `UPDATE console_sessions SET disconnected_at = $2
			WHERE id = $1 AND disconnected_at IS NULL`, id, s.now()); err != nil {
			return fmt.Errorf("disconnect console session: %w", err)
		}
		var err error
		c, err = getConsole(ctx, tx, id)
		return err
	})
	if err != nil {
		return ConsoleSession{}, err
	}
	return c, nil
}

// AppendConsoleTranscript adds a chunk of the command stream or output to
// the session's transcript. Past the store's cap the rest is dropped and
// the session is marked truncated; the chunk is never an error.
func (s *Store) AppendConsoleTranscript(ctx context.Context, id string, chunk []byte) error {
	return s.writeTx(ctx, func(tx *sql.Tx) error {
		var (
			cur       []byte
			truncated bool
		)
		err := tx.QueryRowContext(ctx, `SELECT transcript, transcript_truncated FROM console_sessions
			WHERE id = $1`+s.dialect.forUpdate(), id).Scan(&cur, &truncated)
		if errors.Is(err, sql.ErrNoRows) {
			return ErrNotFound
		}
		if err != nil {
			return fmt.Errorf("append console transcript: %w", err)
		}
		if truncated || len(chunk) == 0 {
			return nil
		}
		room := s.opts.MaxTranscript - len(cur)
		if len(chunk) > room {
			chunk, truncated = chunk[:max(room, 0)], true
		}
		next := append(cur, chunk...)
		if next == nil {
			next = []byte{}
		}
		if _, err := tx.ExecContext(ctx, `UPDATE console_sessions SET transcript = $2, transcript_truncated = $3
			WHERE id = $1`, id, next, truncated); err != nil {
			return fmt.Errorf("append console transcript: %w", err)
		}
		return nil
	})
}

// ListConsoleSessions lists an agent's console sessions, newest first, or
// every agent's when agentID is empty.
func (s *Store) ListConsoleSessions(ctx context.Context, agentID string, limit int) ([]ConsoleSession, error) {
	var w where
	if agentID != "" {
		w.add(`agent_id = %s`, agentID)
	}
	rows, err := s.db.QueryContext(ctx, `SELECT `+consoleColumns+` FROM console_sessions`+w.String()+
		` ORDER BY created_at DESC, id LIMIT `+w.arg(pageSize(limit)), w.args...)
	if err != nil {
		return nil, fmt.Errorf("list console sessions: %w", err)
	}
	defer rows.Close()
	var out []ConsoleSession
	for rows.Next() {
		c, err := scanConsole(rows)
		if err != nil {
			return nil, fmt.Errorf("list console sessions: %w", err)
		}
		out = append(out, c)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("list console sessions: %w", err)
	}
	return out, nil
}

// pageSize bounds a caller's page size to 1..1000, 100 by default.
func pageSize(limit int) int {
	switch {
	case limit <= 0:
		return 100
	case limit > 1000:
		return 1000
	}
	return limit
}
