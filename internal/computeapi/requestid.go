package computeapi

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"net/http"

	"github.com/go-logr/logr"

	"github.com/agentbox/terraform-provider-agentbox/internal/computeapi/supervisors"
)

// HeaderRequestID carries a call's request ID. A client may set it (to
// follow its own IDs through the API's logs and audit); the API checks it
// and otherwise makes one, answers it in the same header, and puts it on
// every log line and the audit record of the call.
const HeaderRequestID = "X-Request-Id"

// maxRequestIDLength bounds a client's request ID, which goes into logs
// and the audit log.
const maxRequestIDLength = 128

// withRequestID gives r its request ID, the client's if it is usable, and
// sets it on the response.
func withRequestID(w http.ResponseWriter, r *http.Request) (*http.Request, string) {
	id := r.Header.Get(HeaderRequestID)
	if !validRequestID(id) {
		var b [12]byte
		_, _ = rand.Read(b[:])
		id = hex.EncodeToString(b[:])
	}
	w.Header().Set(HeaderRequestID, id)
	return r.WithContext(supervisors.WithRequestID(r.Context(), id)), id
}

// validRequestID accepts printable ASCII without spaces, so that an ID can
// neither break a log line nor smuggle in a field.
func validRequestID(id string) bool {
	if id == "" || len(id) > maxRequestIDLength {
		return false
	}
	for i := 0; i < len(id); i++ {
		if c := id[i]; c <= ' ' || c > '~' || c == '"' || c == '\\' {
			return false
		}
	}
	return true
}

// callLog is the server's logger with the call's request ID and operation.
func (s *Server) callLog(r *http.Request, op string) logr.Logger {
	log := s.log.WithValues("op", op)
	if id := requestID(r.Context()); id != "" {
		log = log.WithValues("request_id", id)
	}
	return log
}

// requestID is the request ID of the call ctx serves. It is kept in the
// context where the supervisor pool's transport finds it, to send it on
// to the supervisor (supervisors.WithRequestID).
func requestID(ctx context.Context) string { return supervisors.RequestID(ctx) }
