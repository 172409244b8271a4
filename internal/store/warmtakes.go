package store

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"time"
)

// WarmTaker is who took a warm sandbox.
type WarmTaker string

const (
	// WarmTakenByLease: a pool lease (an ephemeral run) got it.
	WarmTakenByLease WarmTaker = "lease"
	// WarmTakenByAdoption: a new Sandbox, named by Holder, took it over.
	WarmTakenByAdoption WarmTaker = "adopt"
	// WarmTakenByRetirement: its pool is deleting it (scaled down, or its
	// template changed).
	WarmTakenByRetirement WarmTaker = "retire"
)

// WarmTake records who got one ready warm sandbox. Exactly one take per
// sandbox succeeds, across every replica sharing the store: it is the
// arbiter between pool leases, adoptions and the pool's own deletions,
// decided by one row insert. The Sandbox's annotations and Lease are
// written after the decision, to say what it was.
type WarmTake struct {
	// SandboxUID identifies the warm sandbox; a Sandbox re-created under
	// the same name is another sandbox.
	SandboxUID string
	Namespace  string
	Pool       string
	Sandbox    string
	Taker      WarmTaker
	// Holder is the lease's holder, or the adopting Sandbox's name.
	Holder string
	// RequestID, LeaseID and TTLSeconds describe a pool lease's hold.
	RequestID  string
	LeaseID    string
	TTLSeconds int
	// TakenAt is when the take was decided; an empty TakenAt means now.
	TakenAt time.Time
}

// TakeWarm records t unless the sandbox was taken already. It returns the
// take that holds, and whether it is t. A pool lease with the holder and
// request ID of an earlier one in the same pool is not recorded either: the
// earlier take is returned, with false, so that a retried acquire gets the
// sandbox its first try took.
func (s *Store) TakeWarm(ctx context.Context, t WarmTake) (WarmTake, bool, error) {
	switch t.Taker {
	case WarmTakenByLease, WarmTakenByAdoption, WarmTakenByRetirement:
	default:
		return WarmTake{}, false, fmt.Errorf("%w: warm taker %q", ErrInvalid, t.Taker)
	}
	if t.SandboxUID == "" || t.Namespace == "" || t.Pool == "" || t.Sandbox == "" {
		return WarmTake{}, false, fmt.Errorf("%w: a warm take needs the sandbox's uid, namespace, pool and name", ErrInvalid)
	}
	if t.TTLSeconds < 0 {
		return WarmTake{}, false, fmt.Errorf("%w: negative ttl", ErrInvalid)
	}
	for f, v := range map[string]string{"sandbox uid": t.SandboxUID, "namespace": t.Namespace, "pool": t.Pool,
		"sandbox": t.Sandbox, "holder": t.Holder, "request id": t.RequestID, "lease id": t.LeaseID} {
		if err := checkText(f, v); err != nil {
			return WarmTake{}, false, err
		}
	}
	if t.TakenAt.IsZero() {
		t.TakenAt = s.now()
	}
	t.TakenAt = dbTime(t.TakenAt)
	// No conflict target: a taken sandbox and a repeated lease request
	// (the partial unique index) both leave the row out.
	res, err := s.wdb.ExecContext(ctx, `INSERT INTO warm_takes
		(sandbox_uid, namespace, pool, sandbox, taker, holder, request_id, lease_id, ttl_seconds, taken_at)
		VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)
		ON CONFLICT DO NOTHING`,
		t.SandboxUID, t.Namespace, t.Pool, t.Sandbox, string(t.Taker), t.Holder, t.RequestID, t.LeaseID, t.TTLSeconds, t.TakenAt)
	if err != nil {
		return WarmTake{}, false, fmt.Errorf("take warm sandbox %s/%s: %w", t.Namespace, t.Sandbox, err)
	}
	if n, err := res.RowsAffected(); err != nil {
		return WarmTake{}, false, fmt.Errorf("take warm sandbox %s/%s: %w", t.Namespace, t.Sandbox, err)
	} else if n == 1 {
		return t, true, nil
	}
	if t.Taker == WarmTakenByLease {
		prev, err := s.FindWarmLease(ctx, t.Namespace, t.Pool, t.Holder, t.RequestID)
		if err == nil {
			return prev, false, nil
		}
		if !errors.Is(err, ErrNotFound) {
			return WarmTake{}, false, err
		}
	}
	prev, err := s.WarmTakeOf(ctx, t.SandboxUID)
	if errors.Is(err, ErrNotFound) {
		// Taken and forgotten between the insert and this read: the
		// sandbox is gone, which is as good as taken.
		return WarmTake{}, false, fmt.Errorf("%w: warm sandbox %s/%s was taken and has gone", ErrConflict, t.Namespace, t.Sandbox)
	}
	return prev, false, err
}

const warmTakeColumns = `sandbox_uid, namespace, pool, sandbox, taker, holder, request_id, lease_id, ttl_seconds, taken_at`

func scanWarmTake(row interface{ Scan(...any) error }) (WarmTake, error) {
	var (
		t     WarmTake
		taker string
	)
	if err := row.Scan(&t.SandboxUID, &t.Namespace, &t.Pool, &t.Sandbox, &taker, &t.Holder, &t.RequestID, &t.LeaseID,
		&t.TTLSeconds, &t.TakenAt); err != nil {
		return WarmTake{}, err
	}
	t.Taker, t.TakenAt = WarmTaker(taker), t.TakenAt.UTC()
	return t, nil
}

func (s *Store) oneWarmTake(ctx context.Context, what, where string, args ...any) (WarmTake, error) {
	t, err := scanWarmTake(s.wdb.QueryRowContext(ctx, `SELECT `+warmTakeColumns+` FROM warm_takes WHERE `+where, args...))
	if errors.Is(err, sql.ErrNoRows) {
		return WarmTake{}, ErrNotFound
	}
	if err != nil {
		return WarmTake{}, fmt.Errorf("%s: %w", what, err)
	}
	return t, nil
}

// WarmTakeOf returns the take of the sandbox with this UID, or ErrNotFound
// if it is still free.
func (s *Store) WarmTakeOf(ctx context.Context, sandboxUID string) (WarmTake, error) {
	return s.oneWarmTake(ctx, "get warm take", `sandbox_uid = $1`, sandboxUID)
}

// FindWarmLease returns the pool lease a holder's acquire request took.
func (s *Store) FindWarmLease(ctx context.Context, namespace, pool, holder, requestID string) (WarmTake, error) {
	return s.oneWarmTake(ctx, "find warm lease",
		`namespace = $1 AND pool = $2 AND holder = $3 AND request_id = $4 AND taker = 'lease'`,
		namespace, pool, holder, requestID)
}

// ListWarmTakes lists the takes of one pool's sandboxes.
func (s *Store) ListWarmTakes(ctx context.Context, namespace, pool string) ([]WarmTake, error) {
	rows, err := s.wdb.QueryContext(ctx, `SELECT `+warmTakeColumns+` FROM warm_takes
		WHERE namespace = $1 AND pool = $2 ORDER BY taken_at, sandbox_uid`, namespace, pool)
	if err != nil {
		return nil, fmt.Errorf("list warm takes: %w", err)
	}
	defer rows.Close()
	var out []WarmTake
	for rows.Next() {
		t, err := scanWarmTake(rows)
		if err != nil {
			return nil, fmt.Errorf("list warm takes: %w", err)
		}
		out = append(out, t)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("list warm takes: %w", err)
	}
	return out, nil
}

// ForgetWarmTake deletes the take of a sandbox that no longer exists.
// Forgetting a live sandbox's take would make it free again.
func (s *Store) ForgetWarmTake(ctx context.Context, sandboxUID string) error {
	if _, err := s.wdb.ExecContext(ctx, `DELETE FROM warm_takes WHERE sandbox_uid = $1`, sandboxUID); err != nil {
		return fmt.Errorf("forget warm take: %w", err)
	}
	return nil
}
