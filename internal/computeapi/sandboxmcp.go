package computeapi

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"net/http"
	"strconv"
	"strings"
	"time"

	"k8s.io/apimachinery/pkg/types"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	api "github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
	"github.com/agentbox/terraform-provider-agentbox/internal/computeapi/sandboxstate"
	"github.com/agentbox/terraform-provider-agentbox/internal/store"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"
	"github.com/agentbox/terraform-provider-agentbox/internal/usertoken"
)

// The MCP servers in the sandbox, through the API: mcp_request forwards
// one JSON-RPC request to a stdio MCP server of the agent's sandbox
// (waking it), and the tool catalog is served from the store, keyed by a
// hash of the server's configuration and the sandbox image, so that
// listing tools never wakes an idle sandbox. A catalog is discovered from
// a running sandbox when missing, or on an explicit refresh (which may
// wake it). Not to be confused with the API's own MCP endpoint
// (apimcp.go), which offers the sandbox's operations as MCP tools.

func (s *Server) sandboxMCPRequest(w http.ResponseWriter, r *http.Request) {
	var req json.RawMessage
	if apiErr := s.decode(w, r, &req); apiErr != nil {
		writeError(w, apiErr)
		return
	}
	agentID, server := r.PathValue("agent_id"), r.PathValue("server")
	log := s.callLog(r, "mcp_request").WithValues("agent", agentID)
	if apiErr := s.authorize(r, agentID); apiErr != nil {
		writeError(w, apiErr)
		return
	}
	var opts []supervisorapi.MCPOption
	if token := r.Header.Get(api.HeaderUserToken); token != "" {
		if apiErr := s.verifyMCPUserToken(r.Context(), agentID, server, token); apiErr != nil {
			s.logFailure(log, apiErr, nil)
			writeError(w, apiErr)
			return
		}
		opts = append(opts, supervisorapi.WithUserToken(token))
	}
	sup, _, log, apiErr := s.reach(r.Context(), agentID, log)
	if apiErr != nil {
		writeError(w, apiErr)
		return
	}
	out, err := sup.MCPRequest(r.Context(), server, req, opts...)
	if err != nil {
		apiErr := supervisorError(r.Context(), err)
		s.logFailure(log, apiErr, err)
		writeError(w, apiErr)
		return
	}
	writeRawJSON(w, out)
}

// mcpServerAudience is the aud a user token must carry to reach server:
// its audience, or by default a remote server's url (what a server that
// checks tokens knows itself by) and a stdio server's name.
func mcpServerAudience(server v1alpha1.MCPServer) string {
	switch {
	case server.Audience != "":
		return server.Audience
	case server.URL != "":
		return server.URL
	}
	return server.Name
}

// verifyMCPUserToken checks the user token an mcp_request carries for
// agentID's MCP server: issued by this platform, unexpired, not revoked,
// for the agent and for the server's audience. A refusal never echoes the
// token. The call's audit record notes the token's jti and sub.
func (s *Server) verifyMCPUserToken(ctx context.Context, agentID, name, token string) *api.Error {
	if s.userTokenIssuer == nil {
		return api.Errorf(api.CodeUnavailable, "the control plane does not verify user tokens (it runs without a store); send the call without %s", api.HeaderUserToken)
	}
	sb, apiErr := s.agentSandbox(ctx, agentID)
	if apiErr != nil {
		return apiErr
	}
	_, server, apiErr := s.sandboxMCPServer(ctx, sb, name)
	if apiErr != nil {
		return apiErr
	}
	aud := mcpServerAudience(*server)
	c, err := s.userTokenIssuer.Verify(ctx, token, usertoken.Expectation{Agent: agentID, Audience: aud})
	switch {
	case errors.Is(err, usertoken.ErrAudience):
		return api.Errorf(api.CodeInvalidUserToken, "the user token is not for MCP server %q: its audience does not include %q", name, aud)
	case errors.Is(err, usertoken.ErrAgent):
		return api.Errorf(api.CodeInvalidUserToken, "the user token was issued for another agent than %q", agentID)
	case errors.Is(err, usertoken.ErrExpired):
		return api.Errorf(api.CodeInvalidUserToken, "the user token has expired; exchange a new one")
	case errors.Is(err, usertoken.ErrRevoked):
		return api.Errorf(api.CodeInvalidUserToken, "the user token was revoked")
	case errors.Is(err, usertoken.ErrInvalid):
		// The cause (a bad signature, an unknown key, a malformed token)
		// is the verifier's; it does not quote the token.
		return api.Errorf(api.CodeInvalidUserToken, "the user token is not valid: %s",
			strings.TrimPrefix(err.Error(), usertoken.ErrInvalid.Error()+": "))
	case err != nil:
		s.log.Error(err, "verify user token", "agent", agentID)
		return api.Errorf(api.CodeInternal, "could not verify the user token")
	}
	// The audit log gets the token's id and subject, never the token.
	noteAudit(ctx, "jti", c.ID)
	noteAudit(ctx, "sub", c.Subject)
	return nil
}

// sandboxMCPServer returns the template of the sandbox sb and its MCP
// server name.
func (s *Server) sandboxMCPServer(ctx context.Context, sb *v1alpha1.Sandbox, name string) (*v1alpha1.SandboxTemplate, *v1alpha1.MCPServer, *api.Error) {
	var tpl v1alpha1.SandboxTemplate
	if err := s.sandboxes.Get(ctx, types.NamespacedName{Namespace: sb.Namespace, Name: sb.Spec.TemplateRef.Name}, &tpl); err != nil {
		return nil, nil, api.Errorf(api.CodeSandboxNotReady, "the template %s of agent %q's sandbox cannot be read", sb.Spec.TemplateRef.Name, sb.Spec.AgentID)
	}
	for i := range tpl.Spec.MCPServers {
		if tpl.Spec.MCPServers[i].Name == name {
			return &tpl, &tpl.Spec.MCPServers[i], nil
		}
	}
	return nil, nil, api.Errorf(api.CodeInvalidArgument, "the sandbox's template %s has no MCP server %q", tpl.Name, name)
}

// sandboxMCPConfigHash keys a server's catalog: the same configuration in
// the same image lists the same tools.
func sandboxMCPConfigHash(tpl *v1alpha1.SandboxTemplate, server v1alpha1.MCPServer) string {
	b, _ := json.Marshal(struct {
		Image  string             `json:"image"`
		Server v1alpha1.MCPServer `json:"server"`
	}{tpl.Spec.Image, server})
	sum := sha256.Sum256(b)
	return hex.EncodeToString(sum[:])
}

// catalogCall is a list_mcp_tools call checked and bound to the agent's
// sandbox and the MCP server its template configures.
type catalogCall struct {
	agentID, server string
	refresh         bool
	sb              *v1alpha1.Sandbox
	// hash keys the server's catalog (sandboxMCPConfigHash).
	hash string
}

// sandboxMCPTools answers the tool catalog of one of the sandbox's MCP
// servers: the stored one unless the call asks for a refresh, otherwise
// (or when none is stored) one discovered from the running sandbox.
func (s *Server) sandboxMCPTools(w http.ResponseWriter, r *http.Request) {
	c, apiErr := s.catalogRequest(r)
	if apiErr != nil {
		writeError(w, apiErr)
		return
	}
	if !c.refresh {
		cat, found, apiErr := s.storedCatalog(r.Context(), c)
		if apiErr == nil && found {
			writeJSON(w, http.StatusOK, cat)
			return
		}
		if apiErr != nil {
			writeError(w, apiErr)
			return
		}
	} else if c.sb, apiErr = s.readySandbox(r.Context(), c.agentID); apiErr != nil {
		writeError(w, apiErr)
		return
	}
	cat, apiErr := s.discoverCatalog(r.Context(), c)
	if apiErr != nil {
		writeError(w, apiErr)
		return
	}
	writeJSON(w, http.StatusOK, cat)
}

// catalogRequest checks a list_mcp_tools call: the caller's scope, the
// store the catalogs are kept in, the refresh flag, the agent's sandbox
// (which a hold may keep the caller from), and the MCP server its
// template configures.
func (s *Server) catalogRequest(r *http.Request) (catalogCall, *api.Error) {
	c := catalogCall{agentID: r.PathValue("agent_id"), server: r.PathValue("server")}
	if apiErr := s.authorize(r, c.agentID); apiErr != nil {
		return c, apiErr
	}
	if s.store == nil {
		return c, api.Errorf(api.CodeUnavailable, "the control plane runs without a store, which tool catalogs are cached in")
	}
	if v := r.URL.Query().Get("refresh"); v != "" {
		var err error
		if c.refresh, err = strconv.ParseBool(v); err != nil {
			return c, api.Errorf(api.CodeInvalidArgument, "refresh must be true or false, got %q", v)
		}
	}
	var apiErr *api.Error
	c.sb, apiErr = s.agentSandbox(r.Context(), c.agentID)
	if apiErr == nil {
		apiErr = s.checkHold(r.Context(), c.sb)
	}
	if apiErr != nil {
		return c, apiErr
	}
	tpl, server, apiErr := s.sandboxMCPServer(r.Context(), c.sb, c.server)
	if apiErr != nil {
		return c, apiErr
	}
	c.hash = sandboxMCPConfigHash(tpl, *server)
	return c, nil
}

// storedCatalog returns the catalog of c's server kept in the store.
// Without one, found is false if the sandbox runs, for the catalog to be
// discovered; a sandbox that does not is not woken for it.
func (s *Server) storedCatalog(ctx context.Context, c catalogCall) (cat api.MCPToolCatalog, found bool, apiErr *api.Error) {
	stored, err := s.store.GetToolCatalog(ctx, c.hash)
	if err == nil {
		return api.MCPToolCatalog{Server: c.server, ConfigHash: c.hash, RefreshedAt: stored.RefreshedAt, Tools: stored.Tools}, true, nil
	}
	if !errors.Is(err, store.ErrNotFound) {
		s.log.Error(err, "read tool catalog")
		return cat, false, api.Errorf(api.CodeInternal, "could not read the tool catalog")
	}
	if !sandboxstate.Serving(c.sb) {
		e := api.Errorf(api.CodeSandboxNotReady, "no tool catalog of MCP server %q is cached and the sandbox is not running; listing tools does not wake it: ask again with refresh=true to wake it and discover them", c.server)
		e.Details = map[string]string{"phase": string(c.sb.Status.Phase), "reason": "CatalogNotCached"}
		return cat, false, e
	}
	return cat, false, nil
}

// discoverCatalog asks the sandbox's supervisor for the tools of c's
// server, and keeps the answer in the store.
func (s *Server) discoverCatalog(ctx context.Context, c catalogCall) (api.MCPToolCatalog, *api.Error) {
	sup, err := s.conns.For(c.sb)
	if err != nil {
		return api.MCPToolCatalog{}, api.Errorf(api.CodeInternal, "cannot reach the sandbox of agent %q", c.agentID)
	}
	callCtx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	out, err := sup.MCPTools(callCtx, c.server)
	if err != nil {
		return api.MCPToolCatalog{}, supervisorError(callCtx, err)
	}
	var body struct {
		Tools json.RawMessage `json:"tools"`
	}
	if err := json.Unmarshal(out, &body); err != nil || len(body.Tools) == 0 {
		return api.MCPToolCatalog{}, api.Errorf(api.CodeSupervisorUnavailable, "the supervisor's tool list of %q is not understood", c.server)
	}
	stored, err := s.store.PutToolCatalog(ctx, store.ToolCatalog{ConfigHash: c.hash, ServerName: c.server, Tools: body.Tools})
	if err != nil {
		s.log.Error(err, "store tool catalog")
		return api.MCPToolCatalog{}, api.Errorf(api.CodeInternal, "could not store the tool catalog")
	}
	return api.MCPToolCatalog{Server: c.server, ConfigHash: c.hash, RefreshedAt: stored.RefreshedAt, Tools: stored.Tools, Discovered: true}, nil
}
