package wire

import "net/http"

// Code classifies an error. Callers branch on it, never on the message.
// Each side sends only its own codes (see the lists below); the mapping to
// an HTTP status is one, since no code means different things on the two.
type Code string

// Codes both sides send.
const (
	CodeInvalidArgument  Code = "invalid_argument"
	CodePermissionDenied Code = "permission_denied"
	// CodeNotFound: on the API, a path it does not serve (a missing
	// sandbox is CodeSandboxNotFound, so that clients can tell the two
	// apart); on the supervisor, a missing file, program or process.
	CodeNotFound         Code = "not_found"
	CodeMethodNotAllowed Code = "method_not_allowed"
	CodePayloadTooLarge  Code = "payload_too_large"
	// CodeResourceExhausted: the sandbox is already running as many
	// commands (or processes, or sessions) as it allows; retry later.
	CodeResourceExhausted Code = "resource_exhausted"
	CodeInternal          Code = "internal"
	// CodeUnavailable: on the API, the endpoint needs something the
	// control plane was not configured with (the store, for tokens and
	// audit); on the supervisor, something it needs is not there yet.
	CodeUnavailable Code = "unavailable"
	// CodeTimeout is for operations that fail outright when they run out
	// of time. A command that times out is not one: it returns a result
	// with TimedOut set, because its partial output is still useful.
	CodeTimeout Code = "timeout"
	// CodeWorkspaceFull is a write that would take the workspace past its
	// cap, or a disk that is full; nothing already there was changed. It
	// is 507 Insufficient Storage rather than resource_exhausted's 429,
	// because waiting does not help: space has to be freed first.
	CodeWorkspaceFull Code = "workspace_full"
	// CodeUnknown is what a client reports when a response carries no
	// recognisable error body, e.g. from a proxy in between.
	CodeUnknown Code = "unknown"
)

// Codes only the Compute API sends.
const (
	CodeUnauthenticated Code = "unauthenticated"
	CodeSandboxNotFound Code = "sandbox_not_found"
	// CodeSandboxNotReady: the sandbox exists but cannot take calls now;
	// Details carry its "phase" and Ready "reason".
	CodeSandboxNotReady Code = "sandbox_not_ready"
	// CodeSupervisorUnavailable: the sandbox's supervisor could not be
	// reached, failed its identity check or failed the call.
	CodeSupervisorUnavailable Code = "supervisor_unavailable"
	// CodeLeaseHeld: someone else holds the sandbox (the agent's hold,
	// whose wire name is a lease), or the same holder under another
	// request ID: an acquire is refused, and so is any call on the sandbox
	// that does not present the hold's lease ID (the Agentbox-Lease-Id
	// header). Details carry "holder" and "expires_at" (RFC 3339). HTTP
	// 409.
	CodeLeaseHeld Code = "lease_held"
	// CodeLeaseNotHeld: the heartbeat or release names a hold that is not
	// the current one: it was released, reclaimed after expiry, or taken
	// over by another holder.
	CodeLeaseNotHeld Code = "lease_not_held"
	// CodeLeaseExpired: the caller's hold ran out before the heartbeat.
	// It must acquire again.
	CodeLeaseExpired Code = "lease_expired"
	// CodePoolNotFound: the warm pool named in the path does not exist.
	CodePoolNotFound Code = "pool_not_found"
	// CodePoolExhausted: the warm pool has no ready, unleased sandbox now,
	// or none came (or the one cold-started for the call was not ready)
	// within the pool lease's wait; Details carry "retry_after_seconds",
	// and "sandbox" when a cold start is under way for the request. The
	// pool replaces leased sandboxes, so a retry shortly after succeeds
	// unless the pool is too small for the load.
	CodePoolExhausted Code = "pool_exhausted"
	// CodeFileNotFound: the workspace path does not exist.
	CodeFileNotFound Code = "file_not_found"
	// CodeConsoleExpired: the console session is past its time box or was
	// used already; mint a new one.
	CodeConsoleExpired Code = "console_session_expired"
	// CodeEnvNotFound: the agent's sandbox has no cached Python
	// environment of that name (it may have been evicted).
	CodeEnvNotFound Code = "env_not_found"
	// CodeInvalidUserToken: the user token a call carries (the
	// X-Agentbox-User-Token header) is refused: malformed, not signed by
	// the platform, expired, revoked, for another agent or for another
	// audience; the message says which, never quoting the token. HTTP 403:
	// the caller's own credentials are fine (401 would say they are not),
	// the token it passes on is not.
	CodeInvalidUserToken Code = "invalid_user_token"
)

// Codes only the supervisor sends.
const (
	// CodePathEscapesWorkspace refuses a path that would leave the
	// workspace: a ".." that climbs out of it, an absolute path elsewhere,
	// or a symbolic link (at any component) that points outside or is
	// absolute. It is distinct from permission_denied, which is the file
	// system refusing access to a path that is inside, so that a caller
	// can tell a bad path from a bad permission.
	CodePathEscapesWorkspace Code = "path_escapes_workspace"
	// CodeIsADirectory and CodeNotADirectory report a path of the wrong
	// kind: a directory where a file is needed, or a file (or missing
	// parent) where a directory is needed. They are conflicts with the
	// workspace's current state, hence 409.
	CodeIsADirectory  Code = "is_a_directory"
	CodeNotADirectory Code = "not_a_directory"
	// CodeEnvBuildFailed is an environment whose installer failed: a
	// requirement no configured index satisfies, an unreachable index, a
	// package that does not build. The message ends with the installer's
	// own error lines. Nothing of the environment is kept. The Compute
	// API passes it on from its /v1/agents/{id}/envs.
	CodeEnvBuildFailed Code = "env_build_failed"
)

// HTTPStatus is the status sent with the code.
func (c Code) HTTPStatus() int {
	switch c {
	case CodeInvalidArgument:
		return http.StatusBadRequest
	case CodeUnauthenticated:
		return http.StatusUnauthorized
	case CodePermissionDenied, CodePathEscapesWorkspace, CodeInvalidUserToken:
		return http.StatusForbidden
	case CodeNotFound, CodeSandboxNotFound, CodePoolNotFound, CodeFileNotFound, CodeEnvNotFound:
		return http.StatusNotFound
	case CodeMethodNotAllowed:
		return http.StatusMethodNotAllowed
	case CodeSandboxNotReady, CodeLeaseHeld, CodeLeaseNotHeld, CodeLeaseExpired,
		CodeIsADirectory, CodeNotADirectory:
		return http.StatusConflict
	case CodeConsoleExpired:
		return http.StatusGone
	case CodePayloadTooLarge:
		return http.StatusRequestEntityTooLarge
	case CodeEnvBuildFailed:
		return http.StatusUnprocessableEntity
	case CodeResourceExhausted:
		return http.StatusTooManyRequests
	case CodeWorkspaceFull:
		return http.StatusInsufficientStorage
	case CodeSupervisorUnavailable:
		return http.StatusBadGateway
	case CodeUnavailable, CodePoolExhausted:
		return http.StatusServiceUnavailable
	case CodeTimeout:
		return http.StatusGatewayTimeout
	default:
		return http.StatusInternalServerError
	}
}
