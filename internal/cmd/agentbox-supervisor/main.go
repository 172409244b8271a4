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
//	-pass-env            AGENTBOX_PASS_ENV            the proxy variables (the controller adds the template's env)
//	-audit-log           AGENTBOX_AUDIT_LOG           off
//	-python              AGENTBOX_PYTHON              python3, looked up in the commands' PATH
//	-mcp-servers         AGENTBOX_MCP_SERVERS         none (a JSON file: [{"name", "command", "args", "env", "dir"}])
//	-env-dir             AGENTBOX_ENV_DIR             $TMPDIR/agentbox-envs (cached Python environments; empty: none)
//	-env-max-size        AGENTBOX_ENV_MAX_SIZE        2GiB (with -env-max-count, 8: LRU eviction past either)
//	-python-index        AGENTBOX_PYTHON_INDEX        the installer's default (PyPI, through the egress proxy)
//	-python-extra-indexes AGENTBOX_PYTHON_EXTRA_INDEXES none (comma-separated)
//	-python-allowed-packages AGENTBOX_PYTHON_ALLOWED_PACKAGES all (comma-separated project names)
//	-uv                  AGENTBOX_UV                  uv, looked up in the commands' PATH; pip if absent
//	-command-pids-limit  AGENTBOX_COMMAND_PIDS_LIMIT  1024 (RLIMIT_NPROC of commands; -1: none)
//	-memory-limit        AGENTBOX_MEMORY_LIMIT        off (the pod's memory limit; the controller sets it)
//	-memory-reserve      AGENTBOX_MEMORY_RESERVE      the larger of 96MiB and an eighth of -memory-limit
//	-health-listen       AGENTBOX_HEALTH_LISTEN       off (plain HTTP, /livez and /healthz only; the controller sets 127.0.0.1:8444)
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
	"math"
	"net"
	"net/http"
	"os"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
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

type options struct {
	listen           string
	insecureListen   string
	healthListen     string
	tlsDir           string
	trustDomain      string
	allowedClientIDs []string
	workdir          string
	workspace        string
	workspaceCap     int64
	pidsLimit        int
	memoryLimit      int64
	memoryReserve    int64
	maxTimeout       time.Duration
	maxConcurrent    int
	maxQueued        int
	queueWait        time.Duration
	maxProcesses     int
	passEnv          []string
	shutdownGrace    time.Duration
	killGrace        time.Duration
	auditLog         string
	python           string
	mcpServers       string
	mcpServersJSON   string
	pythonTimeout    time.Duration
	pythonMaxTimeout time.Duration
	envDir           string
	envMaxCount      int
	envMaxSize       int64
	envCreateTimeout time.Duration
	pythonIndex      string
	pythonExtra      []string
	pythonAllowed    []string
	uv               string
	reapOrphans      bool
	logLevel         slog.Level
	showVersion      bool
	probe            bool
	probeTimeout     time.Duration
}

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

func parseOptions(args []string, getenv func(string) string, out io.Writer) (*options, error) {
	env := func(key, def string) string {
		if v := getenv(key); v != "" {
			return v
		}
		return def
	}
	fs := flag.NewFlagSet("agentbox-supervisor", flag.ContinueOnError)
	fs.SetOutput(out)
	o := &options{}
	var allowed, passEnv, logLevel, workspaceCap, envMaxSize, pythonExtra, pythonAllowed string
	var pythonTimeout, pythonMaxTimeout string
	var pidsLimit, memoryLimit, memoryReserve string
	fs.StringVar(&o.listen, "listen", env("AGENTBOX_LISTEN", fmt.Sprintf(":%d", supervisorapi.DefaultPort)), "HTTPS (mTLS) listen address")
	fs.StringVar(&o.insecureListen, "insecure-listen", "", "serve plain HTTP without client authentication on this loopback address instead of HTTPS; for local debugging only")
	fs.StringVar(&o.healthListen, "health-listen", env("AGENTBOX_HEALTH_LISTEN", ""), "optional plain-HTTP address serving only GET /livez and /healthz, for probes (which cannot present a client certificate); the controller sets a loopback one")
	fs.BoolVar(&o.probe, "probe", false, "instead of serving, call GET /livez on -health-listen (a loopback address when its host is empty or unspecified) and exit 0 if the supervisor answered, 1 if not: the sandbox pod's liveness probe")
	fs.DurationVar(&o.probeTimeout, "probe-timeout", 5*time.Second, "how long -probe waits for the answer")
	fs.StringVar(&o.tlsDir, "tls-dir", env("AGENTBOX_TLS_DIR", "/etc/agentbox/tls"), "directory holding tls.crt, tls.key and ca.crt")
	fs.StringVar(&o.trustDomain, "trust-domain", env("AGENTBOX_TRUST_DOMAIN", pki.DefaultTrustDomain), "SPIFFE trust domain")
	fs.StringVar(&allowed, "allowed-client-ids", env("AGENTBOX_ALLOWED_CLIENT_IDS", ""), "comma-separated SPIFFE IDs allowed to call (default: the control plane in AGENTBOX_NAMESPACE)")
	fs.StringVar(&o.workdir, "workdir", env("AGENTBOX_WORKDIR", ""), "default working directory of commands (default /workspace if it exists, else the current directory)")
	fs.StringVar(&o.workspace, "workspace", env("AGENTBOX_WORKSPACE", ""), "directory served by the file endpoints; no file path can leave it (default: -workdir if set, else /workspace, and no file endpoints if that does not exist)")
	fs.StringVar(&workspaceCap, "workspace-cap", env("AGENTBOX_WORKSPACE_CAP", "1GiB"), "largest total size of the files in the workspace, in bytes or with a KiB, MiB, GiB (or KB, MB, GB) suffix; file writes past it fail")
	fs.DurationVar(&o.maxTimeout, "max-timeout", supervisor.DefaultMaxTimeout, "largest timeout a command may ask for")
	fs.IntVar(&o.maxConcurrent, "max-concurrent", supervisor.DefaultMaxConcurrentCommands, "commands allowed to run at once")
	fs.IntVar(&o.maxQueued, "max-queued", supervisor.DefaultMaxQueuedCommands, "commands that may wait for one of the -max-concurrent slots; negative: none wait")
	fs.DurationVar(&o.queueWait, "queue-wait", supervisor.DefaultCommandQueueWait, "how long a command waits for a slot before it is refused")
	fs.IntVar(&o.maxProcesses, "max-processes", supervisor.DefaultMaxProcesses, "background processes allowed to exist at once")
	fs.StringVar(&passEnv, "pass-env", env("AGENTBOX_PASS_ENV", strings.Join(supervisor.DefaultPassEnv, ",")), "variables passed from this process's environment to every process it starts (commands, python_exec, execute, terminals, MCP servers): comma-separated, or a JSON array of names; none may start with "+supervisorapi.ReservedEnvPrefix)
	fs.DurationVar(&o.shutdownGrace, "shutdown-grace", 25*time.Second, "how long running commands may finish after SIGTERM before they are sent SIGTERM themselves")
	fs.DurationVar(&o.killGrace, "kill-grace", 3*time.Second, "how long commands sent SIGTERM at shutdown, or background processes stopped by a call, may take to exit before they are killed")
	fs.StringVar(&pidsLimit, "command-pids-limit", env("AGENTBOX_COMMAND_PIDS_LIMIT", strconv.Itoa(supervisor.DefaultCommandPidsLimit)), "RLIMIT_NPROC of every command: tasks the sandbox's user may have before a command's fork fails; -1 for none")
	fs.StringVar(&memoryLimit, "memory-limit", env("AGENTBOX_MEMORY_LIMIT", ""), "the pod's memory limit, as -workspace-cap; when set, the command holding the most memory is killed before the sandbox reaches it (default: off)")
	fs.StringVar(&memoryReserve, "memory-reserve", env("AGENTBOX_MEMORY_RESERVE", ""), "memory kept back under -memory-limit for the sandbox kernel, as -workspace-cap (default: the larger of 96MiB and an eighth of the limit)")
	fs.StringVar(&o.auditLog, "audit-log", env("AGENTBOX_AUDIT_LOG", ""), "append one JSON line per call to this file (default: no audit log)")
	fs.StringVar(&o.python, "python", env("AGENTBOX_PYTHON", supervisor.DefaultPython), "interpreter for python_exec: a name looked up in the commands' PATH, or a path")
	fs.StringVar(&o.mcpServersJSON, "mcp-servers-json", env("AGENTBOX_MCP_SERVERS_JSON", ""), "the same list as -mcp-servers, given inline as JSON (the control plane sets it from the template); not with -mcp-servers")
	fs.StringVar(&pythonTimeout, "python-default-timeout", env("AGENTBOX_PYTHON_DEFAULT_TIMEOUT", supervisor.DefaultPythonTimeout.String()), "timeout of python_exec calls that give none")
	fs.StringVar(&pythonMaxTimeout, "python-max-timeout", env("AGENTBOX_PYTHON_MAX_TIMEOUT", supervisor.DefaultPythonMaxTimeout.String()), "largest timeout a python_exec call may ask for")
	fs.StringVar(&o.mcpServers, "mcp-servers", env("AGENTBOX_MCP_SERVERS", ""), "JSON file listing the template's stdio MCP servers ([{name, command, args, env, dir}]), started on boot and served at /mcp (default: none)")
	fs.StringVar(&o.envDir, "env-dir", env("AGENTBOX_ENV_DIR", filepath.Join(os.TempDir(), "agentbox-envs")), "directory of the cached Python environments (/v1/envs, /v1/execute); empty turns them off")
	fs.IntVar(&o.envMaxCount, "env-max-count", pyenv.DefaultMaxEnvs, "cached Python environments kept; past it the least recently used idle one is removed")
	fs.StringVar(&envMaxSize, "env-max-size", env("AGENTBOX_ENV_MAX_SIZE", "2GiB"), "disk the cached Python environments may use together, as -workspace-cap; past it the least recently used idle ones are removed")
	fs.DurationVar(&o.envCreateTimeout, "env-create-timeout", pyenv.DefaultCreateTimeout, "longest a Python environment may take to build")
	fs.StringVar(&o.pythonIndex, "python-index", env("AGENTBOX_PYTHON_INDEX", ""), "package index (PEP 503 simple URL) environments install from (default: the installer's own)")
	fs.StringVar(&pythonExtra, "python-extra-indexes", env("AGENTBOX_PYTHON_EXTRA_INDEXES", ""), "comma-separated extra package indexes")
	fs.StringVar(&pythonAllowed, "python-allowed-packages", env("AGENTBOX_PYTHON_ALLOWED_PACKAGES", ""), "comma-separated projects environments may install, dependencies included (default: any)")
	fs.StringVar(&o.uv, "uv", env("AGENTBOX_UV", "uv"), "uv to build environments with, looked up in the commands' PATH; when absent (or empty) venv and pip are used")
	fs.BoolVar(&o.reapOrphans, "reap-orphans", os.Getpid() == 1, "reap orphaned processes (on by default when running as PID 1)")
	fs.StringVar(&logLevel, "log-level", env("AGENTBOX_LOG_LEVEL", "info"), "debug, info, warn or error")
	fs.BoolVar(&o.showVersion, "version", false, "print the version and exit")
	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	if fs.NArg() > 0 {
		return nil, fmt.Errorf("unexpected arguments: %q", fs.Args())
	}
	if o.shutdownGrace < 0 || o.killGrace <= 0 {
		return nil, fmt.Errorf("-shutdown-grace must not be negative and -kill-grace must be positive")
	}
	if err := o.logLevel.UnmarshalText([]byte(logLevel)); err != nil {
		return nil, fmt.Errorf("-log-level: %w", err)
	}
	var err error
	if o.workspace == "" {
		// The controller sets AGENTBOX_WORKDIR to the template's workspace
		// mount, which need not be /workspace; the files are served from
		// the same place commands run.
		o.workspace = o.workdir
	}
	if o.workspaceCap, err = parseSize(workspaceCap); err != nil {
		return nil, fmt.Errorf("-workspace-cap: %w", err)
	}
	if o.pidsLimit, err = strconv.Atoi(pidsLimit); err != nil || o.pidsLimit == 0 || o.pidsLimit < -1 {
		return nil, fmt.Errorf("-command-pids-limit: want a positive count or -1 for none, got %q", pidsLimit)
	}
	for _, f := range []struct {
		name, value string
		to          *int64
	}{{"-memory-limit", memoryLimit, &o.memoryLimit}, {"-memory-reserve", memoryReserve, &o.memoryReserve}} {
		if f.value == "" {
			continue
		}
		if *f.to, err = parseSize(f.value); err != nil {
			return nil, fmt.Errorf("%s: %w", f.name, err)
		}
	}
	if o.envMaxSize, err = parseSize(envMaxSize); err != nil {
		return nil, fmt.Errorf("-env-max-size: %w", err)
	}
	if o.envMaxCount <= 0 || o.envCreateTimeout <= 0 {
		return nil, fmt.Errorf("-env-max-count and -env-create-timeout must be positive")
	}
	o.pythonExtra, o.pythonAllowed = splitList(pythonExtra), splitList(pythonAllowed)
	if o.pythonTimeout, err = time.ParseDuration(pythonTimeout); err != nil || o.pythonTimeout <= 0 {
		return nil, fmt.Errorf("-python-default-timeout: want a positive duration such as 30s, got %q", pythonTimeout)
	}
	if o.pythonMaxTimeout, err = time.ParseDuration(pythonMaxTimeout); err != nil || o.pythonMaxTimeout <= 0 {
		return nil, fmt.Errorf("-python-max-timeout: want a positive duration such as 120s, got %q", pythonMaxTimeout)
	}
	// The template API promises that a default above the cap is cut to
	// it, so that lowering only the cap is enough.
	o.pythonTimeout = min(o.pythonTimeout, o.pythonMaxTimeout)
	if o.passEnv, err = supervisor.ParseEnvNames(passEnv); err != nil {
		return nil, fmt.Errorf("-pass-env: %w", err)
	}
	if err := supervisor.CheckPassEnv(o.passEnv); err != nil {
		return nil, fmt.Errorf("-pass-env: %w", err)
	}

	o.allowedClientIDs = splitList(allowed)
	if len(o.allowedClientIDs) == 0 {
		ns := env("AGENTBOX_NAMESPACE", defaultPlatformNamespace)
		o.allowedClientIDs = []string{pki.ControlPlaneID(o.trustDomain, ns).String()}
	}
	for _, id := range o.allowedClientIDs {
		if _, err := pki.ParseID(id); err != nil {
			return nil, fmt.Errorf("-allowed-client-ids: %w", err)
		}
	}
	if o.insecureListen != "" {
		addr, err := loopbackOnly(o.insecureListen)
		if err != nil {
			return nil, err
		}
		o.insecureListen = addr
	}
	return o, nil
}

// parseSize parses a byte count such as "1073741824", "1GiB" or "500MB".
func parseSize(s string) (int64, error) {
	s = strings.TrimSpace(s)
	units := []struct {
		suffix string
		mult   int64
	}{
		{"KiB", 1 << 10}, {"MiB", 1 << 20}, {"GiB", 1 << 30}, {"TiB", 1 << 40},
		{"KB", 1e3}, {"MB", 1e6}, {"GB", 1e9}, {"TB", 1e12}, {"B", 1},
	}
	mult := int64(1)
	for _, u := range units {
		if strings.HasSuffix(s, u.suffix) {
			s, mult = strings.TrimSpace(strings.TrimSuffix(s, u.suffix)), u.mult
			break
		}
	}
	n, err := strconv.ParseInt(s, 10, 64)
	if err != nil {
		return 0, fmt.Errorf("size %q: %w", s, err)
	}
	if n <= 0 || n > math.MaxInt64/mult {
		return 0, fmt.Errorf("size %q is out of range", s)
	}
	return n * mult, nil
}

func splitList(s string) []string {
	var out []string
	for _, f := range strings.Split(s, ",") {
		if f = strings.TrimSpace(f); f != "" {
			out = append(out, f)
		}
	}
	return out
}

// loopbackOnly refuses any address another host could reach: without TLS,
// anyone who can connect can run commands.
func loopbackOnly(addr string) (string, error) {
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return "", fmt.Errorf("-insecure-listen %q: %w", addr, err)
	}
	if host == "localhost" {
		// Resolving the name could yield a routable address.
		host = "127.0.0.1"
	}
	if ip := net.ParseIP(host); ip == nil || !ip.IsLoopback() {
		return "", fmt.Errorf("-insecure-listen %q: refusing a non-loopback address; use 127.0.0.1, [::1] or localhost", addr)
	}
	return net.JoinHostPort(host, port), nil
}

func run(ctx context.Context, o *options, log *slog.Logger) error {
	if o.reapOrphans {
		// Not ctx: orphans still need reaping during the shutdown grace.
		if err := supervisor.StartReaper(context.Background(), log); err != nil {
			return err
		}
	}
	var audit *supervisor.AuditLog
	if o.auditLog != "" {
		var err error
		if audit, err = supervisor.OpenAuditLog(o.auditLog); err != nil {
			return err
		}
		// Runs after every other deferred step of the shutdown below, once
		// no request can still be recording.
		defer func() {
			if err := audit.Close(); err != nil {
				log.Error("closing the audit log failed", "error", err.Error())
				return
			}
			log.Info("audit log closed", "path", o.auditLog)
		}()
	}
	var tlsConfig *tls.Config
	var self string
	if o.insecureListen == "" {
		var err error
		if tlsConfig, self, err = loadTLS(o.tlsDir, o.allowedClientIDs); err != nil {
			return err
		}
		log.Info("loaded TLS identity", "identity", self, "allowed_client_ids", o.allowedClientIDs)
	}
	mcpServers, err := newMCPManager(o, log)
	if err != nil {
		return err
	}
	handler, err := supervisor.New(supervisor.Config{
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
		Audit:                 audit,
		Version:               version,
		Logger:                log,
	})
	if err != nil {
		return err
	}
	defer handler.Close()
	if mcpServers != nil {
		// Started on boot, not on the first call, so that the tool
		// catalog is ready when the control plane asks for it. Stopped
		// once the HTTP server has (defers run in reverse), before the
		// audit log is closed.
		mcpServers.Start(context.Background())
		defer func() {
			ctx, cancel := context.WithTimeout(context.Background(), o.killGrace+5*time.Second)
			defer cancel()
			if err := mcpServers.Stop(ctx); err != nil {
				log.Error("MCP servers did not stop", "error", err.Error())
			}
		}()
		log.Info("starting MCP servers", "servers", mcpServers.Names())
	}

	addr := o.listen
	if o.insecureListen != "" {
		addr = o.insecureListen
		log.Warn("serving plain HTTP without client authentication; for local debugging only", "addr", addr)
	}

	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return fmt.Errorf("listen: %w", err)
	}
	// Request contexts derive from base; cancelling it kills the process
	// groups of commands still running when the grace period ends.
	base, cancelBase := context.WithCancel(context.Background())
	defer cancelBase()
	srv := &http.Server{
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
	serveErr := make(chan error, 2)
	go func() {
		if tlsConfig != nil {
			serveErr <- srv.ServeTLS(ln, "", "")
		} else {
			serveErr <- srv.Serve(ln)
		}
	}()
	log.Info("listening", "addr", ln.Addr().String(), "tls", tlsConfig != nil, "version", version, "workdir", handler.DefaultCwd(),
		"workspace", handler.Workspace(), "workspace_cap", o.workspaceCap)

	var health *http.Server
	if o.healthListen != "" {
		hln, err := net.Listen("tcp", o.healthListen)
		if err != nil {
			_ = srv.Close()
			return fmt.Errorf("listen for health checks: %w", err)
		}
		health = &http.Server{Handler: healthOnly(handler), ReadHeaderTimeout: 5 * time.Second, WriteTimeout: 5 * time.Second}
		go func() { serveErr <- health.Serve(hln) }()
		log.Info("serving health checks", "addr", hln.Addr().String())
	}

	select {
	case err := <-serveErr:
		_ = srv.Close()
		if health != nil {
			_ = health.Close()
		}
		return fmt.Errorf("serve: %w", err)
	case <-ctx.Done():
	}

	log.Info("shutting down", "grace", o.shutdownGrace.String(), "kill_grace", o.killGrace.String())
	if health != nil {
		_ = health.Close()
	}
	if err := stop(srv, handler, cancelBase, o.shutdownGrace, o.killGrace, log); err != nil {
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
// supervisor's.
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
	for _, k := range o.passEnv {
		if v, ok := os.LookupEnv(k); ok {
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
			AllowedPackages: o.pythonAllowed,
			MaxEnvs:         o.envMaxCount,
			MaxBytes:        o.envMaxSize,
			CreateTimeout:   o.envCreateTimeout,
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
