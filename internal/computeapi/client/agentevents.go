package client

import (
	"context"
	"errors"
	"time"
)

// An agent's events, as Server-Sent Events:
//
//	GET /v1/agents/{agent_id}/events   (Last-Event-ID: N, or ?after=N) -> text/event-stream
//
// The life of the agent's sandbox as it happens: each event has an id
// (its number in the agent's log, from 1, without gaps), an event type
// and one line of data, the AgentEvent as JSON. The stream does not end
// by itself: an agent lives on after its sandbox stops. The platform
// keeps the events for its run retention.

// PathAgentEvents streams an agent's events.
func PathAgentEvents(agentID string) string { return PathAgent(agentID, "events") }

// Agent event types. Every event has ID, Type, Time, Agent, and the
// Namespace and Sandbox of the sandbox it is about; the fields of each
// type are said beside it.
const (
	// AgentEventCreated: the agent's sandbox was created (its workspace
	// made, or a warm sandbox adopted). Reason, Message.
	AgentEventCreated = "created"
	// AgentEventPodCreated: a pod was created for the sandbox, at its
	// start or to resume it. Pod, Message.
	AgentEventPodCreated = "pod_created"
	// AgentEventReady: the sandbox serves calls. Pod, Message.
	AgentEventReady = "ready"
	// AgentEventIdleStopping: the sandbox was idle for its idle timeout
	// and is being stopped. Message.
	AgentEventIdleStopping = "idle_stopping"
	// AgentEventSnapshot: a snapshot of the workspace was cut (by an
	// idle stop, or a checkpoint). Snapshot, SizeBytes, Reason, Message.
	AgentEventSnapshot = "snapshot"
	// AgentEventStopped: the sandbox stopped; its workspace is in a
	// snapshot and the next call resumes it. Message.
	AgentEventStopped = "stopped"
	// AgentEventIdleStopCancelled: activity came during an idle stop,
	// which was called off; the sandbox keeps serving. Message.
	AgentEventIdleStopCancelled = "idle_stop_cancelled"
	// AgentEventResuming: a call woke the stopped sandbox; its workspace
	// is being restored. Message.
	AgentEventResuming = "resuming"
	// AgentEventResumed: the sandbox serves again, from its snapshot.
	// Pod, Message.
	AgentEventResumed = "resumed"
	// AgentEventPodReplaced: the sandbox's pod went away out of band and
	// was replaced; the workspace is kept. Pod, Message.
	AgentEventPodReplaced = "pod_replaced"
	// AgentEventPodFailed: the sandbox's pod failed. Pod, Reason, Message.
	AgentEventPodFailed = "pod_failed"
	// AgentEventNodeLost: the node of the sandbox's pod went away.
	// Reason, Message.
	AgentEventNodeLost = "node_lost"
	// AgentEventError: something went wrong that the sandbox's
	// controller reported as a warning (a snapshot or restore that
	// failed, an idle stop abandoned...). Reason, Message.
	AgentEventError = "error"
	// AgentEventNotice: another thing the sandbox's controller did
	// (certificate issued, filespace pulled...). Reason, Message.
	AgentEventNotice = "notice"
	// AgentEventCommandStarted: a command started in the sandbox
	// (run_command, or a run's attempt). CommandID, Command (secrets
	// redacted), RunID for a run's.
	AgentEventCommandStarted = "command_started"
	// AgentEventCommandEnded: the command ended. CommandID, RunID,
	// ExitCode (absent when it did not exit by itself), TimedOut, Signal,
	// Error (the API error code when the call failed), DurationMS.
	AgentEventCommandEnded = "command_ended"
	// AgentEventEgressDenied: the agent's egress proxy refused a
	// connection. Host, Port, Reason, Count (denials of the host since the
	// last event about it).
	AgentEventEgressDenied = "egress_denied"
)

// AgentEventTypes are the agent event types, in the order of their
// constants.
var AgentEventTypes = []string{
	AgentEventCreated, AgentEventPodCreated, AgentEventReady, AgentEventIdleStopping, AgentEventSnapshot,
	AgentEventStopped, AgentEventIdleStopCancelled, AgentEventResuming, AgentEventResumed, AgentEventPodReplaced,
	AgentEventPodFailed, AgentEventNodeLost, AgentEventError, AgentEventNotice, AgentEventCommandStarted,
	AgentEventCommandEnded, AgentEventEgressDenied,
}

// AgentEvent is one event of an agent.
type AgentEvent struct {
	// ID is the event's number in the agent's log, from 1.
	ID        int64     `json:"id"`
	Type      string    `json:"type"`
	Time      time.Time `json:"time"`
	Agent     string    `json:"agent"`
	Namespace string    `json:"namespace,omitempty"`
	Sandbox   string    `json:"sandbox,omitempty"`
	// Reason is the Kubernetes event reason of the sandbox's events, or
	// why egress was denied.
	Reason    string `json:"reason,omitempty"`
	Message   string `json:"message,omitempty"`
	Pod       string `json:"pod,omitempty"`
	Snapshot  string `json:"snapshot,omitempty"`
	SizeBytes int64  `json:"size_bytes,omitempty"`
	// CommandID pairs a command's started and ended events.
	CommandID  string   `json:"command_id,omitempty"`
	Command    []string `json:"command,omitempty"`
	RunID      string   `json:"run_id,omitempty"`
	ExitCode   *int     `json:"exit_code,omitempty"`
	TimedOut   bool     `json:"timed_out,omitempty"`
	Signal     string   `json:"signal,omitempty"`
	Error      string   `json:"error,omitempty"`
	DurationMS int64    `json:"duration_ms,omitempty"`
	Host       string   `json:"host,omitempty"`
	Port       int      `json:"port,omitempty"`
	Count      int      `json:"count,omitempty"`
}

// FollowAgentEvents calls fn with each event of agentID after event
// afterID (0 for all the platform keeps), in order, as they happen, until
// ctx ends (its error is returned) or fn returns an error (returned as
// it is). It reconnects as FollowRun does, resuming after the last event
// fn was given, so that fn sees each event once; errors the API reports
// (not found, permission) are returned at once.
func (c *Client) FollowAgentEvents(ctx context.Context, agentID string, afterID int64, fn func(AgentEvent) error) error {
	if agentID == "" {
		return errors.New("empty agent ID")
	}
	return follow(ctx, c, "the events of agent "+agentID, PathAgentEvents(agentID), afterID,
		func(e AgentEvent) (int64, bool) { return e.ID, false }, fn)
}
