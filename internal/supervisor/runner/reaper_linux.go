package runner

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"strconv"
	"syscall"
	"time"
)

const prSetChildSubreaper = 36 // PR_SET_CHILD_SUBREAPER from <linux/prctl.h>

func init() {
	signalNames[syscall.SIGSTKFLT] = "SIGSTKFLT"
	signalNames[syscall.SIGPWR] = "SIGPWR"
}

// StartReaper makes this process reap orphaned descendants until ctx is
// done. The supervisor is its container's PID 1 unless the pod shares its
// process namespace, so every background job whose parent exits is
// re-parented to it; without reaping, each would stay a zombie and hold a
// PID for the life of the sandbox. When this process is not PID 1 it
// becomes a child subreaper, so that orphans come to it instead.
//
// Only call it in a process where this package is the only thing that
// starts child processes: any other unregistered child that exits would be
// reaped here and its own Wait would fail.
func StartReaper(ctx context.Context, log *slog.Logger) error {
	if os.Getpid() != 1 {
		if _, _, errno := syscall.RawSyscall(syscall.SYS_PRCTL, prSetChildSubreaper, 1, 0); errno != 0 {
			return fmt.Errorf("become child subreaper: %w", errno)
		}
	}
	if log == nil {
		log = slog.Default()
	}
	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, syscall.SIGCHLD)
	go func() {
		defer signal.Stop(sigs)
		// SIGCHLD can coalesce, and a zombie can appear between a scan and
		// the next signal; the ticker bounds how long one can linger.
		tick := time.NewTicker(30 * time.Second)
		defer tick.Stop()
		for {
			if n := reapOrphans(); n > 0 {
				log.Debug("reaped orphaned processes", "count", n)
			}
			// Every command's exit raises SIGCHLD too, and a scan reads
			// all of /proc (a millisecond or more under gVisor): scans
			// are spaced so that a stream of short commands does not pay
			// for one each.
			select {
			case <-ctx.Done():
				return
			case <-time.After(reapSpacing):
			}
			select {
			case <-ctx.Done():
				return
			case <-sigs:
			case <-tick.C:
			}
		}
	}()
	return nil
}

// reapSpacing is the least time between two scans for orphans: how long
// an orphan may stay a zombie after the previous scan.
const reapSpacing = 250 * time.Millisecond

// reapOrphans waits for every zombie child of this process that the
// package did not start itself. /proc is read without holding children.mu,
// which every start takes: a zombie seen there was forked before, so once
// the lock is held it is registered if it is the package's own.
func reapOrphans() int {
	entries, err := os.ReadDir("/proc")
	if err != nil {
		return 0
	}
	self := os.Getpid()
	var zombies []int
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		if state, ppid, ok := procStat(pid); ok && ppid == self && state == 'Z' {
			zombies = append(zombies, pid)
		}
	}
	if len(zombies) == 0 {
		return 0
	}
	children.mu.Lock()
	defer children.mu.Unlock()
	reaped := 0
	for _, pid := range zombies {
		if _, ours := children.pids[pid]; ours {
			continue
		}
		var ws syscall.WaitStatus
		if wpid, err := syscall.Wait4(pid, &ws, syscall.WNOHANG, nil); err == nil && wpid == pid {
			reaped++
		}
	}
	return reaped
}

// procStat reads a process's state and parent from its stat.
func procStat(pid int) (state byte, ppid int, ok bool) {
	fields, ok := procStatFields(pid)
	if !ok || len(fields) < 2 || len(fields[0]) != 1 {
		return 0, 0, false
	}
	ppid, err := strconv.Atoi(string(fields[1]))
	if err != nil {
		return 0, 0, false
	}
	return fields[0][0], ppid, true
}
