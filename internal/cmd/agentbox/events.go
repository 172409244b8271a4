package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"strings"
	"time"

	"github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
)

// eventsCommand: agentbox events [-f] [--after ID] [--json] AGENT_ID.
func eventsCommand(ctx context.Context, args []string, getenv func(string) string, stdout, stderr io.Writer) int {
	var (
		follow, asJSON bool
		after          int64
	)
	return command{
		name:     "events",
		synopsis: "events [-f] [--after ID] [--json] AGENT_ID",
		doc: `Prints the life of an agent's sandbox, an event a line: created, ready,
idle stops, snapshots, resumes, pods replaced or failed, commands started
and ended, egress denied, errors. Each line starts with the event's id and
time. With -f, agentbox follows the events as they happen, reconnecting by
itself if the connection breaks, until interrupted; without it, it prints
the events kept so far and stops. --after ID starts after the event with
that id; --json prints each event as one JSON object a line. It never
wakes the sandbox.`,
		args: []string{"AGENT_ID"},
		flags: func(fs *flag.FlagSet) {
			fs.BoolVar(&follow, "f", false, "follow the events until interrupted")
			fs.BoolVar(&follow, "follow", false, "same as -f")
			fs.Int64Var(&after, "after", 0, "print only the events after the one with this id")
			fs.BoolVar(&asJSON, "json", false, "print the events as JSON lines")
		},
		check: func([]string) error {
			if after < 0 {
				return fmt.Errorf("--after must not be negative")
			}
			return nil
		},
		run: func(ctx context.Context, c *client.Client, args []string) error {
			return printAgentEvents(ctx, c, args[0], after, follow, asJSON, stdout)
		},
	}.main(ctx, args, getenv, stderr)
}

// printAgentEvents prints agentID's events after after: until ctx ends
// when follow (an interrupt is the way out, and not an error), else
// until none came for logsIdle.
func printAgentEvents(ctx context.Context, c *client.Client, agentID string, after int64, follow, asJSON bool, w io.Writer) error {
	parent := ctx
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	errIdle := errors.New("no more events yet")
	var idle *time.Timer
	if !follow {
		idle = time.AfterFunc(logsIdle, func() { cancel(errIdle) })
		defer idle.Stop()
	}
	err := c.FollowAgentEvents(ctx, agentID, after, func(e client.AgentEvent) error {
		if idle != nil {
			idle.Reset(logsIdle)
		}
		if asJSON {
			b, err := json.Marshal(e)
			if err != nil {
				return err
			}
			_, err = fmt.Fprintf(w, "%s\n", b)
			return err
		}
		_, err := fmt.Fprintln(w, formatAgentEvent(e))
		return err
	})
	if errors.Is(context.Cause(ctx), errIdle) || (follow && parent.Err() != nil) {
		return nil
	}
	return err
}

// formatAgentEvent is an event as one line: id, time, type, then the
// fields it has as key=value, the message last.
func formatAgentEvent(e client.AgentEvent) string {
	parts := []string{fmt.Sprint(e.ID), e.Time.UTC().Format("2006-01-02T15:04:05.000Z"), e.Type}
	add := func(k, v string) {
		if v != "" {
			parts = append(parts, k+"="+v)
		}
	}
	add("sandbox", strings.Trim(e.Namespace+"/"+e.Sandbox, "/"))
	add("reason", e.Reason)
	add("pod", e.Pod)
	add("snapshot", e.Snapshot)
	add("run", e.RunID)
	add("command_id", e.CommandID)
	if len(e.Command) > 0 {
		add("command", fmt.Sprintf("%q", strings.Join(e.Command, " ")))
	}
	if e.ExitCode != nil {
		add("exit_code", fmt.Sprint(*e.ExitCode))
	}
	if e.TimedOut {
		add("timed_out", "true")
	}
	add("signal", e.Signal)
	add("error", e.Error)
	if e.Type == client.AgentEventCommandEnded {
		add("duration", (time.Duration(e.DurationMS) * time.Millisecond).String())
	}
	if e.Host != "" {
		add("host", fmt.Sprintf("%s:%d", e.Host, e.Port))
	}
	if e.Count > 1 {
		add("count", fmt.Sprint(e.Count))
	}
	if e.Message != "" {
		add("message", fmt.Sprintf("%q", e.Message))
	}
	return strings.Join(parts, " ")
}
