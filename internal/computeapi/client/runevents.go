package client

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/agentbox/terraform-provider-agentbox/internal/wire"
)

// A run's events, as Server-Sent Events:
//
//	GET /v1/runs/{id}/events   (Last-Event-ID: N, or ?after=N) -> text/event-stream
//
// Each event has an id (its sequence number in the run's log, from 1), an
// event type and one line of data, the RunEvent as JSON. The stream ends
// after the run's end event.

// PathRunEvents streams a run's events.
func PathRunEvents(id string) string { return PathRun(id) + "/events" }

// ContentTypeEventStream is the type of a run's event stream.
const ContentTypeEventStream = "text/event-stream"

// HeaderLastEventID names the last event a follower has seen; the stream
// resumes after it.
const HeaderLastEventID = "Last-Event-ID"

// Run event types.
const (
	// RunEventState: the run changed state: an attempt started (Status
	// running, Attempt), or it ended (the final Status, ExitCode, Reason,
	// Message).
	RunEventState = "state"
	// RunEventStdout and RunEventStderr: a line of the command's output
	// (Text, with its newline when it had one), secrets redacted.
	RunEventStdout = "stdout"
	RunEventStderr = "stderr"
	// RunEventTruncated: output was no longer recorded from here (Message
	// says why); the run went on.
	RunEventTruncated = "truncated"
	// RunEventEnd is the last event: how the run ended, as in its final
	// state event.
	RunEventEnd = "end"
)

// RunEvent is one event of a run.
type RunEvent struct {
	// ID is the event's sequence number in the run's log, from 1.
	ID   int64     `json:"id"`
	Type string    `json:"type"`
	Time time.Time `json:"time"`
	// Status, Attempt, ExitCode, Reason and Message: state and end events.
	Status   string `json:"status,omitempty"`
	Attempt  int    `json:"attempt,omitempty"`
	ExitCode *int   `json:"exit_code,omitempty"`
	Reason   string `json:"reason,omitempty"`
	// Message: state, end and truncated events.
	Message string `json:"message,omitempty"`
	// Text is a line of output: stdout and stderr events.
	Text string `json:"text,omitempty"`
	// Path, Size, SHA256 and Error: artifact events (see
	// RunEventArtifact).
	Path   string `json:"path,omitempty"`
	Size   int64  `json:"size,omitempty"`
	SHA256 string `json:"sha256,omitempty"`
	Error  string `json:"error,omitempty"`
}

// ErrFollowIncomplete is what FollowRun returns when the stream kept
// breaking before the run's end, past its retries.
var ErrFollowIncomplete = errors.New("the run's event stream ended before the run did")

const (
	// followRetries bounds how many times in a row FollowRun reconnects
	// without receiving an event in between.
	followRetries = 8
	// maxEventLine bounds one line of the stream: an event is at most a
	// line of output (16 KiB), which JSON escaping can grow six times.
	maxEventLine = 1 << 20
)

// The wait between reconnections doubles from followBackoffFirst to
// followBackoffMax; variables so that tests can shorten them.
var (
	followBackoffFirst = 250 * time.Millisecond
	followBackoffMax   = 5 * time.Second
)

// FollowRun calls fn with each event of run id after event afterID (0 for
// all), in order, as they happen, and returns nil after the run's end
// event. A run that has ended is replayed. When the connection breaks, or
// the server stops serving it, FollowRun reconnects by itself and resumes
// after the last event fn was given (Last-Event-ID), so that fn sees each
// event once; it gives up with ErrFollowIncomplete (wrapping the last
// failure) after followRetries reconnections in a row that brought no
// event. Errors the API reports for the run (not found, permission) are
// returned at once, as is an error from fn, which stops following. ctx
// bounds the whole.
func (c *Client) FollowRun(ctx context.Context, id string, afterID int64, fn func(RunEvent) error) error {
	if id == "" {
		return errors.New("empty run ID")
	}
	return follow(ctx, c, "run "+id, PathRunEvents(id), afterID, func(e RunEvent) (int64, bool) {
		return e.ID, e.Type == RunEventEnd
	}, fn)
}

// follow reads the event stream at path after event afterID, giving fn
// each event once, in order, and reconnecting as FollowRun says. idOf
// tells an event's id and whether it is the stream's last.
func follow[E any](ctx context.Context, c *Client, what, path string, afterID int64,
	idOf func(E) (int64, bool), fn func(E) error) error {
	if afterID < 0 {
		return fmt.Errorf("negative event id %d", afterID)
	}
	backoff := followBackoffFirst
	for failures := 0; ; {
		last, ended, err := followOnce(ctx, c, path, afterID, idOf, fn)
		if ended {
			return nil
		}
		var fnErr fnError
		switch {
		case errors.As(err, &fnErr):
			return fnErr.err
		case ctx.Err() != nil:
			return fmt.Errorf("follow %s: %w", what, ctx.Err())
		case !retryable(err):
			return err
		}
		if last > afterID {
			afterID, failures, backoff = last, 0, followBackoffFirst
		}
		failures++
		if failures > followRetries {
			return fmt.Errorf("follow %s after event %d: %w: %w", what, afterID, ErrFollowIncomplete, err)
		}
		t := time.NewTimer(backoff)
		select {
		case <-ctx.Done():
			t.Stop()
			return fmt.Errorf("follow %s: %w", what, ctx.Err())
		case <-t.C:
		}
		backoff = min(2*backoff, followBackoffMax)
	}
}

// fnError carries an error of FollowRun's callback out of followOnce.
type fnError struct{ err error }

func (e fnError) Error() string { return e.err.Error() }

// retryable reports whether a failure to follow may pass: a transport
// failure, a stream cut short, or the API being unavailable for a while.
func retryable(err error) bool {
	var apiErr *Error
	if !errors.As(err, &apiErr) {
		return true
	}
	return apiErr.Status >= 500 || apiErr.Status == http.StatusTooManyRequests
}

// followOnce reads one connection's stream. It returns the id of the
// last event given to fn, whether that was the end, and why the stream
// stopped otherwise.
func followOnce[E any](ctx context.Context, c *Client, path string, after int64,
	idOf func(E) (int64, bool), fn func(E) error) (int64, bool, error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, c.endpoint+path, nil)
	if err != nil {
		return after, false, fmt.Errorf("build request: %w", err)
	}
	c.authorize(req.Header, path)
	req.Header.Set("Accept", ContentTypeEventStream)
	if after > 0 {
		req.Header.Set(HeaderLastEventID, strconv.FormatInt(after, 10))
	}
	resp, err := c.httpClient.Do(req)
	if err != nil {
		return after, false, fmt.Errorf("GET %s: %w", path, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode/100 != 2 {
		data, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
		return after, false, wire.DecodeError[wire.API](resp, data)
	}
	if ct := resp.Header.Get("Content-Type"); !strings.HasPrefix(ct, ContentTypeEventStream) {
		return after, false, fmt.Errorf("GET %s: answered %q, not an event stream", path, ct)
	}
	err = ReadEventStream(resp.Body, func(ev EventStreamEvent) error {
		// Events already read are not given to a caller that has gone.
		if err := ctx.Err(); err != nil {
			return err
		}
		var e E
		if err := json.Unmarshal([]byte(ev.Data), &e); err != nil {
			return fmt.Errorf("GET %s: event %q: %w", path, ev.ID, err)
		}
		n, last := idOf(e)
		if n <= after {
			// Already given to fn: a server never sends one, but a
			// follower must not see an event twice.
			return nil
		}
		if err := fn(e); err != nil {
			return fnError{err}
		}
		after = n
		if last {
			return errStreamEnd
		}
		return nil
	})
	switch {
	case errors.Is(err, errStreamEnd):
		return after, true, nil
	case err == nil:
		return after, false, fmt.Errorf("GET %s: the stream closed before its end", path)
	}
	return after, false, err
}

var errStreamEnd = errors.New("end of the event stream")

// EventStreamEvent is one event of a text/event-stream.
type EventStreamEvent struct {
	ID, Event, Data string
}

// ReadEventStream reads a text/event-stream (the Server-Sent Events
// format) and calls fn with each event, until the stream ends (nil), a
// read fails, or fn returns an error, which is returned. Comments
// (keepalives) are skipped; a line longer than 1 MiB is an error. It is
// the subset of the format the API sends, read as the standard says: an
// event ends at a blank line, and its data lines are joined by newlines.
func ReadEventStream(r io.Reader, fn func(EventStreamEvent) error) error {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), maxEventLine)
	var (
		ev      EventStreamEvent
		data    []string
		hasData bool
	)
	for sc.Scan() {
		line := strings.TrimSuffix(sc.Text(), "\r")
		if line == "" {
			if hasData {
				ev.Data = strings.Join(data, "\n")
				if err := fn(ev); err != nil {
					return err
				}
			}
			ev, data, hasData = EventStreamEvent{}, nil, false
			continue
		}
		if strings.HasPrefix(line, ":") {
			continue
		}
		field, value, _ := strings.Cut(line, ":")
		value = strings.TrimPrefix(value, " ")
		switch field {
		case "id":
			ev.ID = value
		case "event":
			ev.Event = value
		case "data":
			data, hasData = append(data, value), true
		}
	}
	if err := sc.Err(); err != nil {
		return fmt.Errorf("read event stream: %w", err)
	}
	return nil
}
