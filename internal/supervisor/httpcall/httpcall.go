// Package httpcall is what every handler of the supervisor shares about the
// call it serves: the facts the call's log line and audit record are made
// from, and the JSON answers and errors it writes.
package httpcall

import (
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"strings"

	api "github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"
)

// Info is what a handler learns about its call that the log line and the
// audit record report.
type Info struct {
	// Program is the program a command runs: only its name, since its
	// arguments and environment may hold secrets.
	Program string
	// File is the workspace-relative path a file call touched.
	File string
	// Result is how the call's command ended.
	Result *api.CommandResult
	// Err is the error the call answered with.
	Err *api.Error
	// Aborted is set when a streamed response failed after its first
	// byte.
	Aborted error
}

// Abort records that the response was cut off after its first byte.
func (i *Info) Abort(err error) { i.Aborted = err }

// Fail records e and answers with it.
func (i *Info) Fail(w http.ResponseWriter, e *api.Error) {
	i.Err = e
	WriteError(w, e)
}

// SetProgram records the program a command runs, for the log line.
func (i *Info) SetProgram(argv []string) {
	if len(argv) > 0 {
		i.Program = argv[0]
	}
}

// Decode decodes the JSON body, of at most limit bytes, into v, answering
// and recording the error if it cannot.
func (i *Info) Decode(w http.ResponseWriter, r *http.Request, limit int64, v any) bool {
	if e := DecodeJSON(w, r, limit, v); e != nil {
		i.Fail(w, e)
		return false
	}
	return true
}

// DecodeJSON decodes the body, which must be exactly one JSON value of at
// most limit bytes, into v.
func DecodeJSON(w http.ResponseWriter, r *http.Request, limit int64, v any) *api.Error {
	if ct := r.Header.Get("Content-Type"); ct != "" && !strings.HasPrefix(ct, "application/json") {
		return api.Errorf(api.CodeInvalidArgument, "content type must be application/json, not %q", ct)
	}
	dec := json.NewDecoder(http.MaxBytesReader(w, r.Body, limit))
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

// WriteJSON answers status with v as the body.
func WriteJSON(w http.ResponseWriter, status int, v any) {
	h := w.Header()
	h.Set("Content-Type", "application/json")
	h.Set("X-Content-Type-Options", "nosniff")
	h.Set("Cache-Control", "no-store")
	w.WriteHeader(status)
	// The status is already sent; an encoding failure here can only be a
	// client that went away, which there is nobody to tell about.
	_ = json.NewEncoder(w).Encode(v)
}

// WriteError answers with e, at its own status or its code's.
func WriteError(w http.ResponseWriter, e *api.Error) {
	status := e.Status
	if status == 0 {
		status = e.Code.HTTPStatus()
	}
	WriteJSON(w, status, api.ErrorBody{Error: e})
}

// MethodNotAllowed refuses the request's method; allow lists the methods
// the path takes.
func MethodNotAllowed(w http.ResponseWriter, r *http.Request, allow string) {
	w.Header().Set("Allow", allow)
	WriteError(w, api.Errorf(api.CodeMethodNotAllowed, "%s is not allowed on %s (allowed: %s)", r.Method, r.URL.Path, allow))
}
