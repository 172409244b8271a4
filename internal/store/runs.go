package store

import (
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/base64"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"regexp"
	"strings"
	"time"

	"github.com/agentbox/terraform-provider-agentbox/internal/redact"
)

// ErrRunFinished means a run has reached a terminal state, which is final:
// it cannot be started, heartbeated, cancelled or finished again. It wraps
// ErrConflict, so callers that map conflicts need not know it. The methods
// that return it also return the run as it stands, to say how it ended.
var ErrRunFinished = fmt.Errorf("%w: run has finished", ErrConflict)

// RunStatus is where a run is in its life. queued and running are live;
// the others are terminal and final.
type RunStatus string

const (
	// RunQueued: recorded, no executor has started it yet.
	RunQueued RunStatus = "queued"
	// RunRunning: an executor started an attempt and heartbeats it.
	RunRunning RunStatus = "running"
	// RunSucceeded: the command exited with status 0.
	RunSucceeded RunStatus = "succeeded"
	// RunFailed: the command exited non-zero, could not be started, or its
	// executor was lost (see Reason).
	RunFailed RunStatus = "failed"
	// RunTimedOut: the command outlived its timeout and was stopped.
	RunTimedOut RunStatus = "timed_out"
	// RunCancelled: someone cancelled it (see CancelledBy).
	RunCancelled RunStatus = "cancelled"
)

// Terminal reports whether the status is final: a run in it never changes
// state again.
func (s RunStatus) Terminal() bool {
	switch s {
	case RunSucceeded, RunFailed, RunTimedOut, RunCancelled:
		return true
	}
	return false
}

func (s RunStatus) valid() bool { return s == RunQueued || s == RunRunning || s.Terminal() }

// RunMode says where a run executes.
type RunMode string

const (
	// RunModeAgent runs in an existing agent's sandbox (AgentID).
	RunModeAgent RunMode = "agent"
	// RunModePool runs in a sandbox leased from a warm pool (Pool).
	RunModePool RunMode = "pool"
	// RunModeJob runs in a sandbox made for it from a template (Template).
	RunModeJob RunMode = "job"
)

func (m RunMode) valid() bool { return m == RunModeAgent || m == RunModePool || m == RunModeJob }

// RunCommand is what a run executes. It is stored as JSON. The
// environment's values are never stored, only its names: values may be
// secrets, and the record outlives the run.
type RunCommand struct {
	Argv []string `json:"argv"`
	// EnvNames are the names of the variables the command was given. A
	// name with "=" in it is refused, since it would carry a value.
	EnvNames []string `json:"env_names,omitempty"`
	Cwd      string   `json:"cwd,omitempty"`
	// TimeoutSeconds bounds the run; 0 means the executor's default.
	TimeoutSeconds int `json:"timeout_seconds,omitempty"`
	// Artifacts are the workspace-relative paths and globs of the files
	// the run keeps as artifacts once its command has ended.
	Artifacts []string `json:"artifacts,omitempty"`
	// PoolRequirements and PoolEnvName are the Python environment a pool
	// run's lease is routed by.
	PoolRequirements []string `json:"pool_requirements,omitempty"`
	PoolEnvName      string   `json:"pool_env_name,omitempty"`
}

// Run is the record of one run-to-completion job. CreateRun makes it
// queued; an executor moves it to running with StartRunAttempt and keeps
// it alive with HeartbeatRun; FinishRun, RequestRunCancel (of a queued run)
// or FailStaleRuns end it, once.
type Run struct {
	// ID is "run-" and 20 hex digits; CreateRun makes it when empty.
	ID string
	// RequestID makes a start idempotent per caller: a second CreateRun
	// with the caller and request id of an earlier run returns that run.
	RequestID string
	// Caller is who started the run: a token id.
	Caller string
	// Holder is the lease holder the run acts for, if any.
	Holder     string
	WorkflowID string
	// Schedule is the namespace/name of the schedule that started the run,
	// or empty.
	Schedule string
	Mode     RunMode
	AgentID  string
	// Sandbox is the namespace/name of the sandbox the run executes in,
	// once known.
	Sandbox string
	// Template is the namespace/name of a job run's template.
	Template string
	// Pool is the namespace/name of a pool run's warm pool.
	Pool    string
	Command RunCommand
	Status  RunStatus
	// Attempts counts StartRunAttempt calls: a job run's retries, or an
	// executor lost and another taking the run over. Each attempt is
	// recorded (ListRunAttempts).
	Attempts int
	// ExitCode is the command's exit status, when it exited.
	ExitCode *int
	// Reason is a short CamelCase word for how the run ended, such as
	// NonZeroExit, DeadlineExceeded, ExecutorLost or Cancelled.
	Reason  string
	Message string
	// OutputBytes is how much output the command wrote.
	OutputBytes int64
	// CancelRequestedBy is who first asked to cancel a running run; the
	// executor sees it in HeartbeatRun's answer and stops the command.
	CancelRequestedBy string
	// CancelledBy is who cancelled a run that ended cancelled.
	CancelledBy string
	// Executor names the control plane replica running the current attempt.
	Executor    string
	CreatedAt   time.Time
	StartedAt   *time.Time
	FinishedAt  *time.Time
	HeartbeatAt *time.Time
	// BackoffLimit is how many times a job run's failed attempt is
	// retried (MaxRunBackoffLimit at most).
	BackoffLimit int
	// ActiveDeadlineSeconds bounds the whole run, from its creation,
	// retries and waits included; 0 means no bound.
	ActiveDeadlineSeconds int
	// TTLSecondsAfterFinished, when set, is how long the record is kept
	// after the run ends, instead of the platform's retention.
	TTLSecondsAfterFinished *int
	// ExpiresAt is when the record goes: the end plus
	// TTLSecondsAfterFinished, set when the run ends.
	ExpiresAt *time.Time
}

// MaxRunBackoffLimit bounds a run's BackoffLimit: more retries than this
// are a loop, not a retry policy.
const MaxRunBackoffLimit = 10

// reasonPattern is what a Reason looks like: a CamelCase word, so that it
// can be matched on by programs (the message is for people).
var reasonPattern = regexp.MustCompile(`^[A-Z][A-Za-z0-9]{0,63}$`)

func checkReason(reason string, required bool) error {
	if reason == "" && !required {
		return nil
	}
	if !reasonPattern.MatchString(reason) {
		return fmt.Errorf("%w: run reason %q is not a CamelCase word of up to 64 characters", ErrInvalid, reason)
	}
	return nil
}

// checkRef refuses a reference that is set but not "namespace/name".
func checkRef(field, v string) error {
	if err := checkText(field, v); err != nil {
		return err
	}
	if v == "" {
		return nil
	}
	ns, name, ok := strings.Cut(v, "/")
	if !ok || ns == "" || name == "" || strings.Contains(name, "/") {
		return fmt.Errorf("%w: %s %q is not namespace/name", ErrInvalid, field, v)
	}
	return nil
}

func (c RunCommand) check() error {
	if len(c.Argv) == 0 {
		return fmt.Errorf("%w: a run needs a command (argv)", ErrInvalid)
	}
	for _, a := range c.Argv {
		if err := checkText("argv", a); err != nil {
			return err
		}
	}
	for _, n := range c.EnvNames {
		if err := checkText("env name", n); err != nil {
			return err
		}
		if n == "" {
			return fmt.Errorf("%w: empty env name", ErrInvalid)
		}
		if name, _, ok := strings.Cut(n, "="); ok {
			// The error names the variable alone: what follows "=" may
			// be a secret, and errors get logged.
			return fmt.Errorf("%w: env name %q carries a value; only variable names are stored", ErrInvalid, name)
		}
	}
	if c.TimeoutSeconds < 0 {
		return fmt.Errorf("%w: negative run timeout", ErrInvalid)
	}
	for _, a := range c.Artifacts {
		if err := checkText("artifact path", a); err != nil {
			return err
		}
	}
	return checkText("cwd", c.Cwd)
}

// newRunID returns "run-" and 80 random bits in hex.
func newRunID() string {
	var b [10]byte
	_, _ = rand.Read(b[:]) // crypto/rand.Read never fails on Linux
	return "run-" + hex.EncodeToString(b[:])
}

// CreateRun records a new run, queued, with no attempts, and returns it
// with created true. It fills in the ID when empty and the creation time;
// the status and everything an executor sets are ignored.
//
// A start is idempotent: if the caller already started a run with the
// same non-empty request id, that run is returned, whatever state it is
// in, with created false, and r is not recorded (even if it differs). A
// given ID that another run has gives ErrConflict.
//
// ErrInvalid refuses an unknown mode, an empty argv or caller, a mode
// without what it runs in (agent id, pool or template), a reference that
// is not namespace/name, and text that a backend could not store.
func (s *Store) CreateRun(ctx context.Context, r Run) (Run, bool, error) {
	if !r.Mode.valid() {
		return Run{}, false, fmt.Errorf("%w: run mode %q", ErrInvalid, r.Mode)
	}
	if r.Caller == "" {
		return Run{}, false, fmt.Errorf("%w: a run needs a caller", ErrInvalid)
	}
	switch {
	case r.Mode == RunModeAgent && r.AgentID == "":
		return Run{}, false, fmt.Errorf("%w: an agent run needs an agent id", ErrInvalid)
	case r.Mode == RunModePool && r.Pool == "":
		return Run{}, false, fmt.Errorf("%w: a pool run needs a pool", ErrInvalid)
	case r.Mode == RunModeJob && r.Template == "":
		return Run{}, false, fmt.Errorf("%w: a job run needs a template", ErrInvalid)
	}
	if err := r.Command.check(); err != nil {
		return Run{}, false, err
	}
	switch {
	case r.BackoffLimit < 0 || r.BackoffLimit > MaxRunBackoffLimit:
		return Run{}, false, fmt.Errorf("%w: run backoff limit %d is not within 0..%d", ErrInvalid, r.BackoffLimit, MaxRunBackoffLimit)
	case r.BackoffLimit > 0 && r.Mode != RunModeJob:
		return Run{}, false, fmt.Errorf("%w: only a job run retries (backoff limit)", ErrInvalid)
	case r.ActiveDeadlineSeconds < 0:
		return Run{}, false, fmt.Errorf("%w: negative run active deadline", ErrInvalid)
	case r.TTLSecondsAfterFinished != nil && *r.TTLSecondsAfterFinished < 0:
		return Run{}, false, fmt.Errorf("%w: negative run TTL after finished", ErrInvalid)
	}
	for f, v := range map[string]string{"run id": r.ID, "request id": r.RequestID, "caller": r.Caller,
		"holder": r.Holder, "workflow id": r.WorkflowID, "agent id": r.AgentID} {
		if err := checkText(f, v); err != nil {
			return Run{}, false, err
		}
	}
	for f, v := range map[string]string{"schedule": r.Schedule, "sandbox": r.Sandbox, "template": r.Template, "pool": r.Pool} {
		if err := checkRef(f, v); err != nil {
			return Run{}, false, err
		}
	}
	cmd, err := json.Marshal(r.Command)
	if err != nil {
		return Run{}, false, fmt.Errorf("create run: encode command: %w", err)
	}
	if r.ID == "" {
		r.ID = newRunID()
	}
	if r.Mode == RunModeJob && r.AgentID == "" {
		// A job run's sandbox is its own, and so is the agent ID the
		// sandbox answers to.
		r.AgentID = r.ID
	}
	r.ExpiresAt = nil
	r.Status, r.Attempts, r.ExitCode = RunQueued, 0, nil
	r.Reason, r.Message, r.OutputBytes = "", "", 0
	r.CancelRequestedBy, r.CancelledBy, r.Executor = "", "", ""
	r.CreatedAt, r.StartedAt, r.FinishedAt, r.HeartbeatAt = s.now(), nil, nil, nil
	// No conflict target: a taken id and a repeated request (the partial
	// unique index) both leave the row out, and are told apart below.
	res, err := s.wdb.ExecContext(ctx, `INSERT INTO runs
		(id, request_id, caller, holder, workflow_id, schedule, mode, agent_id, sandbox, template, pool,
		 command, status, created_at, backoff_limit, active_deadline_seconds, ttl_seconds_after_finished)
		VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17)
		ON CONFLICT DO NOTHING`,
		r.ID, r.RequestID, r.Caller, r.Holder, r.WorkflowID, r.Schedule, string(r.Mode), r.AgentID, r.Sandbox,
		r.Template, r.Pool, string(cmd), string(r.Status), r.CreatedAt, r.BackoffLimit, r.ActiveDeadlineSeconds,
		nullInt(r.TTLSecondsAfterFinished))
	if err != nil {
		return Run{}, false, fmt.Errorf("create run: %w", err)
	}
	if n, err := res.RowsAffected(); err != nil {
		return Run{}, false, fmt.Errorf("create run: %w", err)
	} else if n == 1 {
		return r, true, nil
	}
	if r.RequestID != "" {
		prev, err := s.oneRun(ctx, s.wdb, "create run: earlier start",
			`caller = $1 AND request_id = $2`, r.Caller, r.RequestID)
		if err == nil {
			return prev, false, nil
		}
		if !errors.Is(err, ErrNotFound) {
			return Run{}, false, err
		}
	}
	return Run{}, false, fmt.Errorf("%w: run id %s is taken", ErrConflict, r.ID)
}

const runColumns = `id, request_id, caller, holder, workflow_id, schedule, mode, agent_id, sandbox, template, pool,
	command, status, attempts, exit_code, reason, message, output_bytes, cancel_requested_by, cancelled_by, executor,
	created_at, started_at, finished_at, heartbeat_at, backoff_limit, active_deadline_seconds, ttl_seconds_after_finished,
	expires_at`

func scanRun(row interface{ Scan(...any) error }) (Run, error) {
	var (
		r                                     Run
		mode, status, cmd                     string
		exit, ttl                             sql.NullInt64
		started, finished, heartbeat, expires sql.NullTime
	)
	if err := row.Scan(&r.ID, &r.RequestID, &r.Caller, &r.Holder, &r.WorkflowID, &r.Schedule, &mode, &r.AgentID,
		&r.Sandbox, &r.Template, &r.Pool, &cmd, &status, &r.Attempts, &exit, &r.Reason, &r.Message, &r.OutputBytes,
		&r.CancelRequestedBy, &r.CancelledBy, &r.Executor, &r.CreatedAt, &started, &finished, &heartbeat,
		&r.BackoffLimit, &r.ActiveDeadlineSeconds, &ttl, &expires); err != nil {
		return Run{}, err
	}
	if err := json.Unmarshal([]byte(cmd), &r.Command); err != nil {
		return Run{}, fmt.Errorf("run %s: stored command: %w", r.ID, err)
	}
	if exit.Valid {
		c := int(exit.Int64)
		r.ExitCode = &c
	}
	r.Mode, r.Status, r.CreatedAt = RunMode(mode), RunStatus(status), r.CreatedAt.UTC()
	r.StartedAt, r.FinishedAt, r.HeartbeatAt = timePtr(started), timePtr(finished), timePtr(heartbeat)
	r.ExpiresAt = timePtr(expires)
	if ttl.Valid {
		v := int(ttl.Int64)
		r.TTLSecondsAfterFinished = &v
	}
	return r, nil
}

// queryer is what reads and conditional updates run on: a pool or a
// transaction.
type queryer interface {
	QueryRowContext(ctx context.Context, query string, args ...any) *sql.Row
}

// oneRun returns the run that cond selects, or ErrNotFound.
func (s *Store) oneRun(ctx context.Context, q queryer, what, cond string, args ...any) (Run, error) {
	r, err := scanRun(q.QueryRowContext(ctx, `SELECT `+runColumns+` FROM runs WHERE `+cond, args...))
	if errors.Is(err, sql.ErrNoRows) {
		return Run{}, ErrNotFound
	}
	if err != nil {
		return Run{}, fmt.Errorf("%s: %w", what, err)
	}
	return r, nil
}

// GetRun returns the run with the given ID, or ErrNotFound.
func (s *Store) GetRun(ctx context.Context, id string) (Run, error) {
	return s.oneRun(ctx, s.db, "get run", `id = $1`, id)
}

// RunFilter selects runs to list; empty fields match every run.
type RunFilter struct {
	AgentID string
	Status  RunStatus
	Caller  string
	// Schedule keeps the runs of one schedule (namespace/name).
	Schedule string
	// Live keeps queued and running runs; Status must then be empty.
	Live bool
	// Since keeps runs created at or after it.
	Since time.Time
	// Limit is the page size: 50 when 0, at most 500.
	Limit int
	// PageToken continues a listing where the page that returned it ended.
	PageToken string
}

const (
	defaultRunPage = 50
	maxRunPage     = 500
)

// runPageToken is an opaque position in the (created_at, id) order: the
// last run of a page, in Unix microseconds and id, base64url-encoded.
func runPageToken(r Run) string {
	b := binary.BigEndian.AppendUint64(nil, uint64(r.CreatedAt.UnixMicro()))
	return base64.RawURLEncoding.EncodeToString(append(b, r.ID...))
}

func parseRunPageToken(tok string) (time.Time, string, error) {
	b, err := base64.RawURLEncoding.DecodeString(tok)
	if err != nil || len(b) <= 8 {
		return time.Time{}, "", fmt.Errorf("%w: malformed run page token", ErrInvalid)
	}
	id := string(b[8:])
	if err := checkText("run page token", id); err != nil {
		return time.Time{}, "", err
	}
	return time.UnixMicro(int64(binary.BigEndian.Uint64(b[:8]))).UTC(), id, nil
}

// ListRuns lists runs newest first, by creation time and then id, one page
// at a time. It returns the page and the token of the next one, which is
// empty on the last page. Runs created while a caller pages through the
// list are never listed twice, and none that existed is skipped unless it
// was deleted. An unknown status, a limit out of range or a token that
// ListRuns did not make give ErrInvalid.
func (s *Store) ListRuns(ctx context.Context, f RunFilter) ([]Run, string, error) {
	limit := f.Limit
	switch {
	case limit == 0:
		limit = defaultRunPage
	case limit < 0 || limit > maxRunPage:
		return nil, "", fmt.Errorf("%w: run page size %d is not within 1..%d", ErrInvalid, f.Limit, maxRunPage)
	}
	var w where
	if f.AgentID != "" {
		w.add(`agent_id = %s`, f.AgentID)
	}
	if f.Status != "" {
		if !f.Status.valid() {
			return nil, "", fmt.Errorf("%w: run status %q", ErrInvalid, f.Status)
		}
		w.add(`status = %s`, string(f.Status))
	}
	if f.Caller != "" {
		w.add(`caller = %s`, f.Caller)
	}
	if f.Schedule != "" {
		w.add(`schedule = %s`, f.Schedule)
	}
	if f.Live {
		if f.Status != "" {
			return nil, "", fmt.Errorf("%w: a run filter takes a status or live, not both", ErrInvalid)
		}
		w.add(`status IN (%s, %s)`, string(RunQueued), string(RunRunning))
	}
	if !f.Since.IsZero() {
		w.add(`created_at >= %s`, dbTime(f.Since))
	}
	if f.PageToken != "" {
		at, id, err := parseRunPageToken(f.PageToken)
		if err != nil {
			return nil, "", err
		}
		w.add(`(created_at < %s OR (created_at = %s AND id < %s))`, at, at, id)
	}
	// One more than a page says whether there is a next one.
	rows, err := s.db.QueryContext(ctx, `SELECT `+runColumns+` FROM runs`+w.String()+
		` ORDER BY created_at DESC, id DESC LIMIT `+w.arg(limit+1), w.args...)
	if err != nil {
		return nil, "", fmt.Errorf("list runs: %w", err)
	}
	out, err := collectRuns(rows, "list runs")
	if err != nil {
		return nil, "", err
	}
	if len(out) <= limit {
		return out, "", nil
	}
	out = out[:limit]
	return out, runPageToken(out[limit-1]), nil
}

func collectRuns(rows *sql.Rows, what string) ([]Run, error) {
	defer rows.Close()
	var out []Run
	for rows.Next() {
		r, err := scanRun(rows)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", what, err)
		}
		out = append(out, r)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("%s: %w", what, err)
	}
	return out, nil
}

// updateRun runs one conditional UPDATE ... RETURNING on a run. The
// condition is checked and the row changed in one statement, so of
// replicas racing on a run exactly one sees its condition hold. When it
// does not hold, the run as it stands is returned with ErrRunFinished if
// it has ended, or with the error miss makes of it otherwise; ErrNotFound
// if there is no such run.
//
// events, if set, are the events the change makes of the run as it
// becomes (see stateEvents): they are appended in the same transaction,
// under the row lock the UPDATE took, so that a run's log has its end
// exactly when the run has ended. So are the run's attempt records
// (afterRunChange).
func (s *Store) updateRun(ctx context.Context, what, id, set, cond string, miss func(Run) error,
	events func(Run) []RunEvent, args ...any) (Run, error) {
	args = append([]any{id}, args...)
	query := `UPDATE runs SET ` + set + ` WHERE id = $1 AND ` + cond
	var (
		r   Run
		err error
	)
	if events == nil {
		r, err = s.oneRunReturning(ctx, s.wdb, what, query, args...)
	} else {
		err = s.writeTx(ctx, func(tx *sql.Tx) error {
			var err error
			if r, err = s.oneRunReturning(ctx, tx, what, query, args...); err != nil {
				return err
			}
			if err := s.afterRunChange(ctx, tx, &r); err != nil {
				return fmt.Errorf("%s: %w", what, err)
			}
			_, err = s.insertRunEvents(ctx, tx, r.ID, events(r))
			return err
		})
	}
	if !errors.Is(err, ErrNotFound) {
		return r, err
	}
	// Terminal states are final, so a run read after a missed update that
	// is terminal was terminal when the update missed it.
	cur, err := s.oneRun(ctx, s.wdb, what, `id = $1`, id)
	if err != nil {
		return Run{}, err
	}
	if cur.Status.Terminal() {
		return cur, fmt.Errorf("%s %s: %w (%s)", what, id, ErrRunFinished, cur.Status)
	}
	if miss != nil {
		return cur, miss(cur)
	}
	// Without miss the condition is that the run is live, and a live run
	// cannot have been missed; a run deleted and made again under its id
	// meanwhile is the only way here.
	return cur, fmt.Errorf("%w: %s %s: run is %s", ErrConflict, what, id, cur.Status)
}

func (s *Store) oneRunReturning(ctx context.Context, q queryer, what, query string, args ...any) (Run, error) {
	r, err := scanRun(q.QueryRowContext(ctx, query+` RETURNING `+runColumns, args...))
	if errors.Is(err, sql.ErrNoRows) {
		return Run{}, ErrNotFound
	}
	if err != nil {
		return Run{}, fmt.Errorf("%s: %w", what, err)
	}
	return r, nil
}

// StartRunAttempt records that executor (a replica's identity) starts an
// attempt of a queued or running run in sandbox (namespace/name; empty
// keeps the one recorded). The run becomes running, its attempts count
// up, it gets a heartbeat now, and its first start time is kept. Starting
// a running run is how another replica takes over one whose executor was
// lost; the previous executor's heartbeats fail from then on. A run that
// had a cancel requested still starts, and the caller must honour
// CancelRequestedBy. A finished run gives ErrRunFinished. The start is
// written to the run's event log (a state event with the attempt).
func (s *Store) StartRunAttempt(ctx context.Context, id, executor, sandbox string) (Run, error) {
	if executor == "" {
		return Run{}, fmt.Errorf("%w: a run attempt needs an executor", ErrInvalid)
	}
	if err := checkText("executor", executor); err != nil {
		return Run{}, err
	}
	if err := checkRef("sandbox", sandbox); err != nil {
		return Run{}, err
	}
	return s.updateRun(ctx, "start run attempt", id,
		`status = 'running', attempts = attempts + 1, started_at = COALESCE(started_at, $2), heartbeat_at = $2,
		 executor = $3, sandbox = CASE WHEN $4 = '' THEN sandbox ELSE $4 END`,
		`status IN ('queued', 'running')`, nil, func(r Run) []RunEvent { return stateEvents(r, true) },
		s.now(), executor, sandbox)
}

// HeartbeatRun records that executor still runs the run, and returns it,
// so that the executor learns of a cancel request (CancelRequestedBy). It
// succeeds only while the run is running under that executor: otherwise
// the run is returned with ErrConflict (another replica took it over, or
// it never started) or ErrRunFinished, and the executor must stop.
func (s *Store) HeartbeatRun(ctx context.Context, id, executor string) (Run, error) {
	return s.updateRun(ctx, "heartbeat run", id, `heartbeat_at = $2`,
		`status = 'running' AND executor = $3`,
		func(cur Run) error {
			return fmt.Errorf("%w: heartbeat run %s: it is %s under executor %q, not %q",
				ErrConflict, id, cur.Status, cur.Executor, executor)
		}, nil, s.now(), executor)
}

// RequestRunCancel asks for a run to be cancelled, on behalf of by. A
// queued run has no executor to ask, so it ends at once, cancelled by by,
// with reason Cancelled. A running run gets CancelRequestedBy, kept from
// the first request, and goes on until its executor finishes it. The run
// is returned as it stands; a finished run is returned unchanged with
// ErrRunFinished.
func (s *Store) RequestRunCancel(ctx context.Context, id, by string) (Run, error) {
	if by == "" {
		return Run{}, fmt.Errorf("%w: a cancel request needs a requester", ErrInvalid)
	}
	if err := checkText("cancel requester", by); err != nil {
		return Run{}, err
	}
	// Every right-hand side sees the row as it was, so "status = 'queued'"
	// means the same in each.
	return s.updateRun(ctx, "cancel run", id,
		`cancel_requested_by = CASE WHEN cancel_requested_by = '' THEN $2 ELSE cancel_requested_by END,
		 cancelled_by = CASE WHEN status = 'queued' THEN $2 ELSE cancelled_by END,
		 reason = CASE WHEN status = 'queued' THEN 'Cancelled' ELSE reason END,
		 message = CASE WHEN status = 'queued' THEN 'cancelled before it started' ELSE message END,
		 finished_at = CASE WHEN status = 'queued' THEN $3 ELSE finished_at END,
		 status = CASE WHEN status = 'queued' THEN 'cancelled' ELSE status END`,
		`status IN ('queued', 'running')`, nil, func(r Run) []RunEvent {
			if r.Status != RunCancelled {
				return nil // a cancel request of a running run
			}
			return stateEvents(r, false)
		}, by, s.now())
}

// RunResult is how a run ended, for FinishRun.
type RunResult struct {
	// Status must be terminal.
	Status RunStatus
	// ExitCode is the command's exit status, if it exited.
	ExitCode *int
	// Reason is a CamelCase word, such as NonZeroExit or DeadlineExceeded.
	Reason string
	// Message says in words how the run ended. Known secret formats in
	// it are redacted: it may quote the command's output.
	Message     string
	OutputBytes int64
	// CancelledBy is who cancelled a cancelled run; empty means whoever
	// requested it.
	CancelledBy string
}

// FinishRun ends a queued or running run with r and records when. A run
// finishes once: finishing a finished run returns it unchanged with
// ErrRunFinished, so of replicas racing to end a run (finish, cancel,
// stale sweep) exactly one decides how it ended. Every way a run ends
// (this, the cancel of a queued run, the stale sweep) writes the final
// state and the end event to its log, in the same transaction.
func (s *Store) FinishRun(ctx context.Context, id string, r RunResult) (Run, error) {
	if !r.Status.Terminal() {
		return Run{}, fmt.Errorf("%w: run status %q is not a final one", ErrInvalid, r.Status)
	}
	if err := checkReason(r.Reason, false); err != nil {
		return Run{}, err
	}
	if r.OutputBytes < 0 {
		return Run{}, fmt.Errorf("%w: negative run output size", ErrInvalid)
	}
	for f, v := range map[string]string{"message": r.Message, "cancelled by": r.CancelledBy} {
		if err := checkText(f, v); err != nil {
			return Run{}, err
		}
	}
	if r.CancelledBy != "" && r.Status != RunCancelled {
		return Run{}, fmt.Errorf("%w: only a cancelled run has a canceller", ErrInvalid)
	}
	var exit sql.NullInt64
	if r.ExitCode != nil {
		exit = sql.NullInt64{Int64: int64(*r.ExitCode), Valid: true}
	}
	return s.updateRun(ctx, "finish run", id,
		`status = $2, exit_code = $3, reason = $4, message = $5, output_bytes = $6, finished_at = $7,
		 cancelled_by = CASE WHEN $2 = 'cancelled' AND $8 = '' THEN cancel_requested_by ELSE $8 END`,
		`status IN ('queued', 'running')`, nil, func(r Run) []RunEvent { return stateEvents(r, false) },
		string(r.Status), exit, r.Reason, redact.String(r.Message), r.OutputBytes, s.now(), r.CancelledBy)
}

// FailStaleRuns fails every running run whose last heartbeat is before
// heartbeatBefore, and every queued run created before it, with reason
// (CamelCase, such as ExecutorLost) and message, and returns them. It is
// what brings a run whose executor or control plane died to a definite
// end. A run that another replica finishes meanwhile is left as that one
// ended it, and not returned.
func (s *Store) FailStaleRuns(ctx context.Context, heartbeatBefore time.Time, reason, message string) ([]Run, error) {
	if err := checkReason(reason, true); err != nil {
		return nil, err
	}
	if err := checkText("message", message); err != nil {
		return nil, err
	}
	var failed []Run
	err := s.writeTx(ctx, func(tx *sql.Tx) error {
		rows, err := tx.QueryContext(ctx, `UPDATE runs
			SET status = 'failed', reason = $2, message = $3, finished_at = $4
			WHERE (status = 'running' AND COALESCE(heartbeat_at, started_at, created_at) < $1)
			   OR (status = 'queued' AND created_at < $1)
			RETURNING `+runColumns,
			dbTime(heartbeatBefore), reason, redact.String(message), s.now())
		if err != nil {
			return fmt.Errorf("fail stale runs: %w", err)
		}
		if failed, err = collectRuns(rows, "fail stale runs"); err != nil {
			return err
		}
		// Each failed run's log ends, under the row lock the UPDATE took.
		for i := range failed {
			r := &failed[i]
			if err := s.afterRunChange(ctx, tx, r); err != nil {
				return fmt.Errorf("fail stale runs: %w", err)
			}
			if _, err := s.insertRunEvents(ctx, tx, r.ID, stateEvents(*r, false)); err != nil {
				return fmt.Errorf("fail stale runs: %w", err)
			}
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	return failed, nil
}

// DeleteFinishedRuns deletes the records of runs that finished before
// finishedBefore, with their event logs and artifact records, for
// retention, and returns how many runs it deleted. Live runs are never
// deleted, nor the runs with a TTL of their own (DeleteExpiredRuns
// deletes those), nor runs whose artifacts may still have objects in the
// object store (see RunArtifactsToDelete): their records are what finds
// the objects, so they go only after them.
func (s *Store) DeleteFinishedRuns(ctx context.Context, finishedBefore time.Time) (int64, error) {
	res, err := s.wdb.ExecContext(ctx, `DELETE FROM runs
		WHERE status IN ('succeeded', 'failed', 'timed_out', 'cancelled') AND finished_at < $1
		  AND ttl_seconds_after_finished IS NULL AND `+noArtifactObjects,
		dbTime(finishedBefore))
	if err != nil {
		return 0, fmt.Errorf("delete finished runs: %w", err)
	}
	n, err := res.RowsAffected()
	if err != nil {
		return 0, fmt.Errorf("delete finished runs: %w", err)
	}
	return n, nil
}

// PruneScheduleRuns deletes the records of schedule's finished runs beyond
// the keepSucceeded newest that succeeded and the keepFailed newest that
// ended otherwise (failed, timed out, cancelled), newest by creation, and
// returns how many it deleted: a schedule's history limits. Live runs are
// never deleted, nor are runs whose artifacts may still have objects in
// the object store: retention deletes those, objects first.
func (s *Store) PruneScheduleRuns(ctx context.Context, schedule string, keepSucceeded, keepFailed int) (int64, error) {
	if schedule == "" {
		return 0, fmt.Errorf("%w: prune schedule runs needs a schedule", ErrInvalid)
	}
	if err := checkRef("schedule", schedule); err != nil {
		return 0, err
	}
	if keepSucceeded < 0 || keepFailed < 0 {
		return 0, fmt.Errorf("%w: negative run history limit", ErrInvalid)
	}
	// Both backends rank within one statement, so a run finishing
	// meanwhile is either ranked or left for the next prune.
	res, err := s.wdb.ExecContext(ctx, `DELETE FROM runs WHERE id IN (
		SELECT id FROM (
			SELECT id, status, ROW_NUMBER() OVER (
				PARTITION BY status = 'succeeded' ORDER BY created_at DESC, id DESC) AS n
			FROM runs
			WHERE schedule = $1 AND status IN ('succeeded', 'failed', 'timed_out', 'cancelled')
		) ranked
		WHERE (status = 'succeeded' AND n > $2) OR (status <> 'succeeded' AND n > $3))
		AND `+noArtifactObjects,
		schedule, keepSucceeded, keepFailed)
	if err != nil {
		return 0, fmt.Errorf("prune runs of schedule %s: %w", schedule, err)
	}
	n, err := res.RowsAffected()
	if err != nil {
		return 0, fmt.Errorf("prune runs of schedule %s: %w", schedule, err)
	}
	return n, nil
}

// nullInt maps an optional integer to a column value.
func nullInt(v *int) sql.NullInt64 {
	if v == nil {
		return sql.NullInt64{}
	}
	return sql.NullInt64{Int64: int64(*v), Valid: true}
}

// RunAttempt is the record of one attempt of a run: a job run's first
// try and its retries, or an attempt that another executor took over.
type RunAttempt struct {
	RunID string
	// Attempt numbers a run's attempts from 1.
	Attempt int
	// Sandbox is the namespace/name of the sandbox it ran in, once known.
	Sandbox string
	// Status is running while the attempt goes on, then terminal.
	Status      RunStatus
	ExitCode    *int
	Reason      string
	Message     string
	OutputBytes int64
	StartedAt   time.Time
	FinishedAt  *time.Time
}

// afterRunChange keeps a run's attempt records and its expiry in step
// with a change of its row, in the transaction of the change: a start
// (the run running with an attempt not recorded yet) opens the attempt's
// record and closes any earlier one left open, which was its lost
// executor's; an end closes the open attempt as the run ended, and
// stamps the run's expiry when it has a TTL of its own.
func (s *Store) afterRunChange(ctx context.Context, tx *sql.Tx, r *Run) error {
	switch {
	case r.Status == RunRunning && r.Attempts > 0:
		at := s.now()
		if r.HeartbeatAt != nil {
			at = *r.HeartbeatAt
		}
		if _, err := tx.ExecContext(ctx, `UPDATE run_attempts
			SET status = 'failed', reason = $3, message = 'its executor was lost, and another took the run over', finished_at = $4
			WHERE run_id = $1 AND attempt < $2 AND finished_at IS NULL`,
			r.ID, r.Attempts, "ExecutorLost", at); err != nil {
			return fmt.Errorf("close lost attempts: %w", err)
		}
		if _, err := tx.ExecContext(ctx, `INSERT INTO run_attempts (run_id, attempt, sandbox, status, started_at)
			VALUES ($1, $2, $3, 'running', $4) ON CONFLICT DO NOTHING`,
			r.ID, r.Attempts, r.Sandbox, at); err != nil {
			return fmt.Errorf("record attempt: %w", err)
		}
	case r.Status.Terminal() && r.FinishedAt != nil:
		// The run's output size is its attempts' sum: the last attempt
		// gets what the earlier ones did not write.
		var before int64
		if err := tx.QueryRowContext(ctx, `SELECT COALESCE(SUM(output_bytes), 0) FROM run_attempts
			WHERE run_id = $1 AND finished_at IS NOT NULL`, r.ID).Scan(&before); err != nil {
			return fmt.Errorf("sum attempt output: %w", err)
		}
		var exit sql.NullInt64
		if r.ExitCode != nil {
			exit = sql.NullInt64{Int64: int64(*r.ExitCode), Valid: true}
		}
		if _, err := tx.ExecContext(ctx, `UPDATE run_attempts
			SET status = $2, exit_code = $3, reason = $4, message = $5, output_bytes = $6, finished_at = $7
			WHERE run_id = $1 AND finished_at IS NULL`,
			r.ID, string(r.Status), exit, r.Reason, r.Message, max(r.OutputBytes-before, 0), *r.FinishedAt); err != nil {
			return fmt.Errorf("close attempt: %w", err)
		}
		if r.TTLSecondsAfterFinished != nil && r.ExpiresAt == nil {
			exp := r.FinishedAt.Add(time.Duration(*r.TTLSecondsAfterFinished) * time.Second)
			if _, err := tx.ExecContext(ctx, `UPDATE runs SET expires_at = $2 WHERE id = $1`, r.ID, exp); err != nil {
				return fmt.Errorf("set run expiry: %w", err)
			}
			r.ExpiresAt = &exp
		}
	}
	return nil
}

// FinishRunAttempt closes attempt of the run with res while the run goes
// on: a job run's failed attempt that is retried. The run's own end
// closes its last attempt (FinishRun). An attempt that is not open (not
// started, or closed already) gives ErrConflict; a run that ended,
// ErrRunFinished.
func (s *Store) FinishRunAttempt(ctx context.Context, id string, attempt int, res RunResult) error {
	if !res.Status.Terminal() {
		return fmt.Errorf("%w: attempt status %q is not a final one", ErrInvalid, res.Status)
	}
	if err := checkReason(res.Reason, false); err != nil {
		return err
	}
	if res.OutputBytes < 0 {
		return fmt.Errorf("%w: negative attempt output size", ErrInvalid)
	}
	if err := checkText("message", res.Message); err != nil {
		return err
	}
	var exit sql.NullInt64
	if res.ExitCode != nil {
		exit = sql.NullInt64{Int64: int64(*res.ExitCode), Valid: true}
	}
	return s.writeTx(ctx, func(tx *sql.Tx) error {
		// Only while the run is live: a run that ended closed its
		// attempts with its end.
		var status string
		err := tx.QueryRowContext(ctx, `SELECT status FROM runs WHERE id = $1`, id).Scan(&status)
		if errors.Is(err, sql.ErrNoRows) {
			return ErrNotFound
		}
		if err != nil {
			return fmt.Errorf("finish run attempt: %w", err)
		}
		if RunStatus(status).Terminal() {
			return fmt.Errorf("finish run attempt %s/%d: %w (%s)", id, attempt, ErrRunFinished, status)
		}
		res, err := tx.ExecContext(ctx, `UPDATE run_attempts
			SET status = $3, exit_code = $4, reason = $5, message = $6, output_bytes = $7, finished_at = $8
			WHERE run_id = $1 AND attempt = $2 AND finished_at IS NULL`,
			id, attempt, string(res.Status), exit, res.Reason, redact.String(res.Message), res.OutputBytes, s.now())
		if err != nil {
			return fmt.Errorf("finish run attempt: %w", err)
		}
		if n, err := res.RowsAffected(); err != nil {
			return fmt.Errorf("finish run attempt: %w", err)
		} else if n == 0 {
			return fmt.Errorf("%w: attempt %d of run %s is not open", ErrConflict, attempt, id)
		}
		return nil
	})
}

// ListRunAttempts returns the run's attempts, first first. A run without
// attempts (queued, or cancelled before it started) has none; so has a
// run that does not exist.
func (s *Store) ListRunAttempts(ctx context.Context, id string) ([]RunAttempt, error) {
	rows, err := s.db.QueryContext(ctx, `SELECT run_id, attempt, sandbox, status, exit_code, reason, message,
		output_bytes, started_at, finished_at FROM run_attempts WHERE run_id = $1 ORDER BY attempt`, id)
	if err != nil {
		return nil, fmt.Errorf("list run attempts: %w", err)
	}
	defer rows.Close()
	var out []RunAttempt
	for rows.Next() {
		var (
			a        RunAttempt
			status   string
			exit     sql.NullInt64
			finished sql.NullTime
		)
		if err := rows.Scan(&a.RunID, &a.Attempt, &a.Sandbox, &status, &exit, &a.Reason, &a.Message,
			&a.OutputBytes, &a.StartedAt, &finished); err != nil {
			return nil, fmt.Errorf("list run attempts: %w", err)
		}
		a.Status, a.StartedAt, a.FinishedAt = RunStatus(status), a.StartedAt.UTC(), timePtr(finished)
		if exit.Valid {
			c := int(exit.Int64)
			a.ExitCode = &c
		}
		out = append(out, a)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("list run attempts: %w", err)
	}
	return out, nil
}

// PlaceRun records where a running run executes once its executor knows:
// a pool run's sandbox and the agent ID it answers to are those of the
// pool sandbox it leased, after the attempt started. It succeeds only
// while executor runs it, as HeartbeatRun; the open attempt gets the
// sandbox too.
func (s *Store) PlaceRun(ctx context.Context, id, executor, agentID, sandbox string) (Run, error) {
	if err := checkText("agent id", agentID); err != nil {
		return Run{}, err
	}
	if err := checkRef("sandbox", sandbox); err != nil {
		return Run{}, err
	}
	var r Run
	err := s.writeTx(ctx, func(tx *sql.Tx) error {
		var err error
		r, err = s.oneRunReturning(ctx, tx, "place run", `UPDATE runs SET agent_id = $2, sandbox = $3
			WHERE id = $1 AND status = 'running' AND executor = $4`, id, agentID, sandbox, executor)
		if err != nil {
			return err
		}
		_, err = tx.ExecContext(ctx, `UPDATE run_attempts SET sandbox = $3 WHERE run_id = $1 AND attempt = $2`,
			id, r.Attempts, sandbox)
		if err != nil {
			return fmt.Errorf("place run: %w", err)
		}
		return nil
	})
	if !errors.Is(err, ErrNotFound) {
		return r, err
	}
	cur, err := s.oneRun(ctx, s.wdb, "place run", `id = $1`, id)
	if err != nil {
		return Run{}, err
	}
	if cur.Status.Terminal() {
		return cur, fmt.Errorf("place run %s: %w (%s)", id, ErrRunFinished, cur.Status)
	}
	return cur, fmt.Errorf("%w: place run %s: it is %s under executor %q, not %q", ErrConflict, id, cur.Status, cur.Executor, executor)
}

// DeleteExpiredRuns deletes the records of finished runs whose own TTL
// (TTLSecondsAfterFinished) has passed at now, with their event logs and
// attempts, and returns how many it deleted.
func (s *Store) DeleteExpiredRuns(ctx context.Context, now time.Time) (int64, error) {
	res, err := s.wdb.ExecContext(ctx, `DELETE FROM runs
		WHERE expires_at IS NOT NULL AND expires_at <= $1
		  AND status IN ('succeeded', 'failed', 'timed_out', 'cancelled') AND `+noArtifactObjects, dbTime(now))
	if err != nil {
		return 0, fmt.Errorf("delete expired runs: %w", err)
	}
	n, err := res.RowsAffected()
	if err != nil {
		return 0, fmt.Errorf("delete expired runs: %w", err)
	}
	return n, nil
}
