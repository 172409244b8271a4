package supervisor

import (
	"context"
	"net/http"
	"time"

	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/httpcall"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/runner"
	api "github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/workspace"
)

// The endpoints of commands, and those that hand a call to a room of the
// supervisor (its packages) with what the room needs of the server.

// decode decodes the JSON body into v, answering and recording the error
// if it cannot.
func (s *Server) decode(w http.ResponseWriter, r *http.Request, info *requestInfo, v any) bool {
	return info.Decode(w, r, s.cfg.MaxRequestBytes, v)
}

// serveCommand serves POST /v1/commands and /v1/commands/stream, which
// differ only in where the output goes.
func (s *Server) serveCommand(w *recorder, r *http.Request, info *requestInfo) {
	var req api.CommandRequest
	if !s.decode(w, r, info, &req) {
		return
	}
	info.SetProgram(req.Command)
	spec, apiErr := s.runner.Prepare(&req, s.cfg.DefaultTimeout, s.cfg.MaxTimeout)
	if r.URL.Path == api.PathCommandsStream {
		s.runCommandStream(w, r, info, spec, apiErr)
		return
	}
	s.runCommand(w, r, info, spec, apiErr)
}

// servePython serves python_exec. A snippet is run as a command, through
// the same preparation, process group, output cap and result as
// /v1/commands.
func (s *Server) servePython(w *recorder, r *http.Request, info *requestInfo) {
	var req api.PythonRequest
	if !s.decode(w, r, info, &req) {
		return
	}
	info.Program = s.cfg.Python
	spec, apiErr := s.exec.PreparePython(&req)
	s.runCommand(w, r, info, spec, apiErr)
}

// runCommand runs a prepared command and writes its result; apiErr is a
// failure to prepare it.
func (s *Server) runCommand(w http.ResponseWriter, r *http.Request, info *requestInfo, spec *runner.Spec, apiErr *api.Error) {
	release, ok := s.admit(r.Context(), w, info, apiErr)
	if !ok {
		return
	}
	defer release()
	out := runner.NewOutput(spec.MaxOutput)
	res, apiErr := s.runner.Run(r.Context(), spec, out.Stdout(), out.Stderr())
	if apiErr != nil {
		info.Fail(w, apiErr)
		return
	}
	res.Stdout, res.Stderr, res.Truncated = out.Result()
	info.Result = res
	httpcall.WriteJSON(w, http.StatusOK, res)
}

// runCommandStream is runCommand for /v1/commands/stream: the command is
// prepared, admitted and run exactly as for /v1/commands; only where its
// output goes differs.
func (s *Server) runCommandStream(w http.ResponseWriter, r *http.Request, info *requestInfo, spec *runner.Spec, apiErr *api.Error) {
	release, ok := s.admit(r.Context(), w, info, apiErr)
	if !ok {
		return
	}
	defer release()
	st := runner.NewStream(w, spec.MaxOutput)
	res, apiErr := s.runner.Run(r.Context(), spec, st.Stdout(), st.Stderr())
	if apiErr != nil {
		if !st.Begun() {
			info.Fail(w, apiErr)
			return
		}
		info.Err = apiErr
		st.Send(api.CommandEvent{Error: apiErr})
		return
	}
	res.Truncated = st.Finish()
	info.Result = res
	st.Send(api.CommandEvent{Exit: res})
}

// runCaptured runs a prepared command in one of the concurrent-command
// slots and collects its capped output, as /v1/commands does.
func (s *Server) runCaptured(ctx context.Context, spec *runner.Spec) (*api.CommandResult, *api.Error) {
	release, e := s.acquire(ctx)
	if e != nil {
		return nil, e
	}
	defer release()
	out := runner.NewOutput(spec.MaxOutput)
	res, e := s.runner.Run(ctx, spec, out.Stdout(), out.Stderr())
	if e != nil {
		return nil, e
	}
	res.Stdout, res.Stderr, res.Truncated = out.Result()
	return res, nil
}

// serveHealth serves /healthz and /health: the old fields, and the
// sandbox's state, environments, capacity and load, so that the control
// plane can route a run to a sandbox that has its environment.
func (s *Server) serveHealth(w *recorder, _ *http.Request, _ *requestInfo) {
	h := api.Health{
		Status:        "ok",
		Version:       s.cfg.Version,
		State:         api.StateIdle,
		Capacity:      cap(s.slots),
		CurrentLoad:   len(s.slots),
		UptimeSeconds: int64(time.Since(s.started).Seconds()),
	}
	if s.ws != nil {
		used, capBytes := s.ws.Usage()
		h.Workspace = &api.WorkspaceUsage{UsedBytes: used, CapBytes: capBytes}
	}
	s.exec.Health(&h)
	if h.CurrentLoad > 0 {
		h.State = api.StateBusy
	}
	httpcall.WriteJSON(w, http.StatusOK, h)
}

// serveLive serves /livez. Reaching here took the accept loop, the HTTP
// parser, the router and the lock every call takes (begin): what a wedged
// supervisor would not get through. Nothing more is done, so that the
// probe costs the same whatever the sandbox holds.
func (s *Server) serveLive(w *recorder, _ *http.Request, _ *requestInfo) {
	httpcall.WriteJSON(w, http.StatusOK, map[string]string{"status": "ok"})
}

// serveFlush serves POST /v1/flush.
func (s *Server) serveFlush(w *recorder, _ *http.Request, info *requestInfo) {
	e := api.Errorf(api.CodeNotFound, "the supervisor serves no workspace")
	if s.ws != nil {
		e = s.ws.Flush()
	}
	if e != nil {
		info.Fail(w, e)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

// serveManifest serves GET /v1/manifest/{dir}.
func (s *Server) serveManifest(w *recorder, r *http.Request, info *requestInfo) {
	if s.ws == nil {
		info.Fail(w, workspace.Unavailable())
		return
	}
	s.ws.ServeManifest(w, r, &info.Info)
}

// serveExecute serves POST /v1/execute.
func (s *Server) serveExecute(w *recorder, r *http.Request, info *requestInfo) {
	s.exec.ServeExecute(w, r, &info.Info)
}

// serveEnvs serves /v1/envs and /v1/envs/{name}.
func (s *Server) serveEnvs(w *recorder, r *http.Request, info *requestInfo) {
	s.exec.ServeEnvs(w, r, &info.Info)
}

// servePTY serves GET /v1/pty; the session sends its record itself,
// before it closes.
func (s *Server) servePTY(w *recorder, r *http.Request, info *requestInfo) {
	s.terms.Serve(w, r, &info.Info, func() (string, error) { return api.EncodeAuditRecord(*info.record()) })
}

// serveMCP serves /mcp and everything under it, when the template has MCP
// servers.
func (s *Server) serveMCP(w *recorder, r *http.Request, info *requestInfo) {
	if s.cfg.MCP == nil {
		notFound.serve(w, r, info)
		return
	}
	s.cfg.MCP.ServeHTTP(w, r)
}
