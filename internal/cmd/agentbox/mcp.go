package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"strings"

	"github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
)

// maxMCPRequestBytes bounds a JSON-RPC request read from stdin.
const maxMCPRequestBytes = 8 << 20

// mcpCommand: agentbox mcp request, one JSON-RPC request to an MCP server
// of the agent's sandbox.
func mcpCommand(ctx context.Context, args []string, getenv func(string) string, stdin io.Reader, stdout, stderr io.Writer) int {
	if len(args) == 0 || args[0] != "request" {
		fmt.Fprintln(stderr, "usage: agentbox mcp request [flags] AGENT_ID SERVER [REQUEST]")
		return exitUsage
	}
	var userTokenFile string
	return command{
		name:     "mcp request",
		synopsis: "mcp request [flags] AGENT_ID SERVER [REQUEST]",
		doc: `Sends one JSON-RPC request (REQUEST, or stdin when it is absent or -) to the MCP
server SERVER of the agent's sandbox, waking the sandbox, and prints the
server's JSON-RPC response, e.g.

  agentbox mcp request agent-1 github '{"jsonrpc":"2.0","id":1,"method":"tools/list"}'

With a user token (--user-token-file, or the AGENTBOX_USER_TOKEN variable) the
call acts for that user: the API verifies the token for the agent and the
server and the server receives it in the request's params._meta.`,
		flags: func(fs *flag.FlagSet) {
			fs.StringVar(&userTokenFile, "user-token-file", "", `file holding the user token ("agentbox token exchange" prints one) the server receives (default: the AGENTBOX_USER_TOKEN variable)`)
		},
		check: func(args []string) error {
			if err := checkArgs([]string{"AGENT_ID", "SERVER"}, args[:min(len(args), 2)]); err != nil {
				return err
			}
			if len(args) > 3 {
				return fmt.Errorf("unexpected argument %q (want AGENT_ID SERVER [REQUEST])", args[3])
			}
			return nil
		},
		leaseAgent: func(args []string) string { return args[0] },
		run: func(ctx context.Context, c *client.Client, args []string) error {
			token, err := readUserToken(userTokenFile, getenv)
			if err != nil {
				return usageError{err}
			}
			var req []byte
			if len(args) == 3 && args[2] != "-" {
				req = []byte(args[2])
			} else if req, err = io.ReadAll(io.LimitReader(stdin, maxMCPRequestBytes+1)); err != nil {
				return fmt.Errorf("read the request from stdin: %w", err)
			} else if len(req) > maxMCPRequestBytes {
				return usagef("the request on stdin is larger than %d bytes", maxMCPRequestBytes)
			}
			if !json.Valid(req) {
				return usagef("REQUEST is not JSON")
			}
			out, err := c.MCPRequest(ctx, args[0], args[1], json.RawMessage(bytes.TrimSpace(req)), client.WithUserToken(token))
			if err != nil {
				return err
			}
			_, err = fmt.Fprintln(stdout, string(out))
			return err
		},
	}.main(ctx, args[1:], getenv, stderr)
}

// readUserToken prefers --user-token-file to AGENTBOX_USER_TOKEN, as
// readToken does; neither is no token.
func readUserToken(file string, getenv func(string) string) (string, error) {
	if file == "" {
		return strings.TrimSpace(getenv("AGENTBOX_USER_TOKEN")), nil
	}
	data, err := os.ReadFile(file)
	if err != nil {
		return "", fmt.Errorf("read --user-token-file: %w", err)
	}
	t := strings.TrimSpace(string(data))
	if t == "" {
		return "", errors.New("--user-token-file " + file + " is empty")
	}
	return t, nil
}
