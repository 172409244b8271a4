package supervisor

import (
	"bytes"
	"encoding/json"
	"path"
	"strings"
	"testing"

	sjsonschema "github.com/santhosh-tekuri/jsonschema/v6"

	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/runner"
	api "github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"
)

// FuzzToolInput feeds arbitrary bodies to a tool's input decoder (seed
// corpus in testdata/fuzz/FuzzToolInput). Nothing may panic; every
// refusal is a typed invalid_argument; an input the published schema
// accepts always decodes, so the catalog never promises what a call then
// refuses; and what decodes passes on to the command or path checks only
// values they handle with typed errors, never a NUL or an escaping path.
func FuzzToolInput(f *testing.F) {
	f.Add(api.ToolCreateFile, `{"path":"a/b.txt","content":"hi","mode":"0600"}`)
	f.Add(api.ToolCreateFile, `{"path":"a","content":"AAE=","encoding":"base64"}`)
	f.Add(api.ToolReadFile, `{"path":"a","offset":9007199254740991,"max_bytes":1}`)
	f.Add(api.ToolEditFile, `{"path":"a","old_text":"x","new_text":"","replace_all":true}`)
	f.Add(api.ToolListFiles, `{}`)
	f.Add(api.ToolStatFile, `{"path":"../x"}`)
	f.Add(api.ToolDeleteFile, `{"path":"/","recursive":true}`)
	f.Add(api.ToolRunCommand, `{"command":["sh","-c","exit 1"],"env":{"A":"b"},"timeout_seconds":5}`)
	f.Add(api.ToolPythonExec, `{"code":"print(1)","timeout_seconds":120}`)
	f.Add(api.ToolRunCommand, `{"command":["x"],"timeout_seconds":9223372036854775808}`)
	f.Add(api.ToolCreateFile, `{"path":"a","content":"x","path":"b"}`)
	ws := f.TempDir()
	s := newServer(f, Config{Workspace: ws, DefaultCwd: ws, Python: "sh"})
	published := make(map[string]*sjsonschema.Schema, len(tools()))
	for _, tool := range tools() {
		published[tool.Name()] = compiledInput(f, tool)
	}
	f.Fuzz(func(t *testing.T, name, body string) {
		tool, ok := toolsByName()[name]
		if !ok {
			return
		}
		tt := tool.(interface {
			check(json.RawMessage) *api.Error
		})
		e := tt.check(json.RawMessage(body))
		schemaOK := false
		if doc, err := sjsonschema.UnmarshalJSON(strings.NewReader(body)); err == nil {
			schemaOK = published[name].Validate(doc) == nil
		}
		if e != nil {
			checkTypedError(t, e)
			if e.Code != api.CodeInvalidArgument {
				t.Fatalf("input refused with %s: %v", e.Code, e)
			}
			if schemaOK && json.Valid([]byte(body)) {
				t.Fatalf("the published schema accepts %q but the call refuses it: %v", body, e)
			}
			return
		}
		if !schemaOK {
			t.Fatalf("the call accepted %q, which the published schema refuses", body)
		}
		switch name {
		case api.ToolRunCommand, api.ToolPythonExec:
			var spec *runner.Spec
			if name == api.ToolRunCommand {
				var req api.CommandRequest
				mustDecode(t, body, &req)
				spec, e = s.runner.Prepare(&req, s.cfg.DefaultTimeout, s.cfg.MaxTimeout)
			} else {
				var req api.PythonRequest
				mustDecode(t, body, &req)
				spec, e = s.exec.PreparePython(&req)
			}
			if e != nil {
				checkTypedError(t, e)
				return
			}
			checkSpec(t, s, spec)
		default:
			var in struct {
				Path string `json:"path"`
			}
			_ = json.Unmarshal([]byte(body), &in)
			rel, e := s.toolPath(in.Path)
			if e != nil {
				checkTypedError(t, e)
				return
			}
			if strings.IndexByte(rel, 0) >= 0 || path.IsAbs(rel) || rel == ".." || strings.HasPrefix(rel, "../") {
				t.Fatalf("path %q became %q", in.Path, rel)
			}
		}
	})
}

func mustDecode(t *testing.T, body string, v any) {
	t.Helper()
	if err := json.NewDecoder(bytes.NewReader([]byte(body))).Decode(v); err != nil {
		t.Fatalf("decode %q after the check passed: %v", body, err)
	}
}

// compiledInput compiles the tool's input schema as the catalog
// publishes it, independently of the validator the tool holds.
func compiledInput(t testing.TB, tool Tool) *sjsonschema.Schema {
	t.Helper()
	raw := toolInfo(tool).InputSchema
	doc, err := sjsonschema.UnmarshalJSON(bytes.NewReader(raw))
	if err != nil {
		t.Fatal(err)
	}
	c := sjsonschema.NewCompiler()
	if err := c.AddResource("urn:fuzz:"+tool.Name(), doc); err != nil {
		t.Fatal(err)
	}
	sc, err := c.Compile("urn:fuzz:" + tool.Name())
	if err != nil {
		t.Fatal(err)
	}
	return sc
}
