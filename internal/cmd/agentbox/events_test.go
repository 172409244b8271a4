package main

import (
	"bytes"
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

// agentbox events against the real Compute API, with a store, in front of
// a real supervisor: the commands an exec and a run ran, as lines or
// JSON, from an id, and followed until interrupted.
func TestEventsCommand(t *testing.T) {
	st, err := store.OpenSQLite(context.Background(), filepath.Join(t.TempDir(), "agentbox.db"), store.Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	s, env := realAgentAPI(t, apitest.Options{Store: st})
	a := s.AgentID
	if r := runCLI(t, env, "", "exec", a, "--", "sh", "-c", "exit 5"); r.code != 5 {
		t.Fatalf("exec: code %d, stderr %q", r.code, r.stderr)
	}
	r := runCLI(t, env, "", "runs", "start", "--wait", "--poll", "20ms", a, "--", "true")
	id := strings.TrimSpace(r.stdout)
	if r.code != 0 {
		t.Fatalf("runs start: code %d, stderr %q", r.code, r.stderr)
	}
	r = runCLI(t, env, "", "events", a)
	lines := strings.Split(strings.TrimSpace(r.stdout), "\n")
	if r.code != 0 || len(lines) != 4 || !strings.HasPrefix(lines[0], "1 ") || !strings.Contains(lines[0], " command_started ") ||
		!strings.Contains(lines[0], `command="sh -c exit 5"`) || !strings.Contains(lines[1], " command_ended ") ||
		!strings.Contains(lines[1], "exit_code=5") || !strings.Contains(lines[2], "run="+id) || !strings.Contains(lines[3], "exit_code=0") {
		t.Fatalf("events: code %d, stdout %q, stderr %q", r.code, r.stdout, r.stderr)
	}
	r = runCLI(t, env, "", "events", "--json", "--after", "2", a)
	lines = strings.Split(strings.TrimSpace(r.stdout), "\n")
	var e client.AgentEvent
	if r.code != 0 || len(lines) != 2 || json.Unmarshal([]byte(lines[0]), &e) != nil || e.ID != 3 || e.RunID != id || e.Agent != a {
		t.Fatalf("events --json --after 2: code %d, stdout %q, stderr %q", r.code, r.stdout, r.stderr)
	}
	// -f goes on until interrupted, printing what comes meanwhile.
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan int, 1)
	var out, errOut bytes.Buffer
	go func() {
		done <- run(ctx, []string{"events", "-f", "--after", "4", a}, func(k string) string { return env[k] }, strings.NewReader(""), &out, &errOut)
	}()
	if r := runCLI(t, env, "", "exec", a, "--", "true"); r.code != 0 {
		t.Fatalf("exec: code %d", r.code)
	}
	time.Sleep(time.Second)
	cancel()
	if code := <-done; code != 0 || !strings.HasPrefix(out.String(), "5 ") || strings.Count(out.String(), "\n") != 2 {
		t.Errorf("events -f: code %d, stdout %q, stderr %q", code, out.String(), errOut.String())
	}
	for _, args := range [][]string{{"events"}, {"events", "--after", "-1", a}, {"events", a, "extra"}} {
		if r := runCLI(t, env, "", args...); r.code != exitUsage {
			t.Errorf("%v: code %d, want %d (stderr %q)", args, r.code, exitUsage, r.stderr)
		}
	}
}
