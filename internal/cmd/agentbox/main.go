// Command agentbox is a small client of the agentbox Compute API, for people
// and scripts (and the quickstart):
//
//	agentbox exec [flags] AGENT_ID -- CMD [ARGS...]   (alias: run-command)
//	agentbox shell [flags] AGENT_ID [-- CMD [ARGS...]]
//	agentbox console --reason TEXT [--ttl 15m] AGENT_ID   (staff token)
//	agentbox cp [--mode 0755] SRC DST                  (one side AGENT_ID:PATH, - for stdin/stdout)
//	agentbox status [--json] AGENT_ID
//	agentbox mcp request [--user-token-file F] AGENT_ID SERVER [REQUEST]
//	agentbox events [-f] [--after ID] [--json] AGENT_ID
//	agentbox deploy [--wait] [--timeout 10m] [--template NS/NAME] [--request-id ID] AGENT_ID
//	agentbox leases acquire|heartbeat|release [flags] AGENT_ID
//	agentbox leases acquire-pool [--wait 60s] [flags] NAMESPACE POOL
//	agentbox runs start [--wait] [--request-id ID] [flags] AGENT_ID -- CMD [ARGS...]
//	agentbox runs get|cancel RUN_ID
//	agentbox runs list [--agent A] [--status S]
//	agentbox tokens create --kind agent --agent AGENT_ID [--ttl 720h]
//	agentbox tokens revoke TOKEN_ID
//	agentbox audit verify
//	agentbox audit query [--agent A] [--operation OP] [--since 1h]
//	agentbox audit console [--json] SESSION_ID
//
// Every command takes --endpoint, --token-file and --ca-file, or the
// variables AGENTBOX_ENDPOINT, AGENTBOX_TOKEN and AGENTBOX_CA_FILE. While a
// sandbox is leased, exec, shell, cp and deploy need the lease's ID
// (--lease-id or AGENTBOX_LEASE_ID); without it the API refuses them with
// lease_held, and agentbox says who holds the lease until when.
//
// exec prints the command's stdout and stderr as they are, then a summary
// line "exit_code=N duration=D" on stderr, and exits with the command's
// exit code: 124 if it timed out, 128+N if signal N ended it. Every
// command exits 1 with a message if the API refused or failed the call,
// and 2 with a message naming the bad argument for a usage error.
package main

import (
	"context"
	"errors"
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
  exec          run a command in an agent's sandbox (alias: run-command)
  shell         open an interactive terminal in an agent's sandbox
  console       open a staff console on an agent's sandbox, with a reason (staff)
  cp            copy a file to or from an agent's workspace
  status        show an agent's sandbox, without waking it
  mcp           send a JSON-RPC request to an MCP server of an agent's sandbox, optionally as a user
  events        print or follow the life of an agent's sandbox (created, ready, stopped, commands...)
  deploy        start, resume or create an agent's sandbox
  envs          list, build ahead or delete an agent's cached Python environments
  leases        acquire, heartbeat and release sandbox leases
  runs          start commands that run to completion in the background, follow and cancel them
  tokens        create or revoke API tokens (admin)
  token         exchange a user id for a short-lived user token an agent acts with, or revoke one (admin)
  audit         verify the audit log's hash chain, query it, or read a console session back (admin)
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
	case "exec", "run-command":
		return execCommand(ctx, args[0], args[1:], getenv, stdin, stdout, stderr)
	case "shell":
		return shellCommand(ctx, args[1:], getenv, stdin, stdout, stderr)
	case "console":
		return consoleCommand(ctx, args[1:], getenv, stdin, stdout, stderr)
	case "cp":
		return cpCommand(ctx, args[1:], getenv, stdin, stdout, stderr)
	case "status":
		return statusCommand(ctx, args[1:], getenv, stdout, stderr)
	case "mcp":
		return mcpCommand(ctx, args[1:], getenv, stdin, stdout, stderr)
	case "events":
		return eventsCommand(ctx, args[1:], getenv, stdout, stderr)
	case "deploy":
		return deployCommand(ctx, args[1:], getenv, stdout, stderr)
	case "leases":
		return leasesCommand(ctx, args[1:], getenv, stdout, stderr)
	case "envs":
		return envsCommand(ctx, args[1:], getenv, stdout, stderr)
	case "audit":
		return auditCommand(ctx, args[1:], getenv, stdout, stderr)
	case "runs":
		return runsCommand(ctx, args[1:], getenv, stdout, stderr)
	case "tokens":
		return tokensCommand(ctx, args[1:], getenv, stdout, stderr)
	case "token":
		return userTokenCommand(ctx, args[1:], getenv, stdout, stderr)
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
//
// agentbox sets no deadline of its own on a call: the API bounds every
// wait it makes (a stopped sandbox's resume, computeapi.DefaultResumeTimeout)
// and then answers, so the CLI always shows the API's own account. Only an
// interruption or a broken connection ends a call early, and those say so.
func describe(err error) string {
	var e *client.Error
	if !errors.As(err, &e) {
		switch {
		case errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded):
			return "interrupted before the Compute API answered; a sandbox that was resuming goes on resuming (agentbox status shows it): " + err.Error()
		case errors.Is(err, client.ErrStreamIncomplete):
			return "the connection to the Compute API broke before the command's result arrived, so whether it ran to its end is unknown: " + err.Error()
		}
		return err.Error()
	}
	msg := fmt.Sprintf("%s (%s, HTTP %d)", e.Message, e.Code, e.Status)
	if e.Code == client.CodeUnauthenticated {
		msg += "; check the token"
	}
	if holder, until, ok := client.LeaseHeldBy(err); ok && holder != "" {
		msg += fmt.Sprintf("; held by %q until %s", holder, until.Local().Format(time.RFC3339))
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
	if res.OutOfMemory {
		b.WriteString(" out_of_memory=true")
	}
	if res.Truncated {
		b.WriteString(" truncated=true")
	}
	return b.String()
}

// outOfMemoryNote explains a command the sandbox's memory guard killed,
// which a bare SIGKILL would not.
const outOfMemoryNote = "the sandbox ran short of memory: its supervisor killed this command, which held the most"

// signalNumbers maps the signals a sandboxed command is commonly ended by
// to their Linux numbers, for the shell convention of exiting 128+N.
var signalNumbers = map[string]int{
	"SIGHUP": 1, "SIGINT": 2, "SIGQUIT": 3, "SIGILL": 4, "SIGTRAP": 5, "SIGABRT": 6, "SIGBUS": 7,
	"SIGFPE": 8, "SIGKILL": 9, "SIGUSR1": 10, "SIGSEGV": 11, "SIGUSR2": 12, "SIGPIPE": 13,
	"SIGALRM": 14, "SIGTERM": 15, "SIGXCPU": 24, "SIGXFSZ": 25, "SIGSYS": 31,
}

func exitCode(res *client.CommandResult) int {
	if res.TimedOut {
		return exitTimedOut
	}
	return processExit(res.ExitCode, res.Signal)
}

// processExit is the shell's status for a process that exited with code,
// or was ended by signal when code is negative.
func processExit(code int, signal string) int {
	switch {
	case code >= 0:
		// Linux exit statuses fit a byte; clamping rather than masking
		// keeps an impossible larger code from turning into success.
		return min(code, 255)
	case signalNumbers[signal] != 0:
		return 128 + signalNumbers[signal]
	default:
		return exitAPIError
	}
}
