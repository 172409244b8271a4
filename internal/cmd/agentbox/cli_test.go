package main

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/json"
	"encoding/pem"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/creack/pty"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	ctrlclient "sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	"github.com/agentbox/terraform-provider-agentbox/internal/computeapi/apitest"
	"github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
)

// realAgentAPI starts the real Compute API in front of a real supervisor
// and returns it with the environment that points the CLI at it as the
// agent.
func realAgentAPI(t *testing.T, opts apitest.Options) (*apitest.Server, map[string]string) {
	t.Helper()
	s, err := apitest.NewServer(opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Close)
	caFile := filepath.Join(t.TempDir(), "ca.crt")
	if err := os.WriteFile(caFile, s.CAPEM, 0o600); err != nil {
		t.Fatal(err)
	}
	return s, map[string]string{"AGENTBOX_ENDPOINT": s.URL, "AGENTBOX_CA_FILE": caFile, "AGENTBOX_TOKEN": s.AgentToken}
}

func with(env map[string]string, kv ...string) map[string]string {
	out := map[string]string{}
	for k, v := range env {
		out[k] = v
	}
	for i := 0; i+1 < len(kv); i += 2 {
		out[kv[i]] = kv[i+1]
	}
	return out
}

func TestExecRunsInTheSandboxAndPropagatesExitCodes(t *testing.T) {
	s, env := realAgentAPI(t, apitest.Options{})
	a := s.AgentID

	r := runCLI(t, env, "", "exec", a, "--", "sh", "-c", "echo hello; echo oops >&2; exit 7")
	if r.code != 7 || r.stdout != "hello\n" || !strings.HasPrefix(r.stderr, "oops\nexit_code=7 duration=") {
		t.Errorf("exit 7: code %d, stdout %q, stderr %q", r.code, r.stdout, r.stderr)
	}
	// The quickstart's spelling keeps working.
	r = runCLI(t, env, "", "run-command", a, "--", "echo", "via", "alias")
	if r.code != 0 || r.stdout != "via alias\n" {
		t.Errorf("run-command: code %d, stdout %q, stderr %q", r.code, r.stdout, r.stderr)
	}

	if err := os.Mkdir(filepath.Join(s.Workspace, "sub"), 0o755); err != nil {
		t.Fatal(err)
	}
	input := filepath.Join(t.TempDir(), "input.txt")
	if err := os.WriteFile(input, []byte("from a file\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	r = runCLI(t, env, "", "exec", "--cwd", "sub", a, "--env", "GREETING=hi there", "--stdin-file", input, "--",
		"sh", "-c", `pwd; echo "$GREETING"; cat`)
	want := filepath.Join(s.Workspace, "sub") + "\nhi there\nfrom a file\n"
	if r.code != 0 || r.stdout != want {
		t.Errorf("cwd, env, stdin file: code %d, stdout %q (want %q), stderr %q", r.code, r.stdout, want, r.stderr)
	}
	r = runCLI(t, env, "piped in", "exec", "--stdin-file", "-", a, "--", "tr", "a-z", "A-Z")
	if r.code != 0 || r.stdout != "PIPED IN" {
		t.Errorf("stdin -: code %d, stdout %q, stderr %q", r.code, r.stdout, r.stderr)
	}

	r = runCLI(t, env, "", "exec", a, "--", "sh", "-c", "kill -TERM $$")
	if r.code != 128+15 || !strings.Contains(r.stderr, "signal=SIGTERM") {
		t.Errorf("killed by SIGTERM: code %d, stderr %q", r.code, r.stderr)
	}
	start := time.Now()
	r = runCLI(t, env, "", "exec", "--timeout", "1s", a, "--", "sleep", "30")
	if r.code != exitTimedOut || !strings.Contains(r.stderr, "timed_out=true") {
		t.Errorf("timed out: code %d, stderr %q", r.code, r.stderr)
	}
	t.Logf("a 1 s timeout returned after %s", time.Since(start).Round(time.Millisecond))

	// The agent's token reaches no other agent's sandbox.
	r = runCLI(t, env, "", "exec", "agent-2", "--", "true")
	if r.code != exitAPIError || !strings.Contains(r.stderr, "permission_denied") {
		t.Errorf("other agent: code %d, stderr %q", r.code, r.stderr)
	}
	r = runCLI(t, env, "", "exec", a, "--", "no-such-program-xyz")
	if r.code != exitAPIError || !strings.Contains(r.stderr, "invalid_argument") {
		t.Errorf("unknown program: code %d, stderr %q", r.code, r.stderr)
	}
}

func TestCpRoundTripsAFileBothWays(t *testing.T) {
	s, env := realAgentAPI(t, apitest.Options{})
	a := s.AgentID
	blob := make([]byte, 5<<20+123)
	if _, err := rand.Read(blob); err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	src := filepath.Join(dir, "blob.bin")
	if err := os.WriteFile(src, blob, 0o750); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(src, 0o750); err != nil {
		t.Fatal(err)
	}
	sameAs := func(what, path string) {
		t.Helper()
		got, err := os.ReadFile(path)
		if err != nil {
			t.Fatalf("%s: %v", what, err)
		}
		if !bytes.Equal(got, blob) {
			t.Fatalf("%s: %d bytes, not the %d sent", what, len(got), len(blob))
		}
	}

	// Upload into a directory keeps the name and the permission bits.
	start := time.Now()
	r := runCLI(t, env, "", "cp", src, a+":data/")
	if r.code != 0 || r.stdout != "" {
		t.Fatalf("upload: code %d, stdout %q, stderr %q", r.code, r.stdout, r.stderr)
	}
	t.Logf("uploaded %d bytes in %s", len(blob), time.Since(start).Round(time.Millisecond))
	inWorkspace := filepath.Join(s.Workspace, "data", "blob.bin")
	sameAs("upload", inWorkspace)
	if fi, err := os.Stat(inWorkspace); err != nil || fi.Mode().Perm() != 0o750 {
		t.Errorf("uploaded file: %v, %v; want mode 0750 as the source", fi.Mode(), err)
	}

	// Download into a directory, then over an existing file.
	out := filepath.Join(dir, "out")
	if err := os.Mkdir(out, 0o755); err != nil {
		t.Fatal(err)
	}
	start = time.Now()
	if r := runCLI(t, env, "", "cp", a+":data/blob.bin", out); r.code != 0 {
		t.Fatalf("download: code %d, stderr %q", r.code, r.stderr)
	}
	t.Logf("downloaded %d bytes in %s", len(blob), time.Since(start).Round(time.Millisecond))
	sameAs("download", filepath.Join(out, "blob.bin"))

	// Standard input up, standard output down, with an explicit mode.
	if r := runCLI(t, env, string(blob), "cp", "--mode", "0600", "-", a+":data/from-stdin.bin"); r.code != 0 {
		t.Fatalf("upload -: code %d, stderr %q", r.code, r.stderr)
	}
	sameAs("upload -", filepath.Join(s.Workspace, "data", "from-stdin.bin"))
	if fi, err := os.Stat(filepath.Join(s.Workspace, "data", "from-stdin.bin")); err != nil || fi.Mode().Perm() != 0o600 {
		t.Errorf("--mode 0600: %v, %v", fi.Mode(), err)
	}
	r = runCLI(t, env, "", "cp", a+":data/from-stdin.bin", "-")
	if r.code != 0 || r.stdout != string(blob) {
		t.Fatalf("download -: code %d, %d bytes out (want %d), stderr %q", r.code, len(r.stdout), len(blob), r.stderr)
	}

	// A failed download leaves the destination as it was, and no
	// temporary file behind.
	keep := filepath.Join(out, "keep.txt")
	if err := os.WriteFile(keep, []byte("old"), 0o644); err != nil {
		t.Fatal(err)
	}
	r = runCLI(t, env, "", "cp", a+":data/missing.bin", keep)
	if r.code != exitAPIError || !strings.Contains(r.stderr, "file_not_found") {
		t.Errorf("missing file: code %d, stderr %q", r.code, r.stderr)
	}
	if got, _ := os.ReadFile(keep); string(got) != "old" {
		t.Errorf("destination after a failed download: %q", got)
	}
	entries, _ := os.ReadDir(out)
	if len(entries) != 2 {
		t.Errorf("files left in the destination directory: %v", entries)
	}
}

// A download cut off midway must not leave part of a file behind.
func TestCpTruncatedDownloadLeavesNoFile(t *testing.T) {
	srv := httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Length", "1000000")
		_, _ = w.Write(make([]byte, 4096))
		// Returning with fewer bytes than promised makes the server
		// close the connection: the client reads an unexpected EOF.
	}))
	t.Cleanup(srv.Close)
	caFile := filepath.Join(t.TempDir(), "ca.crt")
	if err := os.WriteFile(caFile, pemOf(srv), 0o600); err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	r := runCLI(t, map[string]string{"AGENTBOX_TOKEN": token}, "", "cp", "--endpoint", srv.URL, "--ca-file", caFile,
		"agent-1:big.bin", filepath.Join(dir, "big.bin"))
	if r.code != exitAPIError || !strings.Contains(r.stderr, "EOF") {
		t.Errorf("truncated download: code %d, stderr %q", r.code, r.stderr)
	}
	if entries, _ := os.ReadDir(dir); len(entries) != 0 {
		t.Errorf("files left behind: %v", entries)
	}
}

func TestStatusAndDeploy(t *testing.T) {
	s, env := realAgentAPI(t, apitest.Options{})
	a := s.AgentID
	r := runCLI(t, env, "", "status", a)
	if r.code != 0 || !strings.Contains(r.stdout, "phase:   Running\n") || !strings.Contains(r.stdout, "ready:   yes (Running)\n") ||
		!strings.Contains(r.stdout, "sandbox: "+s.Namespace+"/"+s.Sandbox+"\n") {
		t.Errorf("status: code %d, stdout:\n%s\nstderr %q", r.code, r.stdout, r.stderr)
	}
	r = runCLI(t, env, "", "status", "--json", a)
	var st client.SandboxStatus
	if err := json.Unmarshal([]byte(r.stdout), &st); err != nil || r.code != 0 || st.Phase != "Running" || !st.Ready || st.AgentID != a {
		t.Errorf("status --json: code %d, %+v (%v), stdout %q", r.code, st, err, r.stdout)
	}
	r = runCLI(t, with(env, "AGENTBOX_TOKEN", s.AdminToken), "", "status", "agent-404")
	if r.code != exitAPIError || !strings.Contains(r.stderr, `agent "agent-404" has no sandbox (sandbox_not_found, HTTP 404)`) {
		t.Errorf("unknown agent: code %d, stderr %q", r.code, r.stderr)
	}

	ctx := context.Background()
	if err := s.SetSandboxState(ctx, v1alpha1.SandboxPhaseStopped, false, v1alpha1.ReasonStopped); err != nil {
		t.Fatal(err)
	}
	// Status does not wake it.
	r = runCLI(t, env, "", "status", a)
	if r.code != 0 || !strings.Contains(r.stdout, "phase:   Stopped\n") || !strings.Contains(r.stdout, "ready:   no (Stopped)\n") {
		t.Errorf("stopped status: code %d, stdout:\n%s", r.code, r.stdout)
	}
	r = runCLI(t, env, "", "deploy", "--wait", "--timeout", "1s", a)
	if r.code != exitAPIError || !strings.Contains(r.stderr, "was not ready after 1s") {
		t.Errorf("deploy --wait past its timeout: code %d, stderr %q", r.code, r.stderr)
	}

	// The "controller" brings the sandbox up while deploy waits.
	resumed := make(chan error, 1)
	go func() {
		time.Sleep(1500 * time.Millisecond)
		if err := s.SetSandboxState(ctx, v1alpha1.SandboxPhaseResuming, false, v1alpha1.ReasonResuming); err != nil {
			resumed <- err
			return
		}
		time.Sleep(1500 * time.Millisecond)
		resumed <- s.SetSandboxState(ctx, v1alpha1.SandboxPhaseRunning, true, v1alpha1.ReasonRunning)
	}()
	start := time.Now()
	r = runCLI(t, env, "", "deploy", a, "--wait", "--timeout", "1m")
	if err := <-resumed; err != nil {
		t.Fatal(err)
	}
	t.Logf("deploy --wait returned after %s; stderr:\n%s", time.Since(start).Round(time.Millisecond), r.stderr)
	if r.code != 0 || !strings.Contains(r.stdout, "phase:   Running\n") ||
		!strings.Contains(r.stderr, "waiting for sandbox: phase Stopped, ") || !strings.Contains(r.stderr, "waiting for sandbox: phase Resuming, ") {
		t.Errorf("deploy --wait: code %d, stdout %q, stderr %q", r.code, r.stdout, r.stderr)
	}
	r = runCLI(t, env, "", "deploy", a)
	if r.code != 0 || !strings.Contains(r.stdout, "phase:   Running\n") || strings.Contains(r.stdout, "created:") {
		t.Errorf("deploy of a running sandbox: code %d, stdout %q, stderr %q", r.code, r.stdout, r.stderr)
	}
	// A missing sandbox is created from --template; this server has none
	// of that name, and an agent token may not name one at all.
	admin := with(env, "AGENTBOX_TOKEN", s.AdminToken)
	r = runCLI(t, admin, "", "deploy", "--template", s.Namespace+"/nope", "--request-id", "r1", "agent-404")
	if r.code != exitAPIError || !strings.Contains(r.stderr, "SandboxTemplate "+s.Namespace+"/nope does not exist (invalid_argument") {
		t.Errorf("deploy from a missing template: code %d, stderr %q", r.code, r.stderr)
	}
	r = runCLI(t, env, "", "deploy", "--template", s.Namespace+"/nope", a)
	if r.code != exitAPIError || !strings.Contains(r.stderr, "permission_denied") {
		t.Errorf("deploy naming a template with an agent token: code %d, stderr %q", r.code, r.stderr)
	}
}

func TestLeasesAcquireHeartbeatRelease(t *testing.T) {
	s, env := realAgentAPI(t, apitest.Options{})
	a := s.AgentID
	r := runCLI(t, env, "", "leases", "acquire", a, "--holder", "alice", "--ttl", "2m", "--json")
	var l client.Lease
	if err := json.Unmarshal([]byte(r.stdout), &l); err != nil || r.code != 0 || l.LeaseID == "" || l.Holder != "alice" ||
		l.TTLSeconds != 120 || l.RequestID == "" {
		t.Fatalf("acquire: code %d, %+v (%v), stderr %q", r.code, l, err, r.stderr)
	}
	// Retrying with the same request ID gets the same lease.
	r = runCLI(t, with(env, "AGENTBOX_LEASE_HOLDER", "alice"), "", "leases", "acquire", "--request-id", l.RequestID, a)
	if r.code != 0 || !strings.Contains(r.stdout, "lease_id:    "+l.LeaseID+"\n") {
		t.Errorf("idempotent acquire: code %d, stdout:\n%s\nstderr %q", r.code, r.stdout, r.stderr)
	}
	r = runCLI(t, env, "", "leases", "acquire", a, "--holder", "bob")
	if r.code != exitAPIError || !strings.Contains(r.stderr, "lease_held") || !strings.Contains(r.stderr, `held by "alice" until `) {
		t.Errorf("acquire of a held lease: code %d, stderr %q", r.code, r.stderr)
	}
	r = runCLI(t, env, "", "leases", "heartbeat", a, "--holder", "alice", "--lease-id", l.LeaseID)
	if r.code != 0 || !strings.Contains(r.stdout, "holder:      alice\n") || !strings.Contains(r.stdout, "expires_at:  ") {
		t.Errorf("heartbeat: code %d, stdout:\n%s\nstderr %q", r.code, r.stdout, r.stderr)
	}
	r = runCLI(t, env, "", "leases", "release", a, "--holder", "alice", "--lease-id", l.LeaseID)
	if r.code != 0 || r.stdout != "released "+l.LeaseID+"\n" {
		t.Errorf("release: code %d, stdout %q, stderr %q", r.code, r.stdout, r.stderr)
	}
	r = runCLI(t, env, "", "leases", "heartbeat", a, "--holder", "alice", "--lease-id", l.LeaseID)
	if r.code != exitAPIError || !strings.Contains(r.stderr, "lease_not_held") {
		t.Errorf("heartbeat after release: code %d, stderr %q", r.code, r.stderr)
	}
	// Now bob can have it.
	r = runCLI(t, env, "", "leases", "acquire", a, "--holder", "bob", "--json")
	var bob client.Lease
	if err := json.Unmarshal([]byte(r.stdout), &bob); err != nil || r.code != 0 {
		t.Fatalf("acquire after release: code %d, stderr %q", r.code, r.stderr)
	}
	// While bob holds it, only calls with his lease ID are served.
	r = runCLI(t, env, "", "exec", a, "--", "echo", "hi")
	if r.code != exitAPIError || !strings.Contains(r.stderr, "lease_held, HTTP 409") || !strings.Contains(r.stderr, `held by "bob" until `) {
		t.Errorf("exec on a held sandbox: code %d, stderr %q", r.code, r.stderr)
	}
	r = runCLI(t, env, "", "exec", "--lease-id", bob.LeaseID, a, "--", "echo", "hi")
	if r.code != 0 || r.stdout != "hi\n" {
		t.Errorf("exec --lease-id: code %d, stdout %q, stderr %q", r.code, r.stdout, r.stderr)
	}
	held := with(env, "AGENTBOX_LEASE_ID", bob.LeaseID)
	if r := runCLI(t, held, "", "exec", a, "--", "true"); r.code != 0 {
		t.Errorf("exec with AGENTBOX_LEASE_ID: code %d, stderr %q", r.code, r.stderr)
	}
	if r := runCLI(t, env, "bob's", "cp", "-", a+":bob.txt"); r.code != exitAPIError || !strings.Contains(r.stderr, "lease_held") {
		t.Errorf("cp on a held sandbox: code %d, stderr %q", r.code, r.stderr)
	}
	if r := runCLI(t, held, "bob's", "cp", "-", a+":bob.txt"); r.code != 0 {
		t.Errorf("cp with the lease ID: code %d, stderr %q", r.code, r.stderr)
	}
	if r := runCLI(t, held, "", "deploy", a); r.code != 0 {
		t.Errorf("deploy with the lease ID: code %d, stderr %q", r.code, r.stderr)
	}
	if r := runCLI(t, env, "", "shell", a, "--", "true"); r.code != exitAPIError || !strings.Contains(r.stderr, "lease_held") {
		t.Errorf("shell on a held sandbox: code %d, stderr %q", r.code, r.stderr)
	}
	if r := runCLI(t, held, "", "shell", a, "--", "true"); r.code != 0 {
		t.Errorf("shell with the lease ID: code %d, stderr %q", r.code, r.stderr)
	}
	if r := runCLI(t, env, "", "status", a); r.code != 0 {
		t.Errorf("status of a held sandbox: code %d, stderr %q", r.code, r.stderr)
	}
	r = runCLI(t, with(env, "AGENTBOX_TOKEN", s.AdminToken), "", "leases", "acquire-pool", s.Namespace, "no-such-pool", "--holder", "carol")
	if r.code != exitAPIError || !strings.Contains(r.stderr, "pool_not_found") {
		t.Errorf("acquire-pool of a missing pool: code %d, stderr %q", r.code, r.stderr)
	}
	r = runCLI(t, with(env, "AGENTBOX_TOKEN", s.AdminToken), "", "leases", "acquire-pool", "--wait", "30s", s.Namespace, "no-such-pool", "--holder", "carol")
	if r.code != exitAPIError || !strings.Contains(r.stderr, "pool_not_found") {
		t.Errorf("acquire-pool --wait of a missing pool: code %d, stderr %q", r.code, r.stderr)
	}
}

// The progress line is drawn only once a transfer has taken a while, at
// most a few times a second, and ends with the totals.
func TestProgressLine(t *testing.T) {
	var buf bytes.Buffer
	now := time.Unix(1000, 0)
	p := newProgressAt(&buf, 10<<20, func() time.Time { return now })
	for range 100 {
		now = now.Add(20 * time.Millisecond)
		p.add(100 << 10)
	}
	p.done()
	out := buf.String()
	draws := strings.Count(out, "\r")
	// 2 s of transfer, silent for the first second, then every 250 ms,
	// plus the final line.
	if draws < 3 || draws > 6 || !strings.HasSuffix(out, "\x1b[K\n") {
		t.Errorf("%d draws: %q", draws, out)
	}
	last := out[strings.LastIndex(out, "\r")+1:]
	if !strings.HasPrefix(last, "9.8 MiB / 10.0 MiB (98%)  4.9 MiB/s  2s") {
		t.Errorf("final line %q", last)
	}

	buf.Reset()
	quick := newProgressAt(&buf, -1, func() time.Time { return now })
	quick.add(1 << 20)
	quick.done()
	if buf.Len() != 0 {
		t.Errorf("a quick transfer printed %q", buf.String())
	}
}

func pemOf(srv *httptest.Server) []byte {
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: srv.Certificate().Raw})
}

// slowReader yields n chunks of size bytes, pausing before each, like a
// slow pipe.
type slowReader struct {
	n, size int
	pause   time.Duration
}

func (r *slowReader) Read(b []byte) (int, error) {
	if r.n == 0 {
		return 0, io.EOF
	}
	time.Sleep(r.pause)
	r.n--
	return copy(b, bytes.Repeat([]byte{'x'}, min(r.size, len(b)))), nil
}

func TestCpShowsProgressOnATerminal(t *testing.T) {
	s, env := realAgentAPI(t, apitest.Options{})
	ptmx, tty, err := pty.Open()
	if err != nil {
		t.Skipf("no pseudo-terminal: %v", err)
	}
	defer ptmx.Close()
	seen := make(chan []byte)
	go func() {
		out, _ := io.ReadAll(ptmx) // ends with EIO once the tty is closed
		seen <- out
	}()
	var stdout bytes.Buffer
	code := run(context.Background(), []string{"cp", "-", s.AgentID + ":slow.bin"}, func(k string) string { return env[k] },
		&slowReader{n: 20, size: 32 << 10, pause: 100 * time.Millisecond}, &stdout, tty)
	tty.Close()
	out := string(<-seen)
	t.Logf("terminal showed %q", out)
	if code != 0 || !strings.Contains(out, "\r") || !strings.Contains(out, "MiB/s") || !strings.Contains(out, "0.6 MiB  ") {
		t.Errorf("code %d, terminal output %q", code, out)
	}
	if fi, err := os.Stat(filepath.Join(s.Workspace, "slow.bin")); err != nil || fi.Size() != 20*32<<10 {
		t.Errorf("uploaded file: %v", err)
	}
}

// A call to a sandbox that does not come up waits as long as the API
// does (agentbox has no deadline of its own to give up on first), and then
// shows the API's answer: what the sandbox was still doing, and that a
// retry picks the resume up.
func TestExecShowsTheAPIsAnswerWhenTheResumeTakesTooLong(t *testing.T) {
	s, env := realAgentAPI(t, apitest.Options{ResumeTimeout: 2 * time.Second})
	if err := s.SetSandboxState(context.Background(), v1alpha1.SandboxPhaseResuming, false, v1alpha1.ReasonResuming); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	r := runCLI(t, env, "", "exec", s.AgentID, "--", "true")
	took := time.Since(start)
	if r.code != exitAPIError || !strings.Contains(r.stderr, "workspace was being restored") || !strings.Contains(r.stderr, "waited 2s") ||
		!strings.Contains(r.stderr, "retry the call") || !strings.Contains(r.stderr, "(sandbox_not_ready, HTTP 409)") || took < 2*time.Second {
		t.Errorf("after %s: code %d, stderr %q", took.Round(time.Millisecond), r.code, r.stderr)
	}
	t.Logf("exec on a sandbox stuck resuming: %s after %s", strings.TrimSpace(r.stderr), took.Round(time.Millisecond))

	// Interrupted (Ctrl-C) while waiting: it says so, rather than print a
	// bare transport error.
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	time.AfterFunc(300*time.Millisecond, cancel)
	var out, errOut strings.Builder
	code := run(ctx, []string{"exec", s.AgentID, "--", "true"}, func(k string) string { return env[k] }, strings.NewReader(""), &out, &errOut)
	if code != exitAPIError || !strings.Contains(errOut.String(), "before the Compute API answered") {
		t.Errorf("interrupted: code %d, stderr %q", code, errOut.String())
	}
}

// status shows the driver of the snapshot and why idle stops do not
// happen.
func TestStatusShowsDriverAndBlockedStop(t *testing.T) {
	s, env := realAgentAPI(t, apitest.Options{})
	ctx := context.Background()
	var sb v1alpha1.Sandbox
	if err := s.Kube.Get(ctx, ctrlclient.ObjectKey{Namespace: s.Namespace, Name: s.Sandbox}, &sb); err != nil {
		t.Fatal(err)
	}
	sb.Status.Snapshot = &v1alpha1.SandboxSnapshot{Name: "sb-1-1", SizeBytes: 1 << 20, Driver: "archive/embedded"}
	sb.Status.Conditions = append(sb.Status.Conditions, metav1.Condition{Type: v1alpha1.ConditionIdleStopBlocked, Status: metav1.ConditionTrue,
		Reason: v1alpha1.ReasonSnapshotAPIMissing, Message: "the cluster does not serve VolumeSnapshots", LastTransitionTime: metav1.Now()})
	if err := s.Kube.Status().Update(ctx, &sb); err != nil {
		t.Fatal(err)
	}
	r := runCLI(t, env, "", "status", s.AgentID)
	if r.code != 0 || !strings.Contains(r.stdout, "archive/embedded driver") ||
		!strings.Contains(r.stdout, "idle stop blocked: SnapshotAPIMissing: the cluster does not serve VolumeSnapshots") {
		t.Errorf("status: code %d, stdout:\n%s", r.code, r.stdout)
	}
}
