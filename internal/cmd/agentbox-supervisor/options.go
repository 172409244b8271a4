package main

import (
	"flag"
	"fmt"
	"io"
	"log/slog"
	"math"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/agentbox/terraform-provider-agentbox/internal/pki"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/pyenv"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"
)

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
	envTTL           time.Duration
	pythonIndex      string
	pythonExtra      []string
	pythonTrusted    []string
	pythonAllowed    []string
	uv               string
	reapOrphans      bool
	warmUp           bool
	idleTrim         time.Duration
	logLevel         slog.Level
	showVersion      bool
	probe            bool
	probeTimeout     time.Duration
	install          string
	// With -install: the workspace to reset for a reused warm sandbox,
	// and the seal key to hand over to the supervisor.
	resetWorkspace string
	sealKeyFrom    string
	sealKeyTo      string
	envSealKeyFile string
	sealKey        []byte
}

// rawFlags are the flags whose values are parsed after the flag set has
// read them: sizes, lists, durations with their own messages.
type rawFlags struct {
	allowed, passEnv, logLevel, workspaceCap, envMaxSize, pythonExtra, pythonAllowed string
	envMaxCount, envTTL                                                              string
	pythonTimeout, pythonMaxTimeout                                                  string
	pidsLimit, memoryLimit, memoryReserve                                            string
	pythonTrusted                                                                    string
	warmUp, idleTrim                                                                 string
}

// parseOptions reads the flags, each of which defaults to its environment
// variable (getenv), and checks them.
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
	var raw rawFlags
	defineFlags(fs, env, o, &raw)
	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	if fs.NArg() > 0 {
		return nil, fmt.Errorf("unexpected arguments: %q", fs.Args())
	}
	for _, step := range []func(*rawFlags) error{o.parseLimits, o.parsePython, o.parsePassEnv} {
		if err := step(&raw); err != nil {
			return nil, err
		}
	}
	if err := o.parseClients(raw.allowed, env); err != nil {
		return nil, err
	}
	return o, nil
}

// defineFlags defines every flag on fs, into o or, for those parsed
// later, raw.
func defineFlags(fs *flag.FlagSet, env func(key, def string) string, o *options, raw *rawFlags) {
	fs.StringVar(&o.listen, "listen", env("AGENTBOX_LISTEN", fmt.Sprintf(":%d", supervisorapi.DefaultPort)), "HTTPS (mTLS) listen address")
	fs.StringVar(&o.insecureListen, "insecure-listen", "", "serve plain HTTP without client authentication on this loopback address instead of HTTPS; for local debugging only")
	fs.StringVar(&o.healthListen, "health-listen", env("AGENTBOX_HEALTH_LISTEN", ""), "optional plain-HTTP address serving only GET /livez and /healthz, for probes (which cannot present a client certificate); the controller sets a loopback one")
	fs.BoolVar(&o.probe, "probe", false, "instead of serving, call GET /livez on -health-listen (a loopback address when its host is empty or unspecified) and exit 0 if the supervisor answered, 1 if not: the sandbox pod's liveness probe")
	fs.DurationVar(&o.probeTimeout, "probe-timeout", 5*time.Second, "how long -probe waits for the answer")
	fs.StringVar(&o.tlsDir, "tls-dir", env("AGENTBOX_TLS_DIR", "/etc/agentbox/tls"), "directory holding tls.crt, tls.key and ca.crt")
	fs.StringVar(&o.trustDomain, "trust-domain", env("AGENTBOX_TRUST_DOMAIN", pki.DefaultTrustDomain), "SPIFFE trust domain")
	fs.StringVar(&raw.allowed, "allowed-client-ids", env("AGENTBOX_ALLOWED_CLIENT_IDS", ""), "comma-separated SPIFFE IDs allowed to call (default: the control plane in AGENTBOX_NAMESPACE)")
	fs.StringVar(&o.workdir, "workdir", env("AGENTBOX_WORKDIR", ""), "default working directory of commands (default /workspace if it exists, else the current directory)")
	fs.StringVar(&o.workspace, "workspace", env("AGENTBOX_WORKSPACE", ""), "directory served by the file endpoints; no file path can leave it (default: -workdir if set, else /workspace, and no file endpoints if that does not exist)")
	fs.StringVar(&raw.workspaceCap, "workspace-cap", env("AGENTBOX_WORKSPACE_CAP", "1GiB"), "largest total size of the files in the workspace, in bytes or with a KiB, MiB, GiB (or KB, MB, GB) suffix; file writes past it fail")
	fs.DurationVar(&o.maxTimeout, "max-timeout", supervisor.DefaultMaxTimeout, "largest timeout a command may ask for")
	fs.IntVar(&o.maxConcurrent, "max-concurrent", supervisor.DefaultMaxConcurrentCommands, "commands allowed to run at once")
	fs.IntVar(&o.maxQueued, "max-queued", supervisor.DefaultMaxQueuedCommands, "commands that may wait for one of the -max-concurrent slots; negative: none wait")
	fs.DurationVar(&o.queueWait, "queue-wait", supervisor.DefaultCommandQueueWait, "how long a command waits for a slot before it is refused")
	fs.IntVar(&o.maxProcesses, "max-processes", supervisor.DefaultMaxProcesses, "background processes allowed to exist at once")
	fs.StringVar(&raw.passEnv, "pass-env", env("AGENTBOX_PASS_ENV", strings.Join(supervisor.DefaultPassEnv, ",")), "variables passed from this process's environment to every process it starts (commands, python_exec, execute, terminals, MCP servers): comma-separated, or a JSON array of names, none of them GODEBUG or starting with "+supervisorapi.ReservedEnvPrefix+"; or "+supervisor.PassAllEnv+" alone for the whole environment except GODEBUG, "+supervisorapi.ReservedEnvPrefix+"*, KUBERNETES_SERVICE_* and KUBERNETES_PORT* (an image's own ENV reaches commands so); PATH falls back to the default when the environment has none")
	fs.DurationVar(&o.shutdownGrace, "shutdown-grace", 25*time.Second, "how long running commands may finish after SIGTERM before they are sent SIGTERM themselves")
	fs.DurationVar(&o.killGrace, "kill-grace", 3*time.Second, "how long commands sent SIGTERM at shutdown, or background processes stopped by a call, may take to exit before they are killed")
	fs.StringVar(&raw.pidsLimit, "command-pids-limit", env("AGENTBOX_COMMAND_PIDS_LIMIT", ""), "RLIMIT_NPROC of every command: tasks the sandbox's user may have before a command's fork fails; -1 for none (default: "+strconv.Itoa(supervisor.DefaultCommandPidsLimit)+", or with -memory-limit what that memory holds at about 0.63 MiB a process, at least 64)")
	fs.StringVar(&raw.memoryLimit, "memory-limit", env("AGENTBOX_MEMORY_LIMIT", ""), "the pod's memory limit, as -workspace-cap; when set, the command holding the most memory is killed before the sandbox reaches it (default: off)")
	fs.StringVar(&raw.memoryReserve, "memory-reserve", env("AGENTBOX_MEMORY_RESERVE", ""), "memory kept back under -memory-limit for the sandbox kernel, as -workspace-cap (default: the larger of 96MiB and an eighth of the limit)")
	fs.StringVar(&o.auditLog, "audit-log", env("AGENTBOX_AUDIT_LOG", ""), "append one JSON line per call to this file (default: no audit log)")
	fs.StringVar(&o.python, "python", env("AGENTBOX_PYTHON", supervisor.DefaultPython), "interpreter for python_exec: a name looked up in the commands' PATH, or a path")
	fs.StringVar(&o.mcpServersJSON, "mcp-servers-json", env("AGENTBOX_MCP_SERVERS_JSON", ""), "the same list as -mcp-servers, given inline as JSON (the control plane sets it from the template); not with -mcp-servers")
	fs.StringVar(&raw.pythonTimeout, "python-default-timeout", env("AGENTBOX_PYTHON_DEFAULT_TIMEOUT", supervisor.DefaultPythonTimeout.String()), "timeout of python_exec calls that give none")
	fs.StringVar(&raw.pythonMaxTimeout, "python-max-timeout", env("AGENTBOX_PYTHON_MAX_TIMEOUT", supervisor.DefaultPythonMaxTimeout.String()), "largest timeout a python_exec call may ask for")
	fs.StringVar(&o.mcpServers, "mcp-servers", env("AGENTBOX_MCP_SERVERS", ""), "JSON file listing the template's stdio MCP servers ([{name, command, args, env, dir}]), started on boot and served at /mcp (default: none)")
	fs.StringVar(&o.envDir, "env-dir", env("AGENTBOX_ENV_DIR", filepath.Join(os.TempDir(), "agentbox-envs")), "directory of the cached Python environments (/v1/envs, /v1/execute); empty turns them off")
	fs.StringVar(&raw.envMaxCount, "env-max-count", env("AGENTBOX_ENV_MAX_COUNT", strconv.Itoa(pyenv.DefaultMaxEnvs)), "cached Python environments kept; past it the least recently used idle one is removed")
	fs.StringVar(&raw.envTTL, "env-ttl", env("AGENTBOX_ENV_TTL", "0s"), "an idle cached Python environment unused for longer than this is removed; 0 for never (the count and size limits still evict)")
	fs.StringVar(&raw.envMaxSize, "env-max-size", env("AGENTBOX_ENV_MAX_SIZE", "2GiB"), "disk the cached Python environments may use together, as -workspace-cap; past it the least recently used idle ones are removed")
	fs.DurationVar(&o.envCreateTimeout, "env-create-timeout", pyenv.DefaultCreateTimeout, "longest a Python environment may take to build")
	fs.StringVar(&o.pythonIndex, "python-index", env("AGENTBOX_PYTHON_INDEX", ""), "package index (PEP 503 simple URL) environments install from (default: the installer's own)")
	fs.StringVar(&raw.pythonExtra, "python-extra-indexes", env("AGENTBOX_PYTHON_EXTRA_INDEXES", ""), "comma-separated extra package indexes")
	fs.StringVar(&raw.pythonTrusted, "python-trusted-hosts", env("AGENTBOX_PYTHON_TRUSTED_HOSTS", ""), "comma-separated index hosts (host or host:port) installs may reach over plain HTTP")
	fs.StringVar(&raw.pythonAllowed, "python-allowed-packages", env("AGENTBOX_PYTHON_ALLOWED_PACKAGES", ""), "comma-separated projects environments may install, dependencies included (default: any)")
	fs.StringVar(&o.uv, "uv", env("AGENTBOX_UV", "uv"), "uv to build environments with, looked up in the commands' PATH; when absent (or empty) venv and pip are used")
	fs.StringVar(&raw.warmUp, "warm-up", env("AGENTBOX_WARM_UP", "true"), "before listening, run a throwaway `true` along the path a command takes, so that the first command costs what later ones do; false: the first command pays")
	fs.StringVar(&raw.idleTrim, "idle-trim", env("AGENTBOX_IDLE_TRIM", supervisor.DefaultIdleTrim.String()), "once no call has been served for this long, return the memory calls freed to the system; 0 for never (Go's scavenger then returns it slowly)")
	fs.BoolVar(&o.reapOrphans, "reap-orphans", os.Getpid() == 1, "reap orphaned processes (on by default when running as PID 1)")
	fs.StringVar(&raw.logLevel, "log-level", env("AGENTBOX_LOG_LEVEL", "info"), "debug, info, warn or error")
	fs.BoolVar(&o.showVersion, "version", false, "print the version and exit")
	fs.StringVar(&o.resetWorkspace, "reset-workspace", "", "with -install: empty this workspace for a reused warm sandbox, keeping only the cached Python environments whose seal verifies, and fail if it cannot")
	fs.StringVar(&o.sealKeyFrom, "seal-key-from", "", "with -install: the environment seal key's file, copied to -seal-key-to and used by -reset-workspace")
	fs.StringVar(&o.sealKeyTo, "seal-key-to", "", "with -install: where to copy the environment seal key for the supervisor")
	fs.StringVar(&o.envSealKeyFile, "env-seal-key-file", env("AGENTBOX_ENV_SEAL_KEY_FILE", ""), "file holding the key that seals cached environments; read and removed at start")
	fs.StringVar(&o.install, "install", "", "instead of serving, copy this executable into DIR/agentbox-supervisor (mode 0755, complete or not at all) and exit: how a sandbox pod's init container gives an image without the supervisor one")
}

// parseLimits checks the graces and the log level, and parses the sizes
// and counts of the workspace, commands and environments.
func (o *options) parseLimits(raw *rawFlags) error {
	var err error
	if o.shutdownGrace < 0 || o.killGrace <= 0 {
		return fmt.Errorf("-shutdown-grace must not be negative and -kill-grace must be positive")
	}
	if err := o.logLevel.UnmarshalText([]byte(raw.logLevel)); err != nil {
		return fmt.Errorf("-log-level: %w", err)
	}
	if o.workspace == "" {
		// The controller sets AGENTBOX_WORKDIR to the template's workspace
		// mount, which need not be /workspace; the files are served from
		// the same place commands run.
		o.workspace = o.workdir
	}
	if o.workspaceCap, err = parseSize(raw.workspaceCap); err != nil {
		return fmt.Errorf("-workspace-cap: %w", err)
	}
	if raw.pidsLimit != "" {
		if o.pidsLimit, err = strconv.Atoi(raw.pidsLimit); err != nil || o.pidsLimit == 0 || o.pidsLimit < -1 {
			return fmt.Errorf("-command-pids-limit: want a positive count or -1 for none, got %q", raw.pidsLimit)
		}
	}
	for _, f := range []struct {
		name, value string
		to          *int64
	}{{"-memory-limit", raw.memoryLimit, &o.memoryLimit}, {"-memory-reserve", raw.memoryReserve, &o.memoryReserve}} {
		if f.value == "" {
			continue
		}
		if *f.to, err = parseSize(f.value); err != nil {
			return fmt.Errorf("%s: %w", f.name, err)
		}
	}
	if o.envMaxSize, err = parseSize(raw.envMaxSize); err != nil {
		return fmt.Errorf("-env-max-size: %w", err)
	}
	if o.envMaxCount, err = strconv.Atoi(raw.envMaxCount); err != nil {
		return fmt.Errorf("-env-max-count: want a positive count, got %q", raw.envMaxCount)
	}
	if o.envTTL, err = time.ParseDuration(raw.envTTL); err != nil || o.envTTL < 0 {
		return fmt.Errorf("-env-ttl: want a duration such as 168h, or 0 for none, got %q", raw.envTTL)
	}
	if o.envMaxCount <= 0 || o.envCreateTimeout <= 0 {
		return fmt.Errorf("-env-max-count and -env-create-timeout must be positive")
	}
	if o.warmUp, err = strconv.ParseBool(raw.warmUp); err != nil {
		return fmt.Errorf("-warm-up: want true or false, got %q", raw.warmUp)
	}
	if o.idleTrim, err = time.ParseDuration(raw.idleTrim); err != nil || o.idleTrim < 0 {
		return fmt.Errorf("-idle-trim: want a duration such as 5s, or 0 for never, got %q", raw.idleTrim)
	}
	return nil
}

// parsePython parses python_exec's timeouts and the package lists.
func (o *options) parsePython(raw *rawFlags) error {
	var err error
	o.pythonExtra, o.pythonAllowed = splitList(raw.pythonExtra), splitList(raw.pythonAllowed)
	o.pythonTrusted = splitList(raw.pythonTrusted)
	if o.pythonTimeout, err = time.ParseDuration(raw.pythonTimeout); err != nil || o.pythonTimeout <= 0 {
		return fmt.Errorf("-python-default-timeout: want a positive duration such as 30s, got %q", raw.pythonTimeout)
	}
	if o.pythonMaxTimeout, err = time.ParseDuration(raw.pythonMaxTimeout); err != nil || o.pythonMaxTimeout <= 0 {
		return fmt.Errorf("-python-max-timeout: want a positive duration such as 120s, got %q", raw.pythonMaxTimeout)
	}
	// The template API promises that a default above the cap is cut to
	// it, so that lowering only the cap is enough.
	o.pythonTimeout = min(o.pythonTimeout, o.pythonMaxTimeout)
	return nil
}

// parsePassEnv parses and checks the variables passed to commands.
func (o *options) parsePassEnv(raw *rawFlags) error {
	var err error
	if o.passEnv, err = supervisor.ParseEnvNames(raw.passEnv); err != nil {
		return fmt.Errorf("-pass-env: %w", err)
	}
	if err := supervisor.CheckPassEnv(o.passEnv); err != nil {
		return fmt.Errorf("-pass-env: %w", err)
	}

	return nil
}

// parseClients parses the client IDs allowed to call, and checks the
// plain-HTTP address.
func (o *options) parseClients(allowed string, env func(key, def string) string) error {
	o.allowedClientIDs = splitList(allowed)
	if len(o.allowedClientIDs) == 0 {
		ns := env("AGENTBOX_NAMESPACE", defaultPlatformNamespace)
		o.allowedClientIDs = []string{pki.ControlPlaneID(o.trustDomain, ns).String()}
	}
	for _, id := range o.allowedClientIDs {
		if _, err := pki.ParseID(id); err != nil {
			return fmt.Errorf("-allowed-client-ids: %w", err)
		}
	}
	if o.insecureListen != "" {
		addr, err := loopbackOnly(o.insecureListen)
		if err != nil {
			return err
		}
		o.insecureListen = addr
	}
	return nil
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
