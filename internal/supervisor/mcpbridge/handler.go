package mcpbridge

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/modelcontextprotocol/go-sdk/jsonrpc"
	"github.com/modelcontextprotocol/go-sdk/mcp"

	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/httpcall"
	api "github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"
)

// Paths the Manager serves:
//
//	GET  /mcp                 -> ListResponse (every server and its state)
//	GET  /mcp/{server}        -> Status
//	POST /mcp/{server}        JSON-RPC request -> JSON-RPC response
//	GET  /mcp/{server}/tools  -> ToolsResponse (the cached tools/list)
//
// Errors outside JSON-RPC (unknown server, server not running, bad body)
// have the supervisor's shape {"error": {"code", "message"}}; a server
// that is not running answers 503 with its Status under "server".
const (
	PathPrefix = "/mcp"
	// HeaderTimeout is the optional per-call timeout in seconds.
	HeaderTimeout = "X-Timeout-Seconds"
)

// ListResponse is the body of GET /mcp.
type ListResponse struct {
	Servers []Status `json:"servers"`
}

// ToolsResponse is the body of GET /mcp/{server}/tools.
type ToolsResponse struct {
	Server    string      `json:"server"`
	Tools     []*mcp.Tool `json:"tools"`
	UpdatedAt *time.Time  `json:"updated_at,omitempty"`
}

// UnavailableBody is the body of a 503: the error and the server's state.
type UnavailableBody struct {
	Error  *api.Error `json:"error"`
	Server Status     `json:"server"`
}

// rpcRequest is one JSON-RPC 2.0 request as received.
type rpcRequest struct {
	JSONRPC string          `json:"jsonrpc"`
	ID      json.RawMessage `json:"id,omitempty"`
	Method  string          `json:"method"`
	Params  json.RawMessage `json:"params,omitempty"`
}

type rpcResponse struct {
	JSONRPC string          `json:"jsonrpc"`
	ID      json.RawMessage `json:"id"`
	Result  any             `json:"result,omitempty"`
	Error   *jsonrpc.Error  `json:"error,omitempty"`
}

// Methods bridged; each goes through the SDK's typed call.
var methods = map[string]func(ctx context.Context, cs *mcp.ClientSession, params json.RawMessage) (any, error){
	"ping": func(ctx context.Context, cs *mcp.ClientSession, p json.RawMessage) (any, error) {
		var params mcp.PingParams
		if err := decodeParams(p, &params); err != nil {
			return nil, err
		}
		return struct{}{}, cs.Ping(ctx, &params)
	},
	// initialize answers with the handshake the bridge did: the session
	// to the server is the bridge's, not the caller's.
	"initialize": func(_ context.Context, cs *mcp.ClientSession, _ json.RawMessage) (any, error) {
		return cs.InitializeResult(), nil
	},
	"tools/list": typed(func(cs *mcp.ClientSession) func(context.Context, *mcp.ListToolsParams) (*mcp.ListToolsResult, error) {
		return cs.ListTools
	}),
	"tools/call": typed(func(cs *mcp.ClientSession) func(context.Context, *mcp.CallToolParams) (*mcp.CallToolResult, error) {
		return cs.CallTool
	}),
	"resources/list": typed(func(cs *mcp.ClientSession) func(context.Context, *mcp.ListResourcesParams) (*mcp.ListResourcesResult, error) {
		return cs.ListResources
	}),
	"resources/templates/list": typed(func(cs *mcp.ClientSession) func(context.Context, *mcp.ListResourceTemplatesParams) (*mcp.ListResourceTemplatesResult, error) {
		return cs.ListResourceTemplates
	}),
	"resources/read": typed(func(cs *mcp.ClientSession) func(context.Context, *mcp.ReadResourceParams) (*mcp.ReadResourceResult, error) {
		return cs.ReadResource
	}),
	"prompts/list": typed(func(cs *mcp.ClientSession) func(context.Context, *mcp.ListPromptsParams) (*mcp.ListPromptsResult, error) {
		return cs.ListPrompts
	}),
	"prompts/get": typed(func(cs *mcp.ClientSession) func(context.Context, *mcp.GetPromptParams) (*mcp.GetPromptResult, error) {
		return cs.GetPrompt
	}),
	"completion/complete": typed(func(cs *mcp.ClientSession) func(context.Context, *mcp.CompleteParams) (*mcp.CompleteResult, error) {
		return cs.Complete
	}),
}

func typed[P any, R any](method func(*mcp.ClientSession) func(context.Context, *P) (R, error)) func(context.Context, *mcp.ClientSession, json.RawMessage) (any, error) {
	return func(ctx context.Context, cs *mcp.ClientSession, raw json.RawMessage) (any, error) {
		params := new(P)
		if err := decodeParams(raw, params); err != nil {
			return nil, err
		}
		return method(cs)(ctx, params)
	}
}

func decodeParams(raw json.RawMessage, v any) error {
	if len(raw) == 0 || bytes.Equal(raw, []byte("null")) {
		return nil
	}
	if err := json.Unmarshal(raw, v); err != nil {
		return &jsonrpc.Error{Code: jsonrpc.CodeInvalidParams, Message: "invalid params: " + err.Error()}
	}
	return nil
}

// ServeHTTP serves PathPrefix and everything under it.
func (m *Manager) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	rest, ok := strings.CutPrefix(r.URL.Path, PathPrefix)
	if !ok || (rest != "" && rest[0] != '/') {
		httpcall.WriteError(w, api.Errorf(api.CodeNotFound, "no such endpoint: %s", r.URL.Path))
		return
	}
	rest = strings.Trim(rest, "/")
	if rest == "" {
		if !allow(w, r, http.MethodGet, http.MethodHead) {
			return
		}
		httpcall.WriteJSON(w, http.StatusOK, ListResponse{Servers: m.Statuses()})
		return
	}
	name, sub, _ := strings.Cut(rest, "/")
	s, ok := m.servers[name]
	if !ok {
		httpcall.WriteError(w, api.Errorf(api.CodeNotFound, "no MCP server named %q", name))
		return
	}
	switch sub {
	case "":
		if r.Method == http.MethodPost {
			m.serveCall(w, r, s)
			return
		}
		if !allow(w, r, http.MethodGet, http.MethodHead, http.MethodPost) {
			return
		}
		httpcall.WriteJSON(w, http.StatusOK, s.status())
	case "tools":
		if !allow(w, r, http.MethodGet, http.MethodHead) {
			return
		}
		if _, st, ok := s.running(); !ok {
			writeUnavailable(w, st)
			return
		}
		s.mu.Lock()
		resp := ToolsResponse{Server: name, Tools: s.tools}
		if !s.toolsAt.IsZero() {
			t := s.toolsAt.UTC()
			resp.UpdatedAt = &t
		}
		toolsErr := s.toolsErr
		s.mu.Unlock()
		if resp.Tools == nil {
			if toolsErr != "" {
				httpcall.WriteError(w, api.Errorf(api.CodeUnavailable, "tools/list of %q failed: %s", name, toolsErr))
				return
			}
			resp.Tools = []*mcp.Tool{}
		}
		httpcall.WriteJSON(w, http.StatusOK, resp)
	default:
		httpcall.WriteError(w, api.Errorf(api.CodeNotFound, "no such endpoint: %s", r.URL.Path))
	}
}

func (m *Manager) serveCall(w http.ResponseWriter, r *http.Request, s *server) {
	if ct := r.Header.Get("Content-Type"); ct != "" && !strings.HasPrefix(ct, "application/json") {
		httpcall.WriteError(w, api.Errorf(api.CodeInvalidArgument, "content type must be application/json, not %q", ct))
		return
	}
	timeout, e := m.callTimeout(r)
	if e != nil {
		httpcall.WriteError(w, e)
		return
	}
	req, ok := m.readCall(w, r)
	if !ok {
		return
	}
	token := r.Header.Get(api.HeaderUserToken)
	// A remote server gets the token as its bearer token instead (see
	// remoteTransport), and never a caller's _meta key either.
	metaToken := token
	if s.cfg.URL != "" {
		metaToken = ""
	}
	params, rpcErr := userTokenParams(req.Params, metaToken)
	if rpcErr != nil {
		writeRPC(w, rpcResponse{ID: req.ID, Error: rpcErr})
		return
	}
	req.Params = params
	call, ok := methods[req.Method]
	if !ok {
		writeRPC(w, rpcResponse{ID: req.ID, Error: &jsonrpc.Error{Code: jsonrpc.CodeMethodNotFound, Message: fmt.Sprintf("method %q is not bridged", req.Method)}})
		return
	}
	session, st, ok := s.running()
	if !ok {
		writeUnavailable(w, st)
		return
	}
	select {
	case m.slots <- struct{}{}:
		defer func() { <-m.slots }()
	default:
		httpcall.WriteError(w, api.Errorf(api.CodeResourceExhausted, "%d MCP calls are already in flight", cap(m.slots)))
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), timeout)
	defer cancel()
	if token != "" && s.cfg.URL != "" {
		ctx = withUserToken(ctx, token)
	}
	result, err := call(ctx, session, req.Params)
	if err != nil {
		writeCallError(ctx, w, r, s, req, err, timeout)
		return
	}
	writeRPC(w, rpcResponse{ID: req.ID, Result: result})
}

// callTimeout is the call's timeout: HeaderTimeout's, or CallTimeout.
func (m *Manager) callTimeout(r *http.Request) (time.Duration, *api.Error) {
	v := r.Header.Get(HeaderTimeout)
	if v == "" {
		return m.cfg.CallTimeout, nil
	}
	sec, err := strconv.Atoi(v)
	if err != nil || sec <= 0 || time.Duration(sec)*time.Second > m.cfg.MaxCallTimeout {
		return 0, api.Errorf(api.CodeInvalidArgument, "%s must be a whole number of seconds from 1 to %d", HeaderTimeout,
			int(m.cfg.MaxCallTimeout/time.Second))
	}
	return time.Duration(sec) * time.Second, nil
}

// readCall reads one JSON-RPC request with an id from the body; anything
// else is answered here, and ok is false.
func (m *Manager) readCall(w http.ResponseWriter, r *http.Request) (req rpcRequest, ok bool) {
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, m.cfg.MaxRequestBytes))
	if err != nil {
		var tooLarge *http.MaxBytesError
		if errors.As(err, &tooLarge) {
			httpcall.WriteError(w, api.Errorf(api.CodePayloadTooLarge, "request body exceeds %d bytes", tooLarge.Limit))
			return req, false
		}
		httpcall.WriteError(w, api.Errorf(api.CodeInvalidArgument, "reading the body: %v", err))
		return req, false
	}
	null := json.RawMessage("null")
	body = bytes.TrimSpace(body)
	if len(body) > 0 && body[0] == '[' {
		writeRPC(w, rpcResponse{ID: null, Error: &jsonrpc.Error{Code: jsonrpc.CodeInvalidRequest, Message: "batches are not supported"}})
		return req, false
	}
	dec := json.NewDecoder(bytes.NewReader(body))
	if err := dec.Decode(&req); err != nil {
		writeRPC(w, rpcResponse{ID: null, Error: &jsonrpc.Error{Code: jsonrpc.CodeParseError, Message: "parse error: " + err.Error()}})
		return req, false
	}
	if dec.More() {
		writeRPC(w, rpcResponse{ID: null, Error: &jsonrpc.Error{Code: jsonrpc.CodeParseError, Message: "unexpected data after the JSON-RPC request"}})
		return req, false
	}
	switch {
	case len(req.ID) == 0 && strings.HasPrefix(req.Method, "notifications/"):
		// The bridge owns the session; the caller's notifications
		// (initialized, cancelled) have nothing to act on.
		w.WriteHeader(http.StatusAccepted)
	case len(req.ID) == 0:
		writeRPC(w, rpcResponse{ID: null, Error: &jsonrpc.Error{Code: jsonrpc.CodeInvalidRequest, Message: "a request needs an id"}})
	case !validID(req.ID):
		writeRPC(w, rpcResponse{ID: null, Error: &jsonrpc.Error{Code: jsonrpc.CodeInvalidRequest, Message: "id must be a string or a number"}})
	case req.JSONRPC != "2.0" || req.Method == "":
		writeRPC(w, rpcResponse{ID: req.ID, Error: &jsonrpc.Error{Code: jsonrpc.CodeInvalidRequest, Message: `not a JSON-RPC 2.0 request ("jsonrpc": "2.0" and a method are required)`}})
	default:
		return req, true
	}
	return req, false
}

// userTokenParams returns params with the call's user token (the value
// of HeaderUserToken, which the control plane verified) in _meta under
// MetaUserToken, or without that key when the call carries no token: a
// caller may not hand a server a token of its own making. params that
// need no change are returned as they are.
func userTokenParams(params json.RawMessage, token string) (json.RawMessage, *jsonrpc.Error) {
	var obj map[string]json.RawMessage
	if len(params) == 0 || bytes.Equal(params, []byte("null")) {
		if token == "" {
			return params, nil
		}
		obj = map[string]json.RawMessage{}
	} else if err := json.Unmarshal(params, &obj); err != nil {
		// Not an object: the typed call refuses it, and no token rides
		// along with it.
		return params, nil
	}
	var meta map[string]json.RawMessage
	if raw, ok := obj["_meta"]; ok && !bytes.Equal(raw, []byte("null")) {
		if err := json.Unmarshal(raw, &meta); err != nil {
			return nil, &jsonrpc.Error{Code: jsonrpc.CodeInvalidParams, Message: "invalid params: _meta must be an object"}
		}
	}
	if token == "" {
		if _, ok := meta[api.MetaUserToken]; !ok {
			return params, nil
		}
		delete(meta, api.MetaUserToken)
	} else {
		if meta == nil {
			meta = map[string]json.RawMessage{}
		}
		// Marshalling a string cannot fail.
		meta[api.MetaUserToken], _ = json.Marshal(token)
	}
	if len(meta) == 0 {
		delete(obj, "_meta")
	} else {
		obj["_meta"], _ = json.Marshal(meta)
	}
	out, err := json.Marshal(obj)
	if err != nil {
		return nil, &jsonrpc.Error{Code: jsonrpc.CodeInvalidParams, Message: "invalid params: " + err.Error()}
	}
	return out, nil
}

// writeCallError answers a call that failed with err.
func writeCallError(ctx context.Context, w http.ResponseWriter, r *http.Request, s *server, req rpcRequest, err error, timeout time.Duration) {
	var (
		wire   *jsonrpc.Error
		denied *EgressDeniedError
		auth   *AuthError
		netErr *url.Error
	)
	switch {
	// The remote transport's errors come first: the SDK wraps them in
	// its own "rejected by transport" JSON-RPC error.
	case errors.As(err, &auth):
		httpcall.WriteError(w, api.Errorf(api.CodePermissionDenied, "MCP server %q refused %s: %v", s.cfg.Name, req.Method, auth))
	case errors.As(err, &denied):
		httpcall.WriteError(w, api.Errorf(api.CodeUnavailable, "MCP server %q cannot be reached: %v", s.cfg.Name, denied))
	case errors.As(err, &wire) && wire.Code != codeRejected:
		writeRPC(w, rpcResponse{ID: req.ID, Error: wire})
	case connectionLost(err):
		// The server died (or Stop came) during the call. Its status
		// may not show it yet, so the message says what happened.
		e := api.Errorf(api.CodeUnavailable, "MCP server %q went away during %s: %v", s.cfg.Name, req.Method, err)
		httpcall.WriteJSON(w, e.Status, UnavailableBody{Error: e, Server: s.status()})
	case ctx.Err() != nil && r.Context().Err() == nil:
		httpcall.WriteError(w, api.Errorf(api.CodeTimeout, "%s on MCP server %q did not answer within %s", req.Method, s.cfg.Name, timeout))
	case r.Context().Err() != nil:
		// The client went away; nobody reads this.
		httpcall.WriteError(w, api.Errorf(api.CodeUnavailable, "request cancelled"))
	case errors.As(err, &netErr):
		// A remote server that could not be reached: the session may
		// still be good, but this call did not get through.
		httpcall.WriteError(w, api.Errorf(api.CodeUnavailable, "MCP server %q could not be reached for %s: %v", s.cfg.Name, req.Method, netErr.Err))
	case errors.As(err, &wire):
		writeRPC(w, rpcResponse{ID: req.ID, Error: wire})
	default:
		// The SDK refused the call or the server's answer (e.g. a
		// result that does not match the tool's output schema).
		writeRPC(w, rpcResponse{ID: req.ID, Error: &jsonrpc.Error{Code: jsonrpc.CodeInternalError, Message: err.Error()}})
	}
}

// codeRejected is the code of the SDK's "rejected by transport" error: a
// request its transport did not deliver, the cause wrapped beside it.
const codeRejected = -32005

// connectionLost reports whether err means the session to the server
// ended, rather than the server answering with an error.
func connectionLost(err error) bool {
	return errors.Is(err, mcp.ErrConnectionClosed) || errors.Is(err, mcp.ErrSessionMissing) || errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) ||
		errors.Is(err, os.ErrClosed) || errors.Is(err, syscall.EPIPE)
}

func validID(id json.RawMessage) bool {
	var v any
	if json.Unmarshal(id, &v) != nil {
		return false
	}
	switch v.(type) {
	case string, float64:
		return true
	}
	return false
}

func allow(w http.ResponseWriter, r *http.Request, methods ...string) bool {
	for _, m := range methods {
		if r.Method == m {
			return true
		}
	}
	list := strings.Join(methods, ", ")
	w.Header().Set("Allow", list)
	httpcall.WriteError(w, api.Errorf(api.CodeMethodNotAllowed, "%s is not allowed on %s (allowed: %s)", r.Method, r.URL.Path, list))
	return false
}

func writeRPC(w http.ResponseWriter, resp rpcResponse) {
	resp.JSONRPC = "2.0"
	if resp.Error == nil && resp.Result == nil {
		resp.Result = struct{}{}
	}
	httpcall.WriteJSON(w, http.StatusOK, resp)
}

func writeUnavailable(w http.ResponseWriter, st Status) {
	msg := fmt.Sprintf("MCP server %q is not running (state %s)", st.Name, st.State)
	if st.LastError != "" {
		msg += "; last error: " + st.LastError
	}
	e := api.Errorf(api.CodeUnavailable, "%s", msg)
	if st.State == StateBackoff && st.NextStartAt != nil {
		// Rounded up: a client that waits this long finds it restarting.
		wait := time.Until(*st.NextStartAt)
		w.Header().Set("Retry-After", strconv.FormatInt(max(1, int64((wait+time.Second-1)/time.Second)), 10))
	}
	httpcall.WriteJSON(w, e.Status, UnavailableBody{Error: e, Server: st})
}
