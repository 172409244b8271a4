package computeapi

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"net/url"
	"strings"
	"unicode/utf8"

	"github.com/go-logr/logr"
	"github.com/modelcontextprotocol/go-sdk/mcp"
	"k8s.io/utils/ptr"

	api "github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
)

// The API's own MCP endpoint, /v1/agents/{agent_id}/mcp: the sandbox's
// operations as MCP tools, over MCP's streamable HTTP transport, for any
// MCP client (an agent framework, an IDE) to use without an agentbox SDK.
// Not to be confused with the MCP servers in the sandbox, which
// sandboxmcp.go forwards calls to.
//
// The transport is stateless: every POST carries one JSON-RPC message and
// gets its answer in the response, no session is kept between POSTs, so
// any replica of the control plane serves any message without sticky
// sessions, and a restart loses nothing. The cost is what needs a
// session: server-to-client requests and a standing notification stream
// (GET), which these tools do not use.
//
// A tool call is served by the API's own REST route for the operation: the
// tool builds the REST request, with the caller's Authorization and request
// ID, and serves it through the Server's handler in process. That is what
// makes a tool call the same operation as its REST call, with nothing kept
// in step by hand: it is authenticated and scoped again, audited as its own
// record under the REST operation's name (run_command, get_file, ...),
// wakes a stopped sandbox, counts as activity, and schedules the filespace
// push, all by the same code. The endpoint adds only the MCP framing.

const (
	// mcpReadDefaultBytes and mcpReadMaxBytes bound read_file: its content
	// goes into the model's context, where a few MiB is already a lot;
	// bigger files are for the files endpoint.
	mcpReadDefaultBytes = 1 << 20
	mcpReadMaxBytes     = 8 << 20
	// mcpMaxResponseBytes bounds a REST response a tool turns into its
	// result. Command output is capped by the supervisor well below it.
	mcpMaxResponseBytes = api.DefaultMaxResponseBytes
)

// mcpSchemas keeps the tools' schemas, inferred once from the Go types,
// across the servers made for each request.
var mcpSchemas = mcp.NewSchemaCache()

// serveMCPEndpoint serves one message of the streamable HTTP transport. Scope is
// checked here, before the message is read, so that another agent's token
// learns nothing about this agent (not even whether it has a sandbox); a
// missing sandbox is refused here too, so that a client pointed at a wrong
// agent fails at connect rather than on every tool call.
func (s *Server) serveMCPEndpoint(w http.ResponseWriter, r *http.Request) {
	agentID := r.PathValue("agent_id")
	if apiErr := s.authorize(r, agentID); apiErr != nil {
		writeError(w, apiErr)
		return
	}
	// A sandbox that is being deleted, or stopped, is left to the tools:
	// they wait for it or report it as the REST calls do.
	if _, apiErr := s.agentSandbox(r.Context(), agentID); apiErr != nil && apiErr.Code != api.CodeSandboxNotReady {
		writeError(w, apiErr)
		return
	}
	srv := s.mcpEndpointServer(r, agentID)
	h := mcp.NewStreamableHTTPHandler(func(*http.Request) *mcp.Server { return srv }, &mcp.StreamableHTTPOptions{
		Stateless: true,
		// One JSON answer per POST: no message is ever streamed, and plain
		// JSON passes proxies and load balancers that buffer.
		JSONResponse: true,
		// The protection is for unauthenticated MCP servers on a developer's
		// machine; this endpoint requires the bearer token, and a mesh
		// sidecar in front of it reaches it over loopback with the
		// Service's Host.
		DisableLocalhostProtection: true,
		MaxRequestBodyBytes:        s.maxRequestBytes,
		// With the protocol versions that allow it, the SDK itself ends a
		// tool call whose POST is gone; mcpCaller.call does it for the
		// others.
		PropagateRequestCancellation: true,
		Logger:                       slog.New(logr.ToSlogHandler(s.log.WithName("mcp"))),
	})
	h.ServeHTTP(w, r)
}

// mcpCaller is what a tool needs of the MCP request it serves: the agent
// and the credentials and request ID to make the REST call with.
type mcpCaller struct {
	s             *Server
	agentID       string
	authorization string
	// holdID is the hold's ID (the wire's lease ID) the MCP request
	// presents, presented again by each REST call it makes.
	holdID string
	// userToken is the user token the MCP request carries
	// (HeaderUserToken), passed on to each REST call, where mcp_request
	// verifies it and the other operations ignore it.
	userToken string
	requestID string
	// post is the context of the HTTP POST that carries the tool call (the
	// server is made for that one POST): when the client goes away, the
	// REST call is cancelled, as it would be for a REST client.
	post context.Context
}

func (s *Server) mcpEndpointServer(r *http.Request, agentID string) *mcp.Server {
	c := &mcpCaller{s: s, agentID: agentID, authorization: r.Header.Get("Authorization"), holdID: r.Header.Get(api.HeaderLeaseID),
		userToken: r.Header.Get(api.HeaderUserToken), post: r.Context()}
	c.requestID = requestID(r.Context())
	srv := mcp.NewServer(&mcp.Implementation{Name: "agentbox", Title: "agentbox sandbox of agent " + agentID, Version: "v1"},
		&mcp.ServerOptions{
			SchemaCache: mcpSchemas,
			Instructions: "These tools act on one isolated Linux sandbox (gVisor) that belongs to agent " + agentID +
				". Its workspace is persistent; relative paths and the default working directory are the workspace. " +
				"A command that exits non-zero is a result, not an error: check exit_code. A sandbox that is stopped " +
				"is resumed by the first call, which then takes longer.",
		})
	mcp.AddTool(srv, &mcp.Tool{Name: "run_command", Description: "Run a command in the sandbox and return its stdout, stderr and exit code. " +
		"Give either command (an argv list, run without a shell) or shell (a command line run with sh -c, for pipes, " +
		"redirections and &&). A non-zero exit_code, timed_out or a signal are results, not errors. Output is capped; " +
		"truncated says when some was dropped."}, c.runCommand)
	mcp.AddTool(srv, &mcp.Tool{Name: "read_file", Description: "Read a file of the workspace. Text (valid UTF-8) comes back as is " +
		"with encoding utf-8, anything else base64-encoded with encoding base64. At most max_bytes are returned; " +
		"truncated says the file is longer.", Annotations: &mcp.ToolAnnotations{ReadOnlyHint: true}}, c.readFile)
	mcp.AddTool(srv, &mcp.Tool{Name: "write_file", Description: "Write a whole file of the workspace, creating its parent " +
		"directories and replacing the file if it exists; readers see the old or the new content, never a mix. " +
		"Use encoding base64 for binary content. The message carrying the content is limited to a few MiB; bigger files " +
		"go through the API's files endpoint.", Annotations: &mcp.ToolAnnotations{IdempotentHint: true}}, c.writeFile)
	mcp.AddTool(srv, &mcp.Tool{Name: "delete_file", Description: "Delete a file, symbolic link or (with recursive) a directory " +
		"of the workspace.", Annotations: &mcp.ToolAnnotations{DestructiveHint: ptr.To(true)}}, c.deleteFile)
	mcp.AddTool(srv, &mcp.Tool{Name: "python_exec", Description: "Run a Python 3 snippet with the sandbox's python3 and return " +
		"its stdout, stderr and exit code (an exception is a non-zero exit_code with the traceback on stderr, not an error). " +
		"Files it writes stay in the workspace."}, c.pythonExec)
	mcp.AddTool(srv, &mcp.Tool{Name: "execute", Description: "Run Python code in a fresh run directory, optionally in a " +
		"virtual environment with requirements installed (pip specifiers such as \"pandas>=2\"; environments are cached " +
		"by requirement set) and with input files; returns status (success, error or timeout), output, stderr, exit_code " +
		"and the files the run produced (base64)."}, c.execute)
	mcp.AddTool(srv, &mcp.Tool{Name: "status", Description: "Report the sandbox's lifecycle phase (Running, Stopped, ...), " +
		"whether it is ready and its last snapshot. It does not wake a stopped sandbox.",
		Annotations: &mcp.ToolAnnotations{ReadOnlyHint: true}}, c.status)
	mcp.AddTool(srv, &mcp.Tool{Name: "mcp_request", Description: "Send one JSON-RPC request to an MCP server of the sandbox " +
		"(one of its template's mcpServers) and return the server's JSON-RPC response: e.g. method tools/list, or " +
		"tools/call with params {\"name\": ..., \"arguments\": {...}}. The user token the MCP client was given, if any, " +
		"reaches the server; it is never an argument here."}, c.mcpRequest)
	return srv
}

type mcpRequestInput struct {
	Server string         `json:"server" jsonschema:"the MCP server's name in the sandbox's template"`
	Method string         `json:"method" jsonschema:"the JSON-RPC method, e.g. tools/list or tools/call"`
	Params map[string]any `json:"params,omitempty" jsonschema:"the method's params, e.g. {\"name\": \"add\", \"arguments\": {\"a\": 1}} for tools/call"`
}

// mcpRequest is mcp_request: the JSON-RPC response, error or not, is the
// tool's result, as the server sent it.
func (c *mcpCaller) mcpRequest(ctx context.Context, _ *mcp.CallToolRequest, in mcpRequestInput) (*mcp.CallToolResult, any, error) {
	if in.Server == "" || in.Method == "" {
		return nil, nil, errors.New("server and method are required")
	}
	req := map[string]any{"jsonrpc": "2.0", "id": 1, "method": in.Method}
	if in.Params != nil {
		req["params"] = in.Params
	}
	var out json.RawMessage
	if err := c.callJSON(ctx, http.MethodPost, api.PathAgent(c.agentID, "mcp/"+url.PathEscape(in.Server)), req, &out); err != nil {
		return nil, nil, err
	}
	return nil, out, nil
}

type mcpRunCommandInput struct {
	Command        []string          `json:"command,omitempty" jsonschema:"the program and its arguments, run without a shell, e.g. [\"ls\", \"-la\"]; give command or shell"`
	Shell          string            `json:"shell,omitempty" jsonschema:"a shell command line, run with sh -c, e.g. \"ls | wc -l\"; give command or shell"`
	Cwd            string            `json:"cwd,omitempty" jsonschema:"working directory, relative to the workspace (default: the workspace)"`
	Env            map[string]string `json:"env,omitempty" jsonschema:"environment variables to set for the command"`
	Stdin          string            `json:"stdin,omitempty" jsonschema:"text written to the command's standard input (default: none)"`
	TimeoutSeconds int               `json:"timeout_seconds,omitempty" jsonschema:"seconds after which the command is killed (default 60)"`
}

func (c *mcpCaller) runCommand(ctx context.Context, _ *mcp.CallToolRequest, in mcpRunCommandInput) (*mcp.CallToolResult, *api.CommandResult, error) {
	argv := in.Command
	switch {
	case len(argv) > 0 && in.Shell != "":
		return nil, nil, errors.New("give either command or shell, not both")
	case in.Shell != "":
		argv = []string{"sh", "-c", in.Shell}
	case len(argv) == 0:
		return nil, nil, errors.New("give command (an argv list) or shell (a command line)")
	}
	var out api.CommandResult
	err := c.callJSON(ctx, http.MethodPost, api.PathRunCommand(c.agentID), api.RunCommandRequest{
		Command: argv, Cwd: in.Cwd, Env: in.Env, Stdin: in.Stdin, TimeoutSeconds: in.TimeoutSeconds,
	}, &out)
	if err != nil {
		return nil, nil, err
	}
	return nil, &out, nil
}

type mcpReadFileInput struct {
	Path     string `json:"path" jsonschema:"file to read, relative to the workspace, e.g. src/main.py"`
	MaxBytes int    `json:"max_bytes,omitempty" jsonschema:"most bytes to return (default 1048576, at most 8388608)"`
}

type mcpReadFileOutput struct {
	Path      string `json:"path"`
	Content   string `json:"content"`
	Encoding  string `json:"encoding" jsonschema:"utf-8 when content is the file's text, base64 when it encodes the bytes"`
	Bytes     int    `json:"bytes" jsonschema:"how many bytes of the file content holds"`
	Truncated bool   `json:"truncated" jsonschema:"the file is longer than what was returned"`
}

func (c *mcpCaller) readFile(ctx context.Context, _ *mcp.CallToolRequest, in mcpReadFileInput) (*mcp.CallToolResult, *mcpReadFileOutput, error) {
	limit := in.MaxBytes
	switch {
	case limit < 0 || limit > mcpReadMaxBytes:
		return nil, nil, fmt.Errorf("max_bytes must be between 1 and %d", mcpReadMaxBytes)
	case limit == 0:
		limit = mcpReadDefaultBytes
	}
	path, err := c.filePath(in.Path)
	if err != nil {
		return nil, nil, err
	}
	res, err := c.call(ctx, http.MethodGet, path, "", nil, limit)
	if err != nil {
		return nil, nil, err
	}
	data := res.body
	if res.truncated {
		// The cut may split a character of a text file: still text.
		if t := trimPartialRune(data); utf8.Valid(t) {
			data = t
		}
	}
	out := &mcpReadFileOutput{Path: in.Path, Bytes: len(data), Truncated: res.truncated, Encoding: "utf-8", Content: string(data)}
	if !utf8.Valid(data) {
		out.Encoding, out.Content = "base64", base64.StdEncoding.EncodeToString(data)
	}
	return nil, out, nil
}

// trimPartialRune drops an incomplete UTF-8 sequence at the end of b.
func trimPartialRune(b []byte) []byte {
	for i := 1; i < utf8.UTFMax && i <= len(b); i++ {
		if utf8.RuneStart(b[len(b)-i]) {
			if !utf8.FullRune(b[len(b)-i:]) {
				return b[:len(b)-i]
			}
			break
		}
	}
	return b
}

type mcpWriteFileInput struct {
	Path     string `json:"path" jsonschema:"file to write, relative to the workspace; parent directories are created"`
	Content  string `json:"content" jsonschema:"the whole new content of the file"`
	Encoding string `json:"encoding,omitempty" jsonschema:"utf-8 (the default) when content is text, base64 when it encodes binary data"`
	Mode     string `json:"mode,omitempty" jsonschema:"permission bits in octal, e.g. 0755 for a script (default 0644)"`
}

func (c *mcpCaller) writeFile(ctx context.Context, _ *mcp.CallToolRequest, in mcpWriteFileInput) (*mcp.CallToolResult, *api.FileInfo, error) {
	data := []byte(in.Content)
	switch in.Encoding {
	case "", "utf-8":
	case "base64":
		var err error
		if data, err = base64.StdEncoding.DecodeString(in.Content); err != nil {
			return nil, nil, fmt.Errorf("content is not valid base64: %w", err)
		}
	default:
		return nil, nil, fmt.Errorf("encoding must be utf-8 or base64, not %q", in.Encoding)
	}
	path, err := c.filePath(in.Path)
	if err != nil {
		return nil, nil, err
	}
	if in.Mode != "" {
		path += "?mode=" + url.QueryEscape(in.Mode)
	}
	res, err := c.call(ctx, http.MethodPut, path, "application/octet-stream", data, mcpMaxResponseBytes)
	if err != nil {
		return nil, nil, err
	}
	var fi api.FileInfo
	if err := json.Unmarshal(res.body, &fi); err != nil {
		return nil, nil, fmt.Errorf("the API's answer to put_file is not understood: %w", err)
	}
	return nil, &fi, nil
}

type mcpDeleteFileInput struct {
	Path      string `json:"path" jsonschema:"file, symbolic link or directory to delete, relative to the workspace"`
	Recursive bool   `json:"recursive,omitempty" jsonschema:"required to delete a directory, which goes with everything in it"`
}

type mcpDeleteFileOutput struct {
	Path    string `json:"path"`
	Deleted bool   `json:"deleted"`
}

func (c *mcpCaller) deleteFile(ctx context.Context, _ *mcp.CallToolRequest, in mcpDeleteFileInput) (*mcp.CallToolResult, *mcpDeleteFileOutput, error) {
	path, err := c.filePath(in.Path)
	if err != nil {
		return nil, nil, err
	}
	if in.Recursive {
		path += "?recursive=true"
	}
	if _, err := c.call(ctx, http.MethodDelete, path, "", nil, mcpMaxResponseBytes); err != nil {
		return nil, nil, err
	}
	return nil, &mcpDeleteFileOutput{Path: in.Path, Deleted: true}, nil
}

type mcpPythonInput struct {
	Code           string            `json:"code" jsonschema:"the Python 3 source to run"`
	Stdin          string            `json:"stdin,omitempty" jsonschema:"text on the snippet's standard input (default: none)"`
	Cwd            string            `json:"cwd,omitempty" jsonschema:"working directory, relative to the workspace (default: the workspace)"`
	Env            map[string]string `json:"env,omitempty" jsonschema:"environment variables to set"`
	TimeoutSeconds int               `json:"timeout_seconds,omitempty" jsonschema:"seconds after which the snippet is killed (default 30, at most 120)"`
}

// pythonExec is the supervisor's python_exec tool through tool_request;
// its output is the supervisor's, passed on as it is (so no output schema
// is declared here that could drift from it).
func (c *mcpCaller) pythonExec(ctx context.Context, _ *mcp.CallToolRequest, in mcpPythonInput) (*mcp.CallToolResult, any, error) {
	var out json.RawMessage
	if err := c.callJSON(ctx, http.MethodPost, api.PathAgent(c.agentID, "tools/python_exec"), in, &out); err != nil {
		return nil, nil, err
	}
	return nil, out, nil
}

type mcpExecuteInput struct {
	Code           string            `json:"code" jsonschema:"the Python 3 source to run"`
	Requirements   []string          `json:"requirements,omitempty" jsonschema:"packages to install first, as pip requirement specifiers (no URLs or paths)"`
	EnvName        string            `json:"env_name,omitempty" jsonschema:"a named environment to run in (created or rebuilt with requirements if given)"`
	TimeoutSeconds int               `json:"timeout_seconds,omitempty" jsonschema:"seconds after which the code is killed (environment builds not counted)"`
	Files          map[string]string `json:"files,omitempty" jsonschema:"input files written to the run directory first: relative path to base64 content"`
}

// execute is the supervisor's /v1/execute; its output is the supervisor's, as for
// python_exec.
func (c *mcpCaller) execute(ctx context.Context, _ *mcp.CallToolRequest, in mcpExecuteInput) (*mcp.CallToolResult, any, error) {
	var out json.RawMessage
	if err := c.callJSON(ctx, http.MethodPost, api.PathAgent(c.agentID, "execute"), in, &out); err != nil {
		return nil, nil, err
	}
	return nil, out, nil
}

func (c *mcpCaller) status(ctx context.Context, _ *mcp.CallToolRequest, _ struct{}) (*mcp.CallToolResult, *api.SandboxStatus, error) {
	var out api.SandboxStatus
	if err := c.callJSON(ctx, http.MethodGet, api.PathAgent(c.agentID, "status"), nil, &out); err != nil {
		return nil, nil, err
	}
	return nil, &out, nil
}

// filePath is the REST path of a workspace file. An absolute path would
// make an empty segment, which the API refuses with a message about the
// URL; the model gets one about its argument instead.
func (c *mcpCaller) filePath(p string) (string, error) {
	if p == "" || strings.HasPrefix(p, "/") {
		return "", fmt.Errorf("path must be relative to the workspace, got %q", p)
	}
	return api.PathFile(c.agentID, p), nil
}

// callJSON makes a REST call with a JSON body (none if in is nil) and
// decodes its JSON answer into out.
func (c *mcpCaller) callJSON(ctx context.Context, method, path string, in, out any) error {
	var body []byte
	contentType := ""
	if in != nil {
		var err error
		if body, err = json.Marshal(in); err != nil {
			return fmt.Errorf("encode the request: %w", err)
		}
		contentType = "application/json"
	}
	res, err := c.call(ctx, method, path, contentType, body, mcpMaxResponseBytes)
	if err != nil {
		return err
	}
	if res.truncated {
		return fmt.Errorf("the answer is larger than %d bytes", mcpMaxResponseBytes)
	}
	if err := json.Unmarshal(res.body, out); err != nil {
		return fmt.Errorf("the API's answer is not understood: %w", err)
	}
	return nil
}

type restResult struct {
	body      []byte
	truncated bool
}

// call serves one REST request through the Server's own handler, as the
// caller of the MCP request, and returns the first limit bytes of a
// successful answer. An error answer becomes an mcpToolError, which the
// SDK returns to the client as a tool error (IsError) whose text starts
// with the API's error code.
func (c *mcpCaller) call(ctx context.Context, method, path, contentType string, body []byte, limit int) (*restResult, error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	defer context.AfterFunc(c.post, cancel)()
	req, err := http.NewRequestWithContext(ctx, method, path, bytes.NewReader(body))
	if err != nil {
		return nil, fmt.Errorf("build the %s %s request: %w", method, path, err)
	}
	req.RequestURI = req.URL.RequestURI()
	req.Header.Set("Authorization", c.authorization)
	if c.holdID != "" {
		req.Header.Set(api.HeaderLeaseID, c.holdID)
	}
	if c.userToken != "" {
		req.Header.Set(api.HeaderUserToken, c.userToken)
	}
	if c.requestID != "" {
		// The tool's audit record and log lines carry the MCP request's
		// ID, which ties them to the MCP exchange that made them.
		req.Header.Set(HeaderRequestID, c.requestID)
	}
	if contentType != "" {
		req.Header.Set("Content-Type", contentType)
	}
	rec := &boundedRecorder{header: http.Header{}, limit: limit}
	c.s.handler.ServeHTTP(rec, req)
	if rec.status >= http.StatusBadRequest {
		var eb api.ErrorBody
		if err := json.Unmarshal(rec.body.Bytes(), &eb); err != nil || eb.Error == nil {
			return nil, fmt.Errorf("the API answered %d", rec.status)
		}
		return nil, mcpToolError{eb.Error}
	}
	return &restResult{body: rec.body.Bytes(), truncated: rec.over}, nil
}

// mcpToolError is an API error as a tool sees it: the code and the
// message, without the HTTP status and the request ID a REST client's
// error shows.
type mcpToolError struct{ e *api.Error }

func (e mcpToolError) Error() string { return string(e.e.Code) + ": " + e.e.Message }

func (e mcpToolError) Unwrap() error { return e.e }

// errAnswerTooLarge stops a handler that streams an answer past what the
// tool keeps (get_file of a big file): its copy fails and it returns.
var errAnswerTooLarge = errors.New("answer larger than the tool keeps")

// boundedRecorder is the ResponseWriter of an in-process REST call: it
// keeps the status, the headers and the first limit bytes of the body.
type boundedRecorder struct {
	header http.Header
	status int
	body   bytes.Buffer
	limit  int
	over   bool
}

func (r *boundedRecorder) Header() http.Header { return r.header }

func (r *boundedRecorder) WriteHeader(status int) {
	if r.status == 0 {
		r.status = status
	}
}

func (r *boundedRecorder) Write(p []byte) (int, error) {
	r.WriteHeader(http.StatusOK)
	limit := r.limit
	if r.status >= http.StatusBadRequest {
		// An error is kept whole, whatever the caller asked for of a
		// success, to learn its code.
		limit = max(limit, auditDetailBytes)
	}
	if room := limit - r.body.Len(); len(p) > room {
		r.body.Write(p[:room])
		r.over = true
		return room, errAnswerTooLarge
	}
	return r.body.Write(p)
}
