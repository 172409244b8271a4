package computeapi

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"sync"
	"time"

	"github.com/coder/websocket"

	api "github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
	"github.com/agentbox/terraform-provider-agentbox/internal/redact"
	"github.com/agentbox/terraform-provider-agentbox/internal/store"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"
)

// The staff console. A staff token mints a console session for one
// agent, with a reason and a time box; the session's PTY is a shell in the
// agent's sandbox, relayed frame for frame from the supervisor's PTY (the
// same agentbox.pty.v1 protocol). The store records who, for which agent,
// why, when they connected and disconnected, the sandbox's snapshot at the
// time, and the terminal's bytes both ways (what was typed, and what the
// terminal showed) up to its cap, with known secret formats redacted. A
// session connects once; the connection ends when the session expires.

const (
	defaultConsoleTTL = 15 * time.Minute
	maxConsoleTTL     = time.Hour
	// transcriptFlush is how much of the terminal's bytes are gathered
	// before they are written to the store (and at the end), so typing
	// does not mean a commit per keystroke.
	transcriptFlush = 16 << 10
)

func (s *Server) staff(r *http.Request) (*Principal, *api.Error) {
	p := PrincipalFrom(r.Context())
	if p == nil || p.Kind != string(store.TokenStaff) {
		return nil, api.Errorf(api.CodePermissionDenied, "console sessions need a staff token")
	}
	if s.store == nil {
		return nil, api.Errorf(api.CodeUnavailable, "the control plane runs without a store, which console sessions are recorded in")
	}
	return p, nil
}

// staffID names the staff member: the token's subject, or its name.
func staffID(p *Principal) string {
	if p.Subject != "" {
		return p.Subject
	}
	return p.Name
}

func (s *Server) createConsoleSession(w http.ResponseWriter, r *http.Request) {
	p, apiErr := s.staff(r)
	if apiErr != nil {
		writeError(w, apiErr)
		return
	}
	var req api.CreateConsoleSessionRequest
	if apiErr := s.decode(w, r, &req); apiErr != nil {
		writeError(w, apiErr)
		return
	}
	noteAuditAgent(r.Context(), req.AgentID)
	switch {
	case req.AgentID == "":
		apiErr = api.Errorf(api.CodeInvalidArgument, "agent_id is required")
	case len(bytes.TrimSpace([]byte(req.Reason))) == 0:
		apiErr = api.Errorf(api.CodeInvalidArgument, "reason is required: every console access says why")
	case req.TTLSeconds < 0 || req.TTLSeconds > int(maxConsoleTTL/time.Second):
		// Compared in seconds: multiplied into a Duration first, a large
		// value wraps around to a short or negative time box.
		apiErr = api.Errorf(api.CodeInvalidArgument, "ttl_seconds must be between 1 and %d (0 means %d), got %d",
			int(maxConsoleTTL/time.Second), int(defaultConsoleTTL/time.Second), req.TTLSeconds)
	}
	if apiErr != nil {
		writeError(w, apiErr)
		return
	}
	ttl := time.Duration(req.TTLSeconds) * time.Second
	if ttl == 0 {
		ttl = defaultConsoleTTL
	}
	c, err := s.store.CreateConsoleSession(r.Context(), staffID(p), req.AgentID, req.Reason, ttl)
	if errors.Is(err, store.ErrInvalid) {
		writeError(w, api.Errorf(api.CodeInvalidArgument, "%v", err))
		return
	}
	if err != nil {
		s.log.Error(err, "create console session")
		writeError(w, api.Errorf(api.CodeInternal, "could not record the console session"))
		return
	}
	writeJSON(w, http.StatusCreated, consoleView(c))
}

func (s *Server) getConsoleSession(w http.ResponseWriter, r *http.Request) {
	p := PrincipalFrom(r.Context())
	if p == nil || (p.Kind != string(store.TokenStaff) && !p.AllAgents) {
		writeError(w, api.Errorf(api.CodePermissionDenied, "console sessions are visible to staff and admins"))
		return
	}
	if s.store == nil {
		writeError(w, api.Errorf(api.CodeUnavailable, "the control plane runs without a store"))
		return
	}
	c, err := s.store.GetConsoleSession(r.Context(), r.PathValue("session_id"))
	if err != nil || (!p.AllAgents && c.StaffID != staffID(p)) {
		if err != nil && !errors.Is(err, store.ErrNotFound) {
			s.log.Error(err, "get console session")
		}
		writeError(w, api.Errorf(api.CodeNotFound, "no console session %q of yours", r.PathValue("session_id")))
		return
	}
	v := consoleView(c)
	v.Transcript, v.TranscriptTruncated = c.Transcript, c.TranscriptTruncated
	for _, r := range c.Records {
		v.TranscriptRecords = append(v.TranscriptRecords, api.TranscriptRecord{Direction: string(r.Direction), At: r.At, Data: r.Data})
	}
	writeJSON(w, http.StatusOK, v)
}

func consoleView(c store.ConsoleSession) api.ConsoleSession {
	return api.ConsoleSession{ID: c.ID, StaffID: c.StaffID, AgentID: c.AgentID, Reason: c.Reason, CreatedAt: c.CreatedAt,
		ExpiresAt: c.ExpiresAt, ConnectedAt: c.ConnectedAt, DisconnectedAt: c.DisconnectedAt, SnapshotID: c.SnapshotID}
}

// consolePTY connects a session to a shell in the agent's sandbox.
func (s *Server) consolePTY(w http.ResponseWriter, r *http.Request) {
	p, apiErr := s.staff(r)
	if apiErr != nil {
		writeError(w, apiErr)
		return
	}
	id := r.PathValue("session_id")
	c, err := s.store.GetConsoleSession(r.Context(), id)
	if err != nil || c.StaffID != staffID(p) {
		writeError(w, api.Errorf(api.CodeNotFound, "no console session %q of yours", id))
		return
	}
	noteAuditAgent(r.Context(), c.AgentID)
	if c.Expired(s.clock.Now()) {
		writeError(w, api.Errorf(api.CodeConsoleExpired, "console session %s expired at %s; mint a new one", id, c.ExpiresAt.UTC().Format(time.RFC3339)))
		return
	}
	if c.ConnectedAt != nil {
		writeError(w, api.Errorf(api.CodeConsoleExpired, "console session %s was already used; a session connects once", id))
		return
	}
	// A console is a shell: only its size is the caller's to choose.
	req, apiErr := ptyRequest(r)
	if apiErr != nil {
		writeError(w, apiErr)
		return
	}
	size := supervisorapi.PTYRequest{Cols: req.Cols, Rows: req.Rows}
	// A hold on the sandbox does not keep staff out; the audit record says
	// whose hold the console passed.
	sup, sb, _, apiErr := s.reach(withHoldBypass(r.Context()), c.AgentID, s.callLog(r, "console_pty").WithValues("agent", c.AgentID))
	if apiErr != nil {
		writeError(w, apiErr)
		return
	}
	upstream, err := sup.DialPTY(r.Context(), size)
	if err != nil {
		writeError(w, supervisorError(r.Context(), err))
		return
	}
	defer upstream.CloseNow()
	snapshot := ""
	if sb.Status.Snapshot != nil {
		snapshot = sb.Status.Snapshot.Name
	}
	if _, err := s.store.ConnectConsoleSession(r.Context(), id, snapshot); err != nil {
		upstream.Close(websocket.StatusNormalClosure, "console session refused")
		if errors.Is(err, store.ErrExpired) || errors.Is(err, store.ErrConflict) {
			writeError(w, api.Errorf(api.CodeConsoleExpired, "console session %s can no longer connect: %v", id, err))
			return
		}
		s.log.Error(err, "connect console session")
		writeError(w, api.Errorf(api.CodeInternal, "could not record the console connection"))
		return
	}
	defer func() {
		// Not the request's context: the client is gone by now.
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if _, err := s.store.DisconnectConsoleSession(ctx, id); err != nil {
			s.log.Error(err, "record console disconnect", "session", id)
		}
	}()
	client, err := acceptPTY(w, r)
	if err != nil {
		return
	}
	defer client.CloseNow()
	ctx, cancel := context.WithDeadline(r.Context(), c.ExpiresAt)
	defer cancel()
	tr := &transcript{st: s.store, id: id, log: s.log, now: s.clock.Now}
	defer tr.close()
	relayPTY(ctx, client, upstream, tr.input, tr.output)
}

// transcript batches a console's terminal bytes, both ways, into the
// session's record. Each direction goes through its own redact.Stream,
// which holds back the end of what it has seen while that may be the
// start of a secret: a key typed a keystroke at a time, or output cut
// between two frames or two writes to the store, is redacted whole. The
// store redacts each record again.
type transcript struct {
	st  *store.Store
	id  string
	now func() time.Time
	log interface {
		Error(err error, msg string, kv ...any)
	}
	mu      sync.Mutex
	in, out redact.Stream
	pending []store.TranscriptRecord
	size    int
}

func (t *transcript) input(b []byte)  { t.add(store.TranscriptInput, b) }
func (t *transcript) output(b []byte) { t.add(store.TranscriptOutput, b) }

func (t *transcript) add(dir store.TranscriptDirection, b []byte) {
	t.mu.Lock()
	stream := &t.out
	if dir == store.TranscriptInput {
		stream = &t.in
	}
	t.appendLocked(dir, stream.Write(b))
	full := t.size >= transcriptFlush
	t.mu.Unlock()
	if full {
		t.flush()
	}
}

// appendLocked adds what a stream let through, to the last record if that
// is of the same direction.
func (t *transcript) appendLocked(dir store.TranscriptDirection, b []byte) {
	if len(b) == 0 {
		return
	}
	if n := len(t.pending); n > 0 && t.pending[n-1].Direction == dir {
		t.pending[n-1].Data = append(t.pending[n-1].Data, b...)
	} else {
		t.pending = append(t.pending, store.TranscriptRecord{Direction: dir, At: t.now(), Data: b})
	}
	t.size += len(b)
}

// close writes what the streams still hold and the rest of the batch.
func (t *transcript) close() {
	t.mu.Lock()
	t.appendLocked(store.TranscriptInput, t.in.Flush())
	t.appendLocked(store.TranscriptOutput, t.out.Flush())
	t.mu.Unlock()
	t.flush()
}

func (t *transcript) flush() {
	t.mu.Lock()
	batch := t.pending
	t.pending, t.size = nil, 0
	t.mu.Unlock()
	if len(batch) == 0 {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := t.st.AppendConsoleTranscript(ctx, t.id, batch...); err != nil {
		t.log.Error(err, "record console transcript", "session", t.id)
	}
}

// Hijack lets a WebSocket upgrade through the audit wrapper; the call is
// recorded with status 101.
func (w *auditedWriter) Hijack() (net.Conn, *bufio.ReadWriter, error) {
	h, ok := w.ResponseWriter.(http.Hijacker)
	if !ok {
		return nil, nil, fmt.Errorf("%T cannot be hijacked", w.ResponseWriter)
	}
	if w.status == 0 {
		w.status = http.StatusSwitchingProtocols
	}
	return h.Hijack()
}
