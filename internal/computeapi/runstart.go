package computeapi

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"

	api "github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
	"github.com/agentbox/terraform-provider-agentbox/internal/store"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"
)

// Runs started inside the control plane, by a RunSchedule, rather than
// through POST /v1/runs: the same record and executor, with no token. The
// caller is the schedule, and the schedule's namespace bounds which agents
// it may reach, as a Kubernetes user's rights end at the namespace.

// ErrRunsUnavailable means the control plane runs without the store that
// runs are recorded in.
var ErrRunsUnavailable = errors.New("the control plane runs without a store, which runs are recorded in")

// InProcessRun is a run that a part of the control plane starts.
type InProcessRun struct {
	// Caller is recorded as the run's caller, such as "schedule:ns/name".
	Caller string
	// RequestID makes the start idempotent per caller, as in POST /v1/runs.
	RequestID string
	// Schedule is the namespace/name of the RunSchedule that starts it.
	Schedule string
	// Namespace is where the agent's sandbox must be: a sandbox elsewhere
	// is refused (store.ErrInvalid), and none at all lets the run fail
	// with SandboxNotFound, on record.
	Namespace      string
	AgentID        string
	Command        []string
	Env            map[string]string
	Cwd            string
	TimeoutSeconds int
}

// StartRunInProcess records a run and starts its executor, as POST
// /v1/runs does, and returns its record, with created false when the
// caller's request id named a run started before (returned as it stands,
// not started again). Invalid input wraps store.ErrInvalid.
func (s *Server) StartRunInProcess(ctx context.Context, req InProcessRun) (store.Run, bool, error) {
	if s.store == nil {
		return store.Run{}, false, ErrRunsUnavailable
	}
	switch {
	case req.Caller == "" || req.AgentID == "":
		return store.Run{}, false, fmt.Errorf("%w: an in-process run needs a caller and an agent id", store.ErrInvalid)
	case len(req.Command) == 0:
		return store.Run{}, false, fmt.Errorf("%w: command must not be empty", store.ErrInvalid)
	case req.TimeoutSeconds < 0:
		return store.Run{}, false, fmt.Errorf("%w: timeout_seconds must not be negative, got %d", store.ErrInvalid, req.TimeoutSeconds)
	}
	sb, apiErr := s.agentSandbox(ctx, req.AgentID)
	switch {
	case apiErr == nil && req.Namespace != "" && sb.Namespace != req.Namespace:
		return store.Run{}, false, fmt.Errorf("%w: the sandbox of agent %q is in namespace %q, not %q: a schedule reaches only agents of its own namespace",
			store.ErrInvalid, req.AgentID, sb.Namespace, req.Namespace)
	case apiErr != nil && apiErr.Code == api.CodeInternal:
		return store.Run{}, false, apiErr
	}
	timeout := req.TimeoutSeconds
	if timeout == 0 {
		timeout = supervisorapi.DefaultTimeoutSeconds
	}
	run, created, err := s.store.CreateRun(ctx, store.Run{
		RequestID: req.RequestID, Caller: req.Caller, Schedule: req.Schedule, Mode: store.RunModeAgent, AgentID: req.AgentID,
		Command: store.RunCommand{Argv: req.Command, EnvNames: slices.Sorted(maps.Keys(req.Env)), Cwd: req.Cwd, TimeoutSeconds: timeout},
	})
	if err != nil {
		return store.Run{}, false, fmt.Errorf("create run: %w", err)
	}
	if created {
		countRun(metricRunsStarted, run, string(run.Mode))
		s.executeRun(ctx, run, runInput{env: req.Env})
	}
	return run, created, nil
}

// CancelRunInProcess asks for a run to be cancelled on behalf of by, as
// POST /v1/runs/{id}/cancel does: a queued run ends at once, a running one
// this replica executes stops at once, and one another replica executes
// stops at its next heartbeat. A run that had finished is returned
// unchanged, with no error.
func (s *Server) CancelRunInProcess(ctx context.Context, id, by string) (store.Run, error) {
	if s.store == nil {
		return store.Run{}, ErrRunsUnavailable
	}
	run, err := s.store.RequestRunCancel(ctx, id, by)
	switch {
	case errors.Is(err, store.ErrRunFinished):
		return run, nil
	case err != nil:
		return store.Run{}, fmt.Errorf("cancel run %s: %w", id, err)
	}
	s.cancelled(run)
	return run, nil
}
