package testenv

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// startProcess runs a component detached from the caller's process group,
// with its output in logDir/name.log, so that a cluster started by
// `agentbox-testenv up` outlives that command and a Ctrl-C in a test run
// does not kill half of it.
func startProcess(st *state, name, bin string, args []string, env []string) error {
	logf, err := os.OpenFile(filepath.Join(st.Dir, name+".log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	defer logf.Close()
	cmd := exec.Command(bin, args...)
	cmd.Stdout = logf
	cmd.Stderr = logf
	cmd.Dir = st.Dir
	cmd.Env = append(os.Environ(), env...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("start %s: %w", name, err)
	}
	st.Procs = append(st.Procs, proc{Name: name, PID: cmd.Process.Pid})
	// Reap in the background so a component that dies becomes a detectable
	// non-existent PID instead of a zombie, which would look alive to kill(0).
	go func() { _ = cmd.Wait() }()
	return st.save()
}

// alive reports whether pid exists and is not a zombie.
func alive(pid int) bool {
	if pid <= 0 || syscall.Kill(pid, 0) != nil {
		return false
	}
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return false
	}
	// The state field follows the parenthesised command name.
	if i := bytes.LastIndexByte(b, ')'); i > 0 && i+2 < len(b) {
		return b[i+2] != 'Z'
	}
	return true
}

// stopPID sends SIGTERM, waits up to grace, then SIGKILLs.
func stopPID(pid int, grace time.Duration) {
	if !alive(pid) {
		return
	}
	_ = syscall.Kill(pid, syscall.SIGTERM)
	deadline := time.Now().Add(grace)
	for time.Now().Before(deadline) {
		if !alive(pid) {
			return
		}
		time.Sleep(50 * time.Millisecond)
	}
	_ = syscall.Kill(pid, syscall.SIGKILL)
	for i := 0; i < 100 && alive(pid); i++ {
		time.Sleep(20 * time.Millisecond)
	}
}

// pidsMentioning lists processes whose command line contains s. Shims and
// gVisor sandboxes are started by containerd, not by us, and are found by
// the state-directory paths on their command lines.
func pidsMentioning(s string) []int {
	entries, _ := os.ReadDir("/proc")
	var pids []int
	self := os.Getpid()
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil || pid == self {
			continue
		}
		cmdline, err := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
		if err != nil {
			continue
		}
		if strings.Contains(string(bytes.ReplaceAll(cmdline, []byte{0}, []byte{' '})), s) {
			pids = append(pids, pid)
		}
	}
	return pids
}

// freePort asks the kernel for a free TCP port on ip. There is a window
// between closing the listener and the component binding it; components are
// started right away, and a collision shows as a clear startup error.
func freePort(ip string) (int, error) {
	l, err := net.Listen("tcp", net.JoinHostPort(ip, "0"))
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

func run(ctx context.Context, name string, args ...string) error {
	out, err := exec.CommandContext(ctx, name, args...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("%s %s: %w: %s", name, strings.Join(args, " "), err, strings.TrimSpace(string(out)))
	}
	return nil
}

// waitFor polls check until it succeeds, the deadline passes or the
// component's process dies, in which case the error names the log to read.
func waitFor(ctx context.Context, st *state, name string, timeout time.Duration, check func(context.Context) error) error {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	var last error
	for {
		if last = check(ctx); last == nil {
			return nil
		}
		if p := st.proc(name); p != nil && !alive(p.PID) {
			return fmt.Errorf("%s exited during startup; last lines of %s:\n%s", name, st.logPath(name), st.logTail(name, 20))
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("%s not ready after %s: %v; last lines of %s:\n%s", name, timeout, last, st.logPath(name), st.logTail(name, 20))
		case <-time.After(100 * time.Millisecond):
		}
	}
}

var errNotReady = errors.New("not ready")
