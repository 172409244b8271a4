package terminal

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/runner"
	api "github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"
	"github.com/coder/websocket"
)

// ptyRun is one session from the upgrade to the end.
type ptyRun struct {
	t    *Terminals
	sess *ptySession
	proc *runner.Process
	ptmx *os.File
	conn *websocket.Conn
	sid  int // the session's ID: the leader's PID

	exited chan struct{} // closed once the leader has been waited for
	result *api.CommandResult
	// audit is the session's record, as the message that carries it (or
	// nil), made once the result is known.
	audit func() []byte

	// lastActivity is the UnixNano of the last frame either way, for the
	// idle timeout.
	lastActivity atomic.Int64
	// typing is set while input is being written to the terminal, which
	// blocks while the process does not read it; the input pump then
	// reads no frames, pongs included, so a ping that fails meanwhile
	// says nothing about the client.
	typing atomic.Bool

	gone     chan struct{} // closed when the client is gone or broke the protocol
	goneOnce sync.Once
	goneWhy  string
}

func (p *ptyRun) waitLeader() {
	res, apiErr := p.t.cfg.Runner.Wait(context.Background(), p.proc)
	if apiErr != nil {
		res = &api.CommandResult{ExitCode: -1, DurationMS: time.Since(p.proc.Started).Milliseconds()}
	}
	p.result = res
	close(p.exited)
}

func (p *ptyRun) clientGone(why string) {
	p.goneOnce.Do(func() {
		p.goneWhy = why
		close(p.gone)
	})
}

func (p *ptyRun) touch() { p.lastActivity.Store(time.Now().UnixNano()) }

// serve runs the session until the process exits, the client goes away
// or a limit or the shutdown ends it.
func (p *ptyRun) serve(reqCtx context.Context) {
	p.gone = make(chan struct{})
	p.touch()
	// ctx bounds every WebSocket operation: it ends with the session, or
	// with reqCtx on a hard shutdown. (After the hijack, reqCtx no longer
	// ends when the client goes away; only the server's base context or
	// the handler's return end it.)
	ctx, cancel := context.WithCancel(reqCtx)
	defer cancel()

	outDone := make(chan struct{})
	go func() {
		defer close(outDone)
		p.pumpOutput(ctx)
	}()
	go p.pumpInput(ctx)
	go p.ping(ctx)

	reason, clientLeft := p.waitEnd(reqCtx)
	if clientLeft {
		// Nobody is left to send output to.
		cancel()
		p.t.cfg.Log.Info("pty client gone; hanging up", "pid", p.sid, "why", p.goneWhy)
	}
	select {
	case <-p.exited:
	default:
		p.hangUp(reqCtx)
	}
	// The leader has exited: what it and its session printed is still
	// being read. Background jobs that keep the terminal open are given
	// WaitDelay before the rest is cut off, as for commands.
	select {
	case <-outDone:
	case <-time.After(p.t.cfg.WaitDelay):
		_ = p.ptmx.SetReadDeadline(time.Now())
		<-outDone
	}
	p.finish()
	if reason == api.PTYReasonIdle || reason == api.PTYReasonTimeLimit {
		p.result.TimedOut = true
	}
	if clientLeft || reqCtx.Err() != nil {
		// Gone, or a hard shutdown that leaves no time to tell it.
		_ = p.conn.CloseNow()
		return
	}
	p.sayGoodbye(ctx, reason)
}

// waitEnd waits for what ends the session: the leader's exit (reason ""),
// the client leaving (clientLeft), a limit, or the shutdown.
func (p *ptyRun) waitEnd(reqCtx context.Context) (reason string, clientLeft bool) {
	idleTimeout := p.t.cfg.IdleTimeout
	idle := time.NewTimer(idleTimeout)
	defer idle.Stop()
	limit := time.NewTimer(p.t.cfg.MaxDuration)
	defer limit.Stop()
	for {
		select {
		case <-p.exited:
			return "", false
		case <-p.gone:
			return "", true
		case <-p.sess.stop:
			return api.PTYReasonShutdown, false
		case <-limit.C:
			return api.PTYReasonTimeLimit, false
		case <-idle.C:
			if left := idleTimeout - time.Since(time.Unix(0, p.lastActivity.Load())); left > 0 {
				idle.Reset(left)
				continue
			}
			return api.PTYReasonIdle, false
		case <-reqCtx.Done():
			// The server is being shut down hard: no grace.
			p.killSession()
			return api.PTYReasonShutdown, false
		}
	}
}

// sayGoodbye tells a client that is still there how the session ended,
// sends the session's record, and closes the WebSocket.
func (p *ptyRun) sayGoodbye(ctx context.Context, reason string) {
	msg, _ := json.Marshal(api.PTYMessage{Type: api.PTYMessageExit, Exit: &api.PTYExit{
		ExitCode: p.result.ExitCode, Signal: p.result.Signal, DurationMS: p.result.DurationMS, Reason: reason,
	}})
	if !p.send(ctx, msg) {
		return
	}
	// The session's record, before the close: the only way left to hand
	// it to the control plane (see api.AuditRecord).
	if p.audit != nil {
		if msg := p.audit(); msg != nil && !p.send(ctx, msg) {
			return
		}
	}
	code, why := websocket.StatusNormalClosure, "process exited"
	if reason != "" {
		code, why = websocket.StatusGoingAway, reason
	}
	// The close handshake waits for the client's answer; one that does
	// not answer is cut off rather than holding up the audit line (and a
	// shutdown).
	closed := make(chan struct{})
	go func() {
		defer close(closed)
		_ = p.conn.Close(code, why)
	}()
	select {
	case <-closed:
	case <-time.After(ptyCloseTimeout):
		_ = p.conn.CloseNow()
		<-closed
	}
}

// send writes one text message, and cuts the connection if it cannot.
func (p *ptyRun) send(ctx context.Context, msg []byte) bool {
	wctx, wcancel := context.WithTimeout(ctx, runner.StreamWriteTimeout)
	err := p.conn.Write(wctx, websocket.MessageText, msg)
	wcancel()
	if err != nil {
		_ = p.conn.CloseNow()
		return false
	}
	return true
}

// finish closes the master once the output is read.
func (p *ptyRun) finish() {
	<-p.exited
	p.ptmx.Close()
}

// pumpOutput sends what the terminal prints until the master reports the
// end of the session (EIO once no process holds the terminal) or its read
// deadline passes. It keeps reading after the client is gone, so that the
// processes never block on a full terminal while they are being hung up.
func (p *ptyRun) pumpOutput(ctx context.Context) {
	buf := make([]byte, ptyReadSize)
	failed := false
	for {
		n, err := p.ptmx.Read(buf)
		if n > 0 && !failed {
			p.touch()
			wctx, cancel := context.WithTimeout(ctx, runner.StreamWriteTimeout)
			werr := p.conn.Write(wctx, websocket.MessageBinary, buf[:n])
			cancel()
			if werr != nil {
				failed = true
				p.clientGone("output: " + werr.Error())
			}
		}
		if err != nil {
			return
		}
	}
}

// pumpInput feeds keyboard input to the terminal and applies control
// messages, until the client goes away.
func (p *ptyRun) pumpInput(ctx context.Context) {
	for {
		typ, data, err := p.conn.Read(ctx)
		if err != nil {
			p.clientGone("input: " + err.Error())
			return
		}
		p.touch()
		switch typ {
		case websocket.MessageBinary:
			// A process that has exited leaves nothing to type into; the
			// session is ending then anyway.
			p.typing.Store(true)
			_, _ = p.ptmx.Write(data)
			p.typing.Store(false)
		case websocket.MessageText:
			if why := p.control(data); why != "" {
				_ = p.conn.Close(websocket.StatusUnsupportedData, why)
				p.clientGone("protocol: " + why)
				return
			}
		}
	}
}

// control applies one control message, returning why it is refused.
func (p *ptyRun) control(data []byte) string {
	var m api.PTYMessage
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&m); err != nil {
		return "invalid control message: " + truncateReason(err.Error())
	}
	switch m.Type {
	case api.PTYMessageResize:
		if m.Cols == 0 || m.Rows == 0 || m.Cols > ptyMaxDimension || m.Rows > ptyMaxDimension {
			return fmt.Sprintf("resize: cols and rows must be from 1 to %d", ptyMaxDimension)
		}
		if err := setWinsize(p.ptmx, m.Cols, m.Rows); err != nil && !errors.Is(err, os.ErrClosed) {
			p.t.cfg.Log.Warn("pty resize failed", "pid", p.sid, "error", err.Error())
		}
		return ""
	default:
		return truncateReason(fmt.Sprintf("unknown control message type %q", m.Type))
	}
}

// truncateReason fits a close reason in the 123 bytes a close frame
// leaves for it.
func truncateReason(s string) string {
	if len(s) > 100 {
		s = runner.TrimPartialRune(s[:100])
	}
	return s
}

// ping checks that a client is still there.
func (p *ptyRun) ping(ctx context.Context) {
	t := time.NewTicker(ptyPingInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-p.exited:
			return
		case <-t.C:
		}
		typingBefore := p.typing.Load()
		pctx, cancel := context.WithTimeout(ctx, ptyPingInterval)
		err := p.conn.Ping(pctx)
		cancel()
		if err != nil && ctx.Err() == nil && !typingBefore && !p.typing.Load() {
			p.clientGone("ping: " + err.Error())
			return
		}
	}
}
