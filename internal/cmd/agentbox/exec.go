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

// execFlags are exec's flags, beside the connection's.
type execFlags struct {
	conn      connection
	leaseID   *string
	cwd       *string
	env       envFlag
	timeout   int
	withStdin *bool
	stdinFile *string
	maxOutput *int64
}

// execCommand runs a command in an agent's sandbox; "run-command" is its
// older name and works the same.
func execCommand(ctx context.Context, name string, args []string, getenv func(string) string, stdin io.Reader, stdout, stderr io.Writer) int {
	fs, f := execFlagSet(name, getenv, stderr)
	failUsage := func(format string, args ...any) int {
		fmt.Fprintf(stderr, "agentbox %s: %s\n", name, fmt.Sprintf(format, args...))
		return exitUsage
	}
	agentID, command, code, ok := parseExecArgs(fs, name, args, stderr)
	if !ok {
		return code
	}
	if err := f.check(agentID, command); err != nil {
		return failUsage("%v", err)
	}
	c, err := f.conn.client()
	if err != nil {
		return failUsage("%v", err)
	}
	defer c.CloseIdleConnections()
	if *f.leaseID != "" {
		c.UseLease(agentID, *f.leaseID)
	}

	req := client.RunCommandRequest{Command: command, Cwd: *f.cwd, TimeoutSeconds: f.timeout, MaxOutputBytes: *f.maxOutput}
	if len(f.env) > 0 {
		req.Env = f.env
	}
	input, closeInput, err := f.openInput(stdin)
	if err != nil {
		return failUsage("--stdin-file: %v", err)
	}
	defer closeInput()
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
	return runStreamed(ctx, c, name, agentID, req, input != nil, stdout, stderr)
}

// execFlagSet defines exec's usage and flags.
func execFlagSet(name string, getenv func(string) string, stderr io.Writer) (*flag.FlagSet, *execFlags) {
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
	f := &execFlags{env: envFlag{}}
	f.conn = connectionFlags(fs, getenv)
	f.leaseID = leaseFlag(fs, getenv)
	f.cwd = fs.String("cwd", "", "working directory in the sandbox; relative to /workspace (default /workspace)")
	fs.Var(f.env, "env", "NAME=VALUE to set in the command's environment; repeatable")
	fs.Var(secondsFlag{&f.timeout}, "timeout", "time after which the command is killed, in seconds or as a duration (default: the sandbox's, 60s)")
	f.withStdin = fs.Bool("stdin", false, "send this program's standard input to the command")
	f.stdinFile = fs.String("stdin-file", "", "send this file to the command's standard input (- for this program's)")
	f.maxOutput = fs.Int64("max-output-bytes", 0, "cap on stdout and stderr combined (default: the sandbox's, 1 MiB)")
	return fs, f
}

// parseExecArgs parses flags before and after AGENT_ID and returns the
// agent and the command after "--"; when !ok, the caller exits with code.
func parseExecArgs(fs *flag.FlagSet, name string, args []string, stderr io.Writer) (agentID string, command []string, code int, ok bool) {
	parse := func(args []string) (int, bool) {
		if err := fs.Parse(args); err != nil {
			if errors.Is(err, flag.ErrHelp) {
				return 0, false
			}
			return exitUsage, false
		}
		return 0, true
	}
	if code, ok := parse(args); !ok {
		return "", nil, code, false
	}
	if fs.NArg() == 0 {
		fmt.Fprintf(stderr, "agentbox %s: missing AGENT_ID\n", name)
		fs.Usage()
		return "", nil, exitUsage, false
	}
	agentID = fs.Arg(0)
	// Parse again after the agent ID, so flags may follow it; this also
	// consumes the "--" before the command.
	if code, ok := parse(fs.Args()[1:]); !ok {
		return "", nil, code, false
	}
	return agentID, fs.Args(), 0, true
}

// check refuses what cannot be sent; its errors are usage errors.
func (f *execFlags) check(agentID string, command []string) error {
	switch {
	case agentID == "":
		return errors.New("missing AGENT_ID")
	case len(command) == 0:
		return errors.New("missing the command to run after AGENT_ID --")
	case *f.withStdin && *f.stdinFile != "":
		return fmt.Errorf("--stdin and --stdin-file %q both name the command's input; pass one", *f.stdinFile)
	case *f.maxOutput < 0:
		return fmt.Errorf("--max-output-bytes %d is negative", *f.maxOutput)
	}
	return nil
}

// openInput returns the command's standard input, nil for none, and what
// closes it.
func (f *execFlags) openInput(stdin io.Reader) (io.Reader, func(), error) {
	switch {
	case *f.withStdin || *f.stdinFile == "-":
		return stdin, func() {}, nil
	case *f.stdinFile != "":
		file, err := os.Open(*f.stdinFile)
		if err != nil {
			return nil, func() {}, err
		}
		return file, func() { file.Close() }, nil
	}
	return nil, func() {}, nil
}

// runStreamed runs req, streamed so that a long command's output shows as
// it comes, and returns the exit code agentbox ends with.
func runStreamed(ctx context.Context, c *client.Client, name, agentID string, req client.RunCommandRequest, hasInput bool, stdout, stderr io.Writer) int {
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
		if client.CodeOf(err) == client.CodePayloadTooLarge && hasInput {
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
