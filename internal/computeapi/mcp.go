package computeapi

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"net/http"
	"strconv"
	"time"

	"k8s.io/apimachinery/pkg/types"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	api "github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
	"github.com/agentbox/terraform-provider-agentbox/internal/computeapi/sandboxstate"
	"github.com/agentbox/terraform-provider-agentbox/internal/store"
)

// MCP through the API: mcp_request forwards one JSON-RPC
// request to a stdio MCP server of the agent's sandbox (waking it), and
// the tool catalog is served from the store, keyed by a hash of the
// server's configuration and the sandbox image, so that listing tools
// never wakes an idle sandbox. A catalog is discovered from a running
// sandbox when missing, or on an explicit refresh (which may wake it).

func (s *Server) mcpRequest(w http.ResponseWriter, r *http.Request) {
	var req json.RawMessage
	if apiErr := s.decode(w, r, &req); apiErr != nil {
		writeError(w, apiErr)
		return
	}
	sup, log, apiErr := s.supervisorFor(r, "mcp_request")
	if apiErr != nil {
		writeError(w, apiErr)
		return
	}
	out, err := sup.MCPRequest(r.Context(), r.PathValue("server"), req)
	if err != nil {
		apiErr := supervisorError(r.Context(), err)
		s.logFailure(log, apiErr, err)
		writeError(w, apiErr)
		return
	}
	writeRawJSON(w, out)
}

// mcpConfigHash keys a server's catalog: the same configuration in the
// same image lists the same tools.
func mcpConfigHash(tpl *v1alpha1.SandboxTemplate, server v1alpha1.MCPServer) string {
	b, _ := json.Marshal(struct {
		Image  string             `json:"image"`
		Server v1alpha1.MCPServer `json:"server"`
	}{tpl.Spec.Image, server})
	sum := sha256.Sum256(b)
	return hex.EncodeToString(sum[:])
}

func (s *Server) mcpTools(w http.ResponseWriter, r *http.Request) {
	agentID, name := r.PathValue("agent_id"), r.PathValue("server")
	if apiErr := s.authorize(r, agentID); apiErr != nil {
		writeError(w, apiErr)
		return
	}
	if s.store == nil {
		writeError(w, api.Errorf(api.CodeUnavailable, "the control plane runs without a store, which tool catalogs are cached in"))
		return
	}
	refresh := false
	if v := r.URL.Query().Get("refresh"); v != "" {
		var err error
		if refresh, err = strconv.ParseBool(v); err != nil {
			writeError(w, api.Errorf(api.CodeInvalidArgument, "refresh must be true or false, got %q", v))
			return
		}
	}
	sb, apiErr := s.agentSandbox(r.Context(), agentID)
	if apiErr == nil {
		apiErr = s.checkHold(r.Context(), sb)
	}
	if apiErr != nil {
		writeError(w, apiErr)
		return
	}
	var tpl v1alpha1.SandboxTemplate
	if err := s.sandboxes.Get(r.Context(), types.NamespacedName{Namespace: sb.Namespace, Name: sb.Spec.TemplateRef.Name}, &tpl); err != nil {
		writeError(w, api.Errorf(api.CodeSandboxNotReady, "the template %s of agent %q's sandbox cannot be read", sb.Spec.TemplateRef.Name, agentID))
		return
	}
	var server *v1alpha1.MCPServer
	for i := range tpl.Spec.MCPServers {
		if tpl.Spec.MCPServers[i].Name == name {
			server = &tpl.Spec.MCPServers[i]
		}
	}
	if server == nil {
		writeError(w, api.Errorf(api.CodeInvalidArgument, "the sandbox's template %s has no MCP server %q", tpl.Name, name))
		return
	}
	hash := mcpConfigHash(&tpl, *server)
	if !refresh {
		c, err := s.store.GetToolCatalog(r.Context(), hash)
		if err == nil {
			writeJSON(w, http.StatusOK, api.MCPToolCatalog{Server: name, ConfigHash: hash, RefreshedAt: c.RefreshedAt, Tools: c.Tools})
			return
		}
		if !errors.Is(err, store.ErrNotFound) {
			s.log.Error(err, "read tool catalog")
			writeError(w, api.Errorf(api.CodeInternal, "could not read the tool catalog"))
			return
		}
		if !sandboxstate.Serving(sb) {
			e := api.Errorf(api.CodeSandboxNotReady, "no tool catalog of MCP server %q is cached and the sandbox is not running; listing tools does not wake it: ask again with refresh=true to wake it and discover them", name)
			e.Details = map[string]string{"phase": string(sb.Status.Phase), "reason": "CatalogNotCached"}
			writeError(w, e)
			return
		}
	} else if sb, apiErr = s.readySandbox(r.Context(), agentID); apiErr != nil {
		writeError(w, apiErr)
		return
	}
	sup, err := s.conns.For(sb)
	if err != nil {
		writeError(w, api.Errorf(api.CodeInternal, "cannot reach the sandbox of agent %q", agentID))
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), time.Minute)
	defer cancel()
	out, err := sup.MCPTools(ctx, name)
	if err != nil {
		writeError(w, supervisorError(ctx, err))
		return
	}
	var body struct {
		Tools json.RawMessage `json:"tools"`
	}
	if err := json.Unmarshal(out, &body); err != nil || len(body.Tools) == 0 {
		writeError(w, api.Errorf(api.CodeSupervisorUnavailable, "the supervisor's tool list of %q is not understood", name))
		return
	}
	c, err := s.store.PutToolCatalog(r.Context(), store.ToolCatalog{ConfigHash: hash, ServerName: name, Tools: body.Tools})
	if err != nil {
		s.log.Error(err, "store tool catalog")
		writeError(w, api.Errorf(api.CodeInternal, "could not store the tool catalog"))
		return
	}
	writeJSON(w, http.StatusOK, api.MCPToolCatalog{Server: name, ConfigHash: hash, RefreshedAt: c.RefreshedAt, Tools: c.Tools, Discovered: true})
}
