package runner

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"time"
)

// Under gVisor the pod's limits bound the sandbox as a whole: a command
// that meets the pod's pids or memory limit takes the sandbox kernel down,
// and the supervisor with it. The limits here sit inside the pod's, so
// that a runaway command is stopped and the supervisor keeps serving.

// DefaultCommandPidsLimit is the RLIMIT_NPROC of every command: the tasks
// (threads included) that the sandbox's user may have at once before a
// command's fork fails with EAGAIN. gVisor counts them per user, so the
// supervisor's own threads count too, but its own limit stays unlimited:
// only commands are refused.
const DefaultCommandPidsLimit = 1024

// DefaultMemoryGuardInterval is how often the memory guard samples the
// sandbox's memory while commands run: a bomb that touches 200 MB/s gets
// 10 MB further between two samples.
const DefaultMemoryGuardInterval = 50 * time.Millisecond

// memorySettle is how long the guard waits after a kill before it samples
// again.
const memorySettle = 500 * time.Millisecond

// defaultMemoryReserve is what the guard keeps back under the pod's limit
// when none is configured. The sandbox kernel's own memory (its heap, the
// page tables, memory its processes freed but it has not yet returned to
// the host) is charged to the pod but invisible in /proc/meminfo; in a
// 256 MiB gVisor pod after a run of hostile commands it was near 64 MiB,
// so the floor is half as much again.
func defaultMemoryReserve(limit int64) int64 { return max(96<<20, limit/8) }

// startConfined starts cmd as children.start does, with the per-command
// process limit in force before the command runs (see startLimited).
func (rn *Runner) startConfined(cmd *exec.Cmd) error {
	if n := rn.cfg.PidsLimit; n > 0 {
		return startLimited(cmd, n)
	}
	return children.start(cmd)
}

// memoryGuard kills the command group that holds the most memory when the
// sandbox's memory in use passes threshold, as an OOM killer would, but
// before the pod's limit is met and never the supervisor.
type memoryGuard struct {
	threshold int64
	interval  time.Duration
	// inUse reports the sandbox's memory in use, in bytes.
	inUse func() (int64, error)
	stop  chan struct{}
	done  chan struct{}
}

// StartMemoryGuard runs the guard until Close. limit is the pod's memory
// limit and reserve what is kept back under it: under gVisor the sandbox
// kernel's own memory is charged to the pod but not reported in the
// sandbox's /proc/meminfo.
func (rn *Runner) StartMemoryGuard(limit, reserve int64, interval time.Duration, inUse func() (int64, error)) error {
	if reserve <= 0 {
		reserve = defaultMemoryReserve(limit)
	}
	if limit-reserve <= 0 {
		return fmt.Errorf("memory limit %d leaves nothing for commands after the reserve of %d", limit, reserve)
	}
	if interval <= 0 {
		interval = DefaultMemoryGuardInterval
	}
	g := &memoryGuard{threshold: limit - reserve, interval: interval, inUse: inUse,
		stop: make(chan struct{}), done: make(chan struct{})}
	rn.memGuard = g
	go rn.guardMemory(g)
	return nil
}

func (rn *Runner) guardMemory(g *memoryGuard) {
	defer close(g.done)
	// Past three quarters of the threshold the guard samples five times
	// as often: a bomb on a busy node gets further between two samples
	// than the reserve allows for, and the pod's limit ends the whole
	// sandbox.
	wait := g.interval
	for {
		select {
		case <-g.stop:
			return
		case <-time.After(wait):
		}
		wait = g.interval
		rn.mu.Lock()
		idle := len(rn.groups) == 0
		rn.mu.Unlock()
		if idle {
			continue
		}
		used, err := g.inUse()
		if err != nil {
			continue
		}
		if used < g.threshold {
			if used > g.threshold/4*3 {
				wait = g.interval / 5
			}
			continue
		}
		pgid, rss := rn.largestGroup()
		if pgid == 0 {
			continue
		}
		rn.mu.Lock()
		rn.oomKilled[pgid] = true
		rn.mu.Unlock()
		rn.cfg.Log.Warn("sandbox memory near its limit: killed the command using the most",
			"in_use_bytes", used, "threshold_bytes", g.threshold, "pgid", pgid, "group_rss_bytes", rss)
		sweepGroup(pgid)
		// The sandbox returns a dead group's memory a moment later; a
		// sample before then would blame the next command too.
		select {
		case <-g.stop:
			return
		case <-time.After(memorySettle):
		}
	}
}

func (g *memoryGuard) close() {
	close(g.stop)
	<-g.done
}

// largestGroup returns the tracked process group whose processes hold the
// most resident memory, and that amount.
func (rn *Runner) largestGroup() (pgid int, rss int64) {
	rn.mu.Lock()
	tracked := make(map[int]int64, len(rn.groups))
	for g := range rn.groups {
		tracked[g] = 0
	}
	rn.mu.Unlock()
	entries, err := os.ReadDir("/proc")
	if err != nil {
		return 0, 0
	}
	page := int64(os.Getpagesize())
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		g, pages, ok := procGroupRSS(pid)
		if _, ours := tracked[g]; ok && ours {
			tracked[g] += pages * page
		}
	}
	for g, n := range tracked {
		if n > rss {
			pgid, rss = g, n
		}
	}
	return pgid, rss
}

// procGroupRSS reads a process's group and resident pages from its stat
// (fields 5 and 24).
func procGroupRSS(pid int) (pgid int, pages int64, ok bool) {
	f, ok := procStatFields(pid)
	// f[0] is field 3 (state): pgrp is f[2], rss is f[21].
	if !ok || len(f) < 22 {
		return 0, 0, false
	}
	pgid, err1 := strconv.Atoi(string(f[2]))
	pages, err2 := strconv.ParseInt(string(f[21]), 10, 64)
	if err1 != nil || err2 != nil {
		return 0, 0, false
	}
	return pgid, pages, true
}

// procStatFields returns the fields of /proc/<pid>/stat from the third
// (state) on. The command name before them is in parentheses and may
// itself hold spaces and parentheses, so they are found after the last ')'.
func procStatFields(pid int) ([][]byte, bool) {
	data, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return nil, false
	}
	i := bytes.LastIndexByte(data, ')')
	if i < 0 {
		return nil, false
	}
	return bytes.Fields(data[i+1:]), true
}

// MemInfoInUse reads the memory in use from /proc/meminfo, as MemTotal
// less MemAvailable. Under gVisor that is the sandbox's own accounting of
// everything its processes hold, tmpfs and page cache included, which is
// what the pod's limit is charged with.
func MemInfoInUse() (int64, error) {
	f, err := os.Open("/proc/meminfo")
	if err != nil {
		return 0, err
	}
	defer f.Close()
	var total, avail int64 = -1, -1
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		k, v, ok := strings.Cut(sc.Text(), ":")
		if !ok {
			continue
		}
		kb, err := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(v), "kB")), 10, 64)
		if err != nil {
			continue
		}
		switch k {
		case "MemTotal":
			total = kb << 10
		case "MemAvailable":
			avail = kb << 10
		}
	}
	if total < 0 || avail < 0 {
		return 0, errors.New("/proc/meminfo has no MemTotal or MemAvailable")
	}
	return total - avail, nil
}

// takeOOMKilled reports whether the memory guard killed pgid, and forgets it.
func (rn *Runner) takeOOMKilled(pgid int) bool {
	rn.mu.Lock()
	defer rn.mu.Unlock()
	k := rn.oomKilled[pgid]
	delete(rn.oomKilled, pgid)
	return k
}
