package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/url"
	"strconv"
	"time"

	"github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
)

// adminCommand runs an admin subcommand, which checks its own arguments.
func adminCommand(ctx context.Context, name, synopsis string, args []string, getenv func(string) string, stderr io.Writer,
	define func(*flag.FlagSet), do func(context.Context, *client.Client, []string) error) int {
	return command{name: name, synopsis: synopsis, flags: define, run: do}.main(ctx, args, getenv, stderr)
}

// auditCommand: agentbox audit verify | agentbox audit query [filters].
func auditCommand(ctx context.Context, args []string, getenv func(string) string, stdout, stderr io.Writer) int {
	if len(args) == 0 || (args[0] != "verify" && args[0] != "query") {
		fmt.Fprintln(stderr, "usage: agentbox audit verify|query [flags]")
		return exitUsage
	}
	if args[0] == "verify" {
		// Exit 3 says "the chain is broken", distinct from failing to ask.
		broken := false
		code := adminCommand(ctx, "audit verify", "audit verify [flags]", args[1:], getenv, stderr, func(*flag.FlagSet) {},
			func(ctx context.Context, c *client.Client, _ []string) error {
				v, err := c.VerifyAudit(ctx)
				if err != nil {
					return err
				}
				if v.OK {
					fmt.Fprintf(stdout, "audit log intact: %d records, head %s\n", v.Records, v.Head)
					return nil
				}
				broken = true
				fmt.Fprintf(stdout, "audit log BROKEN at record %d (%s): %s\n", v.Break.Seq, v.Break.Kind, v.Break.Detail)
				return nil
			})
		if code == 0 && broken {
			return 3
		}
		return code
	}
	var agent, caller, op, since string
	var limit int
	var newest bool
	return adminCommand(ctx, "audit query", "audit query [flags]", args[1:], getenv, stderr, func(fs *flag.FlagSet) {
		fs.StringVar(&agent, "agent", "", "only calls for this agent ID")
		fs.StringVar(&caller, "caller", "", "only calls by this caller (e.g. agent:<token id>, admin, anonymous)")
		fs.StringVar(&op, "operation", "", "only this operation (e.g. run_command)")
		fs.StringVar(&since, "since", "", "only calls this recent: a duration such as 1h, or an RFC 3339 time")
		fs.IntVar(&limit, "limit", 100, "records to print")
		fs.BoolVar(&newest, "newest", true, "newest first")
	}, func(ctx context.Context, c *client.Client, _ []string) error {
		q := url.Values{"limit": {strconv.Itoa(limit)}, "newest": {strconv.FormatBool(newest)}}
		for k, v := range map[string]string{"agent_id": agent, "caller": caller, "operation": op} {
			if v != "" {
				q.Set(k, v)
			}
		}
		if since != "" {
			t, err := time.Parse(time.RFC3339, since)
			if d, derr := time.ParseDuration(since); derr == nil {
				t, err = time.Now().Add(-d), nil
			}
			if err != nil {
				return usageError{fmt.Errorf("--since: want a duration or an RFC 3339 time, got %q", since)}
			}
			q.Set("since", t.UTC().Format(time.RFC3339Nano))
		}
		page, err := c.QueryAudit(ctx, q)
		if err != nil {
			return err
		}
		return printJSON(stdout, page)
	})
}

// tokensCommand: agentbox tokens create|revoke.
func tokensCommand(ctx context.Context, args []string, getenv func(string) string, stdout, stderr io.Writer) int {
	if len(args) == 0 || (args[0] != "create" && args[0] != "revoke") {
		fmt.Fprintln(stderr, "usage: agentbox tokens create|revoke [flags]")
		return exitUsage
	}
	if args[0] == "revoke" {
		return adminCommand(ctx, "tokens revoke", "tokens revoke [flags] TOKEN_ID", args[1:], getenv, stderr, func(*flag.FlagSet) {},
			func(ctx context.Context, c *client.Client, rest []string) error {
				if len(rest) != 1 {
					return usageError{errors.New("want exactly one TOKEN_ID")}
				}
				if err := c.RevokeToken(ctx, rest[0]); err != nil {
					return err
				}
				fmt.Fprintf(stdout, "revoked %s\n", rest[0])
				return nil
			})
	}
	var req client.CreateTokenRequest
	var ttl time.Duration
	return adminCommand(ctx, "tokens create", "tokens create [flags]", args[1:], getenv, stderr, func(fs *flag.FlagSet) {
		fs.StringVar(&req.Kind, "kind", client.TokenKindAgent, "agent, admin or staff")
		fs.StringVar(&req.AgentID, "agent", "", "the agent an agent token is bound to")
		fs.StringVar(&req.Subject, "subject", "", "who holds the token; shown in the audit log")
		fs.DurationVar(&ttl, "ttl", 0, "lifetime, e.g. 720h; 0 means no expiry")
	}, func(ctx context.Context, c *client.Client, _ []string) error {
		req.TTLSeconds = int64(ttl / time.Second)
		t, err := c.CreateToken(ctx, req)
		if err != nil {
			return err
		}
		// The token goes to stdout alone, so that it can be piped into a
		// secret store; the rest is for the person.
		fmt.Fprintln(stdout, t.Token)
		fmt.Fprintf(stderr, "created %s token %s (shown once; the control plane keeps only its hash)\n", t.Kind, t.ID)
		return nil
	})
}
