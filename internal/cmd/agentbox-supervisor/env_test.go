package main

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/modelcontextprotocol/go-sdk/mcp"

	api "github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"
)

// envServerVar makes the test binary a stdio MCP server whose one tool,
// environ, returns the server's environment: the supervisor starts it as a
// template's MCP server, with this variable in the server's own env.
const envServerVar = "SUPERVISOR_TEST_MCP_ENV_SERVER"

func TestMain(m *testing.M) {
	if os.Getenv(envServerVar) != "" {
		runEnvServer()
		return
	}
	os.Exit(m.Run())
}

type environOut struct {
	Env map[string]string `json:"env"`
}

func runEnvServer() {
	s := mcp.NewServer(&mcp.Implementation{Name: "env", Version: "1"}, nil)
	mcp.AddTool(s, &mcp.Tool{Name: "environ", Description: "returns the server's environment"},
		func(context.Context, *mcp.CallToolRequest, struct{}) (*mcp.CallToolResult, environOut, error) {
			out := environOut{Env: map[string]string{}}
			for _, kv := range os.Environ() {
				k, v, _ := strings.Cut(kv, "=")
				out.Env[k] = v
			}
			return nil, out, nil
		})
	if err := s.Run(context.Background(), &mcp.StdioTransport{}); err != nil {
		os.Exit(1)
	}
}

// TestSupervisorProcessPassesTheTemplateEnv runs the real binary as the
// controller configures it: the pod's environment holds the template's
// variables beside the supervisor's own AGENTBOX_ configuration, and
// AGENTBOX_PASS_ENV names the template's. Every kind of process the
// supervisor starts (a command, python_exec, /v1/execute, a terminal and a
// stdio MCP server, which adds its own env) sees the template's variables
// and none of the supervisor's own.
func TestSupervisorProcessPassesTheTemplateEnv(t *testing.T) {
	bin := buildSupervisor(t)
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	workdir := t.TempDir()
	servers, _ := json.Marshal([]api.MCPServerConfig{{Name: "envsrv", Command: self,
		Env: map[string]string{envServerVar: "1", "MCP_ONLY": "for this server", "SHADOWED": "the server's own"}}})
	p := startSupervisor(t, bin, []string{"-insecure-listen", "127.0.0.1:0", "-workdir", workdir}, []string{
		"PATH=" + os.Getenv("PATH"),
		"GREETING=hello from the template",
		"API_KEY=from-a-secret",
		"ODD,NAME=a comma in the name",
		"SHADOWED=the template's",
		"NOT_LISTED=the image's own",
		`AGENTBOX_PASS_ENV=["GREETING","API_KEY","ODD,NAME","SHADOWED","HTTP_PROXY"]`,
		"AGENTBOX_MCP_SERVERS_JSON=" + string(servers),
		"AGENTBOX_TEST_CONFIG=the supervisor's own",
	})
	client := api.NewClient("http://"+p.addr, &http.Client{})
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()

	want := map[string]string{"GREETING": "hello from the template", "API_KEY": "from-a-secret", "ODD,NAME": "a comma in the name"}
	check := func(how string, env map[string]string) {
		t.Helper()
		for k, v := range want {
			if env[k] != v {
				t.Errorf("%s: %s = %q, want %q", how, k, env[k], v)
			}
		}
		for k := range env {
			if strings.HasPrefix(k, api.ReservedEnvPrefix) || k == "NOT_LISTED" {
				t.Errorf("%s: %s=%q reached it", how, k, env[k])
			}
		}
	}
	// The output of `env`, or of Python's os.environ printed one a line.
	parse := func(out string) map[string]string {
		env := map[string]string{}
		for _, line := range strings.Split(out, "\n") {
			if k, v, ok := strings.Cut(strings.TrimRight(line, "\r"), "="); ok {
				env[k] = v
			}
		}
		return env
	}

	res, err := client.RunCommand(ctx, api.CommandRequest{Command: []string{"env"}})
	if err != nil || res.ExitCode != 0 {
		t.Fatalf("env: %+v, %v", res, err)
	}
	check("run_command", parse(res.Stdout))
	if got := parse(res.Stdout)["SHADOWED"]; got != "the template's" {
		t.Errorf("run_command: SHADOWED = %q, want the template's", got)
	}

	// A terminal running env(1) itself: a shell would drop ODD,NAME, which
	// is no shell identifier, from what it passes on.
	c := openConsole(t, client, api.PTYRequest{Command: []string{"env"}})
	c.exit(t)
	check("pty", parse(c.output()))

	// The MCP server gets the template's variables and its own on top.
	var srv map[string]string
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(100 * time.Millisecond) {
		raw, err := client.MCPRequest(ctx, "envsrv", json.RawMessage(`{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"environ","arguments":{}}}`))
		if err == nil {
			var resp struct {
				Result struct {
					StructuredContent environOut `json:"structuredContent"`
				} `json:"result"`
			}
			if err = json.Unmarshal(raw, &resp); err == nil {
				srv = resp.Result.StructuredContent.Env
				break
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("the MCP server did not answer: %v", err)
		}
	}
	delete(srv, envServerVar)
	check("MCP server", srv)
	if srv["MCP_ONLY"] != "for this server" || srv["SHADOWED"] != "the server's own" {
		t.Errorf("MCP server: MCP_ONLY %q, SHADOWED %q; want the server's own env over the template's", srv["MCP_ONLY"], srv["SHADOWED"])
	}

	// python_exec and /v1/execute, where there is a python3.
	supervisorPython(t)
	const printEnv = "import os\nfor k, v in os.environ.items(): print(k + '=' + v)"
	res, err = client.RunPython(ctx, api.PythonRequest{Code: printEnv})
	if err != nil || res.ExitCode != 0 {
		t.Fatalf("python_exec: %+v, %v", res, err)
	}
	check("python_exec", parse(res.Stdout))
	ex, err := client.Execute(ctx, api.ExecuteRequest{Code: printEnv})
	if err != nil || ex.ExitCode != 0 {
		t.Fatalf("execute: %+v, %v", ex, err)
	}
	check("execute", parse(ex.Output))
}

// A list that names one of the supervisor's own variables, or * beside
// other names, is refused at start, whichever way it is given.
func TestPassEnvRefusesTheSupervisorsOwn(t *testing.T) {
	for value, named := range map[string]string{
		"HOME,AGENTBOX_TLS_DIR":       "AGENTBOX_TLS_DIR",
		`["HOME","AGENTBOX_TLS_DIR"]`: "AGENTBOX_TLS_DIR",
		"HOME,GODEBUG":                "GODEBUG",
		"*,HOME":                      "*",
	} {
		_, err := parseOptions(nil, func(k string) string { return map[string]string{"AGENTBOX_PASS_ENV": value}[k] }, io.Discard)
		if err == nil || !strings.Contains(err.Error(), named) {
			t.Errorf("AGENTBOX_PASS_ENV=%s: %v, want a refusal naming %s", value, err, named)
		}
	}
	for in, want := range map[string][]string{
		"*":           {"*"},
		`["*"]`:       {"*"},
		`["A","B,C"]`: {"A", "B,C"},
		"A, B":        {"A", "B"},
		"":            {},
		"[]":          {},
	} {
		o, err := parseOptions([]string{"-pass-env", in}, func(string) string { return "" }, io.Discard)
		if err != nil {
			t.Errorf("-pass-env %q: %v", in, err)
			continue
		}
		if strings.Join(o.passEnv, "|") != strings.Join(want, "|") || o.passEnv == nil {
			t.Errorf("-pass-env %q: %q, want %q", in, o.passEnv, want)
		}
	}
	if _, err := parseOptions([]string{"-pass-env", `["A","B=C"]`}, func(string) string { return "" }, io.Discard); err == nil {
		t.Error(`-pass-env ["A","B=C"] was accepted`)
	}
}

// TestSupervisorProcessPassesTheImageEnv runs the real binary as the
// controller configures it for any image: AGENTBOX_PASS_ENV=* passes the
// whole environment (the image's ENV, the template's env, the platform's
// HOME) to a command, a terminal and a stdio MCP server, but not the
// supervisor's own configuration, its GODEBUG or the API server's address
// kubelet injects.
func TestSupervisorProcessPassesTheImageEnv(t *testing.T) {
	bin := buildSupervisor(t)
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	workdir := t.TempDir()
	servers, _ := json.Marshal([]api.MCPServerConfig{{Name: "envsrv", Command: self, Env: map[string]string{envServerVar: "1"}}})
	path := "/usr/local/node/bin:" + os.Getenv("PATH")
	p := startSupervisor(t, bin, []string{"-insecure-listen", "127.0.0.1:0", "-workdir", workdir}, []string{
		"PATH=" + path,
		"NODE_VERSION=22.11.0",
		"JAVA_HOME=/opt/java",
		"HOME=" + workdir,
		"GREETING=hello from the template",
		"GODEBUG=profstackdepth=0",
		"KUBERNETES_SERVICE_HOST=10.96.0.1",
		"KUBERNETES_SERVICE_PORT=443",
		"KUBERNETES_PORT=tcp://10.96.0.1:443",
		"KUBERNETES_PORT_443_TCP=tcp://10.96.0.1:443",
		"AGENTBOX_PASS_ENV=*",
		"AGENTBOX_MCP_SERVERS_JSON=" + string(servers),
		"AGENTBOX_TEST_CONFIG=the supervisor's own",
	})
	client := api.NewClient("http://"+p.addr, &http.Client{})
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()

	want := map[string]string{"PATH": path, "NODE_VERSION": "22.11.0", "JAVA_HOME": "/opt/java", "HOME": workdir, "GREETING": "hello from the template"}
	check := func(how string, env map[string]string) {
		t.Helper()
		for k, v := range want {
			if env[k] != v {
				t.Errorf("%s: %s = %q, want %q", how, k, env[k], v)
			}
		}
		for k := range env {
			if strings.HasPrefix(k, api.ReservedEnvPrefix) || k == "GODEBUG" || strings.HasPrefix(k, "KUBERNETES_") {
				t.Errorf("%s: %s=%q reached it", how, k, env[k])
			}
		}
	}
	parse := func(out string) map[string]string {
		env := map[string]string{}
		for _, line := range strings.Split(out, "\n") {
			if k, v, ok := strings.Cut(strings.TrimRight(line, "\r"), "="); ok {
				env[k] = v
			}
		}
		return env
	}
	res, err := client.RunCommand(ctx, api.CommandRequest{Command: []string{"env"}})
	if err != nil || res.ExitCode != 0 {
		t.Fatalf("env: %+v, %v", res, err)
	}
	check("run_command", parse(res.Stdout))
	c := openConsole(t, client, api.PTYRequest{Command: []string{"env"}})
	c.exit(t)
	check("pty", parse(c.output()))
	var srv map[string]string
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(100 * time.Millisecond) {
		raw, err := client.MCPRequest(ctx, "envsrv", json.RawMessage(`{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"environ","arguments":{}}}`))
		if err == nil {
			var resp struct {
				Result struct {
					StructuredContent environOut `json:"structuredContent"`
				} `json:"result"`
			}
			if err = json.Unmarshal(raw, &resp); err == nil {
				srv = resp.Result.StructuredContent.Env
				break
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("the MCP server did not answer: %v", err)
		}
	}
	delete(srv, envServerVar)
	check("MCP server", srv)
}
