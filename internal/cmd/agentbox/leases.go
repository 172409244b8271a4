package main

import (
	"context"
	"crypto/rand"
	"flag"
	"fmt"
	"io"
	"text/tabwriter"
	"time"

	"github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
)

const leasesUsage = `usage: agentbox leases acquire|heartbeat|release [flags] AGENT_ID
       agentbox leases acquire-pool [flags] NAMESPACE POOL

Run "agentbox leases <subcommand> -h" for its flags.
`

// leasesCommand: agentbox leases acquire|heartbeat|release|acquire-pool.
// The wire calls an agent's exclusive hold on its sandbox a lease; the CLI
// keeps that name.
func leasesCommand(ctx context.Context, args []string, getenv func(string) string, stdout, stderr io.Writer) int {
	if len(args) == 0 {
		fmt.Fprint(stderr, leasesUsage)
		return exitUsage
	}
	o := &leaseOptions{getenv: getenv, stdout: stdout}
	sub, rest := args[0], args[1:]
	var cmd command
	switch sub {
	case "acquire":
		cmd = o.acquireCommand()
	case "heartbeat":
		cmd = o.heartbeatCommand()
	case "release":
		cmd = o.releaseCommand()
	case "acquire-pool":
		cmd = o.acquirePoolCommand()
	default:
		fmt.Fprintf(stderr, "agentbox leases: unknown subcommand %q\n%s", sub, leasesUsage)
		return exitUsage
	}
	cmd.name = "leases " + sub
	return cmd.main(ctx, rest, getenv, stderr)
}

// leaseOptions are the flags the leases subcommands share, and where they
// print.
type leaseOptions struct {
	holder, requestID, leaseID string
	ttl, wait                  int
	// requirements and envName route a pool lease by environment.
	requirements []string
	envName      string
	asJSON       bool
	getenv       func(string) string
	stdout       io.Writer
}

func (o *leaseOptions) holderFlags(fs *flag.FlagSet) {
	fs.StringVar(&o.holder, "holder", o.getenv("AGENTBOX_LEASE_HOLDER"), "who holds the lease: a user, a run [AGENTBOX_LEASE_HOLDER]")
	fs.BoolVar(&o.asJSON, "json", false, "print the lease as JSON")
}

func (o *leaseOptions) acquireFlags(fs *flag.FlagSet) {
	o.holderFlags(fs)
	fs.StringVar(&o.requestID, "request-id", "", "makes the acquire idempotent: a retry with the same holder and ID gets the same lease (default: a new random ID)")
	fs.Var(secondsFlag{&o.ttl}, "ttl", fmt.Sprintf("how long the lease lasts without a heartbeat, in seconds or as a duration (default %ds, at most %ds)",
		client.DefaultLeaseTTLSeconds, client.MaxLeaseTTLSeconds))
}

func (o *leaseOptions) checkAcquire([]string) error {
	if o.holder == "" {
		return fmt.Errorf("--holder (or AGENTBOX_LEASE_HOLDER) is required")
	}
	if o.ttl > client.MaxLeaseTTLSeconds {
		return fmt.Errorf("--ttl %ds: at most %ds", o.ttl, client.MaxLeaseTTLSeconds)
	}
	if o.requestID == "" {
		o.requestID = rand.Text()
	}
	return nil
}

func (o *leaseOptions) heldFlags(fs *flag.FlagSet) {
	o.holderFlags(fs)
	fs.StringVar(&o.leaseID, "lease-id", "", "the lease_id that acquire printed")
}

func (o *leaseOptions) checkHeld([]string) error {
	switch {
	case o.holder == "":
		return fmt.Errorf("--holder (or AGENTBOX_LEASE_HOLDER) is required")
	case o.leaseID == "":
		return fmt.Errorf("--lease-id is required")
	}
	return nil
}

func (o *leaseOptions) poolFlags(fs *flag.FlagSet) {
	o.acquireFlags(fs)
	fs.Var(secondsFlag{&o.wait}, "wait", fmt.Sprintf("when the pool has no ready sandbox free, how long to wait for one (or for the one a pool with "+
		"coldStartWhenExhausted starts), in seconds or as a duration (default 0: fail at once; at most %ds)", client.MaxPoolLeaseWaitSeconds))
	fs.Var(stringsFlag{&o.requirements}, "requirement", "a requirement of the Python environment the lease's runs will use (repeatable): "+
		"a free sandbox already holding that environment is preferred")
	fs.StringVar(&o.envName, "env-name", "", "the name of the Python environment the lease's runs will use: a free sandbox already holding it is preferred")
}

func (o *leaseOptions) checkPool(args []string) error {
	if o.wait > client.MaxPoolLeaseWaitSeconds {
		return fmt.Errorf("--wait %ds: at most %ds", o.wait, client.MaxPoolLeaseWaitSeconds)
	}
	if o.envName != "" && len(o.requirements) > 0 {
		return fmt.Errorf("--requirement and --env-name: give one or the other")
	}
	return o.checkAcquire(args)
}

func (o *leaseOptions) acquireRequest() client.AcquireLeaseRequest {
	return client.AcquireLeaseRequest{Holder: o.holder, RequestID: o.requestID, TTLSeconds: o.ttl, WaitSeconds: o.wait,
		Requirements: o.requirements, EnvName: o.envName}
}

// show prints v as JSON, or l (and extra fields) as lines.
func (o *leaseOptions) show(v any, l *client.Lease, extra ...[2]string) error {
	if o.asJSON {
		return printJSON(o.stdout, v)
	}
	return printLease(o.stdout, l, extra...)
}

func (o *leaseOptions) acquireCommand() command {
	return command{
		synopsis: "leases acquire [flags] AGENT_ID",
		doc: `Takes the exclusive lease on the agent's sandbox and prints it; heartbeat
and release need its lease_id. While the lease is held the sandbox serves
only calls that present the lease_id: pass it to exec, shell, cp and deploy
with --lease-id or AGENTBOX_LEASE_ID. Others get lease_held.`,
		args: []string{"AGENT_ID"}, flags: o.acquireFlags, check: o.checkAcquire,
		run: func(ctx context.Context, c *client.Client, args []string) error {
			l, err := c.AcquireLease(ctx, args[0], o.acquireRequest())
			if err != nil {
				return err
			}
			return o.show(l, l)
		},
	}
}

func (o *leaseOptions) heartbeatCommand() command {
	return command{
		synopsis: "leases heartbeat [flags] AGENT_ID",
		doc:      "Extends a held lease by its TTL from now and prints it.",
		args:     []string{"AGENT_ID"}, flags: o.heldFlags, check: o.checkHeld,
		run: func(ctx context.Context, c *client.Client, args []string) error {
			l, err := c.HeartbeatLease(ctx, args[0], client.HeartbeatLeaseRequest{Holder: o.holder, LeaseID: o.leaseID})
			if err != nil {
				return err
			}
			return o.show(l, l)
		},
	}
}

func (o *leaseOptions) releaseCommand() command {
	return command{
		synopsis: "leases release [flags] AGENT_ID",
		doc:      "Gives a held lease up. Releasing a lease nobody holds succeeds.",
		args:     []string{"AGENT_ID"}, flags: o.heldFlags, check: o.checkHeld,
		run: func(ctx context.Context, c *client.Client, args []string) error {
			if err := c.ReleaseLease(ctx, args[0], client.ReleaseLeaseRequest{Holder: o.holder, LeaseID: o.leaseID}); err != nil {
				return err
			}
			if o.asJSON {
				return printJSON(o.stdout, map[string]string{"released": o.leaseID})
			}
			fmt.Fprintf(o.stdout, "released %s\n", o.leaseID)
			return nil
		},
	}
}

func (o *leaseOptions) acquirePoolCommand() command {
	return command{
		synopsis: "leases acquire-pool [flags] NAMESPACE POOL",
		doc: `Leases a ready sandbox of a warm pool for one run and prints the lease
with the agent_id to address the sandbox by (exec, cp, heartbeat and
release take it, exec and cp with --lease-id, as for any held sandbox).
Once released or expired, the sandbox is deleted with its workspace. With
--wait, a pool without a ready sandbox free is waited on (or, with
coldStartWhenExhausted, starts one for this lease). With --requirement or
--env-name, a free sandbox already holding that Python environment is
preferred, then one building it; routing says which it got.`,
		args: []string{"NAMESPACE", "POOL"}, flags: o.poolFlags, check: o.checkPool,
		run: func(ctx context.Context, c *client.Client, args []string) error {
			l, err := c.AcquirePoolLease(ctx, args[0], args[1], o.acquireRequest())
			if err != nil {
				return err
			}
			extra := [][2]string{{"agent_id", l.AgentID}, {"sandbox", l.Namespace + "/" + l.Sandbox}}
			if l.Routing != nil {
				extra = append(extra, [2]string{"routing", l.Routing.Result + " " + l.Routing.EnvKey})
			}
			return o.show(l, &l.Lease, extra...)
		},
	}
}

// printLease prints one "name: value" line per field, names as in the
// JSON, so that what a person reads is what a script would pick out.
func printLease(w io.Writer, l *client.Lease, extra ...[2]string) error {
	tw := tabwriter.NewWriter(w, 0, 0, 1, ' ', 0)
	for _, kv := range extra {
		fmt.Fprintf(tw, "%s:\t%s\n", kv[0], kv[1])
	}
	fmt.Fprintf(tw, "lease_id:\t%s\n", l.LeaseID)
	fmt.Fprintf(tw, "holder:\t%s\n", l.Holder)
	fmt.Fprintf(tw, "request_id:\t%s\n", l.RequestID)
	fmt.Fprintf(tw, "ttl_seconds:\t%d\n", l.TTLSeconds)
	for _, t := range []struct {
		name string
		at   time.Time
	}{{"acquired_at", l.AcquiredAt}, {"renewed_at", l.RenewedAt}, {"expires_at", l.ExpiresAt}} {
		if !t.at.IsZero() {
			fmt.Fprintf(tw, "%s:\t%s\n", t.name, t.at.Format(time.RFC3339))
		}
	}
	return tw.Flush()
}
