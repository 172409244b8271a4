package supervisor

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"sync"
	"time"
)

// AuditEntry is one line of the audit log. It says who called what, when,
// for how long and with what outcome, but never with which parameters:
// those hold commands, code and file paths that may carry secrets, so
// only their SHA-256 is kept, which lets a caller that kept its request
// match it to a line.
type AuditEntry struct {
	// Time is when the call arrived.
	Time time.Time `json:"time"`
	// Tool is the call in agent terms: run_command, run_command_stream,
	// python_exec, start_process, list_processes, get_process,
	// kill_process, read_file, write_file, delete_file, stat_file,
	// list_files, flush, pty_session (one line when the session ends),
	// list_tools, describe_tool, and for POST /v1/tools/{name} the
	// tool's name (create_file, edit_file, ...; unknown_tool for a name
	// that is not one).
	Tool string `json:"tool"`
	// ParamsSHA256 is the hex SHA-256 of the JSON body as sent for
	// run_command, run_command_stream, python_exec, start_process and tool
	// invocations, and of "METHOD escaped-path?query" for the others.
	ParamsSHA256 string `json:"params_sha256"`
	DurationMS   int64  `json:"duration_ms"`
	HTTPStatus   int    `json:"http_status"`
	// ExitCode is set when a process ran.
	ExitCode  *int   `json:"exit_code,omitempty"`
	Signal    string `json:"signal,omitempty"`
	TimedOut  bool   `json:"timed_out,omitempty"`
	Truncated bool   `json:"truncated,omitempty"`
	ErrorCode string `json:"error_code,omitempty"`
	// Aborted means the response was cut off after it had started.
	Aborted bool `json:"aborted,omitempty"`
	// Peer is the caller's SPIFFE ID, when it presented a certificate.
	Peer string `json:"peer,omitempty"`
}

// AuditLog appends AuditEntry values to a file as JSON lines.
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
