package supervisorapi

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/url"
	"time"
)

// The execution contract: cached Python environments and code execution
// with requirements and inline files.
//
//	POST   /v1/execute            ExecuteRequest -> ExecuteResult
//	GET    /v1/envs               -> EnvList
//	POST   /v1/envs               EnvRequest -> EnvResult (create or reuse)
//	DELETE /v1/envs/{name}        -> EnvInfo (the environment removed)
//	GET    /health                -> Health, as /healthz
const (
	PathExecute = "/v1/execute"
	// PathEnvs lists and creates environments; one is addressed as
	// PathEnvs + "/" + name.
	PathEnvs = "/v1/envs"
	// PathHealthShort is the short name of the health endpoint; it serves
	// what PathHealth does.
	PathHealthShort = "/health"

	// ToolPythonExecute is the only tool_name /v1/execute runs.
	ToolPythonExecute = "python_execute"

	// Outcomes in ExecuteResult.Status.
	ExecuteSuccess = "success" // exit status 0
	ExecuteError   = "error"   // non-zero exit or ended by a signal
	ExecuteTimeout = "timeout" // killed when timeout_seconds ran out

	// CodeEnvBuildFailed (declared with the other codes) is an
	// environment whose installer failed.

	// MaxExecuteFiles bounds the inline files of one request.
	MaxExecuteFiles = 1000
)

// ExecuteRequest runs Python code, optionally in a cached virtual
// environment, in a fresh directory holding Files. The code runs like
// python_exec (python -u -c, same environment rules, process group,
// output cap and timeout limits); the directory is its working directory,
// and what the run leaves in it comes back in ExecuteResult.FilesProduced.
type ExecuteRequest struct {
	// ToolName is empty or ToolPythonExecute.
	ToolName string `json:"tool_name,omitempty"`
	Code     string `json:"code"`
	// Requirements are installed into the environment before the code
	// runs: names with version specifiers ("pandas>=2.0"), never URLs or
	// paths. With EnvName, the environment of that name is used, and
	// rebuilt if it holds other requirements; without, the environment is
	// the one for this requirement set, shared with every run asking for
	// the same set.
	Requirements []string `json:"requirements,omitempty"`
	// EnvName alone runs in that existing environment as it is; it is
	// not_found if it does not exist (or was evicted). Neither EnvName nor
	// Requirements runs the sandbox's own python3.
	EnvName string `json:"env_name,omitempty"`
	// TimeoutSeconds bounds the code's run, not the environment's build
	// (the supervisor's -env-create-timeout does). Limits as python_exec.
	TimeoutSeconds int `json:"timeout_seconds,omitempty"`
	// Files are written to the run's directory before the code runs:
	// relative path -> content (base64 in JSON, so any bytes).
	Files map[string][]byte `json:"files,omitempty"`
	// PythonIndex picks the package index for a new environment; it must be
	// one of the supervisor's configured indexes when any are configured.
	PythonIndex string `json:"python_index,omitempty"`
	// Stdin, Env and MaxOutputBytes are as for PythonRequest.
	Stdin          string            `json:"stdin,omitempty"`
	Env            map[string]string `json:"env,omitempty"`
	MaxOutputBytes int64             `json:"max_output_bytes,omitempty"`
}

// ExecuteResult is the outcome of code that was started. As with
// CommandResult, a failing or timed-out run is a result, not an error.
type ExecuteResult struct {
	// Status is ExecuteSuccess, ExecuteError or ExecuteTimeout.
	Status string `json:"status"`
	// Output is the standard output, Stderr the standard error, both
	// UTF-8 and under one cap as for commands.
	Output   string `json:"output"`
	Stderr   string `json:"stderr"`
	ExitCode int    `json:"exit_code"`
	// ExecutionTimeMS is the code's run; EnvSetupMS is the time spent
	// getting its environment (building it, or waiting for a build).
	ExecutionTimeMS int64 `json:"execution_time_ms"`
	// FilesProduced holds the regular files the run created or changed in
	// its directory (inputs left as they were are not returned), by
	// relative path, within the supervisor's size caps; FilesOmitted lists
	// those left out and why.
	FilesProduced map[string][]byte `json:"files_produced"`
	FilesOmitted  []OmittedFile     `json:"files_omitted,omitempty"`
	Signal        string            `json:"signal,omitempty"`
	TimedOut      bool              `json:"timed_out"`
	Truncated     bool              `json:"truncated"`
	// Env is the environment the code ran in; nil for the sandbox's own
	// python3.
	Env        *ExecuteEnv `json:"env,omitempty"`
	EnvSetupMS int64       `json:"env_setup_ms"`
}

// ExecuteEnv names the environment a run used.
type ExecuteEnv struct {
	Name string `json:"name"`
	// Created is set when this request built the environment; otherwise it
	// was cached (or built by a concurrent request this one waited for).
	Created       bool     `json:"created"`
	Packages      []string `json:"packages"`
	PythonVersion string   `json:"python_version"`
}

// OmittedFile is a produced file that was not returned.
type OmittedFile struct {
	Path      string `json:"path"`
	SizeBytes int64  `json:"size_bytes"`
	// Reason is "file_too_large", "total_too_large", "too_many_files" or
	// "not_regular" (a symbolic link, socket or the like).
	Reason string `json:"reason"`
}

// EnvRequest creates an environment, or finds it cached.
type EnvRequest struct {
	// Name names the environment; empty means the one for Requirements.
	Name         string   `json:"name,omitempty"`
	Requirements []string `json:"requirements,omitempty"`
	PythonIndex  string   `json:"python_index,omitempty"`
}

// EnvInfo describes one cached environment. The first fields are the
// environment as routing by environment reads it.
type EnvInfo struct {
	Name string `json:"name"`
	// Packages are the installed distributions, "name==version",
	// dependencies included.
	Packages      []string  `json:"packages"`
	PythonVersion string    `json:"python_version"`
	CreatedAt     time.Time `json:"created_at"`
	LastUsedAt    time.Time `json:"last_used_at"`
	// Requirements are as asked for, in canonical spelling.
	Requirements []string `json:"requirements"`
	// SizeBytes is the disk the environment uses, measured when built.
	SizeBytes int64 `json:"size_bytes"`
	// InUse counts the runs using it now; those are never evicted.
	InUse int `json:"in_use"`
	// State is EnvStateReady, or EnvStateUnverified for an environment
	// found on disk (restored with the workspace after an idle stop) whose
	// interpreter is checked at its first use; one that no longer matches
	// is rebuilt then.
	State string `json:"state,omitempty"`
}

// The states of an environment in EnvInfo.
const (
	EnvStateReady      = "ready"
	EnvStateUnverified = "unverified"
)

// EnvResult is the answer to POST /v1/envs.
type EnvResult struct {
	EnvInfo
	// Created is set when this request built it.
	Created    bool  `json:"created"`
	DurationMS int64 `json:"duration_ms"`
}

// EnvList is the body of GET /v1/envs.
type EnvList struct {
	Environments []EnvInfo `json:"environments"`
	EnvCache
}

// EnvCache is the state of the environment cache. Least recently used
// idle environments are evicted past either limit.
type EnvCache struct {
	Count      int   `json:"count"`
	MaxCount   int   `json:"max_count"`
	TotalBytes int64 `json:"total_bytes"`
	MaxBytes   int64 `json:"max_bytes"`
	// Building counts environments being built now.
	Building int `json:"building"`
	// Installer is "uv" or "pip".
	Installer string `json:"installer"`
	// TTLSeconds is the time-to-live of an idle environment; zero for
	// none.
	TTLSeconds int64 `json:"ttl_seconds,omitempty"`
}

// EnvPath is the URL path of the named environment.
func EnvPath(name string) string { return PathEnvs + "/" + url.PathEscape(name) }

// Execute runs code (/v1/execute).
func (c *Client) Execute(ctx context.Context, req ExecuteRequest) (*ExecuteResult, error) {
	body, err := json.Marshal(req)
	if err != nil {
		return nil, fmt.Errorf("encode execute request: %w", err)
	}
	var res ExecuteResult
	if err := c.do(ctx, http.MethodPost, PathExecute, body, &res); err != nil {
		return nil, err
	}
	return &res, nil
}

// ListEnvs lists the cached environments.
func (c *Client) ListEnvs(ctx context.Context) (*EnvList, error) {
	var res EnvList
	if err := c.do(ctx, http.MethodGet, PathEnvs, nil, &res); err != nil {
		return nil, err
	}
	return &res, nil
}

// EnsureEnv creates an environment, or finds it cached.
func (c *Client) EnsureEnv(ctx context.Context, req EnvRequest) (*EnvResult, error) {
	body, err := json.Marshal(req)
	if err != nil {
		return nil, fmt.Errorf("encode env request: %w", err)
	}
	var res EnvResult
	if err := c.do(ctx, http.MethodPost, PathEnvs, body, &res); err != nil {
		return nil, err
	}
	return &res, nil
}

// DeleteEnv removes an environment; one in use goes once its runs end.
func (c *Client) DeleteEnv(ctx context.Context, name string) (*EnvInfo, error) {
	var res EnvInfo
	if err := c.do(ctx, http.MethodDelete, EnvPath(name), nil, &res); err != nil {
		return nil, err
	}
	return &res, nil
}
