package computeapi

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"sync"
	"time"
	"unicode/utf8"

	"github.com/go-logr/logr"

	api "github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
	"github.com/agentbox/terraform-provider-agentbox/internal/redact"
	"github.com/agentbox/terraform-provider-agentbox/internal/store"
)

// A run's events: the executor records the command's output in the run's
// event log (the store writes the changes of state itself), and GET
// /v1/runs/{id}/events streams the log as Server-Sent Events, live.

const (
	// DefaultRunEventPollInterval is how often a stream looks in the store
	// for events that no notification announced: those of a run another
	// replica executes.
	DefaultRunEventPollInterval = 400 * time.Millisecond
	// DefaultRunEventKeepalive is how often an idle stream sends a
	// comment, so that proxies keep the connection.
	DefaultRunEventKeepalive = 15 * time.Second
	// DefaultRunOutputMaxEvents and DefaultRunOutputMaxBytes bound the
	// output a run records as events; past either, one truncated event
	// says so and the rest is counted, not kept.
	DefaultRunOutputMaxEvents = 20000
	DefaultRunOutputMaxBytes  = 4 << 20

	// runEventFlush is how long a line of output waits for others to be
	// written to the store with it, and runEventBatch how many lines make
	// a write at once.
	runEventFlush = 50 * time.Millisecond
	runEventBatch = 256
	// maxRunLine cuts a longer line of output into events of this size.
	maxRunLine = 16 << 10
	// runEventWriteTimeout bounds one write to a stream's client: one that
	// stops reading is let go.
	runEventWriteTimeout = 30 * time.Second
	// runEventRecheck is how often a stream with nothing new looks at the
	// run itself: to end when it was deleted, or when it ended before
	// runs had event logs.
	runEventRecheck = 5 * time.Second
)

// notifier tells the streams of a log (a run's, an agent's) on this
// replica that it grew, so that they need not wait for their next poll.
type notifier struct {
	mu   sync.Mutex
	subs map[string]map[chan struct{}]struct{}
}

// subscribe returns a channel that receives after each notify of id, and
// the function that ends the subscription.
func (n *notifier) subscribe(id string) (<-chan struct{}, func()) {
	ch := make(chan struct{}, 1)
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.subs == nil {
		n.subs = map[string]map[chan struct{}]struct{}{}
	}
	if n.subs[id] == nil {
		n.subs[id] = map[chan struct{}]struct{}{}
	}
	n.subs[id][ch] = struct{}{}
	return ch, func() {
		n.mu.Lock()
		defer n.mu.Unlock()
		delete(n.subs[id], ch)
		if len(n.subs[id]) == 0 {
			delete(n.subs, id)
		}
	}
}

// notify wakes the streams of log id. A stream that has a wake-up pending
// needs no second one: it reads everything new when it wakes.
func (n *notifier) notify(id string) {
	n.mu.Lock()
	defer n.mu.Unlock()
	for ch := range n.subs[id] {
		select {
		case ch <- struct{}{}:
		default:
		}
	}
}

// shutdowns gives the streams of each http.Server that serves the API a
// channel closed when that server begins to shut down: a stream lasts as
// long as its run, and would otherwise hold a graceful shutdown up to its
// grace period. Its followers reconnect to another replica and resume.
type shutdowns struct {
	mu sync.Mutex
	of map[*http.Server]chan struct{}
}

// watch returns the channel of the server that serves r, or nil when r
// came from none (a test calling the handler).
func (d *shutdowns) watch(r *http.Request) <-chan struct{} {
	hs, _ := r.Context().Value(http.ServerContextKey).(*http.Server)
	if hs == nil {
		return nil
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.of == nil {
		d.of = map[*http.Server]chan struct{}{}
	}
	ch, ok := d.of[hs]
	if !ok {
		ch = make(chan struct{})
		d.of[hs] = ch
		hs.RegisterOnShutdown(func() { close(ch) })
	}
	return ch
}

// runOutput turns a run's output into its log's stdout and stderr events:
// each stream is redacted as one text (a redact.Stream, so that a secret
// cut between two reads, or a private key over many lines, is caught),
// then cut into lines, each an event with its newline. Events are written
// to the store in batches, every runEventFlush or runEventBatch lines,
// and bounded in number and size.
type runOutput struct {
	st     *store.Store
	runID  string
	log    logr.Logger
	notify func()
	// maxEvents and maxBytes bound the output events and their text.
	maxEvents int
	maxBytes  int64

	closeOnce sync.Once
	mu        sync.Mutex
	streams   map[string]*lineStream
	pending   []store.RunEvent
	events    int
	bytes     int64
	truncated bool

	flushMu sync.Mutex // one write to the store at a time, in order
	kick    chan struct{}
	stop    chan struct{}
	done    chan struct{}
}

// lineStream is one output stream on its way to lines.
type lineStream struct {
	red     redact.Stream
	partial []byte
}

func (s *Server) newRunOutput(runID string, log logr.Logger) *runOutput {
	o := &runOutput{
		st: s.store, runID: runID, log: log, notify: func() { s.runNotes.notify(runID) },
		maxEvents: s.runOutputMaxEvents, maxBytes: s.runOutputMaxBytes,
		streams: map[string]*lineStream{api.RunEventStdout: {}, api.RunEventStderr: {}},
		kick:    make(chan struct{}, 1), stop: make(chan struct{}), done: make(chan struct{}),
	}
	go o.flushLoop()
	return o
}

// write takes the next piece of a stream's output.
func (o *runOutput) write(stream string, data []byte) {
	if o.add(stream, data) >= runEventBatch {
		select {
		case o.kick <- struct{}{}:
		default:
		}
	}
}

// add takes the piece and returns how many events are queued.
func (o *runOutput) add(stream string, data []byte) int {
	o.mu.Lock()
	defer o.mu.Unlock()
	if ls := o.streams[stream]; ls != nil {
		o.linesLocked(stream, ls, ls.red.Write(data), false)
	}
	return len(o.pending)
}

// linesLocked adds what a stream let through and makes events of the
// lines that are complete (all of them when final).
func (o *runOutput) linesLocked(typ string, ls *lineStream, b []byte, final bool) {
	ls.partial = append(ls.partial, b...)
	rest := ls.partial
	for {
		i := bytes.IndexByte(rest, '\n')
		switch {
		case i >= 0 && i < maxRunLine:
			o.addLocked(typ, rest[:i+1])
			rest = rest[i+1:]
			continue
		case len(rest) >= maxRunLine:
			// Cut at a character's start, so that each piece is text.
			cut := maxRunLine
			for cut < len(rest) && cut > maxRunLine-utf8.UTFMax && !utf8.RuneStart(rest[cut]) {
				cut--
			}
			o.addLocked(typ, rest[:cut])
			rest = rest[cut:]
			continue
		}
		break
	}
	if final && len(rest) > 0 {
		o.addLocked(typ, rest)
		rest = nil
	}
	ls.partial = append(ls.partial[:0], rest...)
}

// addLocked queues one line as an event, or, the first time the bounds
// are reached, the event that says the output is truncated.
func (o *runOutput) addLocked(typ string, line []byte) {
	if o.truncated {
		return
	}
	if o.events+1 > o.maxEvents || o.bytes+int64(len(line)) > o.maxBytes {
		o.truncateLocked(fmt.Sprintf("the run's output past %d lines or %d bytes is not recorded", o.maxEvents, o.maxBytes))
		return
	}
	o.events++
	o.bytes += int64(len(line))
	o.pending = append(o.pending, eventOf(store.RunEventType(typ), api.RunEvent{Text: string(line)}))
}

func (o *runOutput) truncateLocked(msg string) {
	if !o.truncated {
		o.truncated = true
		o.pending = append(o.pending, eventOf(store.RunEventTruncated, api.RunEvent{Message: msg}))
	}
}

// sandboxTruncated records that the sandbox stopped sending output.
func (o *runOutput) sandboxTruncated() {
	o.mu.Lock()
	defer o.mu.Unlock()
	// The lines so far are all the output there is.
	for _, typ := range []string{api.RunEventStdout, api.RunEventStderr} {
		ls := o.streams[typ]
		o.linesLocked(typ, ls, ls.red.Flush(), true)
	}
	o.truncateLocked("the sandbox stopped sending the command's output at its output limit")
}

// eventOf is a store event of the given type with the fields of d as its
// data.
func eventOf(typ store.RunEventType, d api.RunEvent) store.RunEvent {
	b, _ := json.Marshal(d) // strings and numbers always encode
	return store.RunEvent{Type: typ, Data: string(b)}
}

func (o *runOutput) flushLoop() {
	defer close(o.done)
	t := time.NewTicker(runEventFlush)
	defer t.Stop()
	for {
		select {
		case <-o.stop:
			return
		case <-t.C:
		case <-o.kick:
		}
		o.flush()
	}
}

// flush writes the queued events to the store and wakes the run's
// streams. A failed write keeps them queued for the next flush (their
// number is bounded by the output bounds); a run that has ended or is
// gone takes no more.
func (o *runOutput) flush() error {
	o.flushMu.Lock()
	defer o.flushMu.Unlock()
	o.mu.Lock()
	batch := o.pending
	o.pending = nil
	o.mu.Unlock()
	for len(batch) > 0 {
		n := min(len(batch), store.MaxRunEventsAppend)
		ctx, cancel := context.WithTimeout(context.Background(), runStoreTimeout)
		_, err := o.st.AppendRunEvents(ctx, o.runID, batch[:n]...)
		cancel()
		switch {
		case errors.Is(err, store.ErrRunFinished), errors.Is(err, store.ErrNotFound):
			o.log.Info("run ended elsewhere; its last output is not recorded", "events", len(batch))
			return nil
		case err != nil:
			o.mu.Lock()
			o.pending = append(batch, o.pending...)
			o.mu.Unlock()
			o.log.Error(err, "record run output; retrying", "events", len(batch))
			return err
		}
		batch = batch[n:]
		o.notify()
	}
	return nil
}

// close writes what the redaction and the line cutting held back, and
// the rest of the queue, before the run's end is recorded.
func (o *runOutput) close() {
	o.closeOnce.Do(o.closeNow)
}

// closeNow is close, once: the run's artifacts close the output before
// they are collected, and the attempt's end closes it in any case.
func (o *runOutput) closeNow() {
	close(o.stop)
	<-o.done
	o.mu.Lock()
	for _, typ := range []string{api.RunEventStdout, api.RunEventStderr} {
		ls := o.streams[typ]
		o.linesLocked(typ, ls, ls.red.Flush(), true)
	}
	o.mu.Unlock()
	// A store that failed a write gets one more chance before the run's
	// end is recorded after what could be.
	if o.flush() != nil {
		time.Sleep(runEventFlush * 10)
		_ = o.flush()
	}
}

// eventsAfter is the id a stream resumes after: the Last-Event-ID header
// of a reconnecting follower, else the after query parameter, else 0.
func eventsAfter(r *http.Request) (int64, *api.Error) {
	name, v := api.HeaderLastEventID+" header", r.Header.Get(api.HeaderLastEventID)
	if v == "" {
		name, v = "after", r.URL.Query().Get("after")
	}
	if v == "" {
		return 0, nil
	}
	n, err := strconv.ParseInt(v, 10, 64)
	if err != nil || n < 0 {
		return 0, api.Errorf(api.CodeInvalidArgument, "%s must be an event id (a non-negative integer), got %q", name, v)
	}
	return n, nil
}

// wireRunEvent is a stored event as the API sends it.
func wireRunEvent(e store.RunEvent) (api.RunEvent, error) {
	var out api.RunEvent
	if err := json.Unmarshal([]byte(e.Data), &out); err != nil {
		return api.RunEvent{}, fmt.Errorf("run %s event %d: %w", e.RunID, e.Seq, err)
	}
	out.ID, out.Type, out.Time = e.Seq, string(e.Type), e.At
	return out, nil
}

// legacyEnd is the end of a run that ended before runs had event logs,
// made from its record: the one event of its log.
func legacyEnd(run store.Run) api.RunEvent {
	at := run.CreatedAt
	if run.FinishedAt != nil {
		at = *run.FinishedAt
	}
	return api.RunEvent{ID: 1, Type: api.RunEventEnd, Time: at, Status: string(run.Status),
		ExitCode: run.ExitCode, Reason: run.Reason, Message: run.Message}
}

// sseWriter writes Server-Sent Events, each flushed at once, each write
// bounded by runEventWriteTimeout.
type sseWriter struct {
	w  http.ResponseWriter
	rc *http.ResponseController
}

func (w *sseWriter) write(b []byte) error {
	if err := w.rc.SetWriteDeadline(time.Now().Add(runEventWriteTimeout)); err != nil && !errors.Is(err, http.ErrNotSupported) {
		return err
	}
	if _, err := w.w.Write(b); err != nil {
		return err
	}
	return w.rc.Flush()
}

func (w *sseWriter) event(e sseEvent) error {
	data, err := json.Marshal(e.data)
	if err != nil {
		return err
	}
	var b bytes.Buffer
	fmt.Fprintf(&b, "id: %d\nevent: %s\ndata: %s\n\n", e.id, e.typ, data)
	return w.write(b.Bytes())
}

// runEvents streams a run's events after the one the follower names (see
// eventsAfter), live: the executor on this replica wakes the stream when
// it records events, and the stream polls the store besides for those of
// another replica's executor. It ends after the run's end event, or when
// the follower goes away, the Server closes or the http.Server serving it
// shuts down; a follower resumes with Last-Event-ID.
func (s *Server) runEvents(w http.ResponseWriter, r *http.Request) {
	run, apiErr := s.visibleRun(r, r.PathValue("run_id"))
	if apiErr != nil {
		writeError(w, apiErr)
		return
	}
	after, apiErr := eventsAfter(r)
	if apiErr != nil {
		writeError(w, apiErr)
		return
	}
	// Subscribed before the first read, so that no notification falls
	// between a read and the wait.
	woken, unsubscribe := s.runNotes.subscribe(run.ID)
	defer unsubscribe()
	metricRunEventStreams.Inc()
	defer metricRunEventStreams.Dec()
	s.serveEventStream(w, r, eventLog{
		log:   s.callLog(r, "run events").WithValues("run", run.ID),
		woken: woken,
		read: func(ctx context.Context, after int64) ([]sseEvent, error) {
			evs, err := s.store.ListRunEvents(ctx, run.ID, after, store.MaxRunEventsPage)
			if err != nil {
				return nil, err
			}
			out := make([]sseEvent, len(evs))
			for i, e := range evs {
				ev, err := wireRunEvent(e)
				if err != nil {
					return nil, err
				}
				out[i] = sseEvent{id: e.Seq, typ: ev.Type, data: ev, last: e.Type == store.RunEventEnd}
			}
			return out, nil
		},
		page: store.MaxRunEventsPage,
		idle: func(ctx context.Context, after int64) ([]sseEvent, bool, error) {
			cur, err := s.store.GetRun(ctx, run.ID)
			switch {
			case errors.Is(err, store.ErrNotFound):
				return nil, true, nil // deleted by retention
			case err != nil:
				return nil, true, err
			case !cur.Status.Terminal():
				return nil, false, nil
			}
			// The store writes a run's end into its log with its final
			// state, so a second look finds every event there is.
			more, err := s.store.ListRunEvents(ctx, run.ID, after, 1)
			if err != nil || len(more) > 0 {
				return nil, false, nil
			}
			// Nothing after the follower's id: it has seen the end, or
			// names an id past it. A run with no log at all ended before
			// runs had logs: its record ends it.
			if after == 0 {
				end := legacyEnd(cur)
				return []sseEvent{{id: end.ID, typ: end.Type, data: end, last: true}}, true, nil
			}
			return nil, true, nil
		},
	}, after)
}

// sseEvent is one event of a stream: its id, its type, and its data,
// sent as JSON; last ends the stream.
type sseEvent struct {
	id   int64
	typ  string
	data any
	last bool
}

// eventLog is a numbered log that serveEventStream streams.
type eventLog struct {
	log logr.Logger
	// woken receives when the log may have grown.
	woken <-chan struct{}
	// read returns the events after id after, in order, at most page.
	read func(ctx context.Context, after int64) ([]sseEvent, error)
	page int
	// idle, when set, is called when a read found nothing new, at most
	// every runEventRecheck: it may send last events and end the stream.
	idle func(ctx context.Context, after int64) ([]sseEvent, bool, error)
}

// serveEventStream streams l's events after id after as Server-Sent
// Events, live: it reads the log again when woken, and every poll
// interval besides for what another replica wrote, and sends a comment
// when idle so that proxies keep the connection. It ends after an event
// marked last, when idle says so, or when the follower goes away, the
// Server closes or the http.Server serving it shuts down; a follower
// resumes with Last-Event-ID.
func (s *Server) serveEventStream(w http.ResponseWriter, r *http.Request, l eventLog, after int64) {
	ctx := r.Context()
	shutdown := s.streamShutdowns.watch(r)
	w.Header().Set("Content-Type", api.ContentTypeEventStream)
	w.Header().Set("Cache-Control", "no-store")
	w.Header().Set("X-Accel-Buffering", "no")
	w.WriteHeader(http.StatusOK)
	sse := &sseWriter{w: w, rc: http.NewResponseController(w)}
	// A browser's EventSource reconnects after this long.
	if err := sse.write([]byte("retry: 1000\n\n")); err != nil {
		return
	}
	poll := time.NewTicker(s.runEventPoll)
	defer poll.Stop()
	keepalive := time.NewTicker(s.runEventKeepalive)
	defer keepalive.Stop()
	// send sends events and reports whether the stream goes on.
	send := func(evs []sseEvent) bool {
		for _, e := range evs {
			if err := sse.event(e); err != nil {
				return false
			}
			after = e.id
			if e.last {
				return false
			}
		}
		return true
	}
	var checked time.Time
	for {
		evs, err := l.read(ctx, after)
		if err != nil {
			if ctx.Err() == nil {
				// The follower reconnects and resumes; it cannot be told
				// with a status any more.
				l.log.Error(err, "read events; ending the stream")
			}
			return
		}
		if !send(evs) {
			return
		}
		if len(evs) == l.page {
			continue
		}
		if len(evs) == 0 && l.idle != nil && time.Since(checked) >= runEventRecheck {
			checked = time.Now()
			last, end, err := l.idle(ctx, after)
			if err != nil && ctx.Err() == nil {
				l.log.Error(err, "check the stream's source; ending the stream")
			}
			if !send(last) || end {
				return
			}
		}
		select {
		case <-ctx.Done():
			return
		case <-s.closing:
			return
		case <-shutdown:
			return
		case <-l.woken:
		case <-poll.C:
		case <-keepalive.C:
			if err := sse.write([]byte(": keepalive\n\n")); err != nil {
				return
			}
		}
	}
}
