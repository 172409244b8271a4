package supervisor

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"errors"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	sjsonschema "github.com/santhosh-tekuri/jsonschema/v6"

	api "github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"
)

// call invokes a tool through the client and decodes its output into out.
func call(t *testing.T, c *api.Client, name string, in any, out any) *api.Error {
	t.Helper()
	raw, err := c.CallTool(context.Background(), name, in)
	if err != nil {
		var e *api.Error
		if !errors.As(err, &e) {
			t.Fatalf("%s: transport failure %v", name, err)
		}
		return e
	}
	if out != nil {
		dec := json.NewDecoder(bytes.NewReader(raw))
		dec.DisallowUnknownFields()
		if err := dec.Decode(out); err != nil {
			t.Fatalf("%s output %s: %v", name, raw, err)
		}
	}
	return nil
}

func mustCall(t *testing.T, c *api.Client, name string, in any, out any) {
	t.Helper()
	if e := call(t, c, name, in, out); e != nil {
		t.Fatalf("%s(%+v): %v", name, in, e)
	}
}

func TestToolsFiles(t *testing.T) {
	f := newFileServer(t, Config{})
	c := f.client

	var fi api.FileInfo
	mustCall(t, c, api.ToolCreateFile, api.CreateFileInput{Path: "src/main.py", Content: "print('hello')\nprint('hello')\n", Mode: "0755"}, &fi)
	if fi.Path != "src/main.py" || fi.Size != 30 || fi.Mode != "0755" {
		t.Fatalf("create_file = %+v", fi)
	}
	if data, err := os.ReadFile(filepath.Join(f.ws, "src", "main.py")); err != nil || string(data) != "print('hello')\nprint('hello')\n" {
		t.Fatalf("on disk: %q, %v", data, err)
	}
	bin := []byte{0, 1, 2, 0xff, 0xfe}
	mustCall(t, c, api.ToolCreateFile, api.CreateFileInput{Path: "bin/blob", Content: base64.StdEncoding.EncodeToString(bin), Encoding: api.EncodingBase64}, &fi)
	if data, _ := os.ReadFile(filepath.Join(f.ws, "bin", "blob")); !bytes.Equal(data, bin) || fi.Mode != "0644" {
		t.Fatalf("binary create_file: %q, %+v", data, fi)
	}

	var rd api.ReadFileOutput
	mustCall(t, c, api.ToolReadFile, api.ReadFileInput{Path: "src/main.py"}, &rd)
	if rd.Content != "print('hello')\nprint('hello')\n" || rd.Encoding != api.EncodingUTF8 || rd.Truncated || rd.Size != 30 {
		t.Fatalf("read_file = %+v", rd)
	}
	mustCall(t, c, api.ToolReadFile, api.ReadFileInput{Path: "bin/blob"}, &rd)
	if got, _ := base64.StdEncoding.DecodeString(rd.Content); rd.Encoding != api.EncodingBase64 || !bytes.Equal(got, bin) {
		t.Fatalf("read_file of binary = %+v", rd)
	}
	// In parts; a character is never cut in two.
	mustCall(t, c, api.ToolCreateFile, api.CreateFileInput{Path: "utf8.txt", Content: "aé€b"}, nil)
	var parts []string
	for off := int64(0); ; {
		mustCall(t, c, api.ToolReadFile, api.ReadFileInput{Path: "utf8.txt", Offset: off, MaxBytes: 4}, &rd)
		if rd.Encoding != api.EncodingUTF8 {
			t.Fatalf("part at %d: %+v", off, rd)
		}
		parts = append(parts, rd.Content)
		if !rd.Truncated {
			break
		}
		off = rd.NextOffset
	}
	if !slices.Equal(parts, []string{"aé", "€b"}) {
		t.Fatalf("parts %q", parts)
	}

	var ed api.EditFileOutput
	if e := call(t, c, api.ToolEditFile, api.EditFileInput{Path: "src/main.py", OldText: "hello", NewText: "bye"}, nil); e == nil ||
		e.Code != api.CodeInvalidArgument || !strings.Contains(e.Message, "occurs 2 times") {
		t.Fatalf("ambiguous edit: %v", e)
	}
	if e := call(t, c, api.ToolEditFile, api.EditFileInput{Path: "src/main.py", OldText: "absent", NewText: "x"}, nil); e == nil ||
		e.Code != api.CodeInvalidArgument || !strings.Contains(e.Message, "not found") {
		t.Fatalf("edit of absent text: %v", e)
	}
	mustCall(t, c, api.ToolEditFile, api.EditFileInput{Path: "src/main.py", OldText: "hello", NewText: "bye", ReplaceAll: true}, &ed)
	if ed.Replacements != 2 || ed.File.Mode != "0755" || ed.File.Size != 26 {
		t.Fatalf("edit_file = %+v", ed)
	}
	if data, _ := os.ReadFile(filepath.Join(f.ws, "src", "main.py")); string(data) != "print('bye')\nprint('bye')\n" {
		t.Fatalf("after the edit: %q", data)
	}
	// Editing through a link would replace the link with a copy.
	if err := os.Symlink("main.py", filepath.Join(f.ws, "src", "link.py")); err != nil {
		t.Fatal(err)
	}
	if e := call(t, c, api.ToolEditFile, api.EditFileInput{Path: "src/link.py", OldText: "bye", NewText: "x"}, nil); e == nil || e.Code != api.CodeInvalidArgument {
		t.Fatalf("edit through a link: %v", e)
	}

	var ls api.ListResult
	mustCall(t, c, api.ToolListFiles, api.ListFilesInput{}, &ls)
	var names []string
	for _, e := range ls.Entries {
		names = append(names, e.Name)
	}
	if ls.Path != "." || !slices.Equal(names, []string{"bin", "src", "utf8.txt"}) {
		t.Fatalf("list_files = %+v", ls)
	}
	mustCall(t, c, api.ToolStatFile, api.StatFileInput{Path: "src/link.py"}, &fi)
	if !fi.IsSymlink || fi.LinkTarget != "main.py" {
		t.Fatalf("stat_file = %+v", fi)
	}

	if e := call(t, c, api.ToolDeleteFile, api.DeleteFileInput{Path: "src"}, nil); e == nil || e.Code != api.CodeIsADirectory {
		t.Fatalf("delete of a directory without recursive: %v", e)
	}
	var del api.DeleteFileOutput
	mustCall(t, c, api.ToolDeleteFile, api.DeleteFileInput{Path: "src", Recursive: true}, &del)
	if !del.Deleted || del.Path != "src" {
		t.Fatalf("delete_file = %+v", del)
	}
	if _, err := os.Stat(filepath.Join(f.ws, "src")); !os.IsNotExist(err) {
		t.Fatalf("src still there: %v", err)
	}
	if e := call(t, c, api.ToolReadFile, api.ReadFileInput{Path: "src/main.py"}, nil); e == nil || e.Code != api.CodeNotFound {
		t.Fatalf("read of a deleted file: %v", e)
	}
	noTemps(t, f.ws)
}

// Every file tool refuses paths that leave the workspace, with the same
// code the file endpoints use.
func TestToolsConfinement(t *testing.T) {
	f := newFileServer(t, Config{})
	outside := t.TempDir()
	if err := os.WriteFile(filepath.Join(outside, "secret"), []byte("s3cret"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(outside, filepath.Join(f.ws, "escape")); err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{"../x", "a/../../x", "/etc/passwd", "escape/secret", filepath.Join(outside, "secret")} {
		for name, in := range map[string]any{
			api.ToolCreateFile: api.CreateFileInput{Path: p, Content: "x"},
			api.ToolReadFile:   api.ReadFileInput{Path: p},
			api.ToolEditFile:   api.EditFileInput{Path: p, OldText: "s3cret", NewText: "x"},
			api.ToolListFiles:  api.ListFilesInput{Path: p},
			api.ToolStatFile:   api.StatFileInput{Path: p},
			api.ToolDeleteFile: api.DeleteFileInput{Path: p, Recursive: true},
		} {
			e := call(t, f.client, name, in, nil)
			if e == nil || e.Code != api.CodePathEscapesWorkspace || e.Status != http.StatusForbidden {
				t.Errorf("%s(%q) = %v, want path_escapes_workspace", name, p, e)
			}
		}
	}
	if data, err := os.ReadFile(filepath.Join(outside, "secret")); err != nil || string(data) != "s3cret" {
		t.Fatalf("the file outside changed: %q, %v", data, err)
	}
}

func TestToolsCommands(t *testing.T) {
	f := newFileServer(t, Config{Python: "sh"})
	var res api.CommandResult
	mustCall(t, f.client, api.ToolRunCommand, api.CommandRequest{Command: []string{"sh", "-c", "echo $X; pwd; echo err >&2; exit 3"}, Env: map[string]string{"X": "y"}}, &res)
	if res.ExitCode != 3 || res.Stdout != "y\n"+f.s.DefaultCwd()+"\n" || res.Stderr != "err\n" {
		t.Fatalf("run_command = %+v", res)
	}
	mustCall(t, f.client, api.ToolRunCommand, api.CommandRequest{Command: []string{"sh", "-c", "yes | head -c 5000"}, MaxOutputBytes: 100}, &res)
	if !res.Truncated || len(res.Stdout) != 100 {
		t.Fatalf("capped run_command = %+v", res)
	}
	mustCall(t, f.client, api.ToolRunCommand, api.CommandRequest{Command: []string{"sleep", "10"}, TimeoutSeconds: 1}, &res)
	if !res.TimedOut || res.Signal != "SIGKILL" {
		t.Fatalf("timed-out run_command = %+v", res)
	}
	if e := call(t, f.client, api.ToolRunCommand, api.CommandRequest{Command: []string{"no-such-program"}}, nil); e == nil || e.Code != api.CodeNotFound {
		t.Fatalf("missing program: %v", e)
	}
	if e := call(t, f.client, api.ToolRunCommand, api.CommandRequest{Command: []string{"true"}, TimeoutSeconds: 100000}, nil); e == nil ||
		e.Code != api.CodeInvalidArgument || !strings.Contains(e.Message, "timeout_seconds") {
		t.Fatalf("timeout above the maximum: %v", e)
	}
	// python_exec with sh standing in for the interpreter: -u is an sh
	// option too, and -c runs the code.
	mustCall(t, f.client, api.ToolPythonExec, api.PythonRequest{Code: "echo from-snippet; read l; echo $l", Stdin: "in\n"}, &res)
	if res.ExitCode != 0 || res.Stdout != "from-snippet\nin\n" {
		t.Fatalf("python_exec = %+v", res)
	}
	if e := call(t, f.client, api.ToolPythonExec, api.PythonRequest{Code: "x", TimeoutSeconds: 121}, nil); e == nil ||
		e.Code != api.CodeInvalidArgument || !strings.Contains(e.Message, "timeout_seconds") {
		t.Fatalf("python timeout above the cap: %v", e)
	}
}

// Bad input is refused before anything runs, with the field named.
func TestToolsBadInput(t *testing.T) {
	f := newFileServer(t, Config{})
	for _, tc := range []struct {
		tool, input string
		want        []string
	}{
		{api.ToolCreateFile, `{"path":"a"}`, []string{"missing property 'content'"}},
		{api.ToolCreateFile, `{"path":"a","content":"x","owner":"root"}`, []string{"'owner'", "not allowed"}},
		{api.ToolCreateFile, `{"path":7,"content":"x"}`, []string{"'/path'", "want string"}},
		{api.ToolCreateFile, `{"path":"a","content":"x","encoding":"hex"}`, []string{"'/encoding'"}},
		{api.ToolCreateFile, `{"path":"a","content":"x","mode":"rwx"}`, []string{"'/mode'"}},
		{api.ToolCreateFile, `{"path":"","content":"x"}`, []string{"'/path'"}},
		{api.ToolCreateFile, `{"path":"a","content":"!!","encoding":"base64"}`, []string{"base64"}},
		{api.ToolReadFile, `{"path":"a","offset":-1}`, []string{"'/offset'"}},
		{api.ToolReadFile, `{"path":"a","max_bytes":1.5}`, []string{"'/max_bytes'", "want integer"}},
		{api.ToolReadFile, `{"path":"a","max_bytes":1e300}`, []string{"'/max_bytes'"}},
		{api.ToolEditFile, `{"path":"a","old_text":"","new_text":"x"}`, []string{"'/old_text'"}},
		{api.ToolRunCommand, `{"command":[]}`, []string{"'/command'"}},
		{api.ToolRunCommand, `{"command":["ls",1]}`, []string{"'/command/1'", "want string"}},
		{api.ToolRunCommand, `{"command":null}`, []string{"'/command'", "want array"}},
		{api.ToolRunCommand, `{"command":["ls"],"env":{"A":1}}`, []string{"'/env/A'"}},
		{api.ToolPythonExec, `{"code":"1","timeout_seconds":500}`, []string{"'/timeout_seconds'"}},
		{api.ToolListFiles, `[]`, []string{"want object"}},
		{api.ToolListFiles, `null`, []string{"want object"}},
		{api.ToolStatFile, `{"path":"a"} {"path":"b"}`, []string{"after the JSON"}},
	} {
		raw, err := f.client.CallTool(context.Background(), tc.tool, json.RawMessage(tc.input))
		e, ok := err.(*api.Error)
		if !ok || e.Code != api.CodeInvalidArgument || e.Status != http.StatusBadRequest {
			t.Errorf("%s %s = %s, %v; want invalid_argument", tc.tool, tc.input, raw, err)
			continue
		}
		for _, w := range tc.want {
			if !strings.Contains(e.Message, w) {
				t.Errorf("%s %s: message %q does not contain %q", tc.tool, tc.input, e.Message, w)
			}
		}
	}
	if entries, _ := os.ReadDir(f.ws); len(entries) != 0 {
		t.Fatalf("refused calls left %d entries in the workspace", len(entries))
	}
	if _, err := f.client.CallTool(context.Background(), "no_such_tool", map[string]any{}); api.CodeOf(err) != api.CodeNotFound {
		t.Fatalf("unknown tool: %v", err)
	}
	status, body, _ := f.raw(t, http.MethodDelete, api.PathTools+"/"+api.ToolStatFile, nil)
	if status != http.StatusMethodNotAllowed {
		t.Fatalf("DELETE on a tool: %d %s", status, body)
	}
}

// The catalog lists every tool of the registry, and each input schema
// in it is exactly what calls are checked against: an input built from
// the schema's own required properties is accepted as far as validation
// goes, and one with an extra property is refused by it.
func TestToolsCatalogMatchesInvoke(t *testing.T) {
	f := newFileServer(t, Config{})
	list, err := f.client.ListTools(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if len(list) != len(tools()) {
		t.Fatalf("catalog has %d tools, registry %d", len(list), len(tools()))
	}
	for i, info := range list {
		if info.Name != tools()[i].Name() || info.Description == "" || len(info.OutputSchema) == 0 {
			t.Errorf("catalog entry %d: %+v", i, info)
		}
		var sc struct {
			Type                 string                     `json:"type"`
			Properties           map[string]json.RawMessage `json:"properties"`
			Required             []string                   `json:"required"`
			AdditionalProperties *bool                      `json:"additionalProperties"`
		}
		if err := json.Unmarshal(info.InputSchema, &sc); err != nil {
			t.Fatalf("%s schema: %v", info.Name, err)
		}
		if sc.Type != "object" || sc.AdditionalProperties == nil || *sc.AdditionalProperties {
			t.Errorf("%s schema does not close the object: %s", info.Name, info.InputSchema)
		}
		// The published schema, compiled by a fresh validator, agrees
		// with the server on a few inputs.
		doc, err := sjsonschema.UnmarshalJSON(bytes.NewReader(info.InputSchema))
		if err != nil {
			t.Fatal(err)
		}
		comp := sjsonschema.NewCompiler()
		if err := comp.AddResource("urn:test:"+info.Name, doc); err != nil {
			t.Fatal(err)
		}
		published, err := comp.Compile("urn:test:" + info.Name)
		if err != nil {
			t.Fatalf("%s: the published schema does not compile: %v", info.Name, err)
		}
		for _, input := range []string{`{}`, `{"unknown_field":1}`, `{"path":"x"}`, `{"command":["true"]}`, `{"code":"pass"}`, `{"path":"x","content":"y"}`} {
			v, _ := sjsonschema.UnmarshalJSON(strings.NewReader(input))
			publishedOK := published.Validate(v) == nil
			serverErr := toolsByName()[info.Name].(interface {
				check(json.RawMessage) *api.Error
			}).check(json.RawMessage(input))
			if publishedOK != (serverErr == nil) {
				t.Errorf("%s %s: published schema says valid=%v, server says %v", info.Name, input, publishedOK, serverErr)
			}
		}
		for name, raw := range sc.Properties {
			var p struct {
				Description string `json:"description"`
			}
			if json.Unmarshal(raw, &p) != nil || p.Description == "" {
				t.Errorf("%s: property %s has no description: %s", info.Name, name, raw)
			}
		}
	}
	var one api.ToolInfo
	status, body, _ := f.raw(t, http.MethodGet, api.PathTools+"/"+api.ToolEditFile, nil)
	if status != http.StatusOK || json.Unmarshal(body, &one) != nil || one.Name != api.ToolEditFile {
		t.Fatalf("GET one tool: %d %s", status, body)
	}
}

// Tool calls are audited under the tool's name, with the exit status of
// the commands they run.
func TestToolsAudit(t *testing.T) {
	auditPath := filepath.Join(t.TempDir(), "audit.jsonl")
	audit, err := OpenAuditLog(auditPath)
	if err != nil {
		t.Fatal(err)
	}
	defer audit.Close()
	f := newFileServer(t, Config{Audit: audit})
	mustCall(t, f.client, api.ToolCreateFile, api.CreateFileInput{Path: "a", Content: "x"}, nil)
	mustCall(t, f.client, api.ToolRunCommand, api.CommandRequest{Command: []string{"sh", "-c", "exit 4"}}, nil)
	_ = call(t, f.client, api.ToolReadFile, api.ReadFileInput{Path: "../x"}, nil)
	_, _ = f.client.CallTool(context.Background(), "secret-looking-name", map[string]any{})
	if _, err := f.client.ListTools(context.Background()); err != nil {
		t.Fatal(err)
	}
	entries := readAuditLines(t, auditPath)
	var got []string
	for _, e := range entries {
		got = append(got, e.Tool)
	}
	if !slices.Equal(got, []string{"create_file", "run_command", "read_file", "unknown_tool", "list_tools"}) {
		t.Fatalf("audited tools %q", got)
	}
	if e := entries[1]; e.ExitCode == nil || *e.ExitCode != 4 || e.HTTPStatus != 200 {
		t.Fatalf("run_command audit line %+v", e)
	}
	if e := entries[2]; e.ErrorCode != string(api.CodePathEscapesWorkspace) || e.HTTPStatus != http.StatusForbidden {
		t.Fatalf("read_file audit line %+v", e)
	}
	// The parameters hash is of the body as sent.
	rec := httptest.NewRecorder()
	body := `{"path":"a","content":"x"}`
	req := httptest.NewRequest(http.MethodPost, api.PathTools+"/"+api.ToolCreateFile, strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	f.s.ServeHTTP(rec, req)
	entries = readAuditLines(t, auditPath)
	sum := sha256.Sum256([]byte(body))
	if last := entries[len(entries)-1]; last.ParamsSHA256 != hex.EncodeToString(sum[:]) {
		t.Fatalf("params hash %s, want the body's %x", last.ParamsSHA256, sum)
	}
}
