package computeapi

import (
	"context"
	"sync"
	"sync/atomic"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	toolscache "k8s.io/client-go/tools/cache"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
)

// warmKeepAlive is how often a kept connection is used, so that neither
// end closes it as idle: the transport drops an idle connection after 90 s
// (supervisorapi.NewHTTPClient), the supervisor after 2 minutes.
const warmKeepAlive = time.Minute

// warmConns keeps a verified connection open to every ready, free sandbox
// of a warm pool, so that the first call of a pool lease's holder finds
// one. Opened at claim time instead (warmConnection), the handshake with
// a pod the control plane had not talked to yet was on the holder's first
// call in make bench's claim loop. The connections are opened and kept
// one at a time, off the claim path: a pool of n sandboxes costs one
// health call per sandbox a minute, and n idle connections.
type warmConns struct {
	mu sync.Mutex
	// free holds, by sandbox, the sandbox as last seen ready and free,
	// and when its connection is next due a call.
	free map[types.NamespacedName]*warmConn
	kick chan struct{}
	stop chan struct{}
	once sync.Once
	// running is the keeper; it is not part of Server.background, which
	// waits for the work of calls only.
	running sync.WaitGroup
	// period is warmKeepAlive, as a time.Duration, but in tests.
	period atomic.Int64
}

type warmConn struct {
	sb  *v1alpha1.Sandbox
	due time.Time
	// open is when a call over the connection last succeeded; zero
	// before the first.
	open time.Time
}

func newWarmConns() *warmConns {
	c := &warmConns{free: map[types.NamespacedName]*warmConn{}, kick: make(chan struct{}, 1), stop: make(chan struct{})}
	c.period.Store(int64(warmKeepAlive))
	return c
}

// WarmPoolEvents returns the handler the control plane adds to its Sandbox
// informer, through which the API learns of the warm sandboxes to keep a
// connection open to. The first call starts the keeper; Close stops it.
func (s *Server) WarmPoolEvents() toolscache.ResourceEventHandler {
	s.conns.once.Do(func() {
		s.conns.running.Add(1)
		go func() {
			defer s.conns.running.Done()
			s.keepWarmConnections()
		}()
	})
	return toolscache.ResourceEventHandlerFuncs{
		AddFunc:    func(obj any) { s.observeSandbox(obj) },
		UpdateFunc: func(_, obj any) { s.observeSandbox(obj) },
		DeleteFunc: func(obj any) {
			if d, ok := obj.(toolscache.DeletedFinalStateUnknown); ok {
				obj = d.Obj
			}
			if sb, ok := obj.(*v1alpha1.Sandbox); ok {
				s.conns.forget(client.ObjectKeyFromObject(sb))
			}
		},
	}
}

// observeSandbox tracks sb while it is a ready, free sandbox of a warm
// pool, and forgets it otherwise.
func (s *Server) observeSandbox(obj any) {
	sb, ok := obj.(*v1alpha1.Sandbox)
	if !ok {
		return
	}
	key := client.ObjectKeyFromObject(sb)
	owner := metav1.GetControllerOf(sb)
	if owner == nil || owner.Kind != "SandboxWarmPool" || !takeable(sb) || sb.Status.ServiceEndpoint == "" {
		s.conns.forget(key)
		return
	}
	c := s.conns
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

func (c *warmConns) keepAlive() time.Duration { return time.Duration(c.period.Load()) }

func (c *warmConns) forget(key types.NamespacedName) {
	c.mu.Lock()
	delete(c.free, key)
	c.mu.Unlock()
}

func (c *warmConns) wake() {
	select {
	case c.kick <- struct{}{}:
	default:
	}
}

// isOpen reports whether the connection to the sandbox of key was used
// within the keep-alive period, so that it is still open.
func (c *warmConns) isOpen(key types.NamespacedName, now time.Time) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	e := c.free[key]
	return e != nil && !e.open.IsZero() && now.Sub(e.open) < c.keepAlive()
}

// close stops the keeper; the connections close with the supervisor pool.
func (c *warmConns) close() {
	close(c.stop)
	c.running.Wait()
}

// keepWarmConnections opens and keeps the connections, one call at a
// time, until close.
func (s *Server) keepWarmConnections() {
	c := s.conns
	timer := time.NewTimer(c.keepAlive())
	defer timer.Stop()
	for {
		select {
		case <-c.stop:
			return
		case <-c.kick:
		case <-timer.C:
		}
		next := s.callDueConnections()
		if !timer.Stop() {
			select {
			case <-timer.C:
			default:
			}
		}
		timer.Reset(next)
	}
}

// callDueConnections makes a health call over the connection of every
// tracked sandbox that is due one, and returns how long until the next is
// due.
func (s *Server) callDueConnections() time.Duration {
	c := s.conns
	for {
		now := time.Now()
		c.mu.Lock()
		var due *warmConn
		next := c.keepAlive()
		for _, e := range c.free {
			if wait := e.due.Sub(now); wait <= 0 {
				due = e
				break
			} else if wait < next {
				next = wait
			}
		}
		var sb *v1alpha1.Sandbox
		if due != nil {
			// Due again in a minute whatever the outcome: a sandbox that
			// does not answer is left to its first caller, not retried in
			// a loop.
			due.due = now.Add(c.keepAlive())
			sb = due.sb
		}
		c.mu.Unlock()
		if sb == nil {
			return next
		}
		select {
		case <-c.stop:
			return c.keepAlive()
		default:
		}
		// Registered as a warm-up, so that a lease taking the sandbox
		// meanwhile waits for this handshake instead of making a second
		// one (warmConnection, awaitWarmConnection).
		key := client.ObjectKeyFromObject(sb)
		done := make(chan struct{})
		if _, busy := s.warming.LoadOrStore(key, done); busy {
			continue
		}
		ok := s.callHealth(sb)
		s.warming.Delete(key)
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

// callHealth makes a health call to sb's supervisor over a pooled
// connection, opening one if there is none, and reports whether it
// succeeded.
func (s *Server) callHealth(sb *v1alpha1.Sandbox) bool {
	sup, err := s.dialSupervisor(sb)
	if err != nil {
		return false
	}
	ctx, cancel := context.WithTimeout(context.Background(), warmConnectionTimeout)
	defer cancel()
	if _, err := sup.Health(ctx); err != nil {
		s.log.V(1).Info("could not open a connection to a warm sandbox",
			"sandbox", sb.Namespace+"/"+sb.Name, "error", err.Error())
		return false
	}
	return true
}
