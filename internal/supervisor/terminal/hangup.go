package terminal

import (
	"bytes"
	"context"
	"os"
	"strconv"
	"syscall"
	"time"
)

// hangUp ends the session as a terminal hangup would: SIGHUP to every
// process in it (job control puts a shell's jobs in process groups of
// their own, so the leader's group is not enough), then SIGKILL to
// whatever is left after ProcessKillGrace, or at once if reqCtx ends. It
// returns once no process of the session is left. A session that ends by
// itself, by contrast, leaves its background jobs running, as a command
// does.
func (p *ptyRun) hangUp(reqCtx context.Context) {
	hup := func() {
		signalSession(p.sid, syscall.SIGHUP)
		// A stopped job would not see the SIGHUP until continued.
		signalSession(p.sid, syscall.SIGCONT)
	}
	hup()
	deadline := time.NewTimer(p.t.cfg.KillGrace)
	defer deadline.Stop()
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for ticks := 1; ; ticks++ {
		select {
		case <-deadline.C:
			p.killSession()
			return
		case <-reqCtx.Done():
			p.killSession()
			return
		case <-tick.C:
			if len(sessionMembers(p.sid)) == 0 {
				<-p.exited
				return
			}
			// An interactive bash that got the shutdown's SIGTERM (which
			// it ignores) just before the SIGHUP once sat in its prompt
			// until killed: readline defers the signals it catches and
			// acts on one at a time. A repeated hangup reaches it once
			// it is back in its read.
			if ticks%hangUpRepeatTicks == 0 {
				hup()
			}
		}
	}
}

// hangUpRepeatTicks is how many 20 ms ticks pass between repeated hangups.
const hangUpRepeatTicks = 5

// killSession sends SIGKILL to every process of the session, and waits
// for the leader.
func (p *ptyRun) killSession() {
	signalSession(p.sid, syscall.SIGKILL)
	<-p.exited
	// Members that forked while being killed.
	signalSession(p.sid, syscall.SIGKILL)
}

// signalSession sends sig to every live process of session sid. There is
// no kill(2) for a session, and job control spreads one over several
// process groups.
func signalSession(sid int, sig syscall.Signal) {
	for _, pid := range sessionMembers(sid) {
		_ = syscall.Kill(pid, sig)
	}
}

// sessionMembers lists the live (not zombie) processes whose session is
// sid, from /proc/<pid>/stat.
func sessionMembers(sid int) []int {
	entries, err := os.ReadDir("/proc")
	if err != nil {
		return nil
	}
	var out []int
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		data, err := os.ReadFile("/proc/" + e.Name() + "/stat")
		if err != nil {
			continue
		}
		// The command name is in parentheses and may contain anything;
		// the fields after the last ')' are state, ppid, pgrp, session.
		i := bytes.LastIndexByte(data, ')')
		if i < 0 {
			continue
		}
		f := bytes.Fields(data[i+1:])
		if len(f) < 4 || len(f[0]) != 1 || f[0][0] == 'Z' {
			continue
		}
		if s, err := strconv.Atoi(string(f[3])); err == nil && s == sid {
			out = append(out, pid)
		}
	}
	return out
}
