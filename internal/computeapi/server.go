// Package computeapi is the control plane's HTTP API, its surface: it
// authenticates a caller, finds the caller's agent's Sandbox, and forwards
// the operation to that sandbox's supervisor over mutual TLS, counting the
// call as activity on the sandbox's activity clock. What the API decides
// beyond one call lives in packages of its own: holds (an agent's
// exclusive hold, pool leases, the activity clock), supervisors (the
// verified connections to supervisors), sandboxstate (what a sandbox's
// status means for a call).
//
// The wire types and a Go client live in the client subpackage, which
// depends on the standard library only.
package computeapi

import (
	"errors"
	"net/http"
	"sync"
	"time"

	"github.com/go-logr/logr"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/clock"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/agentbox/terraform-provider-agentbox/internal/computeapi/holds"
	"github.com/agentbox/terraform-provider-agentbox/internal/computeapi/supervisors"
	"github.com/agentbox/terraform-provider-agentbox/internal/pki"
	"github.com/agentbox/terraform-provider-agentbox/internal/store"
	"github.com/agentbox/terraform-provider-agentbox/internal/usertoken"
)

const (
	// DefaultMaxRequestBytes bounds a request body. Stdin travels inline,
	// so the bound is a few MiB rather than a few KiB.
	DefaultMaxRequestBytes = 8 << 20

	// supervisorGrace is how much longer than the command's own timeout
	// the API waits for the supervisor: after a timeout the supervisor
	// still kills the process group and sends the partial output.
	supervisorGrace = 30 * time.Second

	// DefaultResumeTimeout covers restoring a workspace of a few GiB and
	// starting a pod on a busy node. A call that waits longer gets
	// sandbox_not_ready and may simply retry: the resume goes on.
	DefaultResumeTimeout = 3 * time.Minute

	// DefaultLeaseRenewInterval is holds.DefaultActivityRenewInterval: how
	// often at most a sandbox's activity clock is renewed.
	DefaultLeaseRenewInterval = holds.DefaultActivityRenewInterval
)

// Options configure a Server.
type Options struct {
	// Sandboxes finds Sandboxes by agent; in the control plane it is the
	// manager's cache, so lookups do not load the API server.
	Sandboxes client.Reader
	// Serves reports whether the platform serves sandboxes in a namespace:
	// agent IDs are the platform's own, so a sandbox elsewhere (another
	// platform's, on the same cluster) is not this platform's agent. Nil
	// serves every namespace.
	Serves func(namespace string) bool
	// Leases writes to the API server: the activity clocks' renewals and
	// the holds (both on the sandboxes' Kubernetes Leases, hence the
	// name), pool leases, created and deleted sandboxes. Its reads are a
	// hold call's first look at a Lease; in the control plane it is the
	// manager's client, which writes directly and reads from the cache.
	Leases client.Client
	// LeaseReader reads directly, for the retries of a hold call whose
	// first read, through Leases, was stale or missed; it defaults to
	// Leases.
	LeaseReader client.Reader
	// Supervisors dials sandbox supervisors; see SupervisorPool.
	Supervisors SupervisorDialer
	// Authenticator decides who a bearer token belongs to.
	Authenticator Authenticator
	// TrustDomain of the sandboxes' SPIFFE IDs; empty means
	// pki.DefaultTrustDomain.
	TrustDomain string
	// Clock defaults to the real clock.
	Clock clock.PassiveClock
	// Logger defaults to a logger that discards.
	Logger logr.Logger
	// LeaseRenewInterval throttles the renewals of a sandbox's activity
	// clock; it defaults to DefaultLeaseRenewInterval.
	LeaseRenewInterval time.Duration
	// ResumeTimeout bounds how long a call waits for a stopped or starting
	// sandbox to become ready; it defaults to DefaultResumeTimeout.
	ResumeTimeout time.Duration
	// MaxRequestBytes defaults to DefaultMaxRequestBytes.
	MaxRequestBytes int64
	// Store, when set, gets every call in its audit log, holds the tokens
	// that /v1/tokens mints, and serves /v1/audit. Without it those
	// endpoints answer unavailable and calls are not audited. The caller
	// closes the Server (which flushes the audit log) before the Store.
	Store *store.Store
	// FilespacePushDelay is how long after an agent's last call that can
	// change its workspace the workspace is pushed into its filespace (in
	// the Store); it defaults to DefaultFilespacePushDelay, and a negative
	// value turns these pushes off.
	FilespacePushDelay time.Duration
	// WarmKeepAlive is how often the API calls the supervisor of each
	// ready, free warm sandbox over the connection it keeps open to it
	// (WarmPoolEvents), and so how soon an environment the supervisor
	// evicted leaves the sandbox's inventory; zero means a minute, the
	// connection's own need.
	WarmKeepAlive time.Duration
	// DefaultTemplate is the SandboxTemplate deploy_or_resume creates an
	// agent's missing sandbox from when the call names none. Zero means
	// such a call must name one, which only an admin token may.
	DefaultTemplate types.NamespacedName
	// Replica names this control plane replica as the executor of the
	// runs it starts; it defaults to the host's name (the pod's).
	Replica string
	// RunHeartbeatInterval is how often an executor heartbeats its run;
	// it defaults to DefaultRunHeartbeatInterval. A run not heartbeated
	// for three intervals is failed as lost by any replica's sweeper.
	RunHeartbeatInterval time.Duration
	// RunSweepInterval is how often the sweeper looks for lost runs; it
	// defaults to DefaultRunSweepInterval.
	RunSweepInterval time.Duration
	// RunRetention is how long the records of finished runs, with their
	// event logs, are kept: the sweeper deletes older ones, at most every
	// runPruneInterval. Zero keeps them forever; the control plane
	// defaults it to DefaultRunRetention.
	RunRetention time.Duration
	// RunEventPollInterval is how often a run's event stream looks in the
	// store for events another replica recorded; it defaults to
	// DefaultRunEventPollInterval. RunEventKeepalive is how often an idle
	// stream sends a comment; it defaults to DefaultRunEventKeepalive.
	RunEventPollInterval, RunEventKeepalive time.Duration
	// RunOutputMaxEvents and RunOutputMaxBytes bound the output lines a
	// run records as events; they default to DefaultRunOutputMaxEvents and
	// DefaultRunOutputMaxBytes.
	RunOutputMaxEvents int
	RunOutputMaxBytes  int64
	// RunArtifacts says where runs' artifacts go (the platform's object
	// store) and bounds them; without a store none are kept.
	RunArtifacts RunArtifactsOptions
	// RunRetryBackoff is how long a job run waits before its first retry;
	// each further retry waits twice as long as the one before, up to
	// RunRetryBackoffMax. They default to DefaultRunRetryBackoff and
	// DefaultRunRetryBackoffMax.
	RunRetryBackoff, RunRetryBackoffMax time.Duration
	// AgentEvents records the agents' events (GET /v1/agents/{id}/events)
	// in Store; the control plane gives the sandbox controller the same
	// one, and closes it after the Server. Nil, with a Store, makes one
	// that the Server closes. The events are kept for RunRetention.
	AgentEvents *AgentEvents
	// UserTokens issues the user tokens of POST /v1/token and publishes
	// their keys under /.well-known; nil turns user tokens off.
	UserTokens *usertoken.Issuer
}

// Server serves the Compute API.
type Server struct {
	sandboxes client.Reader
	// serves: see Options.Serves; never nil.
	serves          func(namespace string) bool
	supervisors     SupervisorDialer
	auth            Authenticator
	trustDomain     string
	clock           clock.PassiveClock
	log             logr.Logger
	resumeTimeout   time.Duration
	maxRequestBytes int64
	handler         http.Handler
	// kube writes to the API server (timed), and kubeDirect reads from it
	// without the cache.
	kube       client.Client
	kubeDirect client.Reader
	// activity is the sandboxes' activity clock, and holds their holds
	// and pool leases.
	activity *holds.ActivityClock
	holds    *holds.Keeper
	// conns reaches the sandboxes' supervisors.
	conns *supervisors.Conns
	store *store.Store
	audit *auditor
	// supervisorAudit is what the pool hands supervisors' records to.
	supervisorAudit *supervisors.AuditSink
	pushes          *autoPusher // nil without a store
	// background holds work a call starts and does not wait for (see
	// recordActivity); Close waits for it.
	background sync.WaitGroup
	// closing is closed when Close begins, for background work that would
	// otherwise last as long as a call that a hijacked connection keeps
	// open.
	closing chan struct{}
	// defaultTemplate: see Options.DefaultTemplate.
	defaultTemplate types.NamespacedName
	// routes are the "METHOD /pattern"s served, for the OpenAPI check.
	routes []string
	// replica, runHeartbeat and runSweep: see Options; execs are the runs
	// this Server executes.
	replica      string
	runHeartbeat time.Duration
	runSweep     time.Duration
	runRetention time.Duration
	execs        executors
	// runNotes wakes the event streams of the runs this Server executes;
	// the rest configure them (see Options).
	runNotes           notifier
	streamShutdowns    shutdowns
	runEventPoll       time.Duration
	runEventKeepalive  time.Duration
	runOutputMaxEvents int
	runOutputMaxBytes  int64
	// artifacts says where runs' artifacts go.
	artifacts RunArtifactsOptions
	// runRetryBackoff and runRetryBackoffMax: see Options.
	runRetryBackoff, runRetryBackoffMax time.Duration
	// agentEvents records agents' events and wakes their streams; nil
	// without a store. ownAgentEvents: the Server made it, and closes it.
	agentEvents    *AgentEvents
	ownAgentEvents bool
	// userTokenIssuer: see Options.UserTokens.
	userTokenIssuer *usertoken.Issuer
	// runWork holds the run executors and the sweeper, which last until
	// Close (apart from background, which settles between calls).
	runWork   sync.WaitGroup
	closeOnce sync.Once
}

// NewServer checks opts and returns a Server.
func NewServer(opts Options) (*Server, error) {
	if err := checkOptions(opts); err != nil {
		return nil, err
	}
	s := newServer(opts)
	s.activity = holds.NewActivityClock(s.kube, s.clock, renewInterval(opts), s.log.WithName("lease"))
	s.holds = holds.New(holds.Config{
		Sandboxes: s.sandboxes, Writer: s.kube, Reader: s.kubeDirect, Store: s.store,
		Activity: s.activity, Clock: s.clock, Log: s.log, OnColdStart: metricColdStarts.Inc,
	})
	s.conns = supervisors.NewConns(s.supervisors, s.trustDomain, s.log)
	if opts.WarmKeepAlive > 0 {
		s.conns.SetKeepAlive(opts.WarmKeepAlive)
	}
	s.conns.OnHealth(s.envHealth)
	if s.store != nil {
		s.useStore(opts.FilespacePushDelay)
	}
	s.handler = s.routeTable()
	return s, nil
}

func checkOptions(opts Options) error {
	switch {
	case opts.Sandboxes == nil:
		return errors.New("computeapi: Options.Sandboxes is required")
	case opts.Leases == nil:
		return errors.New("computeapi: Options.Leases is required")
	case opts.Supervisors == nil:
		return errors.New("computeapi: Options.Supervisors is required")
	case opts.Authenticator == nil:
		return errors.New("computeapi: Options.Authenticator is required")
	}
	return nil
}

// newServer is the Server of opts with the defaults filled in, before
// its parts are made.
func newServer(opts Options) *Server {
	s := &Server{
		sandboxes:       opts.Sandboxes,
		serves:          opts.Serves,
		supervisors:     opts.Supervisors,
		closing:         make(chan struct{}),
		auth:            opts.Authenticator,
		trustDomain:     opts.TrustDomain,
		clock:           opts.Clock,
		log:             opts.Logger,
		maxRequestBytes: positiveOr(opts.MaxRequestBytes, DefaultMaxRequestBytes),
		kubeDirect:      opts.LeaseReader,
		kube:            timedWriter{opts.Leases},
		resumeTimeout:   positiveOr(opts.ResumeTimeout, DefaultResumeTimeout),
		store:           opts.Store,
		defaultTemplate: opts.DefaultTemplate,
		replica:         opts.Replica,
		runHeartbeat:    positiveOr(opts.RunHeartbeatInterval, DefaultRunHeartbeatInterval),
		runSweep:        positiveOr(opts.RunSweepInterval, DefaultRunSweepInterval),
		runRetention:    opts.RunRetention,

		runEventPoll:       positiveOr(opts.RunEventPollInterval, DefaultRunEventPollInterval),
		runEventKeepalive:  positiveOr(opts.RunEventKeepalive, DefaultRunEventKeepalive),
		runOutputMaxEvents: positiveOr(opts.RunOutputMaxEvents, DefaultRunOutputMaxEvents),
		runOutputMaxBytes:  positiveOr(opts.RunOutputMaxBytes, DefaultRunOutputMaxBytes),
		artifacts:          opts.RunArtifacts.withDefaults(),
		runRetryBackoff:    positiveOr(opts.RunRetryBackoff, DefaultRunRetryBackoff),
		runRetryBackoffMax: positiveOr(opts.RunRetryBackoffMax, DefaultRunRetryBackoffMax),
		agentEvents:        opts.AgentEvents,
		userTokenIssuer:    opts.UserTokens,
	}
	if s.replica == "" {
		s.replica = defaultReplica()
	}
	if s.kubeDirect == nil {
		s.kubeDirect = opts.Leases
	}
	if s.trustDomain == "" {
		s.trustDomain = pki.DefaultTrustDomain
	}
	if s.clock == nil {
		s.clock = clock.RealClock{}
	}
	if s.log.GetSink() == nil {
		s.log = logr.Discard()
	}
	if s.serves == nil {
		s.serves = func(string) bool { return true }
	}
	return s
}

// positiveOr is v, or def when v is not positive: an option left at zero
// (or set below it) takes its default.
func positiveOr[T int | int64 | time.Duration](v, def T) T {
	if v > 0 {
		return v
	}
	return def
}

func renewInterval(opts Options) time.Duration {
	if opts.LeaseRenewInterval <= 0 {
		return DefaultLeaseRenewInterval
	}
	return opts.LeaseRenewInterval
}

// useStore starts what the store makes possible: the audit log, with the
// supervisors' own records in it, the pushes of workspaces into their
// filespaces pushDelay after an agent's last call (see
// Options.FilespacePushDelay), and the sweeper of lost runs.
func (s *Server) useStore(pushDelay time.Duration) {
	s.audit = newAuditor(s.store, s.log.WithName("audit"))
	if s.agentEvents == nil {
		s.agentEvents, s.ownAgentEvents = NewAgentEvents(s.store, s.log.WithName("agent-events")), true
	}
	if pool, ok := s.supervisors.(*SupervisorPool); ok {
		s.supervisorAudit = &supervisors.AuditSink{Record: s.recordSupervisor, Invalid: s.invalidSupervisorRecord}
		pool.SetAudit(s.supervisorAudit)
	}
	if pushDelay == 0 {
		pushDelay = DefaultFilespacePushDelay
	}
	if pushDelay > 0 {
		s.pushes = newAutoPusher(s, pushDelay)
	}
	s.runWork.Go(s.sweepRuns)
}

// Close writes the audit records still queued, and stops the runs this
// Server executes: their commands are killed and they end failed with
// reason ExecutorStopped. Call it after the HTTP server has stopped
// serving, and before closing the Store. A second Close does nothing.
func (s *Server) Close() { s.closeOnce.Do(s.close) }

func (s *Server) close() {
	close(s.closing)
	s.conns.Close()
	s.background.Wait()
	s.runWork.Wait()
	s.holds.Drain()
	if s.pushes != nil {
		s.pushes.close()
	}
	if pool, ok := s.supervisors.(*SupervisorPool); ok && s.supervisorAudit != nil {
		pool.ClearAudit(s.supervisorAudit)
	}
	if s.audit != nil {
		s.audit.close()
	}
	if s.ownAgentEvents {
		s.agentEvents.Close()
	}
}

// Handler returns the API's HTTP handler. Health endpoints are not part of
// it: they are served on the separate health port.
func (s *Server) Handler() http.Handler { return s.handler }
