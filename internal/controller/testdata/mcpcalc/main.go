// Command mcpcalc is a tiny stdio MCP server built with the official Go
// SDK, for the cluster tests: the test builds it, puts it into a gVisor
// sandbox through the Compute API and has the sandbox's template run it,
// then reaches it through mcp_request.
package main

import (
	"context"
	"log"
	"os"

	"github.com/modelcontextprotocol/go-sdk/mcp"
)

type addIn struct {
	A int `json:"a" jsonschema:"first addend"`
	B int `json:"b" jsonschema:"second addend"`
}

type addOut struct {
	Sum int `json:"sum"`
}

type readIn struct {
	Path string `json:"path" jsonschema:"file to read, relative to the server's working directory"`
}

type readOut struct {
	Content string `json:"content"`
}

type getenvIn struct {
	Names []string `json:"names" jsonschema:"environment variables to read"`
}

type getenvOut struct {
	// Values holds the variables that are set.
	Values map[string]string `json:"values"`
}

func main() {
	s := mcp.NewServer(&mcp.Implementation{Name: "mcpcalc", Version: "1.0.0"}, nil)
	mcp.AddTool(s, &mcp.Tool{Name: "add", Description: "adds two integers"},
		func(_ context.Context, _ *mcp.CallToolRequest, in addIn) (*mcp.CallToolResult, addOut, error) {
			return nil, addOut{Sum: in.A + in.B}, nil
		})
	// read_text shows where the server runs: it reads the sandbox's
	// workspace, which the test writes through the API.
	mcp.AddTool(s, &mcp.Tool{Name: "read_text", Description: "returns the content of a text file"},
		func(_ context.Context, _ *mcp.CallToolRequest, in readIn) (*mcp.CallToolResult, readOut, error) {
			b, err := os.ReadFile(in.Path)
			if err != nil {
				return nil, readOut{}, err
			}
			return nil, readOut{Content: string(b)}, nil
		})
	// getenv shows what environment the sandbox gives its MCP servers.
	mcp.AddTool(s, &mcp.Tool{Name: "getenv", Description: "returns the server's environment variables of the names given"},
		func(_ context.Context, _ *mcp.CallToolRequest, in getenvIn) (*mcp.CallToolResult, getenvOut, error) {
			out := getenvOut{Values: map[string]string{}}
			for _, n := range in.Names {
				if v, ok := os.LookupEnv(n); ok {
					out.Values[n] = v
				}
			}
			return nil, out, nil
		})
	if err := s.Run(context.Background(), &mcp.StdioTransport{}); err != nil {
		log.Fatal(err)
	}
}
