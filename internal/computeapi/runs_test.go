package computeapi

import (
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	api "github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
	"github.com/agentbox/terraform-provider-agentbox/internal/store"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"
)

// runsAPI serves the API with a store and a real
// supervisor (its workspace ws), and short run intervals when set
// changes them.
func runsAPI(t *testing.T, st *store.Store, ws string, set func(*Options)) func(token string) *api.Client {
	t.Helper()
	return realSupervisorAPIWith(t, apiSetup{
		store:     st,
		configure: func(cfg *supervisor.Config) { cfg.Workspace = ws },
		pushDelay: -1,
		options: func(o *Options) {
			o.Replica = "replica-a"
			if set != nil {
				set(o)
			}
		},
	})
}

// waitRun waits, with a generous bound, for a run to end.
func waitRun(t *testing.T, c *api.Client, id string) *api.Run {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	r, err := c.WaitRun(ctx, id, 20*time.Millisecond)
	if err != nil {
		t.Fatalf("wait for run %s: %v", id, err)
	}
	return r
}

func TestRunSucceedsAndIsIdempotent(t *testing.T) {
	st := tempStore(t)
	ws := t.TempDir()
	c := runsAPI(t, st, ws, nil)("agent-token:agent-1")
	ctx := context.Background()
	req := api.StartRunRequest{AgentID: "agent-1", Command: []string{"sh", "-c", `printf '%s' "$GREETING" > out.txt; echo hello; echo oops >&2`},
		Env: map[string]string{"GREETING": "secret-value"}, Cwd: ws, RequestID: "req-1", WorkflowID: "wf-1", TimeoutSeconds: 30}
	run, created, err := c.StartRun(ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	if !created || run.Status != api.RunQueued || run.Mode != api.RunModeAgent || run.Caller != "agent agent-1" ||
		run.RequestID != "req-1" || run.WorkflowID != "wf-1" {
		t.Fatalf("started %+v (created %v)", run, created)
	}
	done := waitRun(t, c, run.ID)
	if done.Status != api.RunSucceeded || done.ExitCode == nil || *done.ExitCode != 0 || done.OutputBytes != int64(len("hello\noops\n")) ||
		done.Sandbox != "team-a/sb-1" || done.Executor != "replica-a" || done.Attempts != 1 || done.FinishedAt == nil || done.StartedAt == nil {
		t.Fatalf("run ended %+v", done)
	}
	if got, err := os.ReadFile(filepath.Join(ws, "out.txt")); err != nil || string(got) != "secret-value" {
		t.Errorf("the command saw GREETING %q (%v)", got, err)
	}
	// Only the variable's name is recorded.
	if len(done.EnvNames) != 1 || done.EnvNames[0] != "GREETING" {
		t.Errorf("env names %v", done.EnvNames)
	}
	stored, err := st.GetRun(ctx, run.ID)
	if err != nil {
		t.Fatal(err)
	}
	if b, _ := json.Marshal(stored); strings.Contains(string(b), "secret-value") {
		t.Errorf("the record holds the env value: %s", b)
	}

	// The same request id again: the same run, as it stands, and nothing
	// runs again.
	if err := os.Remove(filepath.Join(ws, "out.txt")); err != nil {
		t.Fatal(err)
	}
	again, created, err := c.StartRun(ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	if created || again.ID != run.ID || again.Status != api.RunSucceeded {
		t.Errorf("repeated start: %+v (created %v), want run %s as it ended", again, created, run.ID)
	}
	time.Sleep(100 * time.Millisecond)
	if _, err := os.Stat(filepath.Join(ws, "out.txt")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the repeated start ran the command again (%v)", err)
	}
	// Another request id is another run.
	req.RequestID = "req-2"
	other, created, err := c.StartRun(ctx, req)
	if err != nil || !created || other.ID == run.ID {
		t.Errorf("new request id: %+v, created %v, %v", other, created, err)
	}
	waitRun(t, c, other.ID)
}

func TestRunFailsAndTimesOut(t *testing.T) {
	ws := t.TempDir()
	c := runsAPI(t, tempStore(t), ws, nil)(adminToken)
	ctx := context.Background()
	failing, _, err := c.StartRun(ctx, api.StartRunRequest{AgentID: "agent-1", Command: []string{"sh", "-c", "echo no; exit 3"}})
	if err != nil {
		t.Fatal(err)
	}
	slow, _, err := c.StartRun(ctx, api.StartRunRequest{AgentID: "agent-1", Command: []string{"sleep", "30"}, TimeoutSeconds: 1})
	if err != nil {
		t.Fatal(err)
	}
	missing, _, err := c.StartRun(ctx, api.StartRunRequest{AgentID: "agent-404", Command: []string{"true"}})
	if err != nil {
		t.Fatal(err)
	}
	if r := waitRun(t, c, failing.ID); r.Status != api.RunFailed || r.ExitCode == nil || *r.ExitCode != 3 ||
		r.Reason != "NonZeroExit" || r.OutputBytes != 3 || r.TimeoutSeconds != supervisorapi.DefaultTimeoutSeconds {
		t.Errorf("failing run ended %+v", r)
	}
	if r := waitRun(t, c, slow.ID); r.Status != api.RunTimedOut || r.Reason != "DeadlineExceeded" || r.ExitCode != nil {
		t.Errorf("slow run ended %+v", r)
	}
	if r := waitRun(t, c, missing.ID); r.Status != api.RunFailed || r.Reason != "SandboxNotFound" || !strings.Contains(r.Message, "agent-404") {
		t.Errorf("run of an agent without a sandbox ended %+v", r)
	}
}

// A cancel stops the command's whole process group, and the run ends
// cancelled by whoever asked.
func TestRunCancelKillsTheCommand(t *testing.T) {
	ws := t.TempDir()
	c := runsAPI(t, tempStore(t), ws, nil)("agent-token:agent-1")
	ctx := context.Background()
	run, _, err := c.StartRun(ctx, api.StartRunRequest{AgentID: "agent-1", Cwd: ws, TimeoutSeconds: 600,
		Command: []string{"sh", "-c", "sleep 600 & echo $! > child.pid; echo started; wait"}})
	if err != nil {
		t.Fatal(err)
	}
	var pid int
	for deadline := time.Now().Add(30 * time.Second); pid == 0; time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the command never started")
		}
		b, err := os.ReadFile(filepath.Join(ws, "child.pid"))
		if err == nil && strings.HasSuffix(string(b), "\n") {
			pid, _ = strconv.Atoi(strings.TrimSpace(string(b)))
		}
	}
	r, err := c.CancelRun(ctx, run.ID)
	if err != nil {
		t.Fatal(err)
	}
	if r.CancelRequestedBy != "agent agent-1" {
		t.Errorf("cancel answered %+v", r)
	}
	done := waitRun(t, c, run.ID)
	if done.Status != api.RunCancelled || done.CancelledBy != "agent agent-1" || done.Reason != "Cancelled" {
		t.Errorf("cancelled run ended %+v", done)
	}
	// The background sleep, in the command's process group, is gone (or
	// a zombie waiting for its reaper).
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		stat, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
		if errors.Is(syscall.Kill(pid, 0), syscall.ESRCH) || err != nil || strings.Contains(string(stat), ") Z ") {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the command's child %d still runs after the cancel", pid)
		}
	}
	// A finished run's cancel answers its record, unchanged.
	again, err := c.CancelRun(ctx, run.ID)
	if err != nil || again.Status != api.RunCancelled || !again.FinishedAt.Equal(*done.FinishedAt) {
		t.Errorf("cancel of a finished run: %+v, %v", again, err)
	}
}

// The supervisor sees the call of a cancelled run end, which is what
// makes it kill the command.
func TestRunCancelEndsTheSupervisorCall(t *testing.T) {
	f := newFixtureWith(t, tempStore(t), "")
	ended := make(chan struct{})
	f.sup.mu.Lock()
	f.sup.stream = func(w http.ResponseWriter, r *http.Request, req supervisorapi.CommandRequest) {
		w.Header().Set("Content-Type", supervisorapi.ContentTypeNDJSON)
		_ = json.NewEncoder(w).Encode(supervisorapi.CommandEvent{Stream: "stdout", Data: "working\n"})
		w.(http.Flusher).Flush()
		<-r.Context().Done()
		close(ended)
	}
	f.sup.mu.Unlock()
	c := f.client(t, adminToken)
	ctx := context.Background()
	run, _, err := c.StartRun(ctx, api.StartRunRequest{AgentID: "agent-1", Command: []string{"sleep", "600"}, TimeoutSeconds: 600})
	if err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(30 * time.Second); f.sup.count() == 0; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the run never reached the supervisor")
		}
	}
	if _, err := c.CancelRun(ctx, run.ID); err != nil {
		t.Fatal(err)
	}
	select {
	case <-ended:
	case <-time.After(30 * time.Second):
		t.Fatal("the supervisor's call was not cancelled")
	}
	if r := waitRun(t, c, run.ID); r.Status != api.RunCancelled || r.CancelledBy != "admin" || r.OutputBytes != int64(len("working\n")) {
		t.Errorf("run ended %+v", r)
	}
}

func TestRunAgentIsolationAndRefusals(t *testing.T) {
	st := tempStore(t)
	clients := runsAPI(t, st, t.TempDir(), nil)
	a1, a2, admin := clients("agent-token:agent-1"), clients("agent-token:agent-2"), clients(adminToken)
	ctx := context.Background()
	run, _, err := a1.StartRun(ctx, api.StartRunRequest{AgentID: "agent-1", Command: []string{"true"}})
	if err != nil {
		t.Fatal(err)
	}
	waitRun(t, a1, run.ID)

	_, _, err = a2.StartRun(ctx, api.StartRunRequest{AgentID: "agent-1", Command: []string{"true"}})
	wantAPIError(t, err, api.CodePermissionDenied, http.StatusForbidden)
	_, err = a2.GetRun(ctx, run.ID)
	wantAPIError(t, err, api.CodeNotFound, http.StatusNotFound)
	_, err = a2.CancelRun(ctx, run.ID)
	wantAPIError(t, err, api.CodeNotFound, http.StatusNotFound)
	_, err = a2.GetRun(ctx, "run-00000000000000000000")
	wantAPIError(t, err, api.CodeNotFound, http.StatusNotFound)
	if l, err := a2.ListRuns(ctx, api.RunFilter{}); err != nil || len(l.Runs) != 0 {
		t.Errorf("agent-2 lists %+v, %v", l, err)
	}
	_, err = a2.ListRuns(ctx, api.RunFilter{AgentID: "agent-1"})
	wantAPIError(t, err, api.CodePermissionDenied, http.StatusForbidden)
	if l, err := a1.ListRuns(ctx, api.RunFilter{Status: api.RunSucceeded}); err != nil || len(l.Runs) != 1 || l.Runs[0].ID != run.ID {
		t.Errorf("agent-1 lists %+v, %v", l, err)
	}
	if l, err := admin.ListRuns(ctx, api.RunFilter{AgentID: "agent-1", Since: run.CreatedAt}); err != nil || len(l.Runs) != 1 {
		t.Errorf("admin lists %+v, %v", l, err)
	}
	if l, err := admin.ListRuns(ctx, api.RunFilter{Status: api.RunFailed}); err != nil || len(l.Runs) != 0 {
		t.Errorf("admin lists failed runs %+v, %v", l, err)
	}

	// Pool and job runs are an admin's, as pool leases and sandboxes
	// from a chosen template are.
	for _, req := range []api.StartRunRequest{
		{Mode: api.RunModePool, Pool: "team-a/warm", Command: []string{"true"}},
		{Mode: api.RunModeJob, Template: "team-a/tpl", Command: []string{"true"}},
	} {
		_, _, err = a1.StartRun(ctx, req)
		if e := wantAPIError(t, err, api.CodePermissionDenied, http.StatusForbidden); !strings.Contains(e.Message, "admin token") {
			t.Errorf("mode %s refused with %q", req.Mode, e.Message)
		}
	}
	ttl := -1
	cmd := []string{"true"}
	for name, c := range map[string]struct {
		req  api.StartRunRequest
		want string
	}{
		"no command":             {api.StartRunRequest{AgentID: "agent-1"}, "command"},
		"negative timeout":       {api.StartRunRequest{AgentID: "agent-1", Command: cmd, TimeoutSeconds: -1}, "timeout_seconds"},
		"unknown mode":           {api.StartRunRequest{AgentID: "agent-1", Command: cmd, Mode: "cron"}, "run mode"},
		"agent run with pool":    {api.StartRunRequest{AgentID: "agent-1", Command: cmd, Pool: "team-a/warm"}, "pool"},
		"agent run with tpl":     {api.StartRunRequest{AgentID: "agent-1", Command: cmd, Template: "team-a/tpl"}, "template"},
		"agent run with retries": {api.StartRunRequest{AgentID: "agent-1", Command: cmd, BackoffLimit: 1}, "backoff_limit"},
		"pool run with agent": {api.StartRunRequest{Mode: api.RunModePool, AgentID: "agent-1", Pool: "team-a/warm", Command: cmd},
			"agent_id"},
		"pool run without pool": {api.StartRunRequest{Mode: api.RunModePool, Command: cmd}, "pool as <namespace>/<name>"},
		"pool run with tpl": {api.StartRunRequest{Mode: api.RunModePool, Pool: "team-a/warm", Template: "team-a/tpl", Command: cmd},
			"template"},
		"pool run with retries": {api.StartRunRequest{Mode: api.RunModePool, Pool: "team-a/warm", BackoffLimit: 2, Command: cmd},
			"backoff_limit"},
		"job run with pool": {api.StartRunRequest{Mode: api.RunModeJob, Template: "team-a/tpl", Pool: "team-a/warm", Command: cmd},
			"pool"},
		"job run without tpl": {api.StartRunRequest{Mode: api.RunModeJob, Command: cmd}, "template as <namespace>/<name>"},
		"job run bad tpl":     {api.StartRunRequest{Mode: api.RunModeJob, Template: "Team_A", Command: cmd}, "template"},
		"too many retries": {api.StartRunRequest{Mode: api.RunModeJob, Template: "team-a/tpl", BackoffLimit: 11, Command: cmd},
			"between 0 and 10"},
		"negative retries": {api.StartRunRequest{Mode: api.RunModeJob, Template: "team-a/tpl", BackoffLimit: -1, Command: cmd},
			"between 0 and 10"},
		"negative deadline": {api.StartRunRequest{Mode: api.RunModeJob, Template: "team-a/tpl", ActiveDeadlineSeconds: -1, Command: cmd},
			"active_deadline_seconds"},
		"negative ttl": {api.StartRunRequest{AgentID: "agent-1", TTLSecondsAfterFinished: &ttl, Command: cmd},
			"ttl_seconds_after_finished"},
	} {
		_, _, err = admin.StartRun(ctx, c.req)
		if e := (*api.Error)(nil); !errors.As(err, &e) || e.Code != api.CodeInvalidArgument || !strings.Contains(e.Message, c.want) {
			t.Errorf("%s: %v, want invalid_argument about %s", name, err, c.want)
		}
	}
	_, err = admin.ListRuns(ctx, api.RunFilter{Status: "sleeping"})
	wantAPIError(t, err, api.CodeInvalidArgument, http.StatusBadRequest)
	if l, err := admin.ListRuns(ctx, api.RunFilter{}); err != nil || len(l.Runs) != 1 {
		t.Errorf("refused starts were recorded: %+v, %v", l, err)
	}
}

func TestRunsWithoutStoreAreUnavailable(t *testing.T) {
	c := newFixture(t, "").client(t, adminToken)
	ctx := context.Background()
	_, _, err := c.StartRun(ctx, api.StartRunRequest{AgentID: "agent-1", Command: []string{"true"}})
	wantAPIError(t, err, api.CodeUnavailable, http.StatusServiceUnavailable)
	_, err = c.GetRun(ctx, "run-1")
	wantAPIError(t, err, api.CodeUnavailable, http.StatusServiceUnavailable)
	_, err = c.ListRuns(ctx, api.RunFilter{})
	wantAPIError(t, err, api.CodeUnavailable, http.StatusServiceUnavailable)
	_, err = c.CancelRun(ctx, "run-1")
	wantAPIError(t, err, api.CodeUnavailable, http.StatusServiceUnavailable)
}

// A run whose executor stopped heartbeating (its replica died) is failed
// by the sweeper of a live one.
func TestRunSweeperFailsLostRuns(t *testing.T) {
	st := tempStore(t)
	ctx := context.Background()
	lost, _, err := st.CreateRun(ctx, store.Run{Caller: "admin", Mode: store.RunModeAgent, AgentID: "agent-1",
		Command: store.RunCommand{Argv: []string{"sleep", "600"}}})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := st.StartRunAttempt(ctx, lost.ID, "replica-dead", "team-a/sb-1"); err != nil {
		t.Fatal(err)
	}
	c := runsAPI(t, st, t.TempDir(), func(o *Options) {
		o.RunHeartbeatInterval = 300 * time.Millisecond
		o.RunSweepInterval = 50 * time.Millisecond
	})(adminToken)
	r := waitRun(t, c, lost.ID)
	if r.Status != api.RunFailed || r.Reason != "ExecutorLost" || r.Executor != "replica-dead" ||
		!strings.Contains(r.Message, "stopped before it finished") {
		t.Errorf("lost run ended %+v", r)
	}
	// A live run of this replica heartbeats, and is not failed under it.
	live, _, err := c.StartRun(ctx, api.StartRunRequest{AgentID: "agent-1", Command: []string{"sleep", "1"}, TimeoutSeconds: 30})
	if err != nil {
		t.Fatal(err)
	}
	if r := waitRun(t, c, live.ID); r.Status != api.RunSucceeded {
		t.Errorf("live run ended %+v", r)
	}
}

// A cancel recorded by another replica reaches the executor with its next
// heartbeat.
func TestRunCancelSeenByHeartbeat(t *testing.T) {
	st := tempStore(t)
	c := runsAPI(t, st, t.TempDir(), func(o *Options) { o.RunHeartbeatInterval = 100 * time.Millisecond })(adminToken)
	ctx := context.Background()
	run, _, err := c.StartRun(ctx, api.StartRunRequest{AgentID: "agent-1", Command: []string{"sleep", "600"}, TimeoutSeconds: 600})
	if err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		r, err := c.GetRun(ctx, run.ID)
		if err != nil {
			t.Fatal(err)
		}
		if r.Status == api.RunRunning {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("run never started: %+v", r)
		}
	}
	if _, err := st.RequestRunCancel(ctx, run.ID, "admin:elsewhere"); err != nil {
		t.Fatal(err)
	}
	if r := waitRun(t, c, run.ID); r.Status != api.RunCancelled || r.CancelledBy != "admin:elsewhere" {
		t.Errorf("run ended %+v", r)
	}
}

// A Server that closes stops the runs it executes and records them as
// stopped, rather than leaving them running for the sweeper.
func TestRunStoppedWhenServerCloses(t *testing.T) {
	var srv *Server
	c := realSupervisorAPIWith(t, apiSetup{store: tempStore(t), pushDelay: -1, server: func(s *Server) { srv = s }})(adminToken)
	ctx := context.Background()
	run, _, err := c.StartRun(ctx, api.StartRunRequest{AgentID: "agent-1", Command: []string{"sleep", "600"}, TimeoutSeconds: 600})
	if err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		r, err := srv.store.GetRun(ctx, run.ID)
		if err != nil {
			t.Fatal(err)
		}
		if r.Status == store.RunRunning {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("run never started: %+v", r)
		}
	}
	srv.Close()
	r, err := srv.store.GetRun(ctx, run.ID)
	if err != nil {
		t.Fatal(err)
	}
	if r.Status != store.RunFailed || r.Reason != "ExecutorStopped" {
		t.Errorf("run after Close: %+v", r)
	}
}

// A run reaches the agent's sandbox, so a hold on it refuses a run that
// does not present the hold's lease ID, before anything is recorded, and
// the Go client presents the lease it uses on the agent.
func TestRunHonoursTheHold(t *testing.T) {
	st := tempStore(t)
	ws := t.TempDir()
	clients := runsAPI(t, st, ws, nil)
	holder, other := clients(adminToken), clients(adminToken)
	ctx := context.Background()
	l, err := holder.AcquireLease(ctx, "agent-1", api.AcquireLeaseRequest{Holder: "orchestrator", RequestID: "hold-1", TTLSeconds: 300})
	if err != nil {
		t.Fatal(err)
	}
	req := api.StartRunRequest{AgentID: "agent-1", Command: []string{"echo", "hi"}, Cwd: ws}

	_, _, err = other.StartRun(ctx, req)
	wantAPIError(t, err, api.CodeLeaseHeld, http.StatusConflict)
	if holderName, _, ok := api.LeaseHeldBy(err); !ok || holderName != "orchestrator" {
		t.Errorf("LeaseHeldBy = %q, %v; want orchestrator", holderName, ok)
	}
	if runs, _, err := st.ListRuns(ctx, store.RunFilter{}); err != nil || len(runs) != 0 {
		t.Errorf("a refused run was recorded: %+v, %v", runs, err)
	}

	// The holder's client presents the lease it acquired; the run passes
	// the hold at the start and in its attempt.
	run, created, err := holder.StartRun(ctx, req)
	if err != nil || !created {
		t.Fatalf("start by the holder: %v (created %v)", err, created)
	}
	if done := waitRun(t, holder, run.ID); done.Status != api.RunSucceeded {
		t.Errorf("the holder's run ended %+v", done)
	}
	// Another client acting for the holder, with the lease ID handed on.
	other.UseLease("agent-1", l.LeaseID)
	run, _, err = other.StartRun(ctx, req)
	if err != nil {
		t.Fatalf("start with the lease ID handed on: %v", err)
	}
	if done := waitRun(t, other, run.ID); done.Status != api.RunSucceeded {
		t.Errorf("the run with the handed-on lease ID ended %+v", done)
	}
	// Once released, anyone's run is served again.
	if err := holder.ReleaseLease(ctx, "agent-1", api.ReleaseLeaseRequest{Holder: "orchestrator", LeaseID: l.LeaseID}); err != nil {
		t.Fatal(err)
	}
	anyone := clients(adminToken)
	run, _, err = anyone.StartRun(ctx, req)
	if err != nil {
		t.Fatalf("start after the release: %v", err)
	}
	if done := waitRun(t, anyone, run.ID); done.Status != api.RunSucceeded {
		t.Errorf("the run after the release ended %+v", done)
	}
}
