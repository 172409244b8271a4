package store

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"time"
)

// A run's artifacts: the files its command left under its artifact paths,
// which the executor uploads to the platform's object store once the
// command has ended, before it finishes the run. The store records each
// file found (uploaded, or why not), with an artifact event in the run's
// log written in the same transaction, and per run how the collection
// went. The records go with their run; the objects are the caller's to
// delete first (RunArtifactsToDelete).

// RunEventArtifact: a file of the run's artifacts was uploaded, or was
// not (Error), or the run's artifacts were not kept at all (Message
// alone); data is an ArtifactEventData. Written before the run's end.
const RunEventArtifact RunEventType = "artifact"

// ArtifactEventData is the data of an artifact event.
type ArtifactEventData struct {
	Path   string `json:"path,omitempty"`
	Size   int64  `json:"size,omitempty"`
	SHA256 string `json:"sha256,omitempty"`
	// Error says why the file was not uploaded.
	Error string `json:"error,omitempty"`
	// Message says why no artifacts of the run were kept.
	Message string `json:"message,omitempty"`
}

// RunArtifact is one file of a run's artifacts.
type RunArtifact struct {
	RunID string
	// Path is the file's workspace-relative path, with slashes.
	Path string
	Size int64
	// SHA256 is the lower-case hex digest of what was uploaded.
	SHA256 string
	// ObjectKey is where the object store holds it; empty when it was not
	// uploaded.
	ObjectKey string
	// UploadedAt is when its upload completed; nil when it was not
	// uploaded.
	UploadedAt *time.Time
	// Error says why it was not uploaded (over a size limit, unreadable).
	Error string
}

// Uploaded reports whether the object store holds the artifact.
func (a RunArtifact) Uploaded() bool { return a.ObjectKey != "" && a.Error == "" }

// Collection states of a run's artifacts.
const (
	// ArtifactsCollecting: the executor is uploading them (or died
	// doing so).
	ArtifactsCollecting = "collecting"
	// ArtifactsCollected: every file found is recorded, uploaded or not.
	ArtifactsCollected = "collected"
	// ArtifactsNotKept: none were kept; Message says why (no object
	// store configured, or the collection failed as a whole).
	ArtifactsNotKept = "not_kept"
)

// RunArtifactCollection is how the collection of a run's artifacts went.
type RunArtifactCollection struct {
	RunID string
	State string
	// Store is the kind of object store ("s3", "embedded") and Prefix the
	// key prefix under which the run's objects are.
	Store, Prefix string
	Message       string
	StartedAt     time.Time
	FinishedAt    *time.Time
}

// noArtifactObjects is the condition on a runs row that its artifacts
// have no objects left to delete.
const noArtifactObjects = `NOT EXISTS (SELECT 1 FROM run_artifact_collections c
	WHERE c.run_id = runs.id AND c.state <> 'not_kept' AND c.prefix <> '')`

func validCollectionState(s string) bool {
	return s == ArtifactsCollecting || s == ArtifactsCollected || s == ArtifactsNotKept
}

// BeginRunArtifacts records that the artifacts of a live run are being
// uploaded under prefix of a store of kind store, before the first object
// is written, so that retention finds the objects even if the executor
// dies half-way. A run that has ended gives ErrRunFinished; no run
// ErrNotFound.
func (s *Store) BeginRunArtifacts(ctx context.Context, runID, store, prefix string) error {
	for f, v := range map[string]string{"artifact store": store, "artifact prefix": prefix} {
		if err := checkText(f, v); err != nil {
			return err
		}
	}
	return s.writeTx(ctx, func(tx *sql.Tx) error {
		if err := s.lockLiveRun(ctx, tx, "begin run artifacts", runID); err != nil {
			return err
		}
		_, err := tx.ExecContext(ctx, `INSERT INTO run_artifact_collections (run_id, state, store, prefix, started_at)
			VALUES ($1, $2, $3, $4, $5)
			ON CONFLICT (run_id) DO UPDATE SET state = $2, store = $3, prefix = $4, message = '', finished_at = NULL`,
			runID, ArtifactsCollecting, store, prefix, s.now())
		if err != nil {
			return fmt.Errorf("begin run artifacts: %w", err)
		}
		return nil
	})
}

// lockLiveRun locks the row of a run that has not ended, in tx.
func (s *Store) lockLiveRun(ctx context.Context, tx *sql.Tx, what, runID string) error {
	var status string
	err := tx.QueryRowContext(ctx, `SELECT status FROM runs WHERE id = $1`+s.dialect.forUpdate(), runID).Scan(&status)
	if errors.Is(err, sql.ErrNoRows) {
		return ErrNotFound
	}
	if err != nil {
		return fmt.Errorf("%s: %w", what, err)
	}
	if RunStatus(status).Terminal() {
		return fmt.Errorf("%s %s: %w (%s)", what, runID, ErrRunFinished, status)
	}
	return nil
}

// RecordRunArtifact records one file of a live run's artifacts, replacing
// a record of the same path, and appends its artifact event to the run's
// log in the same transaction; it returns the event. A run that has ended
// gives ErrRunFinished (nothing follows a run's end event); no run
// ErrNotFound.
func (s *Store) RecordRunArtifact(ctx context.Context, a RunArtifact) (RunEvent, error) {
	if a.Path == "" || a.Size < 0 {
		return RunEvent{}, fmt.Errorf("%w: a run artifact needs a path and a size of 0 or more", ErrInvalid)
	}
	for f, v := range map[string]string{"artifact path": a.Path, "artifact sha256": a.SHA256,
		"artifact object key": a.ObjectKey, "artifact error": a.Error} {
		if err := checkText(f, v); err != nil {
			return RunEvent{}, err
		}
	}
	if (a.ObjectKey == "") == (a.Error == "") {
		return RunEvent{}, fmt.Errorf("%w: a run artifact is either uploaded (object key) or not (error)", ErrInvalid)
	}
	data := ArtifactEventData{Path: a.Path, Size: a.Size, Error: a.Error}
	var uploaded any
	if a.Error == "" {
		at := s.now()
		if a.UploadedAt != nil {
			at = dbTime(*a.UploadedAt)
		}
		uploaded, data.SHA256 = at, a.SHA256
	}
	b, err := json.Marshal(data)
	if err != nil {
		return RunEvent{}, fmt.Errorf("record run artifact: %w", err)
	}
	var out []RunEvent
	err = s.writeTx(ctx, func(tx *sql.Tx) error {
		if err := s.lockLiveRun(ctx, tx, "record run artifact", a.RunID); err != nil {
			return err
		}
		if _, err := tx.ExecContext(ctx, `INSERT INTO run_artifacts (run_id, path, size, sha256, object_key, uploaded_at, error)
			VALUES ($1, $2, $3, $4, $5, $6, $7)
			ON CONFLICT (run_id, path) DO UPDATE SET size = $3, sha256 = $4, object_key = $5, uploaded_at = $6, error = $7`,
			a.RunID, a.Path, a.Size, a.SHA256, a.ObjectKey, uploaded, a.Error); err != nil {
			return fmt.Errorf("record run artifact: %w", err)
		}
		var err error
		out, err = s.insertRunEvents(ctx, tx, a.RunID, []RunEvent{{Type: RunEventArtifact, Data: string(b)}})
		return err
	})
	if err != nil {
		return RunEvent{}, err
	}
	return out[0], nil
}

// EndRunArtifacts records how the collection of a live run's artifacts
// ended: state ArtifactsCollected, or ArtifactsNotKept with a message
// saying why, which also goes into the run's log as an artifact event.
// A run that has ended gives ErrRunFinished; no run ErrNotFound.
func (s *Store) EndRunArtifacts(ctx context.Context, runID, state, message string) error {
	if state == ArtifactsCollecting || !validCollectionState(state) {
		return fmt.Errorf("%w: run artifacts cannot end %q", ErrInvalid, state)
	}
	if state == ArtifactsNotKept && message == "" {
		return fmt.Errorf("%w: artifacts not kept need a message saying why", ErrInvalid)
	}
	if err := checkText("artifact message", message); err != nil {
		return err
	}
	return s.writeTx(ctx, func(tx *sql.Tx) error {
		if err := s.lockLiveRun(ctx, tx, "end run artifacts", runID); err != nil {
			return err
		}
		now := s.now()
		if _, err := tx.ExecContext(ctx, `INSERT INTO run_artifact_collections (run_id, state, message, started_at, finished_at)
			VALUES ($1, $2, $3, $4, $4)
			ON CONFLICT (run_id) DO UPDATE SET state = $2, message = $3, finished_at = $4`,
			runID, state, message, now); err != nil {
			return fmt.Errorf("end run artifacts: %w", err)
		}
		if message == "" {
			return nil
		}
		b, _ := json.Marshal(ArtifactEventData{Message: message}) // strings always encode
		_, err := s.insertRunEvents(ctx, tx, runID, []RunEvent{{Type: RunEventArtifact, Data: string(b)}})
		return err
	})
}

const runArtifactColumns = `run_id, path, size, sha256, object_key, uploaded_at, error`

func scanRunArtifact(row interface{ Scan(...any) error }) (RunArtifact, error) {
	var (
		a  RunArtifact
		at sql.NullTime
	)
	if err := row.Scan(&a.RunID, &a.Path, &a.Size, &a.SHA256, &a.ObjectKey, &at, &a.Error); err != nil {
		return RunArtifact{}, err
	}
	a.UploadedAt = timePtr(at)
	return a, nil
}

// ListRunArtifacts returns a run's artifacts by path, and how their
// collection went (nil when it never started: the run has not ended yet,
// never started its command, or ended before runs had artifacts).
func (s *Store) ListRunArtifacts(ctx context.Context, runID string) ([]RunArtifact, *RunArtifactCollection, error) {
	var (
		c        RunArtifactCollection
		finished sql.NullTime
	)
	err := s.db.QueryRowContext(ctx, `SELECT run_id, state, store, prefix, message, started_at, finished_at
		FROM run_artifact_collections WHERE run_id = $1`, runID).
		Scan(&c.RunID, &c.State, &c.Store, &c.Prefix, &c.Message, &c.StartedAt, &finished)
	var coll *RunArtifactCollection
	switch {
	case err == nil:
		c.StartedAt, c.FinishedAt = c.StartedAt.UTC(), timePtr(finished)
		coll = &c
	case !errors.Is(err, sql.ErrNoRows):
		return nil, nil, fmt.Errorf("list run artifacts: %w", err)
	}
	rows, err := s.db.QueryContext(ctx, `SELECT `+runArtifactColumns+` FROM run_artifacts WHERE run_id = $1 ORDER BY path`, runID)
	if err != nil {
		return nil, nil, fmt.Errorf("list run artifacts: %w", err)
	}
	defer rows.Close()
	var out []RunArtifact
	for rows.Next() {
		a, err := scanRunArtifact(rows)
		if err != nil {
			return nil, nil, fmt.Errorf("list run artifacts: %w", err)
		}
		out = append(out, a)
	}
	if err := rows.Err(); err != nil {
		return nil, nil, fmt.Errorf("list run artifacts: %w", err)
	}
	return out, coll, nil
}

// GetRunArtifact returns the artifact of a run at path, or ErrNotFound.
func (s *Store) GetRunArtifact(ctx context.Context, runID, path string) (RunArtifact, error) {
	a, err := scanRunArtifact(s.db.QueryRowContext(ctx, `SELECT `+runArtifactColumns+` FROM run_artifacts
		WHERE run_id = $1 AND path = $2`, runID, path))
	if errors.Is(err, sql.ErrNoRows) {
		return RunArtifact{}, ErrNotFound
	}
	if err != nil {
		return RunArtifact{}, fmt.Errorf("get run artifact: %w", err)
	}
	return a, nil
}

// RunArtifactsToDelete returns, for retention, the artifact collections
// that may have left objects in the object store (all but those whose
// artifacts were not kept) of runs that finished before finishedBefore,
// or whose own TTL has expired by now, at most limit of them, oldest first. The caller deletes the objects
// under each one's Prefix and then calls ForgetRunArtifactObjects;
// DeleteFinishedRuns leaves the runs of the others alone.
func (s *Store) RunArtifactsToDelete(ctx context.Context, finishedBefore, now time.Time, limit int) ([]RunArtifactCollection, error) {
	if limit < 1 {
		return nil, fmt.Errorf("%w: run artifacts page size %d", ErrInvalid, limit)
	}
	// A run with a TTL of its own goes at its expiry, whatever the
	// retention (DeleteExpiredRuns), and so do its objects.
	rows, err := s.db.QueryContext(ctx, `SELECT c.run_id, c.state, c.store, c.prefix, c.message, c.started_at, c.finished_at
		FROM run_artifact_collections c JOIN runs r ON r.id = c.run_id
		WHERE r.status IN ('succeeded', 'failed', 'timed_out', 'cancelled')
		  AND ((r.ttl_seconds_after_finished IS NULL AND r.finished_at < $1) OR (r.expires_at IS NOT NULL AND r.expires_at <= $4))
		  AND c.state <> $2 AND c.prefix <> ''
		ORDER BY r.finished_at, r.id LIMIT $3`, dbTime(finishedBefore), ArtifactsNotKept, limit, dbTime(now))
	if err != nil {
		return nil, fmt.Errorf("run artifacts to delete: %w", err)
	}
	defer rows.Close()
	var out []RunArtifactCollection
	for rows.Next() {
		var (
			c        RunArtifactCollection
			finished sql.NullTime
		)
		if err := rows.Scan(&c.RunID, &c.State, &c.Store, &c.Prefix, &c.Message, &c.StartedAt, &finished); err != nil {
			return nil, fmt.Errorf("run artifacts to delete: %w", err)
		}
		c.StartedAt, c.FinishedAt = c.StartedAt.UTC(), timePtr(finished)
		out = append(out, c)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("run artifacts to delete: %w", err)
	}
	return out, nil
}

// ForgetRunArtifactObjects records that the objects of a run's artifacts
// were deleted from the object store, so that RunArtifactsToDelete no
// longer returns the run: its prefix is cleared. The records stay until
// the run is deleted.
func (s *Store) ForgetRunArtifactObjects(ctx context.Context, runID string) error {
	if _, err := s.wdb.ExecContext(ctx, `UPDATE run_artifact_collections SET prefix = '' WHERE run_id = $1`, runID); err != nil {
		return fmt.Errorf("forget run artifact objects: %w", err)
	}
	return nil
}
