package main

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/agentbox/terraform-provider-agentbox/internal/computeapi/apitest"
	"github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
	"github.com/agentbox/terraform-provider-agentbox/internal/store"
)

// The worked example of a workflow driving runs (examples/workflow) runs
// as documented: the built CLI on PATH, against the real Compute API and
// supervisor. A second start of the same workflow replays its steps and
// starts no run; a new STEP_ATTEMPT runs them again.
func TestWorkflowExamplePipeline(t *testing.T) {
	bin := t.TempDir()
	if out, err := exec.Command("go", "build", "-o", filepath.Join(bin, "agentbox"), ".").CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	st, err := store.OpenSQLite(context.Background(), filepath.Join(t.TempDir(), "agentbox.db"), store.Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	s, env := realAgentAPI(t, apitest.Options{Store: st})
	script, err := filepath.Abs("../../../examples/workflow/pipeline.sh")
	if err != nil {
		t.Fatal(err)
	}
	pipeline := func(attempt string, args ...string) (string, string, int) {
		cmd := exec.Command("sh", append([]string{script}, args...)...)
		cmd.Env = append(os.Environ(), "PATH="+bin+string(os.PathListSeparator)+os.Getenv("PATH"), "STEP_ATTEMPT="+attempt)
		for k, v := range env {
			cmd.Env = append(cmd.Env, k+"="+v)
		}
		var stdout, stderr strings.Builder
		cmd.Stdout, cmd.Stderr = &stdout, &stderr
		err := cmd.Run()
		code := 0
		if ee, ok := err.(*exec.ExitError); ok {
			code = ee.ExitCode()
		} else if err != nil {
			t.Fatal(err)
		}
		return stdout.String(), stderr.String(), code
	}
	const want = "fetched 3 lines\nsorted: gamma beta alpha \nreport: first=gamma lines=3\n"
	out, errOut, code := pipeline("0", s.AgentID, "wf-1")
	if code != 0 || out != want || !strings.Contains(errOut, "== report") {
		t.Fatalf("pipeline: exit %d, stdout %q, stderr %q", code, out, errOut)
	}
	c, err := client.New(s.URL, s.AgentToken, s.CAPEM)
	if err != nil {
		t.Fatal(err)
	}
	defer c.CloseIdleConnections()
	runs := func() []client.Run {
		l, err := c.ListRuns(context.Background(), client.RunFilter{AgentID: s.AgentID})
		if err != nil {
			t.Fatal(err)
		}
		return l.Runs
	}
	first := runs()
	if len(first) != 3 {
		t.Fatalf("%d runs after the pipeline, want 3", len(first))
	}
	for _, r := range first {
		if r.WorkflowID != "wf-1" || r.Status != client.RunSucceeded || !strings.HasPrefix(r.RequestID, "wf-1-") {
			t.Errorf("run %s: workflow %q, request id %q, status %s", r.ID, r.WorkflowID, r.RequestID, r.Status)
		}
	}

	// Started again: the same output, replayed, and no new run.
	if out, errOut, code := pipeline("0", s.AgentID, "wf-1"); code != 0 || out != want {
		t.Errorf("pipeline again: exit %d, stdout %q, stderr %q", code, out, errOut)
	}
	if n := len(runs()); n != 3 {
		t.Errorf("%d runs after starting the pipeline again, want still 3", n)
	}
	// A new attempt runs every step again.
	if out, errOut, code := pipeline("1", s.AgentID, "wf-1"); code != 0 || out != want {
		t.Errorf("pipeline attempt 1: exit %d, stdout %q, stderr %q", code, out, errOut)
	}
	if n := len(runs()); n != 6 {
		t.Errorf("%d runs after attempt 1, want 6", n)
	}
	if _, errOut, code := pipeline("0", s.AgentID); code != 2 || !strings.Contains(errOut, "usage:") {
		t.Errorf("pipeline without a workflow id: exit %d, stderr %q", code, errOut)
	}
}
