package store_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/agentbox/terraform-provider-agentbox/internal/store"
)

func TestAgentEvents(t *testing.T) {
	cases := []struct {
		name string
		run  func(t *testing.T, b backend)
	}{
		{"AppendList", testAgentEventsAppendList},
		{"Invalid", testAgentEventsInvalid},
		{"SourceKey", testAgentEventsSourceKey},
		{"Retention", testAgentEventsRetention},
		{"TwoReplicas", testAgentEventsTwoReplicas},
	}
	for _, b := range backends {
		t.Run(b.name, func(t *testing.T) {
			for _, c := range cases {
				t.Run(c.name, func(t *testing.T) { c.run(t, b) })
			}
		})
	}
}

func agentEvent(typ, msg string) store.AgentEvent {
	return store.AgentEvent{Type: typ, Namespace: "ns", Sandbox: "sbx", Data: fmt.Sprintf(`{"message":%q}`, msg)}
}

// allAgentEvents lists an agent's whole log, a small page at a time.
func allAgentEvents(t *testing.T, s *store.Store, agent string, after int64) []store.AgentEvent {
	t.Helper()
	return allPages(t, after, func(after int64) ([]store.AgentEvent, error) {
		return s.ListAgentEvents(context.Background(), agent, after, 7)
	}, func(e store.AgentEvent) int64 { return e.Seq })
}

func testAgentEventsAppendList(t *testing.T, b backend) {
	ctx := context.Background()
	clk := newClock()
	s := open(t, b.newDSN(t), store.Options{Now: clk.Now})
	if evs, err := s.ListAgentEvents(ctx, "agent-1", 0, 0); err != nil || len(evs) != 0 {
		t.Fatalf("an agent without events: %+v, %v", evs, err)
	}
	at := time.Date(2026, 1, 2, 3, 4, 5, 6789, time.UTC)
	withTime := agentEvent("ready", "two")
	withTime.At = at
	got, err := s.AppendAgentEvents(ctx, "agent-1", agentEvent("created", "one"), withTime)
	if err != nil || len(got) != 2 || got[0].Seq != 1 || got[1].Seq != 2 ||
		!got[0].At.Equal(clk.Now().Truncate(time.Microsecond)) || !got[1].At.Equal(at.Truncate(time.Microsecond)) {
		t.Fatalf("append: %+v, %v", got, err)
	}
	// Another agent numbers its own log.
	if other, err := s.AppendAgentEvents(ctx, "agent-2", agentEvent("created", "x")); err != nil || other[0].Seq != 1 {
		t.Fatalf("other agent: %+v, %v", other, err)
	}
	var batch []store.AgentEvent
	for i := range 20 {
		batch = append(batch, agentEvent("command_started", fmt.Sprint(i)))
	}
	if _, err := s.AppendAgentEvents(ctx, "agent-1", batch...); err != nil {
		t.Fatal(err)
	}
	all := allAgentEvents(t, s, "agent-1", 0)
	if len(all) != 22 {
		t.Fatalf("%d events, want 22", len(all))
	}
	for i, e := range all {
		if e.Seq != int64(i+1) || e.AgentID != "agent-1" || e.Namespace != "ns" || e.Sandbox != "sbx" {
			t.Fatalf("event %d: %+v", i, e)
		}
	}
	if all[0].Type != "created" || all[0].Data != `{"message":"one"}` || all[1].Type != "ready" || all[21].Data != `{"message":"19"}` {
		t.Fatalf("events: %+v %+v %+v", all[0], all[1], all[21])
	}
	// Resuming after an id gives exactly what follows it.
	if rest := allAgentEvents(t, s, "agent-1", 20); len(rest) != 2 || rest[0].Seq != 21 || rest[1].Seq != 22 {
		t.Fatalf("after 20: %+v", rest)
	}
	if rest := allAgentEvents(t, s, "agent-1", 22); len(rest) != 0 {
		t.Fatalf("after the last: %+v", rest)
	}
}

func testAgentEventsInvalid(t *testing.T, b backend) {
	ctx := context.Background()
	s := open(t, b.newDSN(t), store.Options{})
	for name, e := range map[string]store.AgentEvent{
		"no type":      {Data: `{}`},
		"not object":   {Type: "x", Data: `[1]`},
		"not JSON":     {Type: "x", Data: `{`},
		"NUL in field": {Type: "x", Sandbox: "a\x00b", Data: `{}`},
	} {
		if _, err := s.AppendAgentEvents(ctx, "agent-1", e); !errors.Is(err, store.ErrInvalid) {
			t.Errorf("%s: %v, want ErrInvalid", name, err)
		}
	}
	if _, err := s.AppendAgentEvents(ctx, "", agentEvent("x", "")); !errors.Is(err, store.ErrInvalid) {
		t.Errorf("no agent: %v", err)
	}
	if _, err := s.ListAgentEvents(ctx, "agent-1", -1, 0); !errors.Is(err, store.ErrInvalid) {
		t.Errorf("negative after: %v", err)
	}
	if _, err := s.ListAgentEvents(ctx, "agent-1", 0, store.MaxAgentEventsPage+1); !errors.Is(err, store.ErrInvalid) {
		t.Errorf("big page: %v", err)
	}
	// Nothing refused took a number.
	if got, err := s.AppendAgentEvents(ctx, "agent-1", agentEvent("x", "")); err != nil || got[0].Seq != 1 {
		t.Fatalf("after refusals: %+v, %v", got, err)
	}
}

// testAgentEventsSourceKey appends a thing seen twice once.
func testAgentEventsSourceKey(t *testing.T, b backend) {
	ctx := context.Background()
	s := open(t, b.newDSN(t), store.Options{})
	keyed := func(key string) store.AgentEvent {
		e := agentEvent("egress_denied", key)
		e.SourceKey = key
		return e
	}
	got, err := s.AppendAgentEvents(ctx, "agent-1", keyed("uid-1"), keyed("uid-1"), agentEvent("x", ""), keyed("uid-2"))
	if err != nil || len(got) != 3 || got[2].Seq != 3 || got[2].SourceKey != "uid-2" {
		t.Fatalf("append: %+v, %v", got, err)
	}
	got, err = s.AppendAgentEvents(ctx, "agent-1", keyed("uid-2"), keyed("uid-3"))
	if err != nil || len(got) != 1 || got[0].Seq != 4 || got[0].SourceKey != "uid-3" {
		t.Fatalf("second append: %+v, %v", got, err)
	}
	if got, err := s.AppendAgentEvents(ctx, "agent-1", keyed("uid-1")); err != nil || len(got) != 0 {
		t.Fatalf("a key seen before: %+v, %v", got, err)
	}
	// Keys are per agent.
	if got, err := s.AppendAgentEvents(ctx, "agent-2", keyed("uid-1")); err != nil || len(got) != 1 || got[0].Seq != 1 {
		t.Fatalf("another agent: %+v, %v", got, err)
	}
	if all := allAgentEvents(t, s, "agent-1", 0); len(all) != 4 {
		t.Fatalf("log: %+v", all)
	}
}

// testAgentEventsRetention deletes old events; numbering goes on after
// them, even when an agent's every event went.
func testAgentEventsRetention(t *testing.T, b backend) {
	ctx := context.Background()
	clk := newClock()
	s := open(t, b.newDSN(t), store.Options{Now: clk.Now})
	for range 3 {
		if _, err := s.AppendAgentEvents(ctx, "agent-1", agentEvent("old", "")); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := s.AppendAgentEvents(ctx, "agent-2", agentEvent("old", "")); err != nil {
		t.Fatal(err)
	}
	clk.Advance(time.Hour)
	if _, err := s.AppendAgentEvents(ctx, "agent-1", agentEvent("new", "")); err != nil {
		t.Fatal(err)
	}
	n, err := s.DeleteAgentEventsBefore(ctx, clk.Now().Add(-time.Minute))
	if err != nil || n != 4 {
		t.Fatalf("deleted %d, %v; want 4", n, err)
	}
	if all := allAgentEvents(t, s, "agent-1", 0); len(all) != 1 || all[0].Seq != 4 || all[0].Type != "new" {
		t.Fatalf("agent-1 after retention: %+v", all)
	}
	if all := allAgentEvents(t, s, "agent-2", 0); len(all) != 0 {
		t.Fatalf("agent-2 after retention: %+v", all)
	}
	if got, err := s.AppendAgentEvents(ctx, "agent-2", agentEvent("new", "")); err != nil || got[0].Seq != 2 {
		t.Fatalf("agent-2 numbers on: %+v, %v", got, err)
	}
	if n, err := s.DeleteAgentEventsBefore(ctx, clk.Now().Add(-time.Minute)); err != nil || n != 0 {
		t.Fatalf("second delete: %d, %v", n, err)
	}
}

// testAgentEventsTwoReplicas appends to one agent from two stores on one
// database at once, as the controller and the Compute API replicas do:
// every event gets its own number, with no gap.
func testAgentEventsTwoReplicas(t *testing.T, b backend) {
	ctx := context.Background()
	dsn := b.newDSN(t)
	replicas := []*store.Store{open(t, dsn, store.Options{}), open(t, dsn, store.Options{})}
	const writers, appends = 4, 25
	var wg sync.WaitGroup
	errs := make(chan error, writers*appends)
	for w := range writers {
		wg.Go(func() {
			for i := range appends {
				if _, err := replicas[w%2].AppendAgentEvents(ctx, "agent-1", agentEvent("a", fmt.Sprint(w, i)),
					agentEvent("b", fmt.Sprint(w, i))); err != nil {
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
	evs := allAgentEvents(t, replicas[1], "agent-1", 0)
	if len(evs) != writers*appends*2 {
		t.Fatalf("%d events, want %d", len(evs), writers*appends*2)
	}
	for i, e := range evs {
		if e.Seq != int64(i+1) {
			t.Fatalf("event %d has seq %d", i, e.Seq)
		}
		// Each append's two events are next to each other.
		if i%2 == 1 && (e.Type != "b" || evs[i-1].Type != "a" || e.Data != evs[i-1].Data) {
			t.Fatalf("events %d and %d are from different appends: %+v %+v", i, i+1, evs[i-1], e)
		}
	}
}
