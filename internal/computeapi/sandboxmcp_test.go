package computeapi

import (
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"net/http"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/modelcontextprotocol/go-sdk/mcp"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	api "github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/mcpbridge"
)

// envMCPServer makes the test binary a stdio MCP server (built with the
// official SDK) instead of running tests, so that the supervisor's bridge
// has a real server to start.
const envMCPServer = "AGENTBOX_TEST_MCP_SERVER"

func TestMain(m *testing.M) {
	if os.Getenv(envMCPServer) == "1" {
		serveTestMCP()
		return
	}
	os.Exit(m.Run())
}

type addIn struct {
	A int `json:"a"`
	B int `json:"b"`
}

type addOut struct {
	Sum int `json:"sum"`
}

func serveTestMCP() {
	s := mcp.NewServer(&mcp.Implementation{Name: "calc", Version: "1.0.0"}, nil)
	mcp.AddTool(s, &mcp.Tool{Name: "add", Description: "adds two integers"},
		func(_ context.Context, _ *mcp.CallToolRequest, in addIn) (*mcp.CallToolResult, addOut, error) {
			return nil, addOut{Sum: in.A + in.B}, nil
		})
	// user_token answers the user token the call reached the server with
	// (params._meta), "" for none.
	mcp.AddTool(s, &mcp.Tool{Name: "user_token", Description: "returns the call's user token"},
		func(_ context.Context, req *mcp.CallToolRequest, _ struct{}) (*mcp.CallToolResult, userTokenOut, error) {
			tok, _ := req.Params.GetMeta()[api.MetaUserToken].(string)
			return nil, userTokenOut{Token: tok}, nil
		})
	_ = s.Run(context.Background(), &mcp.StdioTransport{})
}

type userTokenOut struct {
	Token string `json:"token"`
}

// TestMCPThroughTheAPI: mcp_request reaches a real stdio MCP server
// through the real supervisor bridge, and the tool catalog is cached by
// configuration so that listing tools does not need the sandbox.
func TestMCPThroughTheAPI(t *testing.T) {
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	server := v1alpha1.MCPServer{Name: "calc", Command: self, Env: map[string]string{envMCPServer: "1"}}
	tpl := &v1alpha1.SandboxTemplate{ObjectMeta: metav1.ObjectMeta{Namespace: "team-a", Name: "python"},
		Spec: v1alpha1.SandboxTemplateSpec{MCPServers: []v1alpha1.MCPServer{server}}}
	mgr, err := mcpbridge.New(mcpbridge.Config{
		Servers: []mcpbridge.ServerConfig{{Name: server.Name, Command: server.Command, Env: server.Env}},
		Logger:  slog.New(slog.NewTextHandler(io.Discard, nil)),
	})
	if err != nil {
		t.Fatal(err)
	}
	mgr.Start(context.Background())
	t.Cleanup(func() { _ = mgr.Stop(context.Background()) })
	st := tempStore(t)
	c := realSupervisorAPI(t, st, func(cfg *supervisor.Config) { cfg.MCP = mgr }, tpl)(adminToken)
	ctx := context.Background()

	// The bridge starts the server in the background; the first calls may
	// find it starting.
	var resp json.RawMessage
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		resp, err = c.MCPRequest(ctx, "agent-1", "calc", map[string]any{
			"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": map[string]any{"name": "add", "arguments": map[string]int{"a": 40, "b": 2}},
		})
		if err == nil || time.Now().After(deadline) {
			break
		}
	}
	if err != nil || !strings.Contains(string(resp), `"sum":42`) {
		t.Fatalf("tools/call add: %s, %v", resp, err)
	}

	first, err := c.MCPTools(ctx, "agent-1", "calc", false)
	if err != nil || !first.Discovered || !strings.Contains(string(first.Tools), `"add"`) || len(first.ConfigHash) != 64 {
		t.Fatalf("first tool listing: %+v, %v", first, err)
	}
	again, err := c.MCPTools(ctx, "agent-1", "calc", false)
	if err != nil || again.Discovered || again.ConfigHash != first.ConfigHash || string(again.Tools) != string(first.Tools) {
		t.Errorf("second listing should come from the cache: %+v, %v", again, err)
	}
	_, err = c.MCPTools(ctx, "agent-1", "nope", false)
	wantAPIError(t, err, api.CodeInvalidArgument, http.StatusBadRequest)
}

// TestMCPToolsDoNotWakeAStoppedSandbox: a stopped sandbox with nothing
// cached is told so, and stays stopped.
func TestMCPToolsDoNotWakeAStoppedSandbox(t *testing.T) {
	tpl := &v1alpha1.SandboxTemplate{ObjectMeta: metav1.ObjectMeta{Namespace: "team-a", Name: "python"},
		Spec: v1alpha1.SandboxTemplateSpec{MCPServers: []v1alpha1.MCPServer{{Name: "calc", Command: "calc"}}}}
	f := newFixture(t, "", tpl)
	var sb v1alpha1.Sandbox
	if err := f.kube.Get(context.Background(), types.NamespacedName{Namespace: "team-a", Name: "sb-1"}, &sb); err != nil {
		t.Fatal(err)
	}
	sb.Status.Phase = v1alpha1.SandboxPhaseStopped
	sb.Status.Conditions = nil
	if err := f.kube.Status().Update(context.Background(), &sb); err != nil {
		t.Fatal(err)
	}
	_, _, client := storeAPI(t, f)
	c := client(adminToken)
	renewed := f.leaseRenewTime(t)
	_, err := c.MCPTools(context.Background(), "agent-1", "calc", false)
	e := wantAPIError(t, err, api.CodeSandboxNotReady, http.StatusConflict)
	if e.Details["reason"] != "CatalogNotCached" {
		t.Errorf("details %v", e.Details)
	}
	if got := f.leaseRenewTime(t); !got.Equal(renewed) {
		t.Errorf("listing tools renewed the Lease (%s -> %s): it would wake the sandbox", renewed, got)
	}
}
