package supervisorapi

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/url"
)

// Sandboxed tools. They are the calls an agent makes through the Compute
// API's tool_request, served by the supervisor at
//
//	GET  /v1/tools          -> ToolCatalog: every tool with the JSON Schema of its input and output
//	GET  /v1/tools/{name}   -> ToolInfo
//	POST /v1/tools/{name}   tool input (a JSON object) -> tool output (a JSON object)
//
// The input is checked against the tool's input schema before anything
// runs: a missing or unknown field, or one of the wrong type, is an
// invalid_argument error that names the field. Failures of the call
// itself carry the same codes as the endpoint the tool mirrors (a path
// outside the workspace is path_escapes_workspace, a full workspace
// workspace_full, and so on). As with RunCommand, a command that exits
// non-zero, is killed or times out is an output, not an error.
const PathTools = "/v1/tools"

// Names of the sandboxed tools. The catalog (ListTools) is authoritative;
// these are for callers that invoke a tool by name.
const (
	// ToolCreateFile writes a whole file, creating its parent directories;
	// CreateFileInput -> FileInfo.
	ToolCreateFile = "create_file"
	// ToolReadFile reads a file or a range of it; ReadFileInput ->
	// ReadFileOutput.
	ToolReadFile = "read_file"
	// ToolEditFile replaces text in a file; EditFileInput ->
	// EditFileOutput.
	ToolEditFile = "edit_file"
	// ToolListFiles lists a directory; ListFilesInput -> ListResult.
	ToolListFiles = "list_files"
	// ToolStatFile describes a path; StatFileInput -> FileInfo.
	ToolStatFile = "stat_file"
	// ToolDeleteFile removes a path; DeleteFileInput -> DeleteFileOutput.
	ToolDeleteFile = "delete_file"
	// ToolRunCommand runs a command; CommandRequest -> CommandResult.
	ToolRunCommand = "run_command"
	// ToolPythonExec runs a Python snippet; PythonRequest ->
	// CommandResult.
	ToolPythonExec = "python_exec"
)

// Encodings of file content in tool inputs and outputs.
const (
	EncodingUTF8   = "utf-8"
	EncodingBase64 = "base64"
)

// ToolInfo describes one tool. The schemas are JSON Schema (draft
// 2020-12) objects; InputSchema is exactly what the supervisor validates
// a call's input against, so a caller (or the model behind it) can be
// given it as the tool's definition.
type ToolInfo struct {
	Name         string          `json:"name"`
	Description  string          `json:"description"`
	InputSchema  json.RawMessage `json:"input_schema"`
	OutputSchema json.RawMessage `json:"output_schema,omitempty"`
}

// ToolCatalog is the body of GET /v1/tools, in a stable order.
type ToolCatalog struct {
	Tools []ToolInfo `json:"tools"`
}

// CreateFileInput is the input of create_file. The file is written
// atomically (readers see the old content or the new, never a mix) and
// counts against the workspace cap; an existing file is replaced.
type CreateFileInput struct {
	Path     string `json:"path" jsonschema:"file to write, relative to the workspace (an absolute path must lie inside it); parent directories are created"`
	Content  string `json:"content" jsonschema:"the whole content of the file"`
	Encoding string `json:"encoding,omitempty" jsonschema:"how content is encoded: utf-8 (the default) for text, base64 for binary data"`
	Mode     string `json:"mode,omitempty" jsonschema:"permission bits in octal, such as 0644 (the default) or 0755"`
}

// ReadFileInput is the input of read_file.
type ReadFileInput struct {
	Path     string `json:"path" jsonschema:"file to read, relative to the workspace"`
	Offset   int64  `json:"offset,omitempty" jsonschema:"byte offset to start reading at (default 0)"`
	MaxBytes int64  `json:"max_bytes,omitempty" jsonschema:"most bytes to return (default and upper limit 1 MiB unless the supervisor is configured otherwise)"`
}

// ReadFileOutput is the output of read_file.
type ReadFileOutput struct {
	Path string `json:"path"`
	// Content is the bytes read, as text when they are valid UTF-8 and as
	// base64 otherwise (see Encoding).
	Content  string `json:"content"`
	Encoding string `json:"encoding"`
	// Size is the size of the whole file.
	Size   int64 `json:"size"`
	Offset int64 `json:"offset"`
	// Truncated means the file goes on after what was returned; read again
	// from NextOffset for the rest.
	Truncated  bool  `json:"truncated"`
	NextOffset int64 `json:"next_offset,omitempty"`
}

// EditFileInput is the input of edit_file: replace OldText with NewText.
// OldText must occur exactly once unless ReplaceAll is set, so an edit
// never lands somewhere the caller did not mean. The file is rewritten
// atomically and keeps its permissions.
type EditFileInput struct {
	Path       string `json:"path" jsonschema:"file to edit, relative to the workspace"`
	OldText    string `json:"old_text" jsonschema:"exact text to replace; it must occur exactly once unless replace_all is true"`
	NewText    string `json:"new_text" jsonschema:"text to put in its place (may be empty to delete old_text)"`
	ReplaceAll bool   `json:"replace_all,omitempty" jsonschema:"replace every occurrence instead of requiring exactly one"`
}

// EditFileOutput is the output of edit_file.
type EditFileOutput struct {
	File         FileInfo `json:"file"`
	Replacements int      `json:"replacements"`
}

// ListFilesInput is the input of list_files.
type ListFilesInput struct {
	Path string `json:"path,omitempty" jsonschema:"directory to list, relative to the workspace (default: the workspace itself)"`
}

// StatFileInput is the input of stat_file.
type StatFileInput struct {
	Path string `json:"path" jsonschema:"path to describe, relative to the workspace; a symbolic link is described itself, not followed"`
}

// DeleteFileInput is the input of delete_file.
type DeleteFileInput struct {
	Path      string `json:"path" jsonschema:"file, symbolic link or directory to delete, relative to the workspace"`
	Recursive bool   `json:"recursive,omitempty" jsonschema:"required to delete a directory, which is deleted with everything in it"`
}

// DeleteFileOutput is the output of delete_file.
type DeleteFileOutput struct {
	Path    string `json:"path"`
	Deleted bool   `json:"deleted"`
}

// ListTools returns the supervisor's tool catalog.
func (c *Client) ListTools(ctx context.Context) ([]ToolInfo, error) {
	var cat ToolCatalog
	if err := c.do(ctx, http.MethodGet, PathTools, nil, &cat); err != nil {
		return nil, err
	}
	return cat.Tools, nil
}

// CallTool invokes the tool name with input, which is encoded as JSON
// unless it is a json.RawMessage already, and returns the tool's output as
// sent. Errors are *Error for inputs the supervisor refused (with the
// offending field named in the message) and calls that failed.
func (c *Client) CallTool(ctx context.Context, name string, input any) (json.RawMessage, error) {
	body, ok := input.(json.RawMessage)
	if !ok {
		var err error
		if body, err = json.Marshal(input); err != nil {
			return nil, fmt.Errorf("encode %s input: %w", name, err)
		}
	}
	var out json.RawMessage
	if err := c.do(ctx, http.MethodPost, PathTools+"/"+url.PathEscape(name), body, &out); err != nil {
		return nil, err
	}
	return out, nil
}
