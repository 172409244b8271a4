// Command agentbox-supervisor runs inside every sandbox pod and executes
// commands and serves the workspace's files for the agentbox control plane
// over mutual TLS.
//
// Configuration comes from flags, each of which defaults to an environment
// variable:
//
//	-listen              AGENTBOX_LISTEN              :8443
//	-tls-dir             AGENTBOX_TLS_DIR             /etc/agentbox/tls (tls.crt, tls.key, ca.crt)
//	-trust-domain        AGENTBOX_TRUST_DOMAIN        agentbox.local
//	-allowed-client-ids  AGENTBOX_ALLOWED_CLIENT_IDS  the control plane's ID in AGENTBOX_NAMESPACE
//	-workdir             AGENTBOX_WORKDIR             the workspace if there is one, else the current directory
//	-workspace           AGENTBOX_WORKSPACE           -workdir if set, else /workspace (file endpoints are off if it does not exist)
//	-workspace-cap       AGENTBOX_WORKSPACE_CAP       1GiB (the controller sets the template's workspace size)
//	-pass-env            AGENTBOX_PASS_ENV            the proxy variables; * for all but the supervisor's own (the controller sets *)
//	-audit-log           AGENTBOX_AUDIT_LOG           off
//	-python              AGENTBOX_PYTHON              python3, looked up in the commands' PATH
//	-mcp-servers         AGENTBOX_MCP_SERVERS         none (a JSON file: [{"name", "command", "args", "env", "dir"}])
//	-env-dir             AGENTBOX_ENV_DIR             $TMPDIR/agentbox-envs (cached Python environments; empty: none; the controller sets a hidden directory on the workspace volume, so that they survive an idle stop)
//	-env-max-size        AGENTBOX_ENV_MAX_SIZE        2GiB (with -env-max-count, 8: LRU eviction past either; the controller sets the template's)
//	-env-max-count       AGENTBOX_ENV_MAX_COUNT       8
//	-env-ttl             AGENTBOX_ENV_TTL             0, none (idle environments unused longer are removed)
//	-python-index        AGENTBOX_PYTHON_INDEX        the installer's default (PyPI, through the egress proxy)
//	-python-extra-indexes AGENTBOX_PYTHON_EXTRA_INDEXES none (comma-separated)
//	-env-seal-key-file   AGENTBOX_ENV_SEAL_KEY_FILE   none (read and removed at start; seals the cached environments so that a reused warm sandbox keeps only unchanged ones)
//	-python-trusted-hosts AGENTBOX_PYTHON_TRUSTED_HOSTS none (comma-separated host or host:port; plain HTTP allowed)
//	-python-allowed-packages AGENTBOX_PYTHON_ALLOWED_PACKAGES all (comma-separated project names)
//	-uv                  AGENTBOX_UV                  uv, looked up in the commands' PATH; pip if absent
//	-command-pids-limit  AGENTBOX_COMMAND_PIDS_LIMIT  1024, or what -memory-limit holds (RLIMIT_NPROC of commands; -1: none)
//	-memory-limit        AGENTBOX_MEMORY_LIMIT        off (the pod's memory limit; the controller sets it)
//	-memory-reserve      AGENTBOX_MEMORY_RESERVE      the larger of 96MiB and an eighth of -memory-limit
//	-health-listen       AGENTBOX_HEALTH_LISTEN       off (plain HTTP, /livez and /healthz only; the controller sets 127.0.0.1:8444)
//	-warm-up             AGENTBOX_WARM_UP             true (a throwaway `true` before listening, so that the first command costs what later ones do)
//	-idle-trim           AGENTBOX_IDLE_TRIM           5s (idle this long, the supervisor returns freed memory at once; 0: never)
//
// "agentbox-supervisor -install DIR" serves nothing: it copies its own
// executable into DIR/agentbox-supervisor and exits 0 (1 with the reason
// on stderr if it cannot). Every sandbox pod's init container runs it from
// the supervisor image into a volume, and the sandbox container runs the
// copy, so the sandbox image itself needs no supervisor.
//
// "agentbox-supervisor -probe" serves nothing: it calls GET /livez on
// -health-listen and exits 0 if the supervisor answered, 1 if not. It is
// the sandbox pod's liveness probe, run by kubelet inside the pod with
// the pod's environment, so it finds the address the supervisor listens
// on.
//
// Every answer carries the supervisor's record of the call (see
// supervisorapi.AuditRecord), which the control plane appends to its
// hash-chained audit log: the record leaves the sandbox as it is made.
// The local audit log is a debugging aid, off unless a path is given (the
// controller keeps it off in sandbox pods). Anywhere the supervisor can
// write, so can the code it runs, as the same user: a local log could be
// edited or filled, and it grows unbounded on the pod's storage.
//
// On SIGTERM the supervisor stops accepting calls and lets running
// commands finish for -shutdown-grace; then it sends SIGTERM to the
// process groups of those still running and of every background process,
// SIGKILL after -kill-grace, closes the audit log and exits 0. Background
// processes get no -shutdown-grace of their own (they do not finish by
// themselves), but keep running while calls do, which may need them. The defaults (25s + 3s) fit in Kubernetes'
// default 30s termination grace period.
//
// AGENTBOX_NAMESPACE is the namespace the control plane runs in (the
// platform namespace, agentbox-system unless the chart says otherwise), not
// the sandbox's own.
package main

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"path/filepath"
	"syscall"
	"time"

	"github.com/agentbox/terraform-provider-agentbox/internal/pki"
	"github.com/agentbox/terraform-provider-agentbox/internal/redact"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/mcpbridge"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/pyenv"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"
)

// version is set at build time with -ldflags "-X main.version=...".
var version = "dev"

const defaultPlatformNamespace = "agentbox-system"

func main() {
	opts, err := parseOptions(os.Args[1:], os.Getenv, os.Stderr)
	if errors.Is(err, flag.ErrHelp) {
		return
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "agentbox-supervisor:", err)
		os.Exit(2)
	}
	if opts.showVersion {
		fmt.Println(version)
		return
	}
	if opts.install != "" {
		path, err := install(opts.install)
		if err != nil {
			fmt.Fprintln(os.Stderr, "agentbox-supervisor -install:", err)
			os.Exit(1)
		}
		fmt.Println("installed", path)
		if opts.resetWorkspace != "" {
			if err := resetWorkspace(opts.resetWorkspace, opts.sealKeyFrom, os.Stdout); err != nil {
				fmt.Fprintln(os.Stderr, "agentbox-supervisor -reset-workspace:", err)
				os.Exit(1)
			}
		}
		if err := handOverSealKey(opts.sealKeyFrom, opts.sealKeyTo); err != nil {
			fmt.Fprintln(os.Stderr, "agentbox-supervisor -install:", err)
			os.Exit(1)
		}
		return
	}
	if opts.probe {
		if err := probe(opts.healthListen, opts.probeTimeout); err != nil {
			fmt.Fprintln(os.Stderr, "agentbox-supervisor -probe:", err)
			os.Exit(1)
		}
		return
	}
	log := slog.New(redact.SlogHandler(slog.NewJSONHandler(os.Stderr, &slog.HandlerOptions{Level: opts.logLevel})))
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	// Once shutdown has begun, a second SIGINT or SIGTERM ends the process
	// at once.
	context.AfterFunc(ctx, stop)
	if err := run(ctx, opts, log); err != nil {
		log.Error("supervisor failed", "error", err.Error())
		os.Exit(1)
	}
}

// run serves until ctx is done, then shuts down: the reaper, the audit
// log, the TLS identity, the MCP servers and the supervisor's handler are
// set up first, and stopped in the reverse order.
func run(ctx context.Context, o *options, log *slog.Logger) error {
	if o.reapOrphans {
		// Not ctx: orphans still need reaping during the shutdown grace.
		if err := supervisor.StartReaper(context.Background(), log); err != nil {
			return err
		}
	}
	o.sealKey = takeSealKey(o.envSealKeyFile, log)
	audit, err := openAuditLog(o.auditLog)
	if err != nil {
		return err
	}
	if audit != nil {
		// Runs after every other deferred step of the shutdown below, once
		// no request can still be recording.
		defer closeAuditLog(audit, o.auditLog, log)
	}
	tlsConfig, self, err := loadIdentity(o, log)
	if err != nil {
		return err
	}
	mcpServers, err := newMCPManager(o, log)
	if err != nil {
		return err
	}
	handler, err := newHandler(o, self, mcpServers, audit, log)
	if err != nil {
		return err
	}
	defer handler.Close()
	if o.warmUp {
		warmUp(ctx, handler, o.idleTrim > 0, log)
	}
	if mcpServers != nil {
		// Stopped once the HTTP server has (defers run in reverse),
		// before the audit log is closed.
		defer startMCP(mcpServers, o.killGrace, log)()
	}
	srv, err := listen(o, handler, tlsConfig, log)
	if err != nil {
		return err
	}
	return srv.serveUntil(ctx, o, handler, log)
}

// warmUp runs the handler's throwaway command before the supervisor
// listens: the sandbox counts as ready once its port accepts, and its
// first command should then cost what the tenth does. A failure is logged
// and serving goes on: the first command pays instead. With trim, the
// start's garbage (certificates, the configuration, the warm-up's own
// buffers) is handed back at once rather than held by the idle sandbox.
func warmUp(ctx context.Context, handler *supervisor.Server, trim bool, log *slog.Logger) {
	start := time.Now()
	if err := handler.WarmUp(ctx); err != nil {
		log.Warn("warm-up command failed; the first command will pay for the start", "error", err.Error())
	} else {
		log.Info("warmed up", "duration_ms", time.Since(start).Milliseconds())
	}
	if trim {
		supervisor.TrimMemory()
	}
}

// openAuditLog opens the local audit log, or returns nil when it is off.
func openAuditLog(path string) (*supervisor.AuditLog, error) {
	if path == "" {
		return nil, nil
	}
	return supervisor.OpenAuditLog(path)
}

func closeAuditLog(audit *supervisor.AuditLog, path string, log *slog.Logger) {
	if err := audit.Close(); err != nil {
		log.Error("closing the audit log failed", "error", err.Error())
		return
	}
	log.Info("audit log closed", "path", path)
}

// loadIdentity loads the TLS configuration and the supervisor's own
// SPIFFE ID, unless it serves plain HTTP.
func loadIdentity(o *options, log *slog.Logger) (*tls.Config, string, error) {
	if o.insecureListen != "" {
		return nil, "", nil
	}
	tlsConfig, self, err := loadTLS(o.tlsDir, o.allowedClientIDs)
	if err != nil {
		return nil, "", err
	}
	log.Info("loaded TLS identity", "identity", self, "allowed_client_ids", o.allowedClientIDs)
	return tlsConfig, self, nil
}

// newHandler is the supervisor's handler, configured by the options.
func newHandler(o *options, self string, mcpServers *mcpbridge.Manager, audit *supervisor.AuditLog, log *slog.Logger) (*supervisor.Server, error) {
	return supervisor.New(supervisor.Config{
		Identity:              self,
		MCP:                   mcpHandler(mcpServers),
		DefaultCwd:            o.workdir,
		Workspace:             o.workspace,
		WorkspaceCap:          o.workspaceCap,
		CommandPidsLimit:      o.pidsLimit,
		MemoryLimit:           o.memoryLimit,
		MemoryReserve:         o.memoryReserve,
		MaxTimeout:            o.maxTimeout,
		MaxConcurrentCommands: o.maxConcurrent,
		MaxQueuedCommands:     o.maxQueued,
		CommandQueueWait:      o.queueWait,
		MaxProcesses:          o.maxProcesses,
		ProcessKillGrace:      o.killGrace,
		PassEnv:               o.passEnv,
		Python:                o.python,
		PythonDefaultTimeout:  o.pythonTimeout,
		PythonMaxTimeout:      o.pythonMaxTimeout,
		Execute:               executeConfig(o),
		IdleTrim:              idleTrim(o.idleTrim),
		Audit:                 audit,
		Version:               version,
		Logger:                log,
	})
}

// idleTrim is -idle-trim as supervisor.Config takes it: 0 there is the
// default, negative never.
func idleTrim(d time.Duration) time.Duration {
	if d == 0 {
		return -1
	}
	return d
}

// startMCP starts the MCP servers on boot, not on the first call, so that
// the tool catalog is ready when the control plane asks for it, and
// returns what stops them.
func startMCP(m *mcpbridge.Manager, killGrace time.Duration, log *slog.Logger) (stop func()) {
	m.Start(context.Background())
	log.Info("starting MCP servers", "servers", m.Names())
	return func() {
		ctx, cancel := context.WithTimeout(context.Background(), killGrace+5*time.Second)
		defer cancel()
		if err := m.Stop(ctx); err != nil {
			log.Error("MCP servers did not stop", "error", err.Error())
		}
	}
}

// servers are the supervisor's HTTP servers while they run.
type servers struct {
	srv    *http.Server
	health *http.Server // nil without -health-listen
	errs   chan error
	// cancelBase cancels the requests' contexts, which kills the process
	// groups of commands still running.
	cancelBase context.CancelFunc
}

// listen starts serving the API, and the health checks when they have an
// address of their own.
func listen(o *options, handler *supervisor.Server, tlsConfig *tls.Config, log *slog.Logger) (*servers, error) {
	addr := o.listen
	if o.insecureListen != "" {
		addr = o.insecureListen
		log.Warn("serving plain HTTP without client authentication; for local debugging only", "addr", addr)
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("listen: %w", err)
	}
	// Request contexts derive from base; cancelling it kills the process
	// groups of commands still running when the grace period ends.
	base, cancelBase := context.WithCancel(context.Background())
	s := &servers{errs: make(chan error, 2), cancelBase: cancelBase}
	s.srv = &http.Server{
		Handler:           handler,
		TLSConfig:         tlsConfig,
		ReadHeaderTimeout: 10 * time.Second,
		ReadTimeout:       time.Minute,
		// A response is written after the command ends, so the write
		// deadline has to outlast the longest command.
		// /v1/execute may build an environment before its run.
		WriteTimeout: o.maxTimeout + o.envCreateTimeout + time.Minute,
		IdleTimeout:  2 * time.Minute,
		BaseContext:  func(net.Listener) context.Context { return base },
		ErrorLog:     slog.NewLogLogger(log.Handler(), slog.LevelWarn),
	}
	go func() {
		if tlsConfig != nil {
			s.errs <- s.srv.ServeTLS(ln, "", "")
		} else {
			s.errs <- s.srv.Serve(ln)
		}
	}()
	log.Info("listening", "addr", ln.Addr().String(), "tls", tlsConfig != nil, "version", version, "workdir", handler.DefaultCwd(),
		"workspace", handler.Workspace(), "workspace_cap", o.workspaceCap)

	if o.healthListen != "" {
		hln, err := net.Listen("tcp", o.healthListen)
		if err != nil {
			_ = s.srv.Close()
			cancelBase()
			return nil, fmt.Errorf("listen for health checks: %w", err)
		}
		s.health = &http.Server{Handler: healthOnly(handler), ReadHeaderTimeout: 5 * time.Second, WriteTimeout: 5 * time.Second}
		go func() { s.errs <- s.health.Serve(hln) }()
		log.Info("serving health checks", "addr", hln.Addr().String())
	}
	return s, nil
}

// serveUntil serves until a server fails or ctx is done, and then shuts
// down (see stop).
func (s *servers) serveUntil(ctx context.Context, o *options, handler *supervisor.Server, log *slog.Logger) error {
	defer s.cancelBase()
	select {
	case err := <-s.errs:
		_ = s.srv.Close()
		if s.health != nil {
			_ = s.health.Close()
		}
		return fmt.Errorf("serve: %w", err)
	case <-ctx.Done():
	}
	log.Info("shutting down", "grace", o.shutdownGrace.String(), "kill_grace", o.killGrace.String())
	if s.health != nil {
		_ = s.health.Close()
	}
	if err := stop(s.srv, handler, s.cancelBase, o.shutdownGrace, o.killGrace, log); err != nil {
		return err
	}
	log.Info("stopped")
	return nil
}

// stop lets the calls in flight finish for grace, then asks the commands
// still running and the background processes to exit with SIGTERM to
// their process groups, and kills the groups with SIGKILL (cancelling the
// requests' contexts and Kill) if they have not exited killGrace later. It
// returns once no request is being served and no process is left, so that
// every audit line has been written.
func stop(srv *http.Server, handler *supervisor.Server, cancelBase context.CancelFunc, grace, killGrace time.Duration, log *slog.Logger) error {
	graceCtx, cancel := context.WithTimeout(context.Background(), grace)
	defer cancel()
	drained := srv.Shutdown(graceCtx) == nil
	n := handler.Terminate()
	if drained && n == 0 {
		return nil
	}
	if drained {
		log.Info("sent SIGTERM to the background processes", "process_groups", n)
	} else {
		log.Warn("calls still running after the grace period; sent SIGTERM to their commands and the background processes", "process_groups", n)
	}
	termCtx, cancelTerm := context.WithTimeout(context.Background(), killGrace)
	defer cancelTerm()
	if handler.Wait(termCtx) == nil {
		// Members of a background process's group that ignored SIGTERM
		// while their leader exited.
		handler.Kill()
		if drained {
			return nil
		}
		// The handlers have returned, but net/http may still be flushing
		// their responses; closing at once could cut off the result of a
		// command that exited cleanly on SIGTERM.
		flushCtx, cancelFlush := context.WithTimeout(context.Background(), time.Second)
		defer cancelFlush()
		if srv.Shutdown(flushCtx) != nil {
			_ = srv.Close()
		}
		return nil
	}
	log.Warn("processes still running after SIGTERM; killing them")
	cancelBase()
	handler.Kill()
	_ = srv.Close()
	killCtx, cancelKill := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancelKill()
	if err := handler.Wait(killCtx); err != nil {
		return fmt.Errorf("commands did not stop: %w", err)
	}
	// Leaders killed just now leave their groups' swept members to this.
	handler.Kill()
	return nil
}

// newMCPManager configures the template's MCP servers, or returns nil if
// there are none. They get the same environment as commands: PATH, LANG,
// the pass-env variables and HOME (their directory), nothing else of the
// supervisor's. Remote servers are reached with that environment's egress
// proxy and trust store (see mcpbridge.RemoteTransport).
func newMCPManager(o *options, log *slog.Logger) (*mcpbridge.Manager, error) {
	var (
		servers []mcpbridge.ServerConfig
		err     error
	)
	switch {
	case o.mcpServers != "" && o.mcpServersJSON != "":
		return nil, errors.New("-mcp-servers and -mcp-servers-json are exclusive")
	case o.mcpServers != "":
		servers, err = mcpbridge.LoadServers(o.mcpServers)
	case o.mcpServersJSON != "":
		servers, err = mcpbridge.ParseServers([]byte(o.mcpServersJSON))
	default:
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	env := map[string]string{"PATH": supervisor.DefaultPath, "LANG": "C.UTF-8"}
	for k, v := range supervisor.PassedEnv(o.passEnv, os.Environ()) {
		if k != "PATH" || v != "" {
			env[k] = v
		}
	}
	dir := o.workdir
	if dir == "" {
		if st, err := os.Stat(supervisor.DefaultWorkspace); err == nil && st.IsDir() {
			dir = supervisor.DefaultWorkspace
		}
	}
	var tracker mcpbridge.ChildTracker
	if o.reapOrphans {
		tracker = supervisor.ProcessTracker{}
	}
	return mcpbridge.New(mcpbridge.Config{
		Servers:        servers,
		BaseEnv:        env,
		DefaultDir:     dir,
		CallTimeout:    min(mcpbridge.DefaultCallTimeout, o.maxTimeout),
		MaxCallTimeout: o.maxTimeout,
		Tracker:        tracker,
		Version:        version,
		Logger:         log,
	})
}

// executeConfig is the configuration of /v1/execute and the environment
// cache; an empty -env-dir leaves the cache off.
func executeConfig(o *options) supervisor.ExecuteConfig {
	c := supervisor.ExecuteConfig{UV: o.uv}
	if o.envDir != "" {
		c.Envs = &pyenv.Config{
			Dir:             o.envDir,
			IndexURL:        o.pythonIndex,
			ExtraIndexURLs:  o.pythonExtra,
			TrustedHosts:    o.pythonTrusted,
			SealKey:         o.sealKey,
			AllowedPackages: o.pythonAllowed,
			MaxEnvs:         o.envMaxCount,
			MaxBytes:        o.envMaxSize,
			CreateTimeout:   o.envCreateTimeout,
			TTL:             o.envTTL,
		}
	}
	return c
}

// mcpHandler keeps a nil *Manager from becoming a non-nil http.Handler.
func mcpHandler(m *mcpbridge.Manager) http.Handler {
	if m == nil {
		return nil
	}
	return m
}

func loadTLS(dir string, allowed []string) (*tls.Config, string, error) {
	cert, err := tls.LoadX509KeyPair(filepath.Join(dir, "tls.crt"), filepath.Join(dir, "tls.key"))
	if err != nil {
		return nil, "", fmt.Errorf("load serving certificate: %w", err)
	}
	if cert.Leaf == nil {
		if cert.Leaf, err = x509.ParseCertificate(cert.Certificate[0]); err != nil {
			return nil, "", fmt.Errorf("parse serving certificate: %w", err)
		}
	}
	id, err := pki.IDFromCert(cert.Leaf)
	if err != nil {
		return nil, "", fmt.Errorf("serving certificate in %s: %w", dir, err)
	}
	caPEM, err := os.ReadFile(filepath.Join(dir, "ca.crt"))
	if err != nil {
		return nil, "", fmt.Errorf("load CA: %w", err)
	}
	pool, err := pki.CertPoolFromPEM(caPEM)
	if err != nil {
		return nil, "", fmt.Errorf("%s: %w", filepath.Join(dir, "ca.crt"), err)
	}
	return pki.ServerTLS(cert, pool, allowed...), id.String(), nil
}

// probe is -probe: one GET /livez on the health listener at addr, which
// goes through the same request handling as every call. A supervisor that
// is stopped or wedged (its accept loop, or the lock every call takes)
// does not answer within timeout, and the probe fails, where a TCP connect
// to its port would still succeed: the kernel accepts connections for a
// listener whose process no longer runs.
func probe(addr string, timeout time.Duration) error {
	if addr == "" {
		return errors.New("no -health-listen (AGENTBOX_HEALTH_LISTEN) to probe")
	}
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return fmt.Errorf("-health-listen %q: %w", addr, err)
	}
	if ip := net.ParseIP(host); host == "" || (ip != nil && ip.IsUnspecified()) {
		host = "127.0.0.1"
	}
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	u := "http://" + net.JoinHostPort(host, port) + supervisorapi.PathLive
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, u, nil)
	if err != nil {
		return err
	}
	// Not the default transport: no proxy from the environment (the pod
	// has HTTP_PROXY for the egress proxy) and no connection kept.
	client := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}}
	resp, err := client.Do(req)
	if err != nil {
		return fmt.Errorf("GET %s: %w", u, err)
	}
	defer resp.Body.Close()
	var body struct {
		Status string `json:"status"`
	}
	if resp.StatusCode != http.StatusOK || json.NewDecoder(io.LimitReader(resp.Body, 4096)).Decode(&body) != nil || body.Status != "ok" {
		return fmt.Errorf("GET %s: %s, status %q", u, resp.Status, body.Status)
	}
	return nil
}

func healthOnly(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != supervisorapi.PathHealth && r.URL.Path != supervisorapi.PathHealthShort && r.URL.Path != supervisorapi.PathLive {
			http.NotFound(w, r)
			return
		}
		h.ServeHTTP(w, r)
	})
}
