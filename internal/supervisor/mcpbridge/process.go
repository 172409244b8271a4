package mcpbridge

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/modelcontextprotocol/go-sdk/mcp"
)

// process is the server's child process and the SDK transport to it: the
// SDK's IOTransport over pipes this package made. The SDK's own
// CommandTransport is not used because it waits for the process inside
// Close and gives up after its timeouts while that Wait still runs (so the
// exit status cannot be read safely), signals only the leader rather than
// the group, and cannot let the supervisor's reaper know about the child.
type process struct {
	cmd     *exec.Cmd
	tracker ChildTracker
	pid     int
	exited  chan struct{} // closed once Wait has returned
	waitErr error         // Wait's error, once exited is closed

	mu     sync.Mutex
	reaped bool // the leader was waited for, so its group ID may be reused
}

// Connect starts the process and connects to its stdin and stdout.
func (p *process) Connect(ctx context.Context) (mcp.Connection, error) {
	stdin, err := p.cmd.StdinPipe()
	if err != nil {
		return nil, err
	}
	stdout, err := p.cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	start := func() (int, error) {
		if err := p.cmd.Start(); err != nil {
			return 0, err
		}
		return p.cmd.Process.Pid, nil
	}
	if p.tracker != nil {
		err = p.tracker.Start(start)
	} else {
		_, err = start()
	}
	if err != nil {
		close(p.exited)
		p.waitErr = err
		return nil, err
	}
	p.mu.Lock()
	p.pid = p.cmd.Process.Pid
	p.mu.Unlock()
	go func() {
		p.waitErr = p.cmd.Wait()
		close(p.exited)
	}()
	return (&mcp.IOTransport{Reader: stdout, Writer: stdin}).Connect(ctx)
}

// killGroup signals the server's process group. The group outlives its
// leader while any member is left, and the kernel does not reuse its ID
// while it exists, so this is safe until reap.
func (p *process) killGroup(sig syscall.Signal) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.pid > 0 && !p.reaped {
		_ = syscall.Kill(-p.pid, sig)
	}
}

// reap waits for the leader, which must have been killed or have exited,
// waits a little for the rest of its group to go, and tells the tracker.
func (p *process) reap() {
	if p.pid == 0 {
		return
	}
	<-p.exited
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.reaped {
		return
	}
	p.reaped = true
	if p.tracker != nil {
		p.tracker.Done(p.pid)
	}
	// SIGKILL is delivered asynchronously: give the members a moment to
	// die, so that a returned Stop means no process is left.
	for deadline := time.Now().Add(time.Second); time.Now().Before(deadline); time.Sleep(5 * time.Millisecond) {
		if !groupAlive(p.pid) {
			return
		}
	}
}

// groupAlive reports whether a process of group pgid is still running.
// Zombies do not count: they are dead, only waiting for their parent (the
// reaper, once orphaned) to collect them. Without /proc, any member
// counts.
func groupAlive(pgid int) bool {
	if syscall.Kill(-pgid, 0) != nil {
		return false
	}
	entries, err := os.ReadDir("/proc")
	if err != nil {
		return true
	}
	for _, e := range entries {
		if e.Name()[0] < '0' || e.Name()[0] > '9' {
			continue
		}
		data, err := os.ReadFile("/proc/" + e.Name() + "/stat")
		if err != nil {
			continue
		}
		// The command name is in parentheses and may contain anything;
		// the fields after it are state, ppid and pgrp.
		i := strings.LastIndexByte(string(data), ')')
		if i < 0 {
			continue
		}
		f := strings.Fields(string(data[i+1:]))
		if len(f) >= 3 && f[0] != "Z" && f[2] == strconv.Itoa(pgid) {
			return true
		}
	}
	return false
}

// exitError describes how the server ended: its exit status when it has
// one, else err, with the last line of its standard error.
func (p *process) exitError(phase string, err error, tail *tailBuffer, ctx context.Context) error {
	var msg string
	var ps *os.ProcessState
	if p.pid > 0 {
		<-p.exited
		ps = p.cmd.ProcessState
	}
	switch {
	case p.pid == 0 && err != nil:
		msg = "start: " + err.Error()
	case phase == "start" && errors.Is(context.Cause(ctx), context.DeadlineExceeded):
		msg = "start-up timed out"
	case ps != nil && phase == "start":
		msg = "exited during start-up: " + ps.String()
	case ps != nil:
		msg = ps.String() // "exit status 3", "signal: killed"
	case p.waitErr != nil:
		msg = phase + ": " + p.waitErr.Error()
	case err != nil:
		msg = phase + ": " + err.Error()
	default:
		msg = "exited"
	}
	if last := tail.lastLine(); last != "" {
		msg += "; stderr: " + last
	}
	return errors.New(msg)
}

// tailBuffer keeps the last max bytes written to it.
type tailBuffer struct {
	mu  sync.Mutex
	max int
	buf []byte
}

func (b *tailBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	n := len(p)
	if len(p) >= b.max {
		p = p[len(p)-b.max:]
		b.buf = append(b.buf[:0], p...)
		return n, nil
	}
	if over := len(b.buf) + len(p) - b.max; over > 0 {
		b.buf = append(b.buf[:0], b.buf[over:]...)
	}
	b.buf = append(b.buf, p...)
	return n, nil
}

// lastLine is the last non-empty line, cut to 512 bytes.
func (b *tailBuffer) lastLine() string {
	b.mu.Lock()
	s := string(b.buf)
	b.mu.Unlock()
	lines := strings.Split(strings.TrimRight(s, "\r\n\t "), "\n")
	last := strings.TrimSpace(lines[len(lines)-1])
	if len(last) > 512 {
		last = last[:512] + "..."
	}
	return strings.ToValidUTF8(last, "\uFFFD")
}
