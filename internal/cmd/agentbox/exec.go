package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
)

// maxInlineStdin bounds the input exec reads: it travels inside the JSON
// request, so the API refuses much less than this (8 MiB by default); the
// bound only keeps "--stdin-file /dev/zero" from eating the machine.
const maxInlineStdin = 64 << 20

// envFlag collects repeated --env NAME=VALUE flags.
type envFlag map[string]string

func (e envFlag) String() string { return "" }

func (e envFlag) Set(s string) error {
	name, value, ok := strings.Cut(s, "=")
	if !ok || name == "" {
		return fmt.Errorf("want NAME=VALUE, got %q", s)
	}
	e[name] = value
	return nil
}

// secondsFlag takes whole seconds as a number ("90") or a duration
// ("90s", "2m"): the API counts seconds, people often think in minutes.
type secondsFlag struct{ seconds *int }

func (f secondsFlag) String() string {
	if f.seconds == nil || *f.seconds == 0 {
		return ""
	}
	return strconv.Itoa(*f.seconds)
}

func (f secondsFlag) Set(s string) error {
	if n, err := strconv.Atoi(s); err == nil && n >= 0 {
		*f.seconds = n
		return nil
	}
	d, err := time.ParseDuration(s)
	if err != nil || d < 0 || d%time.Second != 0 {
		return fmt.Errorf("want whole seconds, as 90 or 90s or 2m, got %q", s)
	}
	*f.seconds = int(d / time.Second)
	return nil
}

// execCommand runs a command in an agent's sandbox; "run-command" is its
// older name and works the same.
func execCommand(ctx context.Context, name string, args []string, getenv func(string) string, stdin io.Reader, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("agentbox "+name, flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprintf(fs.Output(), `usage: agentbox %s [flags] AGENT_ID -- CMD [ARGS...]

Runs CMD in the sandbox of AGENT_ID. No shell is involved; use
"-- sh -c '...'" for one. Flags may also follow AGENT_ID, before "--".
The command's stdout and stderr are printed as they are, then
"exit_code=N duration=D" on stderr (with out_of_memory=true, and a line
saying so, when the sandbox's memory guard killed it); agentbox exits
with the command's code, 124 if it timed out, 128+N if signal N ended
it, 1 if the API failed the call and 2 for bad usage.

flags:
`, name)
		fs.PrintDefaults()
	}
	conn := connectionFlags(fs, getenv)
	leaseID := leaseFlag(fs, getenv)
	cwd := fs.String("cwd", "", "working directory in the sandbox; relative to /workspace (default /workspace)")
	env := envFlag{}
	fs.Var(env, "env", "NAME=VALUE to set in the command's environment; repeatable")
	var timeout int
	fs.Var(secondsFlag{&timeout}, "timeout", "time after which the command is killed, in seconds or as a duration (default: the sandbox's, 60s)")
	withStdin := fs.Bool("stdin", false, "send this program's standard input to the command")
	stdinFile := fs.String("stdin-file", "", "send this file to the command's standard input (- for this program's)")
	maxOutput := fs.Int64("max-output-bytes", 0, "cap on stdout and stderr combined (default: the sandbox's, 1 MiB)")

	failUsage := func(format string, args ...any) int {
		fmt.Fprintf(stderr, "agentbox %s: %s\n", name, fmt.Sprintf(format, args...))
		return exitUsage
	}
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		return exitUsage
	}
	if fs.NArg() == 0 {
		fmt.Fprintf(stderr, "agentbox %s: missing AGENT_ID\n", name)
		fs.Usage()
		return exitUsage
	}
	agentID := fs.Arg(0)
	// Parse again after the agent ID, so flags may follow it; this also
	// consumes the "--" before the command.
	if err := fs.Parse(fs.Args()[1:]); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		return exitUsage
	}
	command := fs.Args()
	switch {
	case agentID == "":
		return failUsage("missing AGENT_ID")
	case len(command) == 0:
		return failUsage("missing the command to run after AGENT_ID --")
	case *withStdin && *stdinFile != "":
		return failUsage("--stdin and --stdin-file %q both name the command's input; pass one", *stdinFile)
	case *maxOutput < 0:
		return failUsage("--max-output-bytes %d is negative", *maxOutput)
	}
	c, err := conn.client()
	if err != nil {
		return failUsage("%v", err)
	}
	defer c.CloseIdleConnections()
	if *leaseID != "" {
		c.UseLease(agentID, *leaseID)
	}

	req := client.RunCommandRequest{Command: command, Cwd: *cwd, TimeoutSeconds: timeout, MaxOutputBytes: *maxOutput}
	if len(env) > 0 {
		req.Env = env
	}
	var input io.Reader
	switch {
	case *withStdin || *stdinFile == "-":
		input = stdin
	case *stdinFile != "":
		f, err := os.Open(*stdinFile)
		if err != nil {
			return failUsage("--stdin-file: %v", err)
		}
		defer f.Close()
		input = f
	}
	if input != nil {
		data, err := io.ReadAll(io.LimitReader(input, maxInlineStdin+1))
		if err != nil {
			fmt.Fprintf(stderr, "agentbox %s: read the command's input: %v\n", name, err)
			return exitAPIError
		}
		if len(data) > maxInlineStdin {
			return failUsage("the command's input is larger than %d MiB; upload it with \"agentbox cp\" and redirect from the file", maxInlineStdin>>20)
		}
		req.Stdin = string(data)
	}

	// Streamed, so that a long command's output shows as it comes.
	res, err := c.RunCommandStream(ctx, agentID, req, func(ev client.CommandEvent) error {
		switch ev.Stream {
		case client.StreamStdout:
			_, _ = io.WriteString(stdout, ev.Data)
		case client.StreamStderr:
			_, _ = io.WriteString(stderr, ev.Data)
		}
		return nil
	})
	if err != nil {
		msg := describe(err)
		if client.CodeOf(err) == client.CodePayloadTooLarge && input != nil {
			msg += `; upload large input with "agentbox cp" and redirect from the file`
		}
		fmt.Fprintf(stderr, "agentbox %s: %s\n", name, msg)
		return exitAPIError
	}
	if res.OutOfMemory {
		fmt.Fprintf(stderr, "agentbox %s: %s\n", name, outOfMemoryNote)
	}
	fmt.Fprintln(stderr, summary(res))
	return exitCode(res)
}
