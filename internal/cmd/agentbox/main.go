// Command agentbox is a small client of the agentbox Compute API, for people
// and scripts (and the quickstart):
//
//	agentbox run-command --endpoint URL [--token-file F] [--ca-file F] AGENT_ID -- CMD [ARGS...]
//	agentbox tokens create --kind agent --agent AGENT_ID [--ttl 720h]
//	agentbox tokens revoke TOKEN_ID
//	agentbox audit verify
//	agentbox audit query [--agent A] [--operation OP] [--since 1h]
//
// It prints the command's stdout and stderr as they are, then a summary line
// "exit_code=N duration=D" on stderr, and exits with the command's exit
// code: 124 if it timed out, 128+N if signal N ended it, and 1 with a
// message if the API refused or failed the call.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
)

// version is set at build time with -ldflags "-X main.version=...".
var version = "dev"

// Exit codes of the CLI itself, chosen as shells and coreutils use them so
// scripts can tell them from a command's own codes where that is possible.
const (
	exitAPIError = 1
	exitUsage    = 2
	// exitTimedOut matches timeout(1).
	exitTimedOut = 124
)

const usage = `usage: agentbox <command> [flags]

commands:
  run-command   run a command in an agent's sandbox
  tokens        create or revoke API tokens (admin)
  audit         verify the audit log's hash chain, or query it (admin)
  version       print the version

Run "agentbox <command> -h" for a command's flags.
`

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := run(ctx, os.Args[1:], os.Getenv, os.Stdin, os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}

func run(ctx context.Context, args []string, getenv func(string) string, stdin io.Reader, stdout, stderr io.Writer) int {
	if len(args) == 0 {
		fmt.Fprint(stderr, usage)
		return exitUsage
	}
	switch args[0] {
	case "run-command":
		return runCommand(ctx, args[1:], getenv, stdin, stdout, stderr)
	case "audit":
		return auditCommand(ctx, args[1:], getenv, stdout, stderr)
	case "tokens":
		return tokensCommand(ctx, args[1:], getenv, stdout, stderr)
	case "version", "--version", "-version":
		fmt.Fprintln(stdout, version)
		return 0
	case "help", "-h", "--help":
		fmt.Fprint(stdout, usage)
		return 0
	default:
		fmt.Fprintf(stderr, "agentbox: unknown command %q\n%s", args[0], usage)
		return exitUsage
	}
}

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

func runCommand(ctx context.Context, args []string, getenv func(string) string, stdin io.Reader, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("agentbox run-command", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprint(fs.Output(), `usage: agentbox run-command [flags] AGENT_ID -- CMD [ARGS...]

Runs CMD in the sandbox of AGENT_ID. No shell is involved; use
"-- sh -c '...'" for one. Flags may also follow AGENT_ID, before "--".

flags:
`)
		fs.PrintDefaults()
	}
	endpoint := fs.String("endpoint", getenv("AGENTBOX_ENDPOINT"), "Compute API URL, e.g. https://agentbox-api.agentbox-system.svc [AGENTBOX_ENDPOINT]")
	tokenFile := fs.String("token-file", "", "file holding the API token (default: the AGENTBOX_TOKEN variable)")
	caFile := fs.String("ca-file", getenv("AGENTBOX_CA_FILE"), "PEM file of the platform CA that signed the API's certificate; default: the system roots [AGENTBOX_CA_FILE]")
	cwd := fs.String("cwd", "", "working directory in the sandbox (default /workspace)")
	env := envFlag{}
	fs.Var(env, "env", "NAME=VALUE to set in the command's environment; repeatable")
	timeout := fs.Int("timeout", 0, "seconds after which the command is killed (default: the sandbox's, 60)")
	withStdin := fs.Bool("stdin", false, "send this program's standard input to the command")

	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		return exitUsage
	}
	if fs.NArg() == 0 {
		fmt.Fprintln(stderr, "agentbox run-command: missing AGENT_ID")
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
	if len(command) == 0 {
		fmt.Fprintln(stderr, "agentbox run-command: missing the command to run after AGENT_ID --")
		return exitUsage
	}
	if *endpoint == "" {
		fmt.Fprintln(stderr, "agentbox run-command: --endpoint (or AGENTBOX_ENDPOINT) is required")
		return exitUsage
	}

	token, err := readToken(*tokenFile, getenv)
	if err != nil {
		fmt.Fprintln(stderr, "agentbox run-command:", err)
		return exitUsage
	}
	var caPEM []byte
	if *caFile != "" {
		if caPEM, err = os.ReadFile(*caFile); err != nil {
			fmt.Fprintln(stderr, "agentbox run-command: read --ca-file:", err)
			return exitUsage
		}
	}
	req := client.RunCommandRequest{Command: command, Cwd: *cwd, TimeoutSeconds: *timeout}
	if len(env) > 0 {
		req.Env = env
	}
	if *withStdin {
		data, err := io.ReadAll(stdin)
		if err != nil {
			fmt.Fprintln(stderr, "agentbox run-command: read standard input:", err)
			return exitAPIError
		}
		req.Stdin = string(data)
	}

	c, err := client.New(*endpoint, token, caPEM)
	if err != nil {
		fmt.Fprintln(stderr, "agentbox run-command:", err)
		return exitUsage
	}
	res, err := c.RunCommand(ctx, agentID, req)
	if err != nil {
		fmt.Fprintln(stderr, "agentbox run-command:", describe(err))
		return exitAPIError
	}
	_, _ = io.WriteString(stdout, res.Stdout)
	_, _ = io.WriteString(stderr, res.Stderr)
	fmt.Fprintln(stderr, summary(res))
	return exitCode(res)
}

// readToken prefers --token-file to AGENTBOX_TOKEN: a file keeps the token
// out of the process environment and shell history.
func readToken(file string, getenv func(string) string) (string, error) {
	if file != "" {
		data, err := os.ReadFile(file)
		if err != nil {
			return "", fmt.Errorf("read --token-file: %w", err)
		}
		if t := strings.TrimSpace(string(data)); t != "" {
			return t, nil
		}
		return "", fmt.Errorf("--token-file %s is empty", file)
	}
	if t := strings.TrimSpace(getenv("AGENTBOX_TOKEN")); t != "" {
		return t, nil
	}
	return "", errors.New("no token: pass --token-file or set AGENTBOX_TOKEN")
}

// describe words an API error for a person: the message, with the code for
// searching and scripting.
func describe(err error) string {
	var e *client.Error
	if !errors.As(err, &e) {
		return err.Error()
	}
	msg := fmt.Sprintf("%s (%s, HTTP %d)", e.Message, e.Code, e.Status)
	if e.Code == client.CodeUnauthenticated {
		msg += "; check the token"
	}
	return msg
}

func summary(res *client.CommandResult) string {
	var b strings.Builder
	fmt.Fprintf(&b, "exit_code=%d duration=%s", res.ExitCode, time.Duration(res.DurationMS)*time.Millisecond)
	if res.Signal != "" {
		fmt.Fprintf(&b, " signal=%s", res.Signal)
	}
	if res.TimedOut {
		b.WriteString(" timed_out=true")
	}
	if res.Truncated {
		b.WriteString(" truncated=true")
	}
	return b.String()
}

// signalNumbers maps the signals a sandboxed command is commonly ended by
// to their Linux numbers, for the shell convention of exiting 128+N.
var signalNumbers = map[string]int{
	"SIGHUP": 1, "SIGINT": 2, "SIGQUIT": 3, "SIGILL": 4, "SIGTRAP": 5, "SIGABRT": 6, "SIGBUS": 7,
	"SIGFPE": 8, "SIGKILL": 9, "SIGUSR1": 10, "SIGSEGV": 11, "SIGUSR2": 12, "SIGPIPE": 13,
	"SIGALRM": 14, "SIGTERM": 15, "SIGXCPU": 24, "SIGXFSZ": 25, "SIGSYS": 31,
}

func exitCode(res *client.CommandResult) int {
	switch {
	case res.TimedOut:
		return exitTimedOut
	case res.ExitCode >= 0:
		// Linux exit statuses fit a byte; clamping rather than masking
		// keeps an impossible larger code from turning into success.
		return min(res.ExitCode, 255)
	case signalNumbers[res.Signal] != 0:
		return 128 + signalNumbers[res.Signal]
	default:
		return exitAPIError
	}
}
