package computeapi

import (
	"errors"
	"maps"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"time"

	"k8s.io/apimachinery/pkg/util/validation"

	api "github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
	"github.com/agentbox/terraform-provider-agentbox/internal/computeapi/holds"
	"github.com/agentbox/terraform-provider-agentbox/internal/store"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"
)

// Runs: POST /v1/runs records a run and starts its executor (runexec.go),
// which outlives the call; the other routes read and cancel the record.

// runStore checks that the control plane has the store runs live in.
func (s *Server) runStore() *api.Error {
	if s.store == nil {
		return api.Errorf(api.CodeUnavailable, "the control plane runs without a store, which runs are recorded in")
	}
	return nil
}

func (s *Server) startRun(w http.ResponseWriter, r *http.Request) {
	if apiErr := s.runStore(); apiErr != nil {
		writeError(w, apiErr)
		return
	}
	var req api.StartRunRequest
	if apiErr := s.decode(w, r, &req); apiErr != nil {
		writeError(w, apiErr)
		return
	}
	if apiErr := s.checkRunMode(r, &req); apiErr != nil {
		writeError(w, apiErr)
		return
	}
	if apiErr := checkRunCommand(&req); apiErr != nil {
		writeError(w, apiErr)
		return
	}
	if req.Mode == api.RunModeAgent {
		// A run reaches the agent's sandbox like run_command, so a hold on
		// it refuses a run that does not present the hold's lease ID, at
		// once rather than in the run's record. The executor checks again
		// when the attempt starts (the hold goes on with it), and a sandbox
		// missing now is left to it, whose record says so.
		if sb, apiErr := s.agentSandbox(r.Context(), req.AgentID); apiErr == nil {
			if apiErr := s.checkHold(r.Context(), sb); apiErr != nil {
				writeError(w, apiErr)
				return
			}
		}
	}
	artifacts, apiErr := artifactPatterns(req.Artifacts)
	if apiErr != nil {
		writeError(w, apiErr)
		return
	}
	run, created, err := s.store.CreateRun(r.Context(), runRecord(&req, PrincipalFrom(r.Context()).Name, "", artifacts))
	if apiErr := s.runStoreError(r, "create run", err); apiErr != nil {
		writeError(w, apiErr)
		return
	}
	noteAudit(r.Context(), "run_id", run.ID)
	if !created {
		writeJSON(w, http.StatusOK, wireRun(run))
		return
	}
	countRun(metricRunsStarted, run, string(run.Mode))
	s.executeRun(r.Context(), run, runInput{env: req.Env, stdin: req.Stdin})
	writeJSON(w, http.StatusAccepted, wireRun(run))
}

// checkRunCommand checks the command and the bounds of a run request,
// whoever starts it.
func checkRunCommand(req *api.StartRunRequest) *api.Error {
	switch {
	case len(req.Command) == 0:
		return api.Errorf(api.CodeInvalidArgument, "command must not be empty")
	case req.TimeoutSeconds < 0:
		return api.Errorf(api.CodeInvalidArgument, "timeout_seconds must not be negative, got %d", req.TimeoutSeconds)
	case req.ActiveDeadlineSeconds < 0:
		return api.Errorf(api.CodeInvalidArgument, "active_deadline_seconds must not be negative, got %d", req.ActiveDeadlineSeconds)
	case req.TTLSecondsAfterFinished != nil && *req.TTLSecondsAfterFinished < 0:
		return api.Errorf(api.CodeInvalidArgument, "ttl_seconds_after_finished must not be negative, got %d", *req.TTLSecondsAfterFinished)
	}
	return nil
}

// runRecord is the record of a checked run request, started by caller
// (and by schedule, if a RunSchedule starts it), keeping artifacts.
func runRecord(req *api.StartRunRequest, caller, schedule string, artifacts []string) store.Run {
	timeout := req.TimeoutSeconds
	if timeout == 0 {
		timeout = supervisorapi.DefaultTimeoutSeconds
	}
	return store.Run{
		RequestID: req.RequestID, Caller: caller, WorkflowID: req.WorkflowID, Schedule: schedule,
		Mode: store.RunMode(req.Mode), AgentID: req.AgentID, Pool: req.Pool, Template: req.Template,
		Command: store.RunCommand{Argv: req.Command, EnvNames: slices.Sorted(maps.Keys(req.Env)), Cwd: req.Cwd,
			TimeoutSeconds: timeout, Artifacts: artifacts, PoolRequirements: req.PoolRequirements, PoolEnvName: req.PoolEnvName},
		BackoffLimit: req.BackoffLimit, ActiveDeadlineSeconds: req.ActiveDeadlineSeconds,
		TTLSecondsAfterFinished: req.TTLSecondsAfterFinished,
	}
}

// checkRunMode checks that req names where the run goes (checkRunTarget)
// and that the caller may start a run of its mode.
func (s *Server) checkRunMode(r *http.Request, req *api.StartRunRequest) *api.Error {
	if apiErr := s.checkRunTarget(req); apiErr != nil {
		return apiErr
	}
	if req.Mode == api.RunModeAgent {
		if apiErr := s.authorize(r, req.AgentID); apiErr != nil {
			return apiErr
		}
		noteAuditAgent(r.Context(), req.AgentID)
		return nil
	}
	if p := PrincipalFrom(r.Context()); p == nil || !p.AllAgents {
		// A pool sandbox belongs to no agent until leased, and a job's
		// template decides the namespace, image and limits it runs with:
		// as for pool leases and creating from any template, an admin's
		// call.
		return api.Errorf(api.CodePermissionDenied, "a run of mode %q needs an admin token, as %s does", req.Mode,
			map[string]string{api.RunModePool: "leasing from a warm pool", api.RunModeJob: "creating a sandbox from a chosen template"}[req.Mode])
	}
	return nil
}

// checkRunTarget checks that req names where the run goes in its mode
// (an empty mode is agent), in a namespace the platform serves, and
// nothing of another mode's, whoever starts it: a caller over HTTP or a
// RunSchedule in process.
func (s *Server) checkRunTarget(req *api.StartRunRequest) *api.Error {
	if req.Mode == "" {
		req.Mode = api.RunModeAgent
	}
	refuse := func(field, mode string) *api.Error {
		return api.Errorf(api.CodeInvalidArgument, "%s does not apply to a run of mode %q", field, mode)
	}
	if req.Mode != api.RunModePool && req.Mode != api.RunModeJob && (len(req.PoolRequirements) > 0 || req.PoolEnvName != "") {
		return refuse("pool_requirements and pool_env_name", req.Mode)
	}
	if apiErr := holds.ValidatePoolEnv(api.AcquireLeaseRequest{Requirements: req.PoolRequirements, EnvName: req.PoolEnvName}); apiErr != nil {
		return apiErr
	}
	switch req.Mode {
	case api.RunModeAgent:
		switch {
		case req.Pool != "":
			return refuse("pool", req.Mode)
		case req.Template != "":
			return refuse("template", req.Mode)
		case req.BackoffLimit != 0:
			return refuse("backoff_limit", req.Mode)
		case req.AgentID == "":
			return api.Errorf(api.CodeInvalidArgument, "agent ID must not be empty")
		}
		return nil
	case api.RunModePool, api.RunModeJob:
	default:
		return api.Errorf(api.CodeInvalidArgument, "run mode must be %q, %q or %q, got %q",
			api.RunModeAgent, api.RunModePool, api.RunModeJob, req.Mode)
	}
	if req.AgentID != "" {
		return api.Errorf(api.CodeInvalidArgument,
			"agent_id does not apply to a run of mode %q: its sandbox (and the agent ID it answers to) comes from the %s",
			req.Mode, map[string]string{api.RunModePool: "pool", api.RunModeJob: "template"}[req.Mode])
	}
	ref, field := req.Pool, "pool"
	if req.Mode == api.RunModeJob {
		if req.Pool != "" {
			return refuse("pool", req.Mode)
		}
		ref, field = req.Template, "template"
		if req.BackoffLimit < 0 || req.BackoffLimit > api.MaxRunBackoffLimit {
			return api.Errorf(api.CodeInvalidArgument, "backoff_limit must be between 0 and %d, got %d",
				api.MaxRunBackoffLimit, req.BackoffLimit)
		}
	} else {
		switch {
		case req.Template != "":
			return refuse("template", req.Mode)
		case req.BackoffLimit != 0:
			return refuse("backoff_limit", req.Mode)
		}
	}
	ns, name, ok := strings.Cut(ref, "/")
	if !ok || len(validation.IsDNS1123Label(ns)) > 0 || len(validation.IsDNS1123Subdomain(name)) > 0 {
		return api.Errorf(api.CodeInvalidArgument, "a run of mode %q needs %s as <namespace>/<name>, got %q", req.Mode, field, ref)
	}
	if !s.serves(ns) {
		return api.Errorf(api.CodeInvalidArgument, "the platform does not serve sandboxes in namespace %q (%s %s)", ns, field, ref)
	}
	return nil
}

// runStoreError maps a store error to the API's, logging what is the
// platform's fault; nil for nil.
func (s *Server) runStoreError(r *http.Request, what string, err error) *api.Error {
	switch {
	case err == nil:
		return nil
	case errors.Is(err, store.ErrInvalid):
		return api.Errorf(api.CodeInvalidArgument, "%v", err)
	case errors.Is(err, store.ErrNotFound):
		return api.Errorf(api.CodeNotFound, "no such run")
	}
	s.callLog(r, what).Error(err, what)
	return api.Errorf(api.CodeInternal, "could not %s", what)
}

// visibleRun returns the run id names if the control plane has a store
// and the caller may see it. A run of
// another agent is answered as missing, so that an agent cannot learn
// which run ids exist.
func (s *Server) visibleRun(r *http.Request, id string) (store.Run, *api.Error) {
	if apiErr := s.runStore(); apiErr != nil {
		return store.Run{}, apiErr
	}
	run, err := s.store.GetRun(r.Context(), id)
	if errors.Is(err, store.ErrNotFound) || (err == nil && !PrincipalFrom(r.Context()).MayAccessAgent(run.AgentID)) {
		return store.Run{}, api.Errorf(api.CodeNotFound, "no run %q", id)
	}
	if apiErr := s.runStoreError(r, "read run", err); apiErr != nil {
		return store.Run{}, apiErr
	}
	noteAuditAgent(r.Context(), run.AgentID)
	return run, nil
}

func (s *Server) getRun(w http.ResponseWriter, r *http.Request) {
	run, apiErr := s.visibleRun(r, r.PathValue("run_id"))
	if apiErr != nil {
		writeError(w, apiErr)
		return
	}
	writeJSON(w, http.StatusOK, s.wireRunAttempts(r, run))
}

// wireRunAttempts is wireRun with the run's attempt history. The history
// is best effort: a store that fails to read it leaves it out (and logs
// it) rather than fail the read of the run.
func (s *Server) wireRunAttempts(r *http.Request, run store.Run) api.Run {
	out := wireRun(run)
	attempts, err := s.store.ListRunAttempts(r.Context(), run.ID)
	if err != nil {
		s.callLog(r, "read run attempts").Error(err, "read run attempts", "run", run.ID)
		return out
	}
	for _, a := range attempts {
		out.AttemptHistory = append(out.AttemptHistory, api.RunAttempt{Attempt: a.Attempt, Sandbox: a.Sandbox,
			Status: string(a.Status), ExitCode: a.ExitCode, Reason: a.Reason, Message: a.Message,
			OutputBytes: a.OutputBytes, StartedAt: a.StartedAt, FinishedAt: a.FinishedAt})
	}
	return out
}

func (s *Server) listRuns(w http.ResponseWriter, r *http.Request) {
	if apiErr := s.runStore(); apiErr != nil {
		writeError(w, apiErr)
		return
	}
	q := r.URL.Query()
	f := store.RunFilter{AgentID: q.Get("agent_id"), Status: store.RunStatus(q.Get("status")), Schedule: q.Get("schedule"),
		PageToken: q.Get("page_token")}
	p := PrincipalFrom(r.Context())
	if !p.AllAgents {
		// An agent token lists its own agent's runs, whether or not it
		// says so.
		if f.AgentID != "" && !p.MayAccessAgent(f.AgentID) {
			writeError(w, api.Errorf(api.CodePermissionDenied, "this token may not list the runs of agent %q", f.AgentID))
			return
		}
		if p.AgentID == "" {
			writeError(w, api.Errorf(api.CodePermissionDenied, "this token may list no agent's runs"))
			return
		}
		f.AgentID = p.AgentID
	}
	if v := q.Get("since"); v != "" {
		t, err := time.Parse(time.RFC3339Nano, v)
		if err != nil {
			writeError(w, api.Errorf(api.CodeInvalidArgument, "since must be an RFC 3339 time, got %q", v))
			return
		}
		f.Since = t
	}
	if v := q.Get("limit"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 {
			writeError(w, api.Errorf(api.CodeInvalidArgument, "limit must be a positive integer, got %q", v))
			return
		}
		f.Limit = n
	}
	runs, next, err := s.store.ListRuns(r.Context(), f)
	if apiErr := s.runStoreError(r, "list runs", err); apiErr != nil {
		writeError(w, apiErr)
		return
	}
	out := api.RunList{Runs: make([]api.Run, 0, len(runs)), NextPageToken: next}
	for _, run := range runs {
		out.Runs = append(out.Runs, wireRun(run))
	}
	writeJSON(w, http.StatusOK, out)
}

// cancelRun records who asked for the cancel. A queued run ends at once;
// a running one is stopped by its executor, at once when this replica
// runs it and at its next heartbeat otherwise. A run that had finished is
// answered with its record, unchanged, and 200: the caller wanted it not
// to run, and it does not.
func (s *Server) cancelRun(w http.ResponseWriter, r *http.Request) {
	run, apiErr := s.visibleRun(r, r.PathValue("run_id"))
	if apiErr != nil {
		writeError(w, apiErr)
		return
	}
	run, err := s.store.RequestRunCancel(r.Context(), run.ID, PrincipalFrom(r.Context()).Name)
	if errors.Is(err, store.ErrRunFinished) {
		writeJSON(w, http.StatusOK, s.wireRunAttempts(r, run))
		return
	}
	if apiErr := s.runStoreError(r, "cancel run", err); apiErr != nil {
		writeError(w, apiErr)
		return
	}
	s.cancelled(run)
	writeJSON(w, http.StatusOK, s.wireRunAttempts(r, run))
}

// cancelled acts on a cancel the store has just recorded: a running run's
// executor on this replica stops it at once (another replica's at its
// next heartbeat); a run that was queued has ended cancelled, and its
// streams and metrics learn it here, since no executor will.
func (s *Server) cancelled(run store.Run) {
	if run.Status == store.RunRunning {
		s.execs.cancel(run.ID, run.CancelRequestedBy)
		return
	}
	s.runNotes.notify(run.ID)
	countRun(metricRunsFinished, run, string(run.Status), string(run.Mode))
}

// wireRun is a run's record as the API sends it.
func wireRun(r store.Run) api.Run {
	return api.Run{
		ID: r.ID, RequestID: r.RequestID, Caller: r.Caller, WorkflowID: r.WorkflowID, Schedule: r.Schedule, Mode: string(r.Mode),
		AgentID: r.AgentID, Sandbox: r.Sandbox, Command: r.Command.Argv, EnvNames: r.Command.EnvNames,
		Cwd: r.Command.Cwd, TimeoutSeconds: r.Command.TimeoutSeconds, ArtifactPaths: r.Command.Artifacts,
		Status: string(r.Status), Attempts: r.Attempts,
		ExitCode: r.ExitCode, Reason: r.Reason, Message: r.Message, OutputBytes: r.OutputBytes,
		CancelRequestedBy: r.CancelRequestedBy, CancelledBy: r.CancelledBy, Executor: r.Executor,
		CreatedAt: r.CreatedAt, StartedAt: r.StartedAt, FinishedAt: r.FinishedAt, HeartbeatAt: r.HeartbeatAt,
		Pool: r.Pool, Template: r.Template, BackoffLimit: r.BackoffLimit, ActiveDeadlineSeconds: r.ActiveDeadlineSeconds,
		TTLSecondsAfterFinished: r.TTLSecondsAfterFinished, ExpiresAt: r.ExpiresAt,
	}
}
