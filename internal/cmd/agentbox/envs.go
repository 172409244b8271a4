package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
)

const envsUsage = `usage: agentbox envs list [flags] AGENT_ID
       agentbox envs create [flags] AGENT_ID [REQUIREMENT...]
       agentbox envs delete [flags] AGENT_ID NAME

Run "agentbox envs <subcommand> -h" for its flags.
`

// envsCommand: agentbox envs list|create|delete, the agent's cached
// Python environments.
func envsCommand(ctx context.Context, args []string, getenv func(string) string, stdout, stderr io.Writer) int {
	if len(args) == 0 {
		fmt.Fprint(stderr, envsUsage)
		return exitUsage
	}
	o := &envsOptions{stdout: stdout}
	sub, rest := args[0], args[1:]
	var cmd command
	switch sub {
	case "list", "ls":
		cmd = o.listCommand()
	case "create":
		cmd = o.createCommand()
	case "delete", "rm":
		cmd = o.deleteCommand()
	default:
		fmt.Fprintf(stderr, "agentbox envs: unknown subcommand %q\n%s", sub, envsUsage)
		return exitUsage
	}
	cmd.name = "envs " + sub
	cmd.leaseAgent = func(args []string) string { return args[0] }
	return cmd.main(ctx, rest, getenv, stderr)
}

type envsOptions struct {
	name   string
	index  string
	asJSON bool
	stdout io.Writer
}

func (o *envsOptions) jsonFlag(fs *flag.FlagSet) {
	fs.BoolVar(&o.asJSON, "json", false, "print the API's JSON")
}

func (o *envsOptions) listCommand() command {
	return command{
		synopsis: "envs list [flags] AGENT_ID",
		doc: `Lists the agent's cached Python environments: name (a requirement set's is
reqs- and its key), state, size, last use and requirements, then the cache's
totals and limits. Wakes a stopped sandbox.`,
		args: []string{"AGENT_ID"}, flags: o.jsonFlag,
		run: func(ctx context.Context, c *client.Client, args []string) error {
			list, err := c.ListEnvs(ctx, args[0])
			if err != nil {
				return err
			}
			if o.asJSON {
				return printJSON(o.stdout, list)
			}
			tw := tabwriter.NewWriter(o.stdout, 0, 4, 2, ' ', 0)
			fmt.Fprintln(tw, "NAME\tSTATE\tSIZE\tLAST USED\tIN USE\tREQUIREMENTS")
			for _, e := range list.Environments {
				fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%d\t%s\n", e.Name, e.State, formatSize(e.SizeBytes),
					e.LastUsedAt.UTC().Format(time.RFC3339), e.InUse, strings.Join(e.Requirements, " "))
			}
			if err := tw.Flush(); err != nil {
				return err
			}
			ttl := "none"
			if list.TTLSeconds > 0 {
				ttl = (time.Duration(list.TTLSeconds) * time.Second).String()
			}
			_, err = fmt.Fprintf(o.stdout, "%d of %d environments, %s of %s, time-to-live %s, built with %s\n",
				list.Count, list.MaxCount, formatSize(list.TotalBytes), formatSize(list.MaxBytes), ttl, list.Installer)
			return err
		},
	}
}

func (o *envsOptions) createCommand() command {
	return command{
		synopsis: "envs create [flags] AGENT_ID [REQUIREMENT...]",
		doc: `Builds an environment ahead of the runs that need it, or finds it cached,
and prints it when it is ready. Requirements alone make the environment of
that requirement set, which execute runs with the same requirements use
without installing; --name makes a named one (empty without requirements).`,
		flags: func(fs *flag.FlagSet) {
			fs.StringVar(&o.name, "name", "", "name of the environment (default: the requirement set's)")
			fs.StringVar(&o.index, "python-index", "", "one of the template's package indexes, for this environment")
			o.jsonFlag(fs)
		},
		check: func(args []string) error {
			switch {
			case len(args) == 0:
				return fmt.Errorf("AGENT_ID is required")
			case len(args) == 1 && o.name == "":
				return fmt.Errorf("give requirements, --name, or both")
			}
			return nil
		},
		run: func(ctx context.Context, c *client.Client, args []string) error {
			res, err := c.CreateEnv(ctx, args[0], client.EnvRequest{Name: o.name, Requirements: args[1:], PythonIndex: o.index})
			if err != nil {
				return err
			}
			if o.asJSON {
				return printJSON(o.stdout, res)
			}
			how := "cached"
			if res.Created {
				how = "built"
			}
			_, err = fmt.Fprintf(o.stdout, "%s: %s in %s, %s, Python %s, %s\n", res.Name, how,
				(time.Duration(res.DurationMS) * time.Millisecond).String(), formatSize(res.SizeBytes), res.PythonVersion, strings.Join(res.Packages, " "))
			return err
		},
	}
}

func (o *envsOptions) deleteCommand() command {
	return command{
		synopsis: "envs delete [flags] AGENT_ID NAME",
		doc:      "Deletes a cached environment; one a run is using goes when the run ends.",
		args:     []string{"AGENT_ID", "NAME"}, flags: o.jsonFlag,
		run: func(ctx context.Context, c *client.Client, args []string) error {
			info, err := c.DeleteEnv(ctx, args[0], args[1])
			if err != nil {
				return err
			}
			if o.asJSON {
				return printJSON(o.stdout, info)
			}
			_, err = fmt.Fprintf(o.stdout, "deleted %s (%s)\n", info.Name, formatSize(info.SizeBytes))
			return err
		},
	}
}

// formatSize prints bytes in binary units.
func formatSize(n int64) string {
	const unit = 1024
	if n < unit {
		return fmt.Sprintf("%d B", n)
	}
	div, exp := int64(unit), 0
	for m := n / unit; m >= unit; m /= unit {
		div *= unit
		exp++
	}
	return fmt.Sprintf("%.1f %ciB", float64(n)/float64(div), "KMGTPE"[exp])
}
