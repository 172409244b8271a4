// Package supervisorapi is the wire contract of the in-sandbox supervisor
// and a Go client for it. It depends on the standard library only, so the
// control plane can call the supervisor without importing the server and
// the supervisor never links control-plane code.
//
// The supervisor serves HTTPS with mutual TLS on port 8443:
//
//	GET  /healthz     -> Health
//	POST /v1/commands  CommandRequest -> CommandResult
//
// Errors are JSON bodies {"error": {"code": ..., "message": ...}} with the
// HTTP status that matches the code.
package supervisorapi

import (
	"fmt"
	"net/http"
)

const (
	// DefaultPort is the port the supervisor listens on in a sandbox pod.
	DefaultPort = 8443

	PathHealth   = "/healthz"
	PathCommands = "/v1/commands"

	// DefaultTimeoutSeconds applies when a request gives no timeout.
	DefaultTimeoutSeconds = 60
	// DefaultMaxOutputBytes applies when a request gives no output cap; it
	// is also the supervisor's default upper limit for the cap.
	DefaultMaxOutputBytes = 1 << 20
)

// CommandRequest runs Command[0] with arguments Command[1:]. No shell is
// involved unless the caller runs one, e.g. ["sh", "-c", "..."].
type CommandRequest struct {
	Command []string `json:"command"`
	// Cwd must be an existing directory. Empty means the supervisor's
	// default (/workspace in a sandbox); a relative path is taken relative
	// to that default.
	Cwd string `json:"cwd,omitempty"`
	// Env is merged over a minimal base environment (PATH, HOME, LANG and
	// the proxy variables); the supervisor's own environment is never
	// passed on.
	Env map[string]string `json:"env,omitempty"`
	// Stdin is written to the command's standard input, which is then
	// closed. Empty means /dev/null.
	Stdin string `json:"stdin,omitempty"`
	// TimeoutSeconds: 0 means DefaultTimeoutSeconds; above the supervisor's
	// maximum (10 minutes unless configured) is an invalid_argument error.
	// On timeout the whole process group is killed and the result has
	// TimedOut set; it is not an error.
	TimeoutSeconds int `json:"timeout_seconds,omitempty"`
	// MaxOutputBytes caps stdout and stderr combined. 0 means
	// DefaultMaxOutputBytes; above the supervisor's limit is an
	// invalid_argument error.
	MaxOutputBytes int64 `json:"max_output_bytes,omitempty"`
}

// CommandResult is the outcome of a command that was started.
type CommandResult struct {
	// Stdout and Stderr are UTF-8; invalid bytes are replaced by U+FFFD.
	Stdout string `json:"stdout"`
	Stderr string `json:"stderr"`
	// ExitCode is -1 when the process was ended by a signal.
	ExitCode int `json:"exit_code"`
	// Signal names the signal that ended the process, e.g. "SIGKILL", or
	// is empty.
	Signal string `json:"signal"`
	// TimedOut means the supervisor killed the process group because the
	// timeout expired.
	TimedOut bool `json:"timed_out"`
	// Truncated means output beyond MaxOutputBytes was discarded.
	Truncated  bool  `json:"truncated"`
	DurationMS int64 `json:"duration_ms"`
}

// Health is the body of GET /healthz.
type Health struct {
	Status  string `json:"status"`
	Version string `json:"version"`
}

// Code classifies an error. Callers branch on it, never on the message.
type Code string

const (
	CodeInvalidArgument   Code = "invalid_argument"
	CodePermissionDenied  Code = "permission_denied"
	CodeNotFound          Code = "not_found"
	CodeMethodNotAllowed  Code = "method_not_allowed"
	CodePayloadTooLarge   Code = "payload_too_large"
	CodeResourceExhausted Code = "resource_exhausted"
	CodeInternal          Code = "internal"
	CodeUnavailable       Code = "unavailable"
	// CodeTimeout is for operations that fail outright when they run out
	// of time. A command that times out is not one: it returns a result
	// with TimedOut set, because its partial output is still useful.
	CodeTimeout Code = "timeout"
	// CodeUnknown is what the client reports when a response carries no
	// recognisable error body, e.g. from something between it and the
	// supervisor.
	CodeUnknown Code = "unknown"
)

// HTTPStatus is the status the supervisor sends with the code.
func (c Code) HTTPStatus() int {
	switch c {
	case CodeInvalidArgument:
		return http.StatusBadRequest
	case CodePermissionDenied:
		return http.StatusForbidden
	case CodeNotFound:
		return http.StatusNotFound
	case CodeMethodNotAllowed:
		return http.StatusMethodNotAllowed
	case CodePayloadTooLarge:
		return http.StatusRequestEntityTooLarge
	case CodeResourceExhausted:
		return http.StatusTooManyRequests
	case CodeUnavailable:
		return http.StatusServiceUnavailable
	case CodeTimeout:
		return http.StatusGatewayTimeout
	default:
		return http.StatusInternalServerError
	}
}

// Error is an error the supervisor reported. Use errors.As to get it from
// a Client method's error; transport failures (refused connections, TLS
// failures, cancelled contexts) are returned as they are, not as *Error.
type Error struct {
	Code    Code   `json:"code"`
	Message string `json:"message"`
	// HTTPStatus is the status the response carried; it is not sent in
	// the body.
	HTTPStatus int `json:"-"`
}

func (e *Error) Error() string {
	if e.HTTPStatus != 0 {
		return fmt.Sprintf("supervisor: %s (%d): %s", e.Code, e.HTTPStatus, e.Message)
	}
	return fmt.Sprintf("supervisor: %s: %s", e.Code, e.Message)
}

// Is makes errors.Is(err, &Error{Code: c}) match any error with code c.
func (e *Error) Is(target error) bool {
	t, ok := target.(*Error)
	return ok && t.Code == e.Code && t.Message == "" && t.HTTPStatus == 0
}

// Errorf returns an *Error with code and the status that goes with it.
func Errorf(code Code, format string, args ...any) *Error {
	return &Error{Code: code, Message: fmt.Sprintf(format, args...), HTTPStatus: code.HTTPStatus()}
}

// ErrorBody is the JSON body of every error response.
type ErrorBody struct {
	Error *Error `json:"error"`
}
