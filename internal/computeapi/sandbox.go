package computeapi

import (
	"context"
	"fmt"
	"net/http"
	"slices"
	"time"

	"github.com/go-logr/logr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	api "github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
	"github.com/agentbox/terraform-provider-agentbox/internal/computeapi/holds"
	"github.com/agentbox/terraform-provider-agentbox/internal/computeapi/sandboxstate"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"
)

// From an agent to its sandbox: find it, wait until it serves (waking it),
// count the call as activity, and reach its supervisor.

// reach is the one way from an agent to its supervisor, for every call
// that works in the sandbox: wait for the sandbox (waking it; a hold
// refuses the call), count the call as activity for as long as ctx
// lasts, and dial its supervisor, verifying the identity the controller
// recorded, over the connection a warm-up may still be opening. Failures
// are logged on log, which comes back naming the sandbox.
func (s *Server) reach(ctx context.Context, agentID string, log logr.Logger) (*supervisorapi.Client, *v1alpha1.Sandbox, logr.Logger, *api.Error) {
	sb, apiErr := s.readySandbox(ctx, agentID)
	if apiErr != nil {
		s.logFailure(log, apiErr, nil)
		return nil, nil, log, apiErr
	}
	log = log.WithValues("sandbox", sb.Namespace+"/"+sb.Name)
	s.recordActivity(ctx, sb)
	s.conns.AwaitWarm(ctx, sb)
	sup, err := s.conns.For(sb)
	if err != nil {
		apiErr := api.Errorf(api.CodeInternal, "cannot reach the sandbox of agent %q", agentID)
		s.logFailure(log, apiErr, err)
		return nil, nil, log, apiErr
	}
	return sup, sb, log, nil
}

// recordActivity renews the sandbox's activity clock as a call starts,
// and goes on renewing it, at the clock's throttled rate, until the call
// ends (ctx is the request's, which ends with the handler): a terminal, a
// streamed command or a long transfer is use of the sandbox for as long as
// it is open, and must not be idle-stopped under the caller.
func (s *Server) recordActivity(ctx context.Context, sb *v1alpha1.Sandbox) {
	s.renewActivity(ctx, sb)
	if ctx.Done() == nil {
		return
	}
	s.background.Go(func() {
		t := time.NewTicker(s.activity.Interval() / activityTicks)
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
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), holds.WriteTimeout)
	defer cancel()
	s.activity.Renew(ctx, sb)
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

// readySandbox returns agentID's Sandbox once it can take calls. A sandbox
// that is stopped, stopping or starting, or that lost its node, is waited
// for: the call renews its activity clock, which is what wakes a stopped
// sandbox or one that lost its node, and is served when the controller
// reports it running, so the caller sees one slower call rather than an error. A
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
	if sandboxstate.Serving(sb) {
		return sb, nil
	}
	if !sandboxstate.Starting(sb) {
		return nil, sandboxstate.NotReady(agentID, sb)
	}
	wake := func() {
		wakeCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), holds.WriteTimeout)
		s.activity.Wake(wakeCtx, sb)
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
	wokenFor := sandboxstate.NodeLossKey(sb)

	// Wall-clock time, not s.clock: the wait is for another process.
	timeout := time.NewTimer(s.resumeTimeout)
	defer timeout.Stop()
	tick := time.NewTicker(sandboxstate.PollInterval)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil, sandboxstate.NotReady(agentID, sb)
		case <-timeout.C:
			e := sandboxstate.NotReady(agentID, sb)
			e.Message += fmt.Sprintf(" (waited %s, the resume timeout, while %s; it goes on, so retry the call)", s.resumeTimeout, sandboxstate.StillDoing(sb))
			e.Details["waited"] = s.resumeTimeout.String()
			return nil, e
		case <-tick.C:
		}
		if sb, apiErr = s.agentSandbox(ctx, agentID); apiErr != nil {
			return nil, apiErr
		}
		if sandboxstate.Serving(sb) {
			return sb, nil
		}
		if !sandboxstate.Starting(sb) {
			return nil, sandboxstate.NotReady(agentID, sb)
		}
		if k := sandboxstate.NodeLossKey(sb); k != "" && k != wokenFor {
			wokenFor = k
			wake()
		}
	}
}

// agentSandbox returns the live Sandbox that has agentID, in whatever
// phase, in a namespace the platform serves. An agent has one: of two or
// more (a second one made by kubectl or Terraform, which the controller
// refuses with DuplicateAgent), the one that keeps the agent is served, as
// the controller decides it. One found only in a namespace not served is
// answered with NamespaceNotServed: the agent is not this platform's.
func (s *Server) agentSandbox(ctx context.Context, agentID string) (*v1alpha1.Sandbox, *api.Error) {
	var list v1alpha1.SandboxList
	// The label narrows the search to the agent's sandboxes; it holds a
	// hash, so spec.agentID is compared too.
	if err := s.sandboxes.List(ctx, &list, client.MatchingLabels{v1alpha1.LabelAgentIDHash: v1alpha1.AgentIDHash(agentID)}); err != nil {
		s.log.Error(err, "list sandboxes", "agent", agentID)
		return nil, api.Errorf(api.CodeInternal, "could not look up the sandbox of agent %q", agentID)
	}
	var live, deleting, elsewhere []*v1alpha1.Sandbox
	for i := range list.Items {
		sb := &list.Items[i]
		if sb.Spec.AgentID != agentID {
			continue
		}
		switch {
		case !s.serves(sb.Namespace):
			elsewhere = append(elsewhere, sb)
		case sb.DeletionTimestamp != nil:
			deleting = append(deleting, sb)
		default:
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
	case len(elsewhere) > 0:
		e := api.Errorf(api.CodeSandboxNotReady, "the sandbox of agent %q is in namespace %q, which this platform does not serve: "+
			"add it to the platform's sandbox namespaces", agentID, elsewhere[0].Namespace)
		e.Details = map[string]string{"phase": string(v1alpha1.SandboxPhasePending), "reason": v1alpha1.ReasonNamespaceNotServed}
		return nil, e
	default:
		// Only the requested ID is named: which other sandboxes exist is
		// none of the caller's business.
		return nil, api.Errorf(api.CodeSandboxNotFound, "agent %q has no sandbox", agentID)
	}

	return live[0], nil
}
