package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"strings"
	"time"

	"github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
)

// connection holds the flags every API command shares.
type connection struct {
	endpoint, tokenFile, caFile *string
	getenv                      func(string) string
}

func connectionFlags(fs *flag.FlagSet, getenv func(string) string) connection {
	return connection{
		endpoint:  fs.String("endpoint", getenv("AGENTBOX_ENDPOINT"), "Compute API URL, e.g. https://agentbox-api.agentbox-system.svc [AGENTBOX_ENDPOINT]"),
		tokenFile: fs.String("token-file", "", "file holding the API token (default: the AGENTBOX_TOKEN variable)"),
		caFile:    fs.String("ca-file", getenv("AGENTBOX_CA_FILE"), "PEM file of the platform CA that signed the API's certificate; default: the system roots [AGENTBOX_CA_FILE]"),
		getenv:    getenv,
	}
}

// leaseFlag defines --lease-id, for commands that act on a sandbox: while
// a sandbox is held, the API serves only calls that present the hold's
// lease ID.
func leaseFlag(fs *flag.FlagSet, getenv func(string) string) *string {
	return fs.String("lease-id", getenv("AGENTBOX_LEASE_ID"),
		`the lease_id of a lease held on the sandbox ("agentbox leases acquire" prints it), needed while the sandbox is held [AGENTBOX_LEASE_ID]`)
}

// client checks the connection flags and returns a client. Its errors are
// usage errors: nothing has been sent yet.
func (c connection) client() (*client.Client, error) {
	if *c.endpoint == "" {
		return nil, errors.New("--endpoint (or AGENTBOX_ENDPOINT) is required")
	}
	token, err := readToken(*c.tokenFile, c.getenv)
	if err != nil {
		return nil, err
	}
	var caPEM []byte
	if *c.caFile != "" {
		if caPEM, err = os.ReadFile(*c.caFile); err != nil {
			return nil, fmt.Errorf("read --ca-file: %w", err)
		}
	}
	return client.New(*c.endpoint, token, caPEM)
}

// command is one API subcommand: its flags, its positional arguments and
// what it does with a connected client.
type command struct {
	// name is how errors are prefixed: "agentbox <name>: ...".
	name string
	// synopsis follows "usage: agentbox"; doc, if any, follows it.
	synopsis, doc string
	// args names the positional arguments, which must all be given; nil
	// lets run check them.
	args []string
	// flags defines the command's own flags.
	flags func(*flag.FlagSet)
	// check validates flags and arguments before anything is sent; its
	// errors are usage errors.
	check func(args []string) error
	run   func(ctx context.Context, c *client.Client, args []string) error
	// leaseAgent, for a command that acts on a sandbox, names its agent
	// from the arguments checked; the command then takes --lease-id and
	// presents it on its calls to that agent's sandbox.
	leaseAgent func(args []string) string
}

// usageError marks an error in what the user typed (exit 2) as opposed to
// one the API or the system reported (exit 1).
type usageError struct{ error }

func usagef(format string, args ...any) error { return usageError{fmt.Errorf(format, args...)} }

// main parses args, connects and runs the command. API errors exit 1,
// usage errors 2.
func (cmd command) main(ctx context.Context, args []string, getenv func(string) string, stderr io.Writer) int {
	fs := flag.NewFlagSet("agentbox "+cmd.name, flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprintf(fs.Output(), "usage: agentbox %s\n", cmd.synopsis)
		if cmd.doc != "" {
			fmt.Fprintf(fs.Output(), "\n%s\n", strings.TrimSpace(cmd.doc))
		}
		fmt.Fprint(fs.Output(), "\nflags:\n")
		fs.PrintDefaults()
	}
	conn := connectionFlags(fs, getenv)
	var leaseID *string
	if cmd.leaseAgent != nil {
		leaseID = leaseFlag(fs, getenv)
	}
	if cmd.flags != nil {
		cmd.flags(fs)
	}
	positional, err := parseInterspersed(fs, args)
	if err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		return exitUsage
	}
	fail := func(err error) int {
		fmt.Fprintf(stderr, "agentbox %s: %v\n", cmd.name, err)
		return exitUsage
	}
	if err := checkArgs(cmd.args, positional); err != nil {
		return fail(err)
	}
	if cmd.check != nil {
		if err := cmd.check(positional); err != nil {
			return fail(err)
		}
	}
	c, err := conn.client()
	if err != nil {
		return fail(err)
	}
	defer c.CloseIdleConnections()
	if leaseID != nil && *leaseID != "" {
		c.UseLease(cmd.leaseAgent(positional), *leaseID)
	}
	if err := cmd.run(ctx, c, positional); err != nil {
		var usageErr usageError
		if errors.As(err, &usageErr) {
			return fail(err)
		}
		fmt.Fprintf(stderr, "agentbox %s: %s\n", cmd.name, describe(err))
		return exitAPIError
	}
	return 0
}

// checkArgs compares the positional arguments with the names the command
// wants, and names what is missing or extra.
func checkArgs(want, got []string) error {
	if want == nil {
		return nil
	}
	if len(got) < len(want) {
		return fmt.Errorf("missing %s", strings.Join(want[len(got):], " "))
	}
	if len(got) > len(want) {
		return fmt.Errorf("unexpected argument %q (want %s)", got[len(want)], strings.Join(want, " "))
	}
	for i, a := range got {
		if a == "" {
			return fmt.Errorf("%s must not be empty", want[i])
		}
	}
	return nil
}

// parseInterspersed parses flags wherever they stand among the positional
// arguments, so that "status AGENT_ID --json" works like
// "status --json AGENT_ID"; everything after "--" is positional.
func parseInterspersed(fs *flag.FlagSet, args []string) ([]string, error) {
	var positional []string
	for {
		if err := fs.Parse(args); err != nil {
			return nil, err
		}
		rest := fs.Args()
		if len(rest) == 0 {
			return positional, nil
		}
		// Parse stops at the first non-flag, or just after a "--",
		// which it drops.
		if n := len(args) - len(rest); n > 0 && args[n-1] == "--" {
			return append(positional, rest...), nil
		}
		positional = append(positional, rest[0])
		args = rest[1:]
	}
}

func printJSON(w io.Writer, v any) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}

// parseSince reads --since: an RFC 3339 time, or a duration before now;
// "" is no bound.
func parseSince(v string, now time.Time) (time.Time, error) {
	if v == "" {
		return time.Time{}, nil
	}
	if t, err := time.Parse(time.RFC3339Nano, v); err == nil {
		return t, nil
	}
	d, err := time.ParseDuration(v)
	if err != nil || d < 0 {
		return time.Time{}, usagef("--since: want a duration such as 1h or an RFC 3339 time, got %q", v)
	}
	return now.Add(-d), nil
}
