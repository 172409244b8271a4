package computeapi

import (
	"bufio"
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	api "github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
	"github.com/agentbox/terraform-provider-agentbox/internal/redact"
	"github.com/agentbox/terraform-provider-agentbox/internal/store"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor"
)

// pipeResponse streams a handler's response body into a pipe, flushed as
// it is written.
type pipeResponse struct {
	header http.Header
	w      *io.PipeWriter
}

func (p *pipeResponse) Header() http.Header         { return p.header }
func (p *pipeResponse) WriteHeader(int)             {}
func (p *pipeResponse) Write(b []byte) (int, error) { return p.w.Write(b) }
func (p *pipeResponse) Flush()                      {}

// followAll follows a run from after to its end and returns its events.
func followAll(t *testing.T, c *api.Client, id string, after int64) []api.RunEvent {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	var evs []api.RunEvent
	if err := c.FollowRun(ctx, id, after, func(e api.RunEvent) error {
		evs = append(evs, e)
		return nil
	}); err != nil {
		t.Fatalf("follow run %s: %v", id, err)
	}
	return evs
}

// outputOf is what a run's events say its command wrote to a stream.
func outputOf(evs []api.RunEvent, stream string) string {
	var b strings.Builder
	for _, e := range evs {
		if e.Type == stream {
			b.WriteString(e.Text)
		}
	}
	return b.String()
}

// checkLog checks that a run's whole log is numbered 1..n, starts with
// the attempt and ends with the end, the final state before it.
func checkLog(t *testing.T, evs []api.RunEvent, status string) {
	t.Helper()
	for i, e := range evs {
		if e.ID != int64(i+1) {
			t.Fatalf("event %d has id %d: %+v", i, e.ID, evs)
		}
	}
	n := len(evs)
	if n < 3 || evs[0].Type != api.RunEventState || evs[0].Status != api.RunRunning || evs[0].Attempt != 1 ||
		evs[n-2].Type != api.RunEventState || evs[n-2].Status != status ||
		evs[n-1].Type != api.RunEventEnd || evs[n-1].Status != status {
		t.Fatalf("log %+v, want an attempt, ..., the %s state and the end", evs, status)
	}
}

// A finished run is replayed: its state changes, its output a line at a
// time (with a secret redacted, and its last line without a newline),
// and its end; resuming after an event gives exactly the rest.
func TestRunEventsReplay(t *testing.T) {
	var srv *Server
	c := realSupervisorAPIWith(t, apiSetup{store: tempStore(t), pushDelay: -1,
		options: func(o *Options) { o.Replica = "replica-a" }, server: func(s *Server) { srv = s }})("agent-token:agent-1")
	ctx := context.Background()
	secret := "ghp_" + strings.Repeat("a1B2", 9)
	run, _, err := c.StartRun(ctx, api.StartRunRequest{AgentID: "agent-1", Command: []string{"sh", "-c",
		`echo one; echo "token=$TOKEN here"; echo err >&2; printf 'two\nthree'; exit 3`},
		Env: map[string]string{"TOKEN": secret}})
	if err != nil {
		t.Fatal(err)
	}
	done := waitRun(t, c, run.ID)
	evs := followAll(t, c, run.ID, 0)
	checkLog(t, evs, api.RunFailed)
	end := evs[len(evs)-1]
	if end.ExitCode == nil || *end.ExitCode != 3 || end.Reason != "NonZeroExit" || !end.Time.Equal(*done.FinishedAt) {
		t.Errorf("end %+v, run %+v", end, done)
	}
	wantOut := "one\ntoken=" + redact.Placeholder("github_token") + " here\ntwo\nthree"
	if got := outputOf(evs, api.RunEventStdout); got != wantOut {
		t.Errorf("stdout %q, want %q", got, wantOut)
	}
	if got := outputOf(evs, api.RunEventStderr); got != "err\n" {
		t.Errorf("stderr %q", got)
	}
	for _, e := range evs {
		if strings.Contains(e.Text, secret) {
			t.Errorf("event %d carries the secret", e.ID)
		}
		if (e.Type == api.RunEventStdout || e.Type == api.RunEventStderr) && strings.Count(e.Text, "\n") > 1 {
			t.Errorf("event %d is more than a line: %q", e.ID, e.Text)
		}
	}
	// Resume after each event, by the header and by the query.
	checkResumes(t, srv.Handler(), api.PathRunEvents(run.ID), adminToken, len(evs), 0)
}

// checkResumes reads the stream at path after each id from 0 to n, by the
// Last-Event-ID header (which wins over the query) and by the after
// query, and checks that exactly the events after it come, numbered on.
// A stream that does not end by itself is read for wait.
func checkResumes(t *testing.T, h http.Handler, path, token string, n int, wait time.Duration) {
	t.Helper()
	for after := range int64(n) + 1 {
		for _, how := range []string{"header", "query"} {
			ctx, cancel := context.Background(), context.CancelFunc(func() {})
			if wait > 0 {
				ctx, cancel = context.WithTimeout(ctx, wait)
			}
			req := httptest.NewRequestWithContext(ctx, http.MethodGet, path, nil)
			req.Header.Set("Authorization", "Bearer "+token)
			if how == "header" {
				req.Header.Set(api.HeaderLastEventID, fmt.Sprint(after))
				req.URL.RawQuery = "after=0"
			} else {
				req.URL.RawQuery = fmt.Sprintf("after=%d", after)
			}
			rec := httptest.NewRecorder()
			h.ServeHTTP(rec, req)
			cancel()
			if rec.Code != http.StatusOK || rec.Header().Get("Content-Type") != api.ContentTypeEventStream {
				t.Fatalf("after %d by %s: %d %s", after, how, rec.Code, rec.Body)
			}
			var got []int64
			if err := api.ReadEventStream(rec.Body, func(ev api.EventStreamEvent) error {
				var e struct {
					ID   int64  `json:"id"`
					Type string `json:"type"`
				}
				if err := json.Unmarshal([]byte(ev.Data), &e); err != nil {
					return err
				}
				if ev.ID != fmt.Sprint(e.ID) || ev.Event != e.Type {
					return fmt.Errorf("event %+v", ev)
				}
				got = append(got, e.ID)
				return nil
			}); err != nil {
				t.Fatal(err)
			}
			if len(got) != n-int(after) || (len(got) > 0 && got[0] != after+1) {
				t.Errorf("after %d by %s: events %v of %d", after, how, got, n)
			}
		}
	}
}

// Bad ids are invalid_argument; a run the caller may not see is not
// found, as GET /v1/runs/{id} answers.
func TestRunEventsRefusals(t *testing.T) {
	var srv *Server
	clients := realSupervisorAPIWith(t, apiSetup{store: tempStore(t), pushDelay: -1, server: func(s *Server) { srv = s }})
	a1, a2 := clients("agent-token:agent-1"), clients("agent-token:agent-2")
	ctx := context.Background()
	run, _, err := a1.StartRun(ctx, api.StartRunRequest{AgentID: "agent-1", Command: []string{"true"}})
	if err != nil {
		t.Fatal(err)
	}
	waitRun(t, a1, run.ID)
	for _, c := range []struct{ header, query string }{
		{header: "abc"}, {header: "-1"}, {header: "1.5"}, {header: "99999999999999999999"},
		{query: "x"}, {query: "-3"}, {header: "", query: "1e3"},
	} {
		req := httptest.NewRequest(http.MethodGet, api.PathRunEvents(run.ID), nil)
		req.Header.Set("Authorization", "Bearer agent-token:agent-1")
		if c.header != "" {
			req.Header.Set(api.HeaderLastEventID, c.header)
		}
		if c.query != "" {
			req.URL.RawQuery = "after=" + c.query
		}
		rec := httptest.NewRecorder()
		srv.Handler().ServeHTTP(rec, req)
		var body api.ErrorBody
		_ = json.Unmarshal(rec.Body.Bytes(), &body)
		if rec.Code != http.StatusBadRequest || body.Error == nil || body.Error.Code != api.CodeInvalidArgument {
			t.Errorf("header %q query %q: %d %s", c.header, c.query, rec.Code, rec.Body)
		}
	}
	err = a2.FollowRun(ctx, run.ID, 0, func(api.RunEvent) error { return nil })
	wantAPIError(t, err, api.CodeNotFound, http.StatusNotFound)
	err = a1.FollowRun(ctx, "run-00000000000000000000", 0, func(api.RunEvent) error { return nil })
	wantAPIError(t, err, api.CodeNotFound, http.StatusNotFound)
}

// A live run's events reach its follower while it runs: the command
// cannot end before the test has seen its first line. A follower that
// stops and comes back with the last id it saw misses nothing and sees
// nothing twice; an idle stream sends keepalives.
func TestRunEventsLive(t *testing.T) {
	ws := t.TempDir()
	var srv *Server
	c := realSupervisorAPIWith(t, apiSetup{store: tempStore(t), pushDelay: -1, noContract: true,
		configure: func(cfg *supervisor.Config) { cfg.Workspace = ws },
		options:   func(o *Options) { o.RunEventKeepalive = 50 * time.Millisecond },
		server:    func(s *Server) { srv = s }})(adminToken)
	ctx := context.Background()
	run, _, err := c.StartRun(ctx, api.StartRunRequest{AgentID: "agent-1", Cwd: ws, TimeoutSeconds: 120, Command: []string{"sh", "-c",
		`echo first; while [ ! -e go ]; do sleep 0.02; done; for i in $(seq 1 200); do echo "line $i"; done; echo bye >&2`}})
	if err != nil {
		t.Fatal(err)
	}
	// First connection: until the first line, which the command printed
	// before it waits for the test.
	fctx, stop := context.WithTimeout(ctx, 60*time.Second)
	var seen []api.RunEvent
	errStop := errors.New("stop here")
	err = c.FollowRun(fctx, run.ID, 0, func(e api.RunEvent) error {
		seen = append(seen, e)
		if e.Type == api.RunEventStdout {
			return errStop
		}
		return nil
	})
	stop()
	if !errors.Is(err, errStop) || seen[len(seen)-1].Text != "first\n" {
		t.Fatalf("first connection: %v, %+v", err, seen)
	}
	if r, err := c.GetRun(ctx, run.ID); err != nil || r.Status != api.RunRunning {
		t.Fatalf("the run is %+v (%v) while it waits for the test", r, err)
	}
	// An idle stream's keepalives, read raw.
	req := httptest.NewRequest(http.MethodGet, api.PathRunEvents(run.ID)+"?after="+fmt.Sprint(seen[len(seen)-1].ID), nil)
	req.Header.Set("Authorization", "Bearer "+adminToken)
	kctx, kstop := context.WithCancel(ctx)
	pr, pw := io.Pipe()
	served := make(chan struct{})
	go func() {
		defer close(served)
		srv.Handler().ServeHTTP(&pipeResponse{header: http.Header{}, w: pw}, req.WithContext(kctx))
		pw.Close()
	}()
	br := bufio.NewReader(pr)
	line, err := br.ReadString('\n')
	for err == nil && line != ": keepalive\n" {
		line, err = br.ReadString('\n')
	}
	kstop()
	pr.Close()
	<-served
	if err != nil {
		t.Fatalf("no keepalive: %v", err)
	}
	// Resume where the first connection stopped, and let the command go on.
	if err := os.WriteFile(filepath.Join(ws, "go"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	seen = append(seen, followAll(t, c, run.ID, seen[len(seen)-1].ID)...)
	checkLog(t, seen, api.RunSucceeded)
	var want strings.Builder
	want.WriteString("first\n")
	for i := 1; i <= 200; i++ {
		fmt.Fprintf(&want, "line %d\n", i)
	}
	if got := outputOf(seen, api.RunEventStdout); got != want.String() {
		t.Errorf("stdout over two connections:\n%q\nwant\n%q", got, want.String())
	}
	if got := outputOf(seen, api.RunEventStderr); got != "bye\n" {
		t.Errorf("stderr %q", got)
	}
}

// Output past the bounds is one truncated event; the run goes on and its
// record counts all of it.
func TestRunEventsTruncated(t *testing.T) {
	c := realSupervisorAPIWith(t, apiSetup{store: tempStore(t), pushDelay: -1,
		options: func(o *Options) { o.RunOutputMaxEvents, o.RunOutputMaxBytes = 5, 100000 }})(adminToken)
	ctx := context.Background()
	run, _, err := c.StartRun(ctx, api.StartRunRequest{AgentID: "agent-1", Command: []string{"sh", "-c", "seq 1 100; echo done > /dev/null"}})
	if err != nil {
		t.Fatal(err)
	}
	done := waitRun(t, c, run.ID)
	evs := followAll(t, c, run.ID, 0)
	checkLog(t, evs, api.RunSucceeded)
	if got := outputOf(evs, api.RunEventStdout); got != "1\n2\n3\n4\n5\n" {
		t.Errorf("recorded output %q", got)
	}
	var truncated int
	for _, e := range evs {
		if e.Type == api.RunEventTruncated {
			truncated++
			if !strings.Contains(e.Message, "not recorded") {
				t.Errorf("truncated event %+v", e)
			}
		}
	}
	if truncated != 1 || evs[len(evs)-3].Type != api.RunEventTruncated {
		t.Errorf("%d truncated events in %+v", truncated, evs)
	}
	if done.OutputBytes != int64(len("1\n")*9+len("10\n")*90+len("100\n")) {
		t.Errorf("the record counts %d output bytes", done.OutputBytes)
	}
	// A single line longer than an event's text is cut into pieces.
	long, _, err := c.StartRun(ctx, api.StartRunRequest{AgentID: "agent-1", Command: []string{"sh", "-c", "head -c 40000 /dev/zero | tr '\\0' x"}})
	if err != nil {
		t.Fatal(err)
	}
	waitRun(t, c, long.ID)
	evs = followAll(t, c, long.ID, 0)
	if got := outputOf(evs, api.RunEventStdout); got != strings.Repeat("x", 40000) {
		t.Errorf("a long line came back as %d bytes", len(got))
	}
	if n := len(evs); n != 2+3+1 {
		t.Errorf("a 40000-byte line in %d events", n-3)
	}
}

// A stream reads the store, not only this replica's notifications: the
// events of a run another replica executes reach it by polling, and the
// end another replica records ends it.
func TestRunEventsFromAnotherReplica(t *testing.T) {
	st := tempStore(t)
	c := realSupervisorAPIWith(t, apiSetup{store: st, pushDelay: -1, noContract: true,
		options: func(o *Options) { o.RunEventPollInterval = 20 * time.Millisecond }})(adminToken)
	ctx := context.Background()
	run, _, err := st.CreateRun(ctx, store.Run{Caller: "admin", Mode: store.RunModeAgent, AgentID: "agent-1",
		Command: store.RunCommand{Argv: []string{"true"}}})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := st.StartRunAttempt(ctx, run.ID, "replica-b", "team-a/sb-1"); err != nil {
		t.Fatal(err)
	}
	got := make(chan api.RunEvent, 100)
	followed := make(chan error, 1)
	go func() {
		fctx, cancel := context.WithTimeout(ctx, 60*time.Second)
		defer cancel()
		followed <- c.FollowRun(fctx, run.ID, 0, func(e api.RunEvent) error {
			got <- e
			return nil
		})
	}()
	next := func() api.RunEvent {
		t.Helper()
		select {
		case e := <-got:
			return e
		case <-time.After(60 * time.Second):
			t.Fatal("no event")
		}
		return api.RunEvent{}
	}
	if e := next(); e.Type != api.RunEventState || e.Status != api.RunRunning {
		t.Fatalf("first event %+v", e)
	}
	for i := range 3 {
		line := fmt.Sprintf("from replica-b %d\n", i)
		if _, err := st.AppendRunEvents(ctx, run.ID, eventOf(store.RunEventStdout, api.RunEvent{Text: line})); err != nil {
			t.Fatal(err)
		}
		if e := next(); e.Type != api.RunEventStdout || e.Text != line {
			t.Fatalf("event %+v, want %q", e, line)
		}
	}
	if _, err := st.FinishRun(ctx, run.ID, store.RunResult{Status: store.RunSucceeded, ExitCode: new(int)}); err != nil {
		t.Fatal(err)
	}
	if e := next(); e.Type != api.RunEventState || e.Status != api.RunSucceeded {
		t.Fatalf("event %+v", e)
	}
	if e := next(); e.Type != api.RunEventEnd {
		t.Fatalf("event %+v", e)
	}
	if err := <-followed; err != nil {
		t.Fatal(err)
	}
}

// A run that ended without an end in its log (one recorded before runs
// had event logs) is ended from its record.
func TestRunEventsWithoutLog(t *testing.T) {
	path := filepath.Join(t.TempDir(), "agentbox.db")
	st, err := store.OpenSQLite(context.Background(), path, store.Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	c := realSupervisorAPIWith(t, apiSetup{store: st, pushDelay: -1})(adminToken)
	ctx := context.Background()
	run, _, err := st.CreateRun(ctx, store.Run{Caller: "admin", Mode: store.RunModeAgent, AgentID: "agent-1",
		Command: store.RunCommand{Argv: []string{"true"}}})
	if err != nil {
		t.Fatal(err)
	}
	code := 4
	if _, err := st.FinishRun(ctx, run.ID, store.RunResult{Status: store.RunFailed, ExitCode: &code, Reason: "NonZeroExit"}); err != nil {
		t.Fatal(err)
	}
	// The store has no way to lose a log; the database does.
	db, err := sql.Open("sqlite", path)
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	if _, err := db.ExecContext(ctx, `DELETE FROM run_events`); err != nil {
		t.Fatal(err)
	}
	evs := followAll(t, c, run.ID, 0)
	if len(evs) != 1 || evs[0].ID != 1 || evs[0].Type != api.RunEventEnd || evs[0].Status != api.RunFailed ||
		evs[0].ExitCode == nil || *evs[0].ExitCode != 4 {
		t.Errorf("events %+v", evs)
	}
}

func TestRunEventsLastEventIDParsing(t *testing.T) {
	for _, c := range []struct {
		header, query string
		want          int64
		bad           bool
	}{
		{want: 0},
		{header: "7", want: 7},
		{query: "9", want: 9},
		{header: "7", query: "9", want: 7},
		{header: "0", want: 0},
		{header: "x", bad: true},
		{header: "-1", bad: true},
		{header: " 5", bad: true},
		{query: "", want: 0},
		{query: "5a", bad: true},
		{header: "9223372036854775808", bad: true},
	} {
		r := httptest.NewRequest(http.MethodGet, "/v1/runs/r/events", nil)
		if c.header != "" {
			r.Header.Set(api.HeaderLastEventID, c.header)
		}
		if c.query != "" {
			r.URL.RawQuery = "after=" + c.query
		}
		got, apiErr := eventsAfter(r)
		if c.bad != (apiErr != nil) || (!c.bad && got != c.want) {
			t.Errorf("header %q query %q: %d, %v", c.header, c.query, got, apiErr)
		}
		if apiErr != nil && apiErr.Code != api.CodeInvalidArgument {
			t.Errorf("header %q query %q: code %s", c.header, c.query, apiErr.Code)
		}
	}
}

// The executor's output writer redacts a secret cut between two reads,
// and a private key over many lines, before it cuts lines.
func TestRunOutputRedactsAcrossWrites(t *testing.T) {
	st := tempStore(t)
	ctx := context.Background()
	run, _, err := st.CreateRun(ctx, store.Run{Caller: "admin", Mode: store.RunModeAgent, AgentID: "agent-1",
		Command: store.RunCommand{Argv: []string{"true"}}})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := st.StartRunAttempt(ctx, run.ID, "replica-a", ""); err != nil {
		t.Fatal(err)
	}
	s := newServer(Options{Store: st})
	o := s.newRunOutput(run.ID, s.log)
	token := "sk-" + strings.Repeat("Z9", 20)
	o.write(api.RunEventStdout, []byte("key: "+token[:10]))
	o.write(api.RunEventStdout, []byte(token[10:]+"\nnext\n-----BEGIN RSA PRIVATE KEY-----\nMIIE"))
	o.write(api.RunEventStdout, []byte("abc\ndef\n-----END RSA PRIVATE KEY-----\nafter"))
	o.close()
	evs, err := st.ListRunEvents(ctx, run.ID, 0, 0)
	if err != nil {
		t.Fatal(err)
	}
	var out strings.Builder
	for _, e := range evs[1:] {
		w, err := wireRunEvent(e)
		if err != nil {
			t.Fatal(err)
		}
		out.WriteString(w.Text)
	}
	want := "key: " + redact.Placeholder("sk_api_key") + "\nnext\n" + redact.Placeholder("pem_private_key") + "\nafter"
	if out.String() != want {
		t.Errorf("output %q, want %q", out.String(), want)
	}
}

// Long lines are cut into pieces of whole characters, at any length.
func TestRunOutputCutsLongLines(t *testing.T) {
	st := tempStore(t)
	ctx := context.Background()
	s := newServer(Options{Store: st})
	for name, text := range map[string]string{
		"exactly one piece":     strings.Repeat("a", maxRunLine),
		"a piece and a newline": strings.Repeat("a", maxRunLine) + "\n",
		"a rune across the cut": strings.Repeat("a", maxRunLine-1) + "é" + strings.Repeat("b", 10) + "\n",
		"many pieces":           strings.Repeat("€", maxRunLine) + "\nend",
	} {
		run, _, err := st.CreateRun(ctx, store.Run{Caller: "admin", Mode: store.RunModeAgent, AgentID: "agent-1",
			Command: store.RunCommand{Argv: []string{"true"}}})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := st.StartRunAttempt(ctx, run.ID, "replica-a", ""); err != nil {
			t.Fatal(err)
		}
		o := s.newRunOutput(run.ID, s.log)
		// In reads of odd sizes, as a pipe gives them.
		for b := []byte(text); len(b) > 0; {
			n := min(len(b), 7919)
			o.write(api.RunEventStdout, b[:n])
			b = b[n:]
		}
		o.close()
		evs, err := st.ListRunEvents(ctx, run.ID, 0, store.MaxRunEventsPage)
		if err != nil {
			t.Fatal(err)
		}
		var out strings.Builder
		for _, e := range evs[1:] {
			w, err := wireRunEvent(e)
			if err != nil {
				t.Fatal(err)
			}
			if len(w.Text) > maxRunLine || !utf8.ValidString(w.Text) {
				t.Errorf("%s: event %d has %d bytes (valid UTF-8: %v)", name, e.Seq, len(w.Text), utf8.ValidString(w.Text))
			}
			out.WriteString(w.Text)
		}
		if out.String() != text {
			t.Errorf("%s: the output came back changed (%d bytes of %d)", name, out.Len(), len(text))
		}
	}
}

// A graceful shutdown of the HTTP server ends the streams it serves at
// once, rather than waiting out its grace for runs that go on: their
// followers resume elsewhere.
func TestRunEventsEndAtShutdown(t *testing.T) {
	ws := t.TempDir()
	var srv *Server
	c := realSupervisorAPIWith(t, apiSetup{store: tempStore(t), pushDelay: -1, noContract: true,
		configure: func(cfg *supervisor.Config) { cfg.Workspace = ws },
		server:    func(s *Server) { srv = s }})(adminToken)
	ctx := context.Background()
	run, _, err := c.StartRun(ctx, api.StartRunRequest{AgentID: "agent-1", Cwd: ws, TimeoutSeconds: 120,
		Command: []string{"sh", "-c", `echo waiting; while [ ! -e go ]; do sleep 0.02; done`}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.WriteFile(filepath.Join(ws, "go"), nil, 0o644) })
	hs := httptest.NewUnstartedServer(srv.Handler())
	hs.Start()
	defer hs.Close()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, hs.URL+api.PathRunEvents(run.ID), nil)
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Authorization", "Bearer "+adminToken)
	resp, err := hs.Client().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	// Read until the command's line, so that the stream is surely being
	// served.
	lines := make(chan string)
	go func() {
		defer close(lines)
		sc := bufio.NewScanner(resp.Body)
		for sc.Scan() {
			lines <- sc.Text()
		}
	}()
	for line := range lines {
		if strings.Contains(line, `"text":"waiting\n"`) {
			break
		}
	}
	sctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	if err := hs.Config.Shutdown(sctx); err != nil {
		t.Fatalf("shutdown waited for the stream: %v", err)
	}
	for range lines {
	}
	if r, err := c.GetRun(ctx, run.ID); err != nil || r.Status != api.RunRunning {
		t.Errorf("the run after the shutdown: %+v, %v", r, err)
	}
}
