package supervisorapi

import (
	"context"
	"encoding/json"
	"fmt"

	"github.com/agentbox/terraform-provider-agentbox/internal/wire"
)

// Streams a CommandEvent can carry output from.
const (
	StreamStdout = wire.StreamStdout
	StreamStderr = wire.StreamStderr
)

// CommandEvent is one line of a POST /v1/commands/stream response; see
// wire.CommandEvent. Its Exit is the supervisor's CommandResult and its
// Error the supervisor's *Error.
type CommandEvent = wire.CommandEvent[CommandResult, wire.Supervisor]

// ErrStreamIncomplete is returned by RunCommandStream when the response
// ended without an Exit event: the connection broke or the supervisor
// aborted the response.
var ErrStreamIncomplete = wire.ErrSupervisorStreamIncomplete

// RunCommandStream runs a command and calls fn with each output event as it
// arrives (Stream and Data, or Truncated), then returns the final result.
// An error from fn stops reading and is returned; the supervisor then kills
// the command, as it does for any client that goes away. As with
// RunCommand, how the command ended is a result, not an error. Before it
// returns, the response is read to its end, so that the supervisor's
// record of the call (its trailer; see AuditRecord) is delivered.
func (c *Client) RunCommandStream(ctx context.Context, req CommandRequest, fn func(CommandEvent) error) (*CommandResult, error) {
	body, err := json.Marshal(req)
	if err != nil {
		return nil, fmt.Errorf("encode command request: %w", err)
	}
	return wire.StreamCommand(ctx, c.transport(), PathCommandsStream, body, fn)
}
