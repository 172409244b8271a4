package client

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/url"

	"github.com/agentbox/terraform-provider-agentbox/internal/wire"
)

// ContentTypeNDJSON is the type of a command stream: one JSON value a line.
const ContentTypeNDJSON = wire.ContentTypeNDJSON

// PathRunCommandStream is the path of run_command_stream for an agent.
func PathRunCommandStream(agentID string) string {
	return "/v1/agents/" + url.PathEscape(agentID) + "/run_command/stream"
}

// Streams a CommandEvent can carry output from.
const (
	StreamStdout = wire.StreamStdout
	StreamStderr = wire.StreamStderr
)

// CommandEvent is one line of a run_command_stream response; see
// wire.CommandEvent. Its Exit is the API's CommandResult and its Error the
// API's *Error.
type CommandEvent = wire.CommandEvent[CommandResult, wire.API]

// ErrStreamIncomplete is returned by RunCommandStream when the response
// ended without an Exit or Error event: the connection broke.
var ErrStreamIncomplete = wire.ErrAPIStreamIncomplete

// RunCommandStream runs a command and calls fn with each output event as it
// arrives, then returns the command's result. An error from fn stops the
// call and is returned; the command is then killed, as for any caller that
// goes away. How the command ended is a result, not an error.
func (c *Client) RunCommandStream(ctx context.Context, agentID string, req RunCommandRequest, fn func(CommandEvent) error) (*CommandResult, error) {
	if agentID == "" {
		return nil, errors.New("empty agent ID")
	}
	body, err := json.Marshal(req)
	if err != nil {
		return nil, fmt.Errorf("encode run_command request: %w", err)
	}
	return wire.StreamCommand(ctx, c.transport(), PathRunCommandStream(agentID), body, fn)
}
