package computeapi

import (
	"context"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"

	api "github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor"
)

// run_command_stream sends the output as events and ends with the result,
// every line as the document describes it (contractCheck); refusals before
// the stream starts are plain errors.
func TestRunCommandStream(t *testing.T) {
	c := realSupervisorAPI(t, nil, nil)(adminToken)
	ctx := context.Background()
	var events []api.CommandEvent
	res, err := c.RunCommandStream(ctx, "agent-1", api.RunCommandRequest{
		Command: []string{"sh", "-c", "echo one; echo two >&2; exit 4"},
	}, func(ev api.CommandEvent) error {
		events = append(events, ev)
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if res.ExitCode != 4 || res.Stdout != "" || res.Stderr != "" {
		t.Errorf("result %+v; want exit 4 and the output only as events", res)
	}
	var out, errOut strings.Builder
	for _, ev := range events {
		switch ev.Stream {
		case api.StreamStdout:
			out.WriteString(ev.Data)
		case api.StreamStderr:
			errOut.WriteString(ev.Data)
		default:
			t.Errorf("unexpected event %+v", ev)
		}
	}
	if out.String() != "one\n" || errOut.String() != "two\n" {
		t.Errorf("streamed stdout %q, stderr %q", out.String(), errOut.String())
	}

	_, err = c.RunCommandStream(ctx, "agent-1", api.RunCommandRequest{}, func(api.CommandEvent) error { return nil })
	wantAPIError(t, err, api.CodeInvalidArgument, http.StatusBadRequest)
	_, err = c.RunCommandStream(ctx, "agent-404", api.RunCommandRequest{Command: []string{"true"}}, func(api.CommandEvent) error { return nil })
	wantAPIError(t, err, api.CodeSandboxNotFound, http.StatusNotFound)
}

// The output reaches the caller while the command still runs: the command
// waits for a file that the caller creates only once it has seen the
// command's first line. Were the response held back until the end, the
// command would wait until its timeout.
func TestRunCommandStreamIsLive(t *testing.T) {
	ws := t.TempDir()
	c := realSupervisorAPIWith(t, apiSetup{
		configure:  func(cfg *supervisor.Config) { cfg.Workspace = ws },
		noContract: true,
		pushDelay:  -1,
	})(adminToken)
	var sawReady bool
	res, err := c.RunCommandStream(context.Background(), "agent-1", api.RunCommandRequest{
		Command:        []string{"sh", "-c", "echo ready; while [ ! -e go ]; do sleep 0.05; done; echo done"},
		Cwd:            ws,
		TimeoutSeconds: 20,
	}, func(ev api.CommandEvent) error {
		if ev.Data == "ready\n" && !sawReady {
			sawReady = true
			return os.WriteFile(filepath.Join(ws, "go"), nil, 0o600)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if !sawReady || res.TimedOut || res.ExitCode != 0 {
		t.Errorf("saw ready %v, result %+v: the first line did not arrive while the command ran", sawReady, res)
	}
}
