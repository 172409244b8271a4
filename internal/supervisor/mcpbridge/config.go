package mcpbridge

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"os"
)

// maxConfigBytes bounds the server list file; it is written by the
// control plane from the template, and a few servers fit in far less.
const maxConfigBytes = 1 << 20

// LoadServers reads a JSON array of ServerConfig from path, as the
// supervisor is given it (one file, mounted from the template). Unknown
// fields are errors, so that a misspelt "args" does not start a server
// without its arguments.
func LoadServers(path string) ([]ServerConfig, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("mcp servers: %w", err)
	}
	defer f.Close()
	data, err := io.ReadAll(io.LimitReader(f, maxConfigBytes+1))
	if err != nil {
		return nil, fmt.Errorf("mcp servers: %w", err)
	}
	if len(data) > maxConfigBytes {
		return nil, fmt.Errorf("mcp servers: %s is larger than %d bytes", path, maxConfigBytes)
	}
	return ParseServers(data)
}

// ParseServers decodes a JSON array of ServerConfig.
func ParseServers(data []byte) ([]ServerConfig, error) {
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.DisallowUnknownFields()
	var servers []ServerConfig
	if err := dec.Decode(&servers); err != nil {
		return nil, fmt.Errorf("mcp servers: %w", err)
	}
	if dec.More() {
		return nil, fmt.Errorf("mcp servers: unexpected data after the JSON array")
	}
	return servers, nil
}
