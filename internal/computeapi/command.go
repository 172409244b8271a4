package computeapi

import (
	"context"
	"encoding/json"
	"net/http"
	"time"

	"github.com/go-logr/logr"

	api "github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"
)

// run_command, answered at once or streamed.

// commandCall is a run_command call checked and bound to its sandbox's
// supervisor, for runCommand and runCommandStream.
type commandCall struct {
	sup *supervisorapi.Client
	req supervisorapi.CommandRequest
	log logr.Logger
	// ctx bounds the call by the command's timeout and a grace.
	ctx    context.Context
	cancel context.CancelFunc
	// ended records the command's end in the agent's events.
	ended func(*supervisorapi.CommandResult, error)
}

// startCommand does what both run_command calls start with: authorize,
// decode and check the request, then reach the supervisor. It answers the
// error itself and returns nil.
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

	sup, sb, log, apiErr := s.reach(r.Context(), agentID, log)
	if apiErr != nil {
		writeError(w, apiErr)
		return nil
	}
	timeout := req.TimeoutSeconds
	if timeout == 0 {
		timeout = supervisorapi.DefaultTimeoutSeconds
	}
	ctx, cancel := context.WithTimeout(r.Context(), time.Duration(timeout)*time.Second+supervisorGrace)
	// The API's run_command request is the supervisor's command request.
	return &commandCall{sup: sup, log: log, ctx: ctx, cancel: cancel, req: req,
		ended: s.commandEvents(sb.Namespace, sb.Name, agentID, req.Command, "")}
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
	call.ended(res, err)
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
	call.ended(res, err)
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
