package store

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"time"
)

// RunEventType is what a run event says.
type RunEventType string

const (
	// RunEventState: the run changed state (an attempt started, or it
	// ended); its data is a RunState. The store writes these itself, in
	// the transaction that changes the run.
	RunEventState RunEventType = "state"
	// RunEventStdout and RunEventStderr: output of the command, a line at
	// a time; data is {"text": ...}.
	RunEventStdout RunEventType = "stdout"
	RunEventStderr RunEventType = "stderr"
	// RunEventTruncated: the executor stopped recording output here, the
	// run going on; data says why.
	RunEventTruncated RunEventType = "truncated"
	// RunEventEnd is a run's last event, written with its final state;
	// its data is that RunState. Nothing is appended after it.
	RunEventEnd RunEventType = "end"
)

// output reports whether callers may append events of the type: the
// store writes state and end events itself.
func (t RunEventType) output() bool {
	return t == RunEventStdout || t == RunEventStderr || t == RunEventTruncated
}

// RunEvent is one entry of a run's event log.
type RunEvent struct {
	RunID string
	// Seq numbers a run's events from 1 up, without gaps; AppendRunEvents
	// assigns it.
	Seq  int64
	Type RunEventType
	// Data is a JSON object.
	Data string
	At   time.Time
}

// RunState is the data of state and end events.
type RunState struct {
	Status RunStatus `json:"status"`
	// Attempt is the attempt that started, in the event of a start.
	Attempt  int    `json:"attempt,omitempty"`
	ExitCode *int   `json:"exit_code,omitempty"`
	Reason   string `json:"reason,omitempty"`
	Message  string `json:"message,omitempty"`
}

const (
	// MaxRunEventsAppend bounds one AppendRunEvents call.
	MaxRunEventsAppend = 1000
	// DefaultRunEventsPage and MaxRunEventsPage bound ListRunEvents.
	DefaultRunEventsPage = 500
	MaxRunEventsPage     = 1000
)

// stateEvents are the events of a change of state that made r what it is:
// the start of an attempt, or its end (a state event and the end event).
// Other changes have none.
func stateEvents(r Run, started bool) []RunEvent {
	st := RunState{Status: r.Status, ExitCode: r.ExitCode, Reason: r.Reason, Message: r.Message}
	if started {
		st.Attempt = r.Attempts
		st.ExitCode, st.Reason, st.Message = nil, "", ""
	}
	b, _ := json.Marshal(st) // a struct of strings and numbers always encodes
	// The events have the time of the change, as the record has it.
	var at time.Time
	switch {
	case started && r.HeartbeatAt != nil:
		at = *r.HeartbeatAt
	case !started && r.FinishedAt != nil:
		at = *r.FinishedAt
	}
	ev := []RunEvent{{RunID: r.ID, Type: RunEventState, Data: string(b), At: at}}
	if r.Status.Terminal() {
		ev = append(ev, RunEvent{RunID: r.ID, Type: RunEventEnd, Data: string(b), At: at})
	}
	return ev
}

// insertRunEvents gives the events the next sequence numbers of their run
// (and the time now, unless they have one) and inserts them, in tx. The caller holds the lock on the run's row
// (an UPDATE of it, or a SELECT FOR UPDATE), which is what makes reading
// the last number and taking the next ones safe across replicas; the
// primary key would refuse a duplicate anyway. The events are returned
// with their numbers and times.
func (s *Store) insertRunEvents(ctx context.Context, tx *sql.Tx, runID string, evs []RunEvent) ([]RunEvent, error) {
	if len(evs) == 0 {
		return nil, nil
	}
	var last int64
	if err := tx.QueryRowContext(ctx, `SELECT COALESCE(MAX(seq), 0) FROM run_events WHERE run_id = $1`,
		runID).Scan(&last); err != nil {
		return nil, fmt.Errorf("run events: %w", err)
	}
	now := s.now()
	out := make([]RunEvent, len(evs))
	for i, e := range evs {
		last++
		e.RunID, e.Seq = runID, last
		if e.At.IsZero() {
			e.At = now
		}
		e.At = dbTime(e.At)
		out[i] = e
	}
	rows := make([][]any, len(out))
	for i, e := range out {
		rows[i] = []any{e.RunID, e.Seq, string(e.Type), e.Data, e.At}
	}
	if err := insertRows(ctx, tx, "run_events", []string{"run_id", "seq", "type", "data", "at"}, rows); err != nil {
		return nil, fmt.Errorf("run events: %w", err)
	}
	return out, nil
}

// AppendRunEvents appends output events (stdout, stderr, truncated) to a
// live run's log, in order, and returns them with their sequence numbers
// and time. Each event's Data must be a JSON object. The store does not
// redact it: the executor redacts the output before it is cut into
// events, which redacting a JSON encoding could not do without breaking
// it. A run that has ended gives ErrRunFinished and nothing is appended,
// so that nothing follows a run's end event; no run gives ErrNotFound.
func (s *Store) AppendRunEvents(ctx context.Context, runID string, evs ...RunEvent) ([]RunEvent, error) {
	if len(evs) > MaxRunEventsAppend {
		return nil, fmt.Errorf("%w: %d run events in one append, at most %d", ErrInvalid, len(evs), MaxRunEventsAppend)
	}
	for _, e := range evs {
		if !e.Type.output() {
			return nil, fmt.Errorf("%w: run event type %q cannot be appended", ErrInvalid, e.Type)
		}
		if err := checkText("run event data", e.Data); err != nil {
			return nil, err
		}
		var obj map[string]json.RawMessage
		if err := json.Unmarshal([]byte(e.Data), &obj); err != nil || obj == nil {
			return nil, fmt.Errorf("%w: run event data is not a JSON object", ErrInvalid)
		}
	}
	if len(evs) == 0 {
		return nil, nil
	}
	var out []RunEvent
	err := s.writeTx(ctx, func(tx *sql.Tx) error {
		var status string
		err := tx.QueryRowContext(ctx, `SELECT status FROM runs WHERE id = $1`+s.dialect.forUpdate(), runID).Scan(&status)
		if errors.Is(err, sql.ErrNoRows) {
			return ErrNotFound
		}
		if err != nil {
			return fmt.Errorf("append run events: %w", err)
		}
		if RunStatus(status).Terminal() {
			return fmt.Errorf("append run events %s: %w (%s)", runID, ErrRunFinished, status)
		}
		out, err = s.insertRunEvents(ctx, tx, runID, evs)
		return err
	})
	if err != nil {
		return nil, err
	}
	return out, nil
}

// ListRunEvents returns a run's events after sequence number after (0 for
// all), in order, at most limit of them (DefaultRunEventsPage when 0, at
// most MaxRunEventsPage). A run without events, or no run, gives none:
// callers check the run itself.
func (s *Store) ListRunEvents(ctx context.Context, runID string, after int64, limit int) ([]RunEvent, error) {
	switch {
	case after < 0:
		return nil, fmt.Errorf("%w: negative run event sequence number %d", ErrInvalid, after)
	case limit == 0:
		limit = DefaultRunEventsPage
	case limit < 0 || limit > MaxRunEventsPage:
		return nil, fmt.Errorf("%w: run event page size %d is not within 1..%d", ErrInvalid, limit, MaxRunEventsPage)
	}
	rows, err := s.db.QueryContext(ctx, `SELECT run_id, seq, type, data, at FROM run_events
		WHERE run_id = $1 AND seq > $2 ORDER BY seq LIMIT $3`, runID, after, limit)
	if err != nil {
		return nil, fmt.Errorf("list run events: %w", err)
	}
	defer rows.Close()
	var out []RunEvent
	for rows.Next() {
		var (
			e   RunEvent
			typ string
		)
		if err := rows.Scan(&e.RunID, &e.Seq, &typ, &e.Data, &e.At); err != nil {
			return nil, fmt.Errorf("list run events: %w", err)
		}
		e.Type, e.At = RunEventType(typ), e.At.UTC()
		out = append(out, e)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("list run events: %w", err)
	}
	return out, nil
}
