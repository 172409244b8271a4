package supervisor

import (
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/execute"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/procenv"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/runner"
	api "github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/terminal"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/workspace"
)

// Defaults for Config's zero values.
const (
	DefaultWorkspace             = workspace.Default
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
	// DefaultCommandPidsLimit is the RLIMIT_NPROC of every command (see
	// runner.DefaultCommandPidsLimit).
	DefaultCommandPidsLimit = runner.DefaultCommandPidsLimit
	// DefaultPTYIdleTimeout and DefaultPTYMaxDuration bound a PTY session.
	DefaultPTYIdleTimeout = terminal.DefaultIdleTimeout
	DefaultPTYMaxDuration = terminal.DefaultMaxDuration
	// DefaultExecuteMaxFileBytes and DefaultExecuteMaxFilesBytes bound the
	// files a /v1/execute run returns.
	DefaultExecuteMaxFileBytes  = execute.DefaultMaxFileBytes
	DefaultExecuteMaxFilesBytes = execute.DefaultMaxFilesBytes
)

// ExecuteConfig configures /v1/execute and /v1/envs.
type ExecuteConfig = execute.Config

// DefaultPassEnv lists the variables copied from the supervisor's own
// environment into every command's when none are configured. Sandbox pods
// reach the network only through the egress proxy, so commands need the
// proxy settings; nothing else of the supervisor's environment is passed
// on unless named or PassAllEnv is configured (as the controller does), so
// that whatever configures the supervisor does not leak to the code it
// runs.
var DefaultPassEnv = []string{"HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "http_proxy", "https_proxy", "no_proxy"}

// PassAllEnv, as the only entry of PassEnv (AGENTBOX_PASS_ENV=*), passes
// the supervisor's whole environment to the processes it starts, except
// what is the supervisor's own (see NotPassed). It is how a sandbox
// image's own environment (NODE_VERSION, JAVA_HOME, a PATH with the
// image's tools) reaches commands: the image's ENV is in the environment
// the container runtime gives the supervisor, beside the template's env
// and the platform's variables.
const PassAllEnv = api.PassAllEnv

// NotPassed reports whether PassAllEnv leaves the variable name out: the
// supervisor's own configuration (api.ReservedEnvPrefix), its Go runtime
// setting GODEBUG (set for the supervisor alone; a Go program the agent
// runs would silently inherit it), and the Kubernetes API server's address
// that kubelet puts into every container (KUBERNETES_SERVICE_*,
// KUBERNETES_PORT*): the sandbox holds no credentials for it, and its
// code has no business being pointed at it.
func NotPassed(name string) bool {
	return strings.HasPrefix(name, api.ReservedEnvPrefix) || name == "GODEBUG" ||
		strings.HasPrefix(name, "KUBERNETES_SERVICE_") || strings.HasPrefix(name, "KUBERNETES_PORT")
}

// PassedEnv is the part of environ (KEY=value entries, as os.Environ
// gives them) that passes to the processes the supervisor starts: the
// variables names lists (CheckPassEnv has checked them), or, when names is
// PassAllEnv alone, every variable NotPassed does not leave out.
func PassedEnv(names, environ []string) map[string]string {
	all := len(names) == 1 && names[0] == PassAllEnv
	listed := make(map[string]bool, len(names))
	for _, n := range names {
		listed[n] = true
	}
	out := map[string]string{}
	for _, kv := range environ {
		k, v, ok := strings.Cut(kv, "=")
		if !ok || k == "" {
			continue
		}
		if (all && !NotPassed(k)) || (!all && listed[k]) {
			out[k] = v
		}
	}
	return out
}

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
	// into BaseEnv when set there, over BaseEnv's values; PassAllEnv
	// alone copies all of it but what NotPassed leaves out. Nil means
	// DefaultPassEnv; use an empty slice to pass nothing. Names starting
	// with api.ReservedEnvPrefix, and GODEBUG, are refused: they are the
	// supervisor's own configuration. An empty PATH counts as none:
	// BaseEnv's (DefaultPath by default) stays.
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
	// CommandPidsLimit is the RLIMIT_NPROC every command starts with;
	// negative means none. Zero means DefaultCommandPidsLimit, or with a
	// MemoryLimit what that memory holds (runner.CommandPidsLimitFor).
	CommandPidsLimit int
	// MemoryLimit is the pod's memory limit in bytes; when set, the
	// command holding the most memory is killed once the sandbox uses
	// more than MemoryLimit less MemoryReserve (zero: the larger of 96
	// MiB and an eighth of the limit). MemoryInUse reports the sandbox's
	// use; nil means runner.ChargeEstimate, gVisor's meminfo plus what
	// the sandbox's processes cost the pod beyond it.
	MemoryLimit   int64
	MemoryReserve int64
	MemoryInUse   func() (int64, error)
	// IdleTrim is how long the server waits once no call is being served
	// before it returns the memory calls freed to the system (TrimMemory,
	// or MemoryTrim when set). Zero means DefaultIdleTrim; negative, never.
	IdleTrim   time.Duration
	MemoryTrim func()
	// Execute configures /v1/execute and the cached Python environments of
	// /v1/envs (see package execute).
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

// withDefaults checks cfg and fills in its zero values.
func (cfg Config) withDefaults() (Config, error) {
	if err := cfg.commandDefaults(); err != nil {
		return cfg, err
	}
	if err := cfg.pythonDefaults(); err != nil {
		return cfg, err
	}
	if cfg.MaxProcesses <= 0 {
		cfg.MaxProcesses = DefaultMaxProcesses
	}
	if cfg.CommandPidsLimit == 0 {
		cfg.CommandPidsLimit = DefaultCommandPidsLimit
		if cfg.MemoryLimit > 0 {
			cfg.CommandPidsLimit = runner.CommandPidsLimitFor(cfg.MemoryLimit, cfg.MemoryReserve)
		}
	}
	if cfg.ProcessOutputBytes <= 0 {
		cfg.ProcessOutputBytes = DefaultProcessOutputBytes
	}
	if cfg.ProcessKillGrace <= 0 {
		cfg.ProcessKillGrace = DefaultProcessKillGrace
	}
	if cfg.IdleTrim == 0 {
		cfg.IdleTrim = DefaultIdleTrim
	}
	if cfg.MemoryTrim == nil {
		cfg.MemoryTrim = TrimMemory
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.WorkspaceCap <= 0 {
		cfg.WorkspaceCap = DefaultWorkspaceCap
	}
	if cfg.WorkspaceUsageTTL <= 0 {
		cfg.WorkspaceUsageTTL = DefaultWorkspaceUsageTTL
	}
	return cfg, nil
}

// commandDefaults fills in the limits of commands and their admission.
func (cfg *Config) commandDefaults() error {
	if cfg.DefaultTimeout <= 0 {
		cfg.DefaultTimeout = DefaultTimeout
	}
	if cfg.MaxTimeout <= 0 {
		cfg.MaxTimeout = DefaultMaxTimeout
	}
	if cfg.DefaultTimeout > cfg.MaxTimeout {
		return fmt.Errorf("default timeout %s exceeds the maximum %s", cfg.DefaultTimeout, cfg.MaxTimeout)
	}
	if cfg.DefaultMaxOutputBytes <= 0 {
		cfg.DefaultMaxOutputBytes = DefaultMaxOutputBytes
	}
	if cfg.MaxOutputBytesLimit <= 0 {
		cfg.MaxOutputBytesLimit = max(DefaultMaxOutputBytes, cfg.DefaultMaxOutputBytes)
	}
	if cfg.DefaultMaxOutputBytes > cfg.MaxOutputBytesLimit {
		return fmt.Errorf("default output cap %d exceeds the limit %d", cfg.DefaultMaxOutputBytes, cfg.MaxOutputBytesLimit)
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
		return err
	}
	return nil
}

// pythonDefaults fills in python_exec's interpreter and limits, which
// MaxTimeout bounds too.
func (cfg *Config) pythonDefaults() error {
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
		return fmt.Errorf("default python timeout %s exceeds the maximum %s", cfg.PythonDefaultTimeout, cfg.PythonMaxTimeout)
	}
	return nil
}

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

// CheckPassEnv refuses a list of variables to pass to commands that names
// one of the supervisor's own (api.ReservedEnvPrefix, GODEBUG), or that
// has PassAllEnv beside other names.
func CheckPassEnv(names []string) error {
	for _, k := range names {
		switch {
		case strings.HasPrefix(k, api.ReservedEnvPrefix):
			return fmt.Errorf("pass env: %s is the supervisor's own configuration (%s...), never passed to commands", k, api.ReservedEnvPrefix)
		case k == "GODEBUG":
			return errors.New("pass env: GODEBUG is the supervisor's own Go runtime setting, never passed to commands")
		case k == PassAllEnv && len(names) > 1:
			return fmt.Errorf("pass env: %s passes the whole environment and stands alone, not beside other names", PassAllEnv)
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

// baseEnvironment is the environment every command starts from: BaseEnv,
// or PATH, HOME (cwd) and LANG, with the PassEnv variables the supervisor
// itself has.
func (cfg *Config) baseEnvironment(cwd string) (map[string]string, error) {
	base := cfg.BaseEnv
	if base == nil {
		base = map[string]string{"PATH": DefaultPath, "HOME": cwd, "LANG": "C.UTF-8"}
	}
	env := make(map[string]string, len(base)+len(cfg.PassEnv))
	for k, v := range base {
		env[k] = v
	}
	for k, v := range PassedEnv(cfg.PassEnv, os.Environ()) {
		if k == "PATH" && v == "" {
			continue
		}
		env[k] = v
	}
	if err := procenv.Validate(env); err != nil {
		return nil, fmt.Errorf("base environment: %w", err)
	}
	return env, nil
}
