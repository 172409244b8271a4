package supervisorapi

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/url"
	"strconv"
	"sync"
	"time"

	"github.com/coder/websocket"

	"github.com/agentbox/terraform-provider-agentbox/internal/wire"
)

// Interactive terminals.
//
// GET /v1/pty upgrades to a WebSocket whose subprotocol must be
// PTYSubprotocol, connected to a process that runs on a new
// pseudo-terminal as the leader of its own session (so it has a
// controlling terminal, job control works and the whole session can be
// hung up). The query says what to run (see PTYRequest.Query):
//
//	command  repeated, the argv; default an interactive shell (bash if the
//	         commands' PATH has it, else sh; not_found if it has neither)
//	cwd      as for CommandRequest
//	env      repeated KEY=VALUE, merged over the commands' base environment
//	         (TERM defaults to xterm-256color)
//	cols, rows  the initial size, default 80x24
//
// A request the supervisor refuses (a bad query, a missing cwd or program,
// too many sessions) gets an ordinary JSON error response, not an upgrade.
//
// Once upgraded, frames are:
//
//   - binary, both ways: terminal bytes. The client sends keyboard input
//     (at most PTYMaxInputFrame bytes a frame), the supervisor sends what
//     the terminal prints, as raw bytes, not necessarily split at
//     character boundaries.
//   - text, both ways: one PTYMessage, a JSON control message. The client
//     sends {"type":"resize","cols":C,"rows":R}; the supervisor sends
//     {"type":"exit","exit":{...}} once the process has exited and its
//     output has been sent, then {"type":"audit","audit":"..."}, its
//     record of the session (see AuditRecord), which the control plane
//     keeps and does not relay. A text frame that is not a valid message
//     ends the session; clients ignore message types they do not know.
//
// After the exit message the supervisor closes the WebSocket: with 1000
// (normal closure) when the process ended on its own, with 1001 (going
// away) when the supervisor ended the session (PTYExit.Reason says why).
// When the client goes away (or stops answering pings) the supervisor
// hangs up: SIGHUP to every process of the session, SIGKILL after a grace.
const (
	PathPTY = "/v1/pty"
	// PTYSubprotocol is the WebSocket subprotocol of this protocol's
	// version; a later, incompatible one will have another name.
	PTYSubprotocol = "agentbox.pty.v1"
	// PTYMaxInputFrame is the largest binary frame a client may send; the
	// supervisor closes the session on a larger one. PTY.Write splits its
	// input to fit.
	PTYMaxInputFrame = 32 << 10

	DefaultPTYCols = 80
	DefaultPTYRows = 24

	PTYMessageResize = "resize"
	PTYMessageExit   = "exit"
	// PTYMessageAudit is in audit.go.

	// Reasons the supervisor ends a session itself (PTYExit.Reason).
	PTYReasonIdle      = "idle_timeout"
	PTYReasonTimeLimit = "time_limit"
	PTYReasonShutdown  = "shutdown"
)

// PTYRequest says what a PTY session runs; see PathPTY.
type PTYRequest struct {
	Command []string
	Cwd     string
	Env     map[string]string
	// Cols and Rows are the initial size; 0 means the default.
	Cols, Rows uint16
}

// Query encodes r as the query of GET /v1/pty.
func (r PTYRequest) Query() url.Values {
	q := url.Values{}
	for _, a := range r.Command {
		q.Add("command", a)
	}
	if r.Cwd != "" {
		q.Set("cwd", r.Cwd)
	}
	for k, v := range r.Env {
		q.Add("env", k+"="+v)
	}
	if r.Cols != 0 {
		q.Set("cols", strconv.Itoa(int(r.Cols)))
	}
	if r.Rows != 0 {
		q.Set("rows", strconv.Itoa(int(r.Rows)))
	}
	return q
}

// PTYMessage is a control message, the content of a text frame.
type PTYMessage struct {
	Type string `json:"type"`
	// Cols and Rows are set in resize messages; both must be positive.
	Cols uint16 `json:"cols,omitempty"`
	Rows uint16 `json:"rows,omitempty"`
	// Exit is set in exit messages.
	Exit *PTYExit `json:"exit,omitempty"`
	// Audit is set in audit messages: the session's AuditRecord, encoded
	// as for HeaderAudit.
	Audit string `json:"audit,omitempty"`
}

// PTYExit says how a PTY session's process ended.
type PTYExit struct {
	// ExitCode is -1 when the process was ended by a signal.
	ExitCode int `json:"exit_code"`
	// Signal names the signal that ended it, e.g. "SIGHUP", or is empty.
	Signal     string `json:"signal,omitempty"`
	DurationMS int64  `json:"duration_ms"`
	// Reason is set when the supervisor ended the session: PTYReasonIdle,
	// PTYReasonTimeLimit or PTYReasonShutdown.
	Reason string `json:"reason,omitempty"`
}

// ErrPTYClosed is returned by PTY methods after Close.
var ErrPTYClosed = errors.New("supervisor: pty session closed")

// PTY is a client's end of a PTY session. Read returns what the terminal
// prints and io.EOF once the process has exited and all of it was read;
// Write types. Reading is what moves the session along: output is not
// buffered beyond one frame, so a client that stops reading stalls the
// process when the terminal's buffer fills, as a real terminal would.
type PTY struct {
	conn   *websocket.Conn
	ctx    context.Context
	cancel context.CancelFunc
	out    *io.PipeReader
	done   chan struct{}

	// Set before done is closed.
	exit *PTYExit
	err  error

	closeOnce sync.Once
}

// DialPTY opens the WebSocket of a PTY session and leaves the frames to
// the caller: the control plane relays them to a staff console as they
// are. Most callers want OpenPTY. A refusal is an *Error.
func (c *Client) DialPTY(ctx context.Context, req PTYRequest) (*websocket.Conn, error) {
	return wire.DialWebSocket(ctx, c.transport(), PathPTY, req.Query(), PTYSubprotocol)
}

// OpenPTY starts a PTY session. ctx bounds the handshake only; the
// session lasts until the process exits, Close, or the supervisor ends
// it. A refusal is an *Error, as for the other calls.
func (c *Client) OpenPTY(ctx context.Context, req PTYRequest) (*PTY, error) {
	conn, err := c.DialPTY(ctx, req)
	if err != nil {
		return nil, err
	}
	return NewPTY(conn), nil
}

// NewPTY is the client end of a PTY session over conn, a WebSocket that
// speaks PTYSubprotocol: the supervisor's own, or the control plane's staff
// console, which relays it.
func NewPTY(conn *websocket.Conn) *PTY {
	pctx, cancel := context.WithCancel(context.Background())
	pr, pw := io.Pipe()
	p := &PTY{conn: conn, ctx: pctx, cancel: cancel, out: pr, done: make(chan struct{})}
	go p.readLoop(pw)
	return p
}

func (p *PTY) readLoop(pw *io.PipeWriter) {
	defer close(p.done)
	for {
		typ, data, err := p.conn.Read(p.ctx)
		if err != nil {
			switch {
			case p.exit != nil:
				pw.Close()
			case p.ctx.Err() != nil:
				p.err = ErrPTYClosed
				pw.CloseWithError(p.err)
			default:
				p.err = fmt.Errorf("supervisor: pty session ended without an exit message: %w", err)
				pw.CloseWithError(p.err)
			}
			return
		}
		switch typ {
		case websocket.MessageBinary:
			if _, err := pw.Write(data); err != nil {
				// The reader was closed: Close was called.
				p.err = ErrPTYClosed
				return
			}
		case websocket.MessageText:
			var m PTYMessage
			if err := json.Unmarshal(data, &m); err != nil {
				p.err = fmt.Errorf("supervisor: invalid pty control message: %w", err)
				pw.CloseWithError(p.err)
				p.conn.Close(websocket.StatusUnsupportedData, "invalid control message")
				return
			}
			if m.Type == PTYMessageExit && m.Exit != nil {
				p.exit = m.Exit
			}
		}
	}
}

// Read reads terminal output.
func (p *PTY) Read(b []byte) (int, error) { return p.out.Read(b) }

// Write sends b as keyboard input, in frames of at most PTYMaxInputFrame
// bytes.
func (p *PTY) Write(b []byte) (int, error) {
	n := 0
	for len(b) > 0 {
		chunk := b[:min(len(b), PTYMaxInputFrame)]
		if err := p.conn.Write(p.ctx, websocket.MessageBinary, chunk); err != nil {
			if p.ctx.Err() != nil {
				return n, ErrPTYClosed
			}
			return n, fmt.Errorf("supervisor: pty input: %w", err)
		}
		n += len(chunk)
		b = b[len(chunk):]
	}
	return n, nil
}

// Resize tells the terminal its new size; the process gets SIGWINCH.
func (p *PTY) Resize(ctx context.Context, cols, rows uint16) error {
	if cols == 0 || rows == 0 {
		return fmt.Errorf("supervisor: pty size %dx%d: both must be positive", cols, rows)
	}
	msg, err := json.Marshal(PTYMessage{Type: PTYMessageResize, Cols: cols, Rows: rows})
	if err != nil {
		return err
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stop := context.AfterFunc(p.ctx, cancel)
	defer stop()
	if err := p.conn.Write(ctx, websocket.MessageText, msg); err != nil {
		if p.ctx.Err() != nil {
			return ErrPTYClosed
		}
		return fmt.Errorf("supervisor: pty resize: %w", err)
	}
	return nil
}

// Wait returns how the process ended once the session is over. Output
// must be read (to io.EOF) meanwhile, or Wait blocks for as long as the
// unread output holds the session up.
func (p *PTY) Wait(ctx context.Context) (*PTYExit, error) {
	select {
	case <-p.done:
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	if p.exit != nil {
		return p.exit, nil
	}
	return nil, p.err
}

// Close ends the session from the client's side; the supervisor then
// hangs up the process's session. It is safe to call more than once, and
// after the process exited.
func (p *PTY) Close() error {
	p.closeOnce.Do(func() {
		p.out.CloseWithError(ErrPTYClosed)
		// Bounded: a supervisor that does not answer the close frame is
		// cut off.
		done := make(chan struct{})
		go func() {
			defer close(done)
			_ = p.conn.Close(websocket.StatusNormalClosure, "client closed the session")
		}()
		select {
		case <-done:
		case <-time.After(5 * time.Second):
		}
		p.cancel()
		_ = p.conn.CloseNow()
		<-p.done
	})
	return nil
}
