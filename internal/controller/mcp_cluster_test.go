package controller

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/modelcontextprotocol/go-sdk/mcp"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	apiclient "github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
)

// TestMCPOnCluster drives both MCP paths of the Compute API against a
// sandbox in a real gVisor pod: (a) the agent's MCP endpoint with the
// official Go SDK's client (the sandbox's operations as MCP tools, each
// audited as its REST operation, and a call that wakes the stopped
// sandbox), and (b) mcp_request and the tool catalog against a stdio MCP
// server (testdata/mcpcalc, built with the same SDK) that the template
// runs inside the sandbox.
func TestMCPOnCluster(t *testing.T) {
	t.Parallel()
	calc := buildMCPCalc(t)
	// The server's binary is put into the workspace once the sandbox runs;
	// until then the supervisor's bridge fails to start it and retries
	// with backoff, as it would for any server that fails at first.
	const calcPath = "/workspace/mcpcalc"
	e, _, api, sbx := apiSandbox(t, "mcp", func(tpl *v1alpha1.SandboxTemplate) {
		tpl.Spec.MCPServers = []v1alpha1.MCPServer{{Name: "calc", Command: calcPath}}
	})
	agent := sbx.Spec.AgentID
	if !e.workspaceWritable(t, e.supervisor(t, sbx)) {
		t.Skip("the MCP server's binary goes into the workspace")
	}
	ctx := e.ctx

	// (a) The MCP endpoint, stateless streamable HTTP, as any MCP client
	// would use it.
	cs, err := mcp.NewClient(&mcp.Implementation{Name: "cluster-test", Version: "v0"}, nil).Connect(ctx,
		&mcp.StreamableClientTransport{Endpoint: api.Endpoint() + apiclient.PathMCP(agent), HTTPClient: api.MCPHTTPClient()}, nil)
	if err != nil {
		t.Fatalf("connect to the MCP endpoint: %v", err)
	}
	defer cs.Close()
	tools, err := cs.ListTools(ctx, nil)
	must(t, err)
	var names []string
	for _, tool := range tools.Tools {
		names = append(names, tool.Name)
	}
	for _, want := range []string{"run_command", "read_file", "write_file", "delete_file", "python_exec", "execute", "status"} {
		if !slices.Contains(names, want) {
			t.Errorf("tools/list lacks %s: %v", want, names)
		}
	}
	call := func(name string, args map[string]any, out any) {
		t.Helper()
		res, err := cs.CallTool(ctx, &mcp.CallToolParams{Name: name, Arguments: args})
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		raw, _ := json.Marshal(res.StructuredContent)
		if res.IsError {
			text, _ := json.Marshal(res.Content)
			t.Fatalf("%s: tool error %s", name, text)
		}
		must(t, json.Unmarshal(raw, out))
	}
	var cmd apiclient.CommandResult
	call("run_command", map[string]any{"shell": "echo out; echo err >&2; exit 3"}, &cmd)
	if cmd.ExitCode != 3 || cmd.Stdout != "out\n" || cmd.Stderr != "err\n" {
		t.Errorf("run_command: %+v", cmd)
	}
	blob := make([]byte, 64<<10)
	_, _ = rand.Read(blob)
	var fi apiclient.FileInfo
	call("write_file", map[string]any{"path": "data/blob.bin", "content": base64.StdEncoding.EncodeToString(blob), "encoding": "base64"}, &fi)
	var rf struct {
		Content, Encoding string
		Truncated         bool
	}
	call("read_file", map[string]any{"path": "data/blob.bin", "max_bytes": len(blob)}, &rf)
	if back, err := base64.StdEncoding.DecodeString(rf.Content); err != nil || rf.Encoding != "base64" || rf.Truncated || !bytes.Equal(back, blob) {
		t.Errorf("read_file: %d bytes back (want %d identical), %s, truncated %v, %v", len(back), len(blob), rf.Encoding, rf.Truncated, err)
	}
	call("python_exec", map[string]any{"code": "print(sum(range(10)))"}, &cmd)
	if cmd.ExitCode != 0 || cmd.Stdout != "45\n" {
		t.Errorf("python_exec: %+v", cmd)
	}
	var status apiclient.SandboxStatus
	call("status", nil, &status)
	if status.Phase != string(v1alpha1.SandboxPhaseRunning) || !status.Ready {
		t.Errorf("status: %+v", status)
	}
	const greeting = "hello from the Compute API\n"
	call("write_file", map[string]any{"path": "greeting.txt", "content": greeting}, &fi)

	// (b) mcp_request to the template's stdio MCP server, running in the
	// gVisor sandbox. Its binary goes in through the file API.
	f, err := os.Open(calc)
	must(t, err)
	_, err = api.PutFile(ctx, agent, filepath.Base(calcPath), f, 0o755)
	f.Close()
	must(t, err)
	waitCalc := func(when string) {
		t.Helper()
		start := time.Now()
		// The bridge's backoff between starts grows to 30s.
		e.eventually("the stdio MCP server in the sandbox", func() error {
			return mcpCalcAdd(ctx, api, agent)
		})
		t.Logf("the stdio MCP server answered mcp_request %s after %s", when, time.Since(start).Round(time.Millisecond))
	}
	waitCalc("once its binary was put")
	list, err := api.MCPRequest(ctx, agent, "calc", map[string]any{"jsonrpc": "2.0", "id": 1, "method": "tools/list"})
	must(t, err)
	var listed struct {
		Result struct {
			Tools []struct{ Name string } `json:"tools"`
		} `json:"result"`
	}
	if err := json.Unmarshal(list, &listed); err != nil || len(listed.Result.Tools) != 3 {
		t.Errorf("tools/list through mcp_request: %s (%v)", list, err)
	}
	var read struct {
		Result struct {
			StructuredContent struct{ Content string } `json:"structuredContent"`
		} `json:"result"`
	}
	raw, err := api.MCPRequest(ctx, agent, "calc", map[string]any{"jsonrpc": "2.0", "id": 2, "method": "tools/call",
		"params": map[string]any{"name": "read_text", "arguments": map[string]string{"path": "/workspace/greeting.txt"}}})
	must(t, err)
	if err := json.Unmarshal(raw, &read); err != nil || read.Result.StructuredContent.Content != greeting {
		t.Errorf("the stdio server read %s (%v), want the file written through the MCP endpoint", raw, err)
	}
	cat, err := api.MCPTools(ctx, agent, "calc", false)
	if err != nil || !cat.Discovered || !bytes.Contains(cat.Tools, []byte(`"read_text"`)) {
		t.Fatalf("list_mcp_tools: %+v, %v", cat, err)
	}
	if again, err := api.MCPTools(ctx, agent, "calc", false); err != nil || again.Discovered || !bytes.Equal(again.Tools, cat.Tools) {
		t.Errorf("list_mcp_tools again, from the cache: %+v, %v", again, err)
	}

	// A stopped sandbox: status through MCP does not wake it, a command
	// does, and the workspace and the stdio server come back with it.
	_, err = api.Terminate(ctx, agent, apiclient.TerminateRequest{Reason: "test: stop with a snapshot", Snapshot: true})
	must(t, err)
	e.waitPhase("mcp", v1alpha1.SandboxPhaseStopped, v1alpha1.ReasonStopped)
	call("status", nil, &status)
	if status.Phase != string(v1alpha1.SandboxPhaseStopped) {
		t.Errorf("status of the stopped sandbox: %+v", status)
	}
	start := time.Now()
	call("run_command", map[string]any{"command": []string{"cat", "greeting.txt"}}, &cmd)
	if cmd.ExitCode != 0 || cmd.Stdout != greeting {
		t.Errorf("run_command that resumed the sandbox: %+v", cmd)
	}
	t.Logf("the MCP run_command that resumed the stopped sandbox took %s", time.Since(start).Round(time.Millisecond))
	waitCalc("after the resume")

	// The audit log holds each tool call under its REST operation.
	ops := map[string]int{}
	e.eventually("the audit records", func() error {
		page, err := api.QueryAudit(ctx, url.Values{"agent_id": {agent}, "limit": {"1000"}})
		if err != nil {
			return err
		}
		clear(ops)
		for _, r := range page.Records {
			ops[r.Operation]++
		}
		// Each mcp_request reached the stdio server through the
		// supervisor, whose own records follow the API's.
		for op, n := range map[string]int{"mcp": 10, "run_command": 2, "put_file": 3, "get_file": 1, "tool_request": 1,
			"status": 2, "mcp_request": 3, "list_mcp_tools": 2, "supervisor:mcp_call": 3} {
			if ops[op] < n {
				return fmt.Errorf("%d records of %s, want at least %d (have %v)", ops[op], op, n, ops)
			}
		}
		return nil
	})
	if v, err := api.VerifyAudit(ctx); err != nil || !v.OK {
		t.Errorf("audit verify: %+v, %v", v, err)
	}
}

// buildMCPCalc builds testdata/mcpcalc for the sandbox: static, so that it
// needs nothing of the sandbox image.
func buildMCPCalc(t *testing.T) string {
	t.Helper()
	return goBuild(t, "./testdata/mcpcalc", "mcpcalc")
}

// goBuild builds the main package pkg (relative to this package) as a
// static Linux binary, to run on the host or copy into a sandbox.
func goBuild(t *testing.T, pkg, name string) string {
	t.Helper()
	out := filepath.Join(t.TempDir(), name)
	build := exec.Command("go", "build", "-trimpath", "-ldflags=-s -w", "-o", out, pkg)
	build.Env = append(os.Environ(), "CGO_ENABLED=0", "GOOS=linux")
	if msg, err := build.CombinedOutput(); err != nil {
		t.Fatalf("build %s: %v\n%s", pkg, err, msg)
	}
	return out
}

// mcpCalcAdd calls the stdio server's add tool through mcp_request.
func mcpCalcAdd(ctx context.Context, api *apiclient.Client, agent string) error {
	raw, err := api.MCPRequest(ctx, agent, "calc", map[string]any{"jsonrpc": "2.0", "id": 1, "method": "tools/call",
		"params": map[string]any{"name": "add", "arguments": map[string]int{"a": 40, "b": 2}}})
	if err != nil {
		return err
	}
	var res struct {
		Result struct {
			StructuredContent struct{ Sum int } `json:"structuredContent"`
		} `json:"result"`
	}
	if err := json.Unmarshal(raw, &res); err != nil || res.Result.StructuredContent.Sum != 42 {
		return fmt.Errorf("tools/call add answered %s (%v)", raw, err)
	}
	return nil
}
