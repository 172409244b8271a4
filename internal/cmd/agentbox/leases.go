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
func leasesCommand(ctx context.Context, args []string, getenv func(string) string, stdout, stderr io.Writer) int {
	if len(args) == 0 {
		fmt.Fprint(stderr, leasesUsage)
		return exitUsage
	}
	var (
		holder, requestID, leaseID string
		ttl, wait                  int
		asJSON                     bool
	)
	holderFlag := func(fs *flag.FlagSet) {
		fs.StringVar(&holder, "holder", getenv("AGENTBOX_LEASE_HOLDER"), "who holds the lease: a user, a run [AGENTBOX_LEASE_HOLDER]")
		fs.BoolVar(&asJSON, "json", false, "print the lease as JSON")
	}
	acquireFlags := func(fs *flag.FlagSet) {
		holderFlag(fs)
		fs.StringVar(&requestID, "request-id", "", "makes the acquire idempotent: a retry with the same holder and ID gets the same lease (default: a new random ID)")
		fs.Var(secondsFlag{&ttl}, "ttl", fmt.Sprintf("how long the lease lasts without a heartbeat, in seconds or as a duration (default %ds, at most %ds)",
			client.DefaultLeaseTTLSeconds, client.MaxLeaseTTLSeconds))
	}
	checkAcquire := func([]string) error {
		if holder == "" {
			return fmt.Errorf("--holder (or AGENTBOX_LEASE_HOLDER) is required")
		}
		if ttl > client.MaxLeaseTTLSeconds {
			return fmt.Errorf("--ttl %ds: at most %ds", ttl, client.MaxLeaseTTLSeconds)
		}
		if requestID == "" {
			requestID = rand.Text()
		}
		return nil
	}
	heldFlags := func(fs *flag.FlagSet) {
		holderFlag(fs)
		fs.StringVar(&leaseID, "lease-id", "", "the lease_id that acquire printed")
	}
	checkHeld := func([]string) error {
		switch {
		case holder == "":
			return fmt.Errorf("--holder (or AGENTBOX_LEASE_HOLDER) is required")
		case leaseID == "":
			return fmt.Errorf("--lease-id is required")
		}
		return nil
	}
	acquireRequest := func() client.AcquireLeaseRequest {
		return client.AcquireLeaseRequest{Holder: holder, RequestID: requestID, TTLSeconds: ttl, WaitSeconds: wait}
	}
	poolFlags := func(fs *flag.FlagSet) {
		acquireFlags(fs)
		fs.Var(secondsFlag{&wait}, "wait", fmt.Sprintf("when the pool has no ready sandbox free, how long to wait for one (or for the one a pool with "+
			"coldStartWhenExhausted starts), in seconds or as a duration (default 0: fail at once; at most %ds)", client.MaxPoolLeaseWaitSeconds))
	}
	checkPool := func(args []string) error {
		if wait > client.MaxPoolLeaseWaitSeconds {
			return fmt.Errorf("--wait %ds: at most %ds", wait, client.MaxPoolLeaseWaitSeconds)
		}
		return checkAcquire(args)
	}
	// show prints v as JSON, or l (and extra fields) as lines.
	show := func(v any, l *client.Lease, extra ...[2]string) error {
		if asJSON {
			return printJSON(stdout, v)
		}
		return printLease(stdout, l, extra...)
	}

	sub, rest := args[0], args[1:]
	var cmd command
	switch sub {
	case "acquire":
		cmd = command{
			synopsis: "leases acquire [flags] AGENT_ID",
			doc: `Takes the exclusive lease on the agent's sandbox and prints it; heartbeat
and release need its lease_id. While the lease is held the sandbox serves
only calls that present the lease_id: pass it to exec, shell, cp and deploy
with --lease-id or AGENTBOX_LEASE_ID. Others get lease_held.`,
			args: []string{"AGENT_ID"}, flags: acquireFlags, check: checkAcquire,
			run: func(ctx context.Context, c *client.Client, args []string) error {
				l, err := c.AcquireLease(ctx, args[0], acquireRequest())
				if err != nil {
					return err
				}
				return show(l, l)
			},
		}
	case "heartbeat":
		cmd = command{
			synopsis: "leases heartbeat [flags] AGENT_ID",
			doc:      "Extends a held lease by its TTL from now and prints it.",
			args:     []string{"AGENT_ID"}, flags: heldFlags, check: checkHeld,
			run: func(ctx context.Context, c *client.Client, args []string) error {
				l, err := c.HeartbeatLease(ctx, args[0], client.HeartbeatLeaseRequest{Holder: holder, LeaseID: leaseID})
				if err != nil {
					return err
				}
				return show(l, l)
			},
		}
	case "release":
		cmd = command{
			synopsis: "leases release [flags] AGENT_ID",
			doc:      "Gives a held lease up. Releasing a lease nobody holds succeeds.",
			args:     []string{"AGENT_ID"}, flags: heldFlags, check: checkHeld,
			run: func(ctx context.Context, c *client.Client, args []string) error {
				if err := c.ReleaseLease(ctx, args[0], client.ReleaseLeaseRequest{Holder: holder, LeaseID: leaseID}); err != nil {
					return err
				}
				if asJSON {
					return printJSON(stdout, map[string]string{"released": leaseID})
				}
				fmt.Fprintf(stdout, "released %s\n", leaseID)
				return nil
			},
		}
	case "acquire-pool":
		cmd = command{
			synopsis: "leases acquire-pool [flags] NAMESPACE POOL",
			doc: `Leases a ready sandbox of a warm pool for one run and prints the lease
with the agent_id to address the sandbox by (exec, cp, heartbeat and
release take it, exec and cp with --lease-id, as for any held sandbox).
Once released or expired, the sandbox is deleted with its workspace. With
--wait, a pool without a ready sandbox free is waited on (or, with
coldStartWhenExhausted, starts one for this lease).`,
			args: []string{"NAMESPACE", "POOL"}, flags: poolFlags, check: checkPool,
			run: func(ctx context.Context, c *client.Client, args []string) error {
				l, err := c.AcquirePoolLease(ctx, args[0], args[1], acquireRequest())
				if err != nil {
					return err
				}
				return show(l, &l.Lease, [2]string{"agent_id", l.AgentID}, [2]string{"sandbox", l.Namespace + "/" + l.Sandbox})
			},
		}
	default:
		fmt.Fprintf(stderr, "agentbox leases: unknown subcommand %q\n%s", sub, leasesUsage)
		return exitUsage
	}
	cmd.name = "leases " + sub
	return cmd.main(ctx, rest, getenv, stderr)
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
