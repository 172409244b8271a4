package controller

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/url"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	apiclient "github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"
)

// TestTemplateSettingsOnCluster: the template's env, a literal and one from
// a Secret, reaches every kind of process an agent starts in a real gVisor
// sandbox through the Compute API (a command, python_exec, execute, a
// terminal, a stdio MCP server with its own env on top) and none of the
// supervisor's own AGENTBOX_ variables does; the template's workspace size
// is the supervisor's cap.
func TestTemplateSettingsOnCluster(t *testing.T) {
	t.Parallel()
	image := os.Getenv(EnvSandboxImage)
	if image == "" {
		t.Skipf("%s is not set: the Compute API needs the real sandbox image's supervisor", EnvSandboxImage)
	}
	calc := buildMCPCalc(t)
	e, st, pool := platformEnv(t)
	api := e.computeAPIWithStore(pool, st)
	ctx := e.ctx
	const secretValue = "from-a-secret-7f3a"
	must(t, e.c.Create(ctx, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: "keys", Namespace: e.ns},
		StringData: map[string]string{"api": secretValue}}))
	// The MCP server's binary goes to /tmp through commands (the test
	// cluster's workspace volumes may not be writable by the sandbox
	// user); until it is there, the bridge retries with backoff.
	const calcPath = "/tmp/mcpcalc"
	const wsSize = 64 << 20
	e.template("tpl", func(tpl *v1alpha1.SandboxTemplate) {
		tpl.Spec.Image = image
		tpl.Spec.IdleTimeout = metav1.Duration{Duration: time.Hour}
		tpl.Spec.Workspace.Size = resource.MustParse("64Mi")
		tpl.Spec.Env = []corev1.EnvVar{
			{Name: "GREETING", Value: "hello from the template"},
			{Name: "API_KEY", ValueFrom: &corev1.EnvVarSource{SecretKeyRef: &corev1.SecretKeySelector{
				LocalObjectReference: corev1.LocalObjectReference{Name: "keys"}, Key: "api"}}},
			// The supervisor's own knob, set by the template: it configures
			// the supervisor and is not passed on.
			{Name: "AGENTBOX_LOG_LEVEL", Value: "debug"},
		}
		tpl.Spec.MCPServers = []v1alpha1.MCPServer{{Name: "calc", Command: calcPath, Env: map[string]string{"MCP_ONLY": "for calc"}}}
	})
	e.sandbox("settings", "tpl")
	sbx, _ := e.waitPhase("settings", v1alpha1.SandboxPhaseRunning, v1alpha1.ReasonRunning)
	agent := sbx.Spec.AgentID

	want := map[string]string{"GREETING": "hello from the template", "API_KEY": secretValue}
	check := func(how string, env map[string]string) {
		t.Helper()
		for k, v := range want {
			if env[k] != v {
				t.Errorf("%s: %s = %q, want %q", how, k, env[k], v)
			}
		}
		for k, v := range env {
			if strings.HasPrefix(k, supervisorapi.ReservedEnvPrefix) {
				t.Errorf("%s: the supervisor's %s=%q reached it", how, k, v)
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

	res, err := api.RunCommand(ctx, agent, apiclient.RunCommandRequest{Command: []string{"env"}})
	if err != nil || res.ExitCode != 0 {
		t.Fatalf("run_command env: %+v, %v", res, err)
	}
	check("run_command", parse(res.Stdout))

	const printEnv = "import os\nfor k, v in os.environ.items(): print(k + '=' + v)"
	raw, err := api.ToolRequest(ctx, agent, "python_exec", map[string]any{"code": printEnv})
	must(t, err)
	var py apiclient.CommandResult
	must(t, json.Unmarshal(raw, &py))
	check("python_exec", parse(py.Stdout))

	raw, err = api.Execute(ctx, agent, map[string]any{"code": printEnv})
	must(t, err)
	var ex struct {
		Status, Output string
	}
	must(t, json.Unmarshal(raw, &ex))
	if ex.Status != "success" {
		t.Fatalf("execute: %s", raw)
	}
	check("execute", parse(ex.Output))

	term, err := api.OpenPTY(ctx, agent, apiclient.PTYOptions{Command: []string{"env"}})
	must(t, err)
	out, err := io.ReadAll(term)
	must(t, err)
	term.Close()
	check("terminal", parse(string(out)))

	// The MCP server: its binary into /tmp in pieces small enough for a
	// command's stdin, then its getenv tool through mcp_request.
	bin, err := os.ReadFile(calc)
	must(t, err)
	for off := 0; off < len(bin); off += 2 << 20 {
		chunk := bin[off:min(off+2<<20, len(bin))]
		res, err := api.RunCommand(ctx, agent, apiclient.RunCommandRequest{
			Command: []string{"python3", "-c", "import base64, sys; open('" + calcPath + ".part', 'ab').write(base64.b64decode(sys.stdin.read()))"},
			Stdin:   base64.StdEncoding.EncodeToString(chunk),
		})
		if err != nil || res.ExitCode != 0 {
			t.Fatalf("upload the MCP server: %+v, %v", res, err)
		}
	}
	res, err = api.RunCommand(ctx, agent, apiclient.RunCommandRequest{Command: []string{"sh", "-c", "chmod 755 " + calcPath + ".part && mv " + calcPath + ".part " + calcPath}})
	if err != nil || res.ExitCode != 0 {
		t.Fatalf("install the MCP server: %+v, %v", res, err)
	}
	var srvEnv map[string]string
	e.eventually("the stdio MCP server's getenv", func() error {
		raw, err := api.MCPRequest(ctx, agent, "calc", map[string]any{"jsonrpc": "2.0", "id": 1, "method": "tools/call",
			"params": map[string]any{"name": "getenv", "arguments": map[string]any{"names": []string{"GREETING", "API_KEY", "MCP_ONLY",
				"AGENTBOX_LOG_LEVEL", "AGENTBOX_TLS_DIR", "AGENTBOX_AGENT_ID"}}}})
		if err != nil {
			return err
		}
		var resp struct {
			Result struct {
				StructuredContent struct {
					Values map[string]string `json:"values"`
				} `json:"structuredContent"`
			} `json:"result"`
		}
		if err := json.Unmarshal(raw, &resp); err != nil || resp.Result.StructuredContent.Values == nil {
			return fmt.Errorf("tools/call getenv answered %s (%v)", raw, err)
		}
		srvEnv = resp.Result.StructuredContent.Values
		return nil
	})
	check("MCP server", srvEnv)
	if srvEnv["MCP_ONLY"] != "for calc" {
		t.Errorf("MCP server: MCP_ONLY = %q, want its own env's", srvEnv["MCP_ONLY"])
	}

	// The workspace's cap is the template's size.
	sup := e.supervisor(t, sbx)
	h, err := sup.Health(ctx)
	must(t, err)
	if h.Workspace == nil || h.Workspace.CapBytes != wsSize {
		t.Errorf("the supervisor's workspace %+v, want the template's 64Mi as its cap", h.Workspace)
	}
	if e.workspaceWritable(t, sup) {
		_, err := api.PutFile(ctx, agent, "big.bin", io.LimitReader(rand.Reader, wsSize+(1<<20)), 0)
		if apiclient.CodeOf(err) != apiclient.CodeWorkspaceFull {
			t.Errorf("a file past the template's size: %v, want %s", err, apiclient.CodeWorkspaceFull)
		} else {
			t.Logf("a file past the template's size was refused: %v", err)
		}
	}
	t.Logf("the template's env reached a command, python_exec, execute, a terminal and an MCP server; workspace cap %d", h.Workspace.CapBytes)
}

// memoryBomb touches every page it takes, 16 MiB at a time, until it is
// stopped.
const memoryBomb = `
b = []
while True:
    b.append(bytearray(b'x' * (16 << 20)))
    print(len(b) * 16, 'MiB', flush=True)
`

// TestOutOfMemoryThroughTheCLIOnCluster runs a memory bomb with "agentbox
// exec" (the real CLI binary, through the Compute API's streamed
// run_command) in a fresh small gVisor sandbox: the supervisor's memory
// guard kills it, and the CLI says so and exits 128+SIGKILL; the sandbox
// lives on, and the supervisor's record of the call says out_of_memory
// too.
func TestOutOfMemoryThroughTheCLIOnCluster(t *testing.T) {
	t.Parallel()
	e, _, api, sbx := apiSandbox(t, "oom", func(tpl *v1alpha1.SandboxTemplate) {
		tpl.Spec.Resources = corev1.ResourceRequirements{
			Requests: corev1.ResourceList{corev1.ResourceCPU: resource.MustParse("100m"), corev1.ResourceMemory: resource.MustParse("64Mi")},
			Limits:   corev1.ResourceList{corev1.ResourceMemory: resource.MustParse("256Mi")},
		}
	})
	agent := sbx.Spec.AgentID
	cli := goBuild(t, "../cmd/agentbox", "agentbox")
	ctx := e.ctx

	cmd := exec.CommandContext(ctx, cli, "exec", "--timeout", "120", agent, "--", "python3", "-c", memoryBomb)
	cmd.Env = e.cliEnv(api.Endpoint(), api.Token())
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	start := time.Now()
	err := cmd.Run()
	var exitErr *exec.ExitError
	lines := strings.Split(strings.TrimSpace(stdout.String()), "\n")
	t.Logf("agentbox exec of a memory bomb: %v after %v; last output %q; stderr %q", err, time.Since(start).Round(time.Millisecond),
		lines[len(lines)-1], tail(stderr.String(), 400))
	if !errors.As(err, &exitErr) || exitErr.ExitCode() != 137 {
		t.Errorf("agentbox exec: %v, want exit 137 (SIGKILL)", err)
	}
	for _, want := range []string{"signal=SIGKILL out_of_memory=true", "the sandbox ran short of memory"} {
		if !strings.Contains(stderr.String(), want) {
			t.Errorf("agentbox exec's stderr lacks %q: %q", want, stderr.String())
		}
	}

	// The sandbox lives on.
	res, err := api.RunCommand(ctx, agent, apiclient.RunCommandRequest{Command: []string{"echo", "alive"}})
	if err != nil || res.Stdout != "alive\n" {
		t.Errorf("after the bomb: %+v, %v", res, err)
	}
	var pod corev1.Pod
	must(t, e.get(PodName(sbx.WorkloadName()), &pod))
	for _, cs := range pod.Status.ContainerStatuses {
		if cs.RestartCount != 0 {
			t.Errorf("container %s restarted %d times", cs.Name, cs.RestartCount)
		}
	}

	// The supervisor's own record of the streamed call.
	var found bool
	for deadline := time.Now().Add(10 * time.Second); !found && time.Now().Before(deadline); time.Sleep(100 * time.Millisecond) {
		page, err := api.QueryAudit(ctx, url.Values{"agent_id": {agent}, "operation": {"supervisor:run_command_stream"}})
		must(t, err)
		for _, r := range page.Records {
			var rec supervisorapi.AuditRecord
			if json.Unmarshal([]byte(r.Detail), &rec) == nil && rec.OutOfMemory && rec.Signal == "SIGKILL" {
				found = true
			}
		}
	}
	if !found {
		t.Error("no supervisor record of the bomb with out_of_memory")
	}
}

// TestSupervisorAuditOnCluster: the supervisor's records of calls leave the
// gVisor sandbox with their answers and join the control plane's audit
// chain; a command that then rewrites every file it can write in the
// sandbox (what find / -writable -type f lists) changes none of them, and
// the chain verifies, through the API and "agentbox audit verify". No
// audit file is kept in the pod.
func TestSupervisorAuditOnCluster(t *testing.T) {
	t.Parallel()
	e, _, api, sbx := apiSandbox(t, "audit", nil)
	agent := sbx.Spec.AgentID
	ctx := e.ctx

	// The first call leaves files behind, in /tmp and in the workspace,
	// for the rewrite below to find.
	res, err := api.RunCommand(ctx, agent, apiclient.RunCommandRequest{Command: []string{"sh", "-c",
		"echo first; mkdir -p /tmp/notes; for i in 1 2 3; do echo $i > /tmp/notes/$i; echo $i > /workspace/note-$i 2>/dev/null; done; exit 3"}})
	if err != nil || res.ExitCode != 3 {
		t.Fatalf("run_command: %+v, %v", res, err)
	}
	if _, err := api.ToolRequest(ctx, agent, "python_exec", map[string]any{"code": "print(6 * 7)"}); err != nil {
		t.Fatal(err)
	}
	res, err = api.RunCommand(ctx, agent, apiclient.RunCommandRequest{Command: []string{"sh", "-c", "test -e /tmp/agentbox-audit.jsonl"}})
	if err != nil || res.ExitCode == 0 {
		t.Errorf("an audit file in the pod: %+v, %v", res, err)
	}

	supRecords := func() map[int64]apiclient.AuditRecord {
		t.Helper()
		page, err := api.QueryAudit(ctx, url.Values{"agent_id": {agent}, "limit": {"1000"}})
		must(t, err)
		out := map[int64]apiclient.AuditRecord{}
		for _, r := range page.Records {
			if strings.HasPrefix(r.Operation, "supervisor:") {
				out[r.Seq] = r
			}
		}
		return out
	}
	var before map[int64]apiclient.AuditRecord
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(100 * time.Millisecond) {
		if before = supRecords(); len(before) >= 3 {
			break
		}
	}
	var sawExit3, sawPython bool
	for _, r := range before {
		var rec supervisorapi.AuditRecord
		must(t, json.Unmarshal([]byte(r.Detail), &rec))
		if rec.Sandbox != "" && !strings.HasSuffix(rec.Sandbox, "/sandbox/"+sbx.WorkloadName()) {
			t.Errorf("record %d names sandbox %q", r.Seq, rec.Sandbox)
		}
		switch {
		case r.Operation == "supervisor:run_command" && rec.ExitCode != nil && *rec.ExitCode == 3:
			sawExit3 = true
		case r.Operation == "supervisor:python_exec":
			sawPython = true
		}
	}
	if !sawExit3 || !sawPython {
		t.Fatalf("supervisor records %+v: want run_command's (exit 3) and python_exec's", before)
	}

	// Everything writable in the sandbox, rewritten.
	const rewrite = `
import os
n = 0
for root, dirs, files in os.walk('/'):
    dirs[:] = [d for d in dirs if os.path.join(root, d) not in ('/proc', '/sys', '/dev')]
    for f in files:
        p = os.path.join(root, f)
        try:
            if os.path.islink(p) or not os.path.isfile(p) or not os.access(p, os.W_OK):
                continue
            with open(p, 'r+b') as fh:
                fh.write(b'{"tool":"forged"}\n')
                fh.truncate()
            n += 1
            if n <= 10:
                print(p)
        except OSError:
            pass
print(n, 'files rewritten')
`
	res, err = api.RunCommand(ctx, agent, apiclient.RunCommandRequest{Command: []string{"python3", "-c", rewrite}, TimeoutSeconds: 120})
	if err != nil || res.ExitCode != 0 {
		t.Fatalf("the rewrite: %+v, %v", res, err)
	}
	t.Logf("the rewrite of every file the sandbox can write: %s", strings.ReplaceAll(strings.TrimSpace(res.Stdout), "\n", ", "))
	if !strings.Contains(res.Stdout, "/tmp/notes/1") {
		t.Errorf("the rewrite did not reach the files the first call made: %q", res.Stdout)
	}
	if res, err := api.RunCommand(ctx, agent, apiclient.RunCommandRequest{Command: []string{"echo", "after"}}); err != nil || res.Stdout != "after\n" {
		t.Fatalf("after the rewrite: %+v, %v", res, err)
	}

	var after map[int64]apiclient.AuditRecord
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(100 * time.Millisecond) {
		if after = supRecords(); len(after) >= len(before)+2 {
			break
		}
	}
	for seq, r := range before {
		if a, ok := after[seq]; !ok || a.Hash != r.Hash || a.Detail != r.Detail {
			t.Errorf("record %d changed: %+v, was %+v", seq, a, r)
		}
	}
	if len(after) < len(before)+2 {
		t.Errorf("%d supervisor records after the rewrite and one more call, %d before", len(after), len(before))
	}
	v, err := api.VerifyAudit(ctx)
	if err != nil || !v.OK {
		t.Errorf("audit verify: %+v, %v", v, err)
	}
	cli := goBuild(t, "../cmd/agentbox", "agentbox")
	cmd := exec.CommandContext(ctx, cli, "audit", "verify")
	cmd.Env = e.cliEnv(api.Endpoint(), api.Token())
	out, err := cmd.CombinedOutput()
	if err != nil || !strings.Contains(string(out), "intact") {
		t.Errorf("agentbox audit verify: %v\n%s", err, out)
	}
	t.Logf("agentbox audit verify: %s", strings.TrimSpace(string(out)))
}

// TestLivenessProbeOnCluster: a gVisor sandbox pod's liveness probe passes
// while the supervisor serves (no restart over several periods), and once
// the supervisor is stopped, it fails and kubelet restarts the container,
// whose new supervisor serves again.
func TestLivenessProbeOnCluster(t *testing.T) {
	t.Parallel()
	e := newClusterEnv(t)
	p := e.gvisorPod(t, "live", gvisorPodOptions{memoryLimit: "256Mi", workspaceCap: "32MiB", emptyDirSize: "64Mi"})
	ctx := e.ctx
	probe := p.pod.Spec.Containers[0].LivenessProbe
	if probe == nil || probe.Exec == nil {
		t.Fatalf("no exec liveness probe: %+v", probe)
	}
	period := time.Duration(probe.PeriodSeconds) * time.Second

	// Healthy: several periods without a restart. One slow probe on a
	// loaded machine is tolerated, as kubelet tolerates it; more are not.
	time.Sleep(4 * period)
	if r := p.restarts(t); r != 0 {
		t.Fatalf("a healthy sandbox restarted %d times", r)
	}
	var pod corev1.Pod
	must(t, e.get(p.name, &pod))
	for _, c := range pod.Status.Conditions {
		if c.Type == corev1.PodReady && c.Status != corev1.ConditionTrue {
			t.Errorf("a healthy sandbox's pod is not Ready: %+v", c)
		}
	}
	failures := livenessFailures(t, e, p.name)
	if failures > 1 {
		t.Errorf("%d liveness probe failures on a healthy sandbox", failures)
	}
	h0, err := p.sup.Health(ctx)
	must(t, err)
	t.Logf("healthy for %v (4 probe periods): Ready, no restart, %d probe failures; supervisor uptime %d s", 4*period, failures, h0.UptimeSeconds)

	// Wedge the supervisor: SIGSTOP, sent from inside the pod by code the
	// agent runs.
	res, err := p.sup.RunCommand(ctx, supervisorapi.CommandRequest{Command: []string{"sh", "-c", "(sleep 1; kill -STOP 1) >/dev/null 2>&1 &"}, Cwd: "/tmp"})
	if err != nil || res.ExitCode != 0 {
		t.Fatalf("kill -STOP 1 in the pod: %+v, %v", res, err)
	}
	e.eventually("the supervisor to stop answering", func() error {
		hctx, cancel := context.WithTimeout(ctx, 3*time.Second)
		defer cancel()
		if _, err := p.sup.Health(hctx); err == nil {
			return errors.New("it still answers")
		}
		return nil
	})
	// Its port still takes connections (the kernel accepts them), which is
	// all the readiness probe checks; the liveness probe goes further.
	stopped := time.Now()
	e.eventually("kubelet to restart the wedged sandbox", func() error {
		if r := p.restarts(t); r == 0 {
			return fmt.Errorf("no restart yet; %d liveness failures", livenessFailures(t, e, p.name))
		}
		return nil
	})
	restartedAfter := time.Since(stopped)
	var h1 *supervisorapi.Health
	e.eventually("the restarted supervisor to serve", func() error {
		hctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		defer cancel()
		h1, err = p.sup.Health(hctx)
		return err
	})
	if n := livenessFailures(t, e, p.name); n == 0 {
		t.Error("the restart was not the liveness probe's")
	}
	t.Logf("the wedged supervisor was restarted %v after SIGSTOP (probe: every %ds, %d failures); the new one has uptime %d s",
		restartedAfter.Round(time.Second), probe.PeriodSeconds, probe.FailureThreshold, h1.UptimeSeconds)
}

// livenessFailures counts kubelet's failed liveness probes of pod.
func livenessFailures(t *testing.T, e *clusterEnv, pod string) int32 {
	t.Helper()
	var list corev1.EventList
	must(t, e.c.List(e.ctx, &list, client.InNamespace(e.ns)))
	var n int32
	for _, ev := range list.Items {
		if ev.InvolvedObject.Name == pod && ev.Reason == "Unhealthy" && strings.Contains(ev.Message, "Liveness") {
			n += max(ev.Count, 1)
		}
	}
	return n
}
