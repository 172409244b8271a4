package supervisor

import (
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"hash"
	"io"
	"net/http"
	"os"
	"sync"
	"time"

	"github.com/agentbox/terraform-provider-agentbox/internal/pki"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/httpcall"
	api "github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"
)

// AuditEntry is one record of a call: the one the supervisor sends with
// the call's answer (see api.AuditRecord), and a line of the optional
// AuditLog.
type AuditEntry = api.AuditRecord

// AuditLog appends AuditEntry values to a file as JSON lines. It is a
// debugging aid, off in sandbox pods: a file in the sandbox can be
// rewritten by the code the supervisor runs, which runs as the same user.
// The record that counts is the one each answer carries to the control
// plane.
//
// Each line is written with a single write(2) on a file opened with
// O_APPEND, under a mutex: the mutex keeps this process's lines whole and
// in order, and O_APPEND makes the kernel place each write at the end even
// if another process appends too. Nothing is buffered in the process, so
// a supervisor that is killed outright loses no line it had recorded and
// leaves no partial one.
type AuditLog struct {
	mu sync.Mutex
	f  *os.File
}

// ErrAuditLogClosed is returned by Record after Close.
var ErrAuditLogClosed = errors.New("audit log is closed")

// OpenAuditLog opens path for appending, creating it readable by its owner
// only.
func OpenAuditLog(path string) (*AuditLog, error) {
	f, err := os.OpenFile(path, os.O_RDWR|os.O_APPEND|os.O_CREATE, 0o600)
	if err != nil {
		return nil, fmt.Errorf("audit log: %w", err)
	}
	// A previous writer that died mid-line (a full disk, say) would
	// otherwise glue its fragment to our first line and spoil both.
	if st, err := f.Stat(); err == nil && st.Size() > 0 {
		last := make([]byte, 1)
		if _, err := f.ReadAt(last, st.Size()-1); err != nil && err != io.EOF {
			f.Close()
			return nil, fmt.Errorf("audit log: %w", err)
		}
		if last[0] != '\n' {
			if _, err := f.Write([]byte{'\n'}); err != nil {
				f.Close()
				return nil, fmt.Errorf("audit log: %w", err)
			}
		}
	}
	return &AuditLog{f: f}, nil
}

// Record appends e as one line.
func (a *AuditLog) Record(e AuditEntry) error {
	line, err := json.Marshal(e)
	if err != nil {
		return fmt.Errorf("audit log: %w", err)
	}
	line = append(line, '\n')
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.f == nil {
		return ErrAuditLogClosed
	}
	if _, err := a.f.Write(line); err != nil {
		return fmt.Errorf("audit log: %w", err)
	}
	return nil
}

// Close syncs the file to its storage and closes it. Later Records fail
// with ErrAuditLogClosed; closing twice is harmless.
func (a *AuditLog) Close() error {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.f == nil {
		return nil
	}
	f := a.f
	a.f = nil
	syncErr := f.Sync()
	if err := f.Close(); err != nil {
		return fmt.Errorf("audit log: %w", err)
	}
	if syncErr != nil {
		return fmt.Errorf("audit log: %w", syncErr)
	}
	return nil
}

// requestInfo is what is known about a call, for its log line and
// record.
type requestInfo struct {
	httpcall.Info
	// op is the call's name in its record (see route).
	op string
	// record makes the call's audit record from what is known when it is
	// first called, and returns that one from then on: a PTY session
	// makes it before its close, to send it, and ServeHTTP after the
	// handler.
	record func() *AuditEntry
	made   *AuditEntry
}

// auditRecord is the record of a call that answered status.
func (s *Server) auditRecord(r *http.Request, start time.Time, status int, info *requestInfo, params hash.Hash) *AuditEntry {
	e := &AuditEntry{
		Time:         start.UTC(),
		Tool:         info.op,
		ParamsSHA256: hex.EncodeToString(params.Sum(nil)),
		DurationMS:   time.Since(start).Milliseconds(),
		HTTPStatus:   status,
		Peer:         peerID(r),
		Sandbox:      s.cfg.Identity,
		RequestID:    requestID(r),
	}
	if res := info.Result; res != nil {
		e.ExitCode = &res.ExitCode
		e.Signal, e.TimedOut, e.OutOfMemory, e.Truncated = res.Signal, res.TimedOut, res.OutOfMemory, res.Truncated
	}
	if info.Err != nil {
		e.ErrorCode = string(info.Err.Code)
	}
	if info.Aborted != nil {
		e.Aborted = true
	}
	return e
}

// requestID is the caller's request ID, if it is one a record can hold:
// short printable ASCII.
func requestID(r *http.Request) string {
	id := r.Header.Get(api.HeaderRequestID)
	if len(id) > api.MaxRequestIDBytes {
		return ""
	}
	for i := 0; i < len(id); i++ {
		if id[i] < 0x21 || id[i] > 0x7e {
			return ""
		}
	}
	return id
}

func peerID(r *http.Request) string {
	if r.TLS == nil || len(r.TLS.PeerCertificates) == 0 {
		return ""
	}
	id, err := pki.IDFromCert(r.TLS.PeerCertificates[0])
	if err != nil {
		return ""
	}
	return id.String()
}
