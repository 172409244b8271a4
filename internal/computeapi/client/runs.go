package client

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"time"

	"github.com/agentbox/terraform-provider-agentbox/internal/wire"
)

// Runs: a command executed to completion in a sandbox, with a record that
// outlives the call that started it.
//
//	POST /v1/runs               StartRunRequest -> Run (202 new, 200 a repeated request_id)
//	GET  /v1/runs/{id}          -> Run
//	GET  /v1/runs?agent_id=&status=&schedule=&since=&page_token=&limit= -> RunList
//	POST /v1/runs/{id}/cancel   -> Run (200, also when it had already finished)

// PathRuns starts and lists runs.
const PathRuns = "/v1/runs"

// PathRun is one run's record.
func PathRun(id string) string { return PathRuns + "/" + url.PathEscape(id) }

// PathRunCancel asks for a run to be cancelled.
func PathRunCancel(id string) string { return PathRun(id) + "/cancel" }

// Run modes: where a run executes.
const (
	// RunModeAgent runs in the sandbox of an agent (AgentID).
	RunModeAgent = "agent"
	// RunModePool runs in a ready sandbox leased from a warm pool (Pool),
	// recycled after the run. Needs an admin token, as pool leases do.
	RunModePool = "pool"
	// RunModeJob runs in a sandbox made for the run from a template
	// (Template), removed after the run; failed attempts are retried up
	// to BackoffLimit times. Needs an admin token.
	RunModeJob = "job"
)

// MaxRunBackoffLimit bounds a job run's BackoffLimit.
const MaxRunBackoffLimit = 10

// EnvRunAttempt is the variable a job run's command gets its attempt
// number in (1 for the first, 2 for the first retry...).
const EnvRunAttempt = "AGENTBOX_RUN_ATTEMPT"

// Run statuses: queued and running are live, the others final.
const (
	RunQueued    = "queued"
	RunRunning   = "running"
	RunSucceeded = "succeeded"
	RunFailed    = "failed"
	RunTimedOut  = "timed_out"
	RunCancelled = "cancelled"
)

// StartRunRequest starts a run of Command in AgentID's sandbox.
type StartRunRequest struct {
	AgentID string   `json:"agent_id"`
	Command []string `json:"command"`
	// Env is given to the command; only its names are recorded.
	Env   map[string]string `json:"env,omitempty"`
	Cwd   string            `json:"cwd,omitempty"`
	Stdin string            `json:"stdin,omitempty"`
	// TimeoutSeconds bounds the command; 0 means the supervisor's default
	// (60 s). The record holds the timeout that applied.
	TimeoutSeconds int `json:"timeout_seconds,omitempty"`
	// RequestID makes the start idempotent per caller: a second start
	// with the same request id returns the first run.
	RequestID  string `json:"request_id,omitempty"`
	WorkflowID string `json:"workflow_id,omitempty"`
	// Mode is RunModeAgent (the default), RunModePool or RunModeJob.
	Mode string `json:"mode,omitempty"`
	// Pool is the warm pool (namespace/name) a pool run leases its
	// sandbox from; pool runs only.
	Pool string `json:"pool,omitempty"`
	// Template is the SandboxTemplate (namespace/name) a job run's
	// sandbox is made from; job runs only.
	Template string `json:"template,omitempty"`
	// PoolRequirements and PoolEnvName route a pool run's lease as
	// AcquireLeaseRequest's Requirements and EnvName route a pool lease:
	// to a free sandbox holding that Python environment first. A job
	// run's sandbox, when it adopts a warm sandbox of its template, takes
	// one holding it the same way (its sandbox's python-env-routing
	// annotation says how it went). Pool and job runs; at most one of the
	// two.
	PoolRequirements []string `json:"pool_requirements,omitempty"`
	PoolEnvName      string   `json:"pool_env_name,omitempty"`
	// BackoffLimit is how many times a job run's failed attempt is
	// retried, in the same sandbox, after a backoff that doubles from
	// attempt to attempt up to a cap; 0..MaxRunBackoffLimit, job runs only.
	BackoffLimit int `json:"backoff_limit,omitempty"`
	// ActiveDeadlineSeconds bounds the whole run from its start, waits
	// and retries included: when it passes, the command is killed and the
	// run ends timed_out with reason DeadlineExceeded. 0: no bound.
	ActiveDeadlineSeconds int `json:"active_deadline_seconds,omitempty"`
	// TTLSecondsAfterFinished, when set, is how long the run's record is
	// kept after it ends, instead of the platform's retention (0: removed
	// as soon as it ends).
	TTLSecondsAfterFinished *int `json:"ttl_seconds_after_finished,omitempty"`
	// Artifacts are the files kept once the command ends: workspace paths
	// (absolute under /workspace, or relative to it) of files or
	// directories, whose segments may be globs ("/workspace/out/*.json").
	// Empty means DefaultRunArtifactPath. See ListRunArtifacts.
	Artifacts []string `json:"artifacts,omitempty"`
}

// Run is a run's record.
type Run struct {
	ID         string `json:"id"`
	RequestID  string `json:"request_id,omitempty"`
	Caller     string `json:"caller"`
	WorkflowID string `json:"workflow_id,omitempty"`
	// Schedule is the namespace/name of the RunSchedule that started the
	// run, if one did.
	Schedule string `json:"schedule,omitempty"`
	Mode     string `json:"mode"`
	AgentID  string `json:"agent_id,omitempty"`
	// Sandbox is the namespace/name of the sandbox it runs in, once known.
	Sandbox string   `json:"sandbox,omitempty"`
	Command []string `json:"command"`
	// EnvNames are the names of the variables the command was given; their
	// values are never recorded.
	EnvNames []string `json:"env_names,omitempty"`
	// ArtifactPaths are the workspace-relative paths and globs whose files
	// the run keeps as artifacts.
	ArtifactPaths  []string `json:"artifact_paths,omitempty"`
	Cwd            string   `json:"cwd,omitempty"`
	TimeoutSeconds int      `json:"timeout_seconds,omitempty"`
	Status         string   `json:"status"`
	Attempts       int      `json:"attempts"`
	// ExitCode is set when the command exited on its own.
	ExitCode *int `json:"exit_code,omitempty"`
	// Reason is a CamelCase word for how the run ended (NonZeroExit,
	// DeadlineExceeded, Cancelled, ExecutorLost, or an API error code such
	// as SandboxNotFound).
	Reason            string     `json:"reason,omitempty"`
	Message           string     `json:"message,omitempty"`
	OutputBytes       int64      `json:"output_bytes"`
	CancelRequestedBy string     `json:"cancel_requested_by,omitempty"`
	CancelledBy       string     `json:"cancelled_by,omitempty"`
	Executor          string     `json:"executor,omitempty"`
	CreatedAt         time.Time  `json:"created_at"`
	StartedAt         *time.Time `json:"started_at,omitempty"`
	FinishedAt        *time.Time `json:"finished_at,omitempty"`
	HeartbeatAt       *time.Time `json:"heartbeat_at,omitempty"`
	// Pool and Template are where a pool or job run gets its sandbox.
	Pool     string `json:"pool,omitempty"`
	Template string `json:"template,omitempty"`
	// BackoffLimit, ActiveDeadlineSeconds and TTLSecondsAfterFinished are
	// as started (see StartRunRequest).
	BackoffLimit            int  `json:"backoff_limit,omitempty"`
	ActiveDeadlineSeconds   int  `json:"active_deadline_seconds,omitempty"`
	TTLSecondsAfterFinished *int `json:"ttl_seconds_after_finished,omitempty"`
	// ExpiresAt is when the record of a run with a TTL of its own goes.
	ExpiresAt *time.Time `json:"expires_at,omitempty"`
	// AttemptHistory is every attempt of the run, first first; GetRun
	// and CancelRun return it, a listing does not.
	AttemptHistory []RunAttempt `json:"attempt_history,omitempty"`
}

// RunAttempt is one attempt of a run.
type RunAttempt struct {
	Attempt int `json:"attempt"`
	// Sandbox is the namespace/name of the sandbox it ran in, once known.
	Sandbox string `json:"sandbox,omitempty"`
	// Status is running while the attempt goes on, then how it ended.
	Status      string     `json:"status"`
	ExitCode    *int       `json:"exit_code,omitempty"`
	Reason      string     `json:"reason,omitempty"`
	Message     string     `json:"message,omitempty"`
	OutputBytes int64      `json:"output_bytes"`
	StartedAt   time.Time  `json:"started_at"`
	FinishedAt  *time.Time `json:"finished_at,omitempty"`
}

// Terminal reports whether the run has ended; its record no longer
// changes.
func (r *Run) Terminal() bool {
	switch r.Status {
	case RunSucceeded, RunFailed, RunTimedOut, RunCancelled:
		return true
	}
	return false
}

// RunList is one page of runs, newest first.
type RunList struct {
	Runs []Run `json:"runs"`
	// NextPageToken continues the listing; empty on the last page.
	NextPageToken string `json:"next_page_token,omitempty"`
}

// RunFilter selects the runs ListRuns lists; empty fields match all.
type RunFilter struct {
	AgentID string
	Status  string
	// Schedule is a RunSchedule's namespace/name.
	Schedule  string
	Since     time.Time
	PageToken string
	Limit     int
}

// StartRun starts a run and returns its record, with created false when
// the caller's request id named a run started before (which is returned
// as it stands, and not started again). An agent run executes in the
// sandbox of req.AgentID, so it presents the lease the client uses on that
// agent (see UseLease): a held sandbox refuses a run without it
// (ErrLeaseHeld). A pool or job run gets a sandbox of its own (req.Pool,
// req.Template).
func (c *Client) StartRun(ctx context.Context, req StartRunRequest) (*Run, bool, error) {
	body, err := json.Marshal(req)
	if err != nil {
		return nil, false, fmt.Errorf("encode run request: %w", err)
	}
	t := c.transport()
	if id := c.leaseOf(req.AgentID); id != "" {
		// The path names no agent, so authorize cannot tell which lease.
		authorize := t.Authorize
		t.Authorize = func(h http.Header, path string) {
			authorize(h, path)
			h.Set(HeaderLeaseID, id)
		}
	}
	resp, err := t.Send(ctx, wire.Request{Method: http.MethodPost, Path: PathRuns, Body: bytes.NewReader(body),
		ContentType: "application/json", Accept: "application/json"})
	if err != nil {
		return nil, false, err
	}
	created := resp.StatusCode == http.StatusAccepted
	var r Run
	if err := t.DecodeJSON(resp, &r); err != nil {
		return nil, false, err
	}
	return &r, created, nil
}

// GetRun returns a run's record.
func (c *Client) GetRun(ctx context.Context, id string) (*Run, error) {
	if id == "" {
		return nil, errors.New("empty run ID")
	}
	var r Run
	if err := c.do(ctx, http.MethodGet, PathRun(id), nil, &r); err != nil {
		return nil, err
	}
	return &r, nil
}

// ListRuns lists one page of runs, newest first.
func (c *Client) ListRuns(ctx context.Context, f RunFilter) (*RunList, error) {
	q := url.Values{}
	if f.AgentID != "" {
		q.Set("agent_id", f.AgentID)
	}
	if f.Status != "" {
		q.Set("status", f.Status)
	}
	if f.Schedule != "" {
		q.Set("schedule", f.Schedule)
	}
	if !f.Since.IsZero() {
		q.Set("since", f.Since.UTC().Format(time.RFC3339Nano))
	}
	if f.PageToken != "" {
		q.Set("page_token", f.PageToken)
	}
	if f.Limit > 0 {
		q.Set("limit", fmt.Sprint(f.Limit))
	}
	path := PathRuns
	if len(q) > 0 {
		path += "?" + q.Encode()
	}
	var l RunList
	if err := c.do(ctx, http.MethodGet, path, nil, &l); err != nil {
		return nil, err
	}
	return &l, nil
}

// CancelRun asks for a run to be cancelled and returns its record: a
// queued run ends cancelled at once, a running one carries
// cancel_requested_by until its executor has stopped the command, and a
// finished one is returned unchanged.
func (c *Client) CancelRun(ctx context.Context, id string) (*Run, error) {
	if id == "" {
		return nil, errors.New("empty run ID")
	}
	var r Run
	if err := c.do(ctx, http.MethodPost, PathRunCancel(id), nil, &r); err != nil {
		return nil, err
	}
	return &r, nil
}

// WaitRun polls a run every poll (1 s when 0) until it has ended, and
// returns its final record; ctx bounds the wait.
func (c *Client) WaitRun(ctx context.Context, id string, poll time.Duration) (*Run, error) {
	if poll <= 0 {
		poll = time.Second
	}
	t := time.NewTicker(poll)
	defer t.Stop()
	for {
		r, err := c.GetRun(ctx, id)
		if err != nil {
			return nil, err
		}
		if r.Terminal() {
			return r, nil
		}
		select {
		case <-ctx.Done():
			return r, fmt.Errorf("wait for run %s (%s): %w", id, r.Status, ctx.Err())
		case <-t.C:
		}
	}
}
