package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"time"

	"github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
)

// userTokenCommand: agentbox token exchange|revoke, the user tokens an
// agent carries to the MCP servers and APIs it calls for a user (admin).
func userTokenCommand(ctx context.Context, args []string, getenv func(string) string, stdout, stderr io.Writer) int {
	if len(args) == 0 || (args[0] != "exchange" && args[0] != "revoke") {
		fmt.Fprintln(stderr, "usage: agentbox token exchange|revoke [flags]")
		return exitUsage
	}
	if args[0] == "revoke" {
		return adminCommand(ctx, "token revoke", "token revoke [flags] JTI", args[1:], getenv, stderr, func(*flag.FlagSet) {},
			func(ctx context.Context, c *client.Client, rest []string) error {
				if len(rest) != 1 {
					return usageError{errors.New("want exactly one JTI")}
				}
				if err := c.RevokeUserToken(ctx, rest[0]); err != nil {
					return err
				}
				fmt.Fprintf(stdout, "revoked %s\n", rest[0])
				return nil
			})
	}
	var req client.TokenExchangeRequest
	var ttl time.Duration
	var asJSON bool
	return adminCommand(ctx, "token exchange", "token exchange --user USER --agent AGENT --audience AUD [flags]", args[1:], getenv, stderr,
		func(fs *flag.FlagSet) {
			fs.StringVar(&req.SubjectToken, "user", "", "the user the agent acts for (the token's sub); required")
			fs.StringVar(&req.AgentID, "agent", "", "the agent that acts (the token's act.sub); required")
			fs.StringVar(&req.Audience, "audience", "", "the MCP server or API that verifies the token (its aud); required")
			fs.StringVar(&req.Scope, "scope", "", "space-separated scopes")
			fs.DurationVar(&ttl, "ttl", 0, "lifetime, e.g. 15m; 0 or more than the platform's maximum gives the maximum")
			fs.StringVar(&req.RunID, "run", "", "the run the token is for (run_id claim)")
			fs.StringVar(&req.LeaseID, "lease", "", "the lease the token is for (lease_id claim)")
			fs.BoolVar(&asJSON, "json", false, "print the whole RFC 8693 response as JSON instead of the token alone")
		}, func(ctx context.Context, c *client.Client, rest []string) error {
			switch {
			case len(rest) > 0:
				return usageError{fmt.Errorf("unexpected arguments %q", rest)}
			case req.SubjectToken == "" || req.AgentID == "" || req.Audience == "":
				return usageError{errors.New("--user, --agent and --audience are required")}
			case ttl < 0:
				return usageError{errors.New("--ttl must not be negative")}
			}
			req.ExpiresIn = int64(ttl / time.Second)
			t, err := c.ExchangeToken(ctx, req)
			if err != nil {
				return err
			}
			if asJSON {
				return printJSON(stdout, t)
			}
			// The token goes to stdout alone, to be piped where it is used.
			fmt.Fprintln(stdout, t.AccessToken)
			fmt.Fprintf(stderr, "issued user token %s for %s acting as %s, expires %s\n", t.JTI, req.AgentID, req.SubjectToken,
				t.ExpiresAt.Local().Format(time.RFC3339))
			return nil
		})
}
