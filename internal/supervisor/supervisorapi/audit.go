package supervisorapi

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"sync"
	"time"
	"unicode/utf8"
)

// Audit records.
//
// The supervisor makes one AuditRecord per call (health checks excepted)
// and sends it with the call's answer, so that the record leaves the
// sandbox as it is made: code in the sandbox runs as the supervisor's user
// and could rewrite a file the supervisor keeps, but not what has already
// been sent. The control plane appends the records to its hash-chained
// audit log beside its own record of the call.
//
// The record travels as base64 (standard encoding) of its JSON:
//
//   - in the HeaderAudit trailer of a response with a body (the supervisor
//     sends every such response chunked, so that it can carry a trailer);
//   - in the HeaderAudit header of a response that has no body (204, a
//     HEAD request), whose header the supervisor holds back until the
//     record is made;
//   - in a PTYMessageAudit control message, sent after the exit message of
//     a PTY session and before the close.
//
// A response cut off mid-way (the supervisor aborted it, or the caller
// stopped reading) carries no record, nor does a PTY session whose client
// went away first.
const (
	// HeaderAudit carries the supervisor's record of the call.
	HeaderAudit = "Agentbox-Audit-Record"
	// HeaderRequestID is the caller's ID for the call, which the
	// supervisor copies into its record (at most MaxRequestIDBytes of
	// printable ASCII; anything else is left out).
	HeaderRequestID = "X-Request-Id"
	// PTYMessageAudit is the type of the PTY control message whose Audit
	// holds the session's record.
	PTYMessageAudit = "audit"

	MaxRequestIDBytes = 128
	// MaxAuditRecordBytes bounds an encoded record; the control plane
	// ignores a larger one.
	MaxAuditRecordBytes = 8 << 10
)

// AuditRecord is the supervisor's record of one call. It says who called
// what, when, for how long and with what outcome, but never with which
// parameters: those hold commands, code and file paths that may carry
// secrets, so only their SHA-256 is kept, which lets a caller that kept
// its request match it to a record.
type AuditRecord struct {
	// Time is when the call arrived.
	Time time.Time `json:"time"`
	// Tool is the call in agent terms: run_command, run_command_stream,
	// python_exec, start_process, list_processes, get_process,
	// kill_process, read_file, write_file, delete_file, stat_file,
	// list_files, file_manifest, flush, pty_session (one record when the
	// session ends), mcp_call, mcp_status, execute, the environments'
	// calls, list_tools, describe_tool, and for POST /v1/tools/{name} the
	// tool's name (create_file, edit_file, ...; unknown_tool for a name
	// that is not one).
	Tool string `json:"tool"`
	// ParamsSHA256 is the hex SHA-256 of the JSON body as sent for
	// run_command, run_command_stream, python_exec, start_process,
	// execute, create_env, mcp_call and tool invocations, and of
	// "METHOD escaped-path?query" for the others.
	ParamsSHA256 string `json:"params_sha256"`
	DurationMS   int64  `json:"duration_ms"`
	HTTPStatus   int    `json:"http_status"`
	// ExitCode is set when a process ran.
	ExitCode    *int   `json:"exit_code,omitempty"`
	Signal      string `json:"signal,omitempty"`
	TimedOut    bool   `json:"timed_out,omitempty"`
	OutOfMemory bool   `json:"out_of_memory,omitempty"`
	Truncated   bool   `json:"truncated,omitempty"`
	ErrorCode   string `json:"error_code,omitempty"`
	// Aborted means the response was cut off after it had started.
	Aborted bool `json:"aborted,omitempty"`
	// Peer is the caller's SPIFFE ID, when it presented a certificate.
	Peer string `json:"peer,omitempty"`
	// Sandbox is the supervisor's own SPIFFE ID, when it serves TLS.
	Sandbox string `json:"sandbox,omitempty"`
	// RequestID is the caller's HeaderRequestID.
	RequestID string `json:"request_id,omitempty"`
}

// EncodeAuditRecord is the value of HeaderAudit (and of a PTY audit
// message) for r.
func EncodeAuditRecord(r AuditRecord) (string, error) {
	b, err := json.Marshal(r)
	if err != nil {
		return "", fmt.Errorf("encode audit record: %w", err)
	}
	return base64.StdEncoding.EncodeToString(b), nil
}

// DecodeAuditRecord reads an encoded record and returns it with its JSON,
// as the supervisor wrote it. The JSON is UTF-8: a record is untrusted
// input, and is refused otherwise.
func DecodeAuditRecord(v string) (AuditRecord, []byte, error) {
	if len(v) > MaxAuditRecordBytes {
		return AuditRecord{}, nil, fmt.Errorf("audit record of %d bytes, more than %d", len(v), MaxAuditRecordBytes)
	}
	raw, err := base64.StdEncoding.DecodeString(v)
	if err != nil {
		return AuditRecord{}, nil, fmt.Errorf("audit record: %w", err)
	}
	if !utf8.Valid(raw) {
		return AuditRecord{}, nil, errors.New("audit record: not UTF-8")
	}
	var r AuditRecord
	if err := json.Unmarshal(raw, &r); err != nil {
		return AuditRecord{}, nil, fmt.Errorf("audit record: %w", err)
	}
	return r, raw, nil
}

// AuditTransport is an http.RoundTripper for calls to supervisors that
// hands each record the supervisor returns to Record, and sends the
// caller's request ID along.
type AuditTransport struct {
	// Base makes the calls; nil means http.DefaultTransport.
	Base http.RoundTripper
	// Record gets each record with the request it answers (its context is
	// the caller's): at once for a response without a body, when the body
	// has been read to its end otherwise. A body closed before its end
	// has no record. Records that cannot be read go to Invalid, if set.
	Record  func(req *http.Request, rec AuditRecord, raw []byte)
	Invalid func(req *http.Request, err error)
	// RequestID, if set, gives the request ID to send for the call whose
	// context is ctx, or "".
	RequestID func(ctx context.Context) string
}

// RoundTrip implements http.RoundTripper.
func (t *AuditTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	if t.RequestID != nil {
		if id := t.RequestID(req.Context()); id != "" && req.Header.Get(HeaderRequestID) == "" {
			req = req.Clone(req.Context())
			req.Header.Set(HeaderRequestID, id)
		}
	}
	base := t.Base
	if base == nil {
		base = http.DefaultTransport
	}
	resp, err := base.RoundTrip(req)
	if err != nil || t.Record == nil {
		return resp, err
	}
	if resp.StatusCode == http.StatusSwitchingProtocols {
		// The body is the upgraded connection (a PTY session): its record
		// comes as a message on it.
		return resp, nil
	}
	if v := resp.Header.Get(HeaderAudit); v != "" {
		t.deliver(req, v)
		return resp, nil
	}
	if resp.Body == nil || resp.Body == http.NoBody {
		return resp, nil
	}
	resp.Body = &auditBody{ReadCloser: resp.Body, done: func() {
		if v := resp.Trailer.Get(HeaderAudit); v != "" {
			t.deliver(req, v)
		}
	}}
	return resp, nil
}

// CloseIdleConnections closes the base transport's idle connections.
func (t *AuditTransport) CloseIdleConnections() {
	if c, ok := t.Base.(interface{ CloseIdleConnections() }); ok {
		c.CloseIdleConnections()
	}
}

func (t *AuditTransport) deliver(req *http.Request, v string) {
	rec, raw, err := DecodeAuditRecord(v)
	if err != nil {
		if t.Invalid != nil {
			t.Invalid(req, err)
		}
		return
	}
	t.Record(req, rec, raw)
}

// auditBody calls done once, when the body has been read to its end: the
// trailer is known only then.
type auditBody struct {
	io.ReadCloser
	once sync.Once
	done func()
}

func (b *auditBody) Read(p []byte) (int, error) {
	n, err := b.ReadCloser.Read(p)
	if err == io.EOF {
		b.once.Do(b.done)
	}
	return n, err
}
