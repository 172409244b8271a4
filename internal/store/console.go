package store

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/agentbox/terraform-provider-agentbox/internal/redact"
)

// ConsoleSession is a staff member's time-boxed console access to one
// agent's sandbox (the staff console). It is minted with a reason,
// connected at most once, and keeps a truncated transcript of both
// directions.
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
	// Transcript is what the terminal showed (its output records, after
	// the output kept by sessions recorded before records had
	// directions), up to the store's cap.
	Transcript []byte
	// Records are the transcript in both directions, in the order they
	// were recorded. GetConsoleSession fills them in; lists do not.
	Records []TranscriptRecord
	// TranscriptTruncated says the cap was reached and later records
	// were dropped.
	TranscriptTruncated bool
}

// TranscriptDirection says which way a transcript record's bytes went.
type TranscriptDirection string

const (
	// TranscriptInput is what the staff member typed.
	TranscriptInput TranscriptDirection = "in"
	// TranscriptOutput is what the terminal showed, echoes of what was
	// typed included.
	TranscriptOutput TranscriptDirection = "out"
)

// TranscriptRecord is a run of a console session's terminal bytes in one
// direction.
type TranscriptRecord struct {
	Direction TranscriptDirection
	// At is when the record was written; zero means the append's time.
	At   time.Time
	Data []byte
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
	// The reason is free text, and staff paste into it what they paste
	// anywhere.
	reason = redact.String(reason)
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

// GetConsoleSession returns a session whatever its state, with its
// transcript records.
func (s *Store) GetConsoleSession(ctx context.Context, id string) (ConsoleSession, error) {
	c, err := getConsole(ctx, s.db, id)
	if err != nil {
		return ConsoleSession{}, err
	}
	rows, err := s.db.QueryContext(ctx, `SELECT direction, at, data FROM console_transcript
		WHERE session_id = $1 ORDER BY seq`, id)
	if err != nil {
		return ConsoleSession{}, fmt.Errorf("get console transcript: %w", err)
	}
	defer rows.Close()
	for rows.Next() {
		var r TranscriptRecord
		var dir string
		if err := rows.Scan(&dir, &r.At, &r.Data); err != nil {
			return ConsoleSession{}, fmt.Errorf("get console transcript: %w", err)
		}
		r.Direction, r.At = TranscriptDirection(dir), r.At.UTC()
		if r.Data == nil {
			r.Data = []byte{}
		}
		c.Records = append(c.Records, r)
		if r.Direction == TranscriptOutput {
			c.Transcript = append(c.Transcript, r.Data...)
		}
	}
	if err := rows.Err(); err != nil {
		return ConsoleSession{}, fmt.Errorf("get console transcript: %w", err)
	}
	return c, nil
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

// AppendConsoleTranscript adds records to the session's transcript, in
// order. Known secret formats are redacted from each record (see package
// redact); a caller that cuts one stream into records redacts it with a
// redact.Stream first, so that a secret cut in two is caught too. Past the
// store's cap the rest is dropped and the session is marked truncated;
// that is never an error.
func (s *Store) AppendConsoleTranscript(ctx context.Context, id string, records ...TranscriptRecord) error {
	for _, r := range records {
		if r.Direction != TranscriptInput && r.Direction != TranscriptOutput {
			return fmt.Errorf("%w: transcript direction %q", ErrInvalid, r.Direction)
		}
	}
	return s.writeTx(ctx, func(tx *sql.Tx) error {
		var (
			legacy    []byte
			truncated bool
		)
		err := tx.QueryRowContext(ctx, `SELECT transcript, transcript_truncated FROM console_sessions
			WHERE id = $1`+s.dialect.forUpdate(), id).Scan(&legacy, &truncated)
		if errors.Is(err, sql.ErrNoRows) {
			return ErrNotFound
		}
		if err != nil {
			return fmt.Errorf("append console transcript: %w", err)
		}
		if truncated {
			return nil
		}
		var seq, size int64
		if err := tx.QueryRowContext(ctx, `SELECT COALESCE(MAX(seq), 0), COALESCE(SUM(LENGTH(data)), 0)
			FROM console_transcript WHERE session_id = $1`, id).Scan(&seq, &size); err != nil {
			return fmt.Errorf("append console transcript: %w", err)
		}
		room := s.opts.MaxTranscript - len(legacy) - int(size)
		now := s.now()
		for _, r := range records {
			data := redact.Bytes(r.Data)
			if len(data) == 0 {
				continue
			}
			if len(data) > room {
				data, truncated = data[:max(room, 0)], true
			}
			if len(data) > 0 {
				at := r.At
				if at.IsZero() {
					at = now
				}
				seq++
				if _, err := tx.ExecContext(ctx, `INSERT INTO console_transcript (session_id, seq, direction, at, data)
					VALUES ($1, $2, $3, $4, $5)`, id, seq, string(r.Direction), dbTime(at), data); err != nil {
					return fmt.Errorf("append console transcript: %w", err)
				}
				room -= len(data)
			}
			if truncated {
				break
			}
		}
		if truncated {
			if _, err := tx.ExecContext(ctx, `UPDATE console_sessions SET transcript_truncated = $2 WHERE id = $1`,
				id, true); err != nil {
				return fmt.Errorf("append console transcript: %w", err)
			}
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
