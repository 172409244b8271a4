package store

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"time"
)

// AgentEvent is one entry of an agent's event log: a moment of its
// sandbox's life (created, ready, idle-stopped, resumed...), a command
// started or ended in it, an egress denial. The store keeps the log and
// numbers it; what each type means is the Compute API's.
type AgentEvent struct {
	AgentID string
	// Seq numbers an agent's events from 1 up, without gaps, for as long
	// as the store lives: retention deletes old events, never numbers.
	// AppendAgentEvents assigns it.
	Seq       int64
	Type      string
	Namespace string
	Sandbox   string
	// Data is a JSON object: the fields of the type.
	Data string
	At   time.Time
	// SourceKey, when set, names what the event records (a Kubernetes
	// Event's UID, say): an agent's log takes each key once, so a writer
	// that may see a thing twice records it once.
	SourceKey string
}

const (
	// MaxAgentEventsAppend bounds one AppendAgentEvents call.
	MaxAgentEventsAppend = 1000
	// DefaultAgentEventsPage and MaxAgentEventsPage bound ListAgentEvents.
	DefaultAgentEventsPage = 500
	MaxAgentEventsPage     = 1000
)

// AppendAgentEvents appends events to agentID's log, in order, and returns
// those it appended with their sequence numbers and times (now, unless
// they have one). An event whose SourceKey the log has already is left
// out. Each event's Data must be a JSON object.
func (s *Store) AppendAgentEvents(ctx context.Context, agentID string, evs ...AgentEvent) ([]AgentEvent, error) {
	if agentID == "" {
		return nil, fmt.Errorf("%w: agent event without an agent", ErrInvalid)
	}
	if len(evs) > MaxAgentEventsAppend {
		return nil, fmt.Errorf("%w: %d agent events in one append, at most %d", ErrInvalid, len(evs), MaxAgentEventsAppend)
	}
	for _, e := range evs {
		if e.Type == "" {
			return nil, fmt.Errorf("%w: agent event without a type", ErrInvalid)
		}
		for _, f := range [][2]string{{"agent event type", e.Type}, {"agent event namespace", e.Namespace},
			{"agent event sandbox", e.Sandbox}, {"agent event data", e.Data}, {"agent event source key", e.SourceKey}} {
			if err := checkText(f[0], f[1]); err != nil {
				return nil, err
			}
		}
		var obj map[string]json.RawMessage
		if err := json.Unmarshal([]byte(e.Data), &obj); err != nil || obj == nil {
			return nil, fmt.Errorf("%w: agent event data is not a JSON object", ErrInvalid)
		}
	}
	if len(evs) == 0 {
		return nil, nil
	}
	var out []AgentEvent
	err := s.writeTx(ctx, func(tx *sql.Tx) error {
		out = out[:0]
		keys := map[string]bool{}
		for _, e := range evs {
			if e.SourceKey == "" {
				out = append(out, e)
				continue
			}
			if keys[e.SourceKey] {
				continue
			}
			keys[e.SourceKey] = true
			var one int
			err := tx.QueryRowContext(ctx, `SELECT 1 FROM agent_events WHERE agent_id = $1 AND source_key = $2`,
				agentID, e.SourceKey).Scan(&one)
			switch {
			case err == nil:
				continue
			case !errors.Is(err, sql.ErrNoRows):
				return fmt.Errorf("append agent events: %w", err)
			}
			out = append(out, e)
		}
		if len(out) == 0 {
			return nil
		}
		// Taking the numbers locks the agent's row until the commit, so
		// two writers of one agent append one after the other.
		var last int64
		if err := tx.QueryRowContext(ctx, `INSERT INTO agent_event_heads (agent_id, last_seq) VALUES ($1, $2)
			ON CONFLICT (agent_id) DO UPDATE SET last_seq = agent_event_heads.last_seq + $2
			RETURNING last_seq`, agentID, len(out)).Scan(&last); err != nil {
			return fmt.Errorf("append agent events: %w", err)
		}
		now := s.now()
		rows := make([][]any, len(out))
		for i := range out {
			e := &out[i]
			e.AgentID, e.Seq = agentID, last-int64(len(out)-1-i)
			if e.At.IsZero() {
				e.At = now
			}
			e.At = dbTime(e.At)
			var key sql.NullString
			if e.SourceKey != "" {
				key = sql.NullString{String: e.SourceKey, Valid: true}
			}
			rows[i] = []any{e.AgentID, e.Seq, e.Type, e.Namespace, e.Sandbox, e.Data, e.At, key}
		}
		if err := insertRows(ctx, tx, "agent_events",
			[]string{"agent_id", "seq", "type", "namespace", "sandbox", "data", "at", "source_key"}, rows); err != nil {
			return fmt.Errorf("append agent events: %w", err)
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	return out, nil
}

// ListAgentEvents returns agentID's events after sequence number after (0
// for all that retention kept), in order, at most limit of them
// (DefaultAgentEventsPage when 0, at most MaxAgentEventsPage).
func (s *Store) ListAgentEvents(ctx context.Context, agentID string, after int64, limit int) ([]AgentEvent, error) {
	switch {
	case after < 0:
		return nil, fmt.Errorf("%w: negative agent event sequence number %d", ErrInvalid, after)
	case limit == 0:
		limit = DefaultAgentEventsPage
	case limit < 0 || limit > MaxAgentEventsPage:
		return nil, fmt.Errorf("%w: agent event page size %d is not within 1..%d", ErrInvalid, limit, MaxAgentEventsPage)
	}
	rows, err := s.db.QueryContext(ctx, `SELECT agent_id, seq, type, namespace, sandbox, data, at, COALESCE(source_key, '')
		FROM agent_events WHERE agent_id = $1 AND seq > $2 ORDER BY seq LIMIT $3`, agentID, after, limit)
	if err != nil {
		return nil, fmt.Errorf("list agent events: %w", err)
	}
	defer rows.Close()
	var out []AgentEvent
	for rows.Next() {
		var e AgentEvent
		if err := rows.Scan(&e.AgentID, &e.Seq, &e.Type, &e.Namespace, &e.Sandbox, &e.Data, &e.At, &e.SourceKey); err != nil {
			return nil, fmt.Errorf("list agent events: %w", err)
		}
		e.At = e.At.UTC()
		out = append(out, e)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("list agent events: %w", err)
	}
	return out, nil
}

// DeleteAgentEventsBefore deletes the agent events older than before, of
// every agent, and returns how many went. Numbering goes on after them.
func (s *Store) DeleteAgentEventsBefore(ctx context.Context, before time.Time) (int64, error) {
	var n int64
	err := s.writeTx(ctx, func(tx *sql.Tx) error {
		res, err := tx.ExecContext(ctx, `DELETE FROM agent_events WHERE at < $1`, dbTime(before))
		if err != nil {
			return fmt.Errorf("delete agent events: %w", err)
		}
		n, err = res.RowsAffected()
		return err
	})
	return n, err
}

// insertRows inserts rows of len(cols) values each into table, in tx, a
// chunk of rows per statement so that the parameters stay far below
// either backend's limit.
func insertRows(ctx context.Context, tx *sql.Tx, table string, cols []string, rows [][]any) error {
	per := max(1, 1000/len(cols))
	for start := 0; start < len(rows); start += per {
		chunk := rows[start:min(start+per, len(rows))]
		var (
			q    strings.Builder
			args []any
		)
		fmt.Fprintf(&q, "INSERT INTO %s (%s) VALUES ", table, strings.Join(cols, ", "))
		for i, row := range chunk {
			if i > 0 {
				q.WriteString(", ")
			}
			q.WriteByte('(')
			for j, v := range row {
				if j > 0 {
					q.WriteString(", ")
				}
				args = append(args, v)
				fmt.Fprintf(&q, "$%d", len(args))
			}
			q.WriteByte(')')
		}
		if _, err := tx.ExecContext(ctx, q.String(), args...); err != nil {
			return err
		}
	}
	return nil
}
