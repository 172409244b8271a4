package main

import (
	"context"
	"encoding/json"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/agentbox/terraform-provider-agentbox/internal/computeapi/apitest"
	"github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
	"github.com/agentbox/terraform-provider-agentbox/internal/store"
)

// The runs commands against the real Compute API, with a store, in front
// of a real supervisor.
func TestRunsCommands(t *testing.T) {
	st, err := store.OpenSQLite(context.Background(), filepath.Join(t.TempDir(), "agentbox.db"), store.Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	s, env := realAgentAPI(t, apitest.Options{Store: st})
	a := s.AgentID

	r := runCLI(t, env, "", "runs", "start", "--wait", "--poll", "20ms", "--env", "X=1", a, "--", "sh", "-c", `echo "x=$X"; exit 5`)
	id := strings.TrimSpace(r.stdout)
	if r.code != 5 || !strings.HasPrefix(id, "run-") || !strings.Contains(r.stderr, id+" failed exit_code=5 reason=NonZeroExit output_bytes=4") {
		t.Fatalf("runs start --wait: code %d, stdout %q, stderr %q", r.code, r.stdout, r.stderr)
	}
	// The run's output, replayed, and its exit code.
	r = runCLI(t, env, "", "runs", "logs", id)
	if r.code != 5 || r.stdout != "x=1\n" || !strings.Contains(r.stderr, "run "+id+" failed exit_code=5 reason=NonZeroExit") {
		t.Errorf("runs logs: code %d, stdout %q, stderr %q", r.code, r.stdout, r.stderr)
	}
	r = runCLI(t, env, "", "runs", "logs", "--json", "--after", "1", id)
	if lines := strings.Split(strings.TrimSpace(r.stdout), "\n"); r.code != 5 || len(lines) != 3 ||
		!strings.HasPrefix(lines[0], `{"id":2,"type":"stdout"`) || !strings.HasPrefix(lines[2], `{"id":4,"type":"end"`) {
		t.Errorf("runs logs --json --after 1: code %d, stdout %q, stderr %q", r.code, r.stdout, r.stderr)
	}
	// Started and followed: the output as it comes, the run id on stderr.
	r = runCLI(t, env, "", "runs", "start", "--follow", a, "--", "sh", "-c", `for i in 1 2 3; do echo "out $i"; echo "err $i" >&2; done; exit 3`)
	if r.code != 3 || r.stdout != "out 1\nout 2\nout 3\n" || !strings.HasPrefix(r.stderr, "run-") ||
		!strings.Contains(r.stderr, "err 1\nerr 2\nerr 3\n") {
		t.Errorf("runs start --follow: code %d, stdout %q, stderr %q", r.code, r.stdout, r.stderr)
	}
	r = runCLI(t, env, "", "runs", "start", "--follow", a, "--", "echo", "fine")
	if r.code != 0 || r.stdout != "fine\n" {
		t.Errorf("runs start --follow echo: code %d, stdout %q, stderr %q", r.code, r.stdout, r.stderr)
	}
	r = runCLI(t, env, "", "runs", "get", id)
	// One "name: value" line per field, aligned.
	fields := strings.Join(strings.Fields(r.stdout), " ")
	for _, want := range []string{"status: failed", "exit_code: 5", "env_names: X", "reason: NonZeroExit"} {
		if r.code != 0 || !strings.Contains(fields, want) {
			t.Errorf("runs get: code %d, stdout %q, want %q; stderr %q", r.code, r.stdout, want, r.stderr)
		}
	}
	r = runCLI(t, env, "", "runs", "start", "--request-id", "once", "--wait", "--poll", "20ms", a, "--", "true")
	first := strings.TrimSpace(r.stdout)
	if r.code != 0 {
		t.Fatalf("runs start true: code %d, stderr %q", r.code, r.stderr)
	}
	if r = runCLI(t, env, "", "runs", "start", "--request-id", "once", a, "--", "true"); strings.TrimSpace(r.stdout) != first {
		t.Errorf("repeated request id: %q, want %q", r.stdout, first)
	}

	r = runCLI(t, env, "", "runs", "start", "--timeout", "10m", a, "--", "sleep", "600")
	long := strings.TrimSpace(r.stdout)
	if r.code != 0 {
		t.Fatalf("runs start sleep: code %d, stderr %q", r.code, r.stderr)
	}
	// A live run without -f: what there is, then a note, exit 0; with -f,
	// to its end (here its cancel).
	if r = runCLI(t, env, "", "runs", "logs", long); r.code != 0 || r.stdout != "" || !strings.Contains(r.stderr, "still running") {
		t.Errorf("runs logs of a live run: code %d, stdout %q, stderr %q", r.code, r.stdout, r.stderr)
	}
	followed := make(chan result, 1)
	go func() { followed <- runCLI(t, env, "", "runs", "logs", "-f", long) }()
	if r = runCLI(t, env, "", "runs", "cancel", long); r.code != 0 || !strings.HasPrefix(r.stdout, long+" ") {
		t.Errorf("runs cancel: code %d, stdout %q, stderr %q", r.code, r.stdout, r.stderr)
	}
	c, err := client.New(s.URL, s.AgentToken, s.CAPEM)
	if err != nil {
		t.Fatal(err)
	}
	defer c.CloseIdleConnections()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if run, err := c.WaitRun(ctx, long, 20*time.Millisecond); err != nil || run.Status != client.RunCancelled {
		t.Errorf("cancelled run: %+v, %v", run, err)
	}
	if r := <-followed; r.code != exitAPIError || !strings.Contains(r.stderr, "run "+long+" cancelled reason=Cancelled") {
		t.Errorf("runs logs -f of the cancelled run: code %d, stdout %q, stderr %q", r.code, r.stdout, r.stderr)
	}

	r = runCLI(t, env, "", "runs", "list", "--status", "failed")
	if r.code != 0 || !strings.Contains(r.stdout, id) || strings.Contains(r.stdout, first) || !strings.HasPrefix(r.stdout, "RUN_ID") {
		t.Errorf("runs list --status failed: code %d, stdout %q, stderr %q", r.code, r.stdout, r.stderr)
	}
	r = runCLI(t, env, "", "runs", "list", "--agent", a, "--json")
	if r.code != 0 || strings.Count(r.stdout, `"id": "run-`) != 5 {
		t.Errorf("runs list --json: code %d, stdout %q", r.code, r.stdout)
	}

	// A time or a duration bounds the listing, as a schedule's name does.
	r = runCLI(t, env, "", "runs", "list", "--since", "1h", "--json")
	if r.code != 0 || strings.Count(r.stdout, `"id": "run-`) != 5 {
		t.Errorf("runs list --since 1h: code %d, stdout %q", r.code, r.stdout)
	}
	r = runCLI(t, env, "", "runs", "list", "--since", time.Now().Add(time.Hour).UTC().Format(time.RFC3339), "--json")
	if r.code != 0 || strings.Contains(r.stdout, `"id": "run-`) {
		t.Errorf("runs list --since an hour ahead: code %d, stdout %q", r.code, r.stdout)
	}
	r = runCLI(t, env, "", "runs", "list", "--schedule", "default/nightly")
	if r.code != 0 || !strings.HasPrefix(r.stdout, "RUN_ID") || strings.Contains(r.stdout, "run-") {
		t.Errorf("runs list --schedule of a schedule that started none: code %d, stdout %q", r.code, r.stdout)
	}

	for _, args := range [][]string{{"runs"}, {"runs", "start", a}, {"runs", "get"}, {"runs", "list", "extra"}, {"runs", "frob"},
		{"runs", "list", "--since", "yesterday"}, {"runs", "logs"}, {"runs", "logs", "--after", "-1", id}, {"runs", "start", "--follow", "--wait", a, "--", "true"},
		{"runs", "start", "--mode", "cron", a, "--", "true"}, {"runs", "start", "--mode", "pool", "--", "true"},
		{"runs", "start", "--mode", "job", "--", "true"}, {"runs", "start", "--pool", "ns/p", a, "--", "true"},
		{"runs", "start", "--mode", "job", "--template", "ns/t", "--backoff-limit", "11", "--", "true"},
		{"runs", "start", "--mode", "job", "--template", "ns/t", "--pool", "ns/p", "--", "true"},
		{"runs", "start", "--mode", "pool", "--pool", "ns/p"}, {"runs", "start", "--ttl-after-finished", "-5", a, "--", "true"}} {
		if r := runCLI(t, env, "", args...); r.code != exitUsage {
			t.Errorf("%v: code %d, want %d (stderr %q)", args, r.code, exitUsage, r.stderr)
		}
	}
	if r := runCLI(t, env, "", "runs", "get", "run-00000000000000000000"); r.code != exitAPIError || !strings.Contains(r.stderr, "not_found") {
		t.Errorf("runs get of no run: code %d, stderr %q", r.code, r.stderr)
	}
	// A job run is an admin's: the mode and template reach the API, which
	// refuses the agent's token.
	if r := runCLI(t, env, "", "runs", "start", "--mode", "job", "--template", "ns/tpl", "--backoff-limit", "2", "--", "true"); r.code != exitAPIError ||
		!strings.Contains(r.stderr, "admin token") {
		t.Errorf("runs start --mode job with an agent token: code %d, stderr %q", r.code, r.stderr)
	}
	// The active deadline stops the command and the run ends timed out
	// (exit 124); its record keeps the options and the attempt.
	r = runCLI(t, env, "", "runs", "start", "--wait", "--poll", "20ms", "--active-deadline", "2s", "--ttl-after-finished", "1h",
		a, "--", "sleep", "30")
	if r.code != exitTimedOut || !strings.Contains(r.stderr, "timed_out reason=DeadlineExceeded") {
		t.Fatalf("runs start --active-deadline 2s: code %d, stdout %q, stderr %q", r.code, r.stdout, r.stderr)
	}
	r = runCLI(t, env, "", "runs", "get", strings.TrimSpace(r.stdout))
	fields = strings.Join(strings.Fields(r.stdout), " ")
	for _, want := range []string{"mode: agent", "active_deadline_seconds: 2", "ttl_seconds_after_finished: 3600", "expires_at: ",
		"attempt 1: timed_out reason=DeadlineExceeded"} {
		if r.code != 0 || !strings.Contains(fields, want) {
			t.Errorf("runs get of the run past its deadline: code %d, stdout %q, want %q", r.code, r.stdout, want)
		}
	}
}

// On a held sandbox, runs start is refused without the lease ID and runs
// with it (--lease-id or AGENTBOX_LEASE_ID).
func TestRunsStartOnAHeldSandbox(t *testing.T) {
	st, err := store.OpenSQLite(context.Background(), filepath.Join(t.TempDir(), "agentbox.db"), store.Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	s, env := realAgentAPI(t, apitest.Options{Store: st})
	a := s.AgentID
	r := runCLI(t, env, "", "leases", "acquire", a, "--holder", "alice", "--ttl", "5m", "--json")
	var l client.Lease
	if err := json.Unmarshal([]byte(r.stdout), &l); err != nil || r.code != 0 {
		t.Fatalf("acquire: code %d, stderr %q", r.code, r.stderr)
	}
	r = runCLI(t, env, "", "runs", "start", "--wait", "--poll", "20ms", a, "--", "echo", "hi")
	if r.code != exitAPIError || !strings.Contains(r.stderr, "lease_held") || !strings.Contains(r.stderr, `held by "alice" until `) {
		t.Errorf("runs start on a held sandbox: code %d, stdout %q, stderr %q", r.code, r.stdout, r.stderr)
	}
	r = runCLI(t, env, "", "runs", "start", "--follow", "--lease-id", l.LeaseID, a, "--", "echo", "hi")
	if r.code != 0 || r.stdout != "hi\n" {
		t.Errorf("runs start --lease-id: code %d, stdout %q, stderr %q", r.code, r.stdout, r.stderr)
	}
	r = runCLI(t, with(env, "AGENTBOX_LEASE_ID", l.LeaseID), "", "runs", "start", "--follow", a, "--", "echo", "again")
	if r.code != 0 || r.stdout != "again\n" {
		t.Errorf("runs start with AGENTBOX_LEASE_ID: code %d, stdout %q, stderr %q", r.code, r.stdout, r.stderr)
	}
}
