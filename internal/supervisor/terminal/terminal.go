// Package terminal serves interactive terminal sessions (GET /v1/pty): a
// command on a new pseudo-terminal, spoken to over a WebSocket, bounded by
// an idle timeout and a maximum duration, and hung up as a terminal would
// be when its client leaves or the supervisor shuts down.
package terminal

import (
	"encoding/json"
	"log/slog"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/coder/websocket"

	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/httpcall"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/procenv"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/runner"
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

// Defaults for Config's zero limits.
const (
	DefaultIdleTimeout = 30 * time.Minute
	DefaultMaxDuration = 12 * time.Hour
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

// Config configures Terminals.
type Config struct {
	// Runner starts the sessions' commands.
	Runner *runner.Runner
	// Admit takes one of the supervisor's concurrent-command slots, or
	// refuses at once: an interactive session never waits.
	Admit func() (release func(), _ *api.Error)
	// DefaultTimeout and MaxTimeout are the command limits a session's
	// command is prepared under (it is not bound by them).
	DefaultTimeout, MaxTimeout time.Duration
	// IdleTimeout ends a session in which nothing was typed or printed for
	// this long; MaxDuration ends any session this long after it started.
	// Zero means DefaultIdleTimeout and DefaultMaxDuration.
	IdleTimeout, MaxDuration time.Duration
	// WaitDelay is how long output is still read after the leader exited;
	// KillGrace how long a hung-up session has before SIGKILL.
	WaitDelay, KillGrace time.Duration
	Log                  *slog.Logger
}

// Terminals is the supervisor's PTY sessions.
type Terminals struct {
	cfg Config

	mu sync.Mutex
	// sessions are the running sessions, for HangUp to reach; closed is
	// set once the supervisor is shutting down.
	sessions map[*ptySession]struct{}
	closed   bool
}

// New returns Terminals configured by cfg.
func New(cfg Config) *Terminals {
	if cfg.IdleTimeout <= 0 {
		cfg.IdleTimeout = DefaultIdleTimeout
	}
	if cfg.MaxDuration <= 0 {
		cfg.MaxDuration = DefaultMaxDuration
	}
	return &Terminals{cfg: cfg, sessions: make(map[*ptySession]struct{})}
}

// ptySession is the part of a running session that HangUp reaches.
type ptySession struct {
	stop     chan struct{} // closed when the supervisor is shutting down
	stopOnce sync.Once
}

func (p *ptySession) shutdown() { p.stopOnce.Do(func() { close(p.stop) }) }

// HangUp refuses new sessions and tells every running one that the
// supervisor is shutting down; each then hangs up its processes and
// closes its WebSocket. Interactive shells ignore the SIGTERM that
// shutdown sends to process groups, so a hangup is what ends them.
func (t *Terminals) HangUp() {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.closed = true
	for p := range t.sessions {
		p.shutdown()
	}
}

// Refuse refuses new sessions from now on, and leaves the running ones be.
func (t *Terminals) Refuse() {
	t.mu.Lock()
	t.closed = true
	t.mu.Unlock()
}

// register records a session for HangUp, or refuses it once the
// supervisor is shutting down.
func (t *Terminals) register(p *ptySession) *api.Error {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closed {
		return api.Errorf(api.CodeUnavailable, "the supervisor is shutting down")
	}
	t.sessions[p] = struct{}{}
	return nil
}

func (t *Terminals) unregister(p *ptySession) {
	t.mu.Lock()
	delete(t.sessions, p)
	t.mu.Unlock()
}

// Serve serves GET /v1/pty. The call lasts as long as the session; its
// one log and audit line, written when it returns, carries the duration
// and how the process ended. record encodes the call's audit record,
// which the session sends before it closes.
func (t *Terminals) Serve(w http.ResponseWriter, r *http.Request, info *httpcall.Info, record func() (string, error)) {
	req, spec, apiErr := t.check(w, r)
	if apiErr != nil {
		info.Fail(w, apiErr)
		return
	}
	info.SetProgram(spec.Argv)

	sess := &ptySession{stop: make(chan struct{})}
	if apiErr := t.register(sess); apiErr != nil {
		info.Fail(w, apiErr)
		return
	}
	defer t.unregister(sess)
	release, apiErr := t.cfg.Admit()
	if apiErr != nil {
		info.Fail(w, apiErr)
		return
	}
	defer release()

	proc, ptmx, apiErr := t.start(spec, req.cols, req.rows)
	if apiErr != nil {
		info.Fail(w, apiErr)
		return
	}
	run := &ptyRun{t: t, sess: sess, proc: proc, ptmx: ptmx, sid: proc.Pid(), exited: make(chan struct{})}
	go run.waitLeader()
	t.connect(w, r, info, run, record)
}

// check checks the upgrade request and prepares its command.
func (t *Terminals) check(w http.ResponseWriter, r *http.Request) (*ptyRequest, *runner.Spec, *api.Error) {
	if !headerHasToken(r.Header, "Upgrade", "websocket") || !headerHasToken(r.Header, "Connection", "upgrade") {
		e := api.Errorf(api.CodeInvalidArgument, "%s is a WebSocket endpoint; send an upgrade request with subprotocol %s", api.PathPTY, api.PTYSubprotocol)
		e.Status = http.StatusUpgradeRequired
		w.Header().Set("Upgrade", "websocket")
		return nil, nil, e
	}
	if !headerHasToken(r.Header, "Sec-WebSocket-Protocol", api.PTYSubprotocol) {
		return nil, nil, api.Errorf(api.CodeInvalidArgument, "the WebSocket subprotocol must be %s", api.PTYSubprotocol)
	}
	req, apiErr := parsePTYQuery(r.URL.Query())
	if apiErr != nil {
		return nil, nil, apiErr
	}
	spec, apiErr := t.prepare(req)
	if apiErr != nil {
		return nil, nil, apiErr
	}
	return req, spec, nil
}

// connect upgrades the connection to the session's WebSocket and serves
// the session on it until it ends.
func (t *Terminals) connect(w http.ResponseWriter, r *http.Request, info *httpcall.Info, run *ptyRun, record func() (string, error)) {
	// The server's read and write deadlines were set for an ordinary
	// request and stay on the connection after the hijack; the session
	// manages its own.
	rc := http.NewResponseController(w)
	_ = rc.SetReadDeadline(time.Time{})
	_ = rc.SetWriteDeadline(time.Time{})
	conn, err := websocket.Accept(w, r, &websocket.AcceptOptions{Subprotocols: []string{api.PTYSubprotocol}})
	if err != nil {
		// Accept has answered the client already.
		info.Err = api.Errorf(api.CodeInvalidArgument, "websocket upgrade: %v", err)
		run.hangUp(r.Context())
		run.finish()
		info.Result = run.result
		return
	}
	conn.SetReadLimit(api.PTYMaxInputFrame)
	run.conn = conn
	run.audit = func() []byte {
		info.Result = run.result
		v, err := record()
		if err != nil {
			t.cfg.Log.Error("audit record not encoded", "tool", "pty_session", "error", err.Error())
			return nil
		}
		msg, _ := json.Marshal(api.PTYMessage{Type: api.PTYMessageAudit, Audit: v})
		return msg
	}
	run.serve(r.Context())
	info.Result = run.result
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

// prepare checks a session's command as Prepare checks any command's
// (cwd, environment, PATH lookup), after filling in the shell and TERM.
func (t *Terminals) prepare(req *ptyRequest) (*runner.Spec, *api.Error) {
	env := make(map[string]string, len(req.env)+1)
	env["TERM"] = ptyTerm
	for k, v := range req.env {
		env[k] = v
	}
	command := req.command
	if len(command) == 0 {
		// A shell, looked for where the session will look: bash for its
		// line editing, else the POSIX sh most images have.
		pathEnv := t.cfg.Runner.BaseEnv()["PATH"]
		if p, ok := env["PATH"]; ok {
			pathEnv = p
		}
		for _, sh := range []string{"bash", "sh"} {
			if _, err := procenv.LookPath(sh, pathEnv, t.cfg.Runner.DefaultCwd()); err == nil {
				command = []string{sh}
				break
			}
		}
		if len(command) == 0 {
			// Any image can be a sandbox, a shell-less one too; then a
			// terminal runs only what it is told to.
			return nil, api.Errorf(api.CodeNotFound, "a terminal without a command runs a shell, and the sandbox image has none: neither bash nor sh is on its PATH (%s); give the command to run", pathEnv)
		}
	}
	// The timeout and output cap prepare checks do not apply: the session
	// has its own limits and its output is streamed.
	return t.cfg.Runner.Prepare(&api.CommandRequest{Command: command, Cwd: req.cwd, Env: env}, t.cfg.DefaultTimeout, t.cfg.MaxTimeout)
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
