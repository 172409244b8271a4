// Package computeapi is the control plane's HTTP API: it authenticates a
// caller, finds the caller's agent's Sandbox, and forwards the operation to
// that sandbox's supervisor over mutual TLS, recording the activity on the
// sandbox's Lease. The same Lease carries the sandbox's exclusive hold
// (acquire, heartbeat, release).
//
// The wire types and a Go client live in the client subpackage, which
// depends on the standard library only.
package computeapi

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"mime"
	"net/http"
	"path"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/go-logr/logr"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/clock"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	api "github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
	"github.com/agentbox/terraform-provider-agentbox/internal/pki"
	"github.com/agentbox/terraform-provider-agentbox/internal/store"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"
)

const (
	// DefaultMaxRequestBytes bounds a request body. Stdin travels inline,
	// so the bound is a few MiB rather than a few KiB.
	DefaultMaxRequestBytes = 8 << 20

	// supervisorGrace is how much longer than the command's own timeout
	// the API waits for the supervisor: after a timeout the supervisor
	// still kills the process group and sends the partial output.
	supervisorGrace = 30 * time.Second

	// leaseWriteTimeout keeps a slow API server from holding up the
	// agent's command for long; a lost renewal is retried on a later call.
	leaseWriteTimeout = 5 * time.Second

	// DefaultResumeTimeout covers restoring a workspace of a few GiB and
	// starting a pod on a busy node. A call that waits longer gets
	// sandbox_not_ready and may simply retry: the resume goes on.
	DefaultResumeTimeout = 3 * time.Minute

	// resumePoll is how often a waiting call looks at the sandbox again.
	// It reads the manager's cache, so polling costs no API requests.
	resumePoll = 100 * time.Millisecond
)

// Options configure a Server.
type Options struct {
	// Sandboxes finds Sandboxes by agent; in the control plane it is the
	// manager's cache, so lookups do not load the API server.
	Sandboxes client.Reader
	// Leases writes the activity renewals and lease holds to sandbox
	// Leases, and its reads are a lease call's first look at the Lease; in
	// the control plane it is the manager's client, which writes directly
	// and reads from the cache.
	Leases client.Client
	// LeaseReader reads Leases directly, for the retries of a lease call
	// whose first read, through Leases, was stale or missed; it defaults
	// to Leases.
	LeaseReader client.Reader
	// Supervisors dials sandbox supervisors; see SupervisorPool.
	Supervisors SupervisorDialer
	// Authenticator decides who a bearer token belongs to.
	Authenticator Authenticator
	// TrustDomain of the sandboxes' SPIFFE IDs; empty means
	// pki.DefaultTrustDomain.
	TrustDomain string
	// Clock defaults to the real clock.
	Clock clock.PassiveClock
	// Logger defaults to a logger that discards.
	Logger logr.Logger
	// LeaseRenewInterval defaults to DefaultLeaseRenewInterval.
	LeaseRenewInterval time.Duration
	// ResumeTimeout bounds how long a call waits for a stopped or starting
	// sandbox to become ready; it defaults to DefaultResumeTimeout.
	ResumeTimeout time.Duration
	// MaxRequestBytes defaults to DefaultMaxRequestBytes.
	MaxRequestBytes int64
	// Store, when set, gets every call in its audit log, holds the tokens
	// that /v1/tokens mints, and serves /v1/audit. Without it those
	// endpoints answer unavailable and calls are not audited. The caller
	// closes the Server (which flushes the audit log) before the Store.
	Store *store.Store
	// FilespacePushDelay is how long after an agent's last call that can
	// change its workspace the workspace is pushed into its filespace (in
	// the Store); it defaults to DefaultFilespacePushDelay, and a negative
	// value turns these pushes off.
	FilespacePushDelay time.Duration
	// DefaultTemplate is the SandboxTemplate deploy_or_resume creates an
	// agent's missing sandbox from when the call names none. Zero means
	// such a call must name one, which only an admin token may.
	DefaultTemplate types.NamespacedName
}

// Server serves the Compute API.
type Server struct {
	sandboxes       client.Reader
	supervisors     SupervisorDialer
	auth            Authenticator
	trustDomain     string
	clock           clock.PassiveClock
	log             logr.Logger
	leases          *leaseRenewer
	leaseReader     client.Reader
	leaseWriter     client.Client
	resumeTimeout   time.Duration
	maxRequestBytes int64
	handler         http.Handler
	store           *store.Store
	audit           *auditor
	// supervisorAudit is what the pool hands supervisors' records to.
	supervisorAudit *supervisorAuditSink
	pushes          *autoPusher // nil without a store
	poolTakes       poolTakes
	// background holds work a call starts and does not wait for (see
	// warmConnection, recordActivity); Close waits for it.
	background sync.WaitGroup
	// closing is closed when Close begins, for background work that would
	// otherwise last as long as a call that a hijacked connection keeps
	// open.
	closing   chan struct{}
	warmSlots chan struct{} // see warmConnection
	conns     *warmConns
	// warming holds, by sandbox, a channel closed when the warm-up of its
	// connection ends; see awaitWarmConnection.
	warming sync.Map
	// settleSlots bounds the pool leases being settled, and claiming
	// counts those being decided; see settleSoon.
	settleSlots chan struct{}
	claiming    atomic.Int32
	// poolWaiters queues the pool leases waiting for a ready sandbox.
	poolWaiters poolWaiters
	// defaultTemplate: see Options.DefaultTemplate.
	defaultTemplate types.NamespacedName
	// routes are the "METHOD /pattern"s served, for the OpenAPI check.
	routes []string
}

// NewServer checks opts and returns a Server.
func NewServer(opts Options) (*Server, error) {
	switch {
	case opts.Sandboxes == nil:
		return nil, errors.New("computeapi: Options.Sandboxes is required")
	case opts.Leases == nil:
		return nil, errors.New("computeapi: Options.Leases is required")
	case opts.Supervisors == nil:
		return nil, errors.New("computeapi: Options.Supervisors is required")
	case opts.Authenticator == nil:
		return nil, errors.New("computeapi: Options.Authenticator is required")
	}
	s := &Server{
		sandboxes:       opts.Sandboxes,
		supervisors:     opts.Supervisors,
		warmSlots:       make(chan struct{}, maxWarmConnections),
		conns:           newWarmConns(),
		settleSlots:     make(chan struct{}, maxSettles),
		closing:         make(chan struct{}),
		auth:            opts.Authenticator,
		trustDomain:     opts.TrustDomain,
		clock:           opts.Clock,
		log:             opts.Logger,
		maxRequestBytes: opts.MaxRequestBytes,
		leaseReader:     opts.LeaseReader,
		leaseWriter:     timedWriter{opts.Leases},
		resumeTimeout:   opts.ResumeTimeout,
		store:           opts.Store,
		defaultTemplate: opts.DefaultTemplate,
	}
	if s.resumeTimeout <= 0 {
		s.resumeTimeout = DefaultResumeTimeout
	}
	if s.leaseReader == nil {
		s.leaseReader = opts.Leases
	}
	if s.trustDomain == "" {
		s.trustDomain = pki.DefaultTrustDomain
	}
	if s.clock == nil {
		s.clock = clock.RealClock{}
	}
	if s.log.GetSink() == nil {
		s.log = logr.Discard()
	}
	if s.maxRequestBytes <= 0 {
		s.maxRequestBytes = DefaultMaxRequestBytes
	}
	interval := opts.LeaseRenewInterval
	if interval <= 0 {
		interval = DefaultLeaseRenewInterval
	}
	s.leases = newLeaseRenewer(s.leaseWriter, s.clock, interval, s.log.WithName("lease"))
	if s.store != nil {
		s.audit = newAuditor(s.store, s.log.WithName("audit"))
		if pool, ok := s.supervisors.(*SupervisorPool); ok {
			s.supervisorAudit = &supervisorAuditSink{record: s.recordSupervisor, invalid: s.invalidSupervisorRecord}
			pool.audit.Store(s.supervisorAudit)
		}
		delay := opts.FilespacePushDelay
		if delay == 0 {
			delay = DefaultFilespacePushDelay
		}
		if delay > 0 {
			s.pushes = newAutoPusher(s, delay)
		}
	}

	mux := http.NewServeMux()
	// Each method of a path is its own operation in the audit log; other
	// methods are refused (and audited) as the path's first operation.
	type method struct {
		verb, op string
		serve    http.HandlerFunc
	}
	route := func(pattern string, methods ...method) {
		allow := make([]string, len(methods))
		for i, m := range methods {
			mux.Handle(m.verb+" "+pattern, s.authenticated(m.op, m.serve))
			allow[i] = m.verb
		}
		mux.Handle(pattern, s.authenticated(methods[0].op, methodNotAllowed(strings.Join(allow, ", "))))
		for _, m := range methods {
			s.routes = append(s.routes, m.verb+" "+pattern)
		}
	}
	post, del, get := http.MethodPost, http.MethodDelete, http.MethodGet
	route("/v1/openapi.yaml", method{get, "openapi", s.serveOpenAPI})
	route("/v1/agents/{agent_id}/run_command", method{post, "run_command", s.runCommand})
	route("/v1/agents/{agent_id}/run_command/stream", method{post, "run_command_stream", s.runCommandStream})
	route("/v1/agents/{agent_id}/pty", method{get, "run_command_pty", s.agentPTY})
	route("/v1/agents/{agent_id}/lease", method{post, "acquire_lease", s.acquireLease}, method{del, "release_lease", s.releaseLease})
	route("/v1/agents/{agent_id}/lease/heartbeat", method{post, "heartbeat_lease", s.heartbeatLease})
	route("/v1/namespaces/{namespace}/warm-pools/{pool}/leases", method{post, "acquire_pool_lease", s.acquirePoolLease})
	route("/v1/agents/{agent_id}/status", method{get, "status", s.status})
	route("/v1/agents/{agent_id}/deploy_or_resume", method{post, "deploy_or_resume", s.deployOrResume})
	route("/v1/agents/{agent_id}/sync_filespace", method{post, "sync_filespace", s.syncFilespace})
	route("/v1/agents/{agent_id}/terminate", method{post, "terminate", s.terminate})
	route("/v1/agents/{agent_id}/files/{path...}",
		method{http.MethodPut, "put_file", s.putFile}, method{get, "get_file", s.getFile}, method{del, "delete_file", s.deleteFile})
	route("/v1/agents/{agent_id}/tools/{tool}", method{post, "tool_request", s.toolRequest})
	route("/v1/agents/{agent_id}/execute", method{post, "execute", s.execute})
	route("/v1/agents/{agent_id}/mcp", method{post, "mcp", s.serveMCP})
	route("/v1/agents/{agent_id}/mcp/{server}", method{post, "mcp_request", s.mcpRequest})
	route("/v1/agents/{agent_id}/mcp/{server}/tools", method{get, "list_mcp_tools", s.mcpTools})
	route("/v1/console/sessions", method{post, "create_console_session", s.createConsoleSession})
	route("/v1/console/sessions/{session_id}", method{get, "get_console_session", s.getConsoleSession})
	route("/v1/console/sessions/{session_id}/pty", method{get, "console_pty", s.consolePTY})
	route("/v1/tokens", method{post, "create_token", s.createToken})
	route("/v1/tokens/{token_id}", method{del, "revoke_token", s.revokeToken})
	route("/v1/audit", method{get, "query_audit", s.queryAudit})
	route("/v1/audit/verify", method{get, "verify_audit", s.verifyAudit})
	// Unknown paths get the same JSON error shape as everything else, and
	// only after authentication, so the route table is not probeable
	// anonymously.
	mux.Handle("/", s.authenticated("unknown", func(w http.ResponseWriter, r *http.Request) {
		writeError(w, api.Errorf(api.CodeNotFound, "no such endpoint: %s %s", r.Method, r.URL.Path))
	}))
	// ServeMux answers a path with "." or ".." segments (or "//") with a
	// redirect to the cleaned path, which a client may follow to a path it
	// did not mean. Such a path is refused instead: no workspace path
	// needs them, and the supervisor would refuse them anyway.
	unclean := s.authenticated("invalid_path", func(w http.ResponseWriter, r *http.Request) {
		writeError(w, api.Errorf(api.CodeInvalidArgument, "path %q has empty, \".\" or \"..\" segments", r.URL.Path))
	})
	s.handler = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if p := r.URL.Path; p != "" && path.Clean(p) != p && !(strings.HasSuffix(p, "/") && path.Clean(p)+"/" == p) {
			unclean.ServeHTTP(w, r)
			return
		}
		mux.ServeHTTP(w, r)
	})
	return s, nil
}

// Close writes the audit records still queued. Call it after the HTTP
// server has stopped serving, and before closing the Store.
func (s *Server) Close() {
	close(s.closing)
	s.conns.close()
	s.background.Wait()
	if s.pushes != nil {
		s.pushes.close()
	}
	if pool, ok := s.supervisors.(*SupervisorPool); ok && s.supervisorAudit != nil {
		pool.audit.CompareAndSwap(s.supervisorAudit, nil)
	}
	if s.audit != nil {
		s.audit.close()
	}
}

// Handler returns the API's HTTP handler. Health endpoints are not part of
// it: they are served on the separate health port.
func (s *Server) Handler() http.Handler { return s.handler }

// authenticated runs next only for a request with a valid bearer token,
// and records the call, whatever its outcome, in the audit log as op.
func (s *Server) authenticated(op string, next http.HandlerFunc) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		result := s.audited(op, w, r, func(w http.ResponseWriter, r *http.Request) *Principal {
			token, ok := bearerToken(r)
			if !ok {
				unauthenticated(w, "missing bearer token", false)
				return nil
			}
			p, err := s.auth.Authenticate(r.Context(), token)
			if errors.Is(err, ErrInvalidToken) {
				unauthenticated(w, "invalid bearer token", true)
				return nil
			}
			if err != nil {
				s.log.Error(err, "authenticate request")
				writeError(w, api.Errorf(api.CodeInternal, "could not check the token"))
				return nil
			}
			next(w, withPresentedLease(r.WithContext(context.WithValue(r.Context(), principalKey{}, p))))
			return p
		})
		if result == resultOK && pushAfter[op] && s.pushes != nil {
			s.pushes.touch(r.PathValue("agent_id"))
		}
	})
}

func unauthenticated(w http.ResponseWriter, msg string, invalid bool) {
	challenge := `Bearer realm="agentbox"`
	if invalid {
		challenge += `, error="invalid_token"`
	}
	w.Header().Set("WWW-Authenticate", challenge)
	writeError(w, api.Errorf(api.CodeUnauthenticated, "%s", msg))
}

func methodNotAllowed(allow string) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Allow", allow)
		writeError(w, api.Errorf(api.CodeMethodNotAllowed, "%s is not allowed on %s (allowed: %s)", r.Method, r.URL.Path, allow))
	}
}

// commandCall is a run_command call checked and bound to its sandbox's
// supervisor, for runCommand and runCommandStream.
type commandCall struct {
	sup *supervisorapi.Client
	req supervisorapi.CommandRequest
	log logr.Logger
	// ctx bounds the call by the command's timeout and a grace.
	ctx    context.Context
	cancel context.CancelFunc
}

// startCommand does what both run_command calls start with: authorize,
// decode and check the request, wake the sandbox, count the activity and
// dial the supervisor. It answers the error itself and returns nil.
func (s *Server) startCommand(w http.ResponseWriter, r *http.Request, op string) *commandCall {
	agentID := r.PathValue("agent_id")
	log := s.callLog(r, op).WithValues("agent", agentID)
	if apiErr := s.authorize(r, agentID); apiErr != nil {
		writeError(w, apiErr)
		return nil
	}
	var req api.RunCommandRequest
	if apiErr := s.decode(w, r, &req); apiErr != nil {
		writeError(w, apiErr)
		return nil
	}
	if len(req.Command) == 0 {
		writeError(w, api.Errorf(api.CodeInvalidArgument, "command must not be empty"))
		return nil
	}
	if req.TimeoutSeconds < 0 {
		writeError(w, api.Errorf(api.CodeInvalidArgument, "timeout_seconds must not be negative, got %d", req.TimeoutSeconds))
		return nil
	}

	sb, apiErr := s.readySandbox(r.Context(), agentID)
	if apiErr != nil {
		s.logFailure(log, apiErr, nil)
		writeError(w, apiErr)
		return nil
	}
	log = log.WithValues("sandbox", sb.Namespace+"/"+sb.Name)
	s.recordActivity(r.Context(), sb)
	s.awaitWarmConnection(r.Context(), sb)

	sup, err := s.dialSupervisor(sb)
	if err != nil {
		apiErr := api.Errorf(api.CodeInternal, "cannot reach the sandbox of agent %q", agentID)
		s.logFailure(log, apiErr, err)
		writeError(w, apiErr)
		return nil
	}
	timeout := req.TimeoutSeconds
	if timeout == 0 {
		timeout = supervisorapi.DefaultTimeoutSeconds
	}
	ctx, cancel := context.WithTimeout(r.Context(), time.Duration(timeout)*time.Second+supervisorGrace)
	// The API's run_command request is the supervisor's command request.
	return &commandCall{sup: sup, log: log, ctx: ctx, cancel: cancel, req: req}
}

// commandResult is the supervisor's result as the API sends it. The
// conversion compiles only while the two types have the same fields, so a
// field the supervisor gains cannot be left behind here.
func commandResult(res *supervisorapi.CommandResult) *api.CommandResult {
	out := api.CommandResult(*res)
	return &out
}

func (s *Server) runCommand(w http.ResponseWriter, r *http.Request) {
	start := s.clock.Now()
	call := s.startCommand(w, r, "run_command")
	if call == nil {
		return
	}
	defer call.cancel()
	res, err := call.sup.RunCommand(call.ctx, call.req)
	if err != nil {
		apiErr := supervisorError(call.ctx, err)
		s.logFailure(call.log, apiErr, err)
		writeError(w, apiErr)
		return
	}
	call.log.V(1).Info("command ran", "exit_code", res.ExitCode, "timed_out", res.TimedOut,
		"duration", s.clock.Since(start).String())
	writeJSON(w, http.StatusOK, commandResult(res))
}

// runCommandStream runs a command and answers its output as it comes, one
// JSON event a line (api.CommandEvent), ending with its result. The status
// line is sent with the first event, so a failure after that is an error
// event, not an HTTP status.
func (s *Server) runCommandStream(w http.ResponseWriter, r *http.Request) {
	start := s.clock.Now()
	call := s.startCommand(w, r, "run_command_stream")
	if call == nil {
		return
	}
	defer call.cancel()
	flusher, _ := w.(http.Flusher)
	started := false
	enc := json.NewEncoder(w)
	send := func(ev api.CommandEvent) error {
		if !started {
			w.Header().Set("Content-Type", supervisorapi.ContentTypeNDJSON)
			w.Header().Set("Cache-Control", "no-store")
			w.WriteHeader(http.StatusOK)
			started = true
		}
		if err := enc.Encode(ev); err != nil {
			return err
		}
		if flusher != nil {
			flusher.Flush()
		}
		return nil
	}
	res, err := call.sup.RunCommandStream(call.ctx, call.req, func(ev supervisorapi.CommandEvent) error {
		return send(api.CommandEvent{Stream: ev.Stream, Data: ev.Data, Truncated: ev.Truncated})
	})
	if err != nil {
		apiErr := supervisorError(call.ctx, err)
		s.logFailure(call.log, apiErr, err)
		if !started {
			writeError(w, apiErr)
			return
		}
		_ = send(api.CommandEvent{Error: apiErr})
		return
	}
	call.log.V(1).Info("command ran", "exit_code", res.ExitCode, "timed_out", res.TimedOut,
		"duration", s.clock.Since(start).String(), "streamed", true)
	_ = send(api.CommandEvent{Exit: commandResult(res)})
}

// recordActivity renews the sandbox's Lease as a call starts, and goes on
// renewing it, at the renewer's throttled rate, until the call ends (ctx
// is the request's, which ends with the handler): a terminal, a streamed
// command or a long transfer is use of the sandbox for as long as it is
// open, and must not be idle-stopped under the caller.
func (s *Server) recordActivity(ctx context.Context, sb *v1alpha1.Sandbox) {
	s.renewActivity(ctx, sb)
	if ctx.Done() == nil {
		return
	}
	s.background.Go(func() {
		t := time.NewTicker(s.leases.interval / activityTicks)
		defer t.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-s.closing:
				return
			case <-t.C:
				// A tick and the end of the call can arrive together.
				if ctx.Err() != nil {
					return
				}
				s.renewActivity(ctx, sb)
			}
		}
	})
}

// activityTicks is how many times per renewal interval an open call asks
// for a renewal. The renewer's throttle lets one per interval through, so
// a renewal follows the previous one after at most an interval and a tick.
const activityTicks = 3

func (s *Server) renewActivity(ctx context.Context, sb *v1alpha1.Sandbox) {
	// The renewal must not be cut short when a client disconnects right
	// after sending, nor hold the call up for long.
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), leaseWriteTimeout)
	defer cancel()
	s.leases.renew(ctx, sb)
}

// authorize checks that the caller may address agentID. It runs before
// the sandbox lookup, so a caller learns nothing about other agents'
// sandboxes, not even whether they exist.
func (s *Server) authorize(r *http.Request, agentID string) *api.Error {
	if agentID == "" {
		return api.Errorf(api.CodeInvalidArgument, "agent ID must not be empty")
	}
	if !PrincipalFrom(r.Context()).MayAccessAgent(agentID) {
		return api.Errorf(api.CodePermissionDenied, "this token may not act on agent %q", agentID)
	}
	return nil
}

func (s *Server) decode(w http.ResponseWriter, r *http.Request, into any) *api.Error {
	if ct := r.Header.Get("Content-Type"); ct != "" {
		if mt, _, err := mime.ParseMediaType(ct); err != nil || mt != "application/json" {
			return api.Errorf(api.CodeInvalidArgument, "content type must be application/json, not %q", ct)
		}
	}
	dec := json.NewDecoder(http.MaxBytesReader(w, r.Body, s.maxRequestBytes))
	// Unknown fields are refused so that a misspelt option (say
	// "timeout") fails loudly instead of silently running with defaults.
	dec.DisallowUnknownFields()
	if err := dec.Decode(into); err != nil {
		var tooLarge *http.MaxBytesError
		switch {
		case errors.As(err, &tooLarge):
			return api.Errorf(api.CodePayloadTooLarge, "request body exceeds %d bytes", tooLarge.Limit)
		case errors.Is(err, io.EOF):
			return api.Errorf(api.CodeInvalidArgument, "empty request body")
		default:
			return api.Errorf(api.CodeInvalidArgument, "invalid JSON body: %v", err)
		}
	}
	if dec.More() {
		return api.Errorf(api.CodeInvalidArgument, "invalid JSON body: more than one value")
	}
	return nil
}

// readySandbox returns agentID's Sandbox once it can take calls. A sandbox
// that is stopped, stopping or starting, or that lost its node, is waited
// for: the call renews its Lease, which is what wakes a stopped sandbox or
// one that lost its node, and is served when the controller reports it
// running, so the caller sees one slower call rather than an error. A
// sandbox in a state that needs a person fails at once, and one that
// someone else holds (checkHold) before it is woken.
func (s *Server) readySandbox(ctx context.Context, agentID string) (*v1alpha1.Sandbox, *api.Error) {
	sb, apiErr := s.agentSandbox(ctx, agentID)
	if apiErr != nil {
		return nil, apiErr
	}
	if apiErr := s.checkHold(ctx, sb); apiErr != nil {
		return nil, apiErr
	}
	if serving(sb) {
		return sb, nil
	}
	if !starting(sb) {
		return nil, notReady(agentID, sb)
	}
	wake := func() {
		wakeCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), leaseWriteTimeout)
		s.leases.wake(wakeCtx, sb)
		cancel()
	}
	if p := sb.Status.Phase; p != "" && p != v1alpha1.SandboxPhasePending {
		// A sandbox being created needs no wake-up, and may have no Lease
		// yet.
		wake()
	}
	// A node lost while the call waits (the sandbox was starting on it)
	// parks the sandbox until activity after the loss, which the renewal
	// above may predate: each loss seen gets its own renewal.
	wokenFor := nodeLossKey(sb)

	// Wall-clock time, not s.clock: the wait is for another process.
	timeout := time.NewTimer(s.resumeTimeout)
	defer timeout.Stop()
	tick := time.NewTicker(resumePoll)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil, notReady(agentID, sb)
		case <-timeout.C:
			e := notReady(agentID, sb)
			e.Message += fmt.Sprintf(" (waited %s, the resume timeout, while %s; it goes on, so retry the call)", s.resumeTimeout, stillDoing(sb))
			e.Details["waited"] = s.resumeTimeout.String()
			return nil, e
		case <-tick.C:
		}
		if sb, apiErr = s.agentSandbox(ctx, agentID); apiErr != nil {
			return nil, apiErr
		}
		if serving(sb) {
			return sb, nil
		}
		if !starting(sb) {
			return nil, notReady(agentID, sb)
		}
		if k := nodeLossKey(sb); k != "" && k != wokenFor {
			wokenFor = k
			wake()
		}
	}
}

// stillDoing says what a sandbox that is not serving yet was doing when a
// call gave up waiting for it.
func stillDoing(sb *v1alpha1.Sandbox) string {
	switch sb.Status.Phase {
	case v1alpha1.SandboxPhaseIdleStopping:
		return "its idle stop finished, which the resume follows"
	case v1alpha1.SandboxPhaseStopped:
		return "the resume was about to begin"
	case v1alpha1.SandboxPhaseResuming:
		return "its workspace was being restored from its snapshot"
	case v1alpha1.SandboxPhaseError:
		return "it was being started again after the error its status names"
	}
	return "its pod was starting"
}

// nodeLossKey identifies the node loss a sandbox waits after, empty when it
// waits after none.
func nodeLossKey(sb *v1alpha1.Sandbox) string {
	loss := sb.Status.NodeLoss
	if loss == nil || sb.Status.Phase != v1alpha1.SandboxPhaseError {
		return ""
	}
	key := loss.NodeName + "@" + loss.Time.UTC().Format(time.RFC3339)
	if loss.ActivityTime != nil {
		key += "/" + loss.ActivityTime.UTC().Format(time.RFC3339Nano)
	}
	return key
}

// serving reports whether the sandbox takes calls now.
func serving(sb *v1alpha1.Sandbox) bool {
	ready := meta.FindStatusCondition(sb.Status.Conditions, v1alpha1.ConditionReady)
	return sb.Status.Phase == v1alpha1.SandboxPhaseRunning && ready != nil && ready.Status == metav1.ConditionTrue &&
		sb.Status.ServiceEndpoint != ""
}

// starting reports whether the sandbox will take calls without anyone's
// help: it is stopped (and the call wakes it), being stopped (the resume
// follows), resuming, its pod is being created, or in an Error that the
// next activity ends (v1alpha1.ErrorResumesOnActivity: a lost node, after
// which it resumes on another node, or an idle stop that failed after its
// pod was gone; the call wakes it). Every other Error needs a person, and
// fails the call at once with the condition's message.
func starting(sb *v1alpha1.Sandbox) bool {
	switch sb.Status.Phase {
	case v1alpha1.SandboxPhaseStopped, v1alpha1.SandboxPhaseIdleStopping, v1alpha1.SandboxPhaseResuming:
		return true
	case v1alpha1.SandboxPhaseError:
		// status.nodeLoss too: a retried API error of the controller can
		// stand in the Ready condition for a moment.
		ready := meta.FindStatusCondition(sb.Status.Conditions, v1alpha1.ConditionReady)
		return sb.Status.NodeLoss != nil || (ready != nil && v1alpha1.ErrorResumesOnActivity(ready.Reason))
	case v1alpha1.SandboxPhasePending, "":
		ready := meta.FindStatusCondition(sb.Status.Conditions, v1alpha1.ConditionReady)
		return ready == nil || ready.Reason == v1alpha1.ReasonCreating || ready.Reason == v1alpha1.ReasonAdoptedFromWarmPool
	case v1alpha1.SandboxPhaseRunning:
		// Running but the Ready condition or endpoint lags a moment.
		return true
	}
	return false
}

func notReady(agentID string, sb *v1alpha1.Sandbox) *api.Error {
	ready := meta.FindStatusCondition(sb.Status.Conditions, v1alpha1.ConditionReady)
	phase, reason := string(sb.Status.Phase), ""
	if phase == "" {
		phase = string(v1alpha1.SandboxPhasePending)
	}
	msg := fmt.Sprintf("the sandbox of agent %q is not ready: phase %s", agentID, phase)
	if ready != nil {
		reason = ready.Reason
		msg += ", reason " + ready.Reason
		if ready.Message != "" {
			msg += ": " + ready.Message
		}
	}
	e := api.Errorf(api.CodeSandboxNotReady, "%s", msg)
	e.Details = map[string]string{"phase": phase, "reason": reason}
	return e
}

// agentSandbox returns the live Sandbox that has agentID, in whatever
// phase. An agent has one: of two or more (a second one made by kubectl
// or Terraform, which the controller refuses with DuplicateAgent), the one
// that keeps the agent is served, as the controller decides it.
func (s *Server) agentSandbox(ctx context.Context, agentID string) (*v1alpha1.Sandbox, *api.Error) {
	var list v1alpha1.SandboxList
	// The label narrows the search to the agent's sandboxes; it holds a
	// hash, so spec.agentID is compared too.
	if err := s.sandboxes.List(ctx, &list, client.MatchingLabels{v1alpha1.LabelAgentIDHash: v1alpha1.AgentIDHash(agentID)}); err != nil {
		s.log.Error(err, "list sandboxes", "agent", agentID)
		return nil, api.Errorf(api.CodeInternal, "could not look up the sandbox of agent %q", agentID)
	}
	var live, deleting []*v1alpha1.Sandbox
	for i := range list.Items {
		sb := &list.Items[i]
		if sb.Spec.AgentID != agentID {
			continue
		}
		if sb.DeletionTimestamp != nil {
			deleting = append(deleting, sb)
		} else {
			live = append(live, sb)
		}
	}
	switch {
	case len(live) == 1:
	case len(live) > 1:
		slices.SortFunc(live, func(a, b *v1alpha1.Sandbox) int {
			if v1alpha1.KeepsAgentBefore(a, b) {
				return -1
			}
			return 1
		})
		s.log.V(1).Info("agent has duplicate sandboxes; serving the one that keeps it", "agent", agentID,
			"sandbox", live[0].Namespace+"/"+live[0].Name, "duplicates", len(live)-1)
	case len(deleting) > 0:
		e := api.Errorf(api.CodeSandboxNotReady, "the sandbox of agent %q is being deleted", agentID)
		e.Details = map[string]string{"phase": string(deleting[0].Status.Phase), "reason": "Deleting"}
		return nil, e
	default:
		// Only the requested ID is named: which other sandboxes exist is
		// none of the caller's business.
		return nil, api.Errorf(api.CodeSandboxNotFound, "agent %q has no sandbox", agentID)
	}

	return live[0], nil
}

// supervisorError turns a failed supervisor call into the API's error.
// Codes describing the request (bad cwd, unknown executable) keep the
// supervisor's message as invalid_argument, so they cannot be confused with
// the API's own not-found and permission errors; failures of the supervisor
// itself become supervisor_unavailable.
func supervisorError(ctx context.Context, err error) *api.Error {
	var se *supervisorapi.Error
	if !errors.As(err, &se) {
		if errors.Is(ctx.Err(), context.DeadlineExceeded) {
			return api.Errorf(api.CodeTimeout, "the sandbox did not answer in time")
		}
		return api.Errorf(api.CodeSupervisorUnavailable, "the sandbox's supervisor could not be reached: %v", err)
	}
	switch se.Code {
	case supervisorapi.CodeInvalidArgument, supervisorapi.CodeNotFound, supervisorapi.CodePermissionDenied,
		supervisorapi.CodeEnvBuildFailed:
		return api.Errorf(api.CodeInvalidArgument, "%s", se.Message)
	case supervisorapi.CodePayloadTooLarge:
		return api.Errorf(api.CodePayloadTooLarge, "%s", se.Message)
	case supervisorapi.CodeResourceExhausted:
		return api.Errorf(api.CodeResourceExhausted, "%s", se.Message)
	case supervisorapi.CodeTimeout:
		return api.Errorf(api.CodeTimeout, "%s", se.Message)
	default:
		return api.Errorf(api.CodeSupervisorUnavailable, "the sandbox's supervisor failed: %s: %s", se.Code, se.Message)
	}
}

// logFailure logs server-side failures as errors and caller mistakes at a
// debug level, so that the error log means something is wrong with the
// platform.
func (s *Server) logFailure(log logr.Logger, apiErr *api.Error, cause error) {
	if apiErr.Status >= 500 {
		if cause == nil {
			cause = apiErr
		}
		log.Error(cause, "call failed", "code", string(apiErr.Code))
		return
	}
	log.V(1).Info("call refused", "code", string(apiErr.Code), "message", apiErr.Message)
}

func writeError(w http.ResponseWriter, e *api.Error) {
	status := e.Status
	if status == 0 {
		status = e.Code.HTTPStatus()
	}
	writeJSON(w, status, api.ErrorBody{Error: e})
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	data, err := json.Marshal(v)
	if err != nil {
		// Only a programming error can get here: every value written is a
		// plain struct.
		status = http.StatusInternalServerError
		data = []byte(`{"error":{"code":"internal","message":"could not encode the response"}}`)
	}
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Cache-Control", "no-store")
	w.WriteHeader(status)
	_, _ = w.Write(append(data, '\n'))
}
