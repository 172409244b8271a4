package computeapi

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/base64"
	"encoding/json"
	"io"
	"maps"
	"net/http"
	"net/url"
	"os/exec"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/modelcontextprotocol/go-sdk/mcp"

	api "github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
)

// connectMCP opens an MCP session with the official SDK's client on the
// agent's endpoint, as c's caller.
func connectMCP(ctx context.Context, c *api.Client, agentID string) (*mcp.ClientSession, error) {
	cl := mcp.NewClient(&mcp.Implementation{Name: "agentbox-test", Version: "v0"}, nil)
	return cl.Connect(ctx, &mcp.StreamableClientTransport{Endpoint: c.Endpoint() + api.PathMCP(agentID), HTTPClient: c.MCPHTTPClient()}, nil)
}

// callTool calls a tool and decodes its structured result into out (when
// not nil); it returns the result for its IsError and text.
func callTool(t *testing.T, cs *mcp.ClientSession, name string, args map[string]any, out any) *mcp.CallToolResult {
	t.Helper()
	res, err := cs.CallTool(context.Background(), &mcp.CallToolParams{Name: name, Arguments: args})
	if err != nil {
		t.Fatalf("%s: protocol error %v", name, err)
	}
	if out != nil && !res.IsError {
		raw, err := json.Marshal(res.StructuredContent)
		if err == nil {
			err = json.Unmarshal(raw, out)
		}
		if err != nil {
			t.Fatalf("%s: structured content %v: %v", name, res.StructuredContent, err)
		}
	}
	return res
}

func toolText(res *mcp.CallToolResult) string {
	var b strings.Builder
	for _, c := range res.Content {
		if tc, ok := c.(*mcp.TextContent); ok {
			b.WriteString(tc.Text)
		}
	}
	return b.String()
}

// TestMCPEndpoint drives the agent's MCP endpoint with the official Go
// SDK's client against the API in front of the real supervisor: the tools
// do what their REST operations do, each call is audited as that
// operation, and another agent's token is refused exactly as for an agent
// that does not exist.
func TestMCPEndpoint(t *testing.T) {
	st := tempStore(t)
	clients := realSupervisorAPI(t, st, nil)
	ctx := context.Background()
	agent := clients("agent-token:agent-1")
	cs, err := connectMCP(ctx, agent, "agent-1")
	if err != nil {
		t.Fatalf("connect: %v", err)
	}
	t.Cleanup(func() { cs.Close() })

	tools, err := cs.ListTools(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, tool := range tools.Tools {
		names = append(names, tool.Name)
		schema, _ := json.Marshal(tool.InputSchema)
		if tool.Description == "" || !bytes.Contains(schema, []byte(`"type":"object"`)) {
			t.Errorf("tool %s: description %q, input schema %s", tool.Name, tool.Description, schema)
		}
	}
	slices.Sort(names)
	if want := []string{"delete_file", "execute", "mcp_request", "python_exec", "read_file", "run_command", "status", "write_file"}; !slices.Equal(names, want) {
		t.Errorf("tools %v, want %v", names, want)
	}

	// Counted as the audit log should count them, by REST operation.
	wantOps := map[string]int{}

	var cmd api.CommandResult
	res := callTool(t, cs, "run_command", map[string]any{"command": []string{"sh", "-c", "echo out; echo err >&2"}}, &cmd)
	wantOps["run_command"]++
	if res.IsError || cmd.Stdout != "out\n" || cmd.Stderr != "err\n" || cmd.ExitCode != 0 {
		t.Errorf("run_command: %+v (%s)", cmd, toolText(res))
	}
	res = callTool(t, cs, "run_command", map[string]any{"shell": "echo $GREETING; exit 7", "env": map[string]string{"GREETING": "hi"}}, &cmd)
	wantOps["run_command"]++
	if res.IsError || cmd.ExitCode != 7 || cmd.Stdout != "hi\n" {
		t.Errorf("a non-zero exit is a result, not a tool error: %+v (%s)", cmd, toolText(res))
	}
	// Refused before any REST call: no audit record.
	if res := callTool(t, cs, "run_command", map[string]any{"command": []string{"true"}, "shell": "true"}, nil); !res.IsError {
		t.Errorf("command and shell together: %s", toolText(res))
	}

	blob := make([]byte, 256<<10)
	if _, err := rand.Read(blob); err != nil {
		t.Fatal(err)
	}
	var fi api.FileInfo
	res = callTool(t, cs, "write_file", map[string]any{"path": "data/blob.bin", "content": base64.StdEncoding.EncodeToString(blob), "encoding": "base64", "mode": "0600"}, &fi)
	wantOps["put_file"]++
	if res.IsError || fi.Size != int64(len(blob)) || fi.Mode != "0600" {
		t.Fatalf("write_file: %+v (%s)", fi, toolText(res))
	}
	var rf mcpReadFileOutput
	res = callTool(t, cs, "read_file", map[string]any{"path": "data/blob.bin", "max_bytes": len(blob)}, &rf)
	wantOps["get_file"]++
	got, err := base64.StdEncoding.DecodeString(rf.Content)
	if res.IsError || err != nil || rf.Encoding != "base64" || rf.Truncated || !bytes.Equal(got, blob) {
		t.Fatalf("read_file of binary data: %d bytes back (want %d identical), encoding %s, truncated %v, %v (%s)",
			len(got), len(blob), rf.Encoding, rf.Truncated, err, toolText(res))
	}
	const text = "héllo, wörld\n"
	callTool(t, cs, "write_file", map[string]any{"path": "notes.txt", "content": text}, nil)
	wantOps["put_file"]++
	res = callTool(t, cs, "read_file", map[string]any{"path": "notes.txt"}, &rf)
	wantOps["get_file"]++
	if res.IsError || rf.Encoding != "utf-8" || rf.Content != text || rf.Truncated {
		t.Errorf("read_file of text: %+v (%s)", rf, toolText(res))
	}
	// A cut inside "é" still reads as text, without the partial character.
	res = callTool(t, cs, "read_file", map[string]any{"path": "notes.txt", "max_bytes": 2}, &rf)
	wantOps["get_file"]++
	if res.IsError || rf.Encoding != "utf-8" || rf.Content != "h" || !rf.Truncated {
		t.Errorf("read_file of a cut text: %+v (%s)", rf, toolText(res))
	}
	// A REST error is a tool error naming the API's code.
	res = callTool(t, cs, "read_file", map[string]any{"path": "missing.txt", "max_bytes": 1}, nil)
	wantOps["get_file"]++
	if !res.IsError || !strings.HasPrefix(toolText(res), string(api.CodeFileNotFound)+":") {
		t.Errorf("read_file of a missing file: error %v, %q", res.IsError, toolText(res))
	}
	var del mcpDeleteFileOutput
	if res := callTool(t, cs, "delete_file", map[string]any{"path": "notes.txt"}, &del); res.IsError || !del.Deleted {
		t.Errorf("delete_file: %+v (%s)", del, toolText(res))
	}
	wantOps["delete_file"]++

	var status api.SandboxStatus
	res = callTool(t, cs, "status", nil, &status)
	wantOps["status"]++
	if res.IsError || status.Phase != "Running" || !status.Ready || status.Name != "sb-1" {
		t.Errorf("status: %+v (%s)", status, toolText(res))
	}

	if _, err := exec.LookPath("python3"); err == nil {
		res = callTool(t, cs, "python_exec", map[string]any{"code": "import sys; print(6*7); sys.exit(3)"}, &cmd)
		wantOps["tool_request"]++
		if res.IsError || cmd.Stdout != "42\n" || cmd.ExitCode != 3 {
			t.Errorf("python_exec: %+v (%s)", cmd, toolText(res))
		}
		var ex struct {
			Status        string            `json:"status"`
			Output        string            `json:"output"`
			FilesProduced map[string][]byte `json:"files_produced"`
		}
		res = callTool(t, cs, "execute", map[string]any{
			"code":  "print(open('in.txt').read().upper()); open('out.txt','w').write('made')",
			"files": map[string]string{"in.txt": base64.StdEncoding.EncodeToString([]byte("inline"))},
		}, &ex)
		wantOps["execute"]++
		if res.IsError || ex.Status != "success" || ex.Output != "INLINE\n" || string(ex.FilesProduced["out.txt"]) != "made" {
			t.Errorf("execute: %+v (%s)", ex, toolText(res))
		}
	} else {
		t.Log("no python3: python_exec and execute not called")
	}

	// Another agent's token is refused on agent-1's endpoint exactly as on
	// one whose agent has no sandbox; the error names only the requested
	// agent.
	other := clients("agent-token:agent-2")
	refusal := func(agentID string) (string, string) {
		_, connErr := connectMCP(ctx, other, agentID)
		if connErr == nil {
			t.Fatalf("agent-2's token connected to %s's MCP endpoint", agentID)
		}
		body := `{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"status","arguments":{}}}`
		req, _ := http.NewRequest(http.MethodPost, other.Endpoint()+api.PathMCP(agentID), strings.NewReader(body))
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Accept", "application/json, text/event-stream")
		resp, err := other.MCPHTTPClient().Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		raw, _ := io.ReadAll(resp.Body)
		rest := strings.Join([]string{resp.Status, resp.Header.Get("Content-Type"), string(raw)}, " ")
		return strings.ReplaceAll(connErr.Error(), agentID, "AGENT"), strings.ReplaceAll(rest, agentID, "AGENT")
	}
	connA, restA := refusal("agent-1")
	connB, restB := refusal("agent-404")
	if connA != connB || restA != restB {
		t.Errorf("refusals differ:\n  agent-1:   %s | %s\n  agent-404: %s | %s", connA, restA, connB, restB)
	}
	if !strings.Contains(restA, "403") || !strings.Contains(restA, string(api.CodePermissionDenied)) {
		t.Errorf("refusal: %s", restA)
	}
	// The admin may address any agent, and learns that agent-404 has no
	// sandbox when it connects, not on each tool call.
	if _, err := connectMCP(ctx, clients(adminToken), "agent-404"); err == nil || !strings.Contains(err.Error(), "Not Found") {
		t.Errorf("connect to an agent without a sandbox: %v", err)
	}

	// One audit record per tool call under its REST operation, as agent-1's
	// caller, carrying the request ID of the MCP POST that made it; each
	// that reached the sandbox followed by the supervisor's own record.
	for op, sup := range map[string]string{"run_command": "supervisor:run_command", "put_file": "supervisor:write_file",
		"get_file": "supervisor:read_file", "delete_file": "supervisor:delete_file", "tool_request": "supervisor:python_exec",
		"execute": "supervisor:execute"} {
		if n := wantOps[op]; n > 0 {
			wantOps[sup] = n
		}
	}
	admin := clients(adminToken)
	var records []api.AuditRecord
	deadline := time.Now().Add(10 * time.Second)
	for {
		page, err := admin.QueryAudit(ctx, url.Values{"agent_id": {"agent-1"}, "limit": {"500"}})
		if err != nil {
			t.Fatal(err)
		}
		records = page.Records
		n := 0
		for _, r := range records {
			if wantOps[r.Operation] > 0 {
				n++
			}
		}
		if sum(wantOps) <= n || time.Now().After(deadline) {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	gotOps := map[string]int{}
	mcpPosts := map[string]bool{}
	for _, r := range records {
		if r.Operation == "mcp" && r.Caller == "agent agent-1" && r.Result == resultOK {
			mcpPosts[r.RequestID] = true
		}
	}
	for _, r := range records {
		if r.Operation == "mcp" {
			continue
		}
		gotOps[r.Operation]++
		if r.Caller != "agent agent-1" || !mcpPosts[r.RequestID] {
			t.Errorf("audit record %+v: want agent-1's caller and the request ID of an MCP POST", r)
		}
	}
	if !maps.Equal(gotOps, wantOps) {
		t.Errorf("audited operations %v, want %v", gotOps, wantOps)
	}
}

func sum(m map[string]int) int {
	n := 0
	for _, v := range m {
		n += v
	}
	return n
}

// TestMCPToolCallsPushTheWorkspace: a write through the MCP endpoint
// schedules the filespace push as the REST call does.
func TestMCPToolCallsPushTheWorkspace(t *testing.T) {
	st := tempStore(t)
	c := realSupervisorAPIWith(t, apiSetup{store: st, pushDelay: 100 * time.Millisecond})(adminToken)
	ctx := context.Background()
	cs, err := connectMCP(ctx, c, "agent-1")
	if err != nil {
		t.Fatal(err)
	}
	defer cs.Close()
	if res := callTool(t, cs, "write_file", map[string]any{"path": "pushed.txt", "content": "via mcp"}, nil); res.IsError {
		t.Fatal(toolText(res))
	}
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		f, err := st.GetFile(ctx, "agent-1", "pushed.txt")
		if err == nil && f.SizeBytes == int64(len("via mcp")) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the MCP write did not reach the filespace: %+v, %v", f, err)
		}
	}
}

// TestMCPEndpointWithAnOlderProtocol: a client of the 2025 protocol
// versions, which keeps no session with a stateless server either, is
// served as the SDK's client (of the 2026 version) is; and for both, a call
// the client gives up ends its command, as closing a REST call does (the
// SDK ends it for the 2026 version, the endpoint for the older ones).
func TestMCPEndpointWithAnOlderProtocol(t *testing.T) {
	// Without the contract check: the answer to an abandoned POST, which
	// nobody reads, is an empty 200.
	c := realSupervisorAPIWith(t, apiSetup{pushDelay: -1, noContract: true})(adminToken)
	post := func(ctx context.Context, shell string) (*http.Response, error) {
		body, _ := json.Marshal(map[string]any{"jsonrpc": "2.0", "id": 7, "method": "tools/call",
			"params": map[string]any{"name": "run_command", "arguments": map[string]any{"shell": shell}}})
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, c.Endpoint()+api.PathMCP("agent-1"), bytes.NewReader(body))
		if err != nil {
			return nil, err
		}
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Accept", "application/json, text/event-stream")
		req.Header.Set("MCP-Protocol-Version", "2025-06-18")
		return c.MCPHTTPClient().Do(req)
	}
	resp, err := post(context.Background(), "echo hi")
	if err != nil {
		t.Fatal(err)
	}
	var answer struct {
		Result mcp.CallToolResult `json:"result"`
	}
	err = json.NewDecoder(resp.Body).Decode(&answer)
	resp.Body.Close()
	if out, _ := answer.Result.StructuredContent.(map[string]any); err != nil || resp.StatusCode != http.StatusOK || answer.Result.IsError || out["stdout"] != "hi\n" {
		t.Fatalf("tools/call with protocol 2025-06-18: %d, %+v, %v", resp.StatusCode, answer.Result, err)
	}

	cs, err := connectMCP(context.Background(), c, "agent-1")
	if err != nil {
		t.Fatal(err)
	}
	defer cs.Close()
	giveUp := map[string]func(ctx context.Context, shell string) error{
		"2025-06-18": func(ctx context.Context, shell string) error {
			resp, err := post(ctx, shell)
			if err == nil {
				resp.Body.Close()
			}
			return err
		},
		"sdk": func(ctx context.Context, shell string) error {
			_, err := cs.CallTool(ctx, &mcp.CallToolParams{Name: "run_command", Arguments: map[string]any{"shell": shell}})
			return err
		},
	}
	for name, call := range giveUp {
		ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
		err := call(ctx, "sleep 2 && echo late > late-"+name)
		cancel()
		if err == nil {
			t.Fatalf("%s: the call outlived its context", name)
		}
	}
	time.Sleep(3 * time.Second)
	for name := range giveUp {
		if _, err := c.GetFile(context.Background(), "agent-1", "late-"+name); api.CodeOf(err) != api.CodeFileNotFound {
			t.Errorf("%s: the command went on after its call was given up: %v", name, err)
		}
	}
}
