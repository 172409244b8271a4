package client

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"time"
)

// Directions of SyncFilespace.
const (
	// SyncPush writes the workspace's changes into the agent's filespace.
	SyncPush = "push"
	// SyncPull writes the filespace's changes into the workspace.
	SyncPull = "pull"
)

// SyncFilespaceRequest is the body of POST /v1/agents/{agent_id}/sync_filespace.
type SyncFilespaceRequest struct {
	// Direction is SyncPush or SyncPull.
	Direction string `json:"direction"`
}

// SyncSummary is the result of a filespace sync. A file changed on both
// sides since the workspace's last sync goes to the newer change; the
// filespace's updated_at wins ties.
type SyncSummary struct {
	Direction string `json:"direction"`
	// SyncedAt is the sync time: the updated_at of what a push wrote.
	SyncedAt time.Time `json:"synced_at"`
	// Pushed and Pulled count files written into the filespace or the
	// workspace; Deleted counts deletions applied to the side written.
	Pushed  int `json:"pushed"`
	Pulled  int `json:"pulled"`
	Deleted int `json:"deleted"`
	// Skipped counts differences left alone because the other side's
	// change is newer (a sync in the other direction applies it) or the
	// file changed during the sync.
	Skipped   int `json:"skipped"`
	Unchanged int `json:"unchanged"`
	// Bytes is the content written to the side synced into.
	Bytes int64 `json:"bytes"`
	// WorkspaceBytes is the workspace's size before the sync.
	WorkspaceBytes int64 `json:"workspace_bytes"`
	// Conflicts lists (up to 100) files changed on both sides and the
	// side that won.
	Conflicts []SyncConflict `json:"conflicts,omitempty"`
	// DurationMS is how long the sync took.
	DurationMS int64 `json:"duration_ms"`
}

// SyncConflict is a file changed on both sides since the last sync.
type SyncConflict struct {
	Path string `json:"path"`
	// Winner is "workspace" or "filespace".
	Winner string `json:"winner"`
}

// TerminateRequest is the body of POST /v1/agents/{agent_id}/terminate.
type TerminateRequest struct {
	// Reason is recorded with the call; it is required.
	Reason string `json:"reason"`
	// Snapshot keeps the workspace: the sandbox is stopped as an idle
	// stop would (push, snapshot, pod deleted) and resumes on the next
	// call. Without it the sandbox is deleted with its workspace.
	Snapshot bool `json:"snapshot"`
}

// Actions a terminate reports.
const (
	// TerminateDeleted: the Sandbox was deleted; its pod, workspace and
	// snapshots go with it.
	TerminateDeleted = "deleted"
	// TerminateStopping: the controller was told to stop the sandbox with
	// a snapshot; poll Status for phase Stopped.
	TerminateStopping = "stopping"
	// TerminateAlreadyStopped: the sandbox had no pod to stop.
	TerminateAlreadyStopped = "already_stopped"
)

// TerminateResult is the answer of a terminate: what was done, and the
// sandbox's status as the call left it.
type TerminateResult struct {
	Action string        `json:"action"`
	Reason string        `json:"reason"`
	Status SandboxStatus `json:"status"`
}

// SyncFilespace runs one sync between the agent's workspace and its
// filespace in the given direction (SyncPush or SyncPull).
func (c *Client) SyncFilespace(ctx context.Context, agentID, direction string) (*SyncSummary, error) {
	body, err := json.Marshal(SyncFilespaceRequest{Direction: direction})
	if err != nil {
		return nil, fmt.Errorf("encode sync request: %w", err)
	}
	var sum SyncSummary
	if err := c.do(ctx, http.MethodPost, PathAgent(agentID, "sync_filespace"), body, &sum); err != nil {
		return nil, err
	}
	return &sum, nil
}

// Terminate force-stops the agent's sandbox; see TerminateRequest.
func (c *Client) Terminate(ctx context.Context, agentID string, req TerminateRequest) (*TerminateResult, error) {
	body, err := json.Marshal(req)
	if err != nil {
		return nil, fmt.Errorf("encode terminate request: %w", err)
	}
	var res TerminateResult
	if err := c.do(ctx, http.MethodPost, PathAgent(agentID, "terminate"), body, &res); err != nil {
		return nil, err
	}
	return &res, nil
}
