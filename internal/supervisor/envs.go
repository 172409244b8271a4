package supervisor

import (
	"net/http"
	"strings"
	"time"

	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/pyenv"
	api "github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"
)

// serveEnvs serves /v1/envs and /v1/envs/{name}; it reports whether the
// path was one of them.
func (s *Server) serveEnvs(w http.ResponseWriter, r *http.Request, info *requestInfo) bool {
	p := r.URL.Path
	if p != api.PathEnvs && !strings.HasPrefix(p, api.PathEnvs+"/") {
		return false
	}
	name := strings.TrimPrefix(strings.TrimPrefix(p, api.PathEnvs), "/")
	if name == "" {
		switch r.Method {
		case http.MethodGet, http.MethodHead:
		case http.MethodPost:
		default:
			methodNotAllowed(w, r, "GET, HEAD, POST")
			return true
		}
	} else if r.Method != http.MethodGet && r.Method != http.MethodHead && r.Method != http.MethodDelete {
		methodNotAllowed(w, r, "GET, HEAD, DELETE")
		return true
	}
	if s.px.envs == nil {
		info.fail(w, api.Errorf(api.CodeUnavailable, "%s", s.px.envsOff))
		return true
	}
	m := s.px.envs
	switch {
	case name == "" && r.Method == http.MethodPost:
		var req api.EnvRequest
		if !s.decodeRequest(w, r, info, &req) {
			return true
		}
		start := time.Now()
		lease, created, err := m.Ensure(r.Context(), pyenv.Request{Name: req.Name, Requirements: req.Requirements, IndexURL: req.PythonIndex, CreateEmpty: true})
		if err != nil {
			info.fail(w, envError(err))
			return true
		}
		// Asked for, so it counts as used now, but no run holds it.
		ei := lease.Info()
		lease.Release()
		ei.InUse--
		writeJSON(w, http.StatusOK, api.EnvResult{EnvInfo: envInfo(ei), Created: created, DurationMS: time.Since(start).Milliseconds()})
	case name == "":
		writeJSON(w, http.StatusOK, api.EnvList{Environments: s.envInfos(), EnvCache: envCache(m.Stats())})
	case r.Method == http.MethodDelete:
		ei, err := m.Delete(name)
		if err != nil {
			info.fail(w, envError(err))
			return true
		}
		writeJSON(w, http.StatusOK, envInfo(ei))
	default:
		for _, ei := range m.List() {
			if ei.Name == name {
				writeJSON(w, http.StatusOK, envInfo(ei))
				return true
			}
		}
		info.fail(w, api.Errorf(api.CodeNotFound, "environment %q does not exist", name))
	}
	return true
}

func (s *Server) envInfos() []api.EnvInfo {
	list := s.px.envs.List()
	out := make([]api.EnvInfo, len(list))
	for i, ei := range list {
		out[i] = envInfo(ei)
	}
	return out
}

func envInfo(ei pyenv.Info) api.EnvInfo {
	return api.EnvInfo{
		Name: ei.Name, Packages: nonNil(ei.Packages), PythonVersion: ei.PythonVersion,
		CreatedAt: ei.CreatedAt.UTC(), LastUsedAt: ei.LastUsedAt.UTC(),
		Requirements: nonNil(ei.Requirements), SizeBytes: ei.SizeBytes, InUse: ei.InUse,
	}
}

func envCache(st pyenv.Stats) api.EnvCache {
	return api.EnvCache{
		Count: st.Count, MaxCount: st.MaxCount, TotalBytes: st.Bytes, MaxBytes: st.MaxBytes,
		Building: st.Building, Installer: st.Installer,
	}
}

// health is the body of /healthz and /health: the old fields, and the
// sandbox's state, environments, capacity and load, so that the control plane
// can route a run to a sandbox that has its environment.
func (s *Server) health() api.Health {
	h := api.Health{
		Status:        "ok",
		Version:       s.cfg.Version,
		State:         api.StateIdle,
		Capacity:      cap(s.slots),
		CurrentLoad:   len(s.slots),
		UptimeSeconds: int64(time.Since(s.px.started).Seconds()),
	}
	if s.usage != nil {
		h.Workspace = &api.WorkspaceUsage{UsedBytes: s.usage.snapshot(), CapBytes: s.usage.cap}
	}
	if s.px.envs != nil {
		h.Environments = s.envInfos()
		c := envCache(s.px.envs.Stats())
		h.EnvCache = &c
		if c.Building > 0 {
			h.State = api.StateWarming
		}
	}
	if h.CurrentLoad > 0 {
		h.State = api.StateBusy
	}
	return h
}

func isHealthPath(p string) bool {
	return p == api.PathHealth || p == api.PathHealthShort || p == api.PathLive
}
