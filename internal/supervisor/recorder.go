package supervisor

import (
	api "github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"

	"io"
	"net/http"
)

// recorder remembers the status, and, when the call is audited (carry),
// makes room for the record in the response (see api.AuditRecord): a
// response with a body is sent chunked with the record declared as its
// trailer; the header of one without a body (204, 304, HEAD) is held back
// until attach, to carry the record itself.
type recorder struct {
	http.ResponseWriter
	status      int
	wroteHeader bool
	carry, head bool
	// held: the header is held back; trailer: the record is declared as
	// the trailer.
	held, trailer bool
}

func (r *recorder) WriteHeader(code int) {
	if r.wroteHeader {
		if !r.held {
			r.ResponseWriter.WriteHeader(code)
		}
		return
	}
	r.status, r.wroteHeader = code, true
	if r.carry {
		switch {
		case r.head || code == http.StatusNoContent || code == http.StatusNotModified:
			r.held = true
			return
		case code != http.StatusSwitchingProtocols:
			// Without a length the body goes chunked, which a trailer
			// needs.
			h := r.Header()
			h.Del("Content-Length")
			h.Add("Trailer", api.HeaderAudit)
			r.trailer = true
		}
	}
	r.ResponseWriter.WriteHeader(code)
}

func (r *recorder) Write(p []byte) (int, error) {
	if !r.wroteHeader {
		r.WriteHeader(http.StatusOK)
	}
	if r.held {
		if r.head {
			// What a HEAD handler writes is not sent anyway.
			return len(p), nil
		}
		return 0, http.ErrBodyNotAllowed
	}
	return r.ResponseWriter.Write(p)
}

// FlushError is what http.ResponseController.Flush calls: a flush sends
// the header, so it must go through WriteHeader.
func (r *recorder) FlushError() error {
	if !r.wroteHeader {
		r.WriteHeader(http.StatusOK)
	}
	if r.held {
		return nil
	}
	return http.NewResponseController(r.ResponseWriter).Flush()
}

// attach puts the encoded record v into the response: as the declared
// trailer, or in the header held back (or never written), which it then
// sends.
func (r *recorder) attach(v string) {
	switch {
	case r.trailer:
		r.Header().Set(api.HeaderAudit, v)
	case r.held || !r.wroteHeader:
		r.Header().Set(api.HeaderAudit, v)
		r.held = false
		r.wroteHeader = true
		r.ResponseWriter.WriteHeader(r.status)
	}
}

func (r *recorder) Unwrap() http.ResponseWriter { return r.ResponseWriter }

// hashingBody feeds what the handler reads of the body to the parameter
// hash, so the body need not be buffered twice.
type hashingBody struct {
	io.ReadCloser
	w io.Writer
}

func (b *hashingBody) Read(p []byte) (int, error) {
	n, err := b.ReadCloser.Read(p)
	b.w.Write(p[:n])
	return n, err
}
