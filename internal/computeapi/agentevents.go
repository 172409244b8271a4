package computeapi

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"sync"
	"time"

	"github.com/go-logr/logr"

	api "github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
	"github.com/agentbox/terraform-provider-agentbox/internal/redact"
	"github.com/agentbox/terraform-provider-agentbox/internal/store"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"
)

// An agent's events: the life of its sandbox as it happens. The sandbox
// controller (on the leader) and the Compute API (on every replica)
// record them through an AgentEvents in the shared store, which numbers
// each agent's log; GET /v1/agents/{id}/events streams the log as
// Server-Sent Events, as a run's events are streamed.
//
// The controller hands its events to AgentEvents in process rather than
// the Compute API reading the Kubernetes Events it records: the event
// recorder aggregates repeated events and may drop them under load, and
// Events are kept for an hour only, so they could not be a log a follower
// resumes in without loss. In process, an event reaches the store as soon
// as it is recorded, and wakes the streams on the leader's replica at
// once; the other replicas find it at their next poll.

const (
	// agentEventQueue bounds the events waiting to be written: past it
	// (the store down for long), new events are dropped and counted.
	agentEventQueue = 10000
	// agentEventRetries is how many times a failed write is tried again
	// before its events are dropped.
	agentEventRetries = 5
)

// AgentEvents records agents' events in the store, in the order they are
// recorded, and wakes the agents' streams on this replica. Record does not
// wait for the store: a reconcile or a command call is not slowed by it.
type AgentEvents struct {
	st    *store.Store
	log   logr.Logger
	notes notifier

	mu      sync.Mutex
	queue   []agentEventEntry
	dropped int
	kick    chan struct{}
	stop    chan struct{}
	done    chan struct{}
	once    sync.Once
}

type agentEventEntry struct {
	key string
	ev  api.AgentEvent
}

// NewAgentEvents returns an AgentEvents that writes to st, started; Close
// it after its last Record.
func NewAgentEvents(st *store.Store, log logr.Logger) *AgentEvents {
	if log.GetSink() == nil {
		log = logr.Discard()
	}
	a := &AgentEvents{st: st, log: log, kick: make(chan struct{}, 1), stop: make(chan struct{}), done: make(chan struct{})}
	go a.writeLoop()
	return a
}

// Record records ev, an event of agent ev.Agent, at ev.Time (now when
// zero). An event without an agent (a warm sandbox's) is not recorded.
func (a *AgentEvents) Record(ev api.AgentEvent) { a.RecordOnce("", ev) }

// RecordOnce is Record for an event the caller may see more than once:
// the agent's log takes key once.
func (a *AgentEvents) RecordOnce(key string, ev api.AgentEvent) {
	if a == nil || ev.Agent == "" || ev.Type == "" {
		return
	}
	if ev.Time.IsZero() {
		ev.Time = time.Now()
	}
	a.mu.Lock()
	if len(a.queue) >= agentEventQueue {
		a.dropped++
		a.mu.Unlock()
		metricAgentEventsDropped.Inc()
		return
	}
	a.queue = append(a.queue, agentEventEntry{key: key, ev: ev})
	a.mu.Unlock()
	select {
	case a.kick <- struct{}{}:
	default:
	}
}

// Close writes what is queued (for a few seconds at most) and stops.
func (a *AgentEvents) Close() {
	if a == nil {
		return
	}
	a.once.Do(func() {
		close(a.stop)
		<-a.done
	})
}

func (a *AgentEvents) writeLoop() {
	defer close(a.done)
	for {
		select {
		case <-a.kick:
			a.flush(false)
		case <-a.stop:
			a.flush(true)
			return
		}
	}
}

// flush writes the queue, each agent's events in one append, in order.
// A write that fails is tried again a few times, the queue growing
// meanwhile, then dropped; closing tries once.
func (a *AgentEvents) flush(closing bool) {
	a.mu.Lock()
	batch := a.queue
	a.queue = nil
	if a.dropped > 0 {
		a.log.Error(nil, "agent event queue full; events dropped", "dropped", a.dropped)
		a.dropped = 0
	}
	a.mu.Unlock()
	var agents []string
	byAgent := map[string][]store.AgentEvent{}
	for _, e := range batch {
		se, err := storeAgentEvent(e.key, e.ev)
		if err != nil {
			a.log.Error(err, "encode agent event", "agent", e.ev.Agent, "type", e.ev.Type)
			continue
		}
		if byAgent[e.ev.Agent] == nil {
			agents = append(agents, e.ev.Agent)
		}
		byAgent[e.ev.Agent] = append(byAgent[e.ev.Agent], se)
	}
	for _, agent := range agents {
		evs := byAgent[agent]
		for start := 0; start < len(evs); start += store.MaxAgentEventsAppend {
			a.append(agent, evs[start:min(start+store.MaxAgentEventsAppend, len(evs))], closing)
		}
		a.notes.notify(agent)
	}
}

func (a *AgentEvents) append(agent string, evs []store.AgentEvent, closing bool) {
	wait := 50 * time.Millisecond
	for try := 0; ; try++ {
		ctx, cancel := context.WithTimeout(context.Background(), runStoreTimeout)
		_, err := a.st.AppendAgentEvents(ctx, agent, evs...)
		cancel()
		switch {
		case err == nil:
			return
		case errors.Is(err, store.ErrInvalid) || closing || try >= agentEventRetries:
			metricAgentEventsDropped.Add(float64(len(evs)))
			a.log.Error(err, "record agent events; dropped", "agent", agent, "events", len(evs))
			return
		}
		a.log.Error(err, "record agent events; retrying", "agent", agent, "events", len(evs))
		select {
		case <-time.After(wait):
		case <-a.stop:
		}
		wait *= 2
	}
}

// storeAgentEvent is ev as the store keeps it: the fields of its type
// are its data.
func storeAgentEvent(key string, ev api.AgentEvent) (store.AgentEvent, error) {
	data := ev
	data.ID, data.Type, data.Time, data.Agent, data.Namespace, data.Sandbox = 0, "", time.Time{}, "", "", ""
	b, err := json.Marshal(data)
	if err != nil {
		return store.AgentEvent{}, err
	}
	var fields map[string]json.RawMessage
	if err := json.Unmarshal(b, &fields); err != nil {
		return store.AgentEvent{}, err
	}
	for _, k := range []string{"id", "type", "time", "agent"} {
		delete(fields, k)
	}
	b, err = json.Marshal(fields)
	if err != nil {
		return store.AgentEvent{}, err
	}
	return store.AgentEvent{Type: ev.Type, Namespace: ev.Namespace, Sandbox: ev.Sandbox, Data: string(b),
		At: ev.Time, SourceKey: key}, nil
}

// wireAgentEvent is a stored event as the API sends it.
func wireAgentEvent(e store.AgentEvent) (api.AgentEvent, error) {
	var out api.AgentEvent
	if err := json.Unmarshal([]byte(e.Data), &out); err != nil {
		return api.AgentEvent{}, fmt.Errorf("agent %s event %d: %w", e.AgentID, e.Seq, err)
	}
	out.ID, out.Type, out.Time, out.Agent, out.Namespace, out.Sandbox = e.Seq, e.Type, e.At, e.AgentID, e.Namespace, e.Sandbox
	return out, nil
}

// agentEventStream streams an agent's events after the one the follower
// names (see eventsAfter), live, for as long as the follower stays. It
// reads the store only: following an agent never wakes its sandbox.
func (s *Server) agentEventStream(w http.ResponseWriter, r *http.Request) {
	agentID := r.PathValue("agent_id")
	if apiErr := s.authorize(r, agentID); apiErr != nil {
		writeError(w, apiErr)
		return
	}
	noteAuditAgent(r.Context(), agentID)
	if s.store == nil {
		writeError(w, api.Errorf(api.CodeUnavailable, "the control plane runs without a store, which agent events are recorded in"))
		return
	}
	after, apiErr := eventsAfter(r)
	if apiErr != nil {
		writeError(w, apiErr)
		return
	}
	woken, unsubscribe := s.agentEvents.notes.subscribe(agentID)
	defer unsubscribe()
	metricAgentEventStreams.Inc()
	defer metricAgentEventStreams.Dec()
	s.serveEventStream(w, r, eventLog{
		log:   s.callLog(r, "agent events").WithValues("agent", agentID),
		woken: woken,
		page:  store.MaxAgentEventsPage,
		read: func(ctx context.Context, after int64) ([]sseEvent, error) {
			evs, err := s.store.ListAgentEvents(ctx, agentID, after, store.MaxAgentEventsPage)
			if err != nil {
				return nil, err
			}
			out := make([]sseEvent, len(evs))
			for i, e := range evs {
				ev, err := wireAgentEvent(e)
				if err != nil {
					return nil, err
				}
				out[i] = sseEvent{id: e.Seq, typ: e.Type, data: ev}
			}
			return out, nil
		},
	}, after)
}

// commandEvents records that a command started in sb, and returns what
// records its end: with the supervisor's result, or the call's failure.
// runID names the run whose attempt the command is, if it is one's.
func (s *Server) commandEvents(namespace, sandbox, agentID string, argv []string, runID string) func(*supervisorapi.CommandResult, error) {
	if s.agentEvents == nil {
		return func(*supervisorapi.CommandResult, error) {}
	}
	start := time.Now()
	id := newCommandID()
	cmd := make([]string, len(argv))
	for i, a := range argv {
		cmd[i] = redact.String(a)
	}
	s.agentEvents.Record(api.AgentEvent{Type: api.AgentEventCommandStarted, Time: start, Agent: agentID,
		Namespace: namespace, Sandbox: sandbox, CommandID: id, Command: cmd, RunID: runID})
	return func(res *supervisorapi.CommandResult, err error) {
		end := time.Now()
		ev := api.AgentEvent{Type: api.AgentEventCommandEnded, Time: end, Agent: agentID, Namespace: namespace,
			Sandbox: sandbox, CommandID: id, RunID: runID, DurationMS: end.Sub(start).Milliseconds()}
		switch {
		case err != nil:
			ev.Error = string(supervisorError(context.Background(), err).Code)
		case res != nil:
			ev.TimedOut, ev.Signal = res.TimedOut, res.Signal
			if !res.TimedOut && res.Signal == "" {
				code := res.ExitCode
				ev.ExitCode = &code
			}
		}
		s.agentEvents.Record(ev)
	}
}

// newCommandID pairs a command's started and ended events.
func newCommandID() string {
	var b [8]byte
	_, _ = rand.Read(b[:]) // crypto/rand.Read never fails on Linux
	return hex.EncodeToString(b[:])
}

// pruneAgentEvents deletes the agents' events older than RunRetention:
// they are kept as long as runs are. Without a retention it deletes
// nothing.
func (s *Server) pruneAgentEvents(now time.Time, log logr.Logger) {
	if s.runRetention <= 0 {
		return
	}
	ctx, done := context.WithTimeout(context.Background(), runStoreTimeout)
	n, err := s.store.DeleteAgentEventsBefore(ctx, now.Add(-s.runRetention))
	done()
	switch {
	case err != nil:
		log.Error(err, "delete expired agent events")
	case n > 0:
		log.Info("deleted agent events past the run retention", "events", n, "retention", s.runRetention.String())
	}
}
