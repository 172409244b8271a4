// Package supervisor is the HTTP server that runs inside every sandbox pod
// and executes commands and reads and writes workspace files for the
// control plane. It is served over mutual
// TLS by cmd/agentbox-supervisor; this package only knows HTTP.
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
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"hash"
	"io"
	"io/fs"
	"log/slog"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/agentbox/terraform-provider-agentbox/internal/pki"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/mcpbridge"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/procenv"
	api "github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"
)

// Defaults for Config's zero values.
const (
	DefaultWorkspace             = "/workspace"
	DefaultTimeout               = api.DefaultTimeoutSeconds * time.Second
	DefaultMaxTimeout            = 10 * time.Minute
	DefaultMaxOutputBytes        = api.DefaultMaxOutputBytes
	DefaultMaxRequestBytes       = 8 << 20
	DefaultMaxConcurrentCommands = 16
	DefaultMaxQueuedCommands     = 256
	DefaultCommandQueueWait      = 30 * time.Second
	DefaultWaitDelay             = time.Second
	DefaultPath                  = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
	DefaultWorkspaceCap          = api.DefaultWorkspaceCapBytes
	DefaultWorkspaceUsageTTL     = time.Second
	DefaultPython                = "python3"
	DefaultPythonTimeout         = api.DefaultPythonTimeoutSeconds * time.Second
	DefaultPythonMaxTimeout      = api.MaxPythonTimeoutSeconds * time.Second
	DefaultMaxProcesses          = 8
	DefaultProcessOutputBytes    = 64 << 10
	DefaultProcessKillGrace      = 5 * time.Second
)

// DefaultPassEnv lists the variables copied from the supervisor's own
// environment into every command's when none are configured. Sandbox pods
// reach the network only through the egress proxy, so commands need the
// proxy settings; nothing else of the supervisor's environment is passed
// on unless named (the controller names the template's variables), so
// that whatever configures the supervisor does not leak to the code it
// runs.
var DefaultPassEnv = []string{"HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "http_proxy", "https_proxy", "no_proxy"}

// Config configures a Server. Zero values mean the defaults above.
type Config struct {
	// Workspace is the directory the file endpoints serve; no path they
	// take can leave it. Empty means DefaultWorkspace if it exists, and
	// otherwise no file endpoints (they answer unavailable). A Workspace
	// that is set must exist.
	Workspace string
	// WorkspaceCap bounds the total size of the regular files in the
	// workspace; a file write that would pass it fails with
	// workspace_full. Zero means DefaultWorkspaceCap.
	WorkspaceCap int64
	// WorkspaceUsageTTL is how long a walk of the workspace is trusted
	// before the next write or health check walks it again (the
	// supervisor's own writes are counted at once; this bounds how late
	// it sees what commands wrote). Zero means DefaultWorkspaceUsageTTL.
	WorkspaceUsageTTL time.Duration
	// DefaultCwd is where commands run when the request names no cwd, and
	// what a relative cwd is relative to. Empty means the workspace if
	// there is one, else the supervisor's working directory.
	DefaultCwd string
	// DefaultTimeout applies to requests without timeout_seconds.
	DefaultTimeout time.Duration
	// MaxTimeout is the largest timeout a request may ask for.
	MaxTimeout time.Duration
	// DefaultMaxOutputBytes applies to requests without max_output_bytes.
	DefaultMaxOutputBytes int64
	// MaxOutputBytesLimit is the largest cap a request may ask for; it
	// defaults to DefaultMaxOutputBytes (the design's 1 MB).
	MaxOutputBytesLimit int64
	// MaxRequestBytes bounds the request body, stdin included.
	MaxRequestBytes int64
	// MaxConcurrentCommands bounds commands running at once. Output
	// buffers live in the supervisor, so this bounds its memory too.
	MaxConcurrentCommands int
	// MaxQueuedCommands bounds the commands that wait for one of those
	// slots (DefaultMaxQueuedCommands if zero; negative: none wait). A
	// burst of calls is a normal load for an agent with many tools, so it
	// waits its turn instead of failing; what does not fit in the queue,
	// or waits longer than CommandQueueWait (DefaultCommandQueueWait if
	// zero), is refused with resource_exhausted. Interactive PTY sessions
	// never wait.
	MaxQueuedCommands int
	CommandQueueWait  time.Duration
	// WaitDelay is how long the supervisor keeps collecting output after
	// the command exited (or was killed) while something else, such as a
	// background job, still holds its stdout or stderr open. After it the
	// pipes are closed and the request returns.
	WaitDelay time.Duration
	// BaseEnv is the environment every command starts from. Nil means
	// PATH=DefaultPath, HOME=the default cwd, LANG=C.UTF-8.
	BaseEnv map[string]string
	// PassEnv names variables copied from the supervisor's environment
	// into BaseEnv when set there, over BaseEnv's values. Nil means
	// DefaultPassEnv; use an empty slice to pass nothing. Names starting
	// with api.ReservedEnvPrefix are refused: they are the supervisor's
	// own configuration.
	PassEnv []string
	// Python is the interpreter python_exec runs: a name looked up in the
	// command's PATH, as a shell would, or a path. Empty means
	// DefaultPython.
	Python string
	// PythonDefaultTimeout applies to python_exec requests without
	// timeout_seconds; PythonMaxTimeout is the largest they may ask for.
	// Zero means DefaultPythonTimeout and DefaultPythonMaxTimeout. Neither
	// may exceed MaxTimeout, which bounds how long the server waits to
	// write any response.
	PythonDefaultTimeout time.Duration
	PythonMaxTimeout     time.Duration
	// MaxProcesses bounds the background processes that exist at once;
	// exited ones are forgotten, oldest first, to make room, and beyond
	// it starts fail with resource_exhausted. Zero means
	// DefaultMaxProcesses.
	MaxProcesses int
	// ProcessOutputBytes is how much of each stream of a background
	// process is kept (the most recent bytes). Zero means
	// DefaultProcessOutputBytes.
	ProcessOutputBytes int
	// ProcessKillGrace is how long DELETE /v1/processes/{id} waits after
	// SIGTERM before it sends SIGKILL. Zero means DefaultProcessKillGrace.
	ProcessKillGrace time.Duration
	// PTYIdleTimeout ends a PTY session (GET /v1/pty) in which nothing
	// was typed or printed for this long; PTYMaxDuration ends any session
	// this long after it started. Zero means DefaultPTYIdleTimeout and
	// DefaultPTYMaxDuration.
	PTYIdleTimeout time.Duration
	PTYMaxDuration time.Duration
	// CommandPidsLimit is the RLIMIT_NPROC every command starts with (see
	// DefaultCommandPidsLimit, which zero means); negative means none.
	CommandPidsLimit int
	// MemoryLimit is the pod's memory limit in bytes; when set, the
	// command holding the most memory is killed once the sandbox uses
	// more than MemoryLimit less MemoryReserve (zero: the larger of 96
	// MiB and an eighth of the limit). MemoryInUse reports the sandbox's
	// use; nil means MemInfoInUse.
	MemoryLimit   int64
	MemoryReserve int64
	MemoryInUse   func() (int64, error)
	// Execute configures /v1/execute and the cached Python environments of
	// /v1/envs (see execute.go).
	Execute ExecuteConfig
	// Audit, when set, gets one line per call (health checks excepted), as
	// a debugging aid: every call's record goes back with its answer
	// anyway (see api.AuditRecord). The caller owns it and closes it after
	// Wait.
	Audit *AuditLog
	// Identity is the supervisor's own SPIFFE ID, put in its records.
	Identity string
	// MCP, when set, serves /mcp and everything under it: the template's
	// stdio MCP servers (see mcpbridge.Manager). Without it those paths
	// are not found.
	MCP http.Handler
	// Version is reported by /healthz.
	Version string
	// Logger defaults to slog.Default().
	Logger *slog.Logger
}

// Server is the supervisor's HTTP handler.
type Server struct {
	cfg        Config
	defaultCwd string
	baseEnv    map[string]string
	slots      chan struct{}
	queued     atomic.Int32 // commands waiting for a slot
	log        *slog.Logger

	// workspace is the absolute path of the workspace and root the
	// handle every file operation goes through; nil when there is none.
	workspace string
	// workspaceAliases are other absolute spellings of the workspace (the
	// configured path, when it differs from the resolved one), accepted
	// in absolute request paths.
	workspaceAliases []string
	root             *os.Root
	usage            *workspaceUsage
	digests          *digestCache

	mu sync.Mutex
	// running counts requests being served, so that Wait also covers
	// their audit lines.
	running int
	idle    chan struct{} // closed when running drops to 0; nil if nobody waits
	// groups holds the process group of every command running now, for
	// Terminate; terminating is set once it has been called.
	groups      map[int]struct{}
	terminating bool
	// oomKilled holds the groups the memory guard killed, until their
	// command's result is written.
	oomKilled map[int]bool
	memGuard  *memoryGuard
	// procs are the background processes, oldest first; procsStarting
	// counts those being spawned, which already take a place.
	procs         []*bgProcess
	procsStarting int

	px executeState
	// ptys are the PTY sessions, for Terminate to hang up.
	ptys map[*ptySession]struct{}
}

// New checks cfg, fills in defaults and returns a Server.
func New(cfg Config) (*Server, error) {
	if cfg.DefaultTimeout <= 0 {
		cfg.DefaultTimeout = DefaultTimeout
	}
	if cfg.MaxTimeout <= 0 {
		cfg.MaxTimeout = DefaultMaxTimeout
	}
	if cfg.DefaultTimeout > cfg.MaxTimeout {
		return nil, fmt.Errorf("default timeout %s exceeds the maximum %s", cfg.DefaultTimeout, cfg.MaxTimeout)
	}
	if cfg.DefaultMaxOutputBytes <= 0 {
		cfg.DefaultMaxOutputBytes = DefaultMaxOutputBytes
	}
	if cfg.MaxOutputBytesLimit <= 0 {
		cfg.MaxOutputBytesLimit = max(DefaultMaxOutputBytes, cfg.DefaultMaxOutputBytes)
	}
	if cfg.DefaultMaxOutputBytes > cfg.MaxOutputBytesLimit {
		return nil, fmt.Errorf("default output cap %d exceeds the limit %d", cfg.DefaultMaxOutputBytes, cfg.MaxOutputBytesLimit)
	}
	if cfg.MaxRequestBytes <= 0 {
		cfg.MaxRequestBytes = DefaultMaxRequestBytes
	}
	if cfg.MaxConcurrentCommands <= 0 {
		cfg.MaxConcurrentCommands = DefaultMaxConcurrentCommands
	}
	switch {
	case cfg.MaxQueuedCommands == 0:
		cfg.MaxQueuedCommands = DefaultMaxQueuedCommands
	case cfg.MaxQueuedCommands < 0:
		cfg.MaxQueuedCommands = 0
	}
	if cfg.CommandQueueWait <= 0 {
		cfg.CommandQueueWait = DefaultCommandQueueWait
	}
	if cfg.WaitDelay <= 0 {
		cfg.WaitDelay = DefaultWaitDelay
	}
	if cfg.PassEnv == nil {
		cfg.PassEnv = DefaultPassEnv
	}
	if err := CheckPassEnv(cfg.PassEnv); err != nil {
		return nil, err
	}
	if cfg.Python == "" {
		cfg.Python = DefaultPython
	}
	if cfg.PythonMaxTimeout <= 0 {
		cfg.PythonMaxTimeout = DefaultPythonMaxTimeout
	}
	cfg.PythonMaxTimeout = min(cfg.PythonMaxTimeout, cfg.MaxTimeout)
	if cfg.PythonDefaultTimeout <= 0 {
		cfg.PythonDefaultTimeout = min(DefaultPythonTimeout, cfg.PythonMaxTimeout)
	}
	if cfg.PythonDefaultTimeout > cfg.PythonMaxTimeout {
		return nil, fmt.Errorf("default python timeout %s exceeds the maximum %s", cfg.PythonDefaultTimeout, cfg.PythonMaxTimeout)
	}
	if cfg.MaxProcesses <= 0 {
		cfg.MaxProcesses = DefaultMaxProcesses
	}
	if cfg.CommandPidsLimit == 0 {
		cfg.CommandPidsLimit = DefaultCommandPidsLimit
	}
	if cfg.ProcessOutputBytes <= 0 {
		cfg.ProcessOutputBytes = DefaultProcessOutputBytes
	}
	if cfg.ProcessKillGrace <= 0 {
		cfg.ProcessKillGrace = DefaultProcessKillGrace
	}
	log := cfg.Logger
	if log == nil {
		log = slog.Default()
	}

	if cfg.WorkspaceCap <= 0 {
		cfg.WorkspaceCap = DefaultWorkspaceCap
	}
	if cfg.WorkspaceUsageTTL <= 0 {
		cfg.WorkspaceUsageTTL = DefaultWorkspaceUsageTTL
	}
	workspace, aliases, err := resolveWorkspace(cfg.Workspace)
	if err != nil {
		return nil, err
	}
	cwdDefault := cfg.DefaultCwd
	if cwdDefault == "" {
		cwdDefault = workspace
	}
	cwd, err := resolveDefaultCwd(cwdDefault)
	if err != nil {
		return nil, err
	}
	base := cfg.BaseEnv
	if base == nil {
		base = map[string]string{"PATH": DefaultPath, "HOME": cwd, "LANG": "C.UTF-8"}
	}
	env := make(map[string]string, len(base)+len(cfg.PassEnv))
	for k, v := range base {
		env[k] = v
	}
	for _, k := range cfg.PassEnv {
		if v, ok := os.LookupEnv(k); ok {
			env[k] = v
		}
	}
	if err := procenv.Validate(env); err != nil {
		return nil, fmt.Errorf("base environment: %w", err)
	}
	s := &Server{
		cfg:        cfg,
		defaultCwd: cwd,
		baseEnv:    env,
		slots:      make(chan struct{}, cfg.MaxConcurrentCommands),
		log:        log,
		workspace:  workspace,
		groups:     make(map[int]struct{}),
		oomKilled:  make(map[int]bool),
		digests:    newDigestCache(),
	}
	s.workspaceAliases = aliases
	if workspace != "" {
		if s.root, err = os.OpenRoot(workspace); err != nil {
			return nil, fmt.Errorf("workspace: %w", err)
		}
		if s.usage, err = newWorkspaceUsage(s.root, cfg.WorkspaceCap, cfg.WorkspaceUsageTTL); err != nil {
			s.root.Close()
			return nil, fmt.Errorf("workspace usage: %w", err)
		}
	}
	s.initExecute()
	if cfg.MemoryLimit > 0 {
		inUse := cfg.MemoryInUse
		if inUse == nil {
			inUse = MemInfoInUse
		}
		if err := s.startMemoryGuard(cfg.MemoryLimit, cfg.MemoryReserve, 0, inUse); err != nil {
			s.Close()
			return nil, err
		}
	}
	return s, nil
}

// CheckPassEnv refuses a list of variables to pass to commands that names
// one of the supervisor's own (api.ReservedEnvPrefix).
func CheckPassEnv(names []string) error {
	for _, k := range names {
		if strings.HasPrefix(k, api.ReservedEnvPrefix) {
			return fmt.Errorf("pass env: %s is the supervisor's own configuration (%s...), never passed to commands", k, api.ReservedEnvPrefix)
		}
	}
	return nil
}

// ParseEnvNames reads a list of variable names, as -pass-env and
// AGENTBOX_PASS_ENV take it: a JSON array of strings (the controller
// writes one, since a name may hold a comma) or a comma-separated list. It
// never returns nil, so that an empty list means none rather than the
// default.
func ParseEnvNames(s string) ([]string, error) {
	out := []string{}
	if t := strings.TrimSpace(s); strings.HasPrefix(t, "[") {
		var names []string
		if err := json.Unmarshal([]byte(t), &names); err != nil {
			return nil, fmt.Errorf("not a JSON array of names: %w", err)
		}
		for _, n := range names {
			if n == "" || strings.ContainsAny(n, "=\x00") {
				return nil, fmt.Errorf("%q is not a variable name", n)
			}
			out = append(out, n)
		}
		return out, nil
	}
	for _, f := range strings.Split(s, ",") {
		if f = strings.TrimSpace(f); f != "" {
			out = append(out, f)
		}
	}
	return out, nil
}

// Close releases the workspace handle and stops environment builds.
func (s *Server) Close() error {
	if s.memGuard != nil {
		s.memGuard.close()
	}
	err := s.closeExecute()
	if s.root == nil {
		return err
	}
	return errors.Join(err, s.root.Close())
}

// resolveWorkspace returns the absolute, symlink-free path of the
// workspace, or "" for none, and the configured absolute path if it
// differs. Both are resolved once here so that absolute request paths can
// be matched against them.
func resolveWorkspace(dir string) (string, []string, error) {
	explicit := dir != ""
	if !explicit {
		dir = DefaultWorkspace
	}
	abs, err := filepath.Abs(dir)
	if err != nil {
		return "", nil, fmt.Errorf("workspace: %w", err)
	}
	real, err := filepath.EvalSymlinks(abs)
	if err != nil {
		if !explicit && errors.Is(err, fs.ErrNotExist) {
			return "", nil, nil
		}
		return "", nil, fmt.Errorf("workspace: %w", err)
	}
	st, err := os.Stat(real)
	if err != nil {
		return "", nil, fmt.Errorf("workspace: %w", err)
	}
	if !st.IsDir() {
		if !explicit {
			return "", nil, nil
		}
		return "", nil, fmt.Errorf("workspace %q is not a directory", abs)
	}
	var aliases []string
	if abs != real {
		aliases = []string{abs}
	}
	return real, aliases, nil
}

// Workspace is the directory the file endpoints serve, or "" if none.
func (s *Server) Workspace() string { return s.workspace }

func resolveDefaultCwd(dir string) (string, error) {
	if dir == "" {
		if st, err := os.Stat(DefaultWorkspace); err == nil && st.IsDir() {
			return DefaultWorkspace, nil
		}
		wd, err := os.Getwd()
		if err != nil {
			return "", fmt.Errorf("default cwd: %w", err)
		}
		return wd, nil
	}
	abs, err := filepath.Abs(dir)
	if err != nil {
		return "", fmt.Errorf("default cwd %q: %w", dir, err)
	}
	st, err := os.Stat(abs)
	if err != nil {
		return "", fmt.Errorf("default cwd: %w", err)
	}
	if !st.IsDir() {
		return "", fmt.Errorf("default cwd %q is not a directory", abs)
	}
	return abs, nil
}

// DefaultCwd is the directory commands run in when they name none.
func (s *Server) DefaultCwd() string { return s.defaultCwd }

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
// that they can exit cleanly before the supervisor does; new background
// processes are refused. It returns how many groups it signalled. Killing
// those that ignore it is left to the caller: cancelling the requests'
// contexts sends SIGKILL to commands, and Kill to everything.
func (s *Server) Terminate() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.terminating = true
	n := 0
	for pgid := range s.groups {
		if syscall.Kill(-pgid, syscall.SIGTERM) == nil {
			n++
		}
	}
	s.hangUpPTYsLocked()
	return n
}

// track records a started command's process group. A command that starts
// after Terminate is told to stop at once rather than left to be killed.
func (s *Server) track(pgid int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.groups[pgid] = struct{}{}
	if s.terminating {
		_ = syscall.Kill(-pgid, syscall.SIGTERM)
	}
}

func (s *Server) untrack(pgid int) {
	s.mu.Lock()
	delete(s.groups, pgid)
	s.mu.Unlock()
}

func (s *Server) begin() {
	s.mu.Lock()
	s.running++
	s.mu.Unlock()
}

func (s *Server) end() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.running--; s.running == 0 && s.idle != nil {
		close(s.idle)
		s.idle = nil
	}
}

// ServeHTTP routes the request, logs one line about it and records it in
// the audit log.
func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	s.begin()
	defer s.end()
	start := time.Now()
	// Health checks are probes, not calls anyone makes on the sandbox:
	// they are neither recorded nor carry a record.
	audited := !isHealthPath(r.URL.Path)
	rec := &recorder{ResponseWriter: w, status: http.StatusOK, carry: audited, head: r.Method == http.MethodHead}
	var info requestInfo
	params := sha256.New()
	info.record = func() *AuditEntry {
		if info.made == nil {
			info.made = s.auditRecord(r, start, rec.status, &info, params)
		}
		return info.made
	}
	switch {
	case r.URL.Path == api.PathCommands, r.URL.Path == api.PathPython, r.URL.Path == api.PathCommandsStream,
		r.URL.Path == api.PathProcesses && r.Method == http.MethodPost,
		r.Method == http.MethodPost && isMCPPath(r.URL.Path),
		r.URL.Path == api.PathExecute, r.URL.Path == api.PathEnvs && r.Method == http.MethodPost,
		r.Method == http.MethodPost && strings.HasPrefix(r.URL.Path, api.PathTools+"/"):
		// The parameters are the JSON body as sent, whether or not it
		// turns out to be valid.
		r.Body = &hashingBody{ReadCloser: r.Body, w: params}
	default:
		// The file endpoints' parameters are the path and query; the
		// bytes of a file are data, not parameters.
		fmt.Fprintf(params, "%s %s?%s", r.Method, r.URL.EscapedPath(), r.URL.RawQuery)
	}
	switch r.URL.Path {
	case api.PathHealth, api.PathHealthShort:
		if r.Method != http.MethodGet && r.Method != http.MethodHead {
			methodNotAllowed(rec, r, "GET, HEAD")
			break
		}
		writeJSON(rec, http.StatusOK, s.health())
	case api.PathLive:
		if r.Method != http.MethodGet && r.Method != http.MethodHead {
			methodNotAllowed(rec, r, "GET, HEAD")
			break
		}
		// Reaching here took the accept loop, the HTTP parser, this
		// router and the lock every call takes (begin): what a wedged
		// supervisor would not get through. Nothing more is done, so that
		// the probe costs the same whatever the sandbox holds.
		writeJSON(rec, http.StatusOK, map[string]string{"status": "ok"})
	case api.PathFlush:
		if r.Method != http.MethodPost {
			methodNotAllowed(rec, r, "POST")
			break
		}
		if e := s.flush(); e != nil {
			info.err = e
			writeError(rec, e)
			break
		}
		rec.WriteHeader(http.StatusNoContent)
	case api.PathCommands:
		if r.Method != http.MethodPost {
			methodNotAllowed(rec, r, "POST")
			break
		}
		s.handleCommand(rec, r, &info)
	case api.PathPython:
		if r.Method != http.MethodPost {
			methodNotAllowed(rec, r, "POST")
			break
		}
		s.handlePython(rec, r, &info)
	case api.PathExecute:
		if r.Method != http.MethodPost {
			methodNotAllowed(rec, r, "POST")
			break
		}
		s.handleExecute(rec, r, &info)
	case api.PathCommandsStream:
		if r.Method != http.MethodPost {
			methodNotAllowed(rec, r, "POST")
			break
		}
		s.handleCommand(rec, r, &info)
	default:
		if isMCPPath(r.URL.Path) && s.cfg.MCP != nil {
			s.cfg.MCP.ServeHTTP(rec, r)
			break
		}
		if !s.serveEnvs(rec, r, &info) && !s.serveProcesses(rec, r, &info) && !s.serveFiles(rec, r, &info) && !s.serveManifest(rec, r, &info) && !s.serveTools(rec, r, &info) && !s.servePTY(rec, r, &info) {
			writeError(rec, api.Errorf(api.CodeNotFound, "no such endpoint: %s", r.URL.Path))
		}
	}

	attrs := []slog.Attr{
		slog.String("method", r.Method),
		slog.String("path", r.URL.Path),
		slog.Int("status", rec.status),
		slog.Int64("duration_ms", time.Since(start).Milliseconds()),
	}
	if peer := peerID(r); peer != "" {
		attrs = append(attrs, slog.String("peer", peer))
	}
	// Only the program name: arguments and environment may hold secrets.
	if info.program != "" {
		attrs = append(attrs, slog.String("program", info.program))
	}
	if info.file != "" {
		attrs = append(attrs, slog.String("file", info.file))
	}
	if info.aborted != nil {
		attrs = append(attrs, slog.String("aborted", info.aborted.Error()))
	}
	if info.result != nil {
		attrs = append(attrs, slog.Int("exit_code", info.result.ExitCode), slog.Bool("timed_out", info.result.TimedOut),
			slog.Bool("truncated", info.result.Truncated))
		if info.result.Signal != "" {
			attrs = append(attrs, slog.String("signal", info.result.Signal))
		}
	}
	if info.err != nil {
		attrs = append(attrs, slog.String("error_code", string(info.err.Code)), slog.String("error", info.err.Message))
	}
	if r.Context().Err() != nil {
		attrs = append(attrs, slog.Bool("cancelled", true))
	}
	level := slog.LevelInfo
	if isHealthPath(r.URL.Path) && rec.status == http.StatusOK {
		// Kubelet probes would otherwise add a line every few seconds for
		// the life of the sandbox.
		level = slog.LevelDebug
	}
	s.log.LogAttrs(r.Context(), level, "request", attrs...)
	if audited {
		e := info.record()
		switch {
		case info.aborted != nil, rec.status == http.StatusSwitchingProtocols:
			// A response cut off carries nothing more; a PTY session sent
			// its record on the connection, if its client was still there.
		default:
			if v, err := api.EncodeAuditRecord(*e); err == nil {
				rec.attach(v)
			} else {
				s.log.Error("audit record not encoded", "tool", e.Tool, "error", err.Error())
			}
		}
		if s.cfg.Audit != nil {
			if err := s.cfg.Audit.Record(*e); err != nil {
				s.log.Error("audit log write failed", "tool", e.Tool, "error", err.Error())
			}
		}
	}
	if info.aborted != nil {
		// The status and part of the body are sent; cutting the
		// connection is the only way left to tell the client the body is
		// incomplete (a chunked body that ends cleanly would look whole).
		panic(http.ErrAbortHandler)
	}
}

type requestInfo struct {
	program string
	file    string
	result  *api.CommandResult
	err     *api.Error
	// aborted is set when a streamed response failed after its first
	// byte.
	aborted error
	// record makes the call's audit record from what is known when it is
	// first called, and returns that one from then on: a PTY session
	// makes it before its close, to send it, and ServeHTTP after the
	// handler.
	record func() *AuditEntry
	made   *AuditEntry
}

// auditRecord is the record of a call that answered status.
func (s *Server) auditRecord(r *http.Request, start time.Time, status int, info *requestInfo, params hash.Hash) *AuditEntry {
	e := &AuditEntry{
		Time:         start.UTC(),
		Tool:         toolName(r),
		ParamsSHA256: hex.EncodeToString(params.Sum(nil)),
		DurationMS:   time.Since(start).Milliseconds(),
		HTTPStatus:   status,
		Peer:         peerID(r),
		Sandbox:      s.cfg.Identity,
		RequestID:    requestID(r),
	}
	if res := info.result; res != nil {
		e.ExitCode = &res.ExitCode
		e.Signal, e.TimedOut, e.OutOfMemory, e.Truncated = res.Signal, res.TimedOut, res.OutOfMemory, res.Truncated
	}
	if info.err != nil {
		e.ErrorCode = string(info.err.Code)
	}
	if info.aborted != nil {
		e.Aborted = true
	}
	return e
}

// requestID is the caller's request ID, if it is one a record can hold:
// short printable ASCII.
func requestID(r *http.Request) string {
	id := r.Header.Get(api.HeaderRequestID)
	if len(id) > api.MaxRequestIDBytes {
		return ""
	}
	for i := 0; i < len(id); i++ {
		if id[i] < 0x21 || id[i] > 0x7e {
			return ""
		}
	}
	return id
}

func (i *requestInfo) abort(err error) { i.aborted = err }

// fail records e and answers with it.
func (i *requestInfo) fail(w http.ResponseWriter, e *api.Error) {
	i.err = e
	writeError(w, e)
}

// setProgram records the program a command runs, for the log line.
func (i *requestInfo) setProgram(argv []string) {
	if len(argv) > 0 {
		i.program = argv[0]
	}
}

// toolName is the name of the call in the audit log, in the terms of the
// tools an agent calls rather than of HTTP.
func toolName(r *http.Request) string {
	p := r.URL.Path
	switch {
	case p == api.PathCommands:
		return "run_command"
	case p == api.PathPython:
		return "python_exec"
	case p == api.PathCommandsStream:
		return "run_command_stream"
	case p == api.PathProcesses && r.Method == http.MethodPost:
		return "start_process"
	case p == api.PathProcesses:
		return "list_processes"
	case strings.HasPrefix(p, api.PathProcesses+"/"):
		if r.Method == http.MethodDelete {
			return "kill_process"
		}
		return "get_process"
	case isMCPPath(p):
		if r.Method == http.MethodPost {
			return "mcp_call"
		}
		return "mcp_status"
	case p == api.PathFlush:
		return "flush"
	case p == api.PathPTY:
		return "pty_session"
	case p == api.PathTools || strings.HasPrefix(p, api.PathTools+"/"):
		return toolAuditName(r)
	case p == api.PathExecute:
		return "execute"
	case p == api.PathEnvs && r.Method == http.MethodPost:
		return "create_env"
	case p == api.PathEnvs:
		return "list_envs"
	case strings.HasPrefix(p, api.PathEnvs+"/"):
		if r.Method == http.MethodDelete {
			return "delete_env"
		}
		return "get_env"
	case isHealthPath(p):
		return "health"
	case strings.HasPrefix(p, api.PathStat):
		return "stat_file"
	case strings.HasPrefix(p, api.PathList):
		return "list_files"
	case strings.HasPrefix(p, api.PathManifest):
		return "file_manifest"
	case strings.HasPrefix(p, api.PathFiles):
		switch r.Method {
		case http.MethodGet, http.MethodHead:
			return "read_file"
		case http.MethodPut:
			return "write_file"
		case http.MethodDelete:
			return "delete_file"
		}
	}
	return "unknown"
}

// isMCPPath reports whether p is served by Config.MCP.
func isMCPPath(p string) bool {
	return p == mcpbridge.PathPrefix || strings.HasPrefix(p, mcpbridge.PathPrefix+"/")
}

// hashingBody feeds what the handler reads of the body to the parameter
// hash, so the body need not be buffered twice.
type hashingBody struct {
	io.ReadCloser
	w io.Writer
}

func (b *hashingBody) Read(p []byte) (int, error) {
	n, err := b.ReadCloser.Read(p)
	b.w.Write(p[:n])
	return n, err
}

// handleCommand serves /v1/commands and /v1/commands/stream, which differ
// only in where the output goes.
func (s *Server) handleCommand(w http.ResponseWriter, r *http.Request, info *requestInfo) {
	var req api.CommandRequest
	if !s.decodeRequest(w, r, info, &req) {
		return
	}
	info.setProgram(req.Command)
	spec, apiErr := s.prepare(&req, s.cfg.DefaultTimeout, s.cfg.MaxTimeout)
	if r.URL.Path == api.PathCommandsStream {
		s.executeStream(w, r, info, spec, apiErr)
		return
	}
	s.execute(w, r, info, spec, apiErr)
}

// decodeRequest decodes the JSON body into v, answering and recording the
// error if it cannot.
func (s *Server) decodeRequest(w http.ResponseWriter, r *http.Request, info *requestInfo, v any) bool {
	if apiErr := s.decodeJSON(w, r, v); apiErr != nil {
		info.fail(w, apiErr)
		return false
	}
	return true
}

// execute runs a prepared command and writes its result; apiErr is a
// failure to prepare it.
func (s *Server) execute(w http.ResponseWriter, r *http.Request, info *requestInfo, spec *commandSpec, apiErr *api.Error) {
	release, ok := s.admit(r.Context(), w, info, apiErr)
	if !ok {
		return
	}
	defer release()
	out := newOutput(spec.maxOutput)
	res, apiErr := s.run(r.Context(), spec, out.stdout, out.stderr)
	if apiErr != nil {
		info.fail(w, apiErr)
		return
	}
	res.Stdout, res.Stderr, res.Truncated = out.result()
	info.result = res
	writeJSON(w, http.StatusOK, res)
}

// admit answers apiErr, a failure to prepare a command, or takes one of
// the MaxConcurrentCommands slots for it, waiting its turn if need be.
func (s *Server) admit(ctx context.Context, w http.ResponseWriter, info *requestInfo, apiErr *api.Error) (release func(), ok bool) {
	if apiErr == nil {
		release, apiErr = s.acquire(ctx)
	}
	if apiErr != nil {
		info.fail(w, apiErr)
		return nil, false
	}
	return release, true
}

// acquire takes one of the MaxConcurrentCommands slots, waiting in the
// queue (see Config.MaxQueuedCommands) while all are taken.
func (s *Server) acquire(ctx context.Context) (release func(), _ *api.Error) {
	if release, apiErr := s.tryAcquire(); apiErr == nil {
		return release, nil
	}
	if int(s.queued.Add(1)) > s.cfg.MaxQueuedCommands {
		s.queued.Add(-1)
		return nil, api.Errorf(api.CodeResourceExhausted, "%d commands are running and %d more are waiting", cap(s.slots), s.cfg.MaxQueuedCommands)
	}
	defer s.queued.Add(-1)
	timer := time.NewTimer(s.cfg.CommandQueueWait)
	defer timer.Stop()
	select {
	case s.slots <- struct{}{}:
		return func() { <-s.slots }, nil
	case <-timer.C:
		return nil, api.Errorf(api.CodeResourceExhausted, "%d commands are running; this one waited %s for its turn", cap(s.slots), s.cfg.CommandQueueWait)
	case <-ctx.Done():
		return nil, api.Errorf(api.CodeResourceExhausted, "the caller went away while %d commands were running", cap(s.slots))
	}
}

// tryAcquire takes a slot only if one is free.
func (s *Server) tryAcquire() (release func(), _ *api.Error) {
	select {
	case s.slots <- struct{}{}:
		return func() { <-s.slots }, nil
	default:
		return nil, api.Errorf(api.CodeResourceExhausted, "%d commands are already running", cap(s.slots))
	}
}

// decodeJSON decodes the body, which must be exactly one JSON value, into
// v.
func (s *Server) decodeJSON(w http.ResponseWriter, r *http.Request, v any) *api.Error {
	if ct := r.Header.Get("Content-Type"); ct != "" && !strings.HasPrefix(ct, "application/json") {
		return api.Errorf(api.CodeInvalidArgument, "content type must be application/json, not %q", ct)
	}
	dec := json.NewDecoder(http.MaxBytesReader(w, r.Body, s.cfg.MaxRequestBytes))
	err := dec.Decode(v)
	if err == nil {
		// A second value, even a valid one, means the body is not what the
		// client meant to send.
		if _, tokErr := dec.Token(); tokErr != io.EOF {
			err = errors.New("unexpected data after the JSON object")
			if tokErr != nil && !isSyntaxError(tokErr) {
				err = tokErr
			}
		}
	}
	if err != nil {
		var tooLarge *http.MaxBytesError
		if errors.As(err, &tooLarge) {
			return api.Errorf(api.CodePayloadTooLarge, "request body exceeds %d bytes", tooLarge.Limit)
		}
		if errors.Is(err, io.EOF) {
			return api.Errorf(api.CodeInvalidArgument, "empty request body")
		}
		return api.Errorf(api.CodeInvalidArgument, "invalid JSON body: %v", err)
	}
	return nil
}

func isSyntaxError(err error) bool {
	var se *json.SyntaxError
	return errors.As(err, &se)
}

func peerID(r *http.Request) string {
	if r.TLS == nil || len(r.TLS.PeerCertificates) == 0 {
		return ""
	}
	id, err := pki.IDFromCert(r.TLS.PeerCertificates[0])
	if err != nil {
		return ""
	}
	return id.String()
}

// recorder remembers the status, and, when the call is audited (carry),
// makes room for the record in the response (see api.AuditRecord): a
// response with a body is sent chunked with the record declared as its
// trailer; the header of one without a body (204, 304, HEAD) is held back
// until attach, to carry the record itself.
type recorder struct {
	http.ResponseWriter
	status      int
	wroteHeader bool
	carry, head bool
	// held: the header is held back; trailer: the record is declared as
	// the trailer.
	held, trailer bool
}

func (r *recorder) WriteHeader(code int) {
	if r.wroteHeader {
		if !r.held {
			r.ResponseWriter.WriteHeader(code)
		}
		return
	}
	r.status, r.wroteHeader = code, true
	if r.carry {
		switch {
		case r.head || code == http.StatusNoContent || code == http.StatusNotModified:
			r.held = true
			return
		case code != http.StatusSwitchingProtocols:
			// Without a length the body goes chunked, which a trailer
			// needs.
			h := r.Header()
			h.Del("Content-Length")
			h.Add("Trailer", api.HeaderAudit)
			r.trailer = true
		}
	}
	r.ResponseWriter.WriteHeader(code)
}

func (r *recorder) Write(p []byte) (int, error) {
	if !r.wroteHeader {
		r.WriteHeader(http.StatusOK)
	}
	if r.held {
		if r.head {
			// What a HEAD handler writes is not sent anyway.
			return len(p), nil
		}
		return 0, http.ErrBodyNotAllowed
	}
	return r.ResponseWriter.Write(p)
}

// FlushError is what http.ResponseController.Flush calls: a flush sends
// the header, so it must go through WriteHeader.
func (r *recorder) FlushError() error {
	if !r.wroteHeader {
		r.WriteHeader(http.StatusOK)
	}
	if r.held {
		return nil
	}
	return http.NewResponseController(r.ResponseWriter).Flush()
}

// attach puts the encoded record v into the response: as the declared
// trailer, or in the header held back (or never written), which it then
// sends.
func (r *recorder) attach(v string) {
	switch {
	case r.trailer:
		r.Header().Set(api.HeaderAudit, v)
	case r.held || !r.wroteHeader:
		r.Header().Set(api.HeaderAudit, v)
		r.held = false
		r.wroteHeader = true
		r.ResponseWriter.WriteHeader(r.status)
	}
}

func (r *recorder) Unwrap() http.ResponseWriter { return r.ResponseWriter }

func writeJSON(w http.ResponseWriter, status int, v any) {
	h := w.Header()
	h.Set("Content-Type", "application/json")
	h.Set("X-Content-Type-Options", "nosniff")
	h.Set("Cache-Control", "no-store")
	w.WriteHeader(status)
	// The status is already sent; an encoding failure here can only be a
	// client that went away, which there is nobody to tell about.
	_ = json.NewEncoder(w).Encode(v)
}

func writeError(w http.ResponseWriter, e *api.Error) {
	status := e.Status
	if status == 0 {
		status = e.Code.HTTPStatus()
	}
	writeJSON(w, status, api.ErrorBody{Error: e})
}

func methodNotAllowed(w http.ResponseWriter, r *http.Request, allow string) {
	w.Header().Set("Allow", allow)
	writeError(w, api.Errorf(api.CodeMethodNotAllowed, "%s is not allowed on %s (allowed: %s)", r.Method, r.URL.Path, allow))
}
