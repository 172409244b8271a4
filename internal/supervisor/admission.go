package supervisor

import (
	"context"
	"net/http"
	"time"

	api "github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"
)

// admit answers apiErr, a failure to prepare a command, or takes one of
// the MaxConcurrentCommands slots for it, waiting its turn if need be.
func (s *Server) admit(ctx context.Context, w http.ResponseWriter, info *requestInfo, apiErr *api.Error) (release func(), ok bool) {
	if apiErr == nil {
		release, apiErr = s.acquire(ctx)
	}
	if apiErr != nil {
		info.Fail(w, apiErr)
		return nil, false
	}
	return release, true
}

// acquire takes one of the MaxConcurrentCommands slots, waiting in the
// queue (see Config.MaxQueuedCommands) while all are taken.
func (s *Server) acquire(ctx context.Context) (release func(), _ *api.Error) {
	if release, apiErr := s.tryAcquire(); apiErr == nil {
		return release, nil
	}
	if int(s.queued.Add(1)) > s.cfg.MaxQueuedCommands {
		s.queued.Add(-1)
		return nil, api.Errorf(api.CodeResourceExhausted, "%d commands are running and %d more are waiting", cap(s.slots), s.cfg.MaxQueuedCommands)
	}
	defer s.queued.Add(-1)
	timer := time.NewTimer(s.cfg.CommandQueueWait)
	defer timer.Stop()
	select {
	case s.slots <- struct{}{}:
		return func() { <-s.slots }, nil
	case <-timer.C:
		return nil, api.Errorf(api.CodeResourceExhausted, "%d commands are running; this one waited %s for its turn", cap(s.slots), s.cfg.CommandQueueWait)
	case <-ctx.Done():
		return nil, api.Errorf(api.CodeResourceExhausted, "the caller went away while %d commands were running", cap(s.slots))
	}
}

// tryAcquire takes a slot only if one is free.
func (s *Server) tryAcquire() (release func(), _ *api.Error) {
	select {
	case s.slots <- struct{}{}:
		return func() { <-s.slots }, nil
	default:
		return nil, api.Errorf(api.CodeResourceExhausted, "%d commands are already running", cap(s.slots))
	}
}
