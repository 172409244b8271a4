package store_test

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"regexp"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/agentbox/terraform-provider-agentbox/internal/store"
)

// TestRuns is the run records' suite, run against both backends.
func TestRuns(t *testing.T) {
	cases := []struct {
		name string
		run  func(t *testing.T, b backend)
	}{
		{"Create", testRunCreate},
		{"CreateInvalid", testRunCreateInvalid},
		{"List", testRunList},
		{"Attempts", testRunAttempts},
		{"Cancel", testRunCancel},
		{"Finish", testRunFinish},
		{"Race", testRunRace},
		{"Stale", testRunStale},
		{"Retention", testRunRetention},
		{"Events", testRunEvents},
		{"EventsTwoReplicas", testRunEventsTwoReplicas},
		{"EventsEnd", testRunEventsEnd},
		{"Schedule", testRunSchedule},
		{"Artifacts", testRunArtifacts},
	}
	for _, b := range backends {
		t.Run(b.name, func(t *testing.T) {
			for _, c := range cases {
				t.Run(c.name, func(t *testing.T) { c.run(t, b) })
			}
		})
	}
}

// runJSON renders a run for comparison: equal renderings are equal runs,
// whatever the internal form of their times.
func runJSON(t *testing.T, r store.Run) string {
	t.Helper()
	b, err := json.Marshal(r)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

func sameRun(t *testing.T, what string, got, want store.Run) {
	t.Helper()
	if g, w := runJSON(t, got), runJSON(t, want); g != w {
		t.Errorf("%s:\n got  %s\n want %s", what, g, w)
	}
}

func agentRun(caller, requestID string) store.Run {
	return store.Run{Caller: caller, RequestID: requestID, Mode: store.RunModeAgent, AgentID: "agent-1",
		Command: store.RunCommand{Argv: []string{"sh", "-c", "echo hi"}}}
}

func mustCreateRun(t *testing.T, s *store.Store, r store.Run) store.Run {
	t.Helper()
	got, created, err := s.CreateRun(context.Background(), r)
	if err != nil || !created {
		t.Fatalf("create run: %+v, created %v, %v", got, created, err)
	}
	return got
}

func mustStartRun(t *testing.T, s *store.Store, id, executor string) store.Run {
	t.Helper()
	r, err := s.StartRunAttempt(context.Background(), id, executor, "ns/sb-1")
	if err != nil {
		t.Fatalf("start run %s: %v", id, err)
	}
	return r
}

func exitCode(c int) *int { return &c }

func testRunCreate(t *testing.T, b backend) {
	ctx := context.Background()
	clk := newClock()
	s := open(t, b.newDSN(t), store.Options{Now: clk.Now})

	in := store.Run{Caller: "tok-1", RequestID: "req-1", Holder: "wf-holder", WorkflowID: "wf-1",
		Schedule: "team/nightly", Mode: store.RunModeJob, Template: "team/python",
		Command: store.RunCommand{Argv: []string{"python", "-c", "print('é')"}, EnvNames: []string{"API_KEY", "HOME"},
			Cwd: "/workspace", TimeoutSeconds: 300},
		// What an executor sets is not the creator's to choose.
		Status: store.RunSucceeded, Attempts: 7, ExitCode: exitCode(3), Reason: "NonZeroExit", Executor: "replica-x"}
	r, created, err := s.CreateRun(ctx, in)
	if err != nil || !created {
		t.Fatalf("create: %+v, %v, %v", r, created, err)
	}
	if !regexp.MustCompile(`^run-[0-9a-f]{20}$`).MatchString(r.ID) {
		t.Errorf("run id %q is not run- and 20 hex digits", r.ID)
	}
	if r.Status != store.RunQueued || r.Attempts != 0 || r.ExitCode != nil || r.Reason != "" || r.Executor != "" ||
		!r.CreatedAt.Equal(clk.Now().Truncate(time.Microsecond)) || r.StartedAt != nil || r.FinishedAt != nil || r.HeartbeatAt != nil {
		t.Errorf("a new run is not a fresh queued one: %+v", r)
	}
	got, err := s.GetRun(ctx, r.ID)
	if err != nil {
		t.Fatal(err)
	}
	sameRun(t, "stored run", got, r)
	if !slices.Equal(got.Command.EnvNames, []string{"API_KEY", "HOME"}) || got.Command.TimeoutSeconds != 300 ||
		got.Command.Argv[2] != "print('é')" || got.Command.Cwd != "/workspace" {
		t.Errorf("command did not round-trip: %+v", got.Command)
	}

	// The retried start gets the first run back, untouched by what the
	// retry says; another caller's identical request id is its own run.
	clk.Advance(time.Second)
	retry := in
	retry.Command.Argv = []string{"other"}
	again, created, err := s.CreateRun(ctx, retry)
	if err != nil || created {
		t.Fatalf("repeated start: created %v, %v", created, err)
	}
	sameRun(t, "repeated start", again, r)
	other := in
	other.Caller = "tok-2"
	r2, created, err := s.CreateRun(ctx, other)
	if err != nil || !created || r2.ID == r.ID {
		t.Errorf("same request id, other caller: %+v, created %v, %v", r2, created, err)
	}
	// Runs without a request id are never the same start.
	a := mustCreateRun(t, s, agentRun("tok-1", ""))
	b2 := mustCreateRun(t, s, agentRun("tok-1", ""))
	if a.ID == b2.ID {
		t.Error("two starts without a request id made one run")
	}
	// The idempotent start holds for a finished run too.
	if _, err := s.FinishRun(ctx, r.ID, store.RunResult{Status: store.RunFailed, Reason: "NonZeroExit", ExitCode: exitCode(1)}); err != nil {
		t.Fatal(err)
	}
	if again, created, err := s.CreateRun(ctx, in); err != nil || created || again.ID != r.ID || again.Status != store.RunFailed {
		t.Errorf("start repeated after the run finished: %+v, created %v, %v", again, created, err)
	}

	// A chosen id that is taken is a conflict, not the other run.
	taken := agentRun("tok-3", "req-9")
	taken.ID = a.ID
	if _, _, err := s.CreateRun(ctx, taken); !errors.Is(err, store.ErrConflict) {
		t.Errorf("taken run id: %v, want ErrConflict", err)
	}
	chosen := agentRun("tok-3", "")
	chosen.ID = "run-chosen"
	if r, _, err := s.CreateRun(ctx, chosen); err != nil || r.ID != "run-chosen" {
		t.Errorf("chosen run id: %+v, %v", r, err)
	}

	if _, err := s.GetRun(ctx, "run-missing"); !errors.Is(err, store.ErrNotFound) {
		t.Errorf("get a missing run: %v, want ErrNotFound", err)
	}
}

func testRunCreateInvalid(t *testing.T, b backend) {
	ctx := context.Background()
	s := open(t, b.newDSN(t), store.Options{})
	cases := []struct {
		name string
		edit func(r *store.Run)
	}{
		{"unknown mode", func(r *store.Run) { r.Mode = "batch" }},
		{"no mode", func(r *store.Run) { r.Mode = "" }},
		{"no argv", func(r *store.Run) { r.Command.Argv = nil }},
		{"no caller", func(r *store.Run) { r.Caller = "" }},
		{"agent mode without agent", func(r *store.Run) { r.AgentID = "" }},
		{"job mode without template", func(r *store.Run) { r.Mode = store.RunModeJob }},
		{"pool mode without pool", func(r *store.Run) { r.Mode = store.RunModePool }},
		{"template not namespace/name", func(r *store.Run) { r.Mode, r.Template = store.RunModeJob, "python" }},
		{"pool with two slashes", func(r *store.Run) { r.Mode, r.Pool = store.RunModePool, "a/b/c" }},
		{"schedule without namespace", func(r *store.Run) { r.Schedule = "/nightly" }},
		{"sandbox without name", func(r *store.Run) { r.Sandbox = "ns/" }},
		{"env value", func(r *store.Run) { r.Command.EnvNames = []string{"TOKEN=abc"} }},
		{"empty env name", func(r *store.Run) { r.Command.EnvNames = []string{""} }},
		{"negative timeout", func(r *store.Run) { r.Command.TimeoutSeconds = -1 }},
		{"NUL in argv", func(r *store.Run) { r.Command.Argv = []string{"a\x00b"} }},
		{"bad UTF-8 in cwd", func(r *store.Run) { r.Command.Cwd = "\xff" }},
		{"NUL in caller", func(r *store.Run) { r.Caller = "x\x00" }},
		{"bad UTF-8 in request id", func(r *store.Run) { r.RequestID = "\xc3" }},
		{"NUL in workflow id", func(r *store.Run) { r.WorkflowID = "\x00" }},
	}
	for _, c := range cases {
		r := agentRun("tok-1", "")
		c.edit(&r)
		if got, _, err := s.CreateRun(ctx, r); !errors.Is(err, store.ErrInvalid) {
			t.Errorf("%s: %+v, %v, want ErrInvalid", c.name, got, err)
		}
	}
	// An env "name" that carries a value is refused without repeating
	// the value.
	secret := randomToken(t)
	r := agentRun("tok-1", "")
	r.Command.EnvNames = []string{"API_TOKEN=" + secret}
	if _, _, err := s.CreateRun(ctx, r); !errors.Is(err, store.ErrInvalid) || strings.Contains(err.Error(), secret) ||
		!strings.Contains(err.Error(), "API_TOKEN") {
		t.Errorf("env value: %v", err)
	}
	// Each mode with what it runs in is accepted.
	for _, r := range []store.Run{
		agentRun("tok-1", ""),
		{Caller: "tok-1", Mode: store.RunModePool, Pool: "ns/warm", Command: store.RunCommand{Argv: []string{"true"}}},
		{Caller: "tok-1", Mode: store.RunModeJob, Template: "ns/tpl", Command: store.RunCommand{Argv: []string{"true"}}},
	} {
		mustCreateRun(t, s, r)
	}
	if runs, _, err := s.ListRuns(ctx, store.RunFilter{}); err != nil || len(runs) != 3 {
		t.Errorf("refused runs were stored: %d runs, %v", len(runs), err)
	}
}

func testRunList(t *testing.T, b backend) {
	ctx := context.Background()
	clk := newClock()
	s := open(t, b.newDSN(t), store.Options{Now: clk.Now})

	// 23 runs over 8 instants, so that pages split runs created at the
	// same time and only the id orders them.
	var all []store.Run
	for i := range 23 {
		if i%3 == 0 {
			clk.Advance(time.Second)
		}
		r := agentRun(fmt.Sprintf("tok-%d", i%2), "")
		r.AgentID = fmt.Sprintf("agent-%d", i%3)
		all = append(all, mustCreateRun(t, s, r))
	}
	for _, r := range all[:5] {
		mustStartRun(t, s, r.ID, "replica-a")
	}
	for i, r := range all {
		all[i], _ = s.GetRun(ctx, r.ID)
	}
	newestFirst := slices.Clone(all)
	slices.SortFunc(newestFirst, func(a, b store.Run) int {
		if c := b.CreatedAt.Compare(a.CreatedAt); c != 0 {
			return c
		}
		return strings.Compare(b.ID, a.ID)
	})
	ids := func(runs []store.Run) []string {
		var out []string
		for _, r := range runs {
			out = append(out, r.ID)
		}
		return out
	}
	filter := func(keep func(store.Run) bool) []string {
		var out []string
		for _, r := range newestFirst {
			if keep(r) {
				out = append(out, r.ID)
			}
		}
		return out
	}
	// pages lists every page of f, checking that each holds at most limit.
	pages := func(f store.RunFilter) ([]string, int) {
		t.Helper()
		var got []string
		n := 0
		for {
			page, next, err := s.ListRuns(ctx, f)
			if err != nil {
				t.Fatalf("list %+v: %v", f, err)
			}
			n++
			if want := f.Limit; want > 0 && len(page) > want {
				t.Fatalf("page of %d runs with limit %d", len(page), want)
			}
			got = append(got, ids(page)...)
			if next == "" {
				return got, n
			}
			if n > 100 {
				t.Fatal("listing does not end")
			}
			f.PageToken = next
		}
	}

	first, next, err := s.ListRuns(ctx, store.RunFilter{})
	if err != nil || next != "" {
		t.Fatalf("one page of all: %v, next %q", err, next)
	}
	if !slices.Equal(ids(first), filter(func(store.Run) bool { return true })) {
		t.Errorf("list is not newest first by (created_at, id):\n got  %v\n want %v", ids(first), ids(newestFirst))
	}
	sameRun(t, "listed run", first[len(first)-1], newestFirst[len(newestFirst)-1])

	for _, limit := range []int{1, 3, 4, 22, 23} {
		got, n := pages(store.RunFilter{Limit: limit})
		if !slices.Equal(got, ids(newestFirst)) {
			t.Errorf("pages of %d: runs lost, repeated or out of order:\n got  %v\n want %v", limit, got, ids(newestFirst))
		}
		if want := (23 + limit - 1) / limit; n != want {
			t.Errorf("pages of %d: %d pages, want %d", limit, n, want)
		}
	}

	since := all[9].CreatedAt
	for name, c := range map[string]struct {
		f    store.RunFilter
		keep func(store.Run) bool
	}{
		"agent":          {store.RunFilter{AgentID: "agent-1", Limit: 2}, func(r store.Run) bool { return r.AgentID == "agent-1" }},
		"status":         {store.RunFilter{Status: store.RunRunning, Limit: 2}, func(r store.Run) bool { return r.Status == store.RunRunning }},
		"caller":         {store.RunFilter{Caller: "tok-1", Limit: 5}, func(r store.Run) bool { return r.Caller == "tok-1" }},
		"since":          {store.RunFilter{Since: since, Limit: 4}, func(r store.Run) bool { return !r.CreatedAt.Before(since) }},
		"agent & status": {store.RunFilter{AgentID: "agent-0", Status: store.RunQueued}, func(r store.Run) bool { return r.AgentID == "agent-0" && r.Status == store.RunQueued }},
		"no match":       {store.RunFilter{Caller: "nobody"}, func(store.Run) bool { return false }},
	} {
		got, _ := pages(c.f)
		want := filter(c.keep)
		if !slices.Equal(got, want) {
			t.Errorf("filter %s:\n got  %v\n want %v", name, got, want)
		}
		if name != "no match" && len(want) == 0 {
			t.Errorf("filter %s: the test data has no match", name)
		}
	}

	// Runs created while a caller pages are not on the later pages, and
	// no run that was there is lost.
	page, next, err := s.ListRuns(ctx, store.RunFilter{Limit: 10})
	if err != nil || next == "" {
		t.Fatalf("first page: %v, next %q", err, next)
	}
	clk.Advance(time.Second)
	newer := mustCreateRun(t, s, agentRun("tok-9", ""))
	got := ids(page)
	for next != "" {
		page, next, err = s.ListRuns(ctx, store.RunFilter{Limit: 10, PageToken: next})
		if err != nil {
			t.Fatal(err)
		}
		got = append(got, ids(page)...)
	}
	if !slices.Equal(got, ids(newestFirst)) {
		t.Errorf("paging while runs are created:\n got  %v\n want %v", got, ids(newestFirst))
	}
	if top, _, err := s.ListRuns(ctx, store.RunFilter{Limit: 1}); err != nil || len(top) != 1 || top[0].ID != newer.ID {
		t.Errorf("the newest run is not first: %v, %v", ids(top), err)
	}

	for name, f := range map[string]store.RunFilter{
		"limit above 500":   {Limit: 501},
		"negative limit":    {Limit: -1},
		"unknown status":    {Status: "done"},
		"token not base64":  {PageToken: "!!!"},
		"token too short":   {PageToken: base64.RawURLEncoding.EncodeToString([]byte("abc"))},
		"token of bad text": {PageToken: base64.RawURLEncoding.EncodeToString([]byte("12345678\xff"))},
	} {
		if runs, _, err := s.ListRuns(ctx, f); !errors.Is(err, store.ErrInvalid) {
			t.Errorf("%s: %d runs, %v, want ErrInvalid", name, len(runs), err)
		}
	}
	if runs, next, err := s.ListRuns(ctx, store.RunFilter{Limit: 500}); err != nil || len(runs) != 24 || next != "" {
		t.Errorf("limit 500: %d runs, next %q, %v", len(runs), next, err)
	}
	// Without a limit a page holds 50.
	for range 27 {
		mustCreateRun(t, s, agentRun("tok-9", ""))
	}
	page, next, err = s.ListRuns(ctx, store.RunFilter{})
	if err != nil || len(page) != 50 || next == "" {
		t.Fatalf("default page: %d runs, next %q, %v", len(page), next, err)
	}
	if rest, next, err := s.ListRuns(ctx, store.RunFilter{PageToken: next}); err != nil || len(rest) != 1 || next != "" {
		t.Errorf("after the default page: %d runs, next %q, %v", len(rest), next, err)
	}
}

func testRunAttempts(t *testing.T, b backend) {
	ctx := context.Background()
	clk := newClock()
	s := open(t, b.newDSN(t), store.Options{Now: clk.Now})
	r := mustCreateRun(t, s, agentRun("tok-1", "req-1"))

	clk.Advance(time.Second)
	t1 := clk.Now().Truncate(time.Microsecond)
	first, err := s.StartRunAttempt(ctx, r.ID, "replica-a", "ns/sb-1")
	if err != nil {
		t.Fatal(err)
	}
	if first.Status != store.RunRunning || first.Attempts != 1 || first.Executor != "replica-a" || first.Sandbox != "ns/sb-1" ||
		first.StartedAt == nil || !first.StartedAt.Equal(t1) || first.HeartbeatAt == nil || !first.HeartbeatAt.Equal(t1) {
		t.Errorf("first attempt: %+v", first)
	}
	got, err := s.GetRun(ctx, r.ID)
	if err != nil {
		t.Fatal(err)
	}
	sameRun(t, "stored first attempt", got, first)

	clk.Advance(time.Second)
	hb, err := s.HeartbeatRun(ctx, r.ID, "replica-a")
	if err != nil || !hb.HeartbeatAt.After(t1) {
		t.Errorf("heartbeat: %+v, %v", hb, err)
	}

	// Another replica takes the run over: a second attempt, the first start
	// time kept, the sandbox kept when none is given.
	clk.Advance(time.Second)
	t3 := clk.Now().Truncate(time.Microsecond)
	second, err := s.StartRunAttempt(ctx, r.ID, "replica-b", "")
	if err != nil {
		t.Fatal(err)
	}
	if second.Attempts != 2 || second.Executor != "replica-b" || second.Sandbox != "ns/sb-1" ||
		!second.StartedAt.Equal(t1) || !second.HeartbeatAt.Equal(t3) {
		t.Errorf("second attempt: %+v", second)
	}
	third, err := s.StartRunAttempt(ctx, r.ID, "replica-b", "ns/sb-2")
	if err != nil || third.Attempts != 3 || third.Sandbox != "ns/sb-2" {
		t.Errorf("third attempt: %+v, %v", third, err)
	}

	// The replaced executor's heartbeat is refused, and does not count.
	clk.Advance(time.Second)
	stale, err := s.HeartbeatRun(ctx, r.ID, "replica-a")
	if !errors.Is(err, store.ErrConflict) || errors.Is(err, store.ErrRunFinished) || stale.Executor != "replica-b" {
		t.Errorf("heartbeat of the replaced executor: %+v, %v, want ErrConflict with the run", stale, err)
	}
	if got, _ := s.GetRun(ctx, r.ID); !got.HeartbeatAt.Equal(t3) {
		t.Errorf("a refused heartbeat moved heartbeat_at to %v", got.HeartbeatAt)
	}
	if _, err := s.HeartbeatRun(ctx, r.ID, "replica-b"); err != nil {
		t.Errorf("heartbeat of the current executor: %v", err)
	}

	// A queued run has no executor to heartbeat it.
	q := mustCreateRun(t, s, agentRun("tok-1", ""))
	if got, err := s.HeartbeatRun(ctx, q.ID, "replica-a"); !errors.Is(err, store.ErrConflict) || got.Status != store.RunQueued {
		t.Errorf("heartbeat of a queued run: %+v, %v", got, err)
	}

	// A finished run starts and heartbeats no more.
	if _, err := s.FinishRun(ctx, r.ID, store.RunResult{Status: store.RunSucceeded, ExitCode: exitCode(0)}); err != nil {
		t.Fatal(err)
	}
	if got, err := s.StartRunAttempt(ctx, r.ID, "replica-c", ""); !errors.Is(err, store.ErrRunFinished) ||
		got.Status != store.RunSucceeded || got.Attempts != 3 {
		t.Errorf("start a finished run: %+v, %v", got, err)
	}
	if got, err := s.HeartbeatRun(ctx, r.ID, "replica-b"); !errors.Is(err, store.ErrRunFinished) || got.Status != store.RunSucceeded {
		t.Errorf("heartbeat a finished run: %+v, %v", got, err)
	}

	for name, call := range map[string]func() error{
		"start missing": func() error { _, err := s.StartRunAttempt(ctx, "run-missing", "replica-a", ""); return err },
		"heartbeat missing": func() error {
			_, err := s.HeartbeatRun(ctx, "run-missing", "replica-a")
			return err
		},
	} {
		if err := call(); !errors.Is(err, store.ErrNotFound) {
			t.Errorf("%s: %v, want ErrNotFound", name, err)
		}
	}
	for name, call := range map[string]func() error{
		"no executor":   func() error { _, err := s.StartRunAttempt(ctx, q.ID, "", ""); return err },
		"bad sandbox":   func() error { _, err := s.StartRunAttempt(ctx, q.ID, "replica-a", "sb"); return err },
		"NUL executor":  func() error { _, err := s.StartRunAttempt(ctx, q.ID, "a\x00", ""); return err },
		"bad UTF-8 box": func() error { _, err := s.StartRunAttempt(ctx, q.ID, "replica-a", "ns/\xff"); return err },
	} {
		if err := call(); !errors.Is(err, store.ErrInvalid) {
			t.Errorf("%s: %v, want ErrInvalid", name, err)
		}
	}
	if got, _ := s.GetRun(ctx, q.ID); got.Status != store.RunQueued || got.Attempts != 0 {
		t.Errorf("refused starts changed the run: %+v", got)
	}
}

func testRunCancel(t *testing.T, b backend) {
	ctx := context.Background()
	clk := newClock()
	s := open(t, b.newDSN(t), store.Options{Now: clk.Now})

	// A queued run has no executor to stop: it ends at once.
	q := mustCreateRun(t, s, agentRun("tok-1", ""))
	clk.Advance(time.Second)
	now := clk.Now().Truncate(time.Microsecond)
	c, err := s.RequestRunCancel(ctx, q.ID, "user-1")
	if err != nil {
		t.Fatal(err)
	}
	if c.Status != store.RunCancelled || c.CancelledBy != "user-1" || c.CancelRequestedBy != "user-1" ||
		c.Reason != "Cancelled" || c.FinishedAt == nil || !c.FinishedAt.Equal(now) || c.StartedAt != nil || c.Executor != "" {
		t.Errorf("cancelled queued run: %+v", c)
	}
	got, _ := s.GetRun(ctx, q.ID)
	sameRun(t, "stored cancelled run", got, c)
	clk.Advance(time.Second)
	again, err := s.RequestRunCancel(ctx, q.ID, "user-2")
	if !errors.Is(err, store.ErrRunFinished) {
		t.Errorf("cancel a cancelled run: %v, want ErrRunFinished", err)
	}
	sameRun(t, "cancel of a cancelled run", again, c)
	if got, err := s.StartRunAttempt(ctx, q.ID, "replica-a", ""); !errors.Is(err, store.ErrRunFinished) || got.Status != store.RunCancelled {
		t.Errorf("start a cancelled run: %+v, %v", got, err)
	}

	// A running run is asked to stop; its executor learns it from the
	// heartbeat and ends it. The first requester is the one recorded.
	r := mustCreateRun(t, s, agentRun("tok-1", ""))
	mustStartRun(t, s, r.ID, "replica-a")
	c, err = s.RequestRunCancel(ctx, r.ID, "user-1")
	if err != nil || c.Status != store.RunRunning || c.CancelRequestedBy != "user-1" || c.CancelledBy != "" || c.FinishedAt != nil {
		t.Errorf("cancel a running run: %+v, %v", c, err)
	}
	if c, err := s.RequestRunCancel(ctx, r.ID, "user-2"); err != nil || c.CancelRequestedBy != "user-1" {
		t.Errorf("second cancel request: %+v, %v", c, err)
	}
	hb, err := s.HeartbeatRun(ctx, r.ID, "replica-a")
	if err != nil || hb.CancelRequestedBy != "user-1" || hb.Status != store.RunRunning {
		t.Errorf("heartbeat after a cancel request: %+v, %v", hb, err)
	}
	done, err := s.FinishRun(ctx, r.ID, store.RunResult{Status: store.RunCancelled, Reason: "Cancelled", ExitCode: exitCode(143), OutputBytes: 10})
	if err != nil || done.Status != store.RunCancelled || done.CancelledBy != "user-1" || *done.ExitCode != 143 {
		t.Errorf("finish the cancelled run: %+v, %v", done, err)
	}

	// FinishRun names the canceller when told.
	r = mustCreateRun(t, s, agentRun("tok-1", ""))
	mustStartRun(t, s, r.ID, "replica-a")
	if done, err := s.FinishRun(ctx, r.ID, store.RunResult{Status: store.RunCancelled, Reason: "Cancelled", CancelledBy: "admin"}); err != nil ||
		done.CancelledBy != "admin" || done.CancelRequestedBy != "" {
		t.Errorf("finish as cancelled by admin: %+v, %v", done, err)
	}

	if _, err := s.RequestRunCancel(ctx, "run-missing", "user-1"); !errors.Is(err, store.ErrNotFound) {
		t.Errorf("cancel a missing run: %v", err)
	}
	for _, by := range []string{"", "a\x00"} {
		if _, err := s.RequestRunCancel(ctx, r.ID, by); !errors.Is(err, store.ErrInvalid) {
			t.Errorf("cancel by %q: %v, want ErrInvalid", by, err)
		}
	}
}

func testRunFinish(t *testing.T, b backend) {
	ctx := context.Background()
	clk := newClock()
	s := open(t, b.newDSN(t), store.Options{Now: clk.Now})
	r := mustCreateRun(t, s, agentRun("tok-1", ""))
	mustStartRun(t, s, r.ID, "replica-a")

	for name, res := range map[string]store.RunResult{
		"live status":            {Status: store.RunRunning},
		"queued status":          {Status: store.RunQueued},
		"no status":              {},
		"unknown status":         {Status: "done"},
		"reason not CamelCase":   {Status: store.RunFailed, Reason: "non zero exit"},
		"reason lower case":      {Status: store.RunFailed, Reason: "nonZeroExit"},
		"reason too long":        {Status: store.RunFailed, Reason: "A" + strings.Repeat("b", 64)},
		"negative output":        {Status: store.RunFailed, OutputBytes: -1},
		"NUL in message":         {Status: store.RunFailed, Message: "a\x00"},
		"canceller of a failure": {Status: store.RunFailed, CancelledBy: "user-1"},
		"bad UTF-8 in canceller": {Status: store.RunCancelled, CancelledBy: "\xff"},
	} {
		if _, err := s.FinishRun(ctx, r.ID, res); !errors.Is(err, store.ErrInvalid) {
			t.Errorf("finish with %s: %v, want ErrInvalid", name, err)
		}
	}
	if got, _ := s.GetRun(ctx, r.ID); got.Status != store.RunRunning {
		t.Fatalf("refused finishes changed the run: %+v", got)
	}

	clk.Advance(time.Minute)
	now := clk.Now().Truncate(time.Microsecond)
	done, err := s.FinishRun(ctx, r.ID, store.RunResult{Status: store.RunFailed, ExitCode: exitCode(2),
		Reason: "NonZeroExit", Message: "exit status 2", OutputBytes: 1 << 40})
	if err != nil {
		t.Fatal(err)
	}
	if done.Status != store.RunFailed || done.ExitCode == nil || *done.ExitCode != 2 || done.Reason != "NonZeroExit" ||
		done.Message != "exit status 2" || done.OutputBytes != 1<<40 || done.FinishedAt == nil || !done.FinishedAt.Equal(now) ||
		done.CancelledBy != "" || done.Attempts != 1 {
		t.Errorf("finished run: %+v", done)
	}
	got, _ := s.GetRun(ctx, r.ID)
	sameRun(t, "stored finished run", got, done)

	// A run finishes once: the second finish changes nothing and says so.
	clk.Advance(time.Minute)
	second, err := s.FinishRun(ctx, r.ID, store.RunResult{Status: store.RunSucceeded, ExitCode: exitCode(0)})
	if !errors.Is(err, store.ErrRunFinished) || !errors.Is(err, store.ErrConflict) {
		t.Errorf("second finish: %v, want ErrRunFinished (a conflict)", err)
	}
	sameRun(t, "second finish", second, done)
	got, _ = s.GetRun(ctx, r.ID)
	sameRun(t, "stored run after a second finish", got, done)

	// The message may quote output: known secret formats are redacted.
	leaky := mustCreateRun(t, s, agentRun("tok-1", ""))
	secret := randomToken(t)
	done, err = s.FinishRun(ctx, leaky.ID, store.RunResult{Status: store.RunFailed, Reason: "NonZeroExit",
		Message: "curl: 401 for token " + secret})
	if err != nil || strings.Contains(done.Message, secret) || !strings.Contains(done.Message, "curl: 401 for token [REDACTED:") {
		t.Errorf("finish with a secret in the message: %q, %v", done.Message, err)
	}
	if got, _ := s.GetRun(ctx, leaky.ID); strings.Contains(got.Message, secret) {
		t.Errorf("stored message holds the secret: %q", got.Message)
	}

	// A queued run can end without starting (its sandbox never came), and
	// without an exit code.
	q := mustCreateRun(t, s, agentRun("tok-1", ""))
	if done, err := s.FinishRun(ctx, q.ID, store.RunResult{Status: store.RunFailed, Reason: "SandboxUnavailable"}); err != nil ||
		done.ExitCode != nil || done.StartedAt != nil || done.FinishedAt == nil {
		t.Errorf("finish a queued run: %+v, %v", done, err)
	}
	for _, st := range []store.RunStatus{store.RunSucceeded, store.RunTimedOut, store.RunCancelled} {
		x := mustCreateRun(t, s, agentRun("tok-1", ""))
		if done, err := s.FinishRun(ctx, x.ID, store.RunResult{Status: st}); err != nil || done.Status != st || !done.Status.Terminal() {
			t.Errorf("finish as %s: %+v, %v", st, done, err)
		}
	}
	if _, err := s.FinishRun(ctx, "run-missing", store.RunResult{Status: store.RunFailed}); !errors.Is(err, store.ErrNotFound) {
		t.Errorf("finish a missing run: %v", err)
	}
	for _, st := range []store.RunStatus{store.RunQueued, store.RunRunning, "", "done"} {
		if st.Terminal() {
			t.Errorf("%q is terminal", st)
		}
	}
}

// testRunRace races every way a run can end, from two stores on one
// database (two replicas), and checks that exactly one ends it, and that
// the ending holds.
func testRunRace(t *testing.T, b backend) {
	ctx := context.Background()
	clk := newClock()
	dsn := b.newDSN(t)
	replicas := []*store.Store{open(t, dsn, store.Options{Now: clk.Now}), open(t, dsn, store.Options{Now: clk.Now})}
	s := replicas[0]
	const rounds = 12
	for round := range 2 * rounds {
		// Half the rounds race on a queued run, where a cancel ends it, and
		// half on a running one, where a cancel only asks.
		startFirst := round >= rounds
		r := mustCreateRun(t, s, agentRun("tok-1", fmt.Sprintf("req-%d", round)))
		if startFirst {
			mustStartRun(t, replicas[1], r.ID, "replica-b")
		}
		clk.Advance(time.Minute)

		type outcome struct {
			who string
			won bool
			run store.Run
			err error
		}
		var (
			mu       sync.Mutex
			outcomes []outcome
			wg       sync.WaitGroup
			start    = make(chan struct{})
		)
		report := func(o outcome) {
			mu.Lock()
			defer mu.Unlock()
			outcomes = append(outcomes, o)
		}
		finish := func(rep *store.Store, who string, res store.RunResult) {
			wg.Go(func() {
				<-start
				got, err := rep.FinishRun(ctx, r.ID, res)
				report(outcome{who: who, won: err == nil, run: got, err: err})
			})
		}
		for i, rep := range replicas {
			finish(rep, fmt.Sprintf("succeed-%d", i), store.RunResult{Status: store.RunSucceeded, ExitCode: exitCode(0)})
			finish(rep, fmt.Sprintf("fail-%d", i), store.RunResult{Status: store.RunFailed, ExitCode: exitCode(1), Reason: "NonZeroExit"})
			wg.Go(func() {
				<-start
				got, err := rep.RequestRunCancel(ctx, r.ID, fmt.Sprintf("user-%d", i))
				report(outcome{who: fmt.Sprintf("cancel-%d", i), won: err == nil && got.Status == store.RunCancelled, run: got, err: err})
			})
			wg.Go(func() {
				<-start
				swept, err := rep.FailStaleRuns(ctx, clk.Now(), "ExecutorLost", "no heartbeat")
				o := outcome{who: fmt.Sprintf("sweep-%d", i), err: err}
				for _, x := range swept {
					if x.ID == r.ID {
						o.won, o.run = true, x
					} else {
						o.err = fmt.Errorf("swept another run %s (%s)", x.ID, x.Status)
					}
				}
				report(o)
			})
		}
		close(start)
		wg.Wait()

		final, err := s.GetRun(ctx, r.ID)
		if err != nil {
			t.Fatal(err)
		}
		if !final.Status.Terminal() {
			t.Fatalf("round %d: the run is still %s", round, final.Status)
		}
		var winners []string
		for _, o := range outcomes {
			switch {
			case o.won:
				winners = append(winners, o.who)
				sameRun(t, fmt.Sprintf("round %d: winner %s", round, o.who), o.run, final)
			case o.err == nil && strings.HasPrefix(o.who, "cancel-"):
				// A cancel request on the running run, before it ended.
				if o.run.Status != store.RunRunning || !startFirst {
					t.Errorf("round %d: %s neither won nor lost: %+v", round, o.who, o.run)
				}
			case o.err == nil && strings.HasPrefix(o.who, "sweep-"):
				// The sweep came after the run had ended.
			case errors.Is(o.err, store.ErrRunFinished):
				// The loser sees the ending that won.
				if o.run.Status != final.Status || !o.run.FinishedAt.Equal(*final.FinishedAt) {
					t.Errorf("round %d: %s lost to %s, but saw %s", round, o.who, final.Status, o.run.Status)
				}
			default:
				t.Errorf("round %d: %s: %v", round, o.who, o.err)
			}
		}
		if len(winners) != 1 {
			t.Errorf("round %d: %d ended the run (%v), want exactly one; it is %s", round, len(winners), winners, final.Status)
		}
		// The ending holds: nothing after the race changes it.
		if _, err := replicas[1].FinishRun(ctx, r.ID, store.RunResult{Status: store.RunTimedOut}); !errors.Is(err, store.ErrRunFinished) {
			t.Errorf("round %d: finish after the race: %v", round, err)
		}
		if swept, err := replicas[1].FailStaleRuns(ctx, clk.Now().Add(time.Hour), "ExecutorLost", ""); err != nil || len(swept) != 0 {
			t.Errorf("round %d: sweep after the race: %d runs, %v", round, len(swept), err)
		}
		after, _ := s.GetRun(ctx, r.ID)
		sameRun(t, fmt.Sprintf("round %d: after the race", round), after, final)
		t.Logf("round %d (%s): %s won with %s", round, map[bool]string{false: "queued", true: "running"}[startFirst], winners, final.Status)
	}
}

func testRunStale(t *testing.T, b backend) {
	ctx := context.Background()
	clk := newClock()
	s := open(t, b.newDSN(t), store.Options{Now: clk.Now})

	oldQueued := mustCreateRun(t, s, agentRun("tok-1", ""))
	lost := mustCreateRun(t, s, agentRun("tok-1", ""))
	mustStartRun(t, s, lost.ID, "replica-a")
	alive := mustCreateRun(t, s, agentRun("tok-1", ""))
	mustStartRun(t, s, alive.ID, "replica-b")
	ended := mustCreateRun(t, s, agentRun("tok-1", ""))
	if _, err := s.FinishRun(ctx, ended.ID, store.RunResult{Status: store.RunSucceeded}); err != nil {
		t.Fatal(err)
	}
	clk.Advance(time.Minute)
	bound := clk.Now()
	clk.Advance(time.Second)
	newQueued := mustCreateRun(t, s, agentRun("tok-1", ""))
	if _, err := s.HeartbeatRun(ctx, alive.ID, "replica-b"); err != nil {
		t.Fatal(err)
	}
	endedBefore, _ := s.GetRun(ctx, ended.ID)

	clk.Advance(time.Second)
	swept, err := s.FailStaleRuns(ctx, bound, "ExecutorLost", "the control plane running it stopped")
	if err != nil {
		t.Fatal(err)
	}
	var sweptIDs []string
	for _, r := range swept {
		sweptIDs = append(sweptIDs, r.ID)
		if r.Status != store.RunFailed || r.Reason != "ExecutorLost" || r.Message != "the control plane running it stopped" ||
			r.FinishedAt == nil || !r.FinishedAt.Equal(clk.Now().Truncate(time.Microsecond)) {
			t.Errorf("swept run: %+v", r)
		}
		got, _ := s.GetRun(ctx, r.ID)
		sameRun(t, "stored swept run", got, r)
	}
	slices.Sort(sweptIDs)
	want := []string{oldQueued.ID, lost.ID}
	slices.Sort(want)
	if !slices.Equal(sweptIDs, want) {
		t.Errorf("swept %v, want the old queued and the lost running run %v", sweptIDs, want)
	}
	if got, _ := s.GetRun(ctx, alive.ID); got.Status != store.RunRunning {
		t.Errorf("a heartbeating run was swept: %+v", got)
	}
	if got, _ := s.GetRun(ctx, newQueued.ID); got.Status != store.RunQueued {
		t.Errorf("a new queued run was swept: %+v", got)
	}
	got, _ := s.GetRun(ctx, ended.ID)
	sameRun(t, "a finished run after the sweep", got, endedBefore)
	// The lost executor finds out.
	if got, err := s.HeartbeatRun(ctx, lost.ID, "replica-a"); !errors.Is(err, store.ErrRunFinished) || got.Reason != "ExecutorLost" {
		t.Errorf("heartbeat of a swept run: %+v, %v", got, err)
	}
	if again, err := s.FailStaleRuns(ctx, bound, "ExecutorLost", ""); err != nil || len(again) != 0 {
		t.Errorf("second sweep: %d runs, %v", len(again), err)
	}
	for _, reason := range []string{"", "executor lost", "\x00"} {
		if _, err := s.FailStaleRuns(ctx, bound, reason, ""); !errors.Is(err, store.ErrInvalid) {
			t.Errorf("sweep with reason %q: %v, want ErrInvalid", reason, err)
		}
	}
}

func testRunRetention(t *testing.T, b backend) {
	ctx := context.Background()
	clk := newClock()
	s := open(t, b.newDSN(t), store.Options{Now: clk.Now})

	oldDone := mustCreateRun(t, s, agentRun("tok-1", "req-old"))
	if _, err := s.FinishRun(ctx, oldDone.ID, store.RunResult{Status: store.RunSucceeded}); err != nil {
		t.Fatal(err)
	}
	oldCancelled := mustCreateRun(t, s, agentRun("tok-1", ""))
	if _, err := s.RequestRunCancel(ctx, oldCancelled.ID, "user-1"); err != nil {
		t.Fatal(err)
	}
	oldQueued := mustCreateRun(t, s, agentRun("tok-1", ""))
	oldRunning := mustCreateRun(t, s, agentRun("tok-1", ""))
	mustStartRun(t, s, oldRunning.ID, "replica-a")
	clk.Advance(24 * time.Hour)
	bound := clk.Now()
	clk.Advance(time.Second)
	newDone := mustCreateRun(t, s, agentRun("tok-1", ""))
	if _, err := s.FinishRun(ctx, newDone.ID, store.RunResult{Status: store.RunFailed}); err != nil {
		t.Fatal(err)
	}

	n, err := s.DeleteFinishedRuns(ctx, bound)
	if err != nil || n != 2 {
		t.Fatalf("delete finished runs: %d, %v, want 2", n, err)
	}
	for _, id := range []string{oldDone.ID, oldCancelled.ID} {
		if _, err := s.GetRun(ctx, id); !errors.Is(err, store.ErrNotFound) {
			t.Errorf("run %s finished before the bound is still there: %v", id, err)
		}
	}
	for _, id := range []string{oldQueued.ID, oldRunning.ID, newDone.ID} {
		if _, err := s.GetRun(ctx, id); err != nil {
			t.Errorf("run %s was deleted: %v", id, err)
		}
	}
	if n, err := s.DeleteFinishedRuns(ctx, bound); err != nil || n != 0 {
		t.Errorf("second delete: %d, %v", n, err)
	}
	// Once its record is gone, a request id starts a new run.
	if r, created, err := s.CreateRun(ctx, agentRun("tok-1", "req-old")); err != nil || !created || r.ID == oldDone.ID {
		t.Errorf("start with a deleted run's request id: %+v, %v, %v", r, created, err)
	}
}

// testRunSchedule: a schedule's runs are listed by schedule (all, and the
// live ones), and pruning keeps the newest finished runs of each kind per
// the history limits, never a live run nor another schedule's.
func testRunSchedule(t *testing.T, b backend) {
	ctx := context.Background()
	clk := newClock()
	s := open(t, b.newDSN(t), store.Options{Now: clk.Now})
	const sched = "team-a/nightly"
	scheduled := func(status store.RunStatus) store.Run {
		t.Helper()
		clk.Advance(time.Second)
		r := agentRun("schedule:"+sched, "")
		r.Schedule = sched
		r = mustCreateRun(t, s, r)
		switch status {
		case store.RunQueued:
			return r
		case store.RunRunning:
			return mustStartRun(t, s, r.ID, "replica-a")
		}
		r, err := s.FinishRun(ctx, r.ID, store.RunResult{Status: status})
		if err != nil {
			t.Fatal(err)
		}
		return r
	}
	ok1, failed1, ok2, cancelled := scheduled(store.RunSucceeded), scheduled(store.RunFailed), scheduled(store.RunSucceeded), scheduled(store.RunCancelled)
	running, ok3, timedOut, queued := scheduled(store.RunRunning), scheduled(store.RunSucceeded), scheduled(store.RunTimedOut), scheduled(store.RunQueued)
	other := agentRun("tok-1", "")
	other.Schedule = "team-a/other"
	other = mustCreateRun(t, s, other)
	if _, err := s.FinishRun(ctx, other.ID, store.RunResult{Status: store.RunSucceeded}); err != nil {
		t.Fatal(err)
	}
	unscheduled := mustCreateRun(t, s, agentRun("tok-1", ""))

	ids := func(f store.RunFilter) []string {
		t.Helper()
		runs, _, err := s.ListRuns(ctx, f)
		if err != nil {
			t.Fatalf("list runs %+v: %v", f, err)
		}
		var out []string
		for _, r := range runs {
			out = append(out, r.ID)
		}
		return out
	}
	if got, want := ids(store.RunFilter{Schedule: sched}), []string{queued.ID, timedOut.ID, ok3.ID, running.ID, cancelled.ID,
		ok2.ID, failed1.ID, ok1.ID}; !slices.Equal(got, want) {
		t.Errorf("runs of the schedule: %v, want %v", got, want)
	}
	if got, want := ids(store.RunFilter{Schedule: sched, Live: true}), []string{queued.ID, running.ID}; !slices.Equal(got, want) {
		t.Errorf("live runs of the schedule: %v, want %v", got, want)
	}
	if _, _, err := s.ListRuns(ctx, store.RunFilter{Live: true, Status: store.RunQueued}); !errors.Is(err, store.ErrInvalid) {
		t.Errorf("live and a status: %v, want ErrInvalid", err)
	}

	// Keep two succeeded and one of the others: ok1 goes, and of failed1,
	// cancelled and timedOut the newest (timedOut) stays.
	n, err := s.PruneScheduleRuns(ctx, sched, 2, 1)
	if err != nil || n != 3 {
		t.Fatalf("prune: %d, %v, want 3", n, err)
	}
	if got, want := ids(store.RunFilter{Schedule: sched}), []string{queued.ID, timedOut.ID, ok3.ID, running.ID, ok2.ID}; !slices.Equal(got, want) {
		t.Errorf("runs after the prune: %v, want %v", got, want)
	}
	if n, err := s.PruneScheduleRuns(ctx, sched, 2, 1); err != nil || n != 0 {
		t.Errorf("second prune: %d, %v", n, err)
	}
	// Zero keeps no finished run, and still every live one.
	if n, err := s.PruneScheduleRuns(ctx, sched, 0, 0); err != nil || n != 3 {
		t.Errorf("prune to nothing: %d, %v, want 3", n, err)
	}
	if got, want := ids(store.RunFilter{Schedule: sched}), []string{queued.ID, running.ID}; !slices.Equal(got, want) {
		t.Errorf("runs after pruning to nothing: %v, want %v", got, want)
	}
	for _, id := range []string{other.ID, unscheduled.ID} {
		if _, err := s.GetRun(ctx, id); err != nil {
			t.Errorf("run %s of no or another schedule was deleted: %v", id, err)
		}
	}
	for _, bad := range []string{"", "nightly", "a/b/c"} {
		if _, err := s.PruneScheduleRuns(ctx, bad, 1, 1); !errors.Is(err, store.ErrInvalid) {
			t.Errorf("prune of schedule %q: %v, want ErrInvalid", bad, err)
		}
	}
	if _, err := s.PruneScheduleRuns(ctx, sched, -1, 1); !errors.Is(err, store.ErrInvalid) {
		t.Errorf("negative limit: %v, want ErrInvalid", err)
	}
}
