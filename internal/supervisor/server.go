// Package supervisor is the HTTP server that runs inside every sandbox pod
// and executes commands and reads and writes workspace files for the
// control plane. It is served over mutual TLS by cmd/agentbox-supervisor;
// this package only knows HTTP. It holds the server, its route table
// (router.go), admission to the concurrent-command slots, the audit record
// every call carries, and the endpoints that tie the rooms together
// (commands, background processes, sandboxed tools); the rooms are its
// packages: runner (starting and confining commands), workspace (files),
// execute (Python runs and environments), terminal (PTY sessions), and
// mcpbridge (the template's MCP servers).
//
// Every call's answer carries the supervisor's record of it (see
// supervisorapi.AuditRecord), which the control plane keeps where code in
// the sandbox cannot reach it; its binary logs through redact.SlogHandler,
// which keeps known secret formats out of the slog output.
//
// It must stay free of client-go and other control-plane code: it runs next
// to untrusted code, so its attack surface is kept small.
package supervisor

import (
	"context"
	"errors"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/execute"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/runner"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/terminal"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/workspace"
)

// Server is the supervisor's HTTP handler.
type Server struct {
	cfg     Config
	log     *slog.Logger
	started time.Time
	slots   chan struct{}
	queued  atomic.Int32 // commands waiting for a slot

	// ws is the workspace the file endpoints serve; nil when there is
	// none.
	ws     *workspace.Workspace
	runner *runner.Runner
	exec   *execute.Service
	terms  *terminal.Terminals
	routes []route

	mu sync.Mutex
	// running counts requests being served, so that Wait also covers
	// their audit lines.
	running int
	idle    chan struct{} // closed when running drops to 0; nil if nobody waits
	// terminating is set once Terminate or Kill has been called: no
	// background process starts after it.
	terminating bool
	// procs are the background processes, oldest first; procsStarting
	// counts those being spawned, which already take a place.
	procs         []*bgProcess
	procsStarting int
	// trim returns freed memory once no call has been served for a while;
	// nil when off.
	trim *idleTrimmer
}

// New checks cfg, fills in defaults and returns a Server.
func New(cfg Config) (*Server, error) {
	cfg, err := cfg.withDefaults()
	if err != nil {
		return nil, err
	}
	s := &Server{cfg: cfg, log: cfg.Logger, started: time.Now(), slots: make(chan struct{}, cfg.MaxConcurrentCommands)}
	if s.ws, err = workspace.Open(cfg.Workspace, cfg.WorkspaceCap, cfg.WorkspaceUsageTTL, s.log); err != nil {
		return nil, err
	}
	if err := s.startRunner(); err != nil {
		s.Close()
		return nil, err
	}
	s.exec = execute.New(cfg.Execute, execute.Options{
		Runner: s.runner, Acquire: s.acquire, Python: cfg.Python,
		DefaultTimeout: cfg.PythonDefaultTimeout, MaxTimeout: cfg.PythonMaxTimeout,
		MaxRequestBytes: cfg.MaxRequestBytes, Log: s.log,
	})
	s.terms = terminal.New(terminal.Config{
		Runner: s.runner, Admit: s.tryAcquire, DefaultTimeout: cfg.DefaultTimeout, MaxTimeout: cfg.MaxTimeout,
		IdleTimeout: cfg.PTYIdleTimeout, MaxDuration: cfg.PTYMaxDuration,
		WaitDelay: cfg.WaitDelay, KillGrace: cfg.ProcessKillGrace, Log: s.log,
	})
	if err := s.startMemoryGuard(); err != nil {
		s.Close()
		return nil, err
	}
	s.routes = s.routeTable()
	s.trim = newIdleTrimmer(cfg.IdleTrim, cfg.MemoryTrim, s.quiet)
	return s, nil
}

// startRunner resolves where commands run and what environment they start
// from, and sets up the runner that starts them.
func (s *Server) startRunner() error {
	cwdDefault := s.cfg.DefaultCwd
	if cwdDefault == "" && s.ws != nil {
		cwdDefault = s.ws.Dir()
	}
	cwd, err := resolveDefaultCwd(cwdDefault)
	if err != nil {
		return err
	}
	env, err := s.cfg.baseEnvironment(cwd)
	if err != nil {
		return err
	}
	s.runner = runner.New(runner.Config{
		BaseEnv: env, DefaultCwd: cwd,
		DefaultMaxOutputBytes: s.cfg.DefaultMaxOutputBytes, MaxOutputBytesLimit: s.cfg.MaxOutputBytesLimit,
		WaitDelay: s.cfg.WaitDelay, PidsLimit: s.cfg.CommandPidsLimit, Log: s.log,
	})
	return nil
}

// startMemoryGuard starts the memory guard when the pod's memory limit is
// known.
func (s *Server) startMemoryGuard() error {
	if s.cfg.MemoryLimit <= 0 {
		return nil
	}
	// The waste is read only beside this sandbox's own charge: it tells
	// the guard how much of a killed command's memory is still to be
	// given back, and means nothing beside another reading.
	inUse, waste := s.cfg.MemoryInUse, (func() (int64, error))(nil)
	if inUse == nil {
		mi, est := runner.NewMemInfo(), runner.NewChargeEstimate()
		est.InUse = mi.InUse
		inUse, waste = est.Charged, mi.Waste
	}
	return s.runner.StartMemoryGuard(s.cfg.MemoryLimit, s.cfg.MemoryReserve, 0, inUse, waste)
}

// Close releases the workspace handle and stops environment builds.
func (s *Server) Close() error {
	var err error
	s.trim.stop()
	if s.runner != nil {
		s.runner.Close()
	}
	if s.exec != nil {
		err = s.exec.Close()
	}
	if s.ws == nil {
		return err
	}
	return errors.Join(err, s.ws.Close())
}

// Workspace is the directory the file endpoints serve, or "" if none.
func (s *Server) Workspace() string {
	if s.ws == nil {
		return ""
	}
	return s.ws.Dir()
}

// DefaultCwd is the directory commands run in when they name none.
func (s *Server) DefaultCwd() string { return s.runner.DefaultCwd() }

// Wait blocks until no request is being served, commands included, and
// no background process is running, or ctx is done. A server that is
// shutting down calls it after Terminate, or after cancelling the
// requests' contexts and Kill, so that every process group has ended and
// every audit line is written before the supervisor exits.
func (s *Server) Wait(ctx context.Context) error {
	s.mu.Lock()
	if s.running == 0 {
		s.mu.Unlock()
		return nil
	}
	if s.idle == nil {
		s.idle = make(chan struct{})
	}
	idle := s.idle
	s.mu.Unlock()
	select {
	case <-idle:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// Terminate sends SIGTERM to the process group of every running command
// and background process, and of every command started from now on, so
// that they can exit cleanly before the supervisor does, and hangs up the
// PTY sessions; new background processes and sessions are refused. It
// returns how many groups it signalled. Killing those that ignore it is
// left to the caller: cancelling the requests' contexts sends SIGKILL to
// commands, and Kill to everything.
func (s *Server) Terminate() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.terminating = true
	n := s.runner.Terminate()
	s.terms.HangUp()
	return n
}

// Kill sends SIGKILL to the process group of every running command and
// background process, and to the groups of background processes whose
// leader exited after Terminate (their members may have ignored SIGTERM).
// It is the last step of a shutdown, after Terminate and a grace.
func (s *Server) Kill() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.terminating = true
	s.terms.Refuse()
	var sweep []int
	for _, p := range s.procs {
		if p.sweep {
			sweep = append(sweep, p.pid)
			p.sweep = false
		}
	}
	return s.runner.Kill(sweep...)
}

func (s *Server) begin() {
	s.mu.Lock()
	s.running++
	s.trim.busy()
	s.mu.Unlock()
}

func (s *Server) end() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.running--; s.running == 0 {
		s.trim.idle()
		if s.idle != nil {
			close(s.idle)
			s.idle = nil
		}
	}
}

// quiet reports whether no call is being served.
func (s *Server) quiet() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.running == 0
}

// MemInfoInUse reads the memory in use from /proc/meminfo (see
// runner.MemInfoInUse).
func MemInfoInUse() (int64, error) { return runner.MemInfoInUse() }

// ProcessTracker lets code outside the supervisor that starts processes
// (mcpbridge, for the MCP servers) register them with the orphan reaper
// (see runner.ProcessTracker).
type ProcessTracker = runner.ProcessTracker

// StartReaper makes this process reap orphaned descendants until ctx is
// done (see runner.StartReaper).
func StartReaper(ctx context.Context, log *slog.Logger) error { return runner.StartReaper(ctx, log) }
