package provider

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/hashicorp/terraform-plugin-testing/helper/resource"
	"github.com/hashicorp/terraform-plugin-testing/knownvalue"
	"github.com/hashicorp/terraform-plugin-testing/plancheck"
	"github.com/hashicorp/terraform-plugin-testing/statecheck"
	"github.com/hashicorp/terraform-plugin-testing/terraform"
	"github.com/hashicorp/terraform-plugin-testing/tfjsonpath"
	"github.com/modelcontextprotocol/go-sdk/mcp"
	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/utils/ptr"
	ctrlclient "sigs.k8s.io/controller-runtime/pkg/client"

	agentboxv1alpha1 "github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	"github.com/agentbox/terraform-provider-agentbox/internal/chart"
	"github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
)

// The template settings test's sandbox: what its template sets, and what
// it writes.
const (
	settingsAgent    = "settings-agent"
	settingsGreeting = "hello from the template"
	// settingsIdle is as short as the test can make it while an open
	// terminal still has to renew the sandbox's activity at the Compute
	// API's production rate (at most every 30 s, plus a tick) to keep it.
	settingsIdle = time.Minute
	// settingsBigMiB is written with a command, from /dev/urandom so that
	// the archive of the idle stop cannot compress it away.
	settingsBigMiB = 1536
	// settingsFillMiB takes the workspace past its 2Gi size.
	settingsFillMiB = 1024
	// settingsMCPPath is where the stdio MCP server's binary is put; the
	// template runs it from there, and the bridge retries until it is.
	settingsMCPPath = "/workspace/mcpcalc"
)

// TestAccTemplateSettings takes the template's settings end to end the way
// a user goes: the platform with the chart's default values (only the image
// tag, as the quickstart), a template with an environment variable (a plain
// value: the provider's env takes no values from Secrets, which go in
// secret_files), a 2Gi workspace, a one-minute idle timeout and a stdio MCP
// server, and an agent's sandbox, all through the terraform CLI. Then,
// through the Compute API with what agentbox_platform reports, and the
// agentbox CLI:
//
//   - the variable reaches run_command (REST and the agent's MCP endpoint),
//     python_exec, a terminal and the stdio MCP server (mcp_request);
//   - a terminal held open for one and a half idle timeouts keeps the sandbox
//     Running, and answers at the end;
//   - 1.5 GiB written by a command go into the agent's filespace in the
//     default store, and survive an idle stop into the default snapshot
//     store and the resume that the next call brings, byte for byte;
//   - dd past the 2Gi workspace fails with ENOSPC, and leaves the earlier
//     file intact.
func TestAccTemplateSettings(t *testing.T) {
	t.Parallel()
	tag := testAccPlatformImageTag(t)
	c, ns := testAccCluster(t)
	tools := settingsTools(t)
	cfg := testAccTemplateSettingsConfig(ns, tag)
	key := types.NamespacedName{Namespace: ns, Name: "settings"}
	tpl := "agentbox_sandbox_template.settings"
	resource.Test(t, resource.TestCase{
		ProtoV6ProviderFactories: testAccProtoV6ProviderFactories,
		CheckDestroy:             platformDestroyed(c, ns),
		Steps: []resource.TestStep{
			{
				Config: cfg,
				ConfigStateChecks: []statecheck.StateCheck{
					statecheck.ExpectKnownValue("agentbox_platform.this", tfjsonpath.New("status"), knownvalue.StringExact("deployed")),
					statecheck.ExpectKnownValue("agentbox_platform.this", tfjsonpath.New("snapshot_driver"), knownvalue.StringExact("archive/embedded")),
					statecheck.ExpectKnownValue(tpl, tfjsonpath.New("env"), knownvalue.MapExact(map[string]knownvalue.Check{
						"GREETING": knownvalue.StringExact(settingsGreeting),
					})),
					statecheck.ExpectKnownValue(tpl, tfjsonpath.New("workspace").AtMapKey("size"), knownvalue.StringExact("2Gi")),
					statecheck.ExpectKnownValue(tpl, tfjsonpath.New("idle_timeout"), knownvalue.StringExact("1m")),
					statecheck.ExpectKnownValue(tpl, tfjsonpath.New("mcp_servers"), knownvalue.ListExact([]knownvalue.Check{
						knownvalue.ObjectPartial(map[string]knownvalue.Check{
							"name":    knownvalue.StringExact("calc"),
							"command": knownvalue.StringExact(settingsMCPPath),
							"env":     knownvalue.MapExact(map[string]knownvalue.Check{"MCP_ONLY": knownvalue.StringExact("for calc")}),
						}),
					})),
					statecheck.ExpectKnownValue("agentbox_sandbox.agent", tfjsonpath.New("id"), knownvalue.StringExact(ns+"/settings")),
					statecheck.ExpectKnownValue("agentbox_sandbox.agent", tfjsonpath.New("agent_id"), knownvalue.StringExact(settingsAgent)),
				},
				Check: func(s *terraform.State) error {
					api, err := platformAPI(s, "agentbox_platform.this")
					if err != nil {
						return err
					}
					defer api.CloseIdleConnections()
					st := &settingsRun{t: t, c: c, key: key, api: api, tools: tools, caPEM: s.RootModule().Resources["agentbox_platform.this"].Primary.Attributes["ca_certificate"]}
					for _, step := range []struct {
						name string
						fn   func(context.Context) error
					}{
						{"the template's env", st.checkEnv},
						{"an open terminal past the idle timeout", st.checkTerminalKeepsRunning},
						{"1.5 GiB across an idle stop and resume", st.checkBigFileAcrossStop},
						{"the workspace's size", st.checkWorkspaceFull},
					} {
						ctx, cancel := context.WithTimeout(context.Background(), 15*time.Minute)
						start := time.Now()
						err := step.fn(ctx)
						cancel()
						if err != nil {
							lctx, lcancel := context.WithTimeout(context.Background(), 30*time.Second)
							t.Logf("the control plane's log:%s", st.controlPlaneLog(lctx))
							lcancel()
							return fmt.Errorf("%s: %w", step.name, err)
						}
						t.Logf("checked %s in %s", step.name, time.Since(start).Round(time.Second))
					}
					return nil
				},
			},
			{
				Config:           cfg,
				ConfigPlanChecks: resource.ConfigPlanChecks{PreApply: []plancheck.PlanCheck{plancheck.ExpectEmptyPlan()}},
			},
			{
				Config:            cfg,
				ResourceName:      tpl,
				ImportState:       true,
				ImportStateId:     ns + "/settings",
				ImportStateVerify: true,
			},
		},
	})
}

func testAccTemplateSettingsConfig(ns, tag string) string {
	return fmt.Sprintf(`
provider "agentbox" {
  kubernetes = {
    config_path = %[1]q
  }
  namespace = %[2]q
}

# The chart's defaults: only the image tag, as the quickstart.
resource "agentbox_platform" "this" {
  image_tag = %[3]q
}

resource "agentbox_sandbox_template" "settings" {
  name = "settings"
  env = {
    GREETING = %[4]q
  }
  workspace = {
    size = "2Gi"
  }
  idle_timeout = "1m"
  mcp_servers = [{
    name    = "calc"
    command = %[5]q
    env     = { MCP_ONLY = "for calc" }
  }]

  depends_on = [agentbox_platform.this]
}

resource "agentbox_sandbox" "agent" {
  name     = "settings"
  agent_id = %[6]q
  template = agentbox_sandbox_template.settings.name
}
`, os.Getenv(testAccKubeconfigEnv), ns, tag, settingsGreeting, settingsMCPPath, settingsAgent)
}

// settingsBinaries are the programs the test builds: the agentbox CLI, and
// the stdio MCP server the template runs in the sandbox.
type settingsBinaries struct {
	cli, mcpcalc string
}

func settingsTools(t *testing.T) settingsBinaries {
	t.Helper()
	dir := t.TempDir()
	build := func(pkg, name string) string {
		out := filepath.Join(dir, name)
		cmd := exec.Command("go", "build", "-trimpath", "-ldflags=-s -w", "-o", out, pkg)
		cmd.Dir = ".."
		// Static, for the sandbox: it needs nothing of the sandbox image.
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0", "GOOS=linux")
		if msg, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("build %s: %v\n%s", pkg, err, msg)
		}
		return out
	}
	return settingsBinaries{
		cli:     build("./internal/cmd/agentbox", "agentbox"),
		mcpcalc: build("./internal/controller/testdata/mcpcalc", "mcpcalc"),
	}
}

// settingsRun is one run of the checks against the installed platform.
type settingsRun struct {
	t     *testing.T
	c     ctrlclient.Client
	key   types.NamespacedName
	api   *client.Client
	tools settingsBinaries
	caPEM string
	// bigSum is the SHA-256 of the big file as written.
	bigSum string
}

// cli runs the agentbox CLI against the platform, as a user whose
// environment names the endpoint, CA and token, and returns its stdout and
// stderr.
func (r *settingsRun) cli(ctx context.Context, args ...string) (string, string, error) {
	ca := filepath.Join(r.t.TempDir(), "ca.crt")
	if err := os.WriteFile(ca, []byte(r.caPEM), 0o600); err != nil {
		return "", "", err
	}
	cmd := exec.CommandContext(ctx, r.tools.cli, args...)
	cmd.Env = append(os.Environ(), "AGENTBOX_ENDPOINT="+r.api.Endpoint(), "AGENTBOX_TOKEN="+r.api.Token(), "AGENTBOX_CA_FILE="+ca)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Run()
	return stdout.String(), stderr.String(), err
}

func (r *settingsRun) run(ctx context.Context, script string) (*client.CommandResult, error) {
	res, err := r.api.RunCommand(ctx, settingsAgent, client.RunCommandRequest{Command: []string{"sh", "-c", script}, TimeoutSeconds: 600})
	if err != nil {
		return nil, fmt.Errorf("run_command %q: %w", script, err)
	}
	return res, nil
}

// checkEnv: the template's variable in a command (through REST and the
// agent's MCP endpoint), python_exec and the stdio MCP server, whose binary
// goes into the workspace through the file API (the template runs it from
// there; the bridge retries until it is).
func (r *settingsRun) checkEnv(ctx context.Context) error {
	res, err := r.run(ctx, `printf '%s\n' "$GREETING"`)
	if err != nil {
		return err
	}
	if res.ExitCode != 0 || res.Stdout != settingsGreeting+"\n" {
		return fmt.Errorf("run_command: %+v; want GREETING=%q", res, settingsGreeting)
	}
	raw, err := r.api.ToolRequest(ctx, settingsAgent, "python_exec", map[string]any{"code": "import os; print(os.environ.get('GREETING'))"})
	if err != nil {
		return fmt.Errorf("python_exec: %w", err)
	}
	var py client.CommandResult
	if err := json.Unmarshal(raw, &py); err != nil || py.ExitCode != 0 || py.Stdout != settingsGreeting+"\n" {
		return fmt.Errorf("python_exec: %s (%v); want GREETING=%q", raw, err, settingsGreeting)
	}

	// The agent's MCP endpoint, as any MCP client uses it: its run_command
	// tool is the REST call's twin.
	mcs, err := mcp.NewClient(&mcp.Implementation{Name: "acc-test", Version: "v0"}, nil).Connect(ctx,
		&mcp.StreamableClientTransport{Endpoint: r.api.Endpoint() + client.PathMCP(settingsAgent), HTTPClient: r.api.MCPHTTPClient()}, nil)
	if err != nil {
		return fmt.Errorf("connect to the agent's MCP endpoint: %w", err)
	}
	called, err := mcs.CallTool(ctx, &mcp.CallToolParams{Name: "run_command", Arguments: map[string]any{"command": []string{"printenv", "GREETING"}}})
	mcs.Close()
	if err != nil {
		return fmt.Errorf("run_command through the MCP endpoint: %w", err)
	}
	raw, _ = json.Marshal(called.StructuredContent)
	var viaMCP client.CommandResult
	if err := json.Unmarshal(raw, &viaMCP); err != nil || called.IsError || viaMCP.Stdout != settingsGreeting+"\n" {
		return fmt.Errorf("run_command through the MCP endpoint: %s (error %v, %v); want GREETING=%q", raw, called.IsError, err, settingsGreeting)
	}

	f, err := os.Open(r.tools.mcpcalc)
	if err != nil {
		return err
	}
	_, err = r.api.PutFile(ctx, settingsAgent, filepath.Base(settingsMCPPath), f, 0o755)
	f.Close()
	if err != nil {
		return fmt.Errorf("put the MCP server's binary: %w", err)
	}
	start := time.Now()
	env, err := r.mcpGetenv(ctx, "GREETING", "MCP_ONLY")
	if err != nil {
		return err
	}
	if env["GREETING"] != settingsGreeting || env["MCP_ONLY"] != "for calc" {
		return fmt.Errorf("the MCP server's environment: %v; want the template's GREETING and its own MCP_ONLY", env)
	}
	r.t.Logf("GREETING reached run_command (REST and the MCP endpoint), python_exec and the stdio MCP server (which answered %s after its binary was put)",
		time.Since(start).Round(time.Millisecond))
	return nil
}

func (r *settingsRun) mcpGetenv(ctx context.Context, names ...string) (map[string]string, error) {
	return mcpGetenv(ctx, r.api, settingsAgent, names...)
}

// mcpGetenv calls the agent's stdio MCP server "calc" (the mcpcalc test
// server) and its getenv tool through mcp_request, again while the server
// is not up yet: the supervisor's bridge starts it with a backoff that
// grows to 30 s.
func mcpGetenv(ctx context.Context, api *client.Client, agent string, names ...string) (map[string]string, error) {
	var last error
	for deadline := time.Now().Add(3 * time.Minute); time.Now().Before(deadline); {
		raw, err := api.MCPRequest(ctx, agent, "calc", map[string]any{"jsonrpc": "2.0", "id": 1, "method": "tools/call",
			"params": map[string]any{"name": "getenv", "arguments": map[string]any{"names": names}}})
		if err == nil {
			var resp struct {
				Result struct {
					StructuredContent struct {
						Values map[string]string `json:"values"`
					} `json:"structuredContent"`
				} `json:"result"`
			}
			if err := json.Unmarshal(raw, &resp); err != nil || resp.Result.StructuredContent.Values == nil {
				return nil, fmt.Errorf("getenv through mcp_request answered %s (%v)", raw, err)
			}
			return resp.Result.StructuredContent.Values, nil
		}
		last = err
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-time.After(2 * time.Second):
		}
	}
	return nil, fmt.Errorf("the stdio MCP server did not answer mcp_request: %w", last)
}

// checkTerminalKeepsRunning holds a terminal open, with nothing typed, for
// one and a half idle timeouts, long enough that the sandbox would have
// stopped without the renewals: the open call is activity, renewed by the
// API at its production rate (every 30 s), so the sandbox is not
// idle-stopped under it. At the end the terminal answers.
func (r *settingsRun) checkTerminalKeepsRunning(ctx context.Context) error {
	term, err := r.api.OpenPTY(ctx, settingsAgent, client.PTYOptions{Command: []string{"sh"}, Cols: 120, Rows: 40})
	if err != nil {
		return fmt.Errorf("open a terminal: %w", err)
	}
	defer term.Close()
	var mu sync.Mutex
	var out bytes.Buffer
	readDone := make(chan error, 1)
	go func() {
		buf := make([]byte, 4096)
		for {
			n, err := term.Read(buf)
			mu.Lock()
			out.Write(buf[:n])
			mu.Unlock()
			if err != nil {
				readDone <- err
				return
			}
		}
	}()
	lease := types.NamespacedName{Namespace: r.key.Namespace, Name: agentboxv1alpha1.LeaseName(r.key.Name)}
	renewals := map[time.Time]bool{}
	open := time.Now()
	for time.Since(open) < 3*settingsIdle/2 {
		var sbx agentboxv1alpha1.Sandbox
		if err := r.c.Get(ctx, r.key, &sbx); err != nil {
			return err
		}
		if sbx.Status.Phase != agentboxv1alpha1.SandboxPhaseRunning {
			return fmt.Errorf("%s after the terminal opened, with it still open, the sandbox is %s (%v)",
				time.Since(open).Round(time.Second), sbx.Status.Phase, sbx.Status.Conditions)
		}
		var l coordinationv1.Lease
		if err := r.c.Get(ctx, lease, &l); err != nil {
			return err
		}
		if l.Spec.RenewTime != nil {
			renewals[l.Spec.RenewTime.Time] = true
		}
		select {
		case err := <-readDone:
			return fmt.Errorf("the terminal ended while held open: %v", err)
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(time.Second):
		}
	}
	held := time.Since(open)
	if _, err := term.Write([]byte(`echo "still $GREETING"` + "\n")); err != nil {
		return fmt.Errorf("type into the terminal: %w", err)
	}
	want := "still " + settingsGreeting
	for deadline := time.Now().Add(30 * time.Second); ; {
		mu.Lock()
		// The echo of the typed line holds $GREETING, not its value.
		got := strings.Contains(out.String(), want)
		text := out.String()
		mu.Unlock()
		if got {
			break
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("the terminal did not answer after %s open: %q", held.Round(time.Second), text)
		}
		time.Sleep(200 * time.Millisecond)
	}
	// Renewed by the open terminal: the first renewal is the open itself.
	if len(renewals) < 3 {
		return fmt.Errorf("the activity lease took %d distinct renew times while the terminal was open %s; want the open call's renewals", len(renewals), held.Round(time.Second))
	}
	r.t.Logf("a terminal held open %s (idle timeout %s) kept the sandbox Running; the activity lease saw %d renew times; it answered %q at the end",
		held.Round(time.Second), settingsIdle, len(renewals), want)
	return nil
}

// checkBigFileAcrossStop writes 1.5 GiB with a command through the CLI,
// waits for the idle stop into the embedded snapshot store, and resumes
// the sandbox with the next call, which finds the file unchanged.
func (r *settingsRun) checkBigFileAcrossStop(ctx context.Context) error {
	start := time.Now()
	stdout, stderr, err := r.cli(ctx, "exec", "--timeout", "10m", settingsAgent, "--", "sh", "-c",
		fmt.Sprintf("dd if=/dev/urandom of=big.bin bs=1M count=%d 2>&1 && sha256sum big.bin", settingsBigMiB))
	wrote := time.Since(start)
	if err != nil {
		return fmt.Errorf("agentbox exec dd: %v; stdout %q, stderr %q", err, stdout, stderr)
	}
	m := regexp.MustCompile(`(?m)^([0-9a-f]{64})  big\.bin$`).FindStringSubmatch(stdout)
	if m == nil {
		return fmt.Errorf("agentbox exec dd: no sha256sum of big.bin in %q", stdout)
	}
	r.bigSum = m[1]
	r.t.Logf("wrote %d MiB from /dev/urandom through agentbox exec in %s (%.0f MiB/s, sha256sum included); sha256 %s",
		settingsBigMiB, wrote.Round(time.Millisecond), float64(settingsBigMiB)/wrote.Seconds(), r.bigSum)

	// Into the agent's filespace in the control plane's store, as the API
	// does on its own after a call and the idle stop does before the
	// snapshot: the default store has room for it.
	start = time.Now()
	push, err := r.api.SyncFilespace(ctx, settingsAgent, client.SyncPush)
	if err != nil {
		return fmt.Errorf("sync_filespace push of the big file: %w", err)
	}
	r.t.Logf("sync_filespace push right after the write: %s (pushed %d files, %d bytes, in %d ms; the API's own push after the call may have taken it first)",
		time.Since(start).Round(time.Millisecond), push.Pushed, push.Bytes, push.DurationMS)

	// The idle stop: Running, then IdleStopping, then Stopped with the
	// snapshot in the embedded store.
	var sbx agentboxv1alpha1.Sandbox
	var stopping, stopped time.Time
	idleFrom := time.Now()
	for stopped.IsZero() {
		if err := r.c.Get(ctx, r.key, &sbx); err != nil {
			return err
		}
		switch sbx.Status.Phase {
		case agentboxv1alpha1.SandboxPhaseIdleStopping:
			if stopping.IsZero() {
				stopping = time.Now()
				r.t.Logf("IdleStopping %s after the write: %s", stopping.Sub(idleFrom).Round(time.Second), readyMessage(&sbx))
			}
		case agentboxv1alpha1.SandboxPhaseStopped:
			stopped = time.Now()
		case agentboxv1alpha1.SandboxPhaseError:
			return fmt.Errorf("the idle stop failed: %s; events: %s", readyMessage(&sbx), r.events(ctx))
		}
		if blocked := meta.FindStatusCondition(sbx.Status.Conditions, agentboxv1alpha1.ConditionIdleStopBlocked); blocked != nil {
			return fmt.Errorf("the idle stop is blocked: %s: %s", blocked.Reason, blocked.Message)
		}
		if time.Since(idleFrom) > settingsIdle+10*time.Minute {
			return fmt.Errorf("not stopped %s after the write (phase %s: %s)", time.Since(idleFrom).Round(time.Second), sbx.Status.Phase, readyMessage(&sbx))
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(500 * time.Millisecond):
		}
	}
	snap := sbx.Status.Snapshot
	if snap == nil || snap.Driver != "archive/embedded" || snap.SizeBytes < settingsBigMiB<<20 {
		return fmt.Errorf("stopped with snapshot %+v; want the whole workspace in the embedded store", snap)
	}
	stopTook := "not seen"
	if !stopping.IsZero() {
		stopTook = stopped.Sub(stopping).Round(time.Second).String()
	}
	r.t.Logf("idle stop: IdleStopping to Stopped as polled in %s; archive %d bytes (%s)", stopTook, snap.SizeBytes, snap.Name)

	// What a user sees, without waking it.
	stdout, stderr, err = r.cli(ctx, "status", "--json", settingsAgent)
	if err != nil {
		return fmt.Errorf("agentbox status: %v; %s", err, stderr)
	}
	var status client.SandboxStatus
	if err := json.Unmarshal([]byte(stdout), &status); err != nil {
		return fmt.Errorf("agentbox status --json: %q: %w", stdout, err)
	}
	if status.Phase != string(agentboxv1alpha1.SandboxPhaseStopped) || status.Snapshot == nil || status.Snapshot.Driver != "archive/embedded" {
		return fmt.Errorf("agentbox status of the stopped sandbox: %+v", status)
	}

	// The next call resumes it, and the file is the one written.
	start = time.Now()
	stdout, stderr, err = r.cli(ctx, "exec", settingsAgent, "--", "sha256sum", "big.bin")
	resumed := time.Since(start)
	if err != nil {
		return fmt.Errorf("agentbox exec sha256sum on the stopped sandbox, after %s: %v; stdout %q, stderr %q; events: %s",
			resumed.Round(time.Second), err, stdout, stderr, r.events(ctx))
	}
	if want := r.bigSum + "  big.bin\n"; stdout != want {
		return fmt.Errorf("after the resume: sha256sum %q, want %q", stdout, want)
	}
	r.t.Logf("agentbox exec sha256sum on the stopped sandbox, resume included: %s", resumed.Round(time.Millisecond))
	// One stop and one resume so far, each told once.
	seen := map[string]int{}
	for _, e := range r.eventList(ctx) {
		if e.Reason == "IdleStopped" || e.Reason == "Resumed" || e.Reason == "FilespacePulled" {
			r.t.Logf("event %s: %s", e.Reason, e.Message)
			seen[e.Reason]++
		}
	}
	if seen["IdleStopped"] != 1 || seen["Resumed"] != 1 {
		return fmt.Errorf("events of the stop and the resume: %v; want one IdleStopped and one Resumed", seen)
	}

	// The resumed sandbox runs the MCP server from the restored workspace,
	// with the template's environment.
	env, err := r.mcpGetenv(ctx, "GREETING")
	if err != nil {
		return fmt.Errorf("after the resume: %w", err)
	}
	if env["GREETING"] != settingsGreeting {
		return fmt.Errorf("after the resume, the MCP server's environment: %v", env)
	}
	return nil
}

// checkWorkspaceFull: dd past the 2Gi workspace fails with ENOSPC, and the
// big file is intact after the failure.
func (r *settingsRun) checkWorkspaceFull(ctx context.Context) error {
	// One command, so that the fill file is gone before the API's
	// filespace push after the call reads the workspace.
	res, err := r.run(ctx, fmt.Sprintf(`dd if=/dev/zero of=fill.bin bs=1M count=%d 2>&1; echo "dd exit $?"; sha256sum big.bin; rm -f fill.bin`, settingsFillMiB))
	if err != nil {
		return err
	}
	if !strings.Contains(res.Stdout, "No space left on device") || strings.Contains(res.Stdout, "dd exit 0") {
		return fmt.Errorf("dd past the workspace's size: %+v; want ENOSPC", res)
	}
	if !strings.Contains(res.Stdout, r.bigSum+"  big.bin\n") {
		return fmt.Errorf("big.bin after the failed dd: %q; want sha256 %s", res.Stdout, r.bigSum)
	}
	r.t.Logf("dd past the 2Gi workspace: %q", strings.TrimSpace(res.Stdout))
	return nil
}

func readyMessage(sbx *agentboxv1alpha1.Sandbox) string {
	if c := meta.FindStatusCondition(sbx.Status.Conditions, agentboxv1alpha1.ConditionReady); c != nil {
		return c.Reason + ": " + c.Message
	}
	return "no Ready condition"
}

// sandboxPodState says what the sandbox and its pods were doing, for the
// message of a failed call: a supervisor that was restarted or replaced
// under the call shows in the restart counts and the last terminations.
func sandboxPodState(ctx context.Context, c ctrlclient.Client, key types.NamespacedName) string {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer cancel()
	var sbx agentboxv1alpha1.Sandbox
	if err := c.Get(ctx, key, &sbx); err != nil {
		return fmt.Sprintf("sandbox: %v", err)
	}
	var b strings.Builder
	fmt.Fprintf(&b, "sandbox phase %s (%s), endpoint %s", sbx.Status.Phase, readyMessage(&sbx), sbx.Status.ServiceEndpoint)
	var pods corev1.PodList
	if err := c.List(ctx, &pods, ctrlclient.InNamespace(key.Namespace)); err != nil {
		return b.String() + fmt.Sprintf("; pods: %v", err)
	}
	for _, p := range pods.Items {
		if !metav1.IsControlledBy(&p, &sbx) {
			continue
		}
		fmt.Fprintf(&b, "; pod %s %s IP %s deleting %v", p.Name, p.Status.Phase, p.Status.PodIP, p.DeletionTimestamp != nil)
		for _, cs := range p.Status.ContainerStatuses {
			fmt.Fprintf(&b, ", container %s ready %v restarts %d", cs.Name, cs.Ready, cs.RestartCount)
			if t := cs.LastTerminationState.Terminated; t != nil {
				fmt.Fprintf(&b, " (last ended %s: %s exit %d)", t.FinishedAt.Format(time.RFC3339), t.Reason, t.ExitCode)
			}
		}
	}
	return b.String()
}

func (r *settingsRun) eventList(ctx context.Context) []corev1.Event {
	var events corev1.EventList
	if err := r.c.List(ctx, &events, ctrlclient.InNamespace(r.key.Namespace)); err != nil {
		r.t.Logf("list events: %v", err)
		return nil
	}
	var out []corev1.Event
	for _, e := range events.Items {
		if e.InvolvedObject.Kind == "Sandbox" && e.InvolvedObject.Name == r.key.Name {
			out = append(out, e)
		}
	}
	return out
}

// events describes the sandbox's events, for failure messages.
func (r *settingsRun) events(ctx context.Context) string {
	var b strings.Builder
	for _, e := range r.eventList(ctx) {
		fmt.Fprintf(&b, "\n  %s %s (x%d): %s", e.Type, e.Reason, e.Count, e.Message)
	}
	return b.String()
}

// controlPlaneLog is the tail of the control plane's log, for failure
// messages: the stop and resume happen there.
func (r *settingsRun) controlPlaneLog(ctx context.Context) string {
	cfg, err := clientcmd.BuildConfigFromFlags("", os.Getenv(testAccKubeconfigEnv))
	if err != nil {
		return err.Error()
	}
	cs, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return err.Error()
	}
	pods, err := cs.CoreV1().Pods(r.key.Namespace).List(ctx, metav1.ListOptions{})
	if err != nil {
		return err.Error()
	}
	var b strings.Builder
	for _, p := range pods.Items {
		if !strings.HasPrefix(p.Name, chart.ControlPlaneDeployment+"-") {
			continue
		}
		rc, err := cs.CoreV1().Pods(p.Namespace).GetLogs(p.Name, &corev1.PodLogOptions{TailLines: ptr.To[int64](80)}).Stream(ctx)
		if err != nil {
			fmt.Fprintf(&b, "\n%s: %v", p.Name, err)
			continue
		}
		data, _ := io.ReadAll(rc)
		rc.Close()
		fmt.Fprintf(&b, "\n--- %s ---\n%s", p.Name, data)
	}
	return b.String()
}
