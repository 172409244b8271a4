package main

import (
	"context"
	"crypto/rand"
	"errors"
	"flag"
	"fmt"
	"io"
	"text/tabwriter"
	"time"

	"github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
)

// deployPoll is how often deploy --wait looks at the sandbox for its
// progress line.
const deployPoll = 500 * time.Millisecond

func statusCommand(ctx context.Context, args []string, getenv func(string) string, stdout, stderr io.Writer) int {
	var asJSON bool
	return command{
		name:     "status",
		synopsis: "status [flags] AGENT_ID",
		doc:      "Shows the agent's sandbox: its phase, whether it is ready, and its latest\nsnapshot. It never wakes a stopped sandbox.",
		args:     []string{"AGENT_ID"},
		flags:    func(fs *flag.FlagSet) { fs.BoolVar(&asJSON, "json", false, "print the status as JSON") },
		run: func(ctx context.Context, c *client.Client, args []string) error {
			st, err := c.Status(ctx, args[0])
			if err != nil {
				return err
			}
			return printStatus(stdout, st, asJSON)
		},
	}.main(ctx, args, getenv, stderr)
}

func printStatus(w io.Writer, st *client.SandboxStatus, asJSON bool) error {
	if asJSON {
		return printJSON(w, st)
	}
	tw := tabwriter.NewWriter(w, 0, 0, 1, ' ', 0)
	fmt.Fprintf(tw, "agent:\t%s\n", st.AgentID)
	fmt.Fprintf(tw, "sandbox:\t%s/%s\n", st.Namespace, st.Name)
	fmt.Fprintf(tw, "phase:\t%s\n", st.Phase)
	ready := "no"
	if st.Ready {
		ready = "yes"
	}
	if st.Reason != "" {
		ready += " (" + st.Reason + ")"
	}
	fmt.Fprintf(tw, "ready:\t%s\n", ready)
	if st.Created {
		fmt.Fprintf(tw, "created:\t%s\n", "yes")
	}
	if st.Message != "" {
		fmt.Fprintf(tw, "message:\t%s\n", st.Message)
	}
	if s := st.Snapshot; s != nil {
		line := s.Name
		if s.SizeBytes > 0 {
			line += ", " + mib(s.SizeBytes)
		}
		if !s.ReadyAt.IsZero() {
			line += ", taken " + s.ReadyAt.Local().Format(time.RFC3339)
		}
		if s.Driver != "" {
			line += ", " + s.Driver + " driver"
		}
		fmt.Fprintf(tw, "snapshot:\t%s\n", line)
	}
	if b := st.IdleStopBlocked; b != nil {
		line := b.Reason + ": " + b.Message
		if !b.NextAttemptAt.IsZero() {
			line += fmt.Sprintf(" (next attempt %s)", b.NextAttemptAt.Local().Format(time.RFC3339))
		}
		fmt.Fprintf(tw, "idle stop blocked:\t%s\n", line)
	}
	return tw.Flush()
}

func deployCommand(ctx context.Context, args []string, getenv func(string) string, stdout, stderr io.Writer) int {
	var (
		wait, asJSON bool
		timeout      time.Duration
		req          client.DeployRequest
	)
	return command{
		name:     "deploy",
		synopsis: "deploy [flags] AGENT_ID",
		doc: `Starts the agent's sandbox, or resumes it from its snapshot if it is
stopped, and prints its status once it serves calls. An agent without a
sandbox gets one, made from --template or the platform's default
template ("created: yes"). The API waits a few minutes at most; with
--wait, agentbox keeps waiting up to --timeout and shows the sandbox's
phase on stderr meanwhile.`,
		args:       []string{"AGENT_ID"},
		leaseAgent: func(args []string) string { return args[0] },
		flags: func(fs *flag.FlagSet) {
			fs.BoolVar(&wait, "wait", false, "wait until the sandbox is ready, showing its phase")
			fs.DurationVar(&timeout, "timeout", 10*time.Minute, "with --wait, how long to wait")
			fs.BoolVar(&asJSON, "json", false, "print the status as JSON")
			fs.StringVar(&req.Template, "template", "", "NAMESPACE/NAME of the SandboxTemplate to create a missing sandbox from (admin token); default: the platform's default template")
			fs.StringVar(&req.RequestID, "request-id", "", "names the create: a retry with the same ID is told the sandbox was created for it (default: a new random ID)")
		},
		check: func([]string) error {
			if timeout <= 0 {
				return fmt.Errorf("--timeout %s: want a positive duration", timeout)
			}
			if req.RequestID == "" {
				// One ID for every call --wait makes.
				req.RequestID = rand.Text()
			}
			return nil
		},
		run: func(ctx context.Context, c *client.Client, args []string) error {
			var st *client.SandboxStatus
			var err error
			if wait {
				st, err = deployAndWait(ctx, c, args[0], req, timeout, stderr)
			} else {
				st, err = c.DeployOrResume(ctx, args[0], req)
			}
			if err != nil {
				return err
			}
			return printStatus(stdout, st, asJSON)
		},
	}.main(ctx, args, getenv, stderr)
}

// deployAndWait calls deploy_or_resume until the sandbox serves, the
// sandbox fails, or timeout passes. Meanwhile it polls status (which is
// cheap: the API answers it from its cache) for a progress line: redrawn
// in place on a terminal, one line per phase change otherwise.
func deployAndWait(ctx context.Context, c *client.Client, agentID string, req client.DeployRequest, timeout time.Duration, stderr io.Writer) (*client.SandboxStatus, error) {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	start := time.Now()
	type result struct {
		st  *client.SandboxStatus
		err error
	}
	done := make(chan result, 1)
	go func() {
		for {
			st, err := c.DeployOrResume(ctx, agentID, req)
			if client.CodeOf(err) == client.CodeSandboxNotReady && ctx.Err() == nil {
				// The API stopped waiting, or the sandbox is not one
				// that comes up by itself: status tells which.
				cur, serr := c.Status(ctx, agentID)
				if serr == nil && comingUp(cur) {
					select {
					case <-ctx.Done():
					case <-time.After(time.Second):
					}
					continue
				}
			}
			done <- result{st, err}
			return
		}
	}()

	term := isTerminal(stderr)
	lastPhase := ""
	drawn := false
	tick := time.NewTicker(deployPoll)
	defer tick.Stop()
	for {
		select {
		case r := <-done:
			if drawn && term {
				fmt.Fprint(stderr, "\r\x1b[K")
			}
			if r.err != nil && ctx.Err() != nil && errors.Is(r.err, context.DeadlineExceeded) {
				return nil, fmt.Errorf("the sandbox of agent %q was not ready after %s (last phase %s)", agentID, timeout, orUnknown(lastPhase))
			}
			return r.st, r.err
		case <-tick.C:
			st, err := c.Status(ctx, agentID)
			if err != nil {
				continue
			}
			line := fmt.Sprintf("waiting for sandbox: phase %s, %.1fs", st.Phase, time.Since(start).Seconds())
			switch {
			case term:
				fmt.Fprintf(stderr, "\r%s\x1b[K", line)
				drawn = true
			case st.Phase != lastPhase:
				fmt.Fprintln(stderr, line)
			}
			lastPhase = st.Phase
		}
	}
}

// comingUp mirrors the API's view of a sandbox that becomes ready without
// anyone's help: stopped or stopping (a call resumes it), resuming, being
// created, or running with its readiness lagging.
func comingUp(st *client.SandboxStatus) bool {
	switch st.Phase {
	case "Stopped", "IdleStopping", "Resuming", "Running":
		return true
	case "Pending", "":
		return st.Reason == "" || st.Reason == "Creating" || st.Reason == "AdoptedFromWarmPool"
	}
	return false
}

func orUnknown(s string) string {
	if s == "" {
		return "unknown"
	}
	return s
}
