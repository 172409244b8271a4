package supervisor

import (
	"bufio"
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	api "github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"
)

func readAuditLines(t *testing.T, path string) []AuditEntry {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if len(data) > 0 && data[len(data)-1] != '\n' {
		t.Fatalf("audit log does not end with a newline: %q", data[max(0, len(data)-80):])
	}
	var out []AuditEntry
	sc := bufio.NewScanner(bytes.NewReader(data))
	sc.Buffer(nil, 1<<20)
	for sc.Scan() {
		var e AuditEntry
		dec := json.NewDecoder(bytes.NewReader(sc.Bytes()))
		dec.DisallowUnknownFields()
		if err := dec.Decode(&e); err != nil {
			t.Fatalf("audit line %d is not one entry: %v: %.200q", len(out)+1, err, sc.Text())
		}
		out = append(out, e)
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	return out
}

// Many goroutines, and two logs open on the same file as two processes
// would have, write large lines at once; every line comes out whole.
func TestAuditLogConcurrentWriters(t *testing.T) {
	path := filepath.Join(t.TempDir(), "audit.jsonl")
	logs := make([]*AuditLog, 2)
	for i := range logs {
		a, err := OpenAuditLog(path)
		if err != nil {
			t.Fatal(err)
		}
		logs[i] = a
	}
	const writers, perWriter = 32, 50
	var wg sync.WaitGroup
	for w := 0; w < writers; w++ {
		wg.Add(1)
		go func(w int) {
			defer wg.Done()
			// Lines of tens of KiB take more than one pipe or page worth
			// of bytes, so interleaving would show.
			pad := strings.Repeat(string(rune('a'+w%26)), 1000*(1+w%40))
			for i := 0; i < perWriter; i++ {
				if err := logs[w%2].Record(AuditEntry{Time: time.Now(), Tool: "run_command", ErrorCode: pad, DurationMS: int64(i)}); err != nil {
					t.Error(err)
					return
				}
			}
		}(w)
	}
	wg.Wait()
	for _, a := range logs {
		if err := a.Close(); err != nil {
			t.Fatal(err)
		}
	}
	lines := readAuditLines(t, path)
	if len(lines) != writers*perWriter {
		t.Fatalf("%d lines, want %d", len(lines), writers*perWriter)
	}
	for i, e := range lines {
		if e.ErrorCode == "" || strings.Trim(e.ErrorCode, e.ErrorCode[:1]) != "" {
			t.Fatalf("line %d mixes writers", i+1)
		}
	}
	info, err := os.Stat(path)
	if err != nil || info.Mode().Perm() != 0o600 {
		t.Errorf("audit log mode %v, %v; want 0600", info.Mode(), err)
	}
}

func TestAuditLogClose(t *testing.T) {
	path := filepath.Join(t.TempDir(), "audit.jsonl")
	// A fragment left by an earlier writer stays on its own line.
	if err := os.WriteFile(path, []byte(`{"tool":"run_comm`), 0o600); err != nil {
		t.Fatal(err)
	}
	a, err := OpenAuditLog(path)
	if err != nil {
		t.Fatal(err)
	}
	if err := a.Record(AuditEntry{Tool: "flush"}); err != nil {
		t.Fatal(err)
	}
	if err := a.Close(); err != nil {
		t.Fatal(err)
	}
	if err := a.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
	if err := a.Record(AuditEntry{Tool: "flush"}); !errors.Is(err, ErrAuditLogClosed) {
		t.Fatalf("Record after Close: %v", err)
	}
	data, _ := os.ReadFile(path)
	lines := strings.Split(strings.TrimSuffix(string(data), "\n"), "\n")
	if len(lines) != 2 || !strings.HasPrefix(lines[1], `{"time":`) || !strings.Contains(lines[1], `"tool":"flush"`) {
		t.Fatalf("audit log after a fragment:\n%s", data)
	}
	if _, err := OpenAuditLog(filepath.Join(t.TempDir(), "missing", "audit.jsonl")); err == nil {
		t.Fatal("opened an audit log in a missing directory")
	}
}

// The server writes one line per call with a hash of the parameters and
// nothing of the parameters themselves.
func TestAuditLogServer(t *testing.T) {
	path := filepath.Join(t.TempDir(), "audit.jsonl")
	audit, err := OpenAuditLog(path)
	if err != nil {
		t.Fatal(err)
	}
	ws := t.TempDir()
	s := newServer(t, Config{Workspace: ws, DefaultCwd: ws, Audit: audit})

	const secret = "ghp_abcdefghijklmnopqrstuvwxyz0123456789"
	body := `{"command":["sh","-c","echo ` + secret + `; exit 3"]}`
	req := httptest.NewRequest(http.MethodPost, api.PathCommands, strings.NewReader(body))
	s.ServeHTTP(httptest.NewRecorder(), req)
	_, _, e := post(t, s, `{"command":`)
	if e == nil {
		t.Fatal("a truncated body was accepted")
	}
	rec := httptest.NewRecorder()
	s.ServeHTTP(rec, httptest.NewRequest(http.MethodPut, api.PathFiles+"notes/"+secret+".txt?mode=0600", strings.NewReader("data")))
	if rec.Code != http.StatusOK {
		t.Fatalf("put: %d %s", rec.Code, rec.Body)
	}
	s.ServeHTTP(httptest.NewRecorder(), httptest.NewRequest(http.MethodGet, api.PathHealth, nil))
	if err := s.Wait(t.Context()); err != nil {
		t.Fatal(err)
	}
	if err := audit.Close(); err != nil {
		t.Fatal(err)
	}

	data, _ := os.ReadFile(path)
	if strings.Contains(string(data), secret) || strings.Contains(string(data), "echo") {
		t.Fatalf("the audit log holds parameters:\n%s", data)
	}
	lines := readAuditLines(t, path)
	if len(lines) != 3 {
		t.Fatalf("%d audit lines, want 3 (health checks are not audited):\n%s", len(lines), data)
	}
	sum := func(s string) string { h := sha256.Sum256([]byte(s)); return hex.EncodeToString(h[:]) }
	run := lines[0]
	if run.Tool != "run_command" || run.HTTPStatus != 200 || run.ExitCode == nil || *run.ExitCode != 3 || run.ParamsSHA256 != sum(body) ||
		run.Time.IsZero() || run.DurationMS < 0 {
		t.Errorf("command line: %+v", run)
	}
	if bad := lines[1]; bad.Tool != "run_command" || bad.HTTPStatus != 400 || bad.ErrorCode != string(api.CodeInvalidArgument) ||
		bad.ExitCode != nil || bad.ParamsSHA256 != sum(`{"command":`) {
		t.Errorf("invalid request line: %+v", bad)
	}
	if put := lines[2]; put.Tool != "write_file" || put.HTTPStatus != 200 || put.ParamsSHA256 != sum("PUT /v1/files/notes/"+secret+".txt?mode=0600") {
		t.Errorf("file line: %+v", put)
	}
}

func TestToolNames(t *testing.T) {
	for _, c := range []struct{ method, path, want string }{
		{"POST", api.PathCommands, "run_command"},
		{"POST", api.PathPython, "python_exec"},
		{"POST", api.PathFlush, "flush"},
		{"GET", api.PathFiles + "a", "read_file"},
		{"HEAD", api.PathFiles + "a", "read_file"},
		{"PUT", api.PathFiles + "a", "write_file"},
		{"DELETE", api.PathFiles + "a", "delete_file"},
		{"GET", api.PathManifest + "src", "file_manifest"},
		{"PATCH", api.PathFiles + "a", "unknown"},
		{"GET", api.PathStat + "a", "stat_file"},
		{"GET", api.PathList + ".", "list_files"},
		{"GET", "/nope", "unknown"},
	} {
		if got := toolName(httptest.NewRequest(c.method, c.path, nil)); got != c.want {
			t.Errorf("%s %s: %q, want %q", c.method, c.path, got, c.want)
		}
	}
}
