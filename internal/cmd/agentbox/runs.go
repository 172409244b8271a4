package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
)

const runsUsage = `usage: agentbox runs start [flags] AGENT_ID -- CMD [ARGS...]
       agentbox runs start --mode pool --pool NS/POOL [flags] -- CMD [ARGS...]
       agentbox runs start --mode job --template NS/NAME [flags] -- CMD [ARGS...]
       agentbox runs logs [-f] [--after ID] [--json] RUN_ID
       agentbox runs get [--json] RUN_ID
       agentbox runs list [--agent A] [--status S] [--json]
       agentbox runs cancel [--json] RUN_ID
       agentbox runs artifacts [--get PATH [-o FILE]] [--json] RUN_ID

Run "agentbox runs <subcommand> -h" for its flags.
`

// runsCommand: agentbox runs start|logs|get|list|cancel|artifacts.
func runsCommand(ctx context.Context, args []string, getenv func(string) string, stdout, stderr io.Writer) int {
	if len(args) == 0 {
		fmt.Fprint(stderr, runsUsage)
		return exitUsage
	}
	o := &runOptions{stdout: stdout, stderr: stderr, env: envFlag{}}
	sub, rest := args[0], args[1:]
	var cmd command
	switch sub {
	case "start":
		cmd = o.startCommand()
	case "get":
		cmd = o.getCommand()
	case "logs":
		cmd = o.logsCommand()
	case "list":
		cmd = o.listCommand()
	case "cancel":
		cmd = o.cancelCommand()
	case "artifacts":
		cmd = o.artifactsCommand()
	default:
		fmt.Fprintf(stderr, "agentbox runs: unknown subcommand %q\n%s", sub, runsUsage)
		return exitUsage
	}
	cmd.name = "runs " + sub
	if code := cmd.main(ctx, rest, getenv, stderr); code != 0 {
		return code
	}
	return o.exit
}

// runOptions are the runs subcommands' flags, where they print, and the
// exit code of a run waited for.
type runOptions struct {
	asJSON, wait, follow  bool
	after                 int64
	requestID, workflowID string
	cwd, agent, status    string
	timeout               int
	poll                  time.Duration
	env                   envFlag
	artifacts             []string
	stdout, stderr        io.Writer
	exit                  int
	// Where a pool or job run gets its sandbox, and a job's options.
	mode, pool, template string
	backoffLimit         int
	activeDeadline       int
	ttlAfterFinished     *int
}

func (o *runOptions) startCommand() command {
	return command{
		synopsis: "runs start [flags] AGENT_ID -- CMD [ARGS...]\n       agentbox runs start --mode pool|job [flags] -- CMD [ARGS...]",
		doc: `Starts a run of the command in the agent's sandbox and prints its run id.
The run goes on in the control plane when agentbox exits; "runs get" shows
how it ended. With --wait, agentbox waits for it to end, prints a summary
line on stderr and exits with the command's exit code: 124 if it timed
out, 1 if it was cancelled or could not run. With --follow, it prints the
run id on stderr, then the command's output as it comes (stdout to
stdout, stderr to stderr, as "runs logs -f" does), and exits as --wait
does. Only the names of --env variables are recorded. --request-id makes
the start idempotent: a second start with the same id prints the first
run's id and starts nothing. On a held sandbox, --lease-id presents the
lease the run acts for.

--mode pool runs the command in a ready sandbox leased from the warm pool
--pool NS/POOL, recycled after the run; --mode job runs it in a sandbox
made for the run from the SandboxTemplate --template NS/NAME, deleted
after the run, retrying a failed attempt up to --backoff-limit times (the
command sees its attempt number in AGENTBOX_RUN_ATTEMPT). Both take no
AGENT_ID, and need an admin token. --active-deadline bounds the whole run,
waits and retries included; --ttl-after-finished keeps its record that
long after it ends instead of the platform's retention.`,
		leaseAgent: func(args []string) string {
			if o.mode != "" && o.mode != client.RunModeAgent {
				return ""
			}
			return args[0]
		},
		flags: func(fs *flag.FlagSet) {
			fs.BoolVar(&o.wait, "wait", false, "wait for the run to end and exit with the command's exit code")
			fs.BoolVar(&o.follow, "follow", false, "print the run's output as it comes and exit with the command's exit code")
			fs.DurationVar(&o.poll, "poll", time.Second, "with --wait, how often to look at the run")
			fs.StringVar(&o.requestID, "request-id", "", "makes the start idempotent for this token")
			fs.StringVar(&o.workflowID, "workflow-id", "", "the workflow the run belongs to, recorded with it")
			fs.StringVar(&o.cwd, "cwd", "", "working directory in the sandbox (default: the workspace)")
			fs.Var(o.env, "env", "NAME=VALUE given to the command; repeatable (only the names are recorded)")
			fs.Var(secondsFlag{&o.timeout}, "timeout", "how long the command may run, in seconds or as a duration (default: the sandbox's, 60s)")
			fs.BoolVar(&o.asJSON, "json", false, "print the run as JSON instead of its id")
			fs.Var(stringsFlag{&o.artifacts}, "artifact", "a workspace path or glob whose files are kept once the command ends; repeatable (default: /workspace/artifacts)")
			fs.StringVar(&o.mode, "mode", client.RunModeAgent, "where the run executes: agent (AGENT_ID's sandbox), pool (--pool) or job (--template)")
			fs.StringVar(&o.pool, "pool", "", "with --mode pool: the warm pool to lease a sandbox from, as NAMESPACE/POOL")
			fs.StringVar(&o.template, "template", "", "with --mode job: the SandboxTemplate to make the run's sandbox from, as NAMESPACE/NAME")
			fs.IntVar(&o.backoffLimit, "backoff-limit", 0, fmt.Sprintf("with --mode job: retries of a failed attempt (0..%d)", client.MaxRunBackoffLimit))
			fs.Var(secondsFlag{&o.activeDeadline}, "active-deadline", "bound on the whole run, waits and retries included, in seconds or as a duration")
			fs.Var(optionalSecondsFlag{&o.ttlAfterFinished}, "ttl-after-finished", "keep the run's record this long after it ends, in seconds or as a duration (default: the platform's retention)")
		},
		check: func(args []string) error {
			agentMode := o.mode == client.RunModeAgent
			switch {
			case o.mode != client.RunModeAgent && o.mode != client.RunModePool && o.mode != client.RunModeJob:
				return fmt.Errorf("--mode must be agent, pool or job, got %q", o.mode)
			case agentMode && (o.pool != "" || o.template != "" || o.backoffLimit != 0):
				return fmt.Errorf("--pool, --template and --backoff-limit go with --mode pool or job")
			case o.mode == client.RunModePool && o.pool == "":
				return fmt.Errorf("--mode pool needs --pool NAMESPACE/POOL")
			case o.mode == client.RunModePool && (o.template != "" || o.backoffLimit != 0):
				return fmt.Errorf("--template and --backoff-limit go with --mode job")
			case o.mode == client.RunModeJob && o.template == "":
				return fmt.Errorf("--mode job needs --template NAMESPACE/NAME")
			case o.mode == client.RunModeJob && o.pool != "":
				return fmt.Errorf("--pool goes with --mode pool")
			case o.backoffLimit < 0 || o.backoffLimit > client.MaxRunBackoffLimit:
				return fmt.Errorf("--backoff-limit must be between 0 and %d", client.MaxRunBackoffLimit)
			case !agentMode && len(args) == 0:
				return fmt.Errorf("missing the command: agentbox runs start --mode %s ... -- CMD [ARGS...]", o.mode)
			case !agentMode:
			case len(args) == 0 || args[0] == "":
				return fmt.Errorf("missing AGENT_ID")
			case len(args) == 1:
				return fmt.Errorf("missing the command: agentbox runs start AGENT_ID -- CMD [ARGS...]")
			case o.poll <= 0:
				return fmt.Errorf("--poll must be positive")
			case o.follow && (o.wait || o.asJSON):
				return fmt.Errorf("--follow prints the output; it goes with neither --wait nor --json")
			}
			return nil
		},
		run: func(ctx context.Context, c *client.Client, args []string) error {
			req := client.StartRunRequest{Cwd: o.cwd, TimeoutSeconds: o.timeout, RequestID: o.requestID, WorkflowID: o.workflowID,
				Mode: o.mode, Pool: o.pool, Template: o.template, BackoffLimit: o.backoffLimit,
				ActiveDeadlineSeconds: o.activeDeadline, TTLSecondsAfterFinished: o.ttlAfterFinished, Artifacts: o.artifacts}
			if o.mode == client.RunModeAgent {
				req.Mode, req.AgentID, req.Command = "", args[0], args[1:]
			} else {
				req.Command = args
			}
			if len(o.env) > 0 {
				req.Env = o.env
			}
			r, _, err := c.StartRun(ctx, req)
			if err != nil {
				return err
			}
			if o.follow {
				fmt.Fprintln(o.stderr, r.ID)
				return o.printLogs(ctx, c, r.ID, true)
			}
			if o.asJSON && !o.wait {
				return printJSON(o.stdout, r)
			}
			if !o.asJSON {
				fmt.Fprintln(o.stdout, r.ID)
			}
			if !o.wait {
				return nil
			}
			if r, err = c.WaitRun(ctx, r.ID, o.poll); err != nil {
				return err
			}
			if o.asJSON {
				if err := printJSON(o.stdout, r); err != nil {
					return err
				}
			}
			fmt.Fprintln(o.stderr, runSummary(r))
			o.exit = runExitCode(r)
			return nil
		},
	}
}

// runExitCode is what agentbox exits with for a run that ended: the
// command's own code when it exited, 124 when it timed out (as
// timeout(1)), 1 otherwise.
func runExitCode(r *client.Run) int {
	switch {
	case r.Status == client.RunTimedOut:
		return exitTimedOut
	case r.ExitCode != nil:
		return *r.ExitCode
	case r.Status == client.RunSucceeded:
		return 0
	}
	return exitAPIError
}

// runSummary is one line on how a run stands.
func runSummary(r *client.Run) string {
	parts := []string{r.ID, r.Status}
	if r.ExitCode != nil {
		parts = append(parts, fmt.Sprintf("exit_code=%d", *r.ExitCode))
	}
	if r.Reason != "" {
		parts = append(parts, "reason="+r.Reason)
	}
	parts = append(parts, fmt.Sprintf("output_bytes=%d", r.OutputBytes))
	if r.StartedAt != nil && r.FinishedAt != nil {
		parts = append(parts, "duration="+r.FinishedAt.Sub(*r.StartedAt).Round(time.Millisecond).String())
	}
	if r.Message != "" && r.Status != client.RunSucceeded {
		parts = append(parts, fmt.Sprintf("message=%q", r.Message))
	}
	return strings.Join(parts, " ")
}

func (o *runOptions) logsCommand() command {
	return command{
		synopsis: "runs logs [-f] [--after ID] [--json] RUN_ID",
		doc: `Prints a run's output: its stdout to stdout, its stderr to stderr, a line
at a time as it was recorded (known secret formats redacted). With -f,
agentbox follows a live run to its end, reconnecting by itself if the
connection breaks, and exits with the command's exit code (124 if it
timed out, 1 if it was cancelled or could not run). Without -f a run that
has ended is printed whole, with the same exit code, and a live one up to
where it is (exit 0). --after ID starts after the event with that id;
--json prints every event (state changes and the end too) as one JSON
object a line instead.`,
		args: []string{"RUN_ID"},
		flags: func(fs *flag.FlagSet) {
			fs.BoolVar(&o.follow, "f", false, "follow the run until it ends")
			fs.BoolVar(&o.follow, "follow", false, "same as -f")
			fs.Int64Var(&o.after, "after", 0, "print only the events after the one with this id")
			fs.BoolVar(&o.asJSON, "json", false, "print the events as JSON lines")
		},
		check: func([]string) error {
			if o.after < 0 {
				return fmt.Errorf("--after must not be negative")
			}
			return nil
		},
		run: func(ctx context.Context, c *client.Client, args []string) error {
			return o.printLogs(ctx, c, args[0], o.follow)
		},
	}
}

// logsIdle is how long "runs logs" without -f waits for more of a live
// run's output before it stops.
const logsIdle = time.Second

// printLogs prints a run's events from o.after, to its end when follow
// or the run has ended, and sets o.exit to how the run ended.
func (o *runOptions) printLogs(ctx context.Context, c *client.Client, id string, follow bool) error {
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	errIdle := fmt.Errorf("no more output yet")
	var idle *time.Timer
	if !follow {
		r, err := c.GetRun(ctx, id)
		if err != nil {
			return err
		}
		if !r.Terminal() {
			idle = time.AfterFunc(logsIdle, func() { cancel(errIdle) })
			defer idle.Stop()
		}
	}
	var end *client.RunEvent
	err := c.FollowRun(ctx, id, o.after, func(e client.RunEvent) error {
		if idle != nil {
			idle.Reset(logsIdle)
		}
		if o.asJSON {
			b, err := json.Marshal(e)
			if err != nil {
				return err
			}
			_, err = fmt.Fprintf(o.stdout, "%s\n", b)
			if e.Type == client.RunEventEnd {
				end = &e
			}
			return err
		}
		var err error
		switch e.Type {
		case client.RunEventStdout:
			_, err = io.WriteString(o.stdout, e.Text)
		case client.RunEventStderr:
			_, err = io.WriteString(o.stderr, e.Text)
		case client.RunEventTruncated:
			_, err = fmt.Fprintf(o.stderr, "agentbox: %s\n", e.Message)
		case client.RunEventEnd:
			end = &e
		}
		return err
	})
	if errors.Is(context.Cause(ctx), errIdle) {
		fmt.Fprintf(o.stderr, "agentbox: run %s is still running; -f follows it\n", id)
		return nil
	}
	if err != nil {
		return err
	}
	if end == nil {
		return nil
	}
	r := &client.Run{ID: id, Status: end.Status, ExitCode: end.ExitCode, Reason: end.Reason, Message: end.Message}
	if !o.asJSON && r.Status != client.RunSucceeded {
		// How it ended, on stderr, since its output alone may not say.
		parts := []string{"agentbox: run", id, r.Status}
		if r.ExitCode != nil {
			parts = append(parts, fmt.Sprintf("exit_code=%d", *r.ExitCode))
		}
		if r.Reason != "" {
			parts = append(parts, "reason="+r.Reason)
		}
		if r.Message != "" {
			parts = append(parts, fmt.Sprintf("message=%q", r.Message))
		}
		fmt.Fprintln(o.stderr, strings.Join(parts, " "))
	}
	o.exit = runExitCode(r)
	return nil
}

func (o *runOptions) getCommand() command {
	return command{
		synopsis: "runs get [--json] RUN_ID",
		doc:      "Prints a run's record.",
		args:     []string{"RUN_ID"},
		flags:    func(fs *flag.FlagSet) { fs.BoolVar(&o.asJSON, "json", false, "print the run as JSON") },
		run: func(ctx context.Context, c *client.Client, args []string) error {
			r, err := c.GetRun(ctx, args[0])
			if err != nil {
				return err
			}
			return o.show(r)
		},
	}
}

func (o *runOptions) cancelCommand() command {
	return command{
		synopsis: "runs cancel [--json] RUN_ID",
		doc: `Asks for a run to be cancelled and prints it as it stands: a queued run
ends at once, a running one shortly after (its command is killed). A run
that had already ended is printed as it ended.`,
		args:  []string{"RUN_ID"},
		flags: func(fs *flag.FlagSet) { fs.BoolVar(&o.asJSON, "json", false, "print the run as JSON") },
		run: func(ctx context.Context, c *client.Client, args []string) error {
			r, err := c.CancelRun(ctx, args[0])
			if err != nil {
				return err
			}
			if o.asJSON {
				return printJSON(o.stdout, r)
			}
			fmt.Fprintln(o.stdout, runSummary(r))
			return nil
		},
	}
}

func (o *runOptions) listCommand() command {
	var limit int
	var page, schedule, since string
	return command{
		synopsis: "runs list [--agent A] [--status S] [--schedule NS/NAME] [--since T] [--json]",
		doc:      "Lists runs, newest first. An agent token lists its own agent's runs.",
		args:     []string{},
		flags: func(fs *flag.FlagSet) {
			fs.StringVar(&o.agent, "agent", "", "only this agent's runs")
			fs.StringVar(&o.status, "status", "", "only runs in this status: queued, running, succeeded, failed, timed_out, cancelled")
			fs.StringVar(&schedule, "schedule", "", "only the runs this RunSchedule (namespace/name) started")
			fs.StringVar(&since, "since", "", "only runs created since then: an RFC 3339 time, or a duration ago such as 1h")
			fs.IntVar(&limit, "limit", 0, "runs per page (default 50, at most 500)")
			fs.StringVar(&page, "page-token", "", "the next_page_token a listing printed")
			fs.BoolVar(&o.asJSON, "json", false, "print the page as JSON")
		},
		run: func(ctx context.Context, c *client.Client, _ []string) error {
			from, err := parseSince(since, time.Now())
			if err != nil {
				return err
			}
			l, err := c.ListRuns(ctx, client.RunFilter{AgentID: o.agent, Status: o.status, Schedule: schedule, Since: from,
				Limit: limit, PageToken: page})
			if err != nil {
				return err
			}
			if o.asJSON {
				return printJSON(o.stdout, l)
			}
			tw := tabwriter.NewWriter(o.stdout, 0, 0, 2, ' ', 0)
			fmt.Fprintln(tw, "RUN_ID\tSTATUS\tEXIT\tAGENT\tCREATED\tCOMMAND")
			for _, r := range l.Runs {
				exit := "-"
				if r.ExitCode != nil {
					exit = fmt.Sprint(*r.ExitCode)
				}
				fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\n", r.ID, r.Status, exit, r.AgentID,
					r.CreatedAt.Format(time.RFC3339), strings.Join(r.Command, " "))
			}
			if err := tw.Flush(); err != nil {
				return err
			}
			if l.NextPageToken != "" {
				fmt.Fprintf(o.stdout, "next_page_token: %s\n", l.NextPageToken)
			}
			return nil
		},
	}
}

// show prints a run as JSON, or one "name: value" line per field set,
// names as in the JSON.
func (o *runOptions) show(r *client.Run) error {
	if o.asJSON {
		return printJSON(o.stdout, r)
	}
	tw := tabwriter.NewWriter(o.stdout, 0, 0, 1, ' ', 0)
	line := func(name, value string) {
		if value != "" {
			fmt.Fprintf(tw, "%s:\t%s\n", name, value)
		}
	}
	at := func(t *time.Time) string {
		if t == nil {
			return ""
		}
		return t.Format(time.RFC3339)
	}
	line("id", r.ID)
	line("mode", r.Mode)
	line("status", r.Status)
	if r.ExitCode != nil {
		line("exit_code", fmt.Sprint(*r.ExitCode))
	}
	line("reason", r.Reason)
	line("message", r.Message)
	line("agent_id", r.AgentID)
	line("sandbox", r.Sandbox)
	line("pool", r.Pool)
	line("template", r.Template)
	line("command", strings.Join(r.Command, " "))
	line("env_names", strings.Join(r.EnvNames, " "))
	line("cwd", r.Cwd)
	line("timeout_seconds", fmt.Sprint(r.TimeoutSeconds))
	line("output_bytes", fmt.Sprint(r.OutputBytes))
	line("request_id", r.RequestID)
	line("workflow_id", r.WorkflowID)
	line("caller", r.Caller)
	line("attempts", fmt.Sprint(r.Attempts))
	if r.BackoffLimit > 0 {
		line("backoff_limit", fmt.Sprint(r.BackoffLimit))
	}
	if r.ActiveDeadlineSeconds > 0 {
		line("active_deadline_seconds", fmt.Sprint(r.ActiveDeadlineSeconds))
	}
	if r.TTLSecondsAfterFinished != nil {
		line("ttl_seconds_after_finished", fmt.Sprint(*r.TTLSecondsAfterFinished))
	}
	line("executor", r.Executor)
	line("cancel_requested_by", r.CancelRequestedBy)
	line("cancelled_by", r.CancelledBy)
	line("created_at", r.CreatedAt.Format(time.RFC3339))
	line("started_at", at(r.StartedAt))
	line("finished_at", at(r.FinishedAt))
	line("expires_at", at(r.ExpiresAt))
	for _, a := range r.AttemptHistory {
		line(fmt.Sprintf("attempt %d", a.Attempt), attemptSummary(a))
	}
	return tw.Flush()
}

// attemptSummary is one line on an attempt of a run: how it ended, when
// it started, how long it took, and where.
func attemptSummary(a client.RunAttempt) string {
	parts := []string{a.Status}
	if a.ExitCode != nil {
		parts = append(parts, fmt.Sprintf("exit_code=%d", *a.ExitCode))
	}
	if a.Reason != "" {
		parts = append(parts, "reason="+a.Reason)
	}
	parts = append(parts, "started_at="+a.StartedAt.Format(time.RFC3339))
	if a.FinishedAt != nil {
		parts = append(parts, "duration="+a.FinishedAt.Sub(a.StartedAt).Round(time.Millisecond).String())
	}
	if a.Sandbox != "" {
		parts = append(parts, "sandbox="+a.Sandbox)
	}
	return strings.Join(parts, " ")
}

// optionalSecondsFlag is secondsFlag for a value that may be left unset
// (nil), as opposed to zero.
type optionalSecondsFlag struct{ seconds **int }

func (f optionalSecondsFlag) String() string {
	if f.seconds == nil || *f.seconds == nil {
		return ""
	}
	return fmt.Sprint(**f.seconds)
}

func (f optionalSecondsFlag) Set(s string) error {
	var n int
	if err := (secondsFlag{&n}).Set(s); err != nil {
		return err
	}
	*f.seconds = &n
	return nil
}
