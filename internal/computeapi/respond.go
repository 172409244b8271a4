package computeapi

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"mime"
	"net/http"

	"github.com/go-logr/logr"

	api "github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"
)

// Reading requests and writing answers, the same for every route.

// decode reads the JSON body of r into into, refusing unknown fields, a
// body over the size bound and anything after the first value.
func (s *Server) decode(w http.ResponseWriter, r *http.Request, into any) *api.Error {
	if ct := r.Header.Get("Content-Type"); ct != "" {
		if mt, _, err := mime.ParseMediaType(ct); err != nil || mt != "application/json" {
			return api.Errorf(api.CodeInvalidArgument, "content type must be application/json, not %q", ct)
		}
	}
	dec := json.NewDecoder(http.MaxBytesReader(w, r.Body, s.maxRequestBytes))
	// Unknown fields are refused so that a misspelt option (say
	// "timeout") fails loudly instead of silently running with defaults.
	dec.DisallowUnknownFields()
	if err := dec.Decode(into); err != nil {
		var tooLarge *http.MaxBytesError
		switch {
		case errors.As(err, &tooLarge):
			return api.Errorf(api.CodePayloadTooLarge, "request body exceeds %d bytes", tooLarge.Limit)
		case errors.Is(err, io.EOF):
			return api.Errorf(api.CodeInvalidArgument, "empty request body")
		default:
			return api.Errorf(api.CodeInvalidArgument, "invalid JSON body: %v", err)
		}
	}
	if dec.More() {
		return api.Errorf(api.CodeInvalidArgument, "invalid JSON body: more than one value")
	}
	return nil
}

// supervisorError turns a failed supervisor call into the API's error.
// Codes describing the request (bad cwd, unknown executable) keep the
// supervisor's message as invalid_argument, so they cannot be confused with
// the API's own not-found and permission errors; failures of the supervisor
// itself become supervisor_unavailable.
func supervisorError(ctx context.Context, err error) *api.Error {
	var se *supervisorapi.Error
	if !errors.As(err, &se) {
		if errors.Is(ctx.Err(), context.DeadlineExceeded) {
			return api.Errorf(api.CodeTimeout, "the sandbox did not answer in time")
		}
		return api.Errorf(api.CodeSupervisorUnavailable, "the sandbox's supervisor could not be reached: %v", err)
	}
	switch se.Code {
	case supervisorapi.CodeInvalidArgument, supervisorapi.CodeNotFound, supervisorapi.CodePermissionDenied,
		supervisorapi.CodeEnvBuildFailed:
		return api.Errorf(api.CodeInvalidArgument, "%s", se.Message)
	case supervisorapi.CodePayloadTooLarge:
		return api.Errorf(api.CodePayloadTooLarge, "%s", se.Message)
	case supervisorapi.CodeResourceExhausted:
		return api.Errorf(api.CodeResourceExhausted, "%s", se.Message)
	case supervisorapi.CodeTimeout:
		return api.Errorf(api.CodeTimeout, "%s", se.Message)
	default:
		return api.Errorf(api.CodeSupervisorUnavailable, "the sandbox's supervisor failed: %s: %s", se.Code, se.Message)
	}
}

// logFailure logs server-side failures as errors and caller mistakes at a
// debug level, so that the error log means something is wrong with the
// platform.
func (s *Server) logFailure(log logr.Logger, apiErr *api.Error, cause error) {
	if apiErr.Status >= 500 {
		if cause == nil {
			cause = apiErr
		}
		log.Error(cause, "call failed", "code", string(apiErr.Code))
		return
	}
	log.V(1).Info("call refused", "code", string(apiErr.Code), "message", apiErr.Message)
}

func writeError(w http.ResponseWriter, e *api.Error) {
	status := e.Status
	if status == 0 {
		status = e.Code.HTTPStatus()
	}
	writeJSON(w, status, api.ErrorBody{Error: e})
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	data, err := json.Marshal(v)
	if err != nil {
		// Only a programming error can get here: every value written is a
		// plain struct.
		status = http.StatusInternalServerError
		data = []byte(`{"error":{"code":"internal","message":"could not encode the response"}}`)
	}
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Cache-Control", "no-store")
	w.WriteHeader(status)
	_, _ = w.Write(append(data, '\n'))
}
