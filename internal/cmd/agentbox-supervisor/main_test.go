package main

import (
	"bufio"
	"bytes"
	"context"
	"crypto/rand"
	"crypto/tls"
	"debug/elf"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/agentbox/terraform-provider-agentbox/internal/pki"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor"
	api "github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"
)

func TestParseOptions(t *testing.T) {
	env := map[string]string{}
	getenv := func(k string) string { return env[k] }

	o, err := parseOptions(nil, getenv, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if o.listen != ":8443" || o.tlsDir != "/etc/agentbox/tls" || o.insecureListen != "" {
		t.Errorf("defaults: %+v", o)
	}
	if want := "spiffe://agentbox.local/ns/agentbox-system/sa/agentbox-controlplane"; len(o.allowedClientIDs) != 1 || o.allowedClientIDs[0] != want {
		t.Errorf("allowed IDs = %v, want [%s]", o.allowedClientIDs, want)
	}

	env["AGENTBOX_NAMESPACE"] = "platform"
	env["AGENTBOX_TRUST_DOMAIN"] = "corp.example"
	o, err = parseOptions(nil, getenv, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if want := "spiffe://corp.example/ns/platform/sa/agentbox-controlplane"; o.allowedClientIDs[0] != want {
		t.Errorf("allowed IDs = %v, want [%s]", o.allowedClientIDs, want)
	}

	o, err = parseOptions([]string{"-allowed-client-ids", "spiffe://a/ns/x/sa/y, spiffe://a/ns/x/sa/z", "-pass-env", ""}, getenv, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if len(o.allowedClientIDs) != 2 || o.allowedClientIDs[1] != "spiffe://a/ns/x/sa/z" || o.passEnv == nil || len(o.passEnv) != 0 {
		t.Errorf("explicit lists: %+v", o)
	}
	if _, err := parseOptions([]string{"-allowed-client-ids", "https://example.com/x"}, getenv, io.Discard); err == nil {
		t.Error("accepted an allowed ID that is not a SPIFFE ID")
	}

	if o.workspaceCap != 1<<30 || o.workspace != "" {
		t.Errorf("workspace defaults: %q %d", o.workspace, o.workspaceCap)
	}
	if o, err := parseOptions([]string{"-workdir", "/srv/ws"}, getenv, io.Discard); err != nil || o.workspace != "/srv/ws" {
		t.Errorf("workspace follows -workdir: %+v, %v", o, err)
	}
	for in, want := range map[string]int64{"1GiB": 1 << 30, "500MB": 500e6, "4096": 4096, "2 KiB": 2048, "7B": 7} {
		o, err := parseOptions([]string{"-workspace-cap", in}, getenv, io.Discard)
		if err != nil || o.workspaceCap != want {
			t.Errorf("-workspace-cap %s: %v, %v; want %d", in, o, err, want)
		}
	}
	for _, in := range []string{"", "0", "-1GiB", "1.5GiB", "lots", "9999999999GiB"} {
		if _, err := parseOptions([]string{"-workspace-cap", in}, getenv, io.Discard); err == nil {
			t.Errorf("-workspace-cap %q was accepted", in)
		}
	}
	for _, addr := range []string{"127.0.0.1:0", "[::1]:8080", "localhost:8080", "127.1.2.3:80"} {
		if _, err := parseOptions([]string{"-insecure-listen", addr}, getenv, io.Discard); err != nil {
			t.Errorf("-insecure-listen %s: %v", addr, err)
		}
	}
	for _, addr := range []string{":8080", "0.0.0.0:8080", "[::]:8080", "10.0.0.5:8080", "example.com:80", "127.0.0.1"} {
		if _, err := parseOptions([]string{"-insecure-listen", addr}, getenv, io.Discard); err == nil {
			t.Errorf("-insecure-listen %s was accepted", addr)
		}
	}
}

// supervisorProcess is the real binary running as a child of the test.
type supervisorProcess struct {
	cmd  *exec.Cmd
	addr string
	done chan error

	mu   sync.Mutex
	logs []map[string]any
}

func (p *supervisorProcess) logLines() []map[string]any {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]map[string]any(nil), p.logs...)
}

func buildSupervisor(t *testing.T) string {
	t.Helper()
	goBin, err := exec.LookPath("go")
	if err != nil {
		t.Skip("go toolchain not in PATH")
	}
	bin := filepath.Join(t.TempDir(), "agentbox-supervisor")
	build := exec.Command(goBin, "build", "-trimpath", "-ldflags", "-s -w -X main.version=test-build", "-o", bin, ".")
	build.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	// The sandbox image has no libc of its own to rely on, so the binary
	// must not need a dynamic loader.
	f, err := elf.Open(bin)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	for _, p := range f.Progs {
		if p.Type == elf.PT_INTERP {
			t.Fatal("the supervisor binary is dynamically linked")
		}
	}
	return bin
}

func startSupervisor(t *testing.T, bin string, args []string, env []string) *supervisorProcess {
	t.Helper()
	cmd := exec.Command(bin, args...)
	cmd.Env = env
	stderr, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	p := &supervisorProcess{cmd: cmd, done: make(chan error, 1)}
	listening := make(chan string, 1)
	go func() {
		sc := bufio.NewScanner(stderr)
		for sc.Scan() {
			t.Log("supervisor:", sc.Text())
			var line map[string]any
			if json.Unmarshal(sc.Bytes(), &line) != nil {
				continue
			}
			p.mu.Lock()
			p.logs = append(p.logs, line)
			p.mu.Unlock()
			if line["msg"] == "listening" {
				listening <- line["addr"].(string)
			}
		}
		p.done <- cmd.Wait()
	}()
	t.Cleanup(func() {
		if cmd.ProcessState == nil {
			_ = cmd.Process.Kill()
			<-p.done
		}
	})
	select {
	case p.addr = <-listening:
	case err := <-p.done:
		t.Fatalf("supervisor exited before listening: %v", err)
	case <-time.After(30 * time.Second):
		t.Fatal("supervisor did not start listening")
	}
	return p
}

func writeTLSDir(t *testing.T, ca *pki.CA, leaf *pki.Leaf) string {
	t.Helper()
	dir := t.TempDir()
	for name, data := range map[string][]byte{"tls.crt": leaf.CertPEM, "tls.key": leaf.KeyPEM, "ca.crt": ca.CertPEM} {
		if err := os.WriteFile(filepath.Join(dir, name), data, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	return dir
}

func issue(t *testing.T, ca *pki.CA, id string, usage pki.Usage) *pki.Leaf {
	t.Helper()
	u, err := pki.ParseID(id)
	if err != nil {
		t.Fatal(err)
	}
	leaf, err := ca.Issue(pki.LeafOptions{ID: u, Usage: usage})
	if err != nil {
		t.Fatal(err)
	}
	return leaf
}

func clientFor(t *testing.T, addr string, cert *pki.Leaf, pool *pki.CA, expectedServer string) *api.Client {
	t.Helper()
	c, err := cert.TLSCertificate()
	if err != nil {
		t.Fatal(err)
	}
	return api.NewClient("https://"+addr, api.NewHTTPClient(pki.ClientTLS(c, pool.Pool(), expectedServer)))
}

// TestSupervisorProcess builds the real binary, runs it with certificates
// from the platform CA, and talks to it over mTLS as the control plane does.
func TestSupervisorProcess(t *testing.T) {
	bin := buildSupervisor(t)

	ca, err := pki.NewCA("agentbox-test-ca")
	if err != nil {
		t.Fatal(err)
	}
	sandboxID := pki.SandboxID("", "agents", "sb-1").String()
	controlPlaneID := pki.ControlPlaneID("", "platform").String()
	tlsDir := writeTLSDir(t, ca, issue(t, ca, sandboxID, pki.UsageServer))
	controlPlane := issue(t, ca, controlPlaneID, pki.UsageClient)
	workdir := t.TempDir()

	p := startSupervisor(t, bin,
		[]string{"-listen", "127.0.0.1:0", "-tls-dir", tlsDir, "-workdir", workdir, "-workspace", workdir, "-workspace-cap", "16MiB", "-shutdown-grace", "20s"},
		[]string{"AGENTBOX_NAMESPACE=platform", "AGENTBOX_TEST_SECRET=s3cret-value", "PATH=" + os.Getenv("PATH")})
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	client := clientFor(t, p.addr, controlPlane, ca, sandboxID)

	h, err := client.Health(ctx)
	if err != nil || h.Status != "ok" || h.Version != "test-build" || h.Workspace == nil || h.Workspace.CapBytes != 16<<20 {
		t.Fatalf("Health = %+v, %v", h, err)
	}

	// Commands get the supervisor's default PATH, so look where they will.
	command, wantPrefix := []string{"echo", "no python3 here"}, "no python3 here"
	for _, dir := range filepath.SplitList(supervisor.DefaultPath) {
		if _, err := os.Stat(filepath.Join(dir, "python3")); err == nil {
			command, wantPrefix = []string{"python3", "-c", "import sys; print(sys.version)"}, "3."
			break
		}
	}
	start := time.Now()
	res, err := client.RunCommand(ctx, api.CommandRequest{Command: command})
	if err != nil {
		t.Fatalf("RunCommand(%q): %v", command, err)
	}
	if res.ExitCode != 0 || !strings.HasPrefix(res.Stdout, wantPrefix) || res.TimedOut {
		t.Fatalf("RunCommand(%q) = %+v", command, res)
	}
	t.Logf("%s -> %q in %s over mTLS (duration_ms %d)", command[0], strings.TrimSpace(res.Stdout), time.Since(start), res.DurationMS)

	res, err = client.RunCommand(ctx, api.CommandRequest{Command: []string{"env"}})
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(res.Stdout, "s3cret-value") || strings.Contains(res.Stdout, "AGENTBOX_") {
		t.Fatalf("the supervisor's environment reached the command:\n%s", res.Stdout)
	}

	testFilesOverMTLS(ctx, t, client, workdir)

	_, err = client.RunCommand(ctx, api.CommandRequest{Command: []string{"true"}, TimeoutSeconds: 3600})
	if api.CodeOf(err) != api.CodeInvalidArgument {
		t.Fatalf("timeout above the maximum: %v, want invalid_argument", err)
	}

	// A valid certificate from the same CA with another identity, here a
	// sandbox posing as the control plane, is refused during the handshake.
	other := issue(t, ca, pki.SandboxID("", "agents", "sb-2").String(), pki.UsageClient)
	_, err = clientFor(t, p.addr, other, ca, sandboxID).Health(ctx)
	if err == nil || api.CodeOf(err) != "" {
		t.Fatalf("client with the wrong identity: %v, want a transport failure", err)
	}
	t.Logf("client with the wrong identity: %v", err)
	otherCert, _ := other.TLSCertificate()
	conn, err := tls.Dial("tcp", p.addr, pki.ClientTLS(otherCert, ca.Pool(), sandboxID))
	if err == nil {
		_ = conn.SetReadDeadline(time.Now().Add(10 * time.Second))
		_, err = conn.Read(make([]byte, 1))
		conn.Close()
	}
	// A TLS alert from the peer arrives as a net.OpError "remote error".
	var opErr *net.OpError
	if !errors.As(err, &opErr) || opErr.Op != "remote error" {
		t.Fatalf("raw TLS connection with the wrong identity: %v, want a TLS alert from the server", err)
	}
	// The control plane refuses a supervisor that is not the sandbox it
	// meant to reach.
	_, err = clientFor(t, p.addr, controlPlane, ca, pki.SandboxID("", "agents", "sb-2").String()).Health(ctx)
	if err == nil || !strings.Contains(err.Error(), "want spiffe://agentbox.local/ns/agents/sandbox/sb-2") {
		t.Fatalf("wrong server identity: %v, want a refusal", err)
	}

	// SIGTERM lets a running command finish, then the process exits 0.
	started := filepath.Join(workdir, "started")
	result := make(chan error, 1)
	var slow *api.CommandResult
	go func() {
		var err error
		slow, err = client.RunCommand(ctx, api.CommandRequest{Command: []string{"sh", "-c", "touch started; sleep 1; echo finished"}})
		result <- err
	}()
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		if _, err := os.Stat(started); err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the slow command did not start")
		}
	}
	if err := p.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	if err := <-result; err != nil {
		t.Fatalf("command running at SIGTERM: %v", err)
	}
	if slow.Stdout != "finished\n" || slow.ExitCode != 0 {
		t.Fatalf("command running at SIGTERM: %+v", slow)
	}
	select {
	case err := <-p.done:
		if err != nil {
			t.Fatalf("supervisor exit: %v", err)
		}
	case <-time.After(15 * time.Second):
		t.Fatal("supervisor did not exit after SIGTERM")
	}

	var sawCommand, sawHandshakeError, sawStopped bool
	for _, l := range p.logLines() {
		switch {
		case l["msg"] == "request" && l["path"] == api.PathCommands && l["status"] == float64(200) && l["peer"] == controlPlaneID:
			sawCommand = true
		case strings.Contains(asString(l["msg"]), "TLS handshake error") && strings.Contains(asString(l["msg"]), "sb-2 is not allowed"):
			sawHandshakeError = true
		case l["msg"] == "stopped":
			sawStopped = true
		}
	}
	if !sawCommand || !sawHandshakeError || !sawStopped {
		t.Errorf("logs: command line %v, handshake error %v, stopped %v", sawCommand, sawHandshakeError, sawStopped)
	}
}

// Commands still running when the grace period ends are sent SIGTERM with
// their process groups, the caller gets that result, and the supervisor
// still exits.
func TestSupervisorProcessGraceExpires(t *testing.T) {
	bin := buildSupervisor(t)
	workdir := t.TempDir()
	p := startSupervisor(t, bin,
		[]string{"-insecure-listen", "127.0.0.1:0", "-workdir", workdir, "-shutdown-grace", "500ms"},
		[]string{"PATH=" + os.Getenv("PATH")})
	client := api.NewClient("http://"+p.addr, nil)
	ctx := context.Background()

	result := make(chan error, 1)
	var res *api.CommandResult
	go func() {
		var err error
		res, err = client.RunCommand(ctx, api.CommandRequest{Command: []string{"sh", "-c", "sleep 100 & echo $! > pid; sleep 100"}})
		result <- err
	}()
	var pid int
	for deadline := time.Now().Add(10 * time.Second); pid == 0; time.Sleep(10 * time.Millisecond) {
		data, _ := os.ReadFile(filepath.Join(workdir, "pid"))
		pid, _ = strconv.Atoi(strings.TrimSpace(string(data)))
		if time.Now().After(deadline) {
			t.Fatal("the command did not start")
		}
	}
	t.Logf("exited %s after SIGTERM with a 500ms grace period", sigterm(t, p, 15*time.Second))
	if err := <-result; err != nil || res.Signal != "SIGTERM" {
		t.Errorf("command stopped at shutdown: %+v, %v; want its result, ended by SIGTERM", res, err)
	}
	for deadline := time.Now().Add(3 * time.Second); !gone(pid); time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("background process %d survived the supervisor", pid)
		}
	}
}

// testFilesOverMTLS puts and gets a 10 MiB binary file through the real
// process, and checks the cap and confinement over the same connection.
func testFilesOverMTLS(ctx context.Context, t *testing.T, client *api.Client, workdir string) {
	t.Helper()
	data := make([]byte, 10<<20)
	if _, err := rand.Read(data); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	fi, err := client.PutFile(ctx, "dir/blob.bin", bytes.NewReader(data), 0o640)
	if err != nil {
		t.Fatal(err)
	}
	put := time.Since(start)
	if fi.Size != int64(len(data)) || fi.Mode != "0640" {
		t.Fatalf("PutFile = %+v", fi)
	}
	start = time.Now()
	rc, err := client.GetFile(ctx, "dir/blob.bin")
	if err != nil {
		t.Fatal(err)
	}
	got, err := io.ReadAll(rc)
	rc.Close()
	if err != nil {
		t.Fatal(err)
	}
	get := time.Since(start)
	if !bytes.Equal(got, data) {
		t.Fatalf("GetFile returned %d bytes that differ from the %d put", len(got), len(data))
	}
	if onDisk, err := os.ReadFile(filepath.Join(workdir, "dir", "blob.bin")); err != nil || !bytes.Equal(onDisk, data) {
		t.Fatalf("file on disk differs (%v)", err)
	}
	t.Logf("10 MiB over mTLS: put %s (%.0f MB/s), get %s (%.0f MB/s)", put, 10.48576/put.Seconds(), get, 10.48576/get.Seconds())

	if h, err := client.Health(ctx); err != nil || h.Workspace.UsedBytes != int64(len(data)) {
		t.Fatalf("Health after the put = %+v, %v", h, err)
	}
	// Another 10 MiB would pass the 16 MiB cap; the refusal arrives while
	// the client is still sending, and it still gets the typed error.
	_, err = client.PutFile(ctx, "dir/blob2.bin", io.MultiReader(bytes.NewReader(data)), 0)
	if api.CodeOf(err) != api.CodeWorkspaceFull {
		t.Fatalf("put past the cap: %v, want workspace_full", err)
	}
	_, err = client.PutFile(ctx, "dir/blob.bin", io.MultiReader(bytes.NewReader(data), bytes.NewReader(data)), 0)
	if api.CodeOf(err) != api.CodeWorkspaceFull {
		t.Fatalf("replacement past the cap: %v, want workspace_full", err)
	}
	if onDisk, err := os.ReadFile(filepath.Join(workdir, "dir", "blob.bin")); err != nil || !bytes.Equal(onDisk, data) {
		t.Fatalf("a refused replacement changed the file (%v)", err)
	}
	if _, err := client.GetFile(ctx, "../../etc/passwd"); api.CodeOf(err) != api.CodePathEscapesWorkspace {
		t.Fatalf("GetFile(../../etc/passwd): %v, want path_escapes_workspace", err)
	}
	if err := client.Delete(ctx, "dir", true); err != nil {
		t.Fatal(err)
	}
}

func asString(v any) string {
	s, _ := v.(string)
	return s
}

// gone reports whether pid has stopped running; a zombie waiting for a
// parent to collect it counts.
func gone(pid int) bool {
	data, err := os.ReadFile(filepath.Join("/proc", strconv.Itoa(pid), "stat"))
	if err != nil {
		return errors.Is(err, os.ErrNotExist)
	}
	i := strings.LastIndexByte(string(data), ')')
	return i >= 0 && strings.HasPrefix(strings.TrimSpace(string(data[i+1:])), "Z")
}

// TestParseTemplateOptions covers the variables the controller sets from a
// SandboxTemplate: the python_exec timeouts and the inline MCP servers.
func TestParseTemplateOptions(t *testing.T) {
	env := map[string]string{
		"AGENTBOX_PYTHON_DEFAULT_TIMEOUT": "3m",
		"AGENTBOX_PYTHON_MAX_TIMEOUT":     "90s",
		"AGENTBOX_MCP_SERVERS_JSON":       `[{"name":"fs","command":"mcp-fs","args":["/workspace"]}]`,
	}
	getenv := func(k string) string { return env[k] }
	o, err := parseOptions(nil, getenv, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	// A default above the cap is cut to it, as the template API promises.
	if o.pythonTimeout != 90*time.Second || o.pythonMaxTimeout != 90*time.Second {
		t.Errorf("python timeouts %s / %s, want 1m30s / 1m30s", o.pythonTimeout, o.pythonMaxTimeout)
	}
	if o.mcpServersJSON != env["AGENTBOX_MCP_SERVERS_JSON"] {
		t.Errorf("mcp servers json %q", o.mcpServersJSON)
	}
	for _, bad := range [][]string{{"-python-default-timeout", "soon"}, {"-python-max-timeout", "0s"}} {
		if _, err := parseOptions(bad, getenv, io.Discard); err == nil {
			t.Errorf("%v was accepted", bad)
		}
	}
	o.mcpServers = "/etc/servers.json"
	if _, err := newMCPManager(o, slog.New(slog.DiscardHandler)); err == nil || !strings.Contains(err.Error(), "exclusive") {
		t.Errorf("both MCP server sources: %v", err)
	}
	o.mcpServers, o.mcpServersJSON = "", `[{"name":"fs","command":"mcp-fs","bogus":1}]`
	if _, err := newMCPManager(o, slog.New(slog.DiscardHandler)); err == nil {
		t.Error("an MCP server list with an unknown field was accepted")
	}
}
