package wire

import (
	"errors"
	"fmt"
)

// Peer is the side of the wire a client calls and whose errors it
// reports: Supervisor or API. It fixes the words the side's errors and
// transport failures start with, so that a log line or a CLI message says
// which side failed, and it keeps the two sides' *Error distinct types.
type Peer interface {
	peer() *peer
}

// peer is what differs between the two sides' clients. Every field keeps a
// message or a step exactly as each client had it before they shared this
// code.
type peer struct {
	// name starts an *Error's message: "agentbox: lease_held (409): ...".
	name string
	// call starts a transport failure's message: "supervisor POST /x: ...".
	call string
	// build is the message of a request that cannot be built.
	build string
	// server names the peer in a refused WebSocket subprotocol.
	server string
	// requestID: the API answers with the call's X-Request-Id, the key to
	// its audit record, which its errors carry.
	requestID bool
	// drainTail: a supervisor's stream ends with a trailer (its audit
	// record), which is read only once the body is read to its end.
	drainTail bool
	// incomplete is the error of a stream that ended without a result.
	incomplete error
}

// Supervisor is the Peer of the sandbox supervisor.
type Supervisor struct{}

// API is the Peer of the Compute API.
type API struct{}

var (
	// ErrSupervisorStreamIncomplete is returned by a supervisor's command
	// stream that ended without an exit event: the connection broke or
	// the supervisor aborted the response.
	ErrSupervisorStreamIncomplete = errors.New("supervisor: command stream ended without a result")
	// ErrAPIStreamIncomplete is returned by the API's command stream that
	// ended without an exit or error event: the connection broke.
	ErrAPIStreamIncomplete = errors.New("agentbox: command stream ended without a result")
)

var (
	supervisorPeer = &peer{name: "supervisor", call: "supervisor ", build: "supervisor request", server: "the server",
		drainTail: true, incomplete: ErrSupervisorStreamIncomplete}
	apiPeer = &peer{name: "agentbox", call: "", build: "build request", server: "the API",
		requestID: true, incomplete: ErrAPIStreamIncomplete}
)

func (Supervisor) peer() *peer { return supervisorPeer }
func (API) peer() *peer        { return apiPeer }

func peerOf[P Peer]() *peer {
	var p P
	return p.peer()
}

// Error is an error a peer reported. Use errors.As to get it from a client
// method's error; transport failures (refused connections, TLS failures,
// cancelled contexts) are returned wrapped as they are, not as *Error.
type Error[P Peer] struct {
	Code    Code   `json:"code"`
	Message string `json:"message"`
	// Details carry machine-readable context for some codes, e.g. "phase"
	// and "reason" for CodeSandboxNotReady. The supervisor sends none.
	Details map[string]string `json:"details,omitempty"`
	// Status is the HTTP status the response carried; it is not sent in
	// the body.
	Status int `json:"-"`
	// RequestID is the call's request ID from the API's X-Request-Id
	// response header: the key to the call's audit record and the API's
	// log lines. Errors of the supervisor have none.
	RequestID string `json:"-"`
}

func (e *Error[P]) Error() string {
	name := peerOf[P]().name
	msg := fmt.Sprintf("%s: %s: %s", name, e.Code, e.Message)
	if e.Status != 0 {
		msg = fmt.Sprintf("%s: %s (%d): %s", name, e.Code, e.Status, e.Message)
	}
	if e.RequestID != "" {
		msg += " (request " + e.RequestID + ")"
	}
	return msg
}

// Is makes errors.Is(err, &Error{Code: c}) match any error with code c.
func (e *Error[P]) Is(target error) bool {
	t, ok := target.(*Error[P])
	return ok && t.Code == e.Code && t.Message == "" && t.Status == 0 && t.Details == nil && t.RequestID == ""
}

// Errorf returns an *Error with code and the status that goes with it.
func Errorf[P Peer](code Code, format string, args ...any) *Error[P] {
	return &Error[P]{Code: code, Message: fmt.Sprintf(format, args...), Status: code.HTTPStatus()}
}

// ErrorBody is the JSON body of every error response:
// {"error": {"code": ..., "message": ...}}.
type ErrorBody[P Peer] struct {
	Error *Error[P] `json:"error"`
}

// CodeOf returns the code of the peer's *Error in err's chain, or "" if
// there is none (a transport failure, for example).
func CodeOf[P Peer](err error) Code {
	var e *Error[P]
	if errors.As(err, &e) {
		return e.Code
	}
	return ""
}
