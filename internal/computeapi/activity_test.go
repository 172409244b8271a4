package computeapi

import (
	"context"
	"fmt"
	"io"
	"net/url"
	"strings"
	"testing"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	"k8s.io/apimachinery/pkg/types"
	clocktesting "k8s.io/utils/clock/testing"
	"sigs.k8s.io/controller-runtime/pkg/client"

	api "github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
)

// TestOpenCallsCountAsActivity: a call that stays open (an agent's PTY, a
// streamed command) renews the sandbox's activity clock for as long as it
// is open, at the renewer's throttled rate (once an interval of the API's
// clock), and stops when the call ends. Without it a sandbox in use
// would be idle-stopped under its terminal.
func TestOpenCallsCountAsActivity(t *testing.T) {
	const interval = 60 * time.Millisecond
	var (
		kube client.Client
		clk  *clocktesting.FakeClock
	)
	st := tempStore(t)
	clients := realSupervisorAPIWith(t, apiSetup{store: st, pushDelay: -1, noContract: true, renewInterval: interval,
		started: func(k client.Client, c *clocktesting.FakeClock) { kube, clk = k, c }})
	agent := clients("agent-token:agent-1")
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()

	renewedAt := func() time.Time {
		var l coordinationv1.Lease
		if err := kube.Get(ctx, types.NamespacedName{Namespace: "team-a", Name: "sb-1"}, &l); err != nil {
			t.Fatal(err)
		}
		return l.Spec.RenewTime.Time
	}
	// waitRenewed waits for the activity clock to read the API's clock.
	waitRenewed := func(what string) {
		t.Helper()
		want := clk.Now().Truncate(time.Microsecond)
		for deadline := time.Now().Add(10 * time.Second); !renewedAt().Equal(want); time.Sleep(5 * time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatalf("%s: the lease was renewed at %v, want %v", what, renewedAt(), want)
			}
		}
	}
	// keptActive steps the API's clock past the throttle a few times and
	// expects a renewal each time.
	keptActive := func(what string) {
		t.Helper()
		for i := range 3 {
			clk.Step(interval)
			waitRenewed(fmt.Sprintf("%s, interval %d", what, i+1))
		}
	}
	// notRenewed expects no renewal after the call ended: its audit
	// record is written once the handler has returned.
	notRenewed := func(op string) {
		t.Helper()
		for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(10 * time.Millisecond) {
			page, err := clients(adminToken).QueryAudit(ctx, url.Values{"operation": {op}})
			if err != nil {
				t.Fatal(err)
			}
			if len(page.Records) > 0 {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("no audit record of %s", op)
			}
		}
		before := renewedAt()
		clk.Step(interval)
		time.Sleep(20 * interval)
		if got := renewedAt(); !got.Equal(before) {
			t.Errorf("after %s ended the lease was renewed at %v (was %v)", op, got, before)
		}
	}

	pty, err := agent.OpenPTY(ctx, "agent-1", api.PTYOptions{Command: []string{"sh", "-c", "read x; echo got-$x"}})
	if err != nil {
		t.Fatal(err)
	}
	waitRenewed("the PTY's opening")
	keptActive("an open PTY")
	if _, err := pty.Write([]byte("bye\n")); err != nil {
		t.Fatal(err)
	}
	out, _ := io.ReadAll(pty)
	if exit, err := pty.Wait(ctx); err != nil || exit.ExitCode != 0 || !strings.Contains(string(out), "got-bye") {
		t.Fatalf("pty: exit %+v, %v, output %q", exit, err, out)
	}
	pty.Close()
	notRenewed("run_command_pty")

	streamCtx, stop := context.WithCancel(ctx)
	started := make(chan struct{})
	done := make(chan error, 1)
	go func() {
		_, err := agent.RunCommandStream(streamCtx, "agent-1", api.RunCommandRequest{Command: []string{"sh", "-c", "echo started; sleep 60"}},
			func(api.CommandEvent) error {
				select {
				case <-started:
				default:
					close(started)
				}
				return nil
			})
		done <- err
	}()
	select {
	case <-started:
	case err := <-done:
		t.Fatalf("the streamed command ended early: %v", err)
	}
	keptActive("a streamed command")
	stop()
	<-done
	notRenewed("run_command_stream")
}
