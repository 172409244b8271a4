package computeapi

import (
	"context"
	"errors"
	"net/http"

	api "github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
	"github.com/agentbox/terraform-provider-agentbox/internal/filespace"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"
)

// syncFilespace runs sync_filespace: one push or pull between
// the agent's workspace and its filespace in the store.
func (s *Server) syncFilespace(w http.ResponseWriter, r *http.Request) {
	start := s.clock.Now()
	var req api.SyncFilespaceRequest
	if apiErr := s.decode(w, r, &req); apiErr != nil {
		writeError(w, apiErr)
		return
	}
	if req.Direction != api.SyncPush && req.Direction != api.SyncPull {
		writeError(w, api.Errorf(api.CodeInvalidArgument, "direction must be %q or %q, got %q", api.SyncPush, api.SyncPull, req.Direction))
		return
	}
	if s.store == nil {
		writeError(w, api.Errorf(api.CodeUnavailable, "the control plane runs without a store, which holds the filespace"))
		return
	}
	sup, log, apiErr := s.supervisorFor(r, "sync_filespace")
	if apiErr != nil {
		writeError(w, apiErr)
		return
	}
	agentID := r.PathValue("agent_id")
	ctx, cancel := context.WithTimeout(r.Context(), filespace.Timeout)
	defer cancel()
	// No CapBytes: the sync takes the cap the supervisor enforces, which
	// the controller set from the template's workspace size when it made
	// the pod. A template changed since then would name a size the volume
	// does not have; the controller's idle-stop sync does the same.
	sum, err := filespace.Sync(ctx, sup, s.store, filespace.Options{
		AgentID:   agentID,
		Direction: filespace.Direction(req.Direction),
		Now:       s.clock.Now,
	})
	if err != nil {
		apiErr := syncError(ctx, err)
		s.logFailure(log, apiErr, err)
		writeError(w, apiErr)
		return
	}
	out := api.SyncSummary{
		Direction:      string(sum.Direction),
		SyncedAt:       sum.SyncedAt,
		Pushed:         sum.Pushed,
		Pulled:         sum.Pulled,
		Deleted:        sum.Deleted,
		Skipped:        sum.Skipped,
		Unchanged:      sum.Unchanged,
		Bytes:          sum.Bytes,
		WorkspaceBytes: sum.WorkspaceBytes,
		DurationMS:     s.clock.Since(start).Milliseconds(),
	}
	for _, c := range sum.Conflicts {
		out.Conflicts = append(out.Conflicts, api.SyncConflict{Path: c.Path, Winner: c.Winner})
	}
	log.Info("filespace synced", "direction", out.Direction, "pushed", out.Pushed, "pulled", out.Pulled,
		"deleted", out.Deleted, "skipped", out.Skipped, "bytes", out.Bytes, "duration_ms", out.DurationMS)
	writeJSON(w, http.StatusOK, out)
}

func syncError(ctx context.Context, err error) *api.Error {
	switch {
	case errors.Is(err, filespace.ErrWorkspaceOverCap):
		return api.Errorf(api.CodeWorkspaceFull, "%v", err)
	case supervisorapi.CodeOf(err) != "":
		return fileError(ctx, err)
	case errors.Is(ctx.Err(), context.DeadlineExceeded):
		return api.Errorf(api.CodeTimeout, "the sync did not finish in %s", filespace.Timeout)
	default:
		return api.Errorf(api.CodeInternal, "the sync failed: %v", err)
	}
}
