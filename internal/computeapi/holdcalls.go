package computeapi

import (
	"context"
	"net/http"
	"strconv"
	"time"

	"github.com/go-logr/logr"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	api "github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
	"github.com/agentbox/terraform-provider-agentbox/internal/computeapi/holds"
)

// The hold calls: an agent's exclusive hold on its sandbox (acquire,
// heartbeat, release) and the pool lease, a hold on a sandbox taken from
// a warm pool. The wire names both "lease" (the agent's lease paths,
// acquire_lease, Agentbox-Lease-Id, lease_held); package holds keeps them.

func (s *Server) acquireLease(w http.ResponseWriter, r *http.Request) {
	var req api.AcquireLeaseRequest
	sb, log, apiErr := s.holdRequest(w, r, "acquire_lease", &req)
	if apiErr == nil {
		apiErr = holds.ValidateAcquire(&req)
	}
	if apiErr == nil && req.WaitSeconds != 0 {
		apiErr = api.Errorf(api.CodeInvalidArgument, "wait_seconds applies to pool leases only")
	}
	if apiErr == nil && (len(req.Requirements) > 0 || req.EnvName != "") {
		apiErr = api.Errorf(api.CodeInvalidArgument, "requirements and env_name route pool leases only")
	}
	var hold api.Lease
	if apiErr == nil {
		hold, apiErr = s.holds.Acquire(r.Context(), sb, req)
	}
	if apiErr != nil {
		s.logFailure(log, apiErr, nil)
		writeError(w, apiErr)
		return
	}
	log.V(1).Info("lease acquired", "holder", req.Holder, "request_id", req.RequestID)
	writeJSON(w, http.StatusOK, hold)
}

func (s *Server) heartbeatLease(w http.ResponseWriter, r *http.Request) {
	var req api.HeartbeatLeaseRequest
	sb, log, apiErr := s.holdRequest(w, r, "heartbeat_lease", &req)
	if apiErr == nil {
		apiErr = holds.ValidateFields(map[string]string{"holder": req.Holder, "lease_id": req.LeaseID})
	}
	var hold api.Lease
	if apiErr == nil {
		hold, apiErr = s.holds.Heartbeat(r.Context(), sb, req.Holder, req.LeaseID)
	}
	if apiErr != nil {
		s.logFailure(log, apiErr, nil)
		writeError(w, apiErr)
		return
	}
	writeJSON(w, http.StatusOK, hold)
}

func (s *Server) releaseLease(w http.ResponseWriter, r *http.Request) {
	var req api.ReleaseLeaseRequest
	sb, log, apiErr := s.holdRequest(w, r, "release_lease", &req)
	if apiErr == nil {
		apiErr = holds.ValidateFields(map[string]string{"holder": req.Holder, "lease_id": req.LeaseID})
	}
	if apiErr == nil {
		apiErr = s.holds.Release(r.Context(), sb, req.Holder, req.LeaseID)
	}
	if apiErr != nil {
		s.logFailure(log, apiErr, nil)
		writeError(w, apiErr)
		return
	}
	log.V(1).Info("lease released", "holder", req.Holder)
	w.Header().Set("Cache-Control", "no-store")
	w.WriteHeader(http.StatusNoContent)
}

// holdRequest does what every hold call starts with: authorize, decode
// the body and find the agent's sandbox, with its pool lease, if any,
// written into its Lease. The sandbox need not be running: a stopped
// sandbox can be reserved before its first command resumes it.
func (s *Server) holdRequest(w http.ResponseWriter, r *http.Request, op string, into any) (*v1alpha1.Sandbox, logr.Logger, *api.Error) {
	agentID := r.PathValue("agent_id")
	log := s.callLog(r, op).WithValues("agent", agentID)
	if apiErr := s.authorize(r, agentID); apiErr != nil {
		return nil, log, apiErr
	}
	if apiErr := s.decode(w, r, into); apiErr != nil {
		return nil, log, apiErr
	}
	sb, apiErr := s.agentSandbox(r.Context(), agentID)
	if apiErr != nil {
		return nil, log, apiErr
	}
	log = log.WithValues("sandbox", sb.Namespace+"/"+sb.Name)
	if apiErr := s.holds.SettlePending(r.Context(), sb); apiErr != nil {
		return nil, log, apiErr
	}
	return sb, log, nil
}

// acquirePoolLease leases a ready sandbox of a warm pool for one ephemeral
// run (holds.Keeper.AcquirePoolLease).
func (s *Server) acquirePoolLease(w http.ResponseWriter, r *http.Request) {
	ns, pool := r.PathValue("namespace"), r.PathValue("pool")
	log := s.callLog(r, "acquire_pool_lease").WithValues("namespace", ns, "pool", pool)
	req, apiErr := s.poolLeaseRequest(w, r)
	var pl holds.PoolLease
	if apiErr == nil {
		pl, apiErr = s.holds.AcquirePoolLease(r.Context(), ns, pool, req, s.conns.Warm)
	}
	if apiErr != nil {
		if apiErr.Code == api.CodePoolExhausted {
			w.Header().Set("Retry-After", strconv.Itoa(int(holds.PoolExhaustedRetry/time.Second)))
		}
		s.logFailure(log, apiErr, nil)
		writeError(w, apiErr)
		return
	}
	sb := pl.Sandbox
	noteEnvRouting(r.Context(), pl.Routing)
	log.WithValues("sandbox", sb.Name).V(1).Info("pool lease acquired", "holder", req.Holder, "request_id", req.RequestID, "settled", pl.Settled)
	writeJSON(w, http.StatusOK, api.PoolLease{Lease: pl.Lease, AgentID: sb.Spec.AgentID, Namespace: sb.Namespace, Sandbox: sb.Name, Routing: pl.Routing})
}

// poolLeaseRequest checks the caller and decodes and checks a pool
// lease's acquire.
func (s *Server) poolLeaseRequest(w http.ResponseWriter, r *http.Request) (api.AcquireLeaseRequest, *api.Error) {
	var req api.AcquireLeaseRequest
	if p := PrincipalFrom(r.Context()); p == nil || !p.AllAgents {
		// Pool sandboxes belong to no agent until leased, so only a
		// principal that may address every agent can lease them.
		return req, api.Errorf(api.CodePermissionDenied, "leasing from a warm pool needs an admin token")
	}
	if apiErr := s.decode(w, r, &req); apiErr != nil {
		return req, apiErr
	}
	if apiErr := holds.ValidateAcquire(&req); apiErr != nil {
		return req, apiErr
	}
	if apiErr := holds.ValidatePoolEnv(req); apiErr != nil {
		return req, apiErr
	}
	if req.WaitSeconds < 0 || req.WaitSeconds > api.MaxPoolLeaseWaitSeconds {
		return req, api.Errorf(api.CodeInvalidArgument, "wait_seconds must be between 0 and %d, got %d", api.MaxPoolLeaseWaitSeconds, req.WaitSeconds)
	}
	return req, nil
}

// A hold is enforced on every call that reaches a sandbox: while a hold
// is live (its holder set and its expiry ahead), a call is served only if
// it names the hold's ID (the wire's lease ID) in the api.HeaderLeaseID
// header, whoever's token it carries; any other call gets lease_held with
// the holder and the expiry. The hold's ID is the proof, not the token or
// the holder name: one token often serves several runs (an admin token,
// an orchestrator's), holder names are the caller's to choose, and the
// ID is unguessable and given only to the acquirer, which may hand it on
// to whatever acts for it. A call that names a hold that is no longer
// held is served like any other call on a free sandbox: the holder learns
// from its heartbeat that the hold is gone.
//
// Exempt are the hold calls themselves, status (which reads the Sandbox
// only and never wakes it), and the staff console, which passes a hold
// and says so in its audit record. A pool lease is a hold too, from the
// moment the store records the take, before the hold is written into the
// sandbox's Lease.

type holdIDKey struct{}

// withPresentedHold puts the hold ID a call presents into its context.
func withPresentedHold(r *http.Request) *http.Request {
	id := r.Header.Get(api.HeaderLeaseID)
	if id == "" {
		return r
	}
	return r.WithContext(context.WithValue(r.Context(), holdIDKey{}, id))
}

func presentedHold(ctx context.Context) string {
	id, _ := ctx.Value(holdIDKey{}).(string)
	return id
}

type holdBypassKey struct{}

// withHoldBypass marks a call that a hold does not keep out (the staff
// console); checkHold records in its audit entry that it passed one.
func withHoldBypass(ctx context.Context) context.Context {
	return context.WithValue(ctx, holdBypassKey{}, true)
}

// checkHold refuses the call of ctx on sb with lease_held while someone
// holds sb and the call does not present that hold's ID.
func (s *Server) checkHold(ctx context.Context, sb *v1alpha1.Sandbox) *api.Error {
	h, blocked := s.holds.Blocking(ctx, sb, presentedHold(ctx))
	if !blocked {
		return nil
	}
	expires := h.Expires.UTC().Format(time.RFC3339Nano)
	if bypass, _ := ctx.Value(holdBypassKey{}).(bool); bypass {
		noteAudit(ctx, "lease_bypassed", map[string]string{"holder": h.Holder, "expires_at": expires})
		return nil
	}
	e := api.Errorf(api.CodeLeaseHeld, "the sandbox of agent %q is leased by %q until %s; only calls that present that lease's ID (header %s) are served",
		sb.Spec.AgentID, h.Holder, h.Expires.UTC().Format(time.RFC3339), api.HeaderLeaseID)
	e.Details = map[string]string{"holder": h.Holder, "expires_at": expires}
	return e
}
