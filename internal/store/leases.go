package store

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"time"
)

// LeaseEventKind is what happened to a lease.
type LeaseEventKind string

const (
	LeaseAcquire   LeaseEventKind = "acquire"
	LeaseHeartbeat LeaseEventKind = "heartbeat"
	LeaseRelease   LeaseEventKind = "release"
	LeaseExpire    LeaseEventKind = "expire"
)

// LeaseEvent is one entry of the lease history. The live lease
// is a coordination.k8s.io Lease; the store keeps what happened to it, and
// the request ids that make acquire idempotent across replicas.
type LeaseEvent struct {
	// ID orders events; the store assigns it.
	ID      int64
	LeaseID string
	AgentID string
	Holder  string
	// RequestID makes an acquire idempotent: a second acquire of the same
	// agent with the same request id returns the first one's event.
	RequestID string
	Event     LeaseEventKind
	At        time.Time
	// ExpiresAt is when the lease lapses without a heartbeat.
	ExpiresAt *time.Time
}

// RecordLeaseEvent appends an event to the lease history and reports
// whether it was new. An acquire whose agent and request id were seen
// before is not recorded again: the earlier acquire is returned with
// created false, so the caller hands back the same lease. An empty At
// means now.
func (s *Store) RecordLeaseEvent(ctx context.Context, e LeaseEvent) (LeaseEvent, bool, error) {
	switch e.Event {
	case LeaseAcquire, LeaseHeartbeat, LeaseRelease, LeaseExpire:
	default:
		return LeaseEvent{}, false, fmt.Errorf("%w: lease event %q", ErrInvalid, e.Event)
	}
	if e.LeaseID == "" || e.AgentID == "" {
		return LeaseEvent{}, false, fmt.Errorf("%w: a lease event needs a lease id and an agent id", ErrInvalid)
	}
	for f, v := range map[string]string{"lease id": e.LeaseID, "agent id": e.AgentID, "holder": e.Holder, "request id": e.RequestID} {
		if err := checkText(f, v); err != nil {
			return LeaseEvent{}, false, err
		}
	}
	if e.At.IsZero() {
		e.At = s.now()
	}
	e.At = dbTime(e.At)
	if e.ExpiresAt != nil {
		x := dbTime(*e.ExpiresAt)
		e.ExpiresAt = &x
	}
	// The conflict target names the partial unique index on acquires, so
	// only a repeated acquire request is skipped.
	err := s.wdb.QueryRowContext(ctx, `INSERT INTO lease_events
		(lease_id, agent_id, holder, request_id, event, at, expires_at)
		VALUES ($1, $2, $3, $4, $5, $6, $7)
		ON CONFLICT (agent_id, request_id) WHERE event = 'acquire' AND request_id <> '' DO NOTHING
		RETURNING id`,
		e.LeaseID, e.AgentID, e.Holder, e.RequestID, string(e.Event), e.At, nullTime(e.ExpiresAt)).Scan(&e.ID)
	if err == nil {
		return e, true, nil
	}
	if !errors.Is(err, sql.ErrNoRows) {
		return LeaseEvent{}, false, fmt.Errorf("record lease event: %w", err)
	}
	prev, err := s.FindLeaseAcquire(ctx, e.AgentID, e.RequestID)
	if err != nil {
		return LeaseEvent{}, false, fmt.Errorf("record lease event: earlier acquire: %w", err)
	}
	return prev, false, nil
}

const leaseColumns = `id, lease_id, agent_id, holder, request_id, event, at, expires_at`

func scanLease(row interface{ Scan(...any) error }) (LeaseEvent, error) {
	var (
		e       LeaseEvent
		kind    string
		expires sql.NullTime
	)
	if err := row.Scan(&e.ID, &e.LeaseID, &e.AgentID, &e.Holder, &e.RequestID, &kind, &e.At, &expires); err != nil {
		return LeaseEvent{}, err
	}
	e.Event, e.At, e.ExpiresAt = LeaseEventKind(kind), e.At.UTC(), timePtr(expires)
	return e, nil
}

// FindLeaseAcquire returns the acquire event an agent's request id produced.
func (s *Store) FindLeaseAcquire(ctx context.Context, agentID, requestID string) (LeaseEvent, error) {
	if requestID == "" {
		return LeaseEvent{}, ErrNotFound
	}
	e, err := scanLease(s.wdb.QueryRowContext(ctx, `SELECT `+leaseColumns+` FROM lease_events
		WHERE agent_id = $1 AND request_id = $2 AND event = 'acquire'`, agentID, requestID))
	if errors.Is(err, sql.ErrNoRows) {
		return LeaseEvent{}, ErrNotFound
	}
	if err != nil {
		return LeaseEvent{}, fmt.Errorf("find lease acquire: %w", err)
	}
	return e, nil
}

// LeaseQuery selects lease history; empty fields match everything.
type LeaseQuery struct {
	AgentID string
	LeaseID string
	// AfterID pages: pass the last ID of the previous page.
	AfterID int64
	Limit   int
}

// ListLeaseEvents lists lease history in the order it happened.
func (s *Store) ListLeaseEvents(ctx context.Context, q LeaseQuery) ([]LeaseEvent, error) {
	var w where
	if q.AgentID != "" {
		w.add(`agent_id = %s`, q.AgentID)
	}
	if q.LeaseID != "" {
		w.add(`lease_id = %s`, q.LeaseID)
	}
	w.add(`id > %s`, q.AfterID)
	rows, err := s.db.QueryContext(ctx, `SELECT `+leaseColumns+` FROM lease_events`+w.String()+
		` ORDER BY id LIMIT `+w.arg(pageSize(q.Limit)), w.args...)
	if err != nil {
		return nil, fmt.Errorf("list lease events: %w", err)
	}
	defer rows.Close()
	var out []LeaseEvent
	for rows.Next() {
		e, err := scanLease(rows)
		if err != nil {
			return nil, fmt.Errorf("list lease events: %w", err)
		}
		out = append(out, e)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("list lease events: %w", err)
	}
	return out, nil
}
