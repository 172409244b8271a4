package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"
	"time"

	"golang.org/x/term"

	"github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"
)

// eot is what a terminal's VEOF key (^D) sends: a reader at the start of
// a line sees end of input.
const eot = 0x04

func shellCommand(ctx context.Context, args []string, getenv func(string) string, stdin io.Reader, stdout, stderr io.Writer) int {
	var cwd string
	env := envFlag{}
	cmd := command{
		name:     "shell",
		synopsis: "shell [flags] AGENT_ID [-- CMD [ARGS...]]",
		doc: `Opens an interactive terminal in the sandbox of AGENT_ID, waking it if it
is stopped: a shell, or CMD. When standard input is a terminal it is put
in raw mode and its size follows the local window; otherwise what is
piped in is typed, followed by ^D. agentbox exits with the process's
exit code, or 128+N if signal N ended it.`,
		flags: func(fs *flag.FlagSet) {
			fs.StringVar(&cwd, "cwd", "", "working directory in the sandbox; relative to /workspace (default /workspace)")
			fs.Var(env, "env", "NAME=VALUE to set in the process's environment; repeatable")
		},
		check: func(args []string) error {
			if len(args) == 0 || args[0] == "" {
				return errors.New("missing AGENT_ID")
			}
			return nil
		},
		leaseAgent: func(args []string) string { return args[0] },
	}
	return cmd.interactive(ctx, args, getenv, stdin, stdout, stderr,
		func(ctx context.Context, c *client.Client, args []string, cols, rows uint16) (*supervisorapi.PTY, error) {
			return c.OpenPTY(ctx, args[0], client.PTYOptions{Command: args[1:], Cwd: cwd, Env: env, Cols: cols, Rows: rows})
		})
}

func consoleCommand(ctx context.Context, args []string, getenv func(string) string, stdin io.Reader, stdout, stderr io.Writer) int {
	var reason string
	var ttl time.Duration
	cmd := command{
		name:     "console",
		synopsis: "console --reason TEXT [--ttl 15m] AGENT_ID",
		doc: `Opens a staff console: a shell in the sandbox of AGENT_ID, with a staff
token. The reason, who connected, when, the sandbox's snapshot, what was
typed and what the terminal showed are recorded (known secret formats
redacted; "agentbox audit console SESSION_ID" reads it back), and the
session ends when its time box (--ttl) passes. A session connects once.
A lease held on the sandbox does not keep staff out; the audit log says
the console passed it. agentbox exits with the shell's exit code.`,
		args: []string{"AGENT_ID"},
		flags: func(fs *flag.FlagSet) {
			fs.StringVar(&reason, "reason", "", "why you need the console, e.g. a ticket; required and recorded")
			fs.DurationVar(&ttl, "ttl", 0, "how long the session may last, at most 1h (default: the API's, 15m)")
		},
		check: func([]string) error {
			switch {
			case reason == "":
				return errors.New("--reason is required: every console access says why")
			case ttl < 0 || ttl%time.Second != 0:
				return fmt.Errorf("--ttl %s must be a positive whole number of seconds", ttl)
			}
			return nil
		},
	}
	return cmd.interactive(ctx, args, getenv, stdin, stdout, stderr,
		func(ctx context.Context, c *client.Client, args []string, cols, rows uint16) (*supervisorapi.PTY, error) {
			s, err := c.CreateConsoleSession(ctx, client.CreateConsoleSessionRequest{AgentID: args[0], Reason: reason, TTLSeconds: int(ttl / time.Second)})
			if err != nil {
				return nil, err
			}
			fmt.Fprintf(stderr, "console session %s on agent %s until %s; this session is recorded\n",
				s.ID, s.AgentID, s.ExpiresAt.Local().Format(time.TimeOnly))
			return c.OpenConsole(ctx, s.ID, cols, rows)
		})
}

// interactive runs cmd with open as what it does: open a terminal session
// of the local window's size, then attach to it. It exits with the remote
// process's status, or the command's own on a usage or API error.
func (cmd command) interactive(ctx context.Context, args []string, getenv func(string) string, stdin io.Reader, stdout, stderr io.Writer,
	open func(ctx context.Context, c *client.Client, args []string, cols, rows uint16) (*supervisorapi.PTY, error)) int {
	code := 0
	cmd.run = func(ctx context.Context, c *client.Client, args []string) error {
		cols, rows := terminalSize(stdin)
		p, err := open(ctx, c, args, cols, rows)
		if err != nil {
			return err
		}
		code, err = attach(ctx, p, stdin, stdout, stderr)
		return err
	}
	if rc := cmd.main(ctx, args, getenv, stderr); rc != 0 {
		return rc
	}
	return code
}

// terminalSize is in's window size, or 0x0 (the API's default) when in is
// not a terminal.
func terminalSize(in io.Reader) (cols, rows uint16) {
	f, ok := in.(*os.File)
	if !ok || !term.IsTerminal(int(f.Fd())) {
		return 0, 0
	}
	w, h, err := term.GetSize(int(f.Fd()))
	if err != nil || w <= 0 || h <= 0 || w > 0xffff || h > 0xffff {
		return 0, 0
	}
	return uint16(w), uint16(h)
}

// attach connects the local terminal (or pipes) to p until the remote
// process exits, and returns its shell status.
func attach(ctx context.Context, p *supervisorapi.PTY, stdin io.Reader, stdout, stderr io.Writer) (int, error) {
	defer p.Close()
	if f, ok := stdin.(*os.File); ok && term.IsTerminal(int(f.Fd())) {
		// Raw, so that keys like ^C and arrows reach the remote terminal
		// as bytes, and the remote terminal alone echoes.
		if old, err := term.MakeRaw(int(f.Fd())); err == nil {
			defer term.Restore(int(f.Fd()), old)
		}
		winch := make(chan os.Signal, 1)
		signal.Notify(winch, syscall.SIGWINCH)
		defer signal.Stop(winch)
		done := make(chan struct{})
		defer close(done)
		go func() {
			for {
				select {
				case <-done:
					return
				case <-winch:
					if cols, rows := terminalSize(f); cols > 0 {
						_ = p.Resize(ctx, cols, rows)
					}
				}
			}
		}()
		go func() { _, _ = io.Copy(p, f) }()
	} else {
		go func() {
			if _, err := io.Copy(p, stdin); err == nil {
				_, _ = p.Write([]byte{eot})
			}
		}()
	}
	if _, err := io.Copy(stdout, p); err != nil {
		return 0, fmt.Errorf("terminal output: %w", err)
	}
	exit, err := p.Wait(ctx)
	if err != nil {
		return 0, fmt.Errorf("terminal session: %w", err)
	}
	if exit.Reason != "" {
		fmt.Fprintf(stderr, "\r\nthe sandbox ended the session: %s\r\n", exit.Reason)
	}
	return processExit(exit.ExitCode, exit.Signal), nil
}
