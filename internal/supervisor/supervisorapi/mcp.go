package supervisorapi

import (
	"context"
	"encoding/json"
	"net/http"
	"net/url"
)

// MCPServerConfig is one MCP server the supervisor bridges at
// /mcp/{name}: a stdio server it starts on boot (Command), or a remote
// one it connects to over Streamable HTTP (URL). The control plane hands
// the supervisor a JSON array of them, made from the SandboxTemplate's
// mcpServers.
type MCPServerConfig struct {
	// Name is the {server} of /mcp/{server}: letters, digits, '.', '_'
	// and '-', starting with a letter or digit, at most 64 bytes.
	Name string `json:"name"`
	// Command is the executable: a path, or a name looked up in the
	// server's PATH (Env over the supervisor's base environment).
	Command string   `json:"command,omitempty"`
	Args    []string `json:"args,omitempty"`
	// Env is merged over the base environment; the supervisor's own
	// environment is never passed on.
	Env map[string]string `json:"env,omitempty"`
	// Dir is the working directory; empty means the workspace.
	Dir string `json:"dir,omitempty"`
	// URL is a remote server's Streamable HTTP endpoint (http or https),
	// reached through the sandbox's egress proxy. It excludes Command,
	// Args, Env and Dir.
	URL string `json:"url,omitempty"`
}

// The user token of an MCP call: the platform-issued JWT that says which
// user the agent acts for (see internal/usertoken).
//
// The control plane verifies the token its caller gave, then sends it to
// the supervisor in HeaderUserToken on POST /mcp/{name}. For a stdio
// server the supervisor puts it into the request's params._meta under
// MetaUserToken, replacing whatever the caller put there, and removes a
// caller's MetaUserToken from a request that came without the header, so
// that only tokens the platform verified reach a server. For a remote
// server it goes out as the Authorization bearer token of that call's
// HTTP requests instead, and a caller's MetaUserToken is removed all the
// same. The token is never put into an environment, a file, a log or an
// audit record.
const (
	HeaderUserToken = "X-Agentbox-User-Token"
	MetaUserToken   = "agentbox.dev/user-token"
)

// MCPOption adds to one MCPRequest.
type MCPOption func(h http.Header)

// WithUserToken sends token, which the caller has verified, as the call's
// user token (HeaderUserToken); an empty token sends none.
func WithUserToken(token string) MCPOption {
	return func(h http.Header) {
		if token != "" {
			h.Set(HeaderUserToken, token)
		}
	}
}

// MCPRequest sends one JSON-RPC request to the MCP server name and
// returns its JSON-RPC response as sent.
func (c *Client) MCPRequest(ctx context.Context, name string, request json.RawMessage, opts ...MCPOption) (json.RawMessage, error) {
	t := c.transport()
	if len(opts) > 0 {
		t.Authorize = func(h http.Header, _ string) {
			for _, o := range opts {
				o(h)
			}
		}
	}
	var out json.RawMessage
	if err := t.Do(ctx, http.MethodPost, "/mcp/"+url.PathEscape(name), request, &out); err != nil {
		return nil, err
	}
	return out, nil
}

// MCPTools returns the supervisor's cached tools/list of the MCP server
// name, as sent ({"server", "tools": [...]}).
func (c *Client) MCPTools(ctx context.Context, name string) (json.RawMessage, error) {
	var out json.RawMessage
	if err := c.do(ctx, http.MethodGet, "/mcp/"+url.PathEscape(name)+"/tools", nil, &out); err != nil {
		return nil, err
	}
	return out, nil
}
