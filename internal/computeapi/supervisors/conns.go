package supervisors

import (
	"context"
	"sync"
	"sync/atomic"
	"time"

	"github.com/go-logr/logr"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	toolscache "k8s.io/client-go/tools/cache"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	"github.com/agentbox/terraform-provider-agentbox/internal/pki"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"
)

// warmKeepAlive is how often a kept connection is used, so that neither
// end closes it as idle: the transport drops an idle connection after 90 s
// (supervisorapi.NewHTTPClient), the supervisor after 2 minutes.
const warmKeepAlive = time.Minute

// warmConnectionTimeout bounds a warm-up: a handshake takes tens of
// milliseconds, and one that takes longer is left to the first call.
const warmConnectionTimeout = 5 * time.Second

// maxWarmConnections bounds the warm-ups of Warm in flight. In a burst of
// claims, handshakes for all of them at once competed with the pool
// leases' writes for the control plane's CPU and halved the claims per
// second (106/s to 51/s in make bench on 2 cores); past the bound, a
// claim leaves the handshake to its first call, as before.
const maxWarmConnections = 2

// Conns is how the API's calls reach a sandbox's supervisor: For gives
// the client of the supervisor that proves the sandbox's identity, over
// the Dialer's pooled connections.
//
// It also keeps a verified connection open to every ready, free sandbox
// of a warm pool (PoolEvents), so that the first call of a pool lease's
// holder finds one. Opened at claim time instead (Warm), the handshake
// with a pod the control plane had not talked to yet was on the holder's
// first call in make bench's claim loop. The connections are opened and
// kept one at a time, off the claim path: a pool of n sandboxes costs one
// health call per sandbox a minute, and n idle connections.
type Conns struct {
	dialer      Dialer
	trustDomain string
	log         logr.Logger

	// slots bounds the warm-ups of Warm in flight.
	slots chan struct{}
	// warming holds, by sandbox, a channel closed when the warm-up of its
	// connection ends; see AwaitWarm.
	warming sync.Map
	// background holds the warm-ups of Warm; Close waits for them.
	background sync.WaitGroup

	mu sync.Mutex
	// free holds, by sandbox, the sandbox as last seen ready and free,
	// and when its connection is next due a call.
	free map[types.NamespacedName]*warmConn
	kick chan struct{}
	stop chan struct{}
	once sync.Once
	// running is the keeper.
	running sync.WaitGroup
	// period is warmKeepAlive, as a time.Duration, but in tests.
	period atomic.Int64
	// onHealth, when set, is given every health answer of a warm
	// sandbox's supervisor (OnHealth).
	onHealth atomic.Pointer[func(*v1alpha1.Sandbox, *supervisorapi.Health)]
}

type warmConn struct {
	sb  *v1alpha1.Sandbox
	due time.Time
	// open is when a call over the connection last succeeded; zero
	// before the first.
	open time.Time
}

// NewConns returns the connections of an API whose sandboxes' supervisors
// prove SPIFFE IDs of trustDomain.
func NewConns(dialer Dialer, trustDomain string, log logr.Logger) *Conns {
	c := &Conns{
		dialer: dialer, trustDomain: trustDomain, log: log,
		slots: make(chan struct{}, maxWarmConnections),
		free:  map[types.NamespacedName]*warmConn{}, kick: make(chan struct{}, 1), stop: make(chan struct{}),
	}
	c.period.Store(int64(warmKeepAlive))
	return c
}

// For returns the client of sb's supervisor, which must prove the
// identity of the workload named in sb's status. Only the controller
// writes status (clients have no RBAC on it), so the name can be trusted
// as the identity to verify.
func (c *Conns) For(sb *v1alpha1.Sandbox) (*supervisorapi.Client, error) {
	return c.dialer.Supervisor(sb.Status.ServiceEndpoint, pki.SandboxID(c.trustDomain, sb.Namespace, sb.WorkloadName()).String())
}

// Warm opens the verified connection to a sandbox just taken from a warm
// pool while its pool lease is being written, so that the holder's first
// call does not wait for a TLS handshake with a pod the control plane has
// not talked to yet. It is the fallback of PoolEvents' keeper, which
// usually has that connection open already (and then nothing is done).
// Failing, or skipping because maxWarmConnections are in flight, only
// means the first call dials for itself.
func (c *Conns) Warm(sb *v1alpha1.Sandbox) {
	key := client.ObjectKeyFromObject(sb)
	if sb.Status.ServiceEndpoint == "" || c.IsOpen(key, time.Now()) {
		return
	}
	select {
	case c.slots <- struct{}{}:
	default:
		return
	}
	done := make(chan struct{})
	if _, busy := c.warming.LoadOrStore(key, done); busy {
		// The keeper is opening it right now; the first call waits for
		// that one.
		<-c.slots
		return
	}
	c.background.Go(func() {
		defer func() {
			c.warming.Delete(key)
			close(done)
			<-c.slots
		}()
		c.callHealth(sb)
	})
}

// AwaitWarm waits for a warm-up of sb's connection still in flight, for
// at most as long as the warm-up may take. The holder's first call
// usually comes while the pool lease's warm-up is still in its handshake;
// without waiting, the call would dial a second connection alongside, and
// the two handshakes would share the same few cores with each other.
func (c *Conns) AwaitWarm(ctx context.Context, sb *v1alpha1.Sandbox) {
	v, ok := c.warming.Load(client.ObjectKeyFromObject(sb))
	if !ok {
		return
	}
	select {
	case <-v.(chan struct{}):
	case <-ctx.Done():
	}
}

// PoolEvents returns the handler the control plane adds to its Sandbox
// informer, through which the API learns of the warm sandboxes to keep a
// connection open to: those of a warm pool that free reports ready and
// free. The first call starts the keeper; Close stops it.
func (c *Conns) PoolEvents(free func(*v1alpha1.Sandbox) bool) toolscache.ResourceEventHandler {
	c.once.Do(func() {
		c.running.Add(1)
		go func() {
			defer c.running.Done()
			c.keep()
		}()
	})
	observe := func(obj any) {
		if sb, ok := obj.(*v1alpha1.Sandbox); ok {
			c.observe(sb, free)
		}
	}
	return toolscache.ResourceEventHandlerFuncs{
		AddFunc:    observe,
		UpdateFunc: func(_, obj any) { observe(obj) },
		DeleteFunc: func(obj any) {
			if d, ok := obj.(toolscache.DeletedFinalStateUnknown); ok {
				obj = d.Obj
			}
			if sb, ok := obj.(*v1alpha1.Sandbox); ok {
				c.forget(client.ObjectKeyFromObject(sb))
			}
		},
	}
}

// observe tracks sb while it is a ready, free sandbox of a warm pool, and
// forgets it otherwise.
func (c *Conns) observe(sb *v1alpha1.Sandbox, free func(*v1alpha1.Sandbox) bool) {
	key := client.ObjectKeyFromObject(sb)
	owner := metav1.GetControllerOf(sb)
	if owner == nil || owner.Kind != "SandboxWarmPool" || !free(sb) || sb.Status.ServiceEndpoint == "" {
		c.forget(key)
		return
	}
	c.mu.Lock()
	e := c.free[key]
	if e == nil || e.sb.Status.ServiceEndpoint != sb.Status.ServiceEndpoint || e.sb.UID != sb.UID {
		// New, or another pod behind the name: its connection is due now.
		c.free[key] = &warmConn{sb: sb}
	} else {
		e.sb = sb
	}
	c.mu.Unlock()
	c.wake()
}

func (c *Conns) keepAlive() time.Duration { return time.Duration(c.period.Load()) }

// SetKeepAlive changes how often a kept connection is used; tests shorten
// it.
func (c *Conns) SetKeepAlive(d time.Duration) { c.period.Store(int64(d)) }

func (c *Conns) forget(key types.NamespacedName) {
	c.mu.Lock()
	delete(c.free, key)
	c.mu.Unlock()
}

func (c *Conns) wake() {
	select {
	case c.kick <- struct{}{}:
	default:
	}
}

// IsOpen reports whether the kept connection to the sandbox of key was
// used within the keep-alive period, so that it is still open.
func (c *Conns) IsOpen(key types.NamespacedName, now time.Time) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	e := c.free[key]
	return e != nil && !e.open.IsZero() && now.Sub(e.open) < c.keepAlive()
}

// WaitWarmUps waits for the warm-ups Warm started.
func (c *Conns) WaitWarmUps() { c.background.Wait() }

// Close stops the keeper and waits for the warm-ups in flight; the
// connections close with the Dialer.
func (c *Conns) Close() {
	close(c.stop)
	c.running.Wait()
	c.background.Wait()
}

// keep opens and keeps the connections, one call at a time, until Close.
func (c *Conns) keep() {
	timer := time.NewTimer(c.keepAlive())
	defer timer.Stop()
	for {
		select {
		case <-c.stop:
			return
		case <-c.kick:
		case <-timer.C:
		}
		next := c.callDue()
		if !timer.Stop() {
			select {
			case <-timer.C:
			default:
			}
		}
		timer.Reset(next)
	}
}

// callDue makes a health call over the connection of every tracked
// sandbox that is due one, and returns how long until the next is due.
func (c *Conns) callDue() time.Duration {
	for {
		due, sb, next := c.nextDue(time.Now())
		if sb == nil {
			return next
		}
		select {
		case <-c.stop:
			return c.keepAlive()
		default:
		}
		// Registered as a warm-up, so that a pool lease taking the
		// sandbox meanwhile waits for this handshake instead of making a
		// second one (Warm, AwaitWarm).
		key := client.ObjectKeyFromObject(sb)
		done := make(chan struct{})
		if _, busy := c.warming.LoadOrStore(key, done); busy {
			continue
		}
		ok := c.callHealth(sb)
		c.warming.Delete(key)
		close(done)
		if ok {
			c.mu.Lock()
			if e := c.free[key]; e == due {
				e.open = time.Now()
			}
			c.mu.Unlock()
		}
	}
}

// nextDue picks a tracked connection that is due a call at now, with its
// sandbox, and marks it due again a keep-alive period later; with none
// due, it returns how long until the next is.
func (c *Conns) nextDue(now time.Time) (*warmConn, *v1alpha1.Sandbox, time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	next := c.keepAlive()
	for _, e := range c.free {
		if wait := e.due.Sub(now); wait <= 0 {
			// Due again in a minute whatever the outcome: a sandbox that
			// does not answer is left to its first caller, not retried in
			// a loop.
			e.due = now.Add(c.keepAlive())
			return e, e.sb, next
		} else if wait < next {
			next = wait
		}
	}
	return nil, nil, next
}

// OnHealth has fn given the answer of every health call made to keep or
// open a warm sandbox's connection, with the sandbox as last seen. The
// answer lists the supervisor's cached environments, so the calls the
// connections need anyway tell of environments evicted since (the
// supervisor's time-to-live sweep, its count and size limits) at no cost
// of their own. fn runs on the keeper's goroutine: it must be bounded.
func (c *Conns) OnHealth(fn func(*v1alpha1.Sandbox, *supervisorapi.Health)) {
	c.onHealth.Store(&fn)
}

// callHealth makes a health call to sb's supervisor over a pooled
// connection, opening one if there is none, and reports whether it
// succeeded.
func (c *Conns) callHealth(sb *v1alpha1.Sandbox) bool {
	sup, err := c.For(sb)
	if err != nil {
		return false
	}
	ctx, cancel := context.WithTimeout(context.Background(), warmConnectionTimeout)
	defer cancel()
	h, err := sup.Health(ctx)
	if err != nil {
		c.log.V(1).Info("could not open a connection to a warm sandbox",
			"sandbox", sb.Namespace+"/"+sb.Name, "error", err.Error())
		return false
	}
	if fn := c.onHealth.Load(); fn != nil && *fn != nil {
		(*fn)(sb, h)
	}
	return true
}
