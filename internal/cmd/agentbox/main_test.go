package main

import (
	"bytes"
	"context"
	"encoding/json"
	"encoding/pem"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
)

const token = "tok-123"

// fakeAPI is a Compute API that answers run_command and
// run_command_stream from a table keyed by the command's first word and
// records the requests it got.
type fakeAPI struct {
	srv      *httptest.Server
	caFile   string
	mu       sync.Mutex
	requests []client.RunCommandRequest
	paths    []string
}

func newFakeAPI(t *testing.T) *fakeAPI {
	t.Helper()
	f := &fakeAPI{}
	f.srv = httptest.NewTLSServer(http.HandlerFunc(f.serve))
	t.Cleanup(f.srv.Close)
	f.caFile = filepath.Join(t.TempDir(), "ca.crt")
	if err := os.WriteFile(f.caFile, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: f.srv.Certificate().Raw}), 0o600); err != nil {
		t.Fatal(err)
	}
	return f
}

func (f *fakeAPI) serve(w http.ResponseWriter, r *http.Request) {
	w.Header().Set("Content-Type", "application/json")
	if r.Header.Get("Authorization") != "Bearer "+token {
		w.WriteHeader(http.StatusUnauthorized)
		_ = json.NewEncoder(w).Encode(client.ErrorBody{Error: client.Errorf(client.CodeUnauthenticated, "invalid bearer token")})
		return
	}
	if strings.HasPrefix(r.URL.Path, "/v1/agents/nobody/") {
		w.WriteHeader(http.StatusNotFound)
		_ = json.NewEncoder(w).Encode(client.ErrorBody{Error: client.Errorf(client.CodeSandboxNotFound, `agent "nobody" has no sandbox`)})
		return
	}
	var req client.RunCommandRequest
	if err := json.NewDecoder(r.Body).Decode(&req); err != nil {
		w.WriteHeader(http.StatusBadRequest)
		return
	}
	f.mu.Lock()
	f.requests = append(f.requests, req)
	f.paths = append(f.paths, r.URL.Path)
	f.mu.Unlock()
	var res client.CommandResult
	switch req.Command[0] {
	case "exit3":
		res = client.CommandResult{Stdout: "out\nno newline at end", Stderr: "err\n", ExitCode: 3, DurationMS: 1500}
	case "sleep":
		res = client.CommandResult{ExitCode: -1, Signal: "SIGKILL", TimedOut: true, DurationMS: 2000}
	case "killed":
		res = client.CommandResult{ExitCode: -1, Signal: "SIGKILL", DurationMS: 5}
	case "memory-hog":
		res = client.CommandResult{ExitCode: -1, Signal: "SIGKILL", OutOfMemory: true, DurationMS: 5}
	default:
		res = client.CommandResult{Stdout: strings.Join(req.Command, " ") + "\n", DurationMS: 12}
	}
	if !strings.HasSuffix(r.URL.Path, "/stream") {
		_ = json.NewEncoder(w).Encode(res)
		return
	}
	// The stream: the output as events, then the result without it.
	w.Header().Set("Content-Type", client.ContentTypeNDJSON)
	enc := json.NewEncoder(w)
	for _, ev := range []client.CommandEvent{{Stream: client.StreamStdout, Data: res.Stdout}, {Stream: client.StreamStderr, Data: res.Stderr}} {
		if ev.Data != "" {
			_ = enc.Encode(ev)
		}
	}
	res.Stdout, res.Stderr = "", ""
	_ = enc.Encode(client.CommandEvent{Exit: &res})
}

func (f *fakeAPI) last(t *testing.T) (client.RunCommandRequest, string) {
	t.Helper()
	f.mu.Lock()
	defer f.mu.Unlock()
	if len(f.requests) == 0 {
		t.Fatal("the API got no request")
	}
	return f.requests[len(f.requests)-1], f.paths[len(f.paths)-1]
}

type result struct {
	code           int
	stdout, stderr string
}

func runCLI(t *testing.T, env map[string]string, stdin string, args ...string) result {
	t.Helper()
	var out, errOut bytes.Buffer
	code := run(context.Background(), args, func(k string) string { return env[k] }, strings.NewReader(stdin), &out, &errOut)
	return result{code, out.String(), errOut.String()}
}

func writeToken(t *testing.T, tok string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "token")
	if err := os.WriteFile(p, []byte(tok+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

func TestRunCommandPrintsOutputAndExitsWithTheCommandsCode(t *testing.T) {
	api := newFakeAPI(t)
	r := runCLI(t, nil, "", "run-command", "--endpoint", api.srv.URL, "--token-file", writeToken(t, token),
		"--ca-file", api.caFile, "agent-1", "--", "exit3", "-x")
	if r.code != 3 {
		t.Errorf("exit code %d, want 3; stderr:\n%s", r.code, r.stderr)
	}
	if r.stdout != "out\nno newline at end" {
		t.Errorf("stdout %q: must be the command's, unchanged", r.stdout)
	}
	if r.stderr != "err\nexit_code=3 duration=1.5s\n" {
		t.Errorf("stderr %q", r.stderr)
	}
	req, path := api.last(t)
	if path != "/v1/agents/agent-1/run_command/stream" || strings.Join(req.Command, " ") != "exit3 -x" {
		t.Errorf("request %s %+v", path, req)
	}
}

func TestFlagsAfterAgentIDAndEnvironmentToken(t *testing.T) {
	api := newFakeAPI(t)
	env := map[string]string{"AGENTBOX_TOKEN": token, "AGENTBOX_ENDPOINT": api.srv.URL, "AGENTBOX_CA_FILE": api.caFile}
	r := runCLI(t, env, "some input", "run-command", "user@example.com", "--cwd", "/workspace/x", "--env", "A=1",
		"--env", "B=x=y", "--timeout", "9", "--stdin", "--", "python3", "-c", "print(1)")
	if r.code != 0 {
		t.Fatalf("exit %d: %s", r.code, r.stderr)
	}
	if r.stdout != "python3 -c print(1)\n" || !strings.HasSuffix(r.stderr, "exit_code=0 duration=12ms\n") {
		t.Errorf("stdout %q stderr %q", r.stdout, r.stderr)
	}
	req, path := api.last(t)
	if path != "/v1/agents/user@example.com/run_command/stream" || req.Cwd != "/workspace/x" || req.Env["A"] != "1" ||
		req.Env["B"] != "x=y" || req.TimeoutSeconds != 9 || req.Stdin != "some input" {
		t.Errorf("request %s %+v", path, req)
	}
}

func TestTimeoutAndSignalExitCodes(t *testing.T) {
	api := newFakeAPI(t)
	env := map[string]string{"AGENTBOX_TOKEN": token}
	r := runCLI(t, env, "", "run-command", "--endpoint", api.srv.URL, "--ca-file", api.caFile, "a", "--", "sleep", "100")
	if r.code != 124 || !strings.Contains(r.stderr, "exit_code=-1 duration=2s signal=SIGKILL timed_out=true") {
		t.Errorf("timed out: exit %d, stderr %q", r.code, r.stderr)
	}
	r = runCLI(t, env, "", "run-command", "--endpoint", api.srv.URL, "--ca-file", api.caFile, "a", "--", "killed")
	if r.code != 137 || strings.Contains(r.stderr, "memory") {
		t.Errorf("killed: exit %d, stderr %q; want 137 and no word of memory", r.code, r.stderr)
	}
	r = runCLI(t, env, "", "run-command", "--endpoint", api.srv.URL, "--ca-file", api.caFile, "a", "--", "memory-hog")
	if r.code != 137 || !strings.Contains(r.stderr, "signal=SIGKILL out_of_memory=true") || !strings.Contains(r.stderr, outOfMemoryNote) {
		t.Errorf("killed by the memory guard: exit %d, stderr %q; want 137, out_of_memory=true and the note", r.code, r.stderr)
	}
}

func TestAPIErrorsExitOneWithAMessage(t *testing.T) {
	api := newFakeAPI(t)
	r := runCLI(t, nil, "", "run-command", "--endpoint", api.srv.URL, "--token-file", writeToken(t, "wrong"),
		"--ca-file", api.caFile, "a", "--", "true")
	if r.code != 1 || !strings.Contains(r.stderr, "unauthenticated") || !strings.Contains(r.stderr, "check the token") || r.stdout != "" {
		t.Errorf("wrong token: exit %d, stdout %q, stderr %q", r.code, r.stdout, r.stderr)
	}
	r = runCLI(t, map[string]string{"AGENTBOX_TOKEN": token}, "", "run-command", "--endpoint", api.srv.URL,
		"--ca-file", api.caFile, "nobody", "--", "true")
	if r.code != 1 || !strings.Contains(r.stderr, `agent "nobody" has no sandbox (sandbox_not_found, HTTP 404)`) {
		t.Errorf("unknown agent: exit %d, stderr %q", r.code, r.stderr)
	}
	// Without the CA the server's certificate is not trusted.
	r = runCLI(t, map[string]string{"AGENTBOX_TOKEN": token}, "", "run-command", "--endpoint", api.srv.URL, "a", "--", "true")
	if r.code != 1 || !strings.Contains(r.stderr, "certificate") {
		t.Errorf("untrusted server: exit %d, stderr %q", r.code, r.stderr)
	}
}

func TestUsageErrors(t *testing.T) {
	api := newFakeAPI(t)
	env := map[string]string{"AGENTBOX_TOKEN": token}
	for name, tc := range map[string]struct {
		env  map[string]string
		args []string
		want string
	}{
		"no command":     {env, []string{}, "usage: agentbox"},
		"unknown":        {env, []string{"frobnicate"}, `unknown command "frobnicate"`},
		"no agent":       {env, []string{"run-command", "--endpoint", api.srv.URL}, "missing AGENT_ID"},
		"no argv":        {env, []string{"run-command", "--endpoint", api.srv.URL, "a", "--"}, "missing the command"},
		"no endpoint":    {env, []string{"run-command", "a", "--", "true"}, "--endpoint"},
		"no token":       {nil, []string{"run-command", "--endpoint", api.srv.URL, "a", "--", "true"}, "no token"},
		"bad env":        {env, []string{"run-command", "--env", "novalue", "a", "--", "true"}, "want NAME=VALUE"},
		"bad token file": {nil, []string{"run-command", "--endpoint", api.srv.URL, "--token-file", "/nonexistent", "a", "--", "true"}, "read --token-file"},
	} {
		r := runCLI(t, tc.env, "", tc.args...)
		if r.code != 2 || !strings.Contains(r.stderr, tc.want) {
			t.Errorf("%s: exit %d, stderr %q, want 2 and %q", name, r.code, r.stderr, tc.want)
		}
	}
	if r := runCLI(t, nil, "", "run-command", "-h"); r.code != 0 || !strings.Contains(r.stderr, "AGENT_ID -- CMD") {
		t.Errorf("-h: exit %d, stderr %q", r.code, r.stderr)
	}
}

func TestNewCommandsUsageErrors(t *testing.T) {
	api := newFakeAPI(t)
	env := map[string]string{"AGENTBOX_TOKEN": token, "AGENTBOX_ENDPOINT": api.srv.URL, "AGENTBOX_CA_FILE": api.caFile}
	for name, tc := range map[string]struct {
		args []string
		want string
	}{
		"exec two inputs":        {[]string{"exec", "--stdin", "--stdin-file", "f", "a", "--", "cat"}, `--stdin and --stdin-file "f"`},
		"exec bad timeout":       {[]string{"exec", "--timeout", "soon", "a", "--", "true"}, `invalid value "soon" for flag -timeout`},
		"exec no stdin file":     {[]string{"exec", "--stdin-file", "/nonexistent/in", "a", "--", "cat"}, "--stdin-file: open /nonexistent/in"},
		"cp one operand":         {[]string{"cp", "a:x"}, "missing DST"},
		"cp three operands":      {[]string{"cp", "a:x", "y", "z"}, `unexpected argument "z"`},
		"cp both local":          {[]string{"cp", "x", "./a:y"}, `neither SRC "x" nor DST "./a:y" is AGENT_ID:PATH`},
		"cp both remote":         {[]string{"cp", "a:x", "b:y"}, `SRC "a:x" and DST "b:y" are both in a workspace`},
		"cp bad mode":            {[]string{"cp", "--mode", "999", "x", "a:y"}, `--mode "999"`},
		"cp no agent":            {[]string{"cp", "x", ":y"}, `DST ":y": missing AGENT_ID`},
		"cp stdin no name":       {[]string{"cp", "-", "a:dir/"}, `DST "a:dir/" needs a file name`},
		"cp remote dir":          {[]string{"cp", "a:", "x"}, `SRC "a:" names no file`},
		"cp missing source":      {[]string{"cp", "/nonexistent/x", "a:y"}, "SRC: open /nonexistent/x"},
		"cp directory":           {[]string{"cp", t.TempDir(), "a:y"}, "is a directory"},
		"cp agent conflict":      {[]string{"cp", "--agent", "u:1", "x", "b:y"}, `names agent "b" and --agent names "u:1"`},
		"status no agent":        {[]string{"status"}, "missing AGENT_ID"},
		"status two agents":      {[]string{"status", "a", "b"}, `unexpected argument "b"`},
		"deploy bad timeout":     {[]string{"deploy", "--timeout", "0s", "a"}, "--timeout 0s"},
		"leases nothing":         {[]string{"leases"}, "usage: agentbox leases"},
		"leases unknown":         {[]string{"leases", "steal", "a"}, `unknown subcommand "steal"`},
		"acquire no holder":      {[]string{"leases", "acquire", "a"}, "--holder (or AGENTBOX_LEASE_HOLDER) is required"},
		"acquire bad ttl":        {[]string{"leases", "acquire", "--holder", "h", "--ttl", "1.5s", "a"}, `invalid value "1.5s" for flag -ttl`},
		"acquire long ttl":       {[]string{"leases", "acquire", "--holder", "h", "--ttl", "2h", "a"}, "--ttl 7200s: at most 3600s"},
		"heartbeat no id":        {[]string{"leases", "heartbeat", "--holder", "h", "a"}, "--lease-id is required"},
		"acquire-pool no pool":   {[]string{"leases", "acquire-pool", "--holder", "h", "ns"}, "missing POOL"},
		"acquire-pool long wait": {[]string{"leases", "acquire-pool", "--holder", "h", "--wait", "10m", "ns", "p"}, "--wait 600s: at most 300s"},
		"acquire-pool bad wait":  {[]string{"leases", "acquire-pool", "--holder", "h", "--wait", "soon", "ns", "p"}, `invalid value "soon" for flag -wait`},
		"acquire-pool env twice": {[]string{"leases", "acquire-pool", "--holder", "h", "--requirement", "numpy", "--env-name", "e", "ns", "p"}, "--requirement and --env-name: give one or the other"},
		"acquire with wait":      {[]string{"leases", "acquire", "--holder", "h", "--wait", "5", "a"}, "flag provided but not defined: -wait"},
	} {
		r := runCLI(t, env, "", tc.args...)
		if r.code != exitUsage || !strings.Contains(r.stderr, tc.want) {
			t.Errorf("%s: exit %d, stderr %q, want 2 and %q", name, r.code, r.stderr, tc.want)
		}
	}
	for _, args := range [][]string{{"exec", "-h"}, {"cp", "-h"}, {"status", "-h"}, {"deploy", "-h"}, {"leases", "acquire", "-h"}} {
		if r := runCLI(t, env, "", args...); r.code != 0 || !strings.Contains(r.stderr, "usage: agentbox "+args[0]) {
			t.Errorf("%v: exit %d, stderr %q", args, r.code, r.stderr)
		}
	}
}

// The 404s of the new commands come through as API errors, not usage ones.
func TestNewCommandsReportNotFound(t *testing.T) {
	api := newFakeAPI(t)
	env := map[string]string{"AGENTBOX_TOKEN": token, "AGENTBOX_ENDPOINT": api.srv.URL, "AGENTBOX_CA_FILE": api.caFile}
	for _, args := range [][]string{
		{"status", "nobody"}, {"deploy", "nobody"}, {"cp", "nobody:x", "-"},
		{"leases", "release", "--holder", "h", "--lease-id", "l", "nobody"},
	} {
		r := runCLI(t, env, "", args...)
		if r.code != exitAPIError || !strings.Contains(r.stderr, `agent "nobody" has no sandbox (sandbox_not_found, HTTP 404)`) || r.stdout != "" {
			t.Errorf("%v: exit %d, stdout %q, stderr %q", args, r.code, r.stdout, r.stderr)
		}
	}
}
