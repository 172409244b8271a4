package runner

import (
	"errors"
	"fmt"
	"os/exec"
	"runtime"
	"syscall"

	"golang.org/x/sys/unix"
)

// startLimited starts cmd with its RLIMIT_NPROC, soft and hard, at n from
// its first instruction. A limit set with prlimit after an ordinary start
// races the command: on a fast host a child that reads or forks right
// away (grep /proc/self/limits did, on a 2-core machine) runs before the
// parent's prlimit lands, and a fork bomb's first children would escape
// it. So the child asks to be traced (PTRACE_TRACEME), the kernel stops it
// as its exec completes and before any of its code runs, and the limit is
// set while it is stopped; then the tracer lets it go.
func startLimited(cmd *exec.Cmd, n int) error {
	if cmd.SysProcAttr == nil {
		cmd.SysProcAttr = &syscall.SysProcAttr{}
	}
	// The tracer is the thread that forked, and only it may detach.
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	cmd.SysProcAttr.Ptrace = true
	if err := children.start(cmd); err != nil {
		return err
	}
	pid := cmd.Process.Pid
	var ws unix.WaitStatus
	var err error
	for {
		if _, err = unix.Wait4(pid, &ws, 0, nil); !errors.Is(err, unix.EINTR) {
			break
		}
	}
	if err == nil && !ws.Stopped() {
		// Killed (its context ended) before it ran: its status is taken,
		// so Wait only releases what Start set up.
		err = fmt.Errorf("%s ended before it ran (%v)", cmd.Path, exitDescription(ws))
	}
	if err == nil {
		if err = unix.Prlimit(pid, unix.RLIMIT_NPROC, &unix.Rlimit{Cur: uint64(n), Max: uint64(n)}, nil); err != nil {
			err = fmt.Errorf("limit the processes of %s: %w", cmd.Path, err)
			_ = unix.Kill(pid, unix.SIGKILL)
		}
		if derr := unix.PtraceDetach(pid); derr != nil && err == nil {
			err = fmt.Errorf("release %s after limiting it: %w", cmd.Path, derr)
			_ = unix.Kill(pid, unix.SIGKILL)
		}
	}
	if err != nil {
		_ = cmd.Wait()
		children.done(pid)
		return err
	}
	return nil
}

func exitDescription(ws unix.WaitStatus) string {
	if ws.Signaled() {
		return "signal " + ws.Signal().String()
	}
	return fmt.Sprintf("exit status %d", ws.ExitStatus())
}
