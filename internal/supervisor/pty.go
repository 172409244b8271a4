package supervisor

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/coder/websocket"
	"github.com/creack/pty"
	"golang.org/x/sys/unix"

	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/procenv"
	api "github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"
)

// Interactive terminals: GET /v1/pty (the protocol is described in
// supervisorapi, next to its client).
//
// The WebSocket library is github.com/coder/websocket: its calls take a
// context, its Conn may be written from several goroutines (output,
// control messages and pings here), it has no dependencies, and its client
// dials through an *http.Client, so the control plane's mTLS client works
// for sessions unchanged. gorilla/websocket, the other candidate, needs a
// single writer and a dialer configured apart from the HTTP client.

// Defaults for the PTY limits in Config.
const (
	DefaultPTYIdleTimeout = 30 * time.Minute
	DefaultPTYMaxDuration = 12 * time.Hour
)

const (
	// ptyPingInterval is how often a quiet session checks that the client
	// is still there; a client that does not answer within it is gone. A
	// peer that vanished without closing its TCP connection would
	// otherwise keep the session (and its processes) until the idle
	// timeout.
	ptyPingInterval = 30 * time.Second
	// ptyCloseTimeout bounds the close handshake at the end of a session.
	ptyCloseTimeout = 2 * time.Second
	// ptyReadSize is the most output sent in one frame.
	ptyReadSize = 32 << 10
	// ptyTerm is TERM for sessions whose request does not set it.
	ptyTerm = "xterm-256color"
	// ptyMaxDimension bounds cols and rows; the kernel takes any uint16,
	// but a program that allocates a screen buffer from them need not.
	ptyMaxDimension = 4096
)

// ptySession is the part of a running session that Terminate reaches.
type ptySession struct {
	stop     chan struct{} // closed when the supervisor is shutting down
	stopOnce sync.Once
}

func (p *ptySession) shutdown() { p.stopOnce.Do(func() { close(p.stop) }) }

// hangUpPTYsLocked tells every PTY session that the supervisor is shutting
// down; each then hangs up its processes and closes its WebSocket.
// Interactive shells ignore the SIGTERM that Terminate sends to process
// groups, so a hangup is what ends them. Called with s.mu held.
func (s *Server) hangUpPTYsLocked() {
	for p := range s.ptys {
		p.shutdown()
	}
}

// registerPTY records a session for Terminate, or refuses it once the
// supervisor is shutting down.
func (s *Server) registerPTY(p *ptySession) *api.Error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.terminating {
		return api.Errorf(api.CodeUnavailable, "the supervisor is shutting down")
	}
	if s.ptys == nil {
		s.ptys = make(map[*ptySession]struct{})
	}
	s.ptys[p] = struct{}{}
	return nil
}

func (s *Server) unregisterPTY(p *ptySession) {
	s.mu.Lock()
	delete(s.ptys, p)
	s.mu.Unlock()
}

func (s *Server) ptyIdleTimeout() time.Duration {
	if s.cfg.PTYIdleTimeout > 0 {
		return s.cfg.PTYIdleTimeout
	}
	return DefaultPTYIdleTimeout
}

func (s *Server) ptyMaxDuration() time.Duration {
	if s.cfg.PTYMaxDuration > 0 {
		return s.cfg.PTYMaxDuration
	}
	return DefaultPTYMaxDuration
}

// servePTY serves GET /v1/pty and reports whether the path was it. The
// call lasts as long as the session; its one log and audit line, written
// by ServeHTTP when it returns, carries the duration and how the process
// ended.
func (s *Server) servePTY(w *recorder, r *http.Request, info *requestInfo) bool {
	if r.URL.Path != api.PathPTY {
		return false
	}
	if r.Method != http.MethodGet {
		methodNotAllowed(w, r, "GET")
		return true
	}
	if !headerHasToken(r.Header, "Upgrade", "websocket") || !headerHasToken(r.Header, "Connection", "upgrade") {
		e := api.Errorf(api.CodeInvalidArgument, "%s is a WebSocket endpoint; send an upgrade request with subprotocol %s", api.PathPTY, api.PTYSubprotocol)
		e.Status = http.StatusUpgradeRequired
		w.Header().Set("Upgrade", "websocket")
		info.fail(w, e)
		return true
	}
	if !headerHasToken(r.Header, "Sec-WebSocket-Protocol", api.PTYSubprotocol) {
		info.fail(w, api.Errorf(api.CodeInvalidArgument, "the WebSocket subprotocol must be %s", api.PTYSubprotocol))
		return true
	}
	req, apiErr := parsePTYQuery(r.URL.Query())
	if apiErr != nil {
		info.fail(w, apiErr)
		return true
	}
	spec, apiErr := s.preparePTY(req)
	if apiErr != nil {
		info.fail(w, apiErr)
		return true
	}
	info.setProgram(spec.argv)

	sess := &ptySession{stop: make(chan struct{})}
	if apiErr := s.registerPTY(sess); apiErr != nil {
		info.fail(w, apiErr)
		return true
	}
	defer s.unregisterPTY(sess)
	release, apiErr := s.tryAcquire()
	if apiErr != nil {
		info.fail(w, apiErr)
		return true
	}
	defer release()

	proc, ptmx, apiErr := s.startPTY(spec, req.cols, req.rows)
	if apiErr != nil {
		info.fail(w, apiErr)
		return true
	}
	run := &ptyRun{s: s, sess: sess, proc: proc, ptmx: ptmx, sid: proc.cmd.Process.Pid, exited: make(chan struct{})}
	go run.waitLeader()

	// The server's read and write deadlines were set for an ordinary
	// request and stay on the connection after the hijack; the session
	// manages its own.
	rc := http.NewResponseController(w)
	_ = rc.SetReadDeadline(time.Time{})
	_ = rc.SetWriteDeadline(time.Time{})
	conn, err := websocket.Accept(w, r, &websocket.AcceptOptions{Subprotocols: []string{api.PTYSubprotocol}})
	if err != nil {
		// Accept has answered the client already.
		info.err = api.Errorf(api.CodeInvalidArgument, "websocket upgrade: %v", err)
		run.hangUp(r.Context())
		run.finish()
		info.result = run.result
		return true
	}
	conn.SetReadLimit(api.PTYMaxInputFrame)
	run.conn = conn
	run.audit = func() []byte {
		info.result = run.result
		v, err := api.EncodeAuditRecord(*info.record())
		if err != nil {
			s.log.Error("audit record not encoded", "tool", "pty_session", "error", err.Error())
			return nil
		}
		msg, _ := json.Marshal(api.PTYMessage{Type: api.PTYMessageAudit, Audit: v})
		return msg
	}
	run.serve(r.Context())
	info.result = run.result
	return true
}

// ptyRequest is a parsed GET /v1/pty query.
type ptyRequest struct {
	command    []string
	cwd        string
	env        map[string]string
	cols, rows uint16
}

// parsePTYQuery parses what api.PTYRequest.Query encodes. Unknown
// parameters are refused, as unknown fields are elsewhere, so that a typo
// is not silently ignored.
func parsePTYQuery(q url.Values) (*ptyRequest, *api.Error) {
	req := &ptyRequest{cols: api.DefaultPTYCols, rows: api.DefaultPTYRows}
	for k, vs := range q {
		switch k {
		case "command":
			req.command = vs
		case "cwd":
			if len(vs) != 1 {
				return nil, api.Errorf(api.CodeInvalidArgument, "cwd is given %d times", len(vs))
			}
			req.cwd = vs[0]
		case "env":
			req.env = make(map[string]string, len(vs))
			for _, kv := range vs {
				name, value, ok := strings.Cut(kv, "=")
				if !ok {
					return nil, api.Errorf(api.CodeInvalidArgument, "env %q is not KEY=VALUE", kv)
				}
				req.env[name] = value
			}
		case "cols", "rows":
			if len(vs) != 1 {
				return nil, api.Errorf(api.CodeInvalidArgument, "%s is given %d times", k, len(vs))
			}
			n, err := strconv.ParseUint(vs[0], 10, 16)
			if err != nil || n == 0 || n > ptyMaxDimension {
				return nil, api.Errorf(api.CodeInvalidArgument, "%s must be an integer from 1 to %d, not %q", k, ptyMaxDimension, vs[0])
			}
			if k == "cols" {
				req.cols = uint16(n)
			} else {
				req.rows = uint16(n)
			}
		default:
			return nil, api.Errorf(api.CodeInvalidArgument, "unknown query parameter %q (known: command, cwd, env, cols, rows)", k)
		}
	}
	return req, nil
}

// preparePTY checks a session's command as prepare checks any command's
// (cwd, environment, PATH lookup), after filling in the shell and TERM.
func (s *Server) preparePTY(req *ptyRequest) (*commandSpec, *api.Error) {
	env := make(map[string]string, len(req.env)+1)
	env["TERM"] = ptyTerm
	for k, v := range req.env {
		env[k] = v
	}
	command := req.command
	if len(command) == 0 {
		// A shell, looked for where the session will look: bash for its
		// line editing, else the POSIX sh every image has.
		pathEnv := s.baseEnv["PATH"]
		if p, ok := env["PATH"]; ok {
			pathEnv = p
		}
		command = []string{"sh"}
		if _, err := procenv.LookPath("bash", pathEnv, s.defaultCwd); err == nil {
			command = []string{"bash"}
		}
	}
	// The timeout and output cap prepare checks do not apply: the session
	// has its own limits and its output is streamed.
	return s.prepare(&api.CommandRequest{Command: command, Cwd: req.cwd, Env: env}, s.cfg.DefaultTimeout, s.cfg.MaxTimeout)
}

// startPTY starts spec as the leader of a new session whose controlling
// terminal is a new pseudo-terminal, and returns the terminal's master.
// Like spawn, it registers the process with the reaper and tracks its
// process group for Terminate and Kill.
func (s *Server) startPTY(spec *commandSpec, cols, rows uint16) (*process, *os.File, *api.Error) {
	ptmx, tty, err := openPTY()
	if err != nil {
		return nil, nil, api.Errorf(api.CodeInternal, "open a pseudo-terminal: %v", err)
	}
	// The parent's copy of the terminal must be closed once the child has
	// its own, or the master never sees the end of the session.
	defer tty.Close()
	if err := pty.Setsize(tty, &pty.Winsize{Cols: cols, Rows: rows}); err != nil {
		ptmx.Close()
		return nil, nil, api.Errorf(api.CodeInternal, "set the terminal size: %v", err)
	}
	cmd := exec.Command(spec.path)
	cmd.Args = spec.argv
	cmd.Dir = spec.dir
	cmd.Env = spec.env
	cmd.Stdin, cmd.Stdout, cmd.Stderr = tty, tty, tty
	// Setsid makes the process the leader of a new session and process
	// group (both IDs are its PID); Setctty makes its stdin, the terminal,
	// the session's controlling terminal, which job control needs.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true, Setctty: true, Ctty: 0}
	p := &process{cmd: cmd, argv0: spec.argv[0], start: time.Now()}
	if err := s.startConfined(cmd); err != nil {
		ptmx.Close()
		return nil, nil, startError(spec, err)
	}
	s.track(cmd.Process.Pid)
	return p, ptmx, nil
}

// openPTY opens a pseudo-terminal pair with creack/pty. pty.Open asks for
// the master's descriptor number for its ioctls, which puts the
// descriptor in blocking mode for good, and a blocked Read could then
// neither time out nor be interrupted by Close. A duplicate, set
// non-blocking before os.NewFile sees it, is pollable again.
func openPTY() (master, tty *os.File, err error) {
	m, tty, err := pty.Open()
	if err != nil {
		return nil, nil, err
	}
	defer m.Close()
	fd, err := unix.FcntlInt(m.Fd(), unix.F_DUPFD_CLOEXEC, 0)
	if err == nil {
		err = unix.SetNonblock(fd, true)
		if err != nil {
			unix.Close(fd)
		}
	}
	if err != nil {
		tty.Close()
		return nil, nil, fmt.Errorf("duplicate the pty master: %w", err)
	}
	return os.NewFile(uintptr(fd), m.Name()), tty, nil
}

// setWinsize sets the terminal's size through the master, without taking
// its descriptor out of non-blocking mode (as pty.Setsize would). The
// kernel sends SIGWINCH to the terminal's foreground process group.
func setWinsize(ptmx *os.File, cols, rows uint16) error {
	rc, err := ptmx.SyscallConn()
	if err != nil {
		return err
	}
	var ioErr error
	err = rc.Control(func(fd uintptr) {
		ioErr = unix.IoctlSetWinsize(int(fd), unix.TIOCSWINSZ, &unix.Winsize{Col: cols, Row: rows})
	})
	if err != nil {
		return err
	}
	return ioErr
}

// ptyRun is one session from the upgrade to the end.
type ptyRun struct {
	s    *Server
	sess *ptySession
	proc *process
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
	res, apiErr := p.s.wait(context.Background(), p.proc)
	if apiErr != nil {
		res = &api.CommandResult{ExitCode: -1, DurationMS: time.Since(p.proc.start).Milliseconds()}
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

	idleTimeout := p.s.ptyIdleTimeout()
	idle := time.NewTimer(idleTimeout)
	defer idle.Stop()
	limit := time.NewTimer(p.s.ptyMaxDuration())
	defer limit.Stop()

	reason := ""
	clientLeft := false
wait:
	for {
		select {
		case <-p.exited:
			break wait
		case <-p.gone:
			clientLeft = true
			break wait
		case <-p.sess.stop:
			reason = api.PTYReasonShutdown
			break wait
		case <-limit.C:
			reason = api.PTYReasonTimeLimit
			break wait
		case <-idle.C:
			if left := idleTimeout - time.Since(time.Unix(0, p.lastActivity.Load())); left > 0 {
				idle.Reset(left)
				continue
			}
			reason = api.PTYReasonIdle
			break wait
		case <-reqCtx.Done():
			// The server is being shut down hard: no grace.
			reason = api.PTYReasonShutdown
			p.killSession()
			break wait
		}
	}
	if clientLeft {
		// Nobody is left to send output to.
		cancel()
		p.s.log.Info("pty client gone; hanging up", "pid", p.sid, "why", p.goneWhy)
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
	case <-time.After(p.s.cfg.WaitDelay):
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
	msg, _ := json.Marshal(api.PTYMessage{Type: api.PTYMessageExit, Exit: &api.PTYExit{
		ExitCode: p.result.ExitCode, Signal: p.result.Signal, DurationMS: p.result.DurationMS, Reason: reason,
	}})
	wctx, wcancel := context.WithTimeout(ctx, streamWriteTimeout)
	err := p.conn.Write(wctx, websocket.MessageText, msg)
	wcancel()
	if err != nil {
		_ = p.conn.CloseNow()
		return
	}
	// The session's record, before the close: the only way left to hand
	// it to the control plane (see api.AuditRecord).
	if p.audit != nil {
		if msg := p.audit(); msg != nil {
			wctx, wcancel := context.WithTimeout(ctx, streamWriteTimeout)
			err := p.conn.Write(wctx, websocket.MessageText, msg)
			wcancel()
			if err != nil {
				_ = p.conn.CloseNow()
				return
			}
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
			wctx, cancel := context.WithTimeout(ctx, streamWriteTimeout)
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
			p.s.log.Warn("pty resize failed", "pid", p.sid, "error", err.Error())
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
		s = trimPartialRune(s[:100])
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

// hangUp ends the session as a terminal hangup would: SIGHUP to every
// process in it (job control puts a shell's jobs in process groups of
// their own, so the leader's group is not enough), then SIGKILL to
// whatever is left after ProcessKillGrace, or at once if reqCtx ends. It
// returns once no process of the session is left. A session that ends by
// itself, by contrast, leaves its background jobs running, as a command
// does.
func (p *ptyRun) hangUp(reqCtx context.Context) {
	hup := func() {
		signalSession(p.sid, syscall.SIGHUP)
		// A stopped job would not see the SIGHUP until continued.
		signalSession(p.sid, syscall.SIGCONT)
	}
	hup()
	deadline := time.NewTimer(p.s.cfg.ProcessKillGrace)
	defer deadline.Stop()
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for ticks := 1; ; ticks++ {
		select {
		case <-deadline.C:
			p.killSession()
			return
		case <-reqCtx.Done():
			p.killSession()
			return
		case <-tick.C:
			if len(sessionMembers(p.sid)) == 0 {
				<-p.exited
				return
			}
			// An interactive bash that got the shutdown's SIGTERM (which
			// it ignores) just before the SIGHUP once sat in its prompt
			// until killed: readline defers the signals it catches and
			// acts on one at a time. A repeated hangup reaches it once
			// it is back in its read.
			if ticks%hangUpRepeatTicks == 0 {
				hup()
			}
		}
	}
}

// hangUpRepeatTicks is how many 20 ms ticks pass between repeated hangups.
const hangUpRepeatTicks = 5

// killSession sends SIGKILL to every process of the session, and waits
// for the leader.
func (p *ptyRun) killSession() {
	signalSession(p.sid, syscall.SIGKILL)
	<-p.exited
	// Members that forked while being killed.
	signalSession(p.sid, syscall.SIGKILL)
}

// signalSession sends sig to every live process of session sid. There is
// no kill(2) for a session, and job control spreads one over several
// process groups.
func signalSession(sid int, sig syscall.Signal) {
	for _, pid := range sessionMembers(sid) {
		_ = syscall.Kill(pid, sig)
	}
}

// sessionMembers lists the live (not zombie) processes whose session is
// sid, from /proc/<pid>/stat.
func sessionMembers(sid int) []int {
	entries, err := os.ReadDir("/proc")
	if err != nil {
		return nil
	}
	var out []int
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		data, err := os.ReadFile("/proc/" + e.Name() + "/stat")
		if err != nil {
			continue
		}
		// The command name is in parentheses and may contain anything;
		// the fields after the last ')' are state, ppid, pgrp, session.
		i := bytes.LastIndexByte(data, ')')
		if i < 0 {
			continue
		}
		f := bytes.Fields(data[i+1:])
		if len(f) < 4 || len(f[0]) != 1 || f[0][0] == 'Z' {
			continue
		}
		if s, err := strconv.Atoi(string(f[3])); err == nil && s == sid {
			out = append(out, pid)
		}
	}
	return out
}

// headerHasToken reports whether a comma-separated header has token,
// ignoring case.
func headerHasToken(h http.Header, name, token string) bool {
	for _, v := range h.Values(name) {
		for _, t := range strings.Split(v, ",") {
			if strings.EqualFold(strings.TrimSpace(t), token) {
				return true
			}
		}
	}
	return false
}
