package supervisor

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	api "github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"
)

func streamClient(t *testing.T, cfg Config) (*Server, *api.Client) {
	t.Helper()
	s := newServer(t, cfg)
	srv := httptest.NewServer(s)
	t.Cleanup(srv.Close)
	return s, api.NewClient(srv.URL, srv.Client())
}

type timedEvent struct {
	at time.Duration
	ev api.CommandEvent
}

func collect(t *testing.T, c *api.Client, req api.CommandRequest) (*api.CommandResult, []timedEvent) {
	t.Helper()
	var evs []timedEvent
	start := time.Now()
	res, err := c.RunCommandStream(context.Background(), req, func(ev api.CommandEvent) error {
		evs = append(evs, timedEvent{time.Since(start), ev})
		return nil
	})
	if err != nil {
		t.Fatalf("RunCommandStream(%q): %v", req.Command, err)
	}
	return res, evs
}

// The first line reaches the client while the command is still sleeping,
// not when it ends.
func TestStreamDeliversOutputAsItArrives(t *testing.T) {
	_, c := streamClient(t, Config{})
	start := time.Now()
	res, evs := collect(t, c, api.CommandRequest{Command: []string{"sh", "-c", "echo one; sleep 1; echo two >&2; sleep 1; echo three"}})
	total := time.Since(start)
	if res.ExitCode != 0 || res.Truncated || res.Stdout != "" || res.Stderr != "" {
		t.Fatalf("exit event %+v", res)
	}
	want := []api.CommandEvent{{Stream: "stdout", Data: "one\n"}, {Stream: "stderr", Data: "two\n"}, {Stream: "stdout", Data: "three\n"}}
	if len(evs) != len(want) {
		t.Fatalf("events %+v, want %+v", evs, want)
	}
	for i, w := range want {
		if evs[i].ev != w {
			t.Errorf("event %d = %+v, want %+v", i, evs[i].ev, w)
		}
	}
	t.Logf("first line after %s, second after %s, third after %s; command took %s (duration_ms %d)",
		evs[0].at, evs[1].at, evs[2].at, total, res.DurationMS)
	if evs[0].at > 700*time.Millisecond || total < 2*time.Second {
		t.Fatalf("first line after %s of a %s command: not streamed", evs[0].at, total)
	}
	if evs[1].at < 900*time.Millisecond || evs[1].at > 1700*time.Millisecond {
		t.Errorf("second line after %s, want about 1s", evs[1].at)
	}
}

// The cap bounds the data sent, across both streams, and a truncated event
// says so as soon as it is reached; the command itself runs to its end.
func TestStreamOutputCap(t *testing.T) {
	_, c := streamClient(t, Config{})
	res, evs := collect(t, c, api.CommandRequest{
		Command:        []string{"sh", "-c", "head -c 300000 /dev/zero | tr '\\0' a; head -c 300000 /dev/zero | tr '\\0' b >&2; echo done >&2"},
		MaxOutputBytes: 100000,
	})
	var sent, truncEvents int
	sawTrunc := false
	for _, e := range evs {
		if e.ev.Truncated {
			truncEvents++
			sawTrunc = true
			continue
		}
		if sawTrunc {
			t.Fatalf("output sent after the truncated event: %.40q", e.ev.Data)
		}
		sent += len(e.ev.Data)
	}
	t.Logf("%d data bytes in %d events, %d truncated event(s); exit %+v", sent, len(evs)-truncEvents, truncEvents, res)
	if sent != 100000 || truncEvents != 1 || !res.Truncated || res.ExitCode != 0 {
		t.Fatalf("sent %d bytes, %d truncated events, result %+v; want exactly the 100000-byte cap, one event, Truncated", sent, truncEvents, res)
	}
}

// A character split between two writes arrives whole; invalid bytes become
// U+FFFD, as in CommandResult.
func TestStreamUTF8(t *testing.T) {
	_, c := streamClient(t, Config{})
	res, evs := collect(t, c, api.CommandRequest{Command: []string{"sh", "-c", `printf 'x\377\342\202'; sleep 0.3; printf '\254y\342'`}})
	var got strings.Builder
	for _, e := range evs {
		if !utf8.ValidString(e.ev.Data) {
			t.Errorf("event data is not UTF-8: %q", e.ev.Data)
		}
		got.WriteString(e.ev.Data)
	}
	if want := "x\uFFFD€y\uFFFD"; got.String() != want || res.ExitCode != 0 {
		t.Fatalf("data %q (%d events), want %q; result %+v", got.String(), len(evs), want, res)
	}
}

// A client that leaves mid-stream gets its command's whole process group
// killed, not left to run to its timeout.
func TestStreamClientGoneKillsProcessGroup(t *testing.T) {
	s, c := streamClient(t, Config{})
	stop := errors.New("enough")
	var pids []int
	start := time.Now()
	_, err := c.RunCommandStream(context.Background(), api.CommandRequest{
		Command:        []string{"sh", "-c", "sleep 100 & echo $! $$; sleep 100"},
		TimeoutSeconds: 300,
	}, func(ev api.CommandEvent) error {
		for _, f := range strings.Fields(ev.Data) {
			p, err := strconv.Atoi(f)
			if err != nil {
				t.Fatalf("event %+v", ev)
			}
			pids = append(pids, p)
		}
		return stop
	})
	if !errors.Is(err, stop) || len(pids) != 2 {
		t.Fatalf("RunCommandStream = %v with pids %v", err, pids)
	}
	left := time.Since(start)
	for _, p := range pids {
		waitGone(t, p, 3*time.Second)
	}
	t.Logf("client left after %s; shell %d and background sleep %d gone %s later", left, pids[1], pids[0], time.Since(start)-left)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := s.Wait(ctx); err != nil {
		t.Fatal(err)
	}
}

// The timeout kills the group and is reported in the exit event.
func TestStreamTimeout(t *testing.T) {
	_, c := streamClient(t, Config{})
	res, evs := collect(t, c, api.CommandRequest{Command: []string{"sh", "-c", "sleep 100 & echo $!; sleep 100"}, TimeoutSeconds: 1})
	if !res.TimedOut || res.Signal != "SIGKILL" || len(evs) != 1 {
		t.Fatalf("result %+v, events %+v", res, evs)
	}
	pid, err := strconv.Atoi(strings.TrimSpace(evs[0].ev.Data))
	if err != nil {
		t.Fatal(err)
	}
	waitGone(t, pid, 2*time.Second)
}

// Requests refused before the command starts are ordinary JSON errors, and
// the call is audited under its own tool name with its outcome.
func TestStreamErrorsAndAudit(t *testing.T) {
	auditPath := filepath.Join(t.TempDir(), "audit.jsonl")
	audit, err := OpenAuditLog(auditPath)
	if err != nil {
		t.Fatal(err)
	}
	defer audit.Close()
	s, c := streamClient(t, Config{Audit: audit, MaxConcurrentCommands: 1, MaxQueuedCommands: -1})
	ctx := context.Background()
	if _, err := c.RunCommandStream(ctx, api.CommandRequest{}, nil); api.CodeOf(err) != api.CodeInvalidArgument {
		t.Errorf("empty command: %v", err)
	}
	if _, err := c.RunCommandStream(ctx, api.CommandRequest{Command: []string{"no-such-program-here"}}, nil); api.CodeOf(err) != api.CodeNotFound {
		t.Errorf("missing program: %v", err)
	}
	rec := httptest.NewRecorder()
	s.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, api.PathCommandsStream, nil))
	if rec.Code != http.StatusMethodNotAllowed {
		t.Errorf("GET: %d", rec.Code)
	}
	// The stream shares the concurrency limit with /v1/commands.
	started := make(chan struct{})
	done := make(chan error, 1)
	go func() {
		_, err := c.RunCommandStream(ctx, api.CommandRequest{Command: []string{"sh", "-c", "echo go; sleep 1"}}, func(api.CommandEvent) error {
			close(started)
			return nil
		})
		done <- err
	}()
	<-started
	if _, err := c.RunCommandStream(ctx, api.CommandRequest{Command: []string{"true"}}, nil); api.CodeOf(err) != api.CodeResourceExhausted {
		t.Errorf("over the limit: %v", err)
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if err := s.Wait(ctx); err != nil {
		t.Fatal(err)
	}
	var sawOK int
	for _, e := range readAuditLines(t, auditPath) {
		if e.Tool != "run_command_stream" || len(e.ParamsSHA256) != 64 {
			t.Errorf("audit entry %+v", e)
		}
		if e.ExitCode != nil && *e.ExitCode == 0 && e.HTTPStatus == 200 {
			sawOK++
		}
	}
	if sawOK != 1 {
		t.Errorf("want one audited stream with exit 0, got %d", sawOK)
	}
}
