package runner

import (
	"errors"
	"fmt"
	"syscall"
	"time"
)

// track records a started command's process group. A command that starts
// after Terminate is told to stop at once rather than left to be killed.
func (rn *Runner) track(pgid int) {
	rn.mu.Lock()
	defer rn.mu.Unlock()
	rn.groups[pgid] = struct{}{}
	if rn.terminating {
		_ = syscall.Kill(-pgid, syscall.SIGTERM)
	}
}

func (rn *Runner) untrack(pgid int) {
	rn.mu.Lock()
	delete(rn.groups, pgid)
	rn.mu.Unlock()
}

// Terminate sends SIGTERM to the process group of every running command,
// and of every command started from now on, so that they can exit
// cleanly before the supervisor does. It returns how many groups it
// signalled.
func (rn *Runner) Terminate() int {
	rn.mu.Lock()
	defer rn.mu.Unlock()
	rn.terminating = true
	n := 0
	for pgid := range rn.groups {
		if syscall.Kill(-pgid, syscall.SIGTERM) == nil {
			n++
		}
	}
	return n
}

// Kill sends SIGKILL to the process group of every running command and to
// the groups in extra (once each), and returns how many it signalled.
func (rn *Runner) Kill(extra ...int) int {
	rn.mu.Lock()
	defer rn.mu.Unlock()
	rn.terminating = true
	pgids := make(map[int]struct{}, len(rn.groups)+len(extra))
	for pgid := range rn.groups {
		pgids[pgid] = struct{}{}
	}
	for _, pgid := range extra {
		pgids[pgid] = struct{}{}
	}
	n := 0
	for pgid := range pgids {
		if syscall.Kill(-pgid, syscall.SIGKILL) == nil {
			n++
		}
	}
	return n
}

var signalNames = map[syscall.Signal]string{
	syscall.SIGHUP: "SIGHUP", syscall.SIGINT: "SIGINT", syscall.SIGQUIT: "SIGQUIT", syscall.SIGILL: "SIGILL",
	syscall.SIGTRAP: "SIGTRAP", syscall.SIGABRT: "SIGABRT", syscall.SIGBUS: "SIGBUS", syscall.SIGFPE: "SIGFPE",
	syscall.SIGKILL: "SIGKILL", syscall.SIGUSR1: "SIGUSR1", syscall.SIGSEGV: "SIGSEGV", syscall.SIGUSR2: "SIGUSR2",
	syscall.SIGPIPE: "SIGPIPE", syscall.SIGALRM: "SIGALRM", syscall.SIGTERM: "SIGTERM", syscall.SIGCHLD: "SIGCHLD",
	syscall.SIGCONT: "SIGCONT", syscall.SIGSTOP: "SIGSTOP", syscall.SIGTSTP: "SIGTSTP", syscall.SIGTTIN: "SIGTTIN",
	syscall.SIGTTOU: "SIGTTOU", syscall.SIGURG: "SIGURG", syscall.SIGXCPU: "SIGXCPU", syscall.SIGXFSZ: "SIGXFSZ",
	syscall.SIGVTALRM: "SIGVTALRM", syscall.SIGPROF: "SIGPROF", syscall.SIGWINCH: "SIGWINCH", syscall.SIGIO: "SIGIO",
	syscall.SIGSYS: "SIGSYS",
}

func signalName(sig syscall.Signal) string {
	if n, ok := signalNames[sig]; ok {
		return n
	}
	return fmt.Sprintf("SIG%d", int(sig))
}

// groupSweepFor bounds sweepGroup. A group that forks faster than it can
// be killed for this long is left to the pod's limits.
const groupSweepFor = 5 * time.Second

// sweepGroup kills the process group pgid again and again until it is
// empty. One SIGKILL to a group can miss a child being forked at that
// moment (gVisor showed it: a fork bomb outlived its command's timeout and
// starved the supervisor), and once the leader is gone nothing else would
// signal the group again.
func sweepGroup(pgid int) {
	deadline := time.Now().Add(groupSweepFor)
	for time.Now().Before(deadline) {
		if errors.Is(syscall.Kill(-pgid, syscall.SIGKILL), syscall.ESRCH) {
			return
		}
		time.Sleep(5 * time.Millisecond)
	}
}
