package supervisorapi

import "github.com/agentbox/terraform-provider-agentbox/internal/wire"

// Code classifies an error; wire documents each. Callers branch on it,
// never on the message.
type Code = wire.Code

// The codes the supervisor sends, by what they concern.
const (
	// A request it cannot serve.
	CodeInvalidArgument  = wire.CodeInvalidArgument
	CodeMethodNotAllowed = wire.CodeMethodNotAllowed
	CodePayloadTooLarge  = wire.CodePayloadTooLarge

	// Workspace paths and files.
	CodeNotFound             = wire.CodeNotFound
	CodePermissionDenied     = wire.CodePermissionDenied
	CodePathEscapesWorkspace = wire.CodePathEscapesWorkspace
	CodeIsADirectory         = wire.CodeIsADirectory
	CodeNotADirectory        = wire.CodeNotADirectory
	CodeWorkspaceFull        = wire.CodeWorkspaceFull

	// Commands, processes and Python environments.
	CodeResourceExhausted = wire.CodeResourceExhausted
	CodeTimeout           = wire.CodeTimeout
	CodeEnvBuildFailed    = wire.CodeEnvBuildFailed

	// The supervisor itself, and what its client could not read.
	CodeInternal    = wire.CodeInternal
	CodeUnavailable = wire.CodeUnavailable
	CodeUnknown     = wire.CodeUnknown
)

// Error is an error the supervisor reported. Use errors.As to get it from
// a Client method's error; transport failures (refused connections, TLS
// failures, cancelled contexts) are returned as they are, not as *Error.
// Its Status is the HTTP status the response carried.
type Error = wire.Error[wire.Supervisor]

// ErrorBody is the JSON body of every error response.
type ErrorBody = wire.ErrorBody[wire.Supervisor]

// Errorf returns an *Error with code and the status that goes with it. It
// is a function rather than a variable so that vet checks its format.
func Errorf(code Code, format string, args ...any) *Error {
	return wire.Errorf[wire.Supervisor](code, format, args...)
}

// CodeOf returns the code of the supervisor's *Error in err's chain, or "" if
// there is none (a transport failure, for example).
func CodeOf(err error) Code { return wire.CodeOf[wire.Supervisor](err) }
