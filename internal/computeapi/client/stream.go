package client

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
)

// ContentTypeNDJSON is the type of a command stream: one JSON value a line.
const ContentTypeNDJSON = "application/x-ndjson"

// PathRunCommandStream is the path of run_command_stream for an agent.
func PathRunCommandStream(agentID string) string {
	return "/v1/agents/" + url.PathEscape(agentID) + "/run_command/stream"
}

// Streams a CommandEvent can carry output from.
const (
	StreamStdout = "stdout"
	StreamStderr = "stderr"
)

// CommandEvent is one line of a run_command_stream response. Exactly one
// of its groups of fields is set:
//
//   - Stream and Data: output, in the order the sandbox produced it (UTF-8,
//     invalid bytes replaced by U+FFFD, as in CommandResult).
//   - Truncated: the output cap was reached; nothing more comes until Exit.
//   - Exit: the command ended; it is the last event, and its Stdout and
//     Stderr are empty, since the output came as events.
//   - Error: the call failed after the stream had started; it is the last
//     event.
type CommandEvent struct {
	Stream    string         `json:"stream,omitempty"`
	Data      string         `json:"data,omitempty"`
	Truncated bool           `json:"truncated,omitempty"`
	Exit      *CommandResult `json:"exit,omitempty"`
	Error     *Error         `json:"error,omitempty"`
}

// ErrStreamIncomplete is returned by RunCommandStream when the response
// ended without an Exit or Error event: the connection broke.
var ErrStreamIncomplete = errors.New("agentbox: command stream ended without a result")

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
	// Leaving early must close the connection, not drain it: that is what
	// ends the command.
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	path := PathRunCommandStream(agentID)
	hreq, err := http.NewRequestWithContext(ctx, http.MethodPost, c.endpoint+path, bytes.NewReader(body))
	if err != nil {
		return nil, fmt.Errorf("build request: %w", err)
	}
	c.authorize(hreq.Header, path)
	hreq.Header.Set("Accept", ContentTypeNDJSON)
	hreq.Header.Set("Content-Type", "application/json")
	resp, err := c.httpClient.Do(hreq)
	if err != nil {
		return nil, fmt.Errorf("POST %s: %w", path, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode/100 != 2 {
		data, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
		return nil, decodeError(resp, data)
	}
	sc := bufio.NewScanner(resp.Body)
	// An event holds at most one read of the command's pipe (32 KiB), which
	// JSON escaping can grow up to six times.
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		var ev CommandEvent
		if err := json.Unmarshal(sc.Bytes(), &ev); err != nil {
			return nil, fmt.Errorf("POST %s: decode event: %w", path, err)
		}
		switch {
		case ev.Exit != nil:
			return ev.Exit, nil
		case ev.Error != nil:
			ev.Error.Status = resp.StatusCode
			ev.Error.RequestID = resp.Header.Get("X-Request-Id")
			return nil, ev.Error
		}
		if err := fn(ev); err != nil {
			return nil, err
		}
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrStreamIncomplete, err)
	}
	return nil, ErrStreamIncomplete
}
