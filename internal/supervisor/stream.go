package supervisor

import (
	"encoding/json"
	"errors"
	"net/http"
	"strings"
	"sync"
	"time"

	api "github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"
)

// streamWriteTimeout bounds each event's write. A client that stops
// reading without closing the connection would otherwise block the pipe
// copier, and with it the command's Wait, past the command's own timeout.
const streamWriteTimeout = 30 * time.Second

// executeStream is execute for /v1/commands/stream: the command is
// prepared, admitted and run exactly as for /v1/commands; only where its
// output goes differs.
func (s *Server) executeStream(w http.ResponseWriter, r *http.Request, info *requestInfo, spec *commandSpec, apiErr *api.Error) {
	release, ok := s.admit(r.Context(), w, info, apiErr)
	if !ok {
		return
	}
	defer release()
	st := newStream(w, spec.maxOutput)
	res, apiErr := s.run(r.Context(), spec, st.stdout, st.stderr)
	if apiErr != nil {
		if !st.begun() {
			info.fail(w, apiErr)
			return
		}
		info.err = apiErr
		st.send(api.CommandEvent{Error: apiErr})
		return
	}
	res.Truncated = st.finish()
	info.result = res
	st.send(api.CommandEvent{Exit: res})
}

// stream turns a command's output into NDJSON events under one byte
// budget shared by both streams, like output. The budget counts the bytes
// the command wrote, not their JSON encoding.
type stream struct {
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
	st   *stream
	name string
	// carry is the start of a character whose remaining bytes have not
	// been read yet.
	carry []byte
}

func newStream(w http.ResponseWriter, limit int64) *stream {
	st := &stream{w: w, rc: http.NewResponseController(w), enc: json.NewEncoder(w), remaining: limit}
	st.stdout = &streamPipe{st: st, name: api.StreamStdout}
	st.stderr = &streamPipe{st: st, name: api.StreamStderr}
	return st
}

// begun reports whether the status line has gone out, after which errors
// can only be sent as events.
func (st *stream) begun() bool {
	st.mu.Lock()
	defer st.mu.Unlock()
	return st.started
}

func (st *stream) send(ev api.CommandEvent) {
	st.mu.Lock()
	defer st.mu.Unlock()
	st.sendLocked(ev)
}

func (st *stream) sendLocked(ev api.CommandEvent) {
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
	if err := st.rc.SetWriteDeadline(time.Now().Add(streamWriteTimeout)); err != nil && !errors.Is(err, http.ErrNotSupported) {
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
		whole := trimPartialRune(text)
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

// finish sends what the pipes left half a character of, which can only be
// invalid now, and reports whether output was cut.
func (st *stream) finish() bool {
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
