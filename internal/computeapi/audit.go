package computeapi

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"hash"
	"io"
	"net/http"
	"sync"
	"time"

	"github.com/go-logr/logr"

	api "github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
	"github.com/agentbox/terraform-provider-agentbox/internal/contentcoding"
	"github.com/agentbox/terraform-provider-agentbox/internal/store"
)

// Every call, refused ones included, is appended to the store's
// hash-chained audit log: who called, for which agent, which operation, a
// hash of the parameters (what was asked, without secrets or file
// contents), how long it took and how it ended. The records of the
// sandbox's supervisor for the calls it served follow (see
// supervisoraudit.go).
//
// Appends go through one background writer that commits them in batches,
// so that a call does not wait for a commit of its own (about a
// millisecond each on these stores) and concurrent calls share commits.
// Nothing is dropped: when the writer falls behind, callers wait for room.

const (
	auditQueue      = 4096
	auditBatch      = 256
	auditRetryDelay = time.Second
	// auditDetailBytes bounds how much of an error response is kept to
	// find its code.
	auditDetailBytes = 2048
)

type auditor struct {
	st   *store.Store
	log  logr.Logger
	ch   chan store.AuditEntry
	done chan struct{}

	// closed, under mu, keeps tryRecord from sending on the closed
	// channel.
	mu     sync.RWMutex
	closed bool
}

func newAuditor(st *store.Store, log logr.Logger) *auditor {
	a := &auditor{st: st, log: log, ch: make(chan store.AuditEntry, auditQueue), done: make(chan struct{})}
	go a.run()
	return a
}

func (a *auditor) record(e store.AuditEntry) {
	a.ch <- e
	metricAuditQueue.Set(float64(len(a.ch)))
}

// tryRecord is record for records that may come after close (a
// supervisor's answer read by a goroutine that outlived the API), which
// are dropped then.
func (a *auditor) tryRecord(e store.AuditEntry) {
	a.mu.RLock()
	defer a.mu.RUnlock()
	if !a.closed {
		a.record(e)
	}
}

// close writes what is queued and stops the writer.
func (a *auditor) close() {
	a.mu.Lock()
	a.closed = true
	close(a.ch)
	a.mu.Unlock()
	<-a.done
}

func (a *auditor) run() {
	defer close(a.done)
	batch := make([]store.AuditEntry, 0, auditBatch)
	for e := range a.ch {
		batch = append(batch[:0], e)
	more:
		for len(batch) < auditBatch {
			select {
			case e, ok := <-a.ch:
				if !ok {
					break more
				}
				batch = append(batch, e)
			default:
				break more
			}
		}
		for {
			// Not the request's context: the call is over, its record is not.
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			_, err := a.st.AppendAuditBatch(ctx, batch)
			cancel()
			if err == nil {
				metricAuditQueue.Set(float64(len(a.ch)))
				break
			}
			metricAuditFailures.Inc()
			a.log.Error(err, "append to the audit log failed; retrying", "records", len(batch))
			time.Sleep(auditRetryDelay)
		}
	}
}

// auditedWriter remembers the status, and the start of an error body to
// learn the error's code from.
type auditedWriter struct {
	http.ResponseWriter
	status int
	body   bytes.Buffer
}

func (w *auditedWriter) WriteHeader(status int) {
	if w.status == 0 {
		w.status = status
	}
	w.ResponseWriter.WriteHeader(status)
}

func (w *auditedWriter) Write(p []byte) (int, error) {
	if w.status == 0 {
		w.status = http.StatusOK
	}
	if w.status >= 400 && w.body.Len() < auditDetailBytes {
		w.body.Write(p[:min(len(p), auditDetailBytes-w.body.Len())])
	}
	return w.ResponseWriter.Write(p)
}

// Unwrap lets http.ResponseController reach the connection's writer, for
// a stream's write deadlines.
func (w *auditedWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }

func (w *auditedWriter) Flush() {
	if f, ok := w.ResponseWriter.(http.Flusher); ok {
		f.Flush()
	}
}

// hashedBody feeds what the handler reads of the request body to h.
type hashedBody struct {
	io.ReadCloser
	h hash.Hash
}

func (b hashedBody) Read(p []byte) (int, error) {
	n, err := b.ReadCloser.Read(p)
	b.h.Write(p[:n])
	return n, err
}

// audited wraps a handler so that its call is recorded once it returns,
// and returns the call's result (resultOf). p is nil for a call refused
// before anyone was authenticated.
func (s *Server) audited(op string, w http.ResponseWriter, r *http.Request, serve func(http.ResponseWriter, *http.Request) *Principal) string {
	start := s.clock.Now()
	r, requestID := withRequestID(w, r)
	// Every answer names the codings uploads may come in, so that a
	// client learns it from whatever call it makes first.
	contentcoding.Advertise(w.Header())
	if s.audit == nil {
		aw := &auditedWriter{ResponseWriter: w}
		serve(aw, r)
		result := resultOf(aw)
		metricRequestSeconds.WithLabelValues(op, result).Observe(s.clock.Since(start).Seconds())
		return result
	}
	h := sha256.New()
	// The parameters are the request line's query and the body as read.
	io.WriteString(h, r.Method+" "+r.URL.EscapedPath()+"?"+r.URL.RawQuery+"\n")
	if r.Body != nil {
		r.Body = hashedBody{ReadCloser: r.Body, h: h}
	}
	note := &auditNote{}
	r = r.WithContext(context.WithValue(r.Context(), auditNoteKey{}, note))
	// The supervisor calls made while serving r report their records
	// here, to be appended after the call's own (see supervisoraudit.go).
	r, calls := withSupervisorCalls(r)
	aw := &auditedWriter{ResponseWriter: w}
	p := serve(aw, r)
	e := store.AuditEntry{
		Time:       start,
		Caller:     "anonymous",
		CallerKind: "anonymous",
		AgentID:    r.PathValue("agent_id"),
		Operation:  op,
		ParamsHash: hex.EncodeToString(h.Sum(nil)),
		Duration:   s.clock.Since(start),
		Status:     aw.status,
		RequestID:  requestID,
	}
	if p != nil {
		e.Caller, e.CallerKind = p.Name, p.Kind
	}
	e.Detail = note.detail()
	if e.AgentID == "" {
		e.AgentID = note.agent()
	}
	e.Result = resultOf(aw)
	metricRequestSeconds.WithLabelValues(op, e.Result).Observe(e.Duration.Seconds())
	s.audit.record(e)
	for _, se := range calls.finish(e) {
		s.audit.record(se)
	}
	return e.Result
}

// auditNote is what a handler adds to its call's audit record: facts a
// reviewer needs beyond who, what and how it ended, such as a hold the
// staff console passed, which become the record's detail (a JSON
// object), and the agent of a call whose path does not name it (a console
// session's).
type auditNote struct {
	mu      sync.Mutex
	fields  map[string]any
	agentID string
}

type auditNoteKey struct{}

// noteAudit adds key to the audit record of the call of ctx; outside an
// audited call it does nothing.
func noteAudit(ctx context.Context, key string, value any) {
	n, _ := ctx.Value(auditNoteKey{}).(*auditNote)
	if n == nil {
		return
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.fields == nil {
		n.fields = map[string]any{}
	}
	n.fields[key] = value
}

// noteAuditAgent names the agent the call of ctx acts on, for a call whose
// path does not.
func noteAuditAgent(ctx context.Context, agentID string) {
	if n, _ := ctx.Value(auditNoteKey{}).(*auditNote); n != nil {
		n.mu.Lock()
		n.agentID = agentID
		n.mu.Unlock()
	}
}

func (n *auditNote) agent() string {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.agentID
}

func (n *auditNote) detail() string {
	n.mu.Lock()
	defer n.mu.Unlock()
	if len(n.fields) == 0 {
		return ""
	}
	b, err := json.Marshal(n.fields)
	if err != nil {
		return fmt.Sprintf("%v", n.fields)
	}
	return string(b)
}

const resultOK = "ok"

// resultOf is resultOK, or the code of the API error the response carried.
func resultOf(aw *auditedWriter) string {
	if aw.status < 400 {
		return resultOK
	}
	var body api.ErrorBody
	if json.Unmarshal(aw.body.Bytes(), &body) == nil && body.Error != nil && body.Error.Code != "" {
		return string(body.Error.Code)
	}
	return "error"
}
