package store_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/agentbox/terraform-provider-agentbox/internal/store"
)

func textEvent(typ store.RunEventType, text string) store.RunEvent {
	b, _ := json.Marshal(map[string]string{"text": text})
	return store.RunEvent{Type: typ, Data: string(b)}
}

func eventState(t *testing.T, e store.RunEvent) store.RunState {
	t.Helper()
	var st store.RunState
	if err := json.Unmarshal([]byte(e.Data), &st); err != nil {
		t.Fatalf("event %d (%s) data %q: %v", e.Seq, e.Type, e.Data, err)
	}
	return st
}

// allEvents lists a run's whole log, a small page at a time.
func allEvents(t *testing.T, s *store.Store, id string) []store.RunEvent {
	t.Helper()
	return allPages(t, 0, func(after int64) ([]store.RunEvent, error) {
		return s.ListRunEvents(context.Background(), id, after, 7)
	}, func(e store.RunEvent) int64 { return e.Seq })
}

// allPages reads a numbered log from after, a page at a time, until a
// page is empty.
func allPages[E any](t *testing.T, after int64, list func(after int64) ([]E, error), seq func(E) int64) []E {
	t.Helper()
	var out []E
	for {
		page, err := list(after)
		if err != nil {
			t.Fatal(err)
		}
		if len(page) == 0 {
			return out
		}
		out = append(out, page...)
		after = seq(page[len(page)-1])
	}
}

// checkSeqs checks that a log is numbered 1..n without gaps.
func checkSeqs(t *testing.T, evs []store.RunEvent) {
	t.Helper()
	for i, e := range evs {
		if e.Seq != int64(i+1) {
			t.Fatalf("event %d has seq %d; log %+v", i, e.Seq, evs)
		}
	}
}

func testRunEvents(t *testing.T, b backend) {
	ctx := context.Background()
	clk := newClock()
	s := open(t, b.newDSN(t), store.Options{Now: clk.Now})
	r := mustCreateRun(t, s, agentRun("tok-1", ""))
	if evs, err := s.ListRunEvents(ctx, r.ID, 0, 0); err != nil || len(evs) != 0 {
		t.Fatalf("a queued run's log: %+v, %v", evs, err)
	}
	mustStartRun(t, s, r.ID, "replica-a")
	got, err := s.AppendRunEvents(ctx, r.ID, textEvent(store.RunEventStdout, "one\n"),
		textEvent(store.RunEventStderr, "two\n"))
	if err != nil || len(got) != 2 || got[0].Seq != 2 || got[1].Seq != 3 || !got[0].At.Equal(clk.Now().Truncate(time.Microsecond)) {
		t.Fatalf("append: %+v, %v", got, err)
	}
	// More than a page, in several appends of several chunks.
	var want []string
	for i := range 3 {
		var batch []store.RunEvent
		for j := range 250 {
			line := fmt.Sprintf("line %d.%d\n", i, j)
			want = append(want, line)
			batch = append(batch, textEvent(store.RunEventStdout, line))
		}
		if _, err := s.AppendRunEvents(ctx, r.ID, batch...); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := s.AppendRunEvents(ctx, r.ID, store.RunEvent{Type: store.RunEventTruncated, Data: `{"message":"enough"}`}); err != nil {
		t.Fatal(err)
	}
	clk.Advance(time.Second)
	if _, err := s.FinishRun(ctx, r.ID, store.RunResult{Status: store.RunFailed, ExitCode: exitCode(3), Reason: "NonZeroExit",
		Message: "exited 3 after printing Bearer abcdefghijklmnop"}); err != nil {
		t.Fatal(err)
	}
	evs := allEvents(t, s, r.ID)
	checkSeqs(t, evs)
	if n := len(evs); n != 1+2+750+1+2 {
		t.Fatalf("%d events", n)
	}
	if st := eventState(t, evs[0]); evs[0].Type != store.RunEventState || st.Status != store.RunRunning || st.Attempt != 1 {
		t.Errorf("first event %+v", evs[0])
	}
	var out []string
	for _, e := range evs[3 : 3+750] {
		var d struct{ Text string }
		if err := json.Unmarshal([]byte(e.Data), &d); err != nil || e.Type != store.RunEventStdout {
			t.Fatalf("event %+v: %v", e, err)
		}
		out = append(out, d.Text)
	}
	if strings.Join(out, "") != strings.Join(want, "") {
		t.Errorf("the output lines came back changed")
	}
	last, end := evs[len(evs)-2], evs[len(evs)-1]
	if last.Type != store.RunEventState || end.Type != store.RunEventEnd || last.Data != end.Data {
		t.Fatalf("the log ends %+v, %+v", last, end)
	}
	if st := eventState(t, end); st.Status != store.RunFailed || st.ExitCode == nil || *st.ExitCode != 3 ||
		st.Reason != "NonZeroExit" || strings.Contains(st.Message, "abcdefghijklmnop") {
		t.Errorf("end event %+v", st)
	}
	// Nothing follows the end.
	if _, err := s.AppendRunEvents(ctx, r.ID, textEvent(store.RunEventStdout, "late\n")); !errors.Is(err, store.ErrRunFinished) {
		t.Errorf("append after the end: %v, want ErrRunFinished", err)
	}
	// Resuming after any event gives exactly the rest.
	for _, after := range []int64{0, 1, 500, int64(len(evs) - 1), int64(len(evs)), 10000} {
		rest, err := s.ListRunEvents(ctx, r.ID, after, store.MaxRunEventsPage)
		if err != nil {
			t.Fatal(err)
		}
		wantN := max(0, len(evs)-int(after))
		if len(rest) != wantN || (wantN > 0 && rest[0].Seq != after+1) {
			t.Errorf("after %d: %d events, want %d", after, len(rest), wantN)
		}
	}

	// Refusals.
	live := mustCreateRun(t, s, agentRun("tok-1", ""))
	for name, ev := range map[string]store.RunEvent{
		"state":       {Type: store.RunEventState, Data: `{"status":"running"}`},
		"end":         {Type: store.RunEventEnd, Data: `{"status":"succeeded"}`},
		"unknown":     {Type: "progress", Data: `{}`},
		"not JSON":    {Type: store.RunEventStdout, Data: `hello`},
		"not object":  {Type: store.RunEventStdout, Data: `"hello"`},
		"NUL":         {Type: store.RunEventStdout, Data: "{\"text\":\"a\x00\"}"},
		"invalid utf": {Type: store.RunEventStdout, Data: "{\"text\":\"\xff\"}"},
	} {
		if _, err := s.AppendRunEvents(ctx, live.ID, ev); !errors.Is(err, store.ErrInvalid) {
			t.Errorf("append %s: %v, want ErrInvalid", name, err)
		}
	}
	if _, err := s.AppendRunEvents(ctx, live.ID, make([]store.RunEvent, store.MaxRunEventsAppend+1)...); !errors.Is(err, store.ErrInvalid) {
		t.Errorf("append of too many: %v", err)
	}
	if _, err := s.AppendRunEvents(ctx, "run-missing", textEvent(store.RunEventStdout, "x")); !errors.Is(err, store.ErrNotFound) {
		t.Errorf("append to no run: %v", err)
	}
	for _, c := range []struct {
		after int64
		limit int
	}{{-1, 0}, {0, -1}, {0, store.MaxRunEventsPage + 1}} {
		if _, err := s.ListRunEvents(ctx, live.ID, c.after, c.limit); !errors.Is(err, store.ErrInvalid) {
			t.Errorf("list after %d limit %d: %v", c.after, c.limit, err)
		}
	}
}

// testRunEventsTwoReplicas appends to one run from two stores on one
// database at once: every event gets its own number, with no gap.
func testRunEventsTwoReplicas(t *testing.T, b backend) {
	ctx := context.Background()
	dsn := b.newDSN(t)
	replicas := []*store.Store{open(t, dsn, store.Options{}), open(t, dsn, store.Options{})}
	r := mustCreateRun(t, replicas[0], agentRun("tok-1", ""))
	mustStartRun(t, replicas[0], r.ID, "replica-a")
	const writers, appends = 4, 25
	var wg sync.WaitGroup
	errs := make(chan error, writers*appends)
	for w := range writers {
		wg.Go(func() {
			for i := range appends {
				_, err := replicas[w%2].AppendRunEvents(ctx, r.ID, textEvent(store.RunEventStdout, fmt.Sprintf("%d.%d.a\n", w, i)),
					textEvent(store.RunEventStdout, fmt.Sprintf("%d.%d.b\n", w, i)))
				if err != nil {
					errs <- err
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	evs := allEvents(t, replicas[1], r.ID)
	checkSeqs(t, evs)
	if len(evs) != 1+writers*appends*2 {
		t.Fatalf("%d events, want %d", len(evs), 1+writers*appends*2)
	}
	// Each append's two events are next to each other.
	for i := 1; i < len(evs); i += 2 {
		if a, b := evs[i].Data, evs[i+1].Data; strings.TrimSuffix(a, `.a\n"}`) != strings.TrimSuffix(b, `.b\n"}`) {
			t.Errorf("events %d and %d are from different appends: %s %s", i+1, i+2, a, b)
		}
	}
}

// testRunEventsEnd checks that every way a run ends writes its end event
// once, and that retention deletes the log with the run.
func testRunEventsEnd(t *testing.T, b backend) {
	ctx := context.Background()
	clk := newClock()
	s := open(t, b.newDSN(t), store.Options{Now: clk.Now})
	endOf := func(id string, want store.RunStatus, n int) {
		t.Helper()
		evs := allEvents(t, s, id)
		checkSeqs(t, evs)
		if len(evs) != n {
			t.Fatalf("run %s: %d events, want %d: %+v", id, len(evs), n, evs)
		}
		end := evs[n-1]
		if end.Type != store.RunEventEnd || eventState(t, end).Status != want {
			t.Errorf("run %s ends with %+v, want end %s", id, end, want)
		}
		for _, e := range evs[:n-1] {
			if e.Type == store.RunEventEnd {
				t.Errorf("run %s: an end before the last event", id)
			}
		}
	}
	queued := mustCreateRun(t, s, agentRun("tok-1", ""))
	if _, err := s.RequestRunCancel(ctx, queued.ID, "user-1"); err != nil {
		t.Fatal(err)
	}
	endOf(queued.ID, store.RunCancelled, 2)
	running := mustCreateRun(t, s, agentRun("tok-1", ""))
	mustStartRun(t, s, running.ID, "replica-a")
	// A cancel request of a running run changes no state yet.
	if _, err := s.RequestRunCancel(ctx, running.ID, "user-1"); err != nil {
		t.Fatal(err)
	}
	if evs := allEvents(t, s, running.ID); len(evs) != 1 {
		t.Errorf("a cancel request wrote events: %+v", evs)
	}
	if _, err := s.FinishRun(ctx, running.ID, store.RunResult{Status: store.RunCancelled}); err != nil {
		t.Fatal(err)
	}
	if _, err := s.FinishRun(ctx, running.ID, store.RunResult{Status: store.RunSucceeded}); !errors.Is(err, store.ErrRunFinished) {
		t.Fatal(err)
	}
	endOf(running.ID, store.RunCancelled, 3)
	lost := mustCreateRun(t, s, agentRun("tok-1", ""))
	mustStartRun(t, s, lost.ID, "replica-a")
	if _, err := s.AppendRunEvents(ctx, lost.ID, textEvent(store.RunEventStdout, "x\n")); err != nil {
		t.Fatal(err)
	}
	clk.Advance(time.Hour)
	if swept, err := s.FailStaleRuns(ctx, clk.Now(), "ExecutorLost", "lost"); err != nil || len(swept) != 1 {
		t.Fatalf("sweep: %+v, %v", swept, err)
	}
	endOf(lost.ID, store.RunFailed, 4)

	clk.Advance(time.Hour)
	if n, err := s.DeleteFinishedRuns(ctx, clk.Now()); err != nil || n != 3 {
		t.Fatalf("delete finished runs: %d, %v", n, err)
	}
	var left int
	if err := s.RawDB().QueryRowContext(ctx, `SELECT COUNT(*) FROM run_events`).Scan(&left); err != nil {
		t.Fatal(err)
	}
	if left != 0 {
		t.Errorf("%d run events outlived their runs", left)
	}
}
