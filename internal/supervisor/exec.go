package supervisor

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
	"unicode/utf8"

	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/procenv"
	api "github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"
)

// commandSpec is a validated request, ready to run.
type commandSpec struct {
	path      string // resolved executable
	argv      []string
	dir       string
	env       []string
	stdin     string
	timeout   time.Duration
	maxOutput int64
}

// errCommandTimeout is the cause of a command context that ran out of
// time, which tells a timeout apart from a client that went away.
var errCommandTimeout = errors.New("command timed out")

// prepare validates req against the server's limits, with the timeout
// limits given since they differ between endpoints, and resolves the
// working directory and executable.
func (s *Server) prepare(req *api.CommandRequest, defaultTimeout, maxTimeout time.Duration) (*commandSpec, *api.Error) {
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

	maxOutput := s.cfg.DefaultMaxOutputBytes
	switch {
	case req.MaxOutputBytes < 0:
		return nil, api.Errorf(api.CodeInvalidArgument, "max_output_bytes must not be negative, got %d", req.MaxOutputBytes)
	case req.MaxOutputBytes > s.cfg.MaxOutputBytesLimit:
		return nil, api.Errorf(api.CodeInvalidArgument, "max_output_bytes %d exceeds the limit of %d", req.MaxOutputBytes, s.cfg.MaxOutputBytesLimit)
	case req.MaxOutputBytes > 0:
		maxOutput = req.MaxOutputBytes
	}

	if err := procenv.Validate(req.Env); err != nil {
		return nil, api.Errorf(api.CodeInvalidArgument, "env: %v", err)
	}
	env := make(map[string]string, len(s.baseEnv)+len(req.Env))
	for k, v := range s.baseEnv {
		env[k] = v
	}
	for k, v := range req.Env {
		env[k] = v
	}

	dir, apiErr := s.resolveCwd(req.Cwd)
	if apiErr != nil {
		return nil, apiErr
	}
	path, apiErr := lookPath(req.Command[0], env["PATH"], dir)
	if apiErr != nil {
		return nil, apiErr
	}
	return &commandSpec{
		path:      path,
		argv:      req.Command,
		dir:       dir,
		env:       procenv.List(env),
		stdin:     req.Stdin,
		timeout:   timeout,
		maxOutput: maxOutput,
	}, nil
}

func (s *Server) resolveCwd(cwd string) (string, *api.Error) {
	dir := s.defaultCwd
	if cwd != "" {
		if strings.IndexByte(cwd, 0) >= 0 {
			return "", api.Errorf(api.CodeInvalidArgument, "cwd contains a NUL byte")
		}
		dir = cwd
		if !filepath.IsAbs(dir) {
			dir = filepath.Join(s.defaultCwd, dir)
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

// lookPath finds name the way a shell would, but in the command's PATH and
// relative to the command's cwd. os/exec would search the supervisor's own
// PATH instead.
func lookPath(name, pathEnv, dir string) (string, *api.Error) {
	p, err := procenv.LookPath(name, pathEnv, dir)
	if err != nil {
		return "", api.Errorf(api.CodeNotFound, "executable %q not found in PATH %q", name, pathEnv)
	}
	return p, nil
}

// run starts the command in its own process group and waits for it,
// sending its output to stdout and stderr. The whole group is killed when
// the timeout expires or ctx is done (the client went away or the server
// is shutting down). A command that exits on its own leaves
// its background jobs running, as a shell would, so an agent can start a
// server and talk to it with the next command.
func (s *Server) run(parent context.Context, spec *commandSpec, stdout, stderr io.Writer) (*api.CommandResult, *api.Error) {
	ctx, cancel := context.WithTimeoutCause(parent, spec.timeout, errCommandTimeout)
	defer cancel()
	p, apiErr := s.spawn(ctx, spec, stdout, stderr)
	if apiErr != nil {
		return nil, apiErr
	}
	return s.wait(ctx, p)
}

// process is a started command, for wait.
type process struct {
	cmd    *exec.Cmd
	argv0  string
	start  time.Time
	killed atomic.Bool // cmd.Cancel ran: ctx, not the command, ended it
}

// spawn is the one place commands are started, for /v1/commands,
// /v1/python, streams and background processes alike, so that they share
// the confinement: own process group, tracked for Terminate and Kill,
// registered with the reaper, the whole group killed when ctx is done.
func (s *Server) spawn(ctx context.Context, spec *commandSpec, stdout, stderr io.Writer) (*process, *api.Error) {
	cmd := exec.CommandContext(ctx, spec.path)
	p := &process{cmd: cmd, argv0: spec.argv[0]}
	cmd.Args = spec.argv
	cmd.Dir = spec.dir
	cmd.Env = spec.env
	if spec.stdin != "" {
		cmd.Stdin = strings.NewReader(spec.stdin)
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
	cmd.WaitDelay = s.cfg.WaitDelay

	p.start = time.Now()
	if err := s.startConfined(cmd); err != nil {
		return nil, startError(spec, err)
	}
	s.track(cmd.Process.Pid)
	return p, nil
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

// wait waits for a spawned process and describes how it ended; the
// output is the caller's. ctx is the one given to spawn, to tell a
// timeout from a cancellation.
func (s *Server) wait(ctx context.Context, p *process) (*api.CommandResult, *api.Error) {
	cmd := p.cmd
	pid := cmd.Process.Pid
	waitErr := cmd.Wait()
	elapsed := time.Since(p.start)
	if p.killed.Load() {
		sweepGroup(pid)
	}
	s.untrack(pid)
	children.done(pid)
	outOfMemory := s.takeOOMKilled(pid)

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

func startError(spec *commandSpec, err error) *api.Error {
	switch {
	case errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded):
		return api.Errorf(api.CodeUnavailable, "request cancelled before %s started", spec.argv[0])
	case errors.Is(err, fs.ErrNotExist):
		return api.Errorf(api.CodeNotFound, "start %s: %v", spec.argv[0], err)
	case errors.Is(err, fs.ErrPermission):
		return api.Errorf(api.CodePermissionDenied, "start %s: %v", spec.argv[0], err)
	case errors.Is(err, syscall.ENOEXEC):
		return api.Errorf(api.CodeInvalidArgument, "start %s: not an executable format", spec.argv[0])
	}
	return api.Errorf(api.CodeInternal, "start %s: %v", spec.argv[0], err)
}

// output collects stdout and stderr under one byte budget. Writes beyond
// the budget are accepted and dropped, so the command's pipes keep
// draining and the command never blocks on a full pipe.
type output struct {
	mu             sync.Mutex
	remaining      int64
	truncated      bool
	stdout, stderr *cappedWriter
}

// Output is kept in chunks rather than one growing slice: growing a slice
// copies it and briefly holds twice its size, and its doubling can reserve
// far more than the budget. Chunks start small, so a command that prints a
// line costs little, and no chunk is larger than the budget left when it
// was allocated, so the memory held never exceeds the cap by more than one
// partly filled chunk per stream.
const (
	minChunk = 512
	maxChunk = 32 << 10
)

type cappedWriter struct {
	o      *output
	chunks [][]byte
	n      int
	cut    bool // this stream lost bytes, so its tail may be a partial rune
}

func newOutput(limit int64) *output {
	o := &output{remaining: limit}
	o.stdout = &cappedWriter{o: o}
	o.stderr = &cappedWriter{o: o}
	return o
}

func (w *cappedWriter) Write(p []byte) (int, error) {
	o := w.o
	o.mu.Lock()
	defer o.mu.Unlock()
	keep := p
	if int64(len(keep)) > o.remaining {
		keep = keep[:o.remaining]
		o.truncated, w.cut = true, true
	}
	for len(keep) > 0 {
		var last []byte
		if len(w.chunks) > 0 {
			last = w.chunks[len(w.chunks)-1]
		}
		if len(last) == cap(last) {
			size := min(max(2*cap(last), minChunk), maxChunk, int(o.remaining))
			last = make([]byte, 0, size)
			w.chunks = append(w.chunks, last)
		}
		n := min(len(keep), cap(last)-len(last))
		last = append(last, keep[:n]...)
		w.chunks[len(w.chunks)-1] = last
		keep = keep[n:]
		w.n += n
		o.remaining -= int64(n)
	}
	return len(p), nil
}

func (o *output) result() (stdout, stderr string, truncated bool) {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.stdout.text(), o.stderr.text(), o.truncated
}

func (w *cappedWriter) text() string {
	var b strings.Builder
	b.Grow(w.n)
	for _, c := range w.chunks {
		b.Write(c)
	}
	s := b.String()
	if w.cut {
		s = trimPartialRune(s)
	}
	// Returns s itself, without a copy, when it is valid already.
	return strings.ToValidUTF8(s, "\uFFFD")
}

// trimPartialRune drops a multi-byte character the cap cut in half, which
// would otherwise show up as a spurious replacement character.
func trimPartialRune(s string) string {
	for i := len(s) - 1; i >= 0 && i >= len(s)-utf8.UTFMax; i-- {
		if utf8.RuneStart(s[i]) {
			if !utf8.FullRuneInString(s[i:]) {
				return s[:i]
			}
			break
		}
	}
	return s
}

var signalNames = map[syscall.Signal]string{
	syscall.SIGHUP: "SIGHUP", syscall.SIGINT: "SIGINT", syscall.SIGQUIT: "SIGQUIT", syscall.SIGILL: "SIGILL",
	syscall.SIGTRAP: "SIGTRAP", syscall.SIGABRT: "SIGABRT", syscall.SIGBUS: "SIGBUS", syscall.SIGFPE: "SIGFPE",
	syscall.SIGKILL: "SIGKILL", syscall.SIGUSR1: "SIGUSR1", syscall.SIGSEGV: "SIGSEGV", syscall.SIGUSR2: "SIGUSR2",
	syscall.SIGPIPE: "SIGPIPE", syscall.SIGALRM: "SIGALRM", syscall.SIGTERM: "SIGTERM", syscall.SIGCHLD: "SIGCHLD",
	syscall.SIGCONT: "SIGCONT", syscall.SIGSTOP: "SIGSTOP", syscall.SIGTSTP: "SIGTSTP", syscall.SIGTTIN: "SIGTTIN",
	syscall.SIGTTOU: "SIGTTOU", syscall.SIGURG: "SIGURG", syscall.SIGXCPU: "SIGXCPU", syscall.SIGXFSZ: "SIGXFSZ",
	syscall.SIGVTALRM: "SIGVTALRM", syscall.SIGPROF: "SIGPROF", syscall.SIGWINCH: "SIGWINCH", syscall.SIGIO: "SIGIO",
	syscall.SIGSYS: "SIGSYS",
}

func signalName(sig syscall.Signal) string {
	if n, ok := signalNames[sig]; ok {
		return n
	}
	return fmt.Sprintf("SIG%d", int(sig))
}

// groupSweepFor bounds sweepGroup. A group that forks faster than it can
// be killed for this long is left to the pod's limits.
const groupSweepFor = 5 * time.Second

// sweepGroup kills the process group pgid again and again until it is
// empty. One SIGKILL to a group can miss a child being forked at that
// moment (gVisor showed it: a fork bomb outlived its command's timeout and
// starved the supervisor), and once the leader is gone nothing else would
// signal the group again.
func sweepGroup(pgid int) {
	deadline := time.Now().Add(groupSweepFor)
	for time.Now().Before(deadline) {
		if errors.Is(syscall.Kill(-pgid, syscall.SIGKILL), syscall.ESRCH) {
			return
		}
		time.Sleep(5 * time.Millisecond)
	}
}
