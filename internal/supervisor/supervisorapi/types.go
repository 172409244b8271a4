// Package supervisorapi is the wire contract of the in-sandbox supervisor
// and a Go client for it. It depends on the standard library, a WebSocket
// library (for PTY sessions) and package wire only, so the control plane
// can call the supervisor without importing the server and the supervisor
// never links control-plane code. What the supervisor shares with the
// Compute API's contract (error codes and *Error, the command request,
// result and events, the client transport) is defined once in package
// wire and named here.
//
// The supervisor serves HTTPS with mutual TLS on port 8443:
//
//	GET    /healthz                -> Health
//	GET    /livez                  -> {"status":"ok"} (the liveness probe's)
//	POST   /v1/commands            CommandRequest -> CommandResult
//	POST   /v1/commands/stream     CommandRequest -> NDJSON CommandEvent lines
//	POST   /v1/python              PythonRequest -> CommandResult (python_exec)
//	POST   /v1/processes           ProcessRequest -> ProcessInfo (background process)
//	GET    /v1/processes           -> ProcessList
//	GET    /v1/processes/{id}      -> ProcessInfo with recent output
//	DELETE /v1/processes/{id}      -> ProcessInfo (stops it, then forgets it)
//	PUT    /v1/files/{path}        file bytes -> FileInfo (?mode=0644)
//	PUT    /v1/files/{dir}?format=tar  tar stream -> TarResult
//	GET    /v1/files/{path}        -> file bytes, or a tar of a directory
//	                                  (?format=tar or Accept: application/x-tar)
//	DELETE /v1/files/{path}        (?recursive=true for a directory)
//	GET    /v1/stat/{path}         -> FileInfo
//	GET    /v1/list/{path}         -> ListResult
//	GET    /v1/tools               -> ToolCatalog (sandboxed tools; see tools.go)
//	POST   /v1/tools/{name}        tool input -> tool output
//	GET    /v1/pty                 WebSocket: interactive terminal (see pty.go)
//
// and the execution and environment endpoints (see execute.go):
// POST /v1/execute, GET and POST /v1/envs, DELETE /v1/envs/{name}, and
// GET /health as another name for /healthz.
//
// File paths are relative to the workspace (/workspace in a sandbox); an
// absolute path is accepted only when it lies under the workspace. Each
// segment is percent-escaped in the URL; see FilePath.
//
// Errors are JSON bodies {"error": {"code": ..., "message": ...}} with the
// HTTP status that matches the code.
package supervisorapi

import (
	"time"

	"github.com/agentbox/terraform-provider-agentbox/internal/wire"
)

const (
	// DefaultPort is the port the supervisor listens on in a sandbox pod.
	DefaultPort = 8443

	PathHealth = "/healthz"
	// PathLive answers {"status":"ok"} once the request has gone through
	// the supervisor's request handling, and does nothing else: it is the
	// liveness probe's, cheap enough to call every few seconds whatever
	// the workspace holds (PathHealth measures the workspace). Like
	// PathHealth it is also served on the plain-HTTP health listener,
	// which needs no client certificate.
	PathLive     = "/livez"
	PathCommands = "/v1/commands"
	// PathCommandsStream (POST) runs a command like PathCommands but
	// answers with its output as it arrives; see CommandEvent.
	PathCommandsStream = "/v1/commands/stream"
	// PathProcesses manages background processes; one is addressed as
	// PathProcesses + "/" + id.
	PathProcesses = "/v1/processes"
	// ContentTypeNDJSON labels streamed responses: one JSON value a line.
	ContentTypeNDJSON = wire.ContentTypeNDJSON
	// PathPython (POST) runs a Python snippet: the python_exec tool.
	PathPython = "/v1/python"
	// PathFlush (POST) writes the workspace's dirty data to its volume, so
	// that a volume snapshot taken next sees every completed write.
	PathFlush = "/v1/flush"
	// The file endpoints take the workspace path after the prefix.
	PathFiles = "/v1/files/"
	PathStat  = "/v1/stat/"
	PathList  = "/v1/list/"

	// ContentTypeTar asks GET /v1/files for a tar of a directory, and
	// labels tar bodies.
	ContentTypeTar = "application/x-tar"
	// FormatTar is the value of the format query parameter for tar.
	FormatTar = "tar"
	// DefaultFileMode applies to files written without a mode.
	DefaultFileMode = 0o644
	// ReservedEnvPrefix starts the names of the variables that configure
	// the supervisor (AGENTBOX_WORKSPACE_CAP, AGENTBOX_TLS_DIR, ...). The
	// supervisor never passes them to the processes it starts.
	ReservedEnvPrefix = "AGENTBOX_"
	// PassAllEnv, as the supervisor's whole AGENTBOX_PASS_ENV, has it pass
	// its whole environment to the processes it starts, except its own
	// configuration (ReservedEnvPrefix), GODEBUG and the API server's
	// address kubelet injects (KUBERNETES_SERVICE_*, KUBERNETES_PORT*).
	PassAllEnv = "*"
	// DefaultWorkspaceCapBytes is the workspace cap when none is configured
	// (the design's 1 GB).
	DefaultWorkspaceCapBytes = 1 << 30
	// PlatformDir is the workspace's hidden directory of the platform's own
	// state that must outlive the pod: it lives on the workspace volume,
	// so an idle stop's snapshot carries it and the resume restores it,
	// but it is not the agent's files: manifests (and with them the
	// filespace syncs) leave it out. Its files count against the
	// workspace cap like any other on the volume.
	PlatformDir = ".agentbox"
	// EnvsDir is where the controller keeps a sandbox's cached Python
	// environments, under the workspace (-env-dir): a venv embeds its
	// absolute path, which is the same after a resume.
	EnvsDir = PlatformDir + "/envs"
	// QueryLinks, set to LinksKeep on PUT /v1/files/{dir}?format=tar,
	// extracts symbolic links whose targets are absolute or lead out of
	// the workspace as they are, instead of refusing them: the restore of
	// an idle stop's snapshot, which must give back the workspace as
	// commands left it (a venv's bin/python links to the image's
	// interpreter). The supervisor never follows such a link itself
	// either way.
	QueryLinks = "links"
	LinksKeep  = "keep"

	// DefaultTimeoutSeconds applies when a request gives no timeout.
	DefaultTimeoutSeconds = 60
	// DefaultMaxOutputBytes applies when a request gives no output cap; it
	// is also the supervisor's default upper limit for the cap.
	DefaultMaxOutputBytes = 1 << 20
)

// CommandRequest runs Command[0] with arguments Command[1:]; see
// wire.CommandRequest. The Compute API's run_command request is the same
// type.
type CommandRequest = wire.CommandRequest

// Limits of python_exec. They are tighter than a command's because a
// snippet is meant to compute something and return, not to run a build.
const (
	// DefaultPythonTimeoutSeconds applies when a PythonRequest gives no
	// timeout.
	DefaultPythonTimeoutSeconds = 30
	// MaxPythonTimeoutSeconds is the largest timeout a PythonRequest may
	// ask for.
	MaxPythonTimeoutSeconds = 120
	// MaxPythonCodeBytes is the largest Code the supervisor accepts. The
	// code is passed to the interpreter as one argument (python3 -c), and
	// Linux refuses any single argument longer than 128 KiB including its
	// terminating NUL. Larger programs belong in a file run by a command.
	MaxPythonCodeBytes = 128<<10 - 1
)

// PythonRequest runs Code with python3 -u -c. The process is a command
// like any other: same environment rules, process group, output cap and
// result; only the timeout limits differ.
type PythonRequest struct {
	Code string `json:"code"`
	// Stdin is the snippet's standard input; empty means /dev/null.
	Stdin string `json:"stdin,omitempty"`
	// Env is merged over the base environment, as for CommandRequest.
	Env map[string]string `json:"env,omitempty"`
	// Cwd is as for CommandRequest.
	Cwd string `json:"cwd,omitempty"`
	// TimeoutSeconds: 0 means DefaultPythonTimeoutSeconds. A value above
	// MaxPythonTimeoutSeconds is refused with invalid_argument rather than
	// clamped: a caller that asked for more time and silently got less
	// would read the resulting TimedOut as a fault of its code.
	TimeoutSeconds int `json:"timeout_seconds,omitempty"`
	// MaxOutputBytes is as for CommandRequest.
	MaxOutputBytes int64 `json:"max_output_bytes,omitempty"`
}

// CommandResult is the outcome of a command that was started; see
// wire.CommandResult.
type CommandResult = wire.CommandResult

// Health is the body of GET /healthz (and /health). The fields after
// Workspace are the pod's status as environment routing reads it, for routing runs to a sandbox that
// has their environment cached.
type Health struct {
	Status  string `json:"status"`
	Version string `json:"version"`
	// Workspace is absent when the supervisor serves no workspace.
	Workspace *WorkspaceUsage `json:"workspace,omitempty"`
	// State is "busy" while commands run, else "warming" while
	// environments are being built, else "idle".
	State string `json:"state"`
	// Environments are the cached Python environments; null when the
	// supervisor keeps none.
	Environments []EnvInfo `json:"environments"`
	// EnvCache sums the cache up; absent when there is none.
	EnvCache *EnvCache `json:"env_cache,omitempty"`
	// Capacity is how many commands (python and execute runs included)
	// may run at once, CurrentLoad how many do now.
	Capacity      int   `json:"capacity"`
	CurrentLoad   int   `json:"current_load"`
	UptimeSeconds int64 `json:"uptime_seconds"`
}

// Values of Health.State.
const (
	StateIdle    = "idle"
	StateBusy    = "busy"
	StateWarming = "warming"
)

// WorkspaceUsage reports how much of the workspace cap is used. UsedBytes
// is the sum of the apparent sizes of the regular files under the
// workspace, which is what the cap is enforced against.
type WorkspaceUsage struct {
	UsedBytes int64 `json:"used_bytes"`
	CapBytes  int64 `json:"cap_bytes"`
}

// FileInfo describes one file in the workspace. It describes a symbolic
// link itself, not its target.
type FileInfo struct {
	// Name is the last element of the path ("." for the workspace).
	Name string `json:"name"`
	// Path is the workspace-relative path, with slashes.
	Path string `json:"path,omitempty"`
	Size int64  `json:"size"`
	// Mode is the permission bits in octal, e.g. "0644" (with setuid,
	// setgid and sticky as the leading digit when set).
	Mode      string    `json:"mode"`
	ModTime   time.Time `json:"mod_time"`
	IsDir     bool      `json:"is_dir"`
	IsSymlink bool      `json:"is_symlink"`
	// LinkTarget is the target of a symbolic link, as stored.
	LinkTarget string `json:"link_target,omitempty"`
}

// ListResult is the body of GET /v1/list/{path}: the directory's entries,
// sorted by name.
type ListResult struct {
	Path    string     `json:"path"`
	Entries []FileInfo `json:"entries"`
}

// TarResult is the body of a successful tar extraction.
type TarResult struct {
	Files    int   `json:"files"`
	Dirs     int   `json:"dirs"`
	Symlinks int   `json:"symlinks"`
	Bytes    int64 `json:"bytes"`
}
