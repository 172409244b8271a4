package terminal

import (
	"fmt"
	"os"
	"os/exec"
	"syscall"

	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/runner"
	api "github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"
	"github.com/creack/pty"
	"golang.org/x/sys/unix"
)

// start starts spec as the leader of a new session whose controlling
// terminal is a new pseudo-terminal, and returns the terminal's master.
// Like Runner.Spawn, it registers the process with the reaper and tracks its
// process group for Terminate and Kill.
func (t *Terminals) start(spec *runner.Spec, cols, rows uint16) (*runner.Process, *os.File, *api.Error) {
	ptmx, tty, err := openPTY()
	if err != nil {
		return nil, nil, api.Errorf(api.CodeInternal, "open a pseudo-terminal: %v", err)
	}
	// The parent's copy of the terminal must be closed once the child has
	// its own, or the master never sees the end of the session.
	defer tty.Close()
	if err := pty.Setsize(tty, &pty.Winsize{Cols: cols, Rows: rows}); err != nil {
		ptmx.Close()
		return nil, nil, api.Errorf(api.CodeInternal, "set the terminal size: %v", err)
	}
	cmd := exec.Command(spec.Path)
	cmd.Args = spec.Argv
	cmd.Dir = spec.Dir
	cmd.Env = spec.Env
	cmd.Stdin, cmd.Stdout, cmd.Stderr = tty, tty, tty
	// Setsid makes the process the leader of a new session and process
	// group (both IDs are its PID); Setctty makes its stdin, the terminal,
	// the session's controlling terminal, which job control needs.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true, Setctty: true, Ctty: 0}
	p, apiErr := t.cfg.Runner.Start(cmd, spec)
	if apiErr != nil {
		ptmx.Close()
		return nil, nil, apiErr
	}
	return p, ptmx, nil
}

// openPTY opens a pseudo-terminal pair with creack/pty. pty.Open asks for
// the master's descriptor number for its ioctls, which puts the
// descriptor in blocking mode for good, and a blocked Read could then
// neither time out nor be interrupted by Close. A duplicate, set
// non-blocking before os.NewFile sees it, is pollable again.
func openPTY() (master, tty *os.File, err error) {
	m, tty, err := pty.Open()
	if err != nil {
		return nil, nil, err
	}
	defer m.Close()
	fd, err := unix.FcntlInt(m.Fd(), unix.F_DUPFD_CLOEXEC, 0)
	if err == nil {
		err = unix.SetNonblock(fd, true)
		if err != nil {
			unix.Close(fd)
		}
	}
	if err != nil {
		tty.Close()
		return nil, nil, fmt.Errorf("duplicate the pty master: %w", err)
	}
	return os.NewFile(uintptr(fd), m.Name()), tty, nil
}

// setWinsize sets the terminal's size through the master, without taking
// its descriptor out of non-blocking mode (as pty.Setsize would). The
// kernel sends SIGWINCH to the terminal's foreground process group.
func setWinsize(ptmx *os.File, cols, rows uint16) error {
	rc, err := ptmx.SyscallConn()
	if err != nil {
		return err
	}
	var ioErr error
	err = rc.Control(func(fd uintptr) {
		ioErr = unix.IoctlSetWinsize(int(fd), unix.TIOCSWINSZ, &unix.Winsize{Col: cols, Row: rows})
	})
	if err != nil {
		return err
	}
	return ioErr
}
