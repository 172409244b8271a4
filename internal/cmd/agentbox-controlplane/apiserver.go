package main

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	stdlog "log"
	"net"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	"github.com/go-logr/logr"
	toolscache "k8s.io/client-go/tools/cache"
	"sigs.k8s.io/controller-runtime/pkg/cache"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
)

// apiServer runs the Compute API as a manager runnable: it starts after the
// manager's caches, stops with the manager, and reports readiness.
//
// The manager does not always wait for it to stop: when the replica loses
// its leader election Lease, controller-runtime sets its graceful shutdown
// timeout to zero, so its stop procedure cancels the runnables from a
// goroutine it does not wait for, and Start returns "leader election lost"
// at once. So the caller also calls drain once the manager has returned,
// and closes what the handlers use only after it.
type apiServer struct {
	addr    string
	handler http.Handler
	getCert func(*tls.ClientHelloInfo) (*tls.Certificate, error)
	cache   cache.Cache
	// sandboxEvents, when set, hears of every Sandbox the cache sees.
	sandboxEvents toolscache.ResourceEventHandler
	log           logr.Logger
	listening     atomic.Bool

	// mu orders Start against drain, so that neither can miss the other:
	// either Start began first and drain stops it and waits for done, or
	// drain came first and Start returns without serving.
	mu       sync.Mutex
	draining bool
	// stop cancels Start's context; nil until Start has begun.
	stop context.CancelFunc
	// done is closed when a Start that began has returned.
	done chan struct{}
}

func newAPIServer(addr string, h http.Handler, getCert func(*tls.ClientHelloInfo) (*tls.Certificate, error), c cache.Cache, log logr.Logger) *apiServer {
	return &apiServer{addr: addr, handler: h, getCert: getCert, cache: c, log: log, done: make(chan struct{})}
}

// NeedLeaderElection is false: every replica serves the API, only the
// leader reconciles.
func (a *apiServer) NeedLeaderElection() bool { return false }

// Start serves until ctx ends or drain is called, then drains calls in
// flight for up to shutdownGrace.
func (a *apiServer) Start(ctx context.Context) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	a.mu.Lock()
	if a.draining || a.stop != nil {
		a.mu.Unlock()
		return nil
	}
	a.stop = cancel
	a.mu.Unlock()
	defer close(a.done)
	// Before the first call, the Sandbox informer must have synced: on an
	// empty cache every agent would get sandbox_not_found.
	inf, err := a.cache.GetInformer(ctx, &v1alpha1.Sandbox{})
	if err != nil {
		return fmt.Errorf("start the Sandbox informer: %w", err)
	}
	if a.sandboxEvents != nil {
		if _, err := inf.AddEventHandler(a.sandboxEvents); err != nil {
			return fmt.Errorf("watch Sandboxes for the Compute API: %w", err)
		}
	}
	if !a.cache.WaitForCacheSync(ctx) {
		if ctx.Err() != nil {
			return nil
		}
		return errors.New("caches did not sync")
	}
	ln, err := net.Listen("tcp", a.addr)
	if err != nil {
		return fmt.Errorf("listen for the Compute API: %w", err)
	}
	srv := &http.Server{
		Handler: a.handler,
		TLSConfig: &tls.Config{
			MinVersion:     tls.VersionTLS12,
			GetCertificate: a.getCert,
		},
		ReadHeaderTimeout: 10 * time.Second,
		// No write timeout: a response is written when the command ends,
		// and commands may run for minutes; the handler bounds each call.
		IdleTimeout: 2 * time.Minute,
		ErrorLog:    stdlog.New(logWriter{a.log}, "", 0),
	}
	errc := make(chan error, 1)
	go func() { errc <- srv.ServeTLS(ln, "", "") }()
	a.listening.Store(true)
	a.log.Info("serving the Compute API", "addr", ln.Addr().String())

	select {
	case err := <-errc:
		a.listening.Store(false)
		return fmt.Errorf("serve the Compute API: %w", err)
	case <-ctx.Done():
	}
	// Unready first, so that load balancers stop sending new calls while
	// the ones in flight finish. Shutdown closes the listener at once, so
	// new connections are refused rather than cut later.
	a.listening.Store(false)
	a.log.Info("stopping the Compute API: no new calls, draining the calls in flight", "graceSeconds", shutdownGrace.Seconds())
	began := time.Now()
	shutdownCtx, cancelShutdown := context.WithTimeout(context.Background(), shutdownGrace)
	defer cancelShutdown()
	if err := srv.Shutdown(shutdownCtx); err != nil {
		a.log.Info("calls still running after the grace period; closing them", "error", err.Error())
		_ = srv.Close()
		return nil
	}
	a.log.Info("drained the Compute API: every call in flight was answered", "seconds", roundSeconds(time.Since(began)))
	return nil
}

// drain stops the server, if the manager has not already, and waits up to
// bound for Start to return, that is for the calls in flight to be
// answered (or cut at shutdownGrace). It returns at once if Start never
// began (the manager failed before starting it), and a Start the manager
// begins after drain returns without serving. started is whether Start
// had begun; finished is false if bound ran out first.
func (a *apiServer) drain(bound time.Duration) (started, finished bool) {
	a.mu.Lock()
	a.draining = true
	stop := a.stop
	a.mu.Unlock()
	if stop == nil {
		return false, true
	}
	stop()
	t := time.NewTimer(bound)
	defer t.Stop()
	select {
	case <-a.done:
		return true, true
	case <-t.C:
		return true, false
	}
}

// roundSeconds is d in seconds to a tenth, for logs.
func roundSeconds(d time.Duration) float64 {
	return d.Round(100 * time.Millisecond).Seconds()
}

// readyCheck is the /readyz check: ready once the caches have synced and
// the API listens.
func (a *apiServer) readyCheck(*http.Request) error {
	if !a.listening.Load() {
		return errors.New("the Compute API is not serving yet")
	}
	return nil
}
