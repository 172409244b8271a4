// Command agentbox-egress-proxy is the forward proxy sandbox traffic leaves
// through: plain HTTP and CONNECT, a domain allowlist and denylist, and a
// denied-CIDR check on the resolved address (see package egressproxy).
//
// Flags, each defaulting to an environment variable:
//
//	-listen      AGENTBOX_EGRESS_LISTEN      :3128
//	-allow       AGENTBOX_EGRESS_ALLOW       hosts allowed, repeatable or comma-separated; "*.example.com" for subdomains; empty allows nothing
//	-deny        AGENTBOX_EGRESS_DENY        hosts refused even if allowed
//	-deny-cidrs  AGENTBOX_EGRESS_DENY_CIDRS  replaces the default denied ranges (private, loopback, link-local, CGNAT, 198.18.0.0/15, metadata); '' denies no address
//	-log-level   AGENTBOX_LOG_LEVEL          info
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
)

// version is set at build time with -ldflags "-X main.version=...".
var version = "dev"

type options struct {
	listen        string
	allow, deny   []string
	deniedCIDRs   []netip.Prefix // nil: the defaults
	shutdownGrace time.Duration
	logLevel      slog.Level
	showVersion   bool
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
	env := func(key, def string) string {
		if v, ok := lookupEnv(key); ok {
			return v
		}
		return def
	}
	fs := flag.NewFlagSet("agentbox-egress-proxy", flag.ContinueOnError)
	fs.SetOutput(out)
	o := &options{
		allow: splitList(env("AGENTBOX_EGRESS_ALLOW", "")),
		deny:  splitList(env("AGENTBOX_EGRESS_DENY", "")),
	}
	var cidrs []string
	cidrsSet := false
	if v, ok := lookupEnv("AGENTBOX_EGRESS_DENY_CIDRS"); ok {
		cidrs, cidrsSet = splitList(v), true
	}
	var logLevel string
	fs.StringVar(&o.listen, "listen", env("AGENTBOX_EGRESS_LISTEN", ":3128"), "listen address")
	fs.Var(&listFlag{vals: &o.allow}, "allow", `hosts that may be reached, repeatable or comma-separated: "example.com", "*.example.com" (subdomains), an IP, or "*"; empty allows nothing`)
	fs.Var(&listFlag{vals: &o.deny}, "deny", "hosts refused even when allowed, same syntax")
	fs.Func("deny-cidrs", "comma-separated CIDRs no request may reach after DNS resolution; replaces the defaults ("+
		"private, loopback, link-local, CGNAT, 198.18.0.0/15, metadata); '' denies no address", func(s string) error {
		cidrs, cidrsSet = splitList(s), true
		return nil
	})
	fs.DurationVar(&o.shutdownGrace, "shutdown-grace", 10*time.Second, "how long open requests and tunnels may continue after SIGTERM")
	fs.StringVar(&logLevel, "log-level", env("AGENTBOX_LOG_LEVEL", "info"), "debug, info, warn or error")
	fs.BoolVar(&o.showVersion, "version", false, "print the version and exit")
	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	if fs.NArg() > 0 {
		return nil, fmt.Errorf("unexpected arguments: %q", fs.Args())
	}
	if err := o.logLevel.UnmarshalText([]byte(logLevel)); err != nil {
		return nil, fmt.Errorf("-log-level: %w", err)
	}
	if cidrsSet {
		p, err := egressproxy.ParseCIDRs(cidrs)
		if err != nil {
			return nil, fmt.Errorf("-deny-cidrs: %w", err)
		}
		o.deniedCIDRs = p // non-nil even when empty: "deny no address"
	}
	return o, nil
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

func run(ctx context.Context, o *options, log *slog.Logger) error {
	proxy, err := egressproxy.New(egressproxy.Config{
		Allow:       o.allow,
		Deny:        o.deny,
		DeniedCIDRs: o.deniedCIDRs,
		Logger:      log,
	})
	if err != nil {
		return err
	}
	defer proxy.Close()
	ln, err := net.Listen("tcp", o.listen)
	if err != nil {
		return fmt.Errorf("listen: %w", err)
	}
	srv := &http.Server{
		Handler:           proxy,
		ReadHeaderTimeout: 10 * time.Second,
		// No read or write timeout: tunnels and streamed downloads last
		// as long as they last.
		IdleTimeout: 2 * time.Minute,
		ErrorLog:    slog.NewLogLogger(log.Handler(), slog.LevelWarn),
	}
	denied := o.deniedCIDRs
	if denied == nil {
		denied = egressproxy.DefaultDeniedCIDRs
	}
	serveErr := make(chan error, 1)
	go func() { serveErr <- srv.Serve(ln) }()
	log.Info("listening", "addr", ln.Addr().String(), "version", version,
		"allow", o.allow, "deny", o.deny, "denied_cidrs", len(denied))
	if len(o.allow) == 0 {
		log.Warn("the allowlist is empty: every request will be denied")
	}

	select {
	case err := <-serveErr:
		return fmt.Errorf("serve: %w", err)
	case <-ctx.Done():
	}
	log.Info("shutting down", "grace", o.shutdownGrace.String())
	sctx, cancel := context.WithTimeout(context.Background(), o.shutdownGrace)
	defer cancel()
	// Shutdown does not wait for hijacked CONNECT tunnels; they end with
	// the process.
	if err := srv.Shutdown(sctx); err != nil && !errors.Is(err, context.DeadlineExceeded) {
		return err
	}
	return nil
}
