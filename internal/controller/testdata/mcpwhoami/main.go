// Command mcpwhoami is a stdio MCP server built with the official Go SDK
// for the user token cluster test: its whoami tool verifies the user
// token a call carries in params._meta, as a third-party server would,
// against a JWKS file the test put into the sandbox, and answers the
// claims it saw or why it refused them.
package main

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"log"
	"os"
	"sync"
	"time"

	jose "github.com/go-jose/go-jose/v4"
	"github.com/modelcontextprotocol/go-sdk/mcp"

	"github.com/agentbox/terraform-provider-agentbox/internal/usertoken"
)

// metaUserToken is supervisorapi.MetaUserToken, spelled out as a server
// outside the platform would.
const metaUserToken = "agentbox.dev/user-token"

type whoamiIn struct {
	JWKSFile string `json:"jwks_file" jsonschema:"the JWKS of the platform's user tokens"`
	Issuer   string `json:"issuer"`
	Audience string `json:"audience"`
	Agent    string `json:"agent"`
}

type whoamiOut struct {
	// Token says whether the call carried a token.
	Token   bool     `json:"token"`
	Refused string   `json:"refused,omitempty"`
	Sub     string   `json:"sub,omitempty"`
	Act     string   `json:"act,omitempty"`
	Aud     []string `json:"aud,omitempty"`
	JTI     string   `json:"jti,omitempty"`
}

type receivedOut struct {
	// SHA256 holds the hex SHA-256 of every token a call carried: the
	// server keeps no token.
	SHA256 []string `json:"sha256"`
}

func main() {
	var mu sync.Mutex
	received := []string{}
	s := mcp.NewServer(&mcp.Implementation{Name: "mcpwhoami", Version: "1.0.0"}, nil)
	mcp.AddTool(s, &mcp.Tool{Name: "whoami", Description: "verifies the call's user token and answers its claims"},
		func(_ context.Context, req *mcp.CallToolRequest, in whoamiIn) (*mcp.CallToolResult, whoamiOut, error) {
			tok, _ := req.Params.GetMeta()[metaUserToken].(string)
			if tok == "" {
				return nil, whoamiOut{}, nil
			}
			sum := sha256.Sum256([]byte(tok))
			mu.Lock()
			received = append(received, hex.EncodeToString(sum[:]))
			mu.Unlock()
			out := whoamiOut{Token: true}
			data, err := os.ReadFile(in.JWKSFile)
			if err != nil {
				return nil, whoamiOut{}, err
			}
			var set jose.JSONWebKeySet
			if err := json.Unmarshal(data, &set); err != nil {
				return nil, whoamiOut{}, err
			}
			c, err := usertoken.VerifyWithKeys(set, tok, in.Issuer, usertoken.Expectation{Audience: in.Audience, Agent: in.Agent}, time.Now())
			if err != nil {
				out.Refused = err.Error()
				return nil, out, nil
			}
			out.Sub, out.Act, out.Aud, out.JTI = c.Subject, c.Actor.Subject, c.Audience, c.ID
			return nil, out, nil
		})
	mcp.AddTool(s, &mcp.Tool{Name: "received", Description: "the SHA-256 of every token a call carried"},
		func(context.Context, *mcp.CallToolRequest, struct{}) (*mcp.CallToolResult, receivedOut, error) {
			mu.Lock()
			defer mu.Unlock()
			return nil, receivedOut{SHA256: append([]string{}, received...)}, nil
		})
	if err := s.Run(context.Background(), &mcp.StdioTransport{}); err != nil {
		log.Fatal(err)
	}
}
