package client

import (
	"errors"
	"time"

	"github.com/agentbox/terraform-provider-agentbox/internal/wire"
)

// Code classifies an error; wire documents each, and Code.HTTPStatus is
// the status the API sends with it. Callers branch on it, never on the
// message.
type Code = wire.Code

// The codes the API sends, by what they concern.
const (
	// The caller and its request.
	CodeUnauthenticated  = wire.CodeUnauthenticated
	CodePermissionDenied = wire.CodePermissionDenied
	CodeInvalidArgument  = wire.CodeInvalidArgument
	CodeNotFound         = wire.CodeNotFound
	CodeMethodNotAllowed = wire.CodeMethodNotAllowed
	CodePayloadTooLarge  = wire.CodePayloadTooLarge

	// The agent's sandbox and its supervisor.
	CodeSandboxNotFound       = wire.CodeSandboxNotFound
	CodeSandboxNotReady       = wire.CodeSandboxNotReady
	CodeSupervisorUnavailable = wire.CodeSupervisorUnavailable
	CodeResourceExhausted     = wire.CodeResourceExhausted
	CodeTimeout               = wire.CodeTimeout

	// Holds (the agent's lease) and pool leases.
	CodeLeaseHeld     = wire.CodeLeaseHeld
	CodeLeaseNotHeld  = wire.CodeLeaseNotHeld
	CodeLeaseExpired  = wire.CodeLeaseExpired
	CodePoolNotFound  = wire.CodePoolNotFound
	CodePoolExhausted = wire.CodePoolExhausted

	// Workspace files and the staff console.
	CodeFileNotFound   = wire.CodeFileNotFound
	CodeEnvNotFound    = wire.CodeEnvNotFound
	CodeEnvBuildFailed = wire.CodeEnvBuildFailed
	CodeWorkspaceFull  = wire.CodeWorkspaceFull
	CodeConsoleExpired = wire.CodeConsoleExpired

	// The user token a call passes on (HeaderUserToken).
	CodeInvalidUserToken = wire.CodeInvalidUserToken

	// The control plane itself, and what the client could not read.
	CodeInternal    = wire.CodeInternal
	CodeUnavailable = wire.CodeUnavailable
	CodeUnknown     = wire.CodeUnknown
)

// Error is an error the API reported. Use errors.As to get it from a Client
// method's error; transport failures (refused connections, TLS failures,
// cancelled contexts) are returned wrapped as they are, not as *Error. Its
// Status and RequestID are the response's, not sent in the body.
type Error = wire.Error[wire.API]

// Errorf returns an *Error with code and the status that goes with it. It
// is a function rather than a variable so that vet checks its format.
func Errorf(code Code, format string, args ...any) *Error {
	return wire.Errorf[wire.API](code, format, args...)
}

// CodeOf returns the code of the API's *Error in err's chain, or "" if
// there is none (a transport failure, for example).
func CodeOf(err error) Code { return wire.CodeOf[wire.API](err) }

// Typed lease errors, for errors.Is. They match on the code alone.
var (
	ErrLeaseHeld    error = &Error{Code: CodeLeaseHeld}
	ErrLeaseNotHeld error = &Error{Code: CodeLeaseNotHeld}
	ErrLeaseExpired error = &Error{Code: CodeLeaseExpired}
)

// LeaseHeldBy returns who holds the lease and until when, if err is a
// CodeLeaseHeld error.
func LeaseHeldBy(err error) (holder string, expiresAt time.Time, ok bool) {
	var e *Error
	if !errors.As(err, &e) || e.Code != CodeLeaseHeld {
		return "", time.Time{}, false
	}
	expiresAt, _ = time.Parse(time.RFC3339Nano, e.Details["expires_at"])
	return e.Details["holder"], expiresAt, true
}

// ErrorBody is the JSON body of every error response.
type ErrorBody = wire.ErrorBody[wire.API]
