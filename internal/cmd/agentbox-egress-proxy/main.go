// Command agentbox-egress-proxy is the forward proxy sandbox traffic leaves
// through: plain HTTP and CONNECT, a domain allowlist and denylist, and a
// denied-CIDR check on the resolved address (see package egressproxy).
//
// Flags, each defaulting to an environment variable:
//
//	-listen                     AGENTBOX_EGRESS_LISTEN                     :3128
//	-allow                      AGENTBOX_EGRESS_ALLOW                      hosts allowed, repeatable or comma-separated; "*.example.com" for subdomains; empty allows nothing
//	-deny                       AGENTBOX_EGRESS_DENY                       hosts refused even if allowed
//	-deny-cidrs                 AGENTBOX_EGRESS_DENY_CIDRS                 replaces the default denied ranges (private, loopback, link-local, CGNAT, 198.18.0.0/15, metadata); '' denies no address
//	-config                     AGENTBOX_EGRESS_CONFIG                     policy file (YAML or JSON: allowedDomains, deniedDomains, deniedCIDRs, allowedCIDRs), added to the flags' lists and reloaded
//	-config-poll                AGENTBOX_EGRESS_CONFIG_POLL                how often the files are checked for changes, 5s
//	-upstream                   AGENTBOX_EGRESS_UPSTREAM                   http://host:port of a proxy to chain to
//	-upstream-credentials-file  AGENTBOX_EGRESS_UPSTREAM_CREDENTIALS_FILE  file holding user:password for the upstream, reloaded
//	-agent                      AGENTBOX_EGRESS_AGENT                      the agent served, for the access log
//	-client-credentials-file    AGENTBOX_EGRESS_CLIENT_CREDENTIALS_FILE    Shared mode: user:password per line; clients must authenticate and the user is logged as the agent; reloaded
//	-intercept-ca-cert-file     AGENTBOX_EGRESS_INTERCEPT_CA_CERT_FILE     PEM CA certificate the proxy issues certificates from for HTTPS destinations with credentials
//	-intercept-ca-key-file      AGENTBOX_EGRESS_INTERCEPT_CA_KEY_FILE      its private key
//	-destination-ca-file        AGENTBOX_EGRESS_DESTINATION_CA_FILE        PEM bundle that verifies those destinations instead of the system roots
//	-metrics-listen             AGENTBOX_EGRESS_METRICS_LISTEN             address for Prometheus /metrics; empty (the default) serves none
//	-log-level                  AGENTBOX_LOG_LEVEL                         info
//
// The policy file's credentials (see egressproxy.FileCredential) are added
// to requests bound for their hosts; HTTPS destinations with a credential
// are reached by terminating the sandbox's TLS with a certificate from the
// interception CA, which the sandbox trusts, and verifying the destination
// anew. Every other CONNECT stays a tunnel the proxy cannot read.
//
// SIGHUP, or a change to the content of -config or either credentials
// file, reloads all three (polled by content hash; see egressproxy.Reloader
// for why not inotify). A file that fails to load keeps what is in force
// and is logged; at startup it is fatal.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/agentbox/terraform-provider-agentbox/internal/egressproxy"
	"github.com/agentbox/terraform-provider-agentbox/internal/pki"
)

// version is set at build time with -ldflags "-X main.version=...".
var version = "dev"

type options struct {
	listen          string
	allow, deny     []string
	deniedCIDRs     []netip.Prefix // nil: the defaults
	configFile      string
	configPoll      time.Duration
	upstream        string
	credentialsFile string
	clientCredsFile string
	interceptCert   string
	interceptKey    string
	destinationCA   string
	agent           string
	metricsListen   string
	shutdownGrace   time.Duration
	logLevel        slog.Level
	showVersion     bool
}

func main() {
	opts, err := parseOptions(os.Args[1:], os.LookupEnv, os.Stderr)
	if errors.Is(err, flag.ErrHelp) {
		return
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "agentbox-egress-proxy:", err)
		os.Exit(2)
	}
	if opts.showVersion {
		fmt.Println(version)
		return
	}
	log := slog.New(slog.NewJSONHandler(os.Stderr, &slog.HandlerOptions{Level: opts.logLevel}))
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	if err := run(ctx, opts, log); err != nil {
		log.Error("egress proxy failed", "error", err.Error())
		os.Exit(1)
	}
}

// listFlag collects a flag given several times, each possibly a comma list.
type listFlag struct {
	vals *[]string
	set  bool
}

func (l *listFlag) String() string {
	if l.vals == nil {
		return ""
	}
	return strings.Join(*l.vals, ",")
}

func (l *listFlag) Set(s string) error {
	if !l.set {
		// The first use on the command line replaces the environment's value.
		*l.vals = nil
		l.set = true
	}
	*l.vals = append(*l.vals, splitList(s)...)
	return nil
}

// parseOptions takes os.LookupEnv rather than os.Getenv so that an empty
// AGENTBOX_EGRESS_DENY_CIDRS can mean "no denied ranges" rather than "unset".
func parseOptions(args []string, lookupEnv func(string) (string, bool), out io.Writer) (*options, error) {
	fs := flag.NewFlagSet("agentbox-egress-proxy", flag.ContinueOnError)
	fs.SetOutput(out)
	o, raw := defineFlags(fs, lookupEnv)
	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	if fs.NArg() > 0 {
		return nil, fmt.Errorf("unexpected arguments: %q", fs.Args())
	}
	if err := o.complete(raw); err != nil {
		return nil, err
	}
	return o, nil
}

// rawFlags are the flags that complete checks and converts after parsing.
type rawFlags struct {
	cidrs    []string
	cidrsSet bool
	poll     string
	logLevel string
}

// defineFlags defines every flag on fs, each defaulting to its
// environment variable.
func defineFlags(fs *flag.FlagSet, lookupEnv func(string) (string, bool)) (*options, *rawFlags) {
	env := func(key, def string) string {
		if v, ok := lookupEnv(key); ok {
			return v
		}
		return def
	}
	o := &options{
		allow: splitList(env("AGENTBOX_EGRESS_ALLOW", "")),
		deny:  splitList(env("AGENTBOX_EGRESS_DENY", "")),
	}
	raw := &rawFlags{}
	if v, ok := lookupEnv("AGENTBOX_EGRESS_DENY_CIDRS"); ok {
		raw.cidrs, raw.cidrsSet = splitList(v), true
	}
	fs.StringVar(&o.listen, "listen", env("AGENTBOX_EGRESS_LISTEN", ":3128"), "listen address")
	fs.Var(&listFlag{vals: &o.allow}, "allow", `hosts that may be reached, repeatable or comma-separated: "example.com", "*.example.com" (subdomains), an IP, or "*"; empty allows nothing`)
	fs.Var(&listFlag{vals: &o.deny}, "deny", "hosts refused even when allowed, same syntax")
	fs.Func("deny-cidrs", "comma-separated CIDRs no request may reach after DNS resolution; replaces the defaults ("+
		"private, loopback, link-local, CGNAT, 198.18.0.0/15, metadata); '' denies no address", func(s string) error {
		raw.cidrs, raw.cidrsSet = splitList(s), true
		return nil
	})
	fs.StringVar(&o.configFile, "config", env("AGENTBOX_EGRESS_CONFIG", ""), "policy file (YAML or JSON with allowedDomains, deniedDomains, deniedCIDRs), added to the flags' lists; reloaded on SIGHUP and on change")
	raw.poll = env("AGENTBOX_EGRESS_CONFIG_POLL", "5s")
	fs.StringVar(&raw.poll, "config-poll", raw.poll, "how often the config and credentials files are checked for changes")
	fs.StringVar(&o.upstream, "upstream", env("AGENTBOX_EGRESS_UPSTREAM", ""), "http://host:port of an upstream proxy that allowed requests go through")
	fs.StringVar(&o.credentialsFile, "upstream-credentials-file", env("AGENTBOX_EGRESS_UPSTREAM_CREDENTIALS_FILE", ""), "file holding user:password for the upstream proxy (a mounted Secret); reloaded like -config")
	fs.StringVar(&o.clientCredsFile, "client-credentials-file", env("AGENTBOX_EGRESS_CLIENT_CREDENTIALS_FILE", ""), "file of user:password lines clients must authenticate with (Shared mode); the user is logged as the agent; reloaded like -config")
	fs.StringVar(&o.interceptCert, "intercept-ca-cert-file", env("AGENTBOX_EGRESS_INTERCEPT_CA_CERT_FILE", ""), "PEM CA certificate for the certificates answering intercepted HTTPS (destinations with credentials); sandboxes must trust it")
	fs.StringVar(&o.interceptKey, "intercept-ca-key-file", env("AGENTBOX_EGRESS_INTERCEPT_CA_KEY_FILE", ""), "PEM private key of -intercept-ca-cert-file")
	fs.StringVar(&o.destinationCA, "destination-ca-file", env("AGENTBOX_EGRESS_DESTINATION_CA_FILE", ""), "PEM bundle verifying intercepted destinations instead of the system roots")
	fs.StringVar(&o.agent, "agent", env("AGENTBOX_EGRESS_AGENT", ""), "the agent this proxy serves, for the access log")
	fs.StringVar(&o.metricsListen, "metrics-listen", env("AGENTBOX_EGRESS_METRICS_LISTEN", ""), "address serving Prometheus /metrics (e.g. :9090); empty serves none")
	fs.DurationVar(&o.shutdownGrace, "shutdown-grace", 10*time.Second, "how long open requests and tunnels may continue after SIGTERM")
	fs.StringVar(&raw.logLevel, "log-level", env("AGENTBOX_LOG_LEVEL", "info"), "debug, info, warn or error")
	fs.BoolVar(&o.showVersion, "version", false, "print the version and exit")
	return o, raw
}

// complete checks the parsed flags and fills in the options they give as
// text.
func (o *options) complete(raw *rawFlags) error {
	if err := o.logLevel.UnmarshalText([]byte(raw.logLevel)); err != nil {
		return fmt.Errorf("-log-level: %w", err)
	}
	var err error
	if o.configPoll, err = time.ParseDuration(raw.poll); err != nil || o.configPoll <= 0 {
		return fmt.Errorf("-config-poll %q: want a positive duration", raw.poll)
	}
	if o.credentialsFile != "" && o.upstream == "" {
		return fmt.Errorf("-upstream-credentials-file needs -upstream")
	}
	if (o.interceptCert == "") != (o.interceptKey == "") {
		return fmt.Errorf("-intercept-ca-cert-file and -intercept-ca-key-file go together")
	}
	if raw.cidrsSet {
		p, err := egressproxy.ParseCIDRs(raw.cidrs)
		if err != nil {
			return fmt.Errorf("-deny-cidrs: %w", err)
		}
		o.deniedCIDRs = p // non-nil even when empty: "deny no address"
	}
	return nil
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

// run serves the proxy until ctx ends or a listener fails, then shuts
// down within the grace period.
func run(ctx context.Context, o *options, log *slog.Logger) error {
	proxy, err := newProxy(o, log)
	if err != nil {
		return err
	}
	defer proxy.Close()
	reloader := newReloader(o, proxy, log)
	if o.watchesFiles() {
		// At startup a broken file is fatal: there is no earlier policy
		// to fall back on, and the pod should not become ready.
		if err := reloader.Reload(); err != nil {
			return err
		}
	}
	ln, err := net.Listen("tcp", o.listen)
	if err != nil {
		return fmt.Errorf("listen: %w", err)
	}
	srv := newProxyServer(proxy, log)
	serveErr := make(chan error, 2)
	go func() { serveErr <- srv.Serve(ln) }()
	metricsSrv, metricsAddr, err := startMetrics(o.metricsListen, proxy, log, serveErr)
	if err != nil {
		srv.Close()
		return err
	}

	reloadNow, stopHUP := reloadOnSIGHUP(ctx)
	defer stopHUP()
	if o.watchesFiles() {
		go reloader.Run(ctx, o.configPoll, reloadNow)
	}
	logListening(log, o, proxy, ln.Addr().String(), metricsAddr)

	select {
	case err := <-serveErr:
		return fmt.Errorf("serve: %w", err)
	case <-ctx.Done():
	}
	return shutdown(log, o.shutdownGrace, srv, metricsSrv)
}

func newProxy(o *options, log *slog.Logger) (*egressproxy.Proxy, error) {
	cfg := egressproxy.Config{
		Allow:       o.allow,
		Deny:        o.deny,
		DeniedCIDRs: o.deniedCIDRs,
		Logger:      log,
		Agent:       o.agent,
		Upstream:    o.upstream,
	}
	// The CA and the bundle are read once: a new CA must reach the
	// sandboxes' trust stores too, which takes new pods anyway.
	if o.interceptCert != "" {
		certPEM, err := os.ReadFile(o.interceptCert)
		if err != nil {
			return nil, fmt.Errorf("interception CA: %w", err)
		}
		keyPEM, err := os.ReadFile(o.interceptKey)
		if err != nil {
			return nil, fmt.Errorf("interception CA: %w", err)
		}
		if cfg.InterceptCA, err = pki.LoadCA(certPEM, keyPEM); err != nil {
			return nil, fmt.Errorf("interception CA: %w", err)
		}
	}
	if o.destinationCA != "" {
		b, err := os.ReadFile(o.destinationCA)
		if err != nil {
			return nil, fmt.Errorf("-destination-ca-file: %w", err)
		}
		if cfg.DestinationRoots, err = pki.CertPoolFromPEM(b); err != nil {
			return nil, fmt.Errorf("-destination-ca-file: %w", err)
		}
	}
	return egressproxy.New(cfg)
}

func newReloader(o *options, proxy *egressproxy.Proxy, log *slog.Logger) *egressproxy.Reloader {
	return &egressproxy.Reloader{
		Proxy:                 proxy,
		Base:                  egressproxy.Policy{Allow: o.allow, Deny: o.deny, DeniedCIDRs: o.deniedCIDRs},
		ConfigFile:            o.configFile,
		CredentialsFile:       o.credentialsFile,
		ClientCredentialsFile: o.clientCredsFile,
		Log:                   log,
	}
}

// watchesFiles says whether any file the reloader keeps in force was given.
func (o *options) watchesFiles() bool {
	return o.configFile != "" || o.credentialsFile != "" || o.clientCredsFile != ""
}

func newProxyServer(proxy *egressproxy.Proxy, log *slog.Logger) *http.Server {
	return &http.Server{
		Handler:           proxy,
		ReadHeaderTimeout: 10 * time.Second,
		// No read or write timeout: tunnels and streamed downloads last
		// as long as they last.
		IdleTimeout: 2 * time.Minute,
		ErrorLog:    slog.NewLogLogger(log.Handler(), slog.LevelWarn),
	}
}

// startMetrics serves /metrics on addr, if one is given, reporting the
// server's end on serveErr. Metrics get their own listener so that the port
// sandboxes can reach serves proxying only, and NetworkPolicy can open the
// two separately.
func startMetrics(addr string, proxy *egressproxy.Proxy, log *slog.Logger, serveErr chan<- error) (*http.Server, string, error) {
	if addr == "" {
		return nil, "", nil
	}
	mln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, "", fmt.Errorf("metrics listen: %w", err)
	}
	mux := http.NewServeMux()
	mux.Handle("GET /metrics", proxy.MetricsHandler())
	metricsSrv := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second,
		ErrorLog: slog.NewLogLogger(log.Handler(), slog.LevelWarn)}
	go func() { serveErr <- fmt.Errorf("metrics: %w", metricsSrv.Serve(mln)) }()
	return metricsSrv, mln.Addr().String(), nil
}

// reloadOnSIGHUP turns each SIGHUP into a request on the returned channel,
// coalescing those that arrive while one is pending; stop ends the
// signal's delivery.
func reloadOnSIGHUP(ctx context.Context) (reloadNow <-chan struct{}, stop func()) {
	hup := make(chan os.Signal, 1)
	signal.Notify(hup, syscall.SIGHUP)
	now := make(chan struct{}, 1)
	go func() {
		for {
			select {
			case <-ctx.Done():
				return
			case <-hup:
				select {
				case now <- struct{}{}:
				default: // one is already pending
				}
			}
		}
	}()
	return now, func() { signal.Stop(hup) }
}

func logListening(log *slog.Logger, o *options, proxy *egressproxy.Proxy, addr, metricsAddr string) {
	pol := proxy.CurrentPolicy()
	// The upstream URL carries no credentials (they are refused there),
	// so it can be logged.
	log.Info("listening", "addr", addr, "version", version, "agent", o.agent,
		"allow", pol.Allow, "deny", pol.Deny, "denied_cidrs", len(pol.DeniedCIDRs),
		"upstream", o.upstream, "config", o.configFile, "client_auth", o.clientCredsFile != "",
		"intercept_ca", o.interceptCert != "", "credentials", proxy.CredentialNames(),
		"metrics_addr", metricsAddr)
	if len(pol.Allow) == 0 {
		log.Warn("the allowlist is empty: every request will be denied")
	}
}

// shutdown lets open requests finish within grace. Shutdown does not wait
// for hijacked CONNECT tunnels; they end with the process.
func shutdown(log *slog.Logger, grace time.Duration, srv, metricsSrv *http.Server) error {
	log.Info("shutting down", "grace", grace.String())
	sctx, cancel := context.WithTimeout(context.Background(), grace)
	defer cancel()
	if metricsSrv != nil {
		metricsSrv.Close()
	}
	if err := srv.Shutdown(sctx); err != nil && !errors.Is(err, context.DeadlineExceeded) {
		return err
	}
	return nil
}
