// Package runner starts and waits for the commands the supervisor runs,
// confined alike whatever asked for them: each in its own process group,
// tracked for shutdown, under the per-command process limit and the
// memory guard, registered with the orphan reaper, and killed whole when
// its time is up. It also holds the capped collectors of their output.
package runner

import (
	"context"
	"errors"
	"io"
	"io/fs"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/procenv"
	api "github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"
)

// Config configures a Runner.
type Config struct {
	// BaseEnv is the environment every command starts from.
	BaseEnv map[string]string
	// DefaultCwd is where commands run when they name no cwd, and what a
	// relative cwd is relative to.
	DefaultCwd string
	// DefaultMaxOutputBytes is the output cap of a request that names
	// none; MaxOutputBytesLimit the largest it may ask for.
	DefaultMaxOutputBytes int64
	MaxOutputBytesLimit   int64
	// WaitDelay is how long output is still collected after a command
	// ended while something else holds its pipes open.
	WaitDelay time.Duration
	// PidsLimit is every command's RLIMIT_NPROC; zero or negative means
	// none.
	PidsLimit int
	Log       *slog.Logger
}

// Runner starts commands and keeps the process group of each running one,
// for shutdown and for the memory guard.
type Runner struct {
	cfg Config

	mu sync.Mutex
	// groups holds the process group of every command running now, for
	// Terminate; terminating is set once it has been called.
	groups      map[int]struct{}
	terminating bool
	// oomKilled holds the groups the memory guard killed, until their
	// command's result is written.
	oomKilled map[int]bool
	memGuard  *memoryGuard
}

// New returns a Runner; cfg is taken as it is (the supervisor fills in its
// defaults).
func New(cfg Config) *Runner {
	return &Runner{cfg: cfg, groups: make(map[int]struct{}), oomKilled: make(map[int]bool)}
}

// BaseEnv is the environment every command starts from. The caller must
// not change it.
func (rn *Runner) BaseEnv() map[string]string { return rn.cfg.BaseEnv }

// DefaultCwd is where commands run when they name none.
func (rn *Runner) DefaultCwd() string { return rn.cfg.DefaultCwd }

// Close stops the memory guard.
func (rn *Runner) Close() {
	if rn.memGuard != nil {
		rn.memGuard.close()
	}
}

// Spec is a validated request, ready to run.
type Spec struct {
	Path      string // resolved executable
	Argv      []string
	Dir       string
	Env       []string
	Stdin     string
	Timeout   time.Duration
	MaxOutput int64
}

// errCommandTimeout is the cause of a command context that ran out of
// time, which tells a timeout apart from a client that went away.
var errCommandTimeout = errors.New("command timed out")

// WithTimeout is the context a command runs under: Wait tells its
// timeout apart from a cancellation.
func WithTimeout(parent context.Context, timeout time.Duration) (context.Context, context.CancelFunc) {
	return context.WithTimeoutCause(parent, timeout, errCommandTimeout)
}

// Prepare validates req against the server's limits, with the timeout
// limits given since they differ between endpoints, and resolves the
// working directory and executable.
func (rn *Runner) Prepare(req *api.CommandRequest, defaultTimeout, maxTimeout time.Duration) (*Spec, *api.Error) {
	if len(req.Command) == 0 {
		return nil, api.Errorf(api.CodeInvalidArgument, "command must not be empty")
	}
	if req.Command[0] == "" {
		return nil, api.Errorf(api.CodeInvalidArgument, "command[0] must not be empty")
	}
	for i, a := range req.Command {
		if strings.IndexByte(a, 0) >= 0 {
			return nil, api.Errorf(api.CodeInvalidArgument, "command[%d] contains a NUL byte", i)
		}
	}

	timeout := defaultTimeout
	switch maxSec := int64(maxTimeout / time.Second); {
	case req.TimeoutSeconds < 0:
		return nil, api.Errorf(api.CodeInvalidArgument, "timeout_seconds must not be negative, got %d", req.TimeoutSeconds)
	case int64(req.TimeoutSeconds) > maxSec:
		return nil, api.Errorf(api.CodeInvalidArgument, "timeout_seconds %d exceeds the maximum of %d", req.TimeoutSeconds, maxSec)
	case req.TimeoutSeconds > 0:
		timeout = time.Duration(req.TimeoutSeconds) * time.Second
	}

	maxOutput := rn.cfg.DefaultMaxOutputBytes
	switch {
	case req.MaxOutputBytes < 0:
		return nil, api.Errorf(api.CodeInvalidArgument, "max_output_bytes must not be negative, got %d", req.MaxOutputBytes)
	case req.MaxOutputBytes > rn.cfg.MaxOutputBytesLimit:
		return nil, api.Errorf(api.CodeInvalidArgument, "max_output_bytes %d exceeds the limit of %d", req.MaxOutputBytes, rn.cfg.MaxOutputBytesLimit)
	case req.MaxOutputBytes > 0:
		maxOutput = req.MaxOutputBytes
	}

	if err := procenv.Validate(req.Env); err != nil {
		return nil, api.Errorf(api.CodeInvalidArgument, "env: %v", err)
	}
	env := make(map[string]string, len(rn.cfg.BaseEnv)+len(req.Env))
	for k, v := range rn.cfg.BaseEnv {
		env[k] = v
	}
	for k, v := range req.Env {
		env[k] = v
	}

	dir, apiErr := rn.resolveCwd(req.Cwd)
	if apiErr != nil {
		return nil, apiErr
	}
	path, apiErr := LookPath(req.Command[0], env["PATH"], dir)
	if apiErr != nil {
		return nil, apiErr
	}
	return &Spec{
		Path:      path,
		Argv:      req.Command,
		Dir:       dir,
		Env:       procenv.List(env),
		Stdin:     req.Stdin,
		Timeout:   timeout,
		MaxOutput: maxOutput,
	}, nil
}

func (rn *Runner) resolveCwd(cwd string) (string, *api.Error) {
	dir := rn.cfg.DefaultCwd
	if cwd != "" {
		if strings.IndexByte(cwd, 0) >= 0 {
			return "", api.Errorf(api.CodeInvalidArgument, "cwd contains a NUL byte")
		}
		dir = cwd
		if !filepath.IsAbs(dir) {
			dir = filepath.Join(rn.cfg.DefaultCwd, dir)
		}
		dir = filepath.Clean(dir)
	}
	st, err := os.Stat(dir)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		return "", api.Errorf(api.CodeNotFound, "cwd %q does not exist", dir)
	case errors.Is(err, fs.ErrPermission):
		return "", api.Errorf(api.CodePermissionDenied, "cwd %q is not accessible", dir)
	case err != nil:
		return "", api.Errorf(api.CodeInvalidArgument, "cwd %q: %v", dir, err)
	case !st.IsDir():
		return "", api.Errorf(api.CodeInvalidArgument, "cwd %q is not a directory", dir)
	}
	return dir, nil
}

// LookPath finds name the way a shell would, but in the command's PATH and
// relative to the command's cwd. os/exec would search the supervisor's own
// PATH instead.
func LookPath(name, pathEnv, dir string) (string, *api.Error) {
	p, err := procenv.LookPath(name, pathEnv, dir)
	if err != nil {
		return "", api.Errorf(api.CodeNotFound, "executable %q not found in PATH %q", name, pathEnv)
	}
	return p, nil
}

// Run starts the command in its own process group and waits for it,
// sending its output to stdout and stderr. The whole group is killed when
// the timeout expires or ctx is done (the client went away or the server
// is shutting down). A command that exits on its own leaves
// its background jobs running, as a shell would, so an agent can start a
// server and talk to it with the next command.
func (rn *Runner) Run(parent context.Context, spec *Spec, stdout, stderr io.Writer) (*api.CommandResult, *api.Error) {
	ctx, cancel := WithTimeout(parent, spec.Timeout)
	defer cancel()
	p, apiErr := rn.Spawn(ctx, spec, stdout, stderr)
	if apiErr != nil {
		return nil, apiErr
	}
	return rn.Wait(ctx, p)
}

// Process is a started command, for Wait.
type Process struct {
	Cmd     *exec.Cmd
	argv0   string
	Started time.Time
	killed  atomic.Bool // cmd.Cancel ran: ctx, not the command, ended it
}

// Pid is the leader's PID, which is also its process group's ID.
func (p *Process) Pid() int { return p.Cmd.Process.Pid }

// Spawn is the one place commands with pipes are started, for
// /v1/commands, /v1/python, streams and background processes alike, so
// that they share the confinement: own process group, tracked for
// Terminate and Kill, registered with the reaper, the whole group killed
// when ctx is done.
func (rn *Runner) Spawn(ctx context.Context, spec *Spec, stdout, stderr io.Writer) (*Process, *api.Error) {
	cmd := exec.CommandContext(ctx, spec.Path)
	p := &Process{Cmd: cmd, argv0: spec.Argv[0]}
	cmd.Args = spec.Argv
	cmd.Dir = spec.Dir
	cmd.Env = spec.Env
	if spec.Stdin != "" {
		cmd.Stdin = strings.NewReader(spec.Stdin)
	} else if f := devNull(); f != nil {
		cmd.Stdin = f
	}
	cmd.Stdout = stdout
	cmd.Stderr = stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	cmd.Cancel = func() error {
		p.killed.Store(true)
		// The group's ID is the leader's PID (Setpgid with Pgid 0).
		err := syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
		if errors.Is(err, syscall.ESRCH) {
			return os.ErrProcessDone
		}
		return err
	}
	// Without a bound, a background job that inherited stdout would hold
	// the request open for as long as it runs.
	cmd.WaitDelay = rn.cfg.WaitDelay
	if err := rn.start(p); err != nil {
		return nil, startError(spec, err)
	}
	return p, nil
}

// Start starts cmd, set up by the caller (a PTY session's, say), with
// the same confinement as Spawn's, for Wait.
func (rn *Runner) Start(cmd *exec.Cmd, spec *Spec) (*Process, *api.Error) {
	p := &Process{Cmd: cmd, argv0: spec.Argv[0]}
	if err := rn.start(p); err != nil {
		return nil, startError(spec, err)
	}
	return p, nil
}

func (rn *Runner) start(p *Process) error {
	p.Started = time.Now()
	if err := rn.startConfined(p.Cmd); err != nil {
		return err
	}
	rn.track(p.Cmd.Process.Pid)
	return nil
}

// devNull is /dev/null opened once for every command's stdin, or nil if
// it cannot be opened (exec.Cmd then opens it itself). exec.Cmd would open
// and close it for each command, and under gVisor the open, its poller
// registration and the close are a dozen system calls.
var devNull = sync.OnceValue(func() *os.File {
	f, err := os.Open(os.DevNull)
	if err != nil {
		return nil
	}
	return f
})

// Wait waits for a started process and describes how it ended; the
// output is the caller's. ctx is the one given to Spawn, to tell a
// timeout from a cancellation.
func (rn *Runner) Wait(ctx context.Context, p *Process) (*api.CommandResult, *api.Error) {
	cmd := p.Cmd
	pid := cmd.Process.Pid
	waitErr := cmd.Wait()
	elapsed := time.Since(p.Started)
	if p.killed.Load() {
		sweepGroup(pid)
	}
	rn.untrack(pid)
	children.done(pid)
	outOfMemory := rn.takeOOMKilled(pid)

	ps := cmd.ProcessState
	if ps == nil {
		return nil, api.Errorf(api.CodeInternal, "wait for %s: %v", p.argv0, waitErr)
	}
	res := &api.CommandResult{ExitCode: ps.ExitCode(), DurationMS: elapsed.Milliseconds()}
	if ws, ok := ps.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
		res.Signal = signalName(ws.Signal())
		// A leader that exited on its own just as the timer fired was not
		// timed out; one the timeout killed always ends by a signal.
		res.TimedOut = p.killed.Load() && errors.Is(context.Cause(ctx), errCommandTimeout)
		res.OutOfMemory = outOfMemory && !res.TimedOut
	}
	return res, nil
}

func startError(spec *Spec, err error) *api.Error {
	switch {
	case errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded):
		return api.Errorf(api.CodeUnavailable, "request cancelled before %s started", spec.Argv[0])
	case errors.Is(err, fs.ErrNotExist):
		return api.Errorf(api.CodeNotFound, "start %s: %v", spec.Argv[0], err)
	case errors.Is(err, fs.ErrPermission):
		return api.Errorf(api.CodePermissionDenied, "start %s: %v", spec.Argv[0], err)
	case errors.Is(err, syscall.ENOEXEC):
		return api.Errorf(api.CodeInvalidArgument, "start %s: not an executable format", spec.Argv[0])
	}
	return api.Errorf(api.CodeInternal, "start %s: %v", spec.Argv[0], err)
}
