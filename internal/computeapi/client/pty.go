package client

import (
	"context"
	"net/url"

	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"
	"github.com/agentbox/terraform-provider-agentbox/internal/wire"
)

// Terminals. The API relays the supervisor's PTY protocol (subprotocol
// agentbox.pty.v1: binary frames are terminal bytes, text frames JSON
// resize and exit messages) as it is, so its client end is the
// supervisor's: supervisorapi.PTY.

// PathAgentPTY returns the path of GET run_command_pty, a WebSocket.
func PathAgentPTY(agentID string) string { return PathAgent(agentID, "pty") }

// PTYOptions says what an agent's PTY session runs: the argv (default
// an interactive shell), cwd, environment and initial size, with the
// supervisor's meaning, since the API passes them on as they are.
type PTYOptions = supervisorapi.PTYRequest

// OpenPTY starts a PTY session in the agent's sandbox, waking it if it is
// stopped. ctx bounds the handshake only. A refusal is an *Error.
func (c *Client) OpenPTY(ctx context.Context, agentID string, opts PTYOptions) (*supervisorapi.PTY, error) {
	return c.dialPTY(ctx, PathAgentPTY(agentID), opts.Query())
}

// OpenConsole connects to a staff console session's terminal (once; it
// closes when the session expires). cols and rows of 0 mean 80x24.
func (c *Client) OpenConsole(ctx context.Context, sessionID string, cols, rows uint16) (*supervisorapi.PTY, error) {
	return c.dialPTY(ctx, PathConsolePTY(sessionID), supervisorapi.PTYRequest{Cols: cols, Rows: rows}.Query())
}

func (c *Client) dialPTY(ctx context.Context, path string, q url.Values) (*supervisorapi.PTY, error) {
	conn, err := wire.DialWebSocket(ctx, c.transport(), path, q, supervisorapi.PTYSubprotocol)
	if err != nil {
		return nil, err
	}
	return supervisorapi.NewPTY(conn), nil
}
