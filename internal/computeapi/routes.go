package computeapi

import (
	"context"
	"errors"
	"net/http"
	"path"
	"strings"

	api "github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
)

// method is one method of a route: its HTTP verb, the operation it is in
// the audit log, and its handler.
type method struct {
	verb, op string
	serve    http.HandlerFunc
}

// routeTable is the API's handler: every route, and the answers to paths
// that are no route.
func (s *Server) routeTable() http.Handler {
	mux := http.NewServeMux()
	// Each method of a path is its own operation in the audit log; other
	// methods are refused (and audited) as the path's first operation.
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
	s.addRoutes(route)
	s.unauthenticatedRoutes(mux)
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
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if p := r.URL.Path; p != "" && path.Clean(p) != p && !(strings.HasSuffix(p, "/") && path.Clean(p)+"/" == p) {
			unclean.ServeHTTP(w, r)
			return
		}
		mux.ServeHTTP(w, r)
	})
}

// addRoutes declares every route of the API, in the order of the OpenAPI
// document.
func (s *Server) addRoutes(route func(pattern string, methods ...method)) {
	post, del, get := http.MethodPost, http.MethodDelete, http.MethodGet
	route("/v1/openapi.yaml", method{get, "openapi", s.serveOpenAPI})
	route("/v1/agents/{agent_id}/run_command", method{post, "run_command", s.runCommand})
	route("/v1/agents/{agent_id}/run_command/stream", method{post, "run_command_stream", s.runCommandStream})
	route("/v1/agents/{agent_id}/pty", method{get, "run_command_pty", s.agentPTY})
	route("/v1/agents/{agent_id}/lease", method{post, "acquire_lease", s.acquireLease}, method{del, "release_lease", s.releaseLease})
	route("/v1/agents/{agent_id}/lease/heartbeat", method{post, "heartbeat_lease", s.heartbeatLease})
	route("/v1/namespaces/{namespace}/warm-pools/{pool}/leases", method{post, "acquire_pool_lease", s.acquirePoolLease})
	route("/v1/agents/{agent_id}/status", method{get, "status", s.status})
	route("/v1/agents/{agent_id}/events", method{get, "agent_events", s.agentEventStream})
	route("/v1/agents/{agent_id}/deploy_or_resume", method{post, "deploy_or_resume", s.deployOrResume})
	route("/v1/agents/{agent_id}/sync_filespace", method{post, "sync_filespace", s.syncFilespace})
	route("/v1/agents/{agent_id}/terminate", method{post, "terminate", s.terminate})
	route("/v1/agents/{agent_id}/files/{path...}",
		method{http.MethodPut, "put_file", s.putFile}, method{get, "get_file", s.getFile}, method{del, "delete_file", s.deleteFile})
	route("/v1/agents/{agent_id}/tools/{tool}", method{post, "tool_request", s.toolRequest})
	route("/v1/agents/{agent_id}/execute", method{post, "execute", s.execute})
	route("/v1/agents/{agent_id}/envs", method{get, "list_envs", s.listEnvs}, method{post, "create_env", s.createEnv})
	route("/v1/agents/{agent_id}/envs/{env}", method{del, "delete_env", s.deleteEnv})
	route("/v1/agents/{agent_id}/mcp", method{post, "mcp", s.serveMCPEndpoint})
	route("/v1/agents/{agent_id}/mcp/{server}", method{post, "mcp_request", s.sandboxMCPRequest})
	route("/v1/agents/{agent_id}/mcp/{server}/tools", method{get, "list_mcp_tools", s.sandboxMCPTools})
	route("/v1/console/sessions", method{post, "create_console_session", s.createConsoleSession})
	route("/v1/console/sessions/{session_id}", method{get, "get_console_session", s.getConsoleSession})
	route("/v1/console/sessions/{session_id}/pty", method{get, "console_pty", s.consolePTY})
	route("/v1/runs", method{post, "start_run", s.startRun}, method{get, "list_runs", s.listRuns})
	route("/v1/runs/{run_id}", method{get, "get_run", s.getRun})
	route("/v1/runs/{run_id}/cancel", method{post, "cancel_run", s.cancelRun})
	route("/v1/runs/{run_id}/events", method{get, "run_events", s.runEvents})
	route("/v1/runs/{run_id}/artifacts", method{get, "list_run_artifacts", s.listRunArtifacts})
	route("/v1/runs/{run_id}/artifacts/{path...}", method{get, "get_run_artifact", s.getRunArtifact})
	route("/v1/tokens", method{post, "create_token", s.createToken})
	route("/v1/tokens/{token_id}", method{del, "revoke_token", s.revokeToken})
	route("/v1/token", method{post, "exchange_token", s.exchangeToken})
	route("/v1/token/revoke", method{post, "revoke_user_token", s.revokeUserToken})
	route("/v1/audit", method{get, "query_audit", s.queryAudit})
	route("/v1/audit/verify", method{get, "verify_audit", s.verifyAudit})
}

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
			next(w, withPresentedHold(r.WithContext(context.WithValue(r.Context(), principalKey{}, p))))
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
