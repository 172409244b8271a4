package computeapi

import (
	"context"
	"errors"
	"fmt"
	"strings"

	api "github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
	"github.com/agentbox/terraform-provider-agentbox/internal/store"
)

// Runs started inside the control plane, by a RunSchedule, rather than
// through POST /v1/runs: the same checks, record and executor, with no
// token. The caller is the schedule, and the schedule's namespace bounds
// which agents, pools and templates it may reach, as a Kubernetes user's
// rights end at the namespace.

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
	// Namespace bounds where the run goes: the agent's sandbox, the pool
	// or the template must be there. An agent's sandbox elsewhere, or a
	// pool or template of another namespace, is refused (store.ErrInvalid);
	// an agent with no sandbox at all lets the run fail with
	// SandboxNotFound, on record. Empty bounds nothing.
	Namespace string
	// Mode is api.RunModeAgent (the default, with AgentID),
	// api.RunModePool (with Pool) or api.RunModeJob (with Template and
	// the job's options), as POST /v1/runs takes them.
	Mode    string
	AgentID string
	// Pool and Template are namespace/name, as POST /v1/runs takes them.
	Pool                    string
	Template                string
	BackoffLimit            int
	ActiveDeadlineSeconds   int
	TTLSecondsAfterFinished *int
	Command                 []string
	Env                     map[string]string
	Cwd                     string
	TimeoutSeconds          int
}

// StartRunInProcess records a run and starts its executor, as POST
// /v1/runs does, with its checks, and returns its record, with created
// false when the caller's request id named a run started before (returned
// as it stands, not started again). Invalid input wraps store.ErrInvalid.
func (s *Server) StartRunInProcess(ctx context.Context, in InProcessRun) (store.Run, bool, error) {
	if s.store == nil {
		return store.Run{}, false, ErrRunsUnavailable
	}
	if in.Caller == "" {
		return store.Run{}, false, fmt.Errorf("%w: an in-process run needs a caller", store.ErrInvalid)
	}
	req := api.StartRunRequest{
		RequestID: in.RequestID, Mode: in.Mode, AgentID: in.AgentID, Pool: in.Pool, Template: in.Template,
		BackoffLimit: in.BackoffLimit, ActiveDeadlineSeconds: in.ActiveDeadlineSeconds, TTLSecondsAfterFinished: in.TTLSecondsAfterFinished,
		Command: in.Command, Env: in.Env, Cwd: in.Cwd, TimeoutSeconds: in.TimeoutSeconds,
	}
	apiErr := s.checkRunTarget(&req)
	if apiErr == nil {
		apiErr = checkRunCommand(&req)
	}
	if apiErr != nil {
		return store.Run{}, false, fmt.Errorf("%w: %s", store.ErrInvalid, apiErr.Message)
	}
	if err := s.inNamespace(ctx, &req, in.Namespace); err != nil {
		return store.Run{}, false, err
	}
	run, created, err := s.store.CreateRun(ctx, runRecord(&req, in.Caller, in.Schedule, nil))
	if err != nil {
		return store.Run{}, false, fmt.Errorf("create run: %w", err)
	}
	if created {
		countRun(metricRunsStarted, run, string(run.Mode))
		s.executeRun(ctx, run, runInput{env: req.Env})
	}
	return run, created, nil
}

// inNamespace checks that a checked run request goes to ns only: its
// pool's or template's namespace, or its agent's sandbox's (a sandbox
// missing is left to the run, whose record says so).
func (s *Server) inNamespace(ctx context.Context, req *api.StartRunRequest, ns string) error {
	if ns == "" {
		return nil
	}
	switch req.Mode {
	case api.RunModePool, api.RunModeJob:
		field, ref := "pool", req.Pool
		if req.Mode == api.RunModeJob {
			field, ref = "template", req.Template
		}
		if refNS, _, _ := strings.Cut(ref, "/"); refNS != ns {
			return fmt.Errorf("%w: %s %s is in namespace %q, not %q: a schedule reaches only pools and templates of its own namespace",
				store.ErrInvalid, field, ref, refNS, ns)
		}
		return nil
	}
	sb, apiErr := s.agentSandbox(ctx, req.AgentID)
	switch {
	case apiErr == nil && sb.Namespace != ns:
		return fmt.Errorf("%w: the sandbox of agent %q is in namespace %q, not %q: a schedule reaches only agents of its own namespace",
			store.ErrInvalid, req.AgentID, sb.Namespace, ns)
	case apiErr != nil && apiErr.Code == api.CodeInternal:
		return apiErr
	}
	return nil
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
