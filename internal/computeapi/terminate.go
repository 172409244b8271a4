package computeapi

import (
	"context"
	"net/http"
	"strings"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	api "github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
	"github.com/agentbox/terraform-provider-agentbox/internal/computeapi/holds"
)

// Terminate is the force stop. The API never writes a Sandbox's
// spec, so it has two levers:
//
//   - with a snapshot, the activity clock: its renewTime is set back by the
//     sandbox's idle timeout, so the controller finds the sandbox idle and
//     runs the idle stop it would run an hour later (push, snapshot, pod
//     and claim deleted). The next call resumes it, as after any stop. An
//     agent's hold on the sandbox is released, since a hold would not
//     survive the stop's purpose;
//   - without one, the Sandbox object is deleted; the controller's
//     finalizer removes its snapshots, and owner references its pod,
//     workspace claim and Lease.

// maxTerminateReason bounds the reason, which goes to the log.
const maxTerminateReason = 1024

// defaultIdleTimeout mirrors the controller's default, for a sandbox
// whose template cannot be read.
const defaultIdleTimeout = time.Hour

func (s *Server) terminate(w http.ResponseWriter, r *http.Request) {
	agentID := r.PathValue("agent_id")
	log := s.callLog(r, "terminate").WithValues("agent", agentID)
	if apiErr := s.authorize(r, agentID); apiErr != nil {
		writeError(w, apiErr)
		return
	}
	var req api.TerminateRequest
	if apiErr := s.decode(w, r, &req); apiErr != nil {
		writeError(w, apiErr)
		return
	}
	req.Reason = strings.TrimSpace(req.Reason)
	if req.Reason == "" || len(req.Reason) > maxTerminateReason {
		writeError(w, api.Errorf(api.CodeInvalidArgument, "reason is required and at most %d bytes", maxTerminateReason))
		return
	}
	sb, apiErr := s.agentSandbox(r.Context(), agentID)
	if apiErr == nil {
		apiErr = s.checkHold(r.Context(), sb)
	}
	if apiErr != nil {
		writeError(w, apiErr)
		return
	}
	log = log.WithValues("sandbox", sb.Namespace+"/"+sb.Name, "reason", req.Reason, "snapshot", req.Snapshot)
	res := api.TerminateResult{Reason: req.Reason}
	if req.Snapshot {
		res.Action, apiErr = s.stopWithSnapshot(r.Context(), sb)
	} else {
		res.Action, apiErr = s.deleteSandbox(r.Context(), sb)
	}
	if apiErr != nil {
		s.logFailure(log, apiErr, nil)
		writeError(w, apiErr)
		return
	}
	log.Info("sandbox terminated", "action", res.Action)
	res.Status = statusView(sb)
	writeJSON(w, http.StatusOK, res)
}

func (s *Server) deleteSandbox(ctx context.Context, sb *v1alpha1.Sandbox) (string, *api.Error) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), holds.WriteTimeout)
	defer cancel()
	// The UID precondition keeps a retried call from deleting a sandbox
	// created for the agent since.
	err := s.kube.Delete(ctx, sb, client.Preconditions{UID: ptr.To(sb.UID)})
	if err != nil && !apierrors.IsNotFound(err) {
		s.log.Error(err, "delete sandbox", "sandbox", sb.Namespace+"/"+sb.Name)
		return "", api.Errorf(api.CodeInternal, "could not delete the sandbox of agent %q", sb.Spec.AgentID)
	}
	return api.TerminateDeleted, nil
}

func (s *Server) stopWithSnapshot(ctx context.Context, sb *v1alpha1.Sandbox) (string, *api.Error) {
	idle, apiErr := s.idleTimeout(ctx, sb)
	if apiErr != nil {
		return "", apiErr
	}
	if apiErr := s.holds.EndForStop(ctx, sb, idle); apiErr != nil {
		return "", apiErr
	}
	if sb.Status.Phase == v1alpha1.SandboxPhaseStopped {
		return api.TerminateAlreadyStopped, nil
	}
	return api.TerminateStopping, nil
}

// idleTimeout is the timeout the controller applies to sb: its own, its
// template's, or the default.
func (s *Server) idleTimeout(ctx context.Context, sb *v1alpha1.Sandbox) (time.Duration, *api.Error) {
	if sb.Spec.IdleTimeout != nil && sb.Spec.IdleTimeout.Duration > 0 {
		return sb.Spec.IdleTimeout.Duration, nil
	}
	var tpl v1alpha1.SandboxTemplate
	err := s.sandboxes.Get(ctx, types.NamespacedName{Namespace: sb.Namespace, Name: sb.Spec.TemplateRef.Name}, &tpl)
	switch {
	case apierrors.IsNotFound(err):
		// Without its template the controller does not stop a sandbox.
		return 0, api.Errorf(api.CodeSandboxNotReady, "the template %q of agent %q's sandbox is missing, so it cannot be stopped with a snapshot",
			sb.Spec.TemplateRef.Name, sb.Spec.AgentID)
	case err != nil:
		s.log.Error(err, "get sandbox template", "sandbox", sb.Namespace+"/"+sb.Name)
		return 0, api.Errorf(api.CodeInternal, "could not read the template of agent %q's sandbox", sb.Spec.AgentID)
	case tpl.Spec.IdleTimeout.Duration > 0:
		return tpl.Spec.IdleTimeout.Duration, nil
	}
	return defaultIdleTimeout, nil
}
