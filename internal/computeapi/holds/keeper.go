// Package holds decides who may use a sandbox, and writes it down on the
// sandbox's activity clock, the Kubernetes Lease that also records when
// the sandbox was last used:
//
//   - a hold is an agent's exclusive hold on its own sandbox, acquired,
//     heartbeaten and released through the API (the wire calls it a
//     lease: the agent "lease" paths, Agentbox-Lease-Id, lease_held);
//   - a pool lease takes a ready sandbox from a warm pool for one run; the
//     store decides who gets which sandbox, and the take becomes a hold;
//   - the activity clock moves as calls use a sandbox (ActivityClock).
//
// The Compute API's handlers decode and answer; a Keeper does the rest.
package holds

import (
	"context"
	"sync"
	"sync/atomic"
	"time"

	"github.com/go-logr/logr"
	"k8s.io/utils/clock"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/agentbox/terraform-provider-agentbox/internal/store"
)

// WriteTimeout bounds one write of the API to the Kubernetes API server
// (a renewal, a hold, a pool lease's settle): a slow API server must not
// hold up the agent's call for long, and a lost renewal is retried on a
// later call.
const WriteTimeout = 5 * time.Second

// Config is what a Keeper works with.
type Config struct {
	// Sandboxes finds Sandboxes, warm pools and templates; in the control
	// plane it is the manager's cache.
	Sandboxes client.Reader
	// Writer writes Leases and Sandboxes, and its reads are a hold call's
	// first look at the Lease (the manager's client: writes go to the API
	// server, reads come from the cache).
	Writer client.Client
	// Reader reads directly, for the retries of a hold call whose first
	// read, through Writer, was stale or missed.
	Reader client.Reader
	// Store decides pool leases and keeps the history of holds; without
	// it pool leases are refused and no history is kept.
	Store *store.Store
	// Activity is the activity clock that hold writes move.
	Activity *ActivityClock
	Clock    clock.PassiveClock
	Log      logr.Logger
	// OnColdStart is called for each sandbox a pool lease creates; it may
	// be nil.
	OnColdStart func()
}

// Keeper keeps the holds and pool leases of the sandboxes.
type Keeper struct {
	sandboxes   client.Reader
	writer      client.Client
	reader      client.Reader
	store       *store.Store
	activity    *ActivityClock
	clock       clock.PassiveClock
	log         logr.Logger
	onColdStart func()

	// poolTakes are the pool sandboxes this replica is taking.
	poolTakes poolTakes
	// poolWaiters queues the pool leases waiting for a ready sandbox.
	poolWaiters poolWaiters
	// settleSlots bounds the pool leases being settled, and claiming
	// counts those being decided; see settleSoon.
	settleSlots chan struct{}
	claiming    atomic.Int32
	// grace is settleGrace, as a time.Duration, but in tests.
	grace atomic.Int64
	// settles holds the settles running in the background; Drain waits
	// for them.
	settles sync.WaitGroup
}

// New returns a Keeper working with cfg.
func New(cfg Config) *Keeper {
	k := &Keeper{
		sandboxes: cfg.Sandboxes, writer: cfg.Writer, reader: cfg.Reader, store: cfg.Store,
		activity: cfg.Activity, clock: cfg.Clock, log: cfg.Log, onColdStart: cfg.OnColdStart,
		settleSlots: make(chan struct{}, maxSettles),
	}
	k.grace.Store(int64(settleGrace))
	if k.reader == nil {
		k.reader = cfg.Writer
	}
	if k.onColdStart == nil {
		k.onColdStart = func() {}
	}
	return k
}

// SetSettleGrace changes how long a settle waits before it starts (see
// settleGrace); tests lengthen it.
func (k *Keeper) SetSettleGrace(d time.Duration) { k.grace.Store(int64(d)) }

// Drain waits for the pool leases being settled in the background.
func (k *Keeper) Drain() { k.settles.Wait() }

// PauseSettles keeps the Keeper from writing pool leases into their
// sandboxes in the background until resume is called, as if the API
// server were slow or the replica had died after answering. Tests use
// it.
func (k *Keeper) PauseSettles() (resume func()) {
	for range maxSettles {
		k.settleSlots <- struct{}{}
	}
	return func() {
		for range maxSettles {
			<-k.settleSlots
		}
	}
}

// writeContext is ctx for one write: not cut short when the client hangs
// up (the write would then land or not at random, and the caller retries
// anyway), and bounded by WriteTimeout.
func writeContext(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(context.WithoutCancel(ctx), WriteTimeout)
}
