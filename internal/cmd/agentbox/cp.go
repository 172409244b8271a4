package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
)

// operand is one side of a copy: a local path, "-" for standard input or
// output, or a file in an agent's workspace.
type operand struct {
	agentID, path string
	remote        bool
}

// parseOperand reads AGENT_ID:PATH as scp does: a colon before any slash
// makes the operand remote, so "./a:b" and "/tmp/a:b" stay local. Agent
// IDs may themselves contain colons; for those, --agent names the agent
// and the remote side is written ":PATH".
func parseOperand(s, agentFlag string) (operand, error) {
	i := strings.IndexByte(s, ':')
	if s == "-" || i < 0 || strings.Contains(s[:i], "/") {
		return operand{path: s}, nil
	}
	agentID, p := s[:i], s[i+1:]
	switch {
	case agentFlag != "" && agentID == "":
		agentID = agentFlag
	case agentFlag != "":
		return operand{}, fmt.Errorf("%q names agent %q and --agent names %q; with --agent write the remote side as :PATH", s, agentID, agentFlag)
	case agentID == "":
		return operand{}, fmt.Errorf("%q: missing AGENT_ID before the colon (or pass --agent)", s)
	}
	return operand{agentID: agentID, path: p, remote: true}, nil
}

func parseMode(s string) (fs.FileMode, error) {
	n, err := strconv.ParseUint(s, 8, 32)
	if err != nil || n > 0o777 {
		return 0, fmt.Errorf("--mode %q: want octal permission bits such as 0644 or 755", s)
	}
	return fs.FileMode(n), nil
}

func cpCommand(ctx context.Context, args []string, getenv func(string) string, stdin io.Reader, stdout, stderr io.Writer) int {
	var (
		modeFlag, agentFlag string
		mode                fs.FileMode
		src, dst            operand
	)
	return command{
		name:     "cp",
		synopsis: "cp [flags] SRC DST",
		doc: `Copies one file to or from an agent's workspace. Exactly one of SRC and
DST is AGENT_ID:PATH, PATH relative to /workspace; the other is a local
path, or - for standard input or output. The file streams: its size is
bounded by the workspace, not by memory.

  agentbox cp report.csv agent-1:data/          upload into data/report.csv
  agentbox cp agent-1:out/result.json .         download into ./result.json
  tar cz src | agentbox cp - agent-1:src.tgz    upload standard input

An upload is written atomically in the workspace; a download goes to a
temporary file beside DST that is renamed over DST only once complete, so
a failed copy leaves DST as it was. An upload's mode is --mode, else the
local file's permission bits, else the sandbox's default (0644). On a
terminal, long copies show their progress on stderr.`,
		args: []string{"SRC", "DST"},
		flags: func(fs *flag.FlagSet) {
			fs.StringVar(&modeFlag, "mode", "", "permission bits of the file written, in octal (e.g. 0755)")
			fs.StringVar(&agentFlag, "agent", "", "the agent, for agent IDs that contain a colon; the remote side is then :PATH")
		},
		check: func(args []string) (err error) {
			if modeFlag != "" {
				if mode, err = parseMode(modeFlag); err != nil {
					return err
				}
			}
			if src, err = parseOperand(args[0], agentFlag); err != nil {
				return fmt.Errorf("SRC %w", err)
			}
			if dst, err = parseOperand(args[1], agentFlag); err != nil {
				return fmt.Errorf("DST %w", err)
			}
			switch {
			case src.remote && dst.remote:
				return fmt.Errorf("SRC %q and DST %q are both in a workspace; one side must be local", args[0], args[1])
			case !src.remote && !dst.remote:
				return fmt.Errorf("neither SRC %q nor DST %q is AGENT_ID:PATH; use cp(1) for local copies", args[0], args[1])
			case src.remote && (src.path == "" || strings.HasSuffix(src.path, "/")):
				return fmt.Errorf("SRC %q names no file", args[0])
			case dst.remote && src.path == "-" && (dst.path == "" || strings.HasSuffix(dst.path, "/")):
				return fmt.Errorf("DST %q needs a file name when SRC is standard input", args[1])
			}
			return nil
		},
		leaseAgent: func([]string) string {
			if dst.remote {
				return dst.agentID
			}
			return src.agentID
		},
		run: func(ctx context.Context, c *client.Client, _ []string) error {
			if dst.remote {
				return upload(ctx, c, src.path, dst, mode, modeFlag != "", stdin, stderr)
			}
			return download(ctx, c, src, dst.path, mode, modeFlag != "", stdout, stderr)
		},
	}.main(ctx, args, getenv, stderr)
}

func upload(ctx context.Context, c *client.Client, local string, dst operand, mode fs.FileMode, modeSet bool,
	stdin io.Reader, stderr io.Writer) error {
	body, total := stdin, int64(-1)
	if local != "-" {
		f, err := os.Open(local)
		if err != nil {
			return usageError{fmt.Errorf("SRC: %w", err)}
		}
		defer f.Close()
		fi, err := f.Stat()
		if err != nil {
			return fmt.Errorf("SRC: %w", err)
		}
		if fi.IsDir() {
			return usagef("SRC %q is a directory; cp copies one file (archive a directory with tar and copy that)", local)
		}
		if fi.Mode().IsRegular() {
			total = fi.Size()
		}
		if !modeSet {
			mode = fi.Mode().Perm()
		}
		body = f
	}
	remote := dst.path
	if remote == "" || strings.HasSuffix(remote, "/") {
		remote += filepath.Base(local)
	}
	p := newProgress(stderr, total)
	_, err := c.PutFile(ctx, dst.agentID, remote, progressReader{body, p}, uint32(mode))
	p.done()
	return err
}

func download(ctx context.Context, c *client.Client, src operand, local string, mode fs.FileMode, modeSet bool,
	stdout, stderr io.Writer) error {
	if local != "-" {
		if fi, err := os.Stat(local); (err == nil && fi.IsDir()) || strings.HasSuffix(local, string(filepath.Separator)) {
			local = filepath.Join(local, path.Base(src.path))
		}
	}
	body, err := c.GetFile(ctx, src.agentID, src.path)
	if err != nil {
		return err
	}
	defer body.Close()
	p := newProgress(stderr, -1)
	defer p.done()
	in := progressReader{body, p}
	if local == "-" {
		if _, err := io.Copy(stdout, in); err != nil {
			return fmt.Errorf("copy %s:%s to standard output: %w", src.agentID, src.path, err)
		}
		return nil
	}
	if !modeSet {
		mode = 0o644
		// Overwriting keeps the file's mode, as cp(1) does.
		if fi, err := os.Stat(local); err == nil && fi.Mode().IsRegular() {
			mode = fi.Mode().Perm()
		}
	}
	return writeAtomically(local, mode, in)
}

// writeAtomically writes r to a temporary file in name's directory and
// renames it to name once r is fully read, so that name is never left
// holding part of a file, and a reader of name sees the old file or the
// new one.
func writeAtomically(name string, mode fs.FileMode, r io.Reader) (err error) {
	tmp, err := os.CreateTemp(filepath.Dir(name), "."+filepath.Base(name)+".agentbox-*")
	if err != nil {
		return fmt.Errorf("DST: %w", err)
	}
	defer func() {
		if err != nil {
			tmp.Close()
			os.Remove(tmp.Name())
		}
	}()
	if _, err := io.Copy(tmp, r); err != nil {
		return fmt.Errorf("download to %s: %w", name, err)
	}
	if err := tmp.Chmod(mode); err != nil {
		return fmt.Errorf("DST: %w", err)
	}
	if err := tmp.Close(); err != nil {
		return fmt.Errorf("DST: %w", err)
	}
	if err := os.Rename(tmp.Name(), name); err != nil {
		return fmt.Errorf("DST: %w", err)
	}
	return nil
}
