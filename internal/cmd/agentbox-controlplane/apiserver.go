package main

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	stdlog "log"
	"net"
	"net/http"
	"sync/atomic"
	"time"

	"github.com/go-logr/logr"
	toolscache "k8s.io/client-go/tools/cache"
	"sigs.k8s.io/controller-runtime/pkg/cache"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
)

// apiServer runs the Compute API as a manager runnable: it starts after the
// manager's caches, stops with the manager, and reports readiness.
type apiServer struct {
	addr    string
	handler http.Handler
	getCert func(*tls.ClientHelloInfo) (*tls.Certificate, error)
	cache   cache.Cache
	// sandboxEvents, when set, hears of every Sandbox the cache sees.
	sandboxEvents toolscache.ResourceEventHandler
	log           logr.Logger
	listening     atomic.Bool
}

func newAPIServer(addr string, h http.Handler, getCert func(*tls.ClientHelloInfo) (*tls.Certificate, error), c cache.Cache, log logr.Logger) *apiServer {
	return &apiServer{addr: addr, handler: h, getCert: getCert, cache: c, log: log}
}

// NeedLeaderElection is false: every replica serves the API, only the
// leader reconciles.
func (a *apiServer) NeedLeaderElection() bool { return false }

// Start serves until ctx ends, then drains calls in flight for up to
// shutdownGrace.
func (a *apiServer) Start(ctx context.Context) error {
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
	// the ones in flight finish.
	a.listening.Store(false)
	shutdownCtx, cancel := context.WithTimeout(context.Background(), shutdownGrace)
	defer cancel()
	if err := srv.Shutdown(shutdownCtx); err != nil {
		a.log.Info("calls still running after the grace period; closing them", "error", err.Error())
		_ = srv.Close()
	}
	return nil
}

// readyCheck is the /readyz check: ready once the caches have synced and
// the API listens.
func (a *apiServer) readyCheck(*http.Request) error {
	if !a.listening.Load() {
		return errors.New("the Compute API is not serving yet")
	}
	return nil
}
