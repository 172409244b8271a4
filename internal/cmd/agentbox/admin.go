package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/url"
	"strconv"
	"text/tabwriter"
	"time"

	"github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
)

// adminCommand runs an admin subcommand, which checks its own arguments.
func adminCommand(ctx context.Context, name, synopsis string, args []string, getenv func(string) string, stderr io.Writer,
	define func(*flag.FlagSet), do func(context.Context, *client.Client, []string) error) int {
	return command{name: name, synopsis: synopsis, flags: define, run: do}.main(ctx, args, getenv, stderr)
}

// auditCommand: agentbox audit verify | agentbox audit query [filters] |
// agentbox audit console SESSION_ID.
func auditCommand(ctx context.Context, args []string, getenv func(string) string, stdout, stderr io.Writer) int {
	if len(args) == 0 || (args[0] != "verify" && args[0] != "query" && args[0] != "console") {
		fmt.Fprintln(stderr, "usage: agentbox audit verify|query|console [flags]")
		return exitUsage
	}
	if args[0] == "console" {
		return auditConsoleCommand(ctx, args[1:], getenv, stdout, stderr)
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
		t, err := parseSince(since, time.Now())
		if err != nil {
			return err
		}
		if !t.IsZero() {
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
		fs.StringVar(&req.Kind, "kind", client.TokenKindAgent, "agent, admin, staff or exchange (acts for users: mints and revokes user tokens)")
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

// auditConsoleCommand: agentbox audit console [--json] SESSION_ID prints a
// staff console session as recorded, with its transcript both ways.
func auditConsoleCommand(ctx context.Context, args []string, getenv func(string) string, stdout, stderr io.Writer) int {
	var asJSON bool
	return command{
		name:     "audit console",
		synopsis: "audit console [--json] SESSION_ID",
		doc: `Prints a staff console session as recorded: who, for which agent, why,
when, the sandbox's snapshot, and the transcript, one record a line: its
time, "in" for what the staff member typed or "out" for what the terminal
showed, and the bytes, quoted. Known secret formats were redacted before
they were stored. The session's staff member or an admin may read it.`,
		args:  []string{"SESSION_ID"},
		flags: func(fs *flag.FlagSet) { fs.BoolVar(&asJSON, "json", false, "print the session as the API returns it") },
		run: func(ctx context.Context, c *client.Client, args []string) error {
			s, err := c.GetConsoleSession(ctx, args[0])
			if err != nil {
				return err
			}
			if asJSON {
				return printJSON(stdout, s)
			}
			return printConsoleSession(stdout, s)
		},
	}.main(ctx, args, getenv, stderr)
}

func printConsoleSession(w io.Writer, s *client.ConsoleSession) error {
	tw := tabwriter.NewWriter(w, 0, 0, 1, ' ', 0)
	at := func(t *time.Time) string {
		if t == nil || t.IsZero() {
			return "-"
		}
		return t.Format(time.RFC3339)
	}
	for _, kv := range [][2]string{
		{"session", s.ID}, {"staff", s.StaffID}, {"agent", s.AgentID}, {"reason", s.Reason},
		{"created_at", at(&s.CreatedAt)}, {"expires_at", at(&s.ExpiresAt)},
		{"connected_at", at(s.ConnectedAt)}, {"disconnected_at", at(s.DisconnectedAt)}, {"snapshot", s.SnapshotID},
	} {
		fmt.Fprintf(tw, "%s:\t%s\n", kv[0], kv[1])
	}
	summary := fmt.Sprintf("%d records", len(s.TranscriptRecords))
	if s.TranscriptTruncated {
		summary += ", truncated at the store's cap"
	}
	fmt.Fprintf(tw, "transcript:\t%s\n", summary)
	if err := tw.Flush(); err != nil {
		return err
	}
	if len(s.TranscriptRecords) == 0 && len(s.Transcript) > 0 {
		// Recorded before transcripts had directions: the output alone.
		_, err := fmt.Fprintf(w, "out %q\n", s.Transcript)
		return err
	}
	for _, r := range s.TranscriptRecords {
		if _, err := fmt.Fprintf(w, "%s %-3s %q\n", r.At.Format("15:04:05.000"), r.Direction, r.Data); err != nil {
			return err
		}
	}
	return nil
}
