package execute

import (
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/httpcall"

	"net/http"
	"strings"
	"time"

	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/pyenv"
	api "github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"
)

// ServeEnvs serves /v1/envs and /v1/envs/{name}, every method.
func (x *Service) ServeEnvs(w http.ResponseWriter, r *http.Request, info *httpcall.Info) {
	name := strings.TrimPrefix(strings.TrimPrefix(r.URL.Path, api.PathEnvs), "/")
	if name == "" {
		switch r.Method {
		case http.MethodGet, http.MethodHead:
		case http.MethodPost:
		default:
			httpcall.MethodNotAllowed(w, r, "GET, HEAD, POST")
			return
		}
	} else if r.Method != http.MethodGet && r.Method != http.MethodHead && r.Method != http.MethodDelete {
		httpcall.MethodNotAllowed(w, r, "GET, HEAD, DELETE")
		return
	}
	if x.envs == nil {
		info.Fail(w, api.Errorf(api.CodeUnavailable, "%s", x.envsOff))
		return
	}
	m := x.envs
	switch {
	case name == "" && r.Method == http.MethodPost:
		var req api.EnvRequest
		if !info.Decode(w, r, x.opts.MaxRequestBytes, &req) {
			return
		}
		if x.uv == "" {
			// pip builds from the base interpreter.
			if e := x.needPython("building a Python environment", nil); e != nil {
				info.Fail(w, e)
				return
			}
		}
		start := time.Now()
		pin, created, err := m.Ensure(r.Context(), pyenv.Request{Name: req.Name, Requirements: req.Requirements, IndexURL: req.PythonIndex, CreateEmpty: true})
		if err != nil {
			info.Fail(w, envError(err))
			return
		}
		// Asked for, so it counts as used now, but no run holds it.
		ei := pin.Info()
		pin.Release()
		ei.InUse--
		httpcall.WriteJSON(w, http.StatusOK, api.EnvResult{EnvInfo: envInfo(ei), Created: created, DurationMS: time.Since(start).Milliseconds()})
	case name == "":
		httpcall.WriteJSON(w, http.StatusOK, api.EnvList{Environments: x.envInfos(), EnvCache: envCache(m.Stats())})
	case r.Method == http.MethodDelete:
		ei, err := m.Delete(name)
		if err != nil {
			info.Fail(w, envError(err))
			return
		}
		httpcall.WriteJSON(w, http.StatusOK, envInfo(ei))
	default:
		for _, ei := range m.List() {
			if ei.Name == name {
				httpcall.WriteJSON(w, http.StatusOK, envInfo(ei))
				return
			}
		}
		info.Fail(w, api.Errorf(api.CodeNotFound, "environment %q does not exist", name))
	}
}

func (x *Service) envInfos() []api.EnvInfo {
	list := x.envs.List()
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
		Requirements: nonNil(ei.Requirements), SizeBytes: ei.SizeBytes, InUse: ei.InUse, State: ei.State,
	}
}

func envCache(st pyenv.Stats) api.EnvCache {
	return api.EnvCache{
		Count: st.Count, MaxCount: st.MaxCount, TotalBytes: st.Bytes, MaxBytes: st.MaxBytes,
		Building: st.Building, Installer: st.Installer, TTLSeconds: int64(st.TTL / time.Second),
	}
}

// Health adds the environments to h, the body of /healthz and /health,
// so that the control plane can route a run to a sandbox that has its
// environment; a sandbox that is building one is warming.
func (x *Service) Health(h *api.Health) {
	if x.envs == nil {
		return
	}
	h.Environments = x.envInfos()
	c := envCache(x.envs.Stats())
	h.EnvCache = &c
	if c.Building > 0 {
		h.State = api.StateWarming
	}
}
