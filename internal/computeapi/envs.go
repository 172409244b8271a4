package computeapi

import (
	"context"
	"errors"
	"net/http"
	"time"

	api "github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/pyenv"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"
)

// The agent's cached Python environments (/v1/agents/{id}/envs): listed,
// built ahead of the runs that need them, and deleted. They are the
// supervisor's (/v1/envs), forwarded like the other sandbox operations:
// scope, wake, activity and audit are the API's, what an environment is
// the supervisor's.

// envBuildTimeout bounds POST /v1/agents/{id}/envs beyond a wake: the
// supervisor bounds the build itself (its env-create-timeout, five
// minutes by default) and answers timeout; this only guards against a
// supervisor that never answers.
const envBuildTimeout = pyenv.DefaultCreateTimeout + supervisorGrace

// envCallTimeout bounds listing and deleting, which touch no installer.
const envCallTimeout = time.Minute

func (s *Server) listEnvs(w http.ResponseWriter, r *http.Request) {
	sup, log, apiErr := s.supervisorFor(r, "list_envs")
	if apiErr != nil {
		writeError(w, apiErr)
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), envCallTimeout)
	defer cancel()
	list, err := sup.ListEnvs(ctx)
	if err != nil {
		apiErr := envError(ctx, err)
		s.logFailure(log, apiErr, err)
		writeError(w, apiErr)
		return
	}
	writeJSON(w, http.StatusOK, list)
}

func (s *Server) createEnv(w http.ResponseWriter, r *http.Request) {
	var req api.EnvRequest
	if apiErr := s.decode(w, r, &req); apiErr != nil {
		writeError(w, apiErr)
		return
	}
	if req.Name == "" && len(req.Requirements) == 0 {
		writeError(w, api.Errorf(api.CodeInvalidArgument, "an environment needs requirements, or a name (with requirements, or alone for an empty one)"))
		return
	}
	sup, log, apiErr := s.supervisorFor(r, "create_env")
	if apiErr != nil {
		writeError(w, apiErr)
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), envBuildTimeout)
	defer cancel()
	res, err := sup.EnsureEnv(ctx, req)
	if err != nil {
		apiErr := envError(ctx, err)
		s.logFailure(log, apiErr, err)
		writeError(w, apiErr)
		return
	}
	writeJSON(w, http.StatusOK, res)
}

func (s *Server) deleteEnv(w http.ResponseWriter, r *http.Request) {
	sup, log, apiErr := s.supervisorFor(r, "delete_env")
	if apiErr != nil {
		writeError(w, apiErr)
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), envCallTimeout)
	defer cancel()
	info, err := sup.DeleteEnv(ctx, r.PathValue("env"))
	if err != nil {
		apiErr := envError(ctx, err)
		s.logFailure(log, apiErr, err)
		writeError(w, apiErr)
		return
	}
	writeJSON(w, http.StatusOK, info)
}

// envError maps the supervisor's environment errors to the API's: an
// environment that does not exist is env_not_found, an installer that
// failed env_build_failed (with the installer's own error lines), one
// being built when it is deleted resource_exhausted; the rest as for any
// call (a build past its time is timeout).
func envError(ctx context.Context, err error) *api.Error {
	var se *supervisorapi.Error
	if errors.As(err, &se) {
		switch se.Code {
		case supervisorapi.CodeNotFound:
			return api.Errorf(api.CodeEnvNotFound, "%s", se.Message)
		case supervisorapi.CodeEnvBuildFailed:
			return api.Errorf(api.CodeEnvBuildFailed, "%s", se.Message)
		case supervisorapi.CodePermissionDenied:
			return api.Errorf(api.CodePermissionDenied, "%s", se.Message)
		case supervisorapi.CodeUnavailable:
			return api.Errorf(api.CodeUnavailable, "%s", se.Message)
		}
	}
	return supervisorError(ctx, err)
}
