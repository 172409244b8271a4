package controller

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/go-logr/logr"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	apiclient "github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"
)

// agentEventFollower follows an agent's events through the Go client in
// the background, over as many connections as the test cuts.
type agentEventFollower struct {
	t     *testing.T
	api   *apiclient.Client
	agent string

	mu      sync.Mutex
	got     []apiclient.AgentEvent
	arrived []time.Time
	cancel  context.CancelFunc
	done    chan error
}

// connect opens a connection resuming after the last event seen.
func (f *agentEventFollower) connect(ctx context.Context) {
	f.mu.Lock()
	var after int64
	if n := len(f.got); n > 0 {
		after = f.got[n-1].ID
	}
	f.mu.Unlock()
	fctx, cancel := context.WithCancel(ctx)
	f.cancel, f.done = cancel, make(chan error, 1)
	go func() {
		f.done <- f.api.FollowAgentEvents(fctx, f.agent, after, func(e apiclient.AgentEvent) error {
			f.mu.Lock()
			f.got, f.arrived = append(f.got, e), append(f.arrived, time.Now())
			f.mu.Unlock()
			return nil
		})
	}()
}

// cut ends the connection mid-stream.
func (f *agentEventFollower) cut() {
	f.cancel()
	if err := <-f.done; !errors.Is(err, context.Canceled) {
		f.t.Fatalf("follower ended with %v, want its cancel", err)
	}
}

// waitFor waits for an event of type typ after the n-th event, and
// returns the index of the first such event.
func (f *agentEventFollower) waitFor(typ string, n int) int {
	f.t.Helper()
	for deadline := time.Now().Add(waitTimeout); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		f.mu.Lock()
		for i := n; i < len(f.got); i++ {
			if f.got[i].Type == typ {
				f.mu.Unlock()
				return i
			}
		}
		f.mu.Unlock()
	}
	f.t.Fatalf("no %s event after event %d; got %s", typ, n, f.types())
	return 0
}

func (f *agentEventFollower) types() string {
	f.mu.Lock()
	defer f.mu.Unlock()
	var b strings.Builder
	for _, e := range f.got {
		fmt.Fprintf(&b, "%d:%s(%s) ", e.ID, e.Type, e.Reason)
	}
	return b.String()
}

// TestAgentEventsOnCluster follows an agent's events on the real cluster
// through the Compute API, from before its sandbox exists: the sandbox is
// created and gets ready, runs a command, idle-stops, and resumes on the
// next call. The follower sees created, ready, command started and ended,
// idle-stopping, the snapshot, stopped, resuming and resumed, in order;
// its connection is cut twice mid-stream and resumed with Last-Event-ID,
// with no gap and no duplicate. curl (a client this project did not
// write) and the agentbox CLI read the same log.
func TestAgentEventsOnCluster(t *testing.T) {
	t.Parallel()
	image := os.Getenv(EnvSandboxImage)
	if image == "" {
		t.Skipf("%s is not set: the Compute API needs the real sandbox image's supervisor", EnvSandboxImage)
	}
	e, _, api := apiTemplate(t, image, nil)
	const name = "events"
	agent := "agent:" + name + "@example.com"
	f := &agentEventFollower{t: t, api: api, agent: agent}
	f.connect(e.ctx)
	e.sandbox(name, "tpl")
	e.waitPhase(name, v1alpha1.SandboxPhaseRunning, v1alpha1.ReasonRunning)
	ready := f.waitFor(apiclient.AgentEventReady, 0)
	created := f.waitFor(apiclient.AgentEventCreated, 0)
	f.cut()

	res, err := api.RunCommand(e.ctx, agent, apiclient.RunCommandRequest{Command: []string{"sh", "-c", "echo first; exit 3"}})
	if err != nil || res.ExitCode != 3 {
		t.Fatalf("run_command: %+v, %v", res, err)
	}
	f.connect(e.ctx)
	started := f.waitFor(apiclient.AgentEventCommandStarted, ready)
	ended := f.waitFor(apiclient.AgentEventCommandEnded, started)

	e.setActivity(name, time.Now().Add(-2*time.Hour))
	e.waitPhase(name, v1alpha1.SandboxPhaseStopped, v1alpha1.ReasonStopped)
	stopping := f.waitFor(apiclient.AgentEventIdleStopping, ended)
	snapshot := f.waitFor(apiclient.AgentEventSnapshot, stopping)
	stopped := f.waitFor(apiclient.AgentEventStopped, snapshot)
	// Following the agent does not wake its sandbox.
	time.Sleep(2 * time.Second)
	var still v1alpha1.Sandbox
	must(t, e.get(name, &still))
	if still.Status.Phase != v1alpha1.SandboxPhaseStopped {
		t.Fatalf("the followed sandbox is %s, not Stopped", still.Status.Phase)
	}
	f.cut()

	// The next call resumes the sandbox.
	res, err = api.RunCommand(e.ctx, agent, apiclient.RunCommandRequest{Command: []string{"echo", "again"}})
	if err != nil || res.ExitCode != 0 {
		t.Fatalf("run_command on the stopped sandbox: %+v, %v", res, err)
	}
	f.connect(e.ctx)
	resuming := f.waitFor(apiclient.AgentEventResuming, stopped)
	resumed := f.waitFor(apiclient.AgentEventResumed, resuming)
	started2 := f.waitFor(apiclient.AgentEventCommandStarted, resumed)
	ended2 := f.waitFor(apiclient.AgentEventCommandEnded, started2)
	// A run's command names the run.
	run, _, err := api.StartRun(e.ctx, apiclient.StartRunRequest{AgentID: agent, Command: []string{"true"}})
	must(t, err)
	runStarted := f.waitFor(apiclient.AgentEventCommandStarted, ended2)
	runEnded := f.waitFor(apiclient.AgentEventCommandEnded, runStarted)
	f.cut()

	f.mu.Lock()
	got := append([]apiclient.AgentEvent(nil), f.got...)
	arrived := append([]time.Time(nil), f.arrived...)
	f.mu.Unlock()
	t.Logf("events: %s", f.types())
	for i, ev := range got {
		if ev.ID != int64(i+1) {
			t.Fatalf("event %d has id %d (lost or repeated events): %s", i, ev.ID, f.types())
		}
		if ev.Agent != agent || ev.Namespace != e.ns || ev.Sandbox != name {
			t.Fatalf("event %d is about %s %s/%s", ev.ID, ev.Agent, ev.Namespace, ev.Sandbox)
		}
	}
	if created > ready {
		t.Errorf("created (%d) after ready (%d)", created, ready)
	}
	if s, x := got[started], got[ended]; fmt.Sprint(s.Command) != "[sh -c echo first; exit 3]" || x.CommandID != s.CommandID ||
		x.ExitCode == nil || *x.ExitCode != 3 || s.RunID != "" {
		t.Errorf("run_command's events: %+v %+v", s, x)
	}
	if s := got[snapshot]; s.Snapshot == "" {
		t.Errorf("snapshot event without the snapshot: %+v", s)
	}
	if s, x := got[runStarted], got[runEnded]; s.RunID != run.ID || x.RunID != run.ID || x.ExitCode == nil || *x.ExitCode != 0 {
		t.Errorf("the run's events: %+v %+v", s, x)
	}
	// How long each event took from when it happened to the follower;
	// those the follower was connected for (not those it caught up on).
	var lat []time.Duration
	for i, ev := range got {
		if d := arrived[i].Sub(ev.Time); i > ended && i != resuming && i < runEnded && d < 10*time.Second {
			lat = append(lat, d)
		}
	}
	t.Logf("%d events, event to follower (connected): %v", len(got), lat)

	// curl, from Last-Event-ID 2: the stream does not end, so curl stops
	// at its --max-time (exit 28) with what it read.
	if curl, err := exec.LookPath("curl"); err != nil {
		t.Log("curl is not installed: the stream is not read by a third-party SSE client")
	} else {
		const resume = 2
		out, err := e.curlEvents(curl, api, apiclient.PathAgentEvents(agent), resume, "3")
		var exitErr *exec.ExitError
		if !errors.As(err, &exitErr) || exitErr.ExitCode() != 28 {
			t.Fatalf("curl: %v, want its timeout (28)", err)
		}
		var ids []int64
		must(t, apiclient.ReadEventStream(bytes.NewReader(out), func(ev apiclient.EventStreamEvent) error {
			var ae apiclient.AgentEvent
			if err := json.Unmarshal([]byte(ev.Data), &ae); err != nil {
				return err
			}
			if ae.ID > int64(len(got)) {
				return nil // later than the follower's
			}
			want := got[ae.ID-1]
			if ev.ID != fmt.Sprint(ae.ID) || ev.Event != ae.Type || ae.Type != want.Type || !ae.Time.Equal(want.Time) {
				return fmt.Errorf("curl read event %s %s %+v; the client read %+v", ev.ID, ev.Event, ae, want)
			}
			ids = append(ids, ae.ID)
			return nil
		}))
		if len(ids) != len(got)-resume || ids[0] != resume+1 {
			t.Fatalf("curl read %d events from %v, want %d from %d", len(ids), ids[:min(len(ids), 1)], len(got)-resume, resume+1)
		}
		t.Logf("curl read events %d..%d (%d bytes)", ids[0], ids[len(ids)-1], len(out))
	}

	// The CLI prints the same log, a line an event.
	cli := goBuild(t, "../cmd/agentbox", "agentbox")
	cmd := exec.CommandContext(e.ctx, cli, "events", agent)
	cmd.Env = e.cliEnv(api.Endpoint(), api.Token())
	var cliOut, cliErr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &cliOut, &cliErr
	if err := cmd.Run(); err != nil {
		t.Fatalf("agentbox events: %v, stderr %q", err, cliErr.String())
	}
	lines := strings.Split(strings.TrimSpace(cliOut.String()), "\n")
	if len(lines) < len(got) || !strings.HasPrefix(lines[ended], fmt.Sprintf("%d ", ended+1)) ||
		!strings.Contains(lines[ended], " command_ended ") || !strings.Contains(lines[ended], "exit_code=3") {
		t.Fatalf("agentbox events: %d lines for %d events:\n%s", len(lines), len(got), cliOut.String())
	}
}

// denyProbe asks the agent's egress proxy, from inside the sandbox, for a
// name off its allowlist argv[1] times; the proxy refuses each by name,
// before any lookup or connection.
const denyProbe = `
import sys, urllib.request, urllib.error
for _ in range(int(sys.argv[1])):
    try:
        urllib.request.urlopen("http://not-allowed.invalid/", timeout=20).read()
        print("allowed?")
    except urllib.error.HTTPError as e:
        print(e.code)
`

// TestEgressDeniedEventsOnCluster: a sandbox behind a PerAgent egress
// proxy asks for a name off the allowlist; the leader's EgressDenials
// reads the refusal from the proxy's access log, and the agent's event
// stream gets egress_denied at once for the first, then one event
// counting the refusals of the rest of the window.
func TestEgressDeniedEventsOnCluster(t *testing.T) {
	t.Parallel()
	image := os.Getenv(EnvSandboxImage)
	if image == "" {
		t.Skipf("%s is not set: the test runs commands through the real sandbox image's supervisor", EnvSandboxImage)
	}
	e, _, api := apiTemplate(t, image, func(tpl *v1alpha1.SandboxTemplate) {
		tpl.Spec.EgressProxyRef = &v1alpha1.LocalObjectReference{Name: "egress"}
	})
	e.startEgressManager(testEgressReconciler())
	logs, err := kubernetes.NewForConfig(e.cfg)
	must(t, err)
	denials := &EgressDenials{Pods: e.c, Logs: logs, Namespaces: ServedNamespaces{e.ns}, Events: e.agentEvents, Log: logr.Discard()}
	dctx, stopDenials := context.WithCancel(e.ctx)
	denialsDone := make(chan error, 1)
	go func() { denialsDone <- denials.Start(dctx) }()
	t.Cleanup(func() {
		stopDenials()
		<-denialsDone
	})

	proxy := &v1alpha1.EgressProxy{
		ObjectMeta: metav1.ObjectMeta{Name: "egress", Namespace: e.ns},
		Spec: v1alpha1.EgressProxySpec{
			Mode:           v1alpha1.EgressProxyModePerAgent,
			AllowedDomains: []v1alpha1.Domain{"allowed.invalid"},
		},
	}
	must(t, e.c.Create(e.ctx, proxy))
	const name = "denied"
	agent := "agent:" + name + "@example.com"
	e.sandbox(name, "tpl")
	sbx := e.waitReason(name, v1alpha1.ReasonRunning)
	f := &agentEventFollower{t: t, api: api, agent: agent}
	f.connect(e.ctx)
	defer f.cut()
	ready := f.waitFor(apiclient.AgentEventReady, 0)

	sup := e.supervisor(t, sbx)
	asked := time.Now()
	res, err := sup.RunCommand(e.ctx, supervisorapi.CommandRequest{Command: []string{"python3", "-c", denyProbe, "6"}, Cwd: "/tmp"})
	if err != nil || res.ExitCode != 0 || strings.Count(res.Stdout, "403") != 6 {
		t.Fatalf("probe: %+v, %v", res, err)
	}
	first := f.waitFor(apiclient.AgentEventEgressDenied, ready)
	rest := f.waitFor(apiclient.AgentEventEgressDenied, first+1)
	f.mu.Lock()
	a, b, arrived := f.got[first], f.got[rest], f.arrived[first]
	f.mu.Unlock()
	if a.Host != "not-allowed.invalid" || a.Port != 80 || a.Reason != "not_allowed" || a.Count != 1 || a.Sandbox != name || a.Namespace != e.ns {
		t.Errorf("first denial: %+v", a)
	}
	if b.Host != a.Host || b.Count != 5 {
		t.Errorf("the window's denials: %+v, want a count of 5", b)
	}
	t.Logf("egress_denied: the probe began %s before the first event arrived (%s after the proxy logged it); the window's count came %s later",
		arrived.Sub(asked).Round(time.Millisecond), arrived.Sub(a.Time).Round(time.Millisecond), b.Time.Sub(a.Time).Round(time.Millisecond))
}

// curlEvents reads an event stream of the API with curl -N, from after
// event lastEventID, for at most maxTime seconds, and returns what it read.
func (e *clusterEnv) curlEvents(curl string, api *apiclient.Client, path string, lastEventID int, maxTime string) ([]byte, error) {
	caFile := filepath.Join(e.t.TempDir(), "api-ca.crt")
	must(e.t, os.WriteFile(caFile, e.apiCAPEM, 0o600))
	cmd := exec.CommandContext(e.ctx, curl, "-sS", "-N", "--fail", "--max-time", maxTime, "--cacert", caFile,
		"-H", "Authorization: Bearer "+api.Token(), "-H", fmt.Sprintf("Last-Event-ID: %d", lastEventID),
		api.Endpoint()+path)
	return cmd.Output()
}
