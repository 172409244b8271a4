package runner

import (
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"strings"
	"sync"
	"time"

	api "github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"
)

// StreamWriteTimeout bounds each event's write. A client that stops
// reading without closing the connection would otherwise block the pipe
// copier, and with it the command's Wait, past the command's own timeout.
const StreamWriteTimeout = 30 * time.Second

// Stream turns a command's output into NDJSON events under one byte
// budget shared by both streams, like output. The budget counts the bytes
// the command wrote, not their JSON encoding.
type Stream struct {
	mu        sync.Mutex
	w         http.ResponseWriter
	rc        *http.ResponseController
	enc       *json.Encoder
	started   bool
	failed    bool // the client is gone or stuck: drop the rest
	remaining int64
	truncated bool

	stdout, stderr *streamPipe
}

type streamPipe struct {
	st   *Stream
	name string
	// carry is the start of a character whose remaining bytes have not
	// been read yet.
	carry []byte
}

// Stdout is where the command's standard output goes.
func (st *Stream) Stdout() io.Writer { return st.stdout }

// Stderr is where the command's standard error goes.
func (st *Stream) Stderr() io.Writer { return st.stderr }

// NewStream returns a Stream that writes to w and sends at most limit
// bytes of output.
func NewStream(w http.ResponseWriter, limit int64) *Stream {
	st := &Stream{w: w, rc: http.NewResponseController(w), enc: json.NewEncoder(w), remaining: limit}
	st.stdout = &streamPipe{st: st, name: api.StreamStdout}
	st.stderr = &streamPipe{st: st, name: api.StreamStderr}
	return st
}

// Begun reports whether the status line has gone out, after which errors
// can only be sent as events.
func (st *Stream) Begun() bool {
	st.mu.Lock()
	defer st.mu.Unlock()
	return st.started
}

// Send sends one event.
func (st *Stream) Send(ev api.CommandEvent) {
	st.mu.Lock()
	defer st.mu.Unlock()
	st.sendLocked(ev)
}

func (st *Stream) sendLocked(ev api.CommandEvent) {
	if st.failed {
		return
	}
	if !st.started {
		st.started = true
		h := st.w.Header()
		h.Set("Content-Type", api.ContentTypeNDJSON)
		h.Set("X-Content-Type-Options", "nosniff")
		h.Set("Cache-Control", "no-store")
		st.w.WriteHeader(http.StatusOK)
	}
	// httptest's recorder has no deadlines; a real connection does.
	if err := st.rc.SetWriteDeadline(time.Now().Add(StreamWriteTimeout)); err != nil && !errors.Is(err, http.ErrNotSupported) {
		st.failed = true
		return
	}
	if st.enc.Encode(ev) != nil || st.rc.Flush() != nil {
		st.failed = true
	}
}

// Write sends what fits in the budget as an event and drops the rest,
// always accepting all of p so the command never blocks on a full pipe
// once the cap is reached.
func (p *streamPipe) Write(b []byte) (int, error) {
	st := p.st
	st.mu.Lock()
	defer st.mu.Unlock()
	keep, cut := b, false
	if int64(len(keep)) > st.remaining {
		keep, cut = keep[:st.remaining], true
	}
	st.remaining -= int64(len(keep))
	if len(keep) > 0 || (cut && len(p.carry) > 0) {
		text := string(p.carry) + string(keep)
		p.carry = nil
		whole := TrimPartialRune(text)
		if !cut {
			p.carry = []byte(text[len(whole):])
		}
		if whole != "" {
			st.sendLocked(api.CommandEvent{Stream: p.name, Data: strings.ToValidUTF8(whole, "\uFFFD")})
		}
	}
	if cut && !st.truncated {
		st.truncated = true
		st.sendLocked(api.CommandEvent{Truncated: true})
	}
	return len(b), nil
}

// Finish sends what the pipes left half a character of, which can only be
// invalid now, and reports whether output was cut.
func (st *Stream) Finish() bool {
	st.mu.Lock()
	defer st.mu.Unlock()
	for _, p := range []*streamPipe{st.stdout, st.stderr} {
		if len(p.carry) > 0 {
			st.sendLocked(api.CommandEvent{Stream: p.name, Data: strings.ToValidUTF8(string(p.carry), "\uFFFD")})
			p.carry = nil
		}
	}
	return st.truncated
}
