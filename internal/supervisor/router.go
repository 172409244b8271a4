package supervisor

import (
	"crypto/sha256"
	"fmt"
	"log/slog"
	"net/http"
	"strings"
	"time"

	"github.com/agentbox/terraform-provider-agentbox/internal/contentcoding"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/httpcall"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/mcpbridge"
	api "github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/workspace"
)

// handler serves one call; info is what it records about it.
type handler func(w *recorder, r *http.Request, info *requestInfo)

// params says what a call's parameters are, for the hash in its record.
type params int

const (
	// paramsURL: the method, path and query. The file endpoints' bytes
	// are data, not parameters.
	paramsURL params = iota
	// paramsBody: the JSON body as sent, whether or not it turns out to
	// be valid.
	paramsBody
)

// method is how one or more methods of a route are served.
type method struct {
	// verbs are the HTTP methods served; nil serves every method the
	// route lists no other way for (the handler checks them itself).
	verbs []string
	// op names the call in the audit record, in the terms of the tools an
	// agent calls rather than of HTTP; opOf, when set, names it instead.
	op     string
	opOf   func(*http.Request) string
	params params
	serve  handler
}

// route is one path, or every path under a prefix, and its methods. A
// method it does not list is refused (and recorded as its first
// method's operation), unless a method with nil verbs takes it.
type route struct {
	path   string
	prefix bool // path ends in "/" and everything under it is served
	// probe marks health checks: they are neither recorded nor carry a
	// record, and their log line is debug when they pass.
	probe   bool
	methods []method
}

var (
	onGet    = []string{http.MethodGet, http.MethodHead}
	onPost   = []string{http.MethodPost}
	onPut    = []string{http.MethodPut}
	onDelete = []string{http.MethodDelete}
	onOther  []string // every method not listed before
)

// routeTable is every endpoint the supervisor serves.
func (s *Server) routeTable() []route {
	files := func(prefix string) handler {
		return func(w *recorder, r *http.Request, info *requestInfo) {
			if s.ws == nil {
				info.Fail(w, workspace.Unavailable())
				return
			}
			s.ws.ServeFiles(w, r, prefix, &info.Info)
		}
	}
	return []route{
		{path: api.PathHealth, probe: true, methods: []method{{onGet, "health", nil, paramsURL, s.serveHealth}}},
		{path: api.PathHealthShort, probe: true, methods: []method{{onGet, "health", nil, paramsURL, s.serveHealth}}},
		{path: api.PathLive, probe: true, methods: []method{{onGet, "health", nil, paramsURL, s.serveLive}}},
		{path: api.PathFlush, methods: []method{{onPost, "flush", nil, paramsURL, s.serveFlush}}},
		{path: api.PathCommands, methods: []method{{onPost, "run_command", nil, paramsBody, s.serveCommand}}},
		{path: api.PathCommandsStream, methods: []method{{onPost, "run_command_stream", nil, paramsBody, s.serveCommand}}},
		{path: api.PathPython, methods: []method{{onPost, "python_exec", nil, paramsBody, s.servePython}}},
		{path: api.PathExecute, methods: []method{{onPost, "execute", nil, paramsBody, s.serveExecute}}},
		{path: api.PathEnvs, methods: []method{
			{onGet, "list_envs", nil, paramsURL, s.serveEnvs},
			{onPost, "create_env", nil, paramsBody, s.serveEnvs}}},
		{path: api.PathEnvs + "/", prefix: true, methods: []method{
			{onGet, "get_env", nil, paramsURL, s.serveEnvs},
			{onDelete, "delete_env", nil, paramsURL, s.serveEnvs},
			{onOther, "get_env", nil, paramsURL, s.serveEnvs}}},
		{path: api.PathProcesses, methods: []method{
			{onGet, "list_processes", nil, paramsURL, s.listProcesses},
			{onPost, "start_process", nil, paramsBody, s.startProcessCall}}},
		{path: api.PathProcesses + "/", prefix: true, methods: []method{
			{onGet, "get_process", nil, paramsURL, s.serveProcess},
			{onDelete, "kill_process", nil, paramsURL, s.serveProcess}}},
		// The file endpoints confine the path before they look at the
		// method, so every method goes to them.
		{path: api.PathFiles, prefix: true, methods: []method{
			{onGet, "read_file", nil, paramsURL, files(api.PathFiles)},
			{onPut, "write_file", nil, paramsURL, files(api.PathFiles)},
			{onDelete, "delete_file", nil, paramsURL, files(api.PathFiles)},
			{onOther, "unknown", nil, paramsURL, files(api.PathFiles)}}},
		{path: api.PathStat, prefix: true, methods: []method{
			{onGet, "stat_file", nil, paramsURL, files(api.PathStat)},
			{onOther, "stat_file", nil, paramsURL, files(api.PathStat)}}},
		{path: api.PathList, prefix: true, methods: []method{
			{onGet, "list_files", nil, paramsURL, files(api.PathList)},
			{onOther, "list_files", nil, paramsURL, files(api.PathList)}}},
		{path: api.PathManifest, prefix: true, methods: []method{{onGet, "file_manifest", nil, paramsURL, s.serveManifest}}},
		{path: api.PathTools, methods: []method{{onGet, "list_tools", nil, paramsURL, s.listTools}}},
		// A tool call is recorded by the tool's name; an unknown tool is
		// refused whatever the method.
		{path: api.PathTools + "/", prefix: true, methods: []method{
			{onPost, "", toolOp, paramsBody, s.serveTool},
			{onOther, "", toolOp, paramsURL, s.serveTool}}},
		{path: api.PathPTY, methods: []method{{[]string{http.MethodGet}, "pty_session", nil, paramsURL, s.servePTY}}},
		{path: mcpbridge.PathPrefix, methods: []method{
			{onPost, "mcp_call", nil, paramsBody, s.serveMCP},
			{onOther, "mcp_status", nil, paramsURL, s.serveMCP}}},
		{path: mcpbridge.PathPrefix + "/", prefix: true, methods: []method{
			{onPost, "mcp_call", nil, paramsBody, s.serveMCP},
			{onOther, "mcp_status", nil, paramsURL, s.serveMCP}}},
	}
}

// notFound is what a path no route serves gets.
var notFound = method{op: "unknown", params: paramsURL, serve: func(w *recorder, r *http.Request, _ *requestInfo) {
	httpcall.WriteError(w, api.Errorf(api.CodeNotFound, "no such endpoint: %s", r.URL.Path))
}}

// match finds the route of r's path (nil if none) and the method that
// serves r.
func (s *Server) match(r *http.Request) (*route, method) {
	p := r.URL.Path
	for i := range s.routes {
		rt := &s.routes[i]
		if p == rt.path || rt.prefix && strings.HasPrefix(p, rt.path) {
			return rt, rt.method(r.Method)
		}
	}
	return nil, notFound
}

// method is the route's method that serves verb, or a refusal.
func (rt *route) method(verb string) method {
	var allow []string
	for _, m := range rt.methods {
		if m.verbs == nil {
			return m
		}
		for _, v := range m.verbs {
			if v == verb {
				return m
			}
		}
		allow = append(allow, m.verbs...)
	}
	refusal := rt.methods[0]
	list := strings.Join(allow, ", ")
	refusal.serve = func(w *recorder, r *http.Request, _ *requestInfo) { httpcall.MethodNotAllowed(w, r, list) }
	return refusal
}

// name is the call's operation name in its record.
func (m method) name(r *http.Request) string {
	if m.opOf != nil {
		return m.opOf(r)
	}
	return m.op
}

// ServeHTTP routes the request, logs one line about it and records it in
// the audit log.
func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	s.begin()
	defer s.end()
	start := time.Now()
	rt, m := s.match(r)
	probe := rt != nil && rt.probe
	// Every answer names the codings uploads may come in, so that the
	// control plane learns it from the health calls it makes anyway,
	// before the first upload.
	contentcoding.Advertise(w.Header())
	rec := &recorder{ResponseWriter: w, status: http.StatusOK, carry: !probe, head: r.Method == http.MethodHead}
	info := &requestInfo{op: m.name(r)}
	sum := sha256.New()
	if m.params == paramsBody {
		r.Body = &hashingBody{ReadCloser: r.Body, w: sum}
	} else {
		fmt.Fprintf(sum, "%s %s?%s", r.Method, r.URL.EscapedPath(), r.URL.RawQuery)
	}
	info.record = func() *AuditEntry {
		if info.made == nil {
			info.made = s.auditRecord(r, start, rec.status, info, sum)
		}
		return info.made
	}
	m.serve(rec, r, info)
	s.logRequest(r, rec.status, start, info, probe)
	if !probe {
		s.record(rec, info)
	}
	if info.Aborted != nil {
		// The status and part of the body are sent; cutting the
		// connection is the only way left to tell the client the body is
		// incomplete (a chunked body that ends cleanly would look whole).
		panic(http.ErrAbortHandler)
	}
}

// logRequest writes the call's one log line.
func (s *Server) logRequest(r *http.Request, status int, start time.Time, info *requestInfo, probe bool) {
	attrs := []slog.Attr{
		slog.String("method", r.Method),
		slog.String("path", r.URL.Path),
		slog.Int("status", status),
		slog.Int64("duration_ms", time.Since(start).Milliseconds()),
	}
	if peer := peerID(r); peer != "" {
		attrs = append(attrs, slog.String("peer", peer))
	}
	// Only the program name: arguments and environment may hold secrets.
	if info.Program != "" {
		attrs = append(attrs, slog.String("program", info.Program))
	}
	if info.File != "" {
		attrs = append(attrs, slog.String("file", info.File))
	}
	if info.Aborted != nil {
		attrs = append(attrs, slog.String("aborted", info.Aborted.Error()))
	}
	if info.Result != nil {
		attrs = append(attrs, slog.Int("exit_code", info.Result.ExitCode), slog.Bool("timed_out", info.Result.TimedOut),
			slog.Bool("truncated", info.Result.Truncated))
		if info.Result.Signal != "" {
			attrs = append(attrs, slog.String("signal", info.Result.Signal))
		}
	}
	if info.Err != nil {
		attrs = append(attrs, slog.String("error_code", string(info.Err.Code)), slog.String("error", info.Err.Message))
	}
	if r.Context().Err() != nil {
		attrs = append(attrs, slog.Bool("cancelled", true))
	}
	level := slog.LevelInfo
	if probe && status == http.StatusOK {
		// Kubelet probes would otherwise add a line every few seconds for
		// the life of the sandbox.
		level = slog.LevelDebug
	}
	s.log.LogAttrs(r.Context(), level, "request", attrs...)
}

// record puts the call's record into its answer and the optional audit
// log.
func (s *Server) record(rec *recorder, info *requestInfo) {
	e := info.record()
	switch {
	case info.Aborted != nil, rec.status == http.StatusSwitchingProtocols:
		// A response cut off carries nothing more; a PTY session sent
		// its record on the connection, if its client was still there.
	default:
		if v, err := api.EncodeAuditRecord(*e); err == nil {
			rec.attach(v)
		} else {
			s.log.Error("audit record not encoded", "tool", e.Tool, "error", err.Error())
		}
	}
	if s.cfg.Audit != nil {
		if err := s.cfg.Audit.Record(*e); err != nil {
			s.log.Error("audit log write failed", "tool", e.Tool, "error", err.Error())
		}
	}
}
