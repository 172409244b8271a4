package supervisor

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"unicode/utf8"

	"github.com/google/jsonschema-go/jsonschema"
	sjsonschema "github.com/santhosh-tekuri/jsonschema/v6"

	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/httpcall"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/runner"
	api "github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/workspace"
)

// Sandboxed tools: GET /v1/tools and POST /v1/tools/{name} (see
// supervisorapi.PathTools).
//
// Every tool is defined once, in the tools list below, with a Go input
// type; the JSON Schema the catalog shows is inferred from that type
// (github.com/google/jsonschema-go, which the MCP SDK already brings), and
// the same schema, compiled by github.com/santhosh-tekuri/jsonschema, is
// what a call's input is checked against before it is decoded into the
// type. The catalog therefore cannot drift from what a call accepts. The
// validator is the second library because it reports errors by where
// they are in the input ("at '/command/1': got number, want string"),
// which is what a model correcting its call needs, while jsonschema-go's
// own validator reports locations in the schema.
//
// The tools are thin: each calls the code its HTTP endpoint uses (Prepare
// and Run for commands, the workspace's Confine and WriteFile for files), so
// confinement, caps and error codes are the same whichever way a call
// comes in.

// Tool is one sandboxed tool.
type Tool interface {
	// Name is what callers invoke the tool by, e.g. "create_file".
	Name() string
	// Description tells a model what the tool does.
	Description() string
	// InputSchema is the JSON Schema of the input Call accepts.
	InputSchema() *jsonschema.Schema
	// OutputSchema is the JSON Schema of what Call returns.
	OutputSchema() *jsonschema.Schema
	// Call validates input (one JSON value) against InputSchema, decodes
	// it and runs the tool. Its errors are typed: invalid_argument for
	// input, the file and command codes otherwise.
	Call(ctx context.Context, s *Server, input json.RawMessage) (any, *api.Error)
}

// maxSafeInteger bounds every integer in a tool input, so that a number
// the schema accepts always fits the Go field it is decoded into (and is
// exactly representable in JSON everywhere).
const maxSafeInteger = 1<<53 - 1

// tools is the registry: the catalog and the invoke endpoint are both
// built from it, in this order. It is built on first use, not at start-up:
// inferring and compiling the schemas allocates 0.8 MB in 8,000 objects,
// and every sandbox would carry the heap pages they touched (under gVisor
// in 2 MiB units, which are not given back piecemeal) whether or not it
// ever lists or calls a tool.
var tools = sync.OnceValue(func() []Tool {
	return []Tool{
		newTool(api.ToolCreateFile,
			"Write a file in the workspace, creating its parent directories; an existing file is replaced. "+
				"The write is atomic and counts against the workspace's size cap.",
			func(sc *jsonschema.Schema) {
				prop(sc, "path").MinLength = ptr(1)
				prop(sc, "encoding").Enum = []any{api.EncodingUTF8, api.EncodingBase64}
				prop(sc, "mode").Pattern = `^0?[0-7]{1,3}$`
			},
			func(_ context.Context, s *Server, in *api.CreateFileInput) (*api.FileInfo, *api.Error) {
				return s.toolCreateFile(in)
			}),
		newTool(api.ToolReadFile,
			"Read a file in the workspace, or a byte range of it. Text comes back as is, other bytes as base64; "+
				"a large file is returned in parts (see truncated and next_offset).",
			func(sc *jsonschema.Schema) { prop(sc, "path").MinLength = ptr(1) },
			func(_ context.Context, s *Server, in *api.ReadFileInput) (*api.ReadFileOutput, *api.Error) {
				return s.toolReadFile(in)
			}),
		newTool(api.ToolEditFile,
			"Replace text in a file in the workspace: old_text must occur exactly once, or set replace_all. "+
				"The file is rewritten atomically and keeps its permissions.",
			func(sc *jsonschema.Schema) {
				prop(sc, "path").MinLength = ptr(1)
				prop(sc, "old_text").MinLength = ptr(1)
			},
			func(_ context.Context, s *Server, in *api.EditFileInput) (*api.EditFileOutput, *api.Error) {
				return s.toolEditFile(in)
			}),
		newTool(api.ToolListFiles,
			"List a directory in the workspace (one level, sorted by name).",
			nil,
			func(_ context.Context, s *Server, in *api.ListFilesInput) (*api.ListResult, *api.Error) {
				rel, e := s.toolPath(in.Path)
				if e != nil {
					return nil, e
				}
				return s.ws.List(rel)
			}),
		newTool(api.ToolStatFile,
			"Describe a file, directory or symbolic link in the workspace: size, mode, modification time.",
			func(sc *jsonschema.Schema) { prop(sc, "path").MinLength = ptr(1) },
			func(_ context.Context, s *Server, in *api.StatFileInput) (*api.FileInfo, *api.Error) {
				rel, e := s.toolPath(in.Path)
				if e != nil {
					return nil, e
				}
				return s.ws.Stat(rel)
			}),
		newTool(api.ToolDeleteFile,
			"Delete a file or symbolic link in the workspace, or a directory with everything in it (recursive).",
			func(sc *jsonschema.Schema) { prop(sc, "path").MinLength = ptr(1) },
			func(_ context.Context, s *Server, in *api.DeleteFileInput) (*api.DeleteFileOutput, *api.Error) {
				rel, e := s.toolPath(in.Path)
				if e != nil {
					return nil, e
				}
				if e := s.ws.Delete(rel, in.Recursive); e != nil {
					return nil, e
				}
				return &api.DeleteFileOutput{Path: rel, Deleted: true}, nil
			}),
		newTool(api.ToolRunCommand,
			"Run a program in the sandbox and return its exit code and output (stdout and stderr, capped). "+
				"No shell is involved unless you run one, e.g. [\"sh\", \"-c\", \"...\"]. On timeout the whole process group is killed.",
			func(sc *jsonschema.Schema) {
				cmd := prop(sc, "command")
				cmd.MinItems = ptr(1)
				cmd.Items.MinLength = ptr(1)
				describe(sc, map[string]string{
					"command":          "the program and its arguments",
					"cwd":              "working directory (default: the workspace); relative paths are taken from there",
					"env":              "environment variables, merged over a minimal base environment",
					"stdin":            "text written to the program's standard input (default: none)",
					"timeout_seconds":  fmt.Sprintf("seconds before the process group is killed (default %d)", api.DefaultTimeoutSeconds),
					"max_output_bytes": fmt.Sprintf("cap on stdout and stderr combined (default %d)", api.DefaultMaxOutputBytes),
				})
			},
			func(ctx context.Context, s *Server, in *api.CommandRequest) (*api.CommandResult, *api.Error) {
				spec, e := s.runner.Prepare(in, s.cfg.DefaultTimeout, s.cfg.MaxTimeout)
				if e != nil {
					return nil, e
				}
				return s.runCaptured(ctx, spec)
			}),
		newTool(api.ToolPythonExec,
			"Run a Python snippet with python3 and return its exit code and output. "+
				fmt.Sprintf("Default timeout %ds, at most %ds; output capped at %d bytes.",
					api.DefaultPythonTimeoutSeconds, api.MaxPythonTimeoutSeconds, api.DefaultMaxOutputBytes),
			func(sc *jsonschema.Schema) {
				code := prop(sc, "code")
				code.MinLength = ptr(1)
				code.MaxLength = ptr(api.MaxPythonCodeBytes)
				prop(sc, "timeout_seconds").Maximum = ptr(float64(api.MaxPythonTimeoutSeconds))
				describe(sc, map[string]string{
					"code":             "the Python source to run",
					"stdin":            "text written to the snippet's standard input (default: none)",
					"env":              "environment variables, merged over a minimal base environment",
					"cwd":              "working directory (default: the workspace)",
					"timeout_seconds":  fmt.Sprintf("seconds before the snippet is killed (default %d)", api.DefaultPythonTimeoutSeconds),
					"max_output_bytes": fmt.Sprintf("cap on stdout and stderr combined (default %d)", api.DefaultMaxOutputBytes),
				})
			},
			func(ctx context.Context, s *Server, in *api.PythonRequest) (*api.CommandResult, *api.Error) {
				spec, e := s.exec.PreparePython(in)
				if e != nil {
					return nil, e
				}
				return s.runCaptured(ctx, spec)
			}),
	}
})

// toolsByName indexes tools.
var toolsByName = sync.OnceValue(func() map[string]Tool {
	m := make(map[string]Tool, len(tools()))
	for _, t := range tools() {
		if _, dup := m[t.Name()]; dup {
			panic("supervisor: tool " + t.Name() + " is defined twice")
		}
		m[t.Name()] = t
	}
	return m
})

// typedTool is a Tool whose input is In and output *Out.
type typedTool[In, Out any] struct {
	name, description string
	input, output     *jsonschema.Schema
	validator         *sjsonschema.Schema
	call              func(context.Context, *Server, *In) (*Out, *api.Error)
}

// newTool infers the tool's schemas from In and Out, lets adjust add what
// Go types cannot say (lengths, enums, patterns, descriptions of fields of
// shared types), and compiles the input schema. A schema that does not
// compile is a bug here, so it panics when the registry is built, which
// the tools tests do.
func newTool[In, Out any](name, description string, adjust func(*jsonschema.Schema), call func(context.Context, *Server, *In) (*Out, *api.Error)) Tool {
	in, err := jsonschema.For[In](nil)
	if err != nil {
		panic(fmt.Sprintf("supervisor: tool %s: input schema: %v", name, err))
	}
	tightenSchema(in)
	if adjust != nil {
		adjust(in)
	}
	out, err := jsonschema.For[Out](nil)
	if err != nil {
		panic(fmt.Sprintf("supervisor: tool %s: output schema: %v", name, err))
	}
	raw, err := json.Marshal(in)
	if err != nil {
		panic(fmt.Sprintf("supervisor: tool %s: %v", name, err))
	}
	doc, err := sjsonschema.UnmarshalJSON(bytes.NewReader(raw))
	if err != nil {
		panic(fmt.Sprintf("supervisor: tool %s: %v", name, err))
	}
	c := sjsonschema.NewCompiler()
	c.DefaultDraft(sjsonschema.Draft2020)
	url := "urn:agentbox:tool:" + name
	if err := c.AddResource(url, doc); err != nil {
		panic(fmt.Sprintf("supervisor: tool %s: %v", name, err))
	}
	v, err := c.Compile(url)
	if err != nil {
		panic(fmt.Sprintf("supervisor: tool %s: compile the input schema: %v", name, err))
	}
	return &typedTool[In, Out]{name: name, description: description, input: in, output: out, validator: v, call: call}
}

func (t *typedTool[In, Out]) Name() string                     { return t.name }
func (t *typedTool[In, Out]) Description() string              { return t.description }
func (t *typedTool[In, Out]) InputSchema() *jsonschema.Schema  { return t.input }
func (t *typedTool[In, Out]) OutputSchema() *jsonschema.Schema { return t.output }

func (t *typedTool[In, Out]) Call(ctx context.Context, s *Server, input json.RawMessage) (any, *api.Error) {
	in, e := t.decode(input)
	if e != nil {
		return nil, e
	}
	out, e := t.call(ctx, s, in)
	if e != nil {
		return nil, e
	}
	return out, nil
}

// check is decode without the result, for tests that compare the
// published schema with what a call accepts.
func (t *typedTool[In, Out]) check(input json.RawMessage) *api.Error {
	_, e := t.decode(input)
	return e
}

// decode checks input against the input schema and decodes it.
func (t *typedTool[In, Out]) decode(input json.RawMessage) (*In, *api.Error) {
	doc, err := sjsonschema.UnmarshalJSON(bytes.NewReader(input))
	if err != nil {
		return nil, api.Errorf(api.CodeInvalidArgument, "%s: input is not JSON: %v", t.name, err)
	}
	if err := t.validator.Validate(doc); err != nil {
		return nil, api.Errorf(api.CodeInvalidArgument, "%s: invalid input: %s", t.name, describeValidation(err))
	}
	// The schema has already refused unknown fields; the decoder refuses
	// them too, so the two can never disagree silently.
	in := new(In)
	dec := json.NewDecoder(bytes.NewReader(input))
	dec.DisallowUnknownFields()
	if err := dec.Decode(in); err != nil {
		var te *json.UnmarshalTypeError
		if errors.As(err, &te) && te.Field != "" {
			return nil, api.Errorf(api.CodeInvalidArgument, "%s: invalid input: at '/%s': %v", t.name, strings.ReplaceAll(te.Field, ".", "/"), err)
		}
		return nil, api.Errorf(api.CodeInvalidArgument, "%s: invalid input: %v", t.name, err)
	}
	return in, nil
}

// describeValidation turns a validation error into one line naming each
// offending place in the input, e.g. "at '/path': got number, want
// string; at ”: missing property 'content'".
func describeValidation(err error) string {
	var ve *sjsonschema.ValidationError
	if !errors.As(err, &ve) {
		return err.Error()
	}
	var parts []string
	var walk func(u *sjsonschema.OutputUnit)
	walk = func(u *sjsonschema.OutputUnit) {
		switch {
		case u.Error == nil:
		case u.InstanceLocation == "":
			// The object itself: the message names the property.
			parts = append(parts, u.Error.String())
		default:
			parts = append(parts, fmt.Sprintf("at '%s': %s", u.InstanceLocation, u.Error.String()))
		}
		for i := range u.Errors {
			walk(&u.Errors[i])
		}
	}
	walk(ve.BasicOutput())
	if len(parts) == 0 {
		return ve.Error()
	}
	return strings.Join(parts, "; ")
}

// tightenSchema fixes what jsonschema.For leaves looser than the decoder:
// slices may be null, and integers unbounded. Every integer a tool takes
// is a size, offset or duration, so none is negative.
func tightenSchema(sc *jsonschema.Schema) {
	for _, p := range sc.Properties {
		if len(p.Types) == 2 && p.Types[0] == "null" {
			p.Type, p.Types = p.Types[1], nil
		}
		if p.Type == "integer" {
			p.Minimum = ptr(0.0)
			p.Maximum = ptr(float64(maxSafeInteger))
		}
	}
}

func prop(sc *jsonschema.Schema, name string) *jsonschema.Schema {
	p, ok := sc.Properties[name]
	if !ok {
		panic("supervisor: tool schema has no property " + name)
	}
	return p
}

// describe sets the descriptions of properties of types shared with the
// HTTP endpoints, whose struct tags are not the place for them.
func describe(sc *jsonschema.Schema, descs map[string]string) {
	for name, d := range descs {
		prop(sc, name).Description = d
	}
}

func ptr[T any](v T) *T { return &v }

// toolInfo is the catalog entry of t.
func toolInfo(t Tool) api.ToolInfo {
	in, _ := json.Marshal(t.InputSchema())
	out, _ := json.Marshal(t.OutputSchema())
	return api.ToolInfo{Name: t.Name(), Description: t.Description(), InputSchema: in, OutputSchema: out}
}

// listTools serves GET /v1/tools, the catalog.
func (s *Server) listTools(w *recorder, _ *http.Request, _ *requestInfo) {
	cat := api.ToolCatalog{Tools: make([]api.ToolInfo, 0, len(tools()))}
	for _, t := range tools() {
		cat.Tools = append(cat.Tools, toolInfo(t))
	}
	httpcall.WriteJSON(w, http.StatusOK, cat)
}

// serveTool serves /v1/tools/{name}: the tool's catalog entry, or a call
// of it.
func (s *Server) serveTool(w *recorder, r *http.Request, info *requestInfo) {
	name := strings.TrimPrefix(r.URL.Path, api.PathTools+"/")
	t, ok := toolsByName()[name]
	if !ok {
		info.Fail(w, api.Errorf(api.CodeNotFound, "no tool %q; GET %s lists them", name, api.PathTools))
		return
	}
	switch r.Method {
	case http.MethodGet, http.MethodHead:
		httpcall.WriteJSON(w, http.StatusOK, toolInfo(t))
	case http.MethodPost:
		var input json.RawMessage
		if !s.decode(w, r, info, &input) {
			return
		}
		out, e := t.Call(r.Context(), s, input)
		if e != nil {
			info.Fail(w, e)
			return
		}
		if res, ok := out.(*api.CommandResult); ok {
			info.Result = res
		}
		httpcall.WriteJSON(w, http.StatusOK, out)
	default:
		httpcall.MethodNotAllowed(w, r, "GET, HEAD, POST")
	}
}

// toolOp is the audit record's name for a call under /v1/tools/: the
// tool's name for an invocation of a known tool.
func toolOp(r *http.Request) string {
	name := strings.TrimPrefix(r.URL.Path, api.PathTools+"/")
	switch {
	case toolsByName()[name] == nil:
		// Not the name as sent: the audit log holds no text a caller
		// chose.
		return "unknown_tool"
	case r.Method != http.MethodPost:
		return "describe_tool"
	}
	return name
}

// toolPath turns a tool's path into a workspace-relative one, as the file
// endpoints do with theirs.
func (s *Server) toolPath(p string) (string, *api.Error) {
	if s.ws == nil {
		return "", workspace.Unavailable()
	}
	if p == "" {
		p = "."
	}
	return s.ws.Confine(p)
}

func (s *Server) toolCreateFile(in *api.CreateFileInput) (*api.FileInfo, *api.Error) {
	rel, e := s.toolPath(in.Path)
	if e != nil {
		return nil, e
	}
	data := []byte(in.Content)
	if in.Encoding == api.EncodingBase64 {
		var err error
		if data, err = base64.StdEncoding.DecodeString(in.Content); err != nil {
			return nil, api.Errorf(api.CodeInvalidArgument, "create_file: content is not valid base64: %v", err)
		}
	}
	return s.ws.PutFile(rel, bytes.NewReader(data), in.Mode, int64(len(data)))
}

func (s *Server) toolReadFile(in *api.ReadFileInput) (*api.ReadFileOutput, *api.Error) {
	rel, e := s.toolPath(in.Path)
	if e != nil {
		return nil, e
	}
	limit := s.cfg.DefaultMaxOutputBytes
	switch {
	case in.MaxBytes > s.cfg.MaxOutputBytesLimit:
		return nil, api.Errorf(api.CodeInvalidArgument, "max_bytes %d exceeds the limit of %d", in.MaxBytes, s.cfg.MaxOutputBytesLimit)
	case in.MaxBytes > 0:
		limit = in.MaxBytes
	}
	f, fi, e := s.ws.OpenRegular("read", rel)
	if e != nil {
		return nil, e
	}
	defer f.Close()
	out := &api.ReadFileOutput{Path: rel, Size: fi.Size(), Offset: in.Offset, Encoding: api.EncodingUTF8}
	// One byte more than asked tells whether the file goes on.
	buf := make([]byte, min(limit+1, max(fi.Size()-in.Offset+1, 1)))
	n, err := f.ReadAt(buf, in.Offset)
	if err != nil && err != io.EOF {
		return nil, workspace.FSError("read", rel, err)
	}
	data := buf[:n]
	if int64(len(data)) > limit {
		data = data[:limit]
		out.Truncated = true
		// A character cut in two at the end is left for the next read,
		// so that text stays text.
		if trimmed := runner.TrimPartialRune(string(data)); len(trimmed) < len(data) && utf8.ValidString(trimmed) && len(trimmed) > 0 {
			data = data[:len(trimmed)]
		}
		out.NextOffset = in.Offset + int64(len(data))
	}
	if utf8.Valid(data) {
		out.Content = string(data)
	} else {
		out.Content, out.Encoding = base64.StdEncoding.EncodeToString(data), api.EncodingBase64
	}
	return out, nil
}

func (s *Server) toolEditFile(in *api.EditFileInput) (*api.EditFileOutput, *api.Error) {
	rel, e := s.toolPath(in.Path)
	if e != nil {
		return nil, e
	}
	// WriteFile replaces a symbolic link rather than writing through it,
	// which would turn an edit of a link into a copy of its target.
	if s.ws.IsSymlink(rel) {
		return nil, api.Errorf(api.CodeInvalidArgument, "edit_file %q: is a symbolic link; edit the file it points to", rel)
	}
	f, fi, e := s.ws.OpenRegular("edit", rel)
	if e != nil {
		return nil, e
	}
	if fi.Size() > s.cfg.MaxRequestBytes {
		f.Close()
		return nil, api.Errorf(api.CodePayloadTooLarge, "edit_file %q: the file is %d bytes; edit_file handles files up to %d", rel, fi.Size(), s.cfg.MaxRequestBytes)
	}
	data, err := io.ReadAll(io.LimitReader(f, s.cfg.MaxRequestBytes+1))
	f.Close()
	if err != nil {
		return nil, workspace.FSError("edit", rel, err)
	}
	old := []byte(in.OldText)
	n := bytes.Count(data, old)
	switch {
	case n == 0:
		return nil, api.Errorf(api.CodeInvalidArgument, "edit_file %q: old_text was not found in the file", rel)
	case n > 1 && !in.ReplaceAll:
		return nil, api.Errorf(api.CodeInvalidArgument, "edit_file %q: old_text occurs %d times; give more context to make it unique, or set replace_all", rel, n)
	}
	edited := bytes.Replace(data, old, []byte(in.NewText), -1)
	if _, e := s.ws.WriteFile(rel, bytes.NewReader(edited), fi.Mode().Perm(), int64(len(edited))); e != nil {
		return nil, e
	}
	st, e := s.ws.Stat(rel)
	if e != nil {
		return nil, e
	}
	return &api.EditFileOutput{File: *st, Replacements: n}, nil
}

// Compile-time check that the registry's element type is what
// typedTool implements.
var _ Tool = (*typedTool[api.StatFileInput, api.FileInfo])(nil)
