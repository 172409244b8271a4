package supervisorapi

// MCPServerConfig is one stdio MCP server the supervisor starts on boot
// and bridges at /mcp/{name}. The control plane hands the supervisor a
// JSON array of them, made from the SandboxTemplate's mcpServers.
type MCPServerConfig struct {
	// Name is the {server} of /mcp/{server}: letters, digits, '.', '_'
	// and '-', starting with a letter or digit, at most 64 bytes.
	Name string `json:"name"`
	// Command is the executable: a path, or a name looked up in the
	// server's PATH (Env over the supervisor's base environment).
	Command string   `json:"command"`
	Args    []string `json:"args,omitempty"`
	// Env is merged over the base environment; the supervisor's own
	// environment is never passed on.
	Env map[string]string `json:"env,omitempty"`
	// Dir is the working directory; empty means the workspace.
	Dir string `json:"dir,omitempty"`
}
