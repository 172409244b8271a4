package supervisorapi

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"time"
)

// Streams a CommandEvent can carry output from.
const (
	StreamStdout = "stdout"
	StreamStderr = "stderr"
)

// CommandEvent is one line of a POST /v1/commands/stream response. Exactly
// one of its groups of fields is set:
//
//   - Stream and Data: output, in the order the supervisor read it.
//   - Truncated: the output cap was reached; nothing more is sent until
//     Exit.
//   - Exit: the command ended; it is the last event. Its Stdout and Stderr
//     are empty, since the output was sent as events.
//   - Error: the supervisor failed after the stream had started (it never
//     does for a command that ran, whatever its outcome); it is the last
//     event.
//
// Data is UTF-8 text, as CommandResult's fields are: each invalid byte
// becomes U+FFFD. A character split between two reads of the pipe is held
// back until it is complete, so splitting never makes a valid character
// invalid. Text was preferred to base64 so that a caller can show output as
// it comes without decoding it; programs whose output is binary belong in
// a file that is then read.
type CommandEvent struct {
	Stream    string         `json:"stream,omitempty"`
	Data      string         `json:"data,omitempty"`
	Truncated bool           `json:"truncated,omitempty"`
	Exit      *CommandResult `json:"exit,omitempty"`
	Error     *Error         `json:"error,omitempty"`
}

// ErrStreamIncomplete is returned by RunCommandStream when the response
// ended without an Exit event: the connection broke or the supervisor
// aborted the response.
var ErrStreamIncomplete = errors.New("supervisor: command stream ended without a result")

// RunCommandStream runs a command and calls fn with each output event as it
// arrives (Stream and Data, or Truncated), then returns the final result.
// An error from fn stops reading and is returned; the supervisor then kills
// the command, as it does for any client that goes away. As with
// RunCommand, how the command ended is a result, not an error.
func (c *Client) RunCommandStream(ctx context.Context, req CommandRequest, fn func(CommandEvent) error) (*CommandResult, error) {
	body, err := json.Marshal(req)
	if err != nil {
		return nil, fmt.Errorf("encode command request: %w", err)
	}
	// Leaving early must close the connection, not drain it: that is what
	// tells the supervisor to kill the command.
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	hreq, err := http.NewRequestWithContext(ctx, http.MethodPost, strings.TrimSuffix(c.BaseURL, "/")+PathCommandsStream, bytes.NewReader(body))
	if err != nil {
		return nil, fmt.Errorf("supervisor request: %w", err)
	}
	hreq.Header.Set("Accept", ContentTypeNDJSON)
	hreq.Header.Set("Content-Type", "application/json")
	resp, err := c.httpClient().Do(hreq)
	if err != nil {
		return nil, fmt.Errorf("supervisor POST %s: %w", PathCommandsStream, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode/100 != 2 {
		data, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
		return nil, decodeError(resp.StatusCode, data)
	}
	sc := bufio.NewScanner(resp.Body)
	// A line holds at most one pipe read (32 KiB), which JSON escaping can
	// grow up to six times.
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		var ev CommandEvent
		if err := json.Unmarshal(sc.Bytes(), &ev); err != nil {
			return nil, fmt.Errorf("supervisor POST %s: decode event: %w", PathCommandsStream, err)
		}
		switch {
		case ev.Exit != nil:
			readTail(resp.Body)
			return ev.Exit, nil
		case ev.Error != nil:
			readTail(resp.Body)
			ev.Error.HTTPStatus = resp.StatusCode
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

// readTail reads what follows a stream's last event: the end of the
// chunked body and its trailer, the supervisor's record of the call (see
// AuditRecord), which is known only once the body has been read to its
// end. The supervisor sends nothing more, so this takes no time; the
// bounds only guard against a broken peer.
func readTail(body io.ReadCloser) {
	t := time.AfterFunc(5*time.Second, func() { body.Close() })
	defer t.Stop()
	_, _ = io.Copy(io.Discard, io.LimitReader(body, 64<<10))
}

func (c *Client) httpClient() *http.Client {
	if c.HTTPClient == nil {
		return http.DefaultClient
	}
	return c.HTTPClient
}
