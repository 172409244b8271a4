package runner

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
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

// minCommandPidsLimit is the least process limit CommandPidsLimitFor gives
// a small sandbox: enough for a shell, a build tool and its workers.
const minCommandPidsLimit = 64

// CommandPidsLimitFor is the commands' default process limit in a gVisor
// sandbox whose pod has the given memory limit and guard reserve (zero: the
// default reserve). Each process costs the pod about 0.63 MiB on the host
// (see ChargeEstimate), so DefaultCommandPidsLimit is more than a small
// pod can hold: under it, a fork bomb took a 256 MiB sandbox down in two
// seconds, faster than the memory guard could act, while under 256 the
// same bomb left it serving. So the limit is what the memory below the
// guard's threshold holds at that cost, within [64, 1024]: 256 for a
// 256 MiB pod, 1024 from about 740 MiB on.
func CommandPidsLimitFor(memoryLimit, reserve int64) int {
	if reserve <= 0 {
		reserve = defaultMemoryReserve(memoryLimit)
	}
	n := (memoryLimit - reserve) / chargePerProcess
	return int(min(max(n, minCommandPidsLimit), DefaultCommandPidsLimit))
}

// DefaultMemoryGuardInterval is how often the memory guard samples the
// sandbox's memory while commands run: a bomb that touches 200 MB/s gets
// 10 MB further between two samples.
const DefaultMemoryGuardInterval = 50 * time.Millisecond

// memorySettle is how long after a kill the guard makes allowance for
// the memory the killed group still holds: gVisor counts a dead process's
// pages in the sandbox's meminfo (as the sentry's own, "System") until its
// page allocator has handed them back to the host, a moment later.
const memorySettle = 500 * time.Millisecond

// settleSlack is how far the memory in use may rise past its lowest
// reading since a kill, while the guard waits for the killed group's
// memory to come back, before it takes that for a new command's growth:
// the supervisor's own allocations and page-table noise stay under it.
const settleSlack = 4 << 20

// defaultMemoryReserve is what the guard keeps back under the pod's limit
// when none is configured. It covers what the pod is charged that the
// guard's reading does not show: the sandbox kernel's and gofer's own
// memory (see guardPolicy), about 15 MiB in a fresh pod; a bomb's growth
// past the threshold before the kill lands, about 15 MiB at 1 GB/s; and
// the error of ChargeEstimate's figures per process, which were measured
// on idle processes (a process with more mappings has bigger page tables).
// A 256 MiB pod peaked at 201 MiB through three memory bombs in a row.
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
	policy   guardPolicy
	interval time.Duration
	// inUse reports the sandbox's memory in use, in bytes.
	inUse func() (int64, error)
	// waste reports what the sandbox counts for ended processes' memory
	// not yet given back (MemInfo.Waste); nil when it cannot be read, and
	// then the guard holds a killed group's memory for holdFor.
	waste func() (int64, error)
	stop  chan struct{}
	done  chan struct{}
}

// guardPolicy decides, from one reading of the memory in use, whether the
// guard kills now and how soon it samples again. It holds no clock or
// process of its own, so that its decisions can be tested alone.
//
// What gVisor does that the policy is built on (gVisor's
// pkg/sentry/pgalloc/pgalloc.go and pkg/sentry/fsimpl/proc/tasks_files.go):
// the sandbox's /proc/meminfo is the sentry's usage.MemoryAccounting,
// which counts every committed page of the memfd that backs application
// memory, tmpfs and the sentry's page cache. When a process dies its
// pages become "waste", still counted (as System) until the MemoryFile's
// releaser goroutine decommits them with fallocate(PUNCH_HOLE), which is
// also when the host uncharges them from the pod, so meminfo and the pod's
// charge fall together: in a 1 GiB pod, 0.2 s after a bomb of 860 MiB was
// killed, both were back where they started. (meminfo's figure rests on
// the host's own count of the memfd's pages: MemoryFile.UpdateUsage
// checks its fstat block count and mincore.) What meminfo does not show
// is the memory of the sentry and the gofer outside that memfd, about
// 15 MiB in a fresh pod, and what each process costs on the host
// (ChargeEstimate adds that). The reserve covers the former and a bomb's
// growth between two samples.
//
// A guard that stops sampling after a kill is blind just when a second
// bomb is most likely: a bomb grows by about 1 GB/s in gVisor, so one
// started while the guard slept 500 ms met the pod's limit and the whole
// sandbox was OOM-killed. So the guard samples on, fast, and while the
// killed group's memory may still be on its way back it only kills again
// once the memory in use rises past the lowest reading since the kill:
// what the dead group still holds is not blamed on the next command, and
// anything that grows on top of it is.
//
// That alone did not do: while the killed group's memory is given back,
// meminfo falls by what is given back and recycled as it rises by what a
// new bomb takes, and lags what the new bomb touched, so a 256 MiB pod's
// third bomb in a row grew unseen to the pod's limit. So from a kill until
// the killed group's memory has left meminfo, the guard also holds a floor
// of the charge built from what does not lag, the live groups' resident
// memory, and kills what grows past it (see heldRelease). meminfo lags a
// growing bomb with no kill before it too, on a busy node, so from three
// quarters of the threshold on the guard watches the charge with the same
// kind of floor (see newWatch).
type guardPolicy struct {
	threshold int64
	interval  time.Duration
	// killedAt is when the guard last killed; floor the lowest reading
	// since.
	killedAt time.Time
	floor    int64
	// held is what the guard holds as charged from a kill until the
	// killed group's memory is given back (see heldRelease); nil when
	// nothing is held.
	held *heldRelease
	// heldFloor is the held floor of the charge that made the last kill,
	// zero if the charge read did.
	heldFloor int64
	// near is whether the last charge read was past three quarters of
	// the threshold.
	near bool
}

// sample returns whether to kill the largest command group, given the
// memory in use now, and how long to wait before the next sample.
func (p *guardPolicy) sample(used int64, now time.Time) (kill bool, wait time.Duration) {
	return p.read(guardReading{charged: used, waste: -1}, now)
}

// holding reports whether the guard needs the waste and the live groups
// in its readings: while it holds a killed group's memory, and while the
// charge read is past three quarters of the threshold (to watch it).
func (p *guardPolicy) holding() bool { return p.held != nil || p.near }

// read is sample with all that the guard read.
func (p *guardPolicy) read(r guardReading, now time.Time) (kill bool, wait time.Duration) {
	used := r.charged
	fast := p.interval / 5
	p.heldFloor = 0
	p.near = used > p.threshold/4*3
	if h := p.held; h != nil {
		h.observe(r)
		switch {
		case h.over(now) || h.watch && !p.near && h.floor(r) <= p.threshold/4*3:
			p.held = nil
		case r.groups != nil && h.growth(r) > heldSlack && h.floor(r) >= p.threshold:
			// Something grows while the last kill's memory is still on
			// its way back, or while meminfo lags, and the floor of the
			// charge is past the threshold: meminfo may show less (see
			// heldRelease).
			p.killedAt, p.floor, p.heldFloor = now, used, h.floor(r)
			return true, fast
		case h.watch && r.groups != nil && (used >= h.floor(r) || now.Sub(h.since) >= holdFor):
			// meminfo has caught up, or has had time to: watch from here.
			// (Resident memory counts a process's shared libraries whole,
			// and new processes in a build would otherwise keep the floor
			// over the charge for as long as they run.)
			h.rebase(r, now)
		}
	}
	if p.held == nil && p.near && r.groups != nil && r.waste >= 0 {
		p.held = newWatch(r, now)
	}
	settling := !p.killedAt.IsZero() && now.Sub(p.killedAt) < memorySettle
	if settling {
		p.floor = min(p.floor, used)
	}
	switch {
	case used < p.threshold:
		// Past three quarters of the threshold, and while a killed
		// group's memory comes back, the guard samples five times as
		// often: a bomb on a busy node gets further between two samples
		// than the reserve allows for, and the pod's limit ends the whole
		// sandbox.
		if settling || p.held != nil || p.near {
			return false, fast
		}
		return false, p.interval
	case settling && used <= p.floor+settleSlack:
		return false, fast
	}
	p.killedAt, p.floor = now, used
	return true, fast
}

// killed records that the guard killed group pgid after reading r (its
// groups read just before the kill, pgid among them): from now until its
// memory is given back, the guard holds it as charged.
func (p *guardPolicy) killed(r guardReading, pgid int, now time.Time) {
	if r.groups == nil {
		return
	}
	charged := r.charged
	if p.held != nil {
		p.held.observe(r)
		charged = max(charged, p.held.floor(r))
	}
	if p.held == nil || p.held.watch {
		p.held = newHeldRelease(r.waste)
	}
	live := make(map[int]int64, len(r.groups))
	for g, n := range r.groups {
		if g != pgid {
			live[g] = n
		}
	}
	p.held.kill(now, charged, r.groups[pgid], live)
}

// StartMemoryGuard runs the guard until Close. limit is the pod's memory
// limit and reserve what is kept back under it: under gVisor the sandbox
// kernel's own memory is charged to the pod but not reported in the
// sandbox's /proc/meminfo. inUse reads what the pod is charged, and waste,
// if not nil, what the sandbox still counts for ended processes' memory
// (MemInfo.Waste, beside a charge read from the same MemInfo).
func (rn *Runner) StartMemoryGuard(limit, reserve int64, interval time.Duration, inUse, waste func() (int64, error)) error {
	if reserve <= 0 {
		reserve = defaultMemoryReserve(limit)
	}
	if limit-reserve <= 0 {
		return fmt.Errorf("memory limit %d leaves nothing for commands after the reserve of %d", limit, reserve)
	}
	if interval <= 0 {
		interval = DefaultMemoryGuardInterval
	}
	g := &memoryGuard{policy: guardPolicy{threshold: limit - reserve, interval: interval}, interval: interval, inUse: inUse,
		waste: waste, stop: make(chan struct{}), done: make(chan struct{})}
	rn.memGuard = g
	go rn.guardMemory(g)
	return nil
}

func (rn *Runner) guardMemory(g *memoryGuard) {
	defer close(g.done)
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
		// While it holds a killed group's memory the guard samples on
		// with no command running: the release is often over before the
		// next command starts, and only a reading then shows it.
		if idle && !g.policy.holding() {
			continue
		}
		used, err := g.inUse()
		if err != nil {
			continue
		}
		r := guardReading{charged: used, waste: -1}
		if g.policy.holding() {
			r.waste = g.readWaste()
			r.groups, _, r.procs = rn.scanGroups()
		}
		var kill bool
		now := time.Now()
		kill, wait = g.policy.read(r, now)
		if !kill {
			continue
		}
		if r.waste < 0 {
			r.waste = g.readWaste()
		}
		pgid, cost, rss, pids := rn.largestGroup()
		if pgid == 0 {
			continue
		}
		r.groups, r.procs = rss, pids
		g.policy.killed(r, pgid, now)
		rn.mu.Lock()
		rn.oomKilled[pgid] = true
		rn.mu.Unlock()
		rn.cfg.Log.Warn("sandbox memory near its limit: killed the command using the most",
			"in_use_bytes", used, "held_floor_bytes", g.policy.heldFloor, "threshold_bytes", g.policy.threshold,
			"pgid", pgid, "group_bytes", cost)
		sweepGroup(pgid)
	}
}

// readWaste reads the waste, -1 if it cannot be read.
func (g *memoryGuard) readWaste() int64 {
	if g.waste == nil {
		return -1
	}
	n, err := g.waste()
	if err != nil {
		return -1
	}
	return n
}

func (g *memoryGuard) close() {
	close(g.stop)
	<-g.done
}

// scanGroups reads, for each tracked process group the guard has not
// killed, its processes' resident memory and how many they are, and each
// of those processes' own. Groups the guard has killed are left out: they
// are on their way out.
func (rn *Runner) scanGroups() (rss map[int]int64, procs map[int]int, pids map[int]int64) {
	rn.mu.Lock()
	rss = make(map[int]int64, len(rn.groups))
	procs = make(map[int]int, len(rn.groups))
	pids = make(map[int]int64)
	for g := range rn.groups {
		if !rn.oomKilled[g] {
			rss[g] = 0
		}
	}
	rn.mu.Unlock()
	entries, err := os.ReadDir("/proc")
	if err != nil {
		return rss, procs, pids
	}
	page := int64(os.Getpagesize())
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		g, pages, ok := procGroupRSS(pid)
		if _, ours := rss[g]; ok && ours {
			rss[g] += pages * page
			procs[g]++
			pids[pid] = pages * page
		}
	}
	return rss, procs, pids
}

// largestGroup returns the tracked process group that costs the pod the
// most, and that amount: its processes' resident memory, and for each
// process what the sandbox kernel holds for it beyond that
// (hiddenPerProcess), so that a fork bomb of small processes is found.
// Groups the guard has already killed are left out: they are on their way
// out, and the next kill must hit what still grows. rss and pids are
// every group's and process's resident memory, as scanGroups reads them.
func (rn *Runner) largestGroup() (pgid int, cost int64, rss, pids map[int]int64) {
	rss, procs, pids := rn.scanGroups()
	for g, n := range rss {
		if c := n + int64(procs[g])*hiddenPerProcess; c > cost {
			pgid, cost = g, c
		}
	}
	return pgid, cost, rss, pids
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
	return memInfoInUse(f)
}

func memInfoInUse(r io.Reader) (int64, error) {
	var total, avail int64 = -1, -1
	sc := bufio.NewScanner(r)
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
