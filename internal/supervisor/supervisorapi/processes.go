package supervisorapi

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/url"
	"time"
)

// ProcessRequest starts a background process: a command that outlives the
// call that started it, such as a development server. The fields mean what
// they mean in CommandRequest. There is no timeout: it runs until it
// exits, is stopped with DELETE, or the supervisor shuts down.
type ProcessRequest struct {
	Command []string          `json:"command"`
	Cwd     string            `json:"cwd,omitempty"`
	Env     map[string]string `json:"env,omitempty"`
	Stdin   string            `json:"stdin,omitempty"`
}

// ProcessInfo describes a background process.
type ProcessInfo struct {
	ID      string   `json:"id"`
	Command []string `json:"command"`
	// PID is the leader's, which is also its process group's ID.
	PID       int       `json:"pid"`
	StartedAt time.Time `json:"started_at"`
	Running   bool      `json:"running"`
	// Exit is set once the leader has exited: ExitCode, Signal and
	// DurationMS (Stdout and Stderr are empty; see below).
	Exit *CommandResult `json:"exit,omitempty"`
	// Stdout and Stderr are the most recent output of each stream, at
	// most the supervisor's ring size each (64 KiB unless configured), as
	// UTF-8 with invalid bytes replaced by U+FFFD. They are only filled by
	// GetProcess and KillProcess. Truncated means older output was
	// dropped.
	Stdout    string `json:"stdout,omitempty"`
	Stderr    string `json:"stderr,omitempty"`
	Truncated bool   `json:"truncated,omitempty"`
}

// ProcessList is the body of GET /v1/processes, oldest first.
type ProcessList struct {
	Processes []ProcessInfo `json:"processes"`
}

// StartProcess starts a background process. The supervisor refuses with
// resource_exhausted when its limit of processes are all running (exited
// ones are forgotten, oldest first, to make room).
func (c *Client) StartProcess(ctx context.Context, req ProcessRequest) (*ProcessInfo, error) {
	body, err := json.Marshal(req)
	if err != nil {
		return nil, fmt.Errorf("encode process request: %w", err)
	}
	var info ProcessInfo
	if err := c.do(ctx, http.MethodPost, PathProcesses, body, &info); err != nil {
		return nil, err
	}
	return &info, nil
}

// ListProcesses lists the background processes, without their output.
func (c *Client) ListProcesses(ctx context.Context) ([]ProcessInfo, error) {
	var list ProcessList
	if err := c.do(ctx, http.MethodGet, PathProcesses, nil, &list); err != nil {
		return nil, err
	}
	return list.Processes, nil
}

// GetProcess describes one background process, with its recent output.
func (c *Client) GetProcess(ctx context.Context, id string) (*ProcessInfo, error) {
	var info ProcessInfo
	if err := c.do(ctx, http.MethodGet, PathProcesses+"/"+url.PathEscape(id), nil, &info); err != nil {
		return nil, err
	}
	return &info, nil
}

// KillProcess stops a background process if it is running (SIGTERM to its
// process group, SIGKILL after the supervisor's grace) and forgets it. It
// returns the process as it ended, with its last output.
func (c *Client) KillProcess(ctx context.Context, id string) (*ProcessInfo, error) {
	var info ProcessInfo
	if err := c.do(ctx, http.MethodDelete, PathProcesses+"/"+url.PathEscape(id), nil, &info); err != nil {
		return nil, err
	}
	return &info, nil
}
