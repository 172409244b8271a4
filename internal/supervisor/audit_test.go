package supervisor

import (
	"bufio"
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/coder/websocket"

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
	s := newServer(t, Config{})
	toolName := func(r *http.Request) string {
		_, m := s.match(r)
		return m.name(r)
	}
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

// Every answer carries the supervisor's record of its call, however the
// answer is sent: a JSON result, a stream, a file, a HEAD or 204 answer
// without a body, an error, a PTY session; the client side
// (api.AuditTransport) hands each one over with the request it answers.
// The records are those the optional local log gets, and carry the
// caller's request ID. Health checks carry none.
func TestAuditRecordTravelsWithTheAnswer(t *testing.T) {
	ws := t.TempDir()
	path := filepath.Join(t.TempDir(), "audit.jsonl")
	local, err := OpenAuditLog(path)
	if err != nil {
		t.Fatal(err)
	}
	s := newServer(t, Config{Workspace: ws, DefaultCwd: ws, Audit: local, Identity: "spiffe://td/ns/a/sandbox/sb"})
	srv := httptest.NewServer(s)
	defer srv.Close()

	type got struct {
		path string
		rec  api.AuditRecord
		raw  []byte
	}
	var mu sync.Mutex
	var records []got
	var invalid []error
	tr := &api.AuditTransport{
		Base: srv.Client().Transport,
		Record: func(req *http.Request, rec api.AuditRecord, raw []byte) {
			mu.Lock()
			defer mu.Unlock()
			records = append(records, got{req.URL.Path, rec, raw})
		},
		Invalid:   func(_ *http.Request, err error) { invalid = append(invalid, err) },
		RequestID: func(ctx context.Context) string { id, _ := ctx.Value(reqIDKey{}).(string); return id },
	}
	c := api.NewClient(srv.URL, &http.Client{Transport: tr})
	ctx := context.WithValue(t.Context(), reqIDKey{}, "req-42")
	last := func(t *testing.T, path string) api.AuditRecord {
		t.Helper()
		mu.Lock()
		defer mu.Unlock()
		if len(records) == 0 || records[len(records)-1].path != path {
			t.Fatalf("no record for %s (have %+v, invalid %v)", path, records, invalid)
		}
		return records[len(records)-1].rec
	}

	res, err := c.RunCommand(ctx, api.CommandRequest{Command: []string{"sh", "-c", "exit 3"}})
	if err != nil || res.ExitCode != 3 {
		t.Fatalf("run: %+v %v", res, err)
	}
	if r := last(t, api.PathCommands); r.Tool != "run_command" || r.ExitCode == nil || *r.ExitCode != 3 || r.HTTPStatus != 200 ||
		r.RequestID != "req-42" || r.Sandbox != "spiffe://td/ns/a/sandbox/sb" {
		t.Errorf("run_command record %+v", r)
	}
	if _, err := c.RunCommandStream(ctx, api.CommandRequest{Command: []string{"echo", "streamed"}}, func(api.CommandEvent) error { return nil }); err != nil {
		t.Fatal(err)
	}
	if r := last(t, api.PathCommandsStream); r.Tool != "run_command_stream" || r.ExitCode == nil || *r.ExitCode != 0 {
		t.Errorf("stream record %+v", r)
	}
	if _, err := c.PutFile(ctx, "f.txt", strings.NewReader("data"), 0); err != nil {
		t.Fatal(err)
	}
	if r := last(t, api.PathFiles+"f.txt"); r.Tool != "write_file" {
		t.Errorf("put record %+v", r)
	}
	body, err := c.GetFile(ctx, "f.txt")
	if err != nil {
		t.Fatal(err)
	}
	if b, _ := io.ReadAll(body); string(b) != "data" {
		t.Fatalf("get: %q", b)
	}
	body.Close()
	if r := last(t, api.PathFiles+"f.txt"); r.Tool != "read_file" || r.HTTPStatus != 200 {
		t.Errorf("get record %+v", r)
	}
	head, err := http.NewRequestWithContext(ctx, http.MethodHead, srv.URL+api.PathFiles+"f.txt", nil)
	if err != nil {
		t.Fatal(err)
	}
	resp, err := (&http.Client{Transport: tr}).Do(head)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if r := last(t, api.PathFiles+"f.txt"); r.Tool != "read_file" || r.HTTPStatus != 200 || resp.Header.Get(api.HeaderAudit) == "" {
		t.Errorf("HEAD record %+v (header %q)", r, resp.Header.Get(api.HeaderAudit))
	}
	if err := c.Delete(ctx, "f.txt", false); err != nil {
		t.Fatal(err)
	}
	if r := last(t, api.PathFiles+"f.txt"); r.Tool != "delete_file" || r.HTTPStatus != http.StatusNoContent {
		t.Errorf("delete record %+v", r)
	}
	if err := c.Flush(ctx); err != nil {
		t.Fatal(err)
	}
	if r := last(t, api.PathFlush); r.Tool != "flush" || r.HTTPStatus != http.StatusNoContent {
		t.Errorf("flush record %+v", r)
	}
	if _, err := c.GetFile(ctx, "missing"); api.CodeOf(err) != api.CodeNotFound {
		t.Fatalf("get missing: %v", err)
	}
	if r := last(t, api.PathFiles+"missing"); r.ErrorCode != string(api.CodeNotFound) || r.HTTPStatus != http.StatusNotFound {
		t.Errorf("error record %+v", r)
	}

	// A PTY session: its record follows the exit message on the
	// connection, before the close.
	conn, err := c.DialPTY(ctx, api.PTYRequest{Command: []string{"sh", "-c", "exit 5"}})
	if err != nil {
		t.Fatal(err)
	}
	var exit *api.PTYExit
	var sess *api.AuditRecord
	for {
		typ, data, err := conn.Read(ctx)
		if err != nil {
			break
		}
		if typ != websocket.MessageText {
			continue
		}
		var m api.PTYMessage
		if err := json.Unmarshal(data, &m); err != nil {
			t.Fatal(err)
		}
		switch m.Type {
		case api.PTYMessageExit:
			exit = m.Exit
		case api.PTYMessageAudit:
			if exit == nil {
				t.Error("the audit message came before the exit message")
			}
			r, _, err := api.DecodeAuditRecord(m.Audit)
			if err != nil {
				t.Fatal(err)
			}
			sess = &r
		}
	}
	if sess == nil || sess.Tool != "pty_session" || sess.ExitCode == nil || *sess.ExitCode != 5 || sess.HTTPStatus != http.StatusSwitchingProtocols || sess.RequestID != "req-42" {
		t.Errorf("PTY session record %+v after exit %+v", sess, exit)
	}

	// Health checks carry nothing.
	n := len(records)
	if _, err := c.Health(ctx); err != nil {
		t.Fatal(err)
	}
	if len(records) != n {
		t.Errorf("a health check carried a record: %+v", records[n:])
	}

	// What travelled is what the local log holds, byte for byte.
	if err := s.Wait(ctx); err != nil {
		t.Fatal(err)
	}
	if err := local.Close(); err != nil {
		t.Fatal(err)
	}
	lines := readAuditLines(t, path)
	if len(lines) != len(records)+1 {
		t.Fatalf("%d local lines, %d records sent (+1 PTY session)", len(lines), len(records))
	}
	data, _ := os.ReadFile(path)
	for _, r := range records {
		if !bytes.Contains(data, append(r.raw, '\n')) {
			t.Errorf("record %s is not a line of the local log", r.raw)
		}
	}
	if len(invalid) > 0 {
		t.Errorf("records that could not be read: %v", invalid)
	}
}

type reqIDKey struct{}

// The record says when the memory guard killed the command.
func TestAuditRecordOutOfMemory(t *testing.T) {
	s := newServer(t, Config{MemoryLimit: 256 << 20, MemoryReserve: 56 << 20, MemoryInUse: func() (int64, error) { return 250 << 20, nil }})
	t.Cleanup(func() { s.Close() })
	req := httptest.NewRequest(http.MethodPost, api.PathCommands, strings.NewReader(`{"command":["sleep","30"]}`))
	rec := httptest.NewRecorder()
	s.ServeHTTP(rec, req)
	r, _, err := api.DecodeAuditRecord(rec.Result().Trailer.Get(api.HeaderAudit))
	if err != nil {
		t.Fatalf("trailer %v: %v", rec.Result().Trailer, err)
	}
	if !r.OutOfMemory || r.Signal != "SIGKILL" {
		t.Errorf("record %+v, want out_of_memory with SIGKILL", r)
	}
}
