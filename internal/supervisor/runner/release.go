package runner

import (
	"bufio"
	"bytes"
	"errors"
	"io"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"
)

// What a killed group held stays charged to the pod until gVisor's page
// allocator has given it back to the host, and while it is given back the
// sandbox's meminfo is a poor measure of what a new command takes:
//
//   - a new command's anonymous memory is committed by the host when the
//     command first touches it, and meminfo counts it only after the
//     sentry's next scan for committed pages (pgalloc's UpdateUsage, run
//     when meminfo is read), and that scan is throttled to 8 times its
//     own duration, which grows while the host's CPUs are saturated by
//     the command itself and by the release;
//   - the new command's allocations take the dead group's pages first
//     ("recycling" them: pgalloc's findAllocatableAndMarkUsed), and each
//     recycled page leaves meminfo at once, uncounted until that next
//     scan, though the host never stopped charging it.
//
// So meminfo falls by what is recycled and released as it rises by what a
// new bomb takes, and a bomb started during the release grew unseen to
// the pod's limit (a 256 MiB pod, its third bomb in a row). The sentry's
// own count of a process's resident memory (/proc/<pid>/stat's rss, the
// pages it has mapped for the process, counted when it maps them, so
// before the process can touch them) does not lag, and meminfo counts the
// dead group's memory that is still to be given back apart from the rest:
// it is neither anonymous nor page cache, but the sentry's own ("System"),
// until released or recycled. So after a kill the guard holds, as a floor
// of the charge,
//
//	(charge at the kill − what the killed group held)
//	  + what the killed group holds still
//	  + what the live groups have grown by since the kill
//
// where "holds still" is what meminfo's System count still holds above
// where it was before the kill (see heldRelease.pending): pages given
// back leave it, and so do pages recycled into a live group, which then
// show in that group's growth. It errs high: the host uncharges pages as
// it goes through a release, meminfo only once a release is done.

// holdFor bounds how long after a kill the guard holds the killed group's
// memory as charged when its release does not show in meminfo: gVisor
// gave a bomb's memory back 15 to 330 ms after the kill.
const holdFor = 2 * memorySettle

// heldSlack is how much the live groups may grow while the guard holds a
// killed group's memory before the guard kills for it: a new command's
// own start (a shell, an interpreter) stays under it, a bomb passes it in
// tens of milliseconds.
const heldSlack = 16 << 20

// guardReading is one sample of what the guard reads.
type guardReading struct {
	// charged is what the pod is charged (ChargeEstimate).
	charged int64
	// waste is what meminfo counts that is neither anonymous memory nor
	// page cache (MemInfoWaste): mostly ended processes' pages not yet
	// given back. Negative when unknown.
	waste int64
	// groups is the resident memory of each live command group the guard
	// has not killed, and procs of each of their processes; nil when not
	// read.
	groups, procs map[int]int64
}

// heldRelease is what the guard holds after a kill, until the killed
// groups' memory is given back.
type heldRelease struct {
	since time.Time
	// base is the charge at the last kill less what the killed groups
	// held then; killed is what they held.
	base, killed int64
	// waste0 is the waste just before the first kill, wastePeak the most
	// seen since the last kill, lastWaste the last reading.
	waste0, wastePeak, lastWaste int64
	// bound is the most the killed groups can still hold by the charge
	// read (see observe).
	bound int64
	// groups0 is each live group's resident memory at the last kill, or
	// for a watch each of their processes' at the start.
	groups0 map[int]int64
	// watch is set when nothing was killed: the guard watches a charge
	// near the threshold (see newWatch).
	watch bool
}

// newWatch starts a floor of the charge with no kill, from a reading past
// three quarters of the threshold. meminfo lags a bomb's growth even with
// no release going on (the sentry's scan for committed pages is
// throttled, and slower on a busy node): a first bomb in a 1 GiB pod grew
// from 60 MiB to the pod's limit in 0.9 s with the guard's reading never
// past its threshold. The floor is the reading at the start, plus how the
// waste has moved since (it falls as dead memory is given back, and rises
// as it dies), plus how the live groups' resident memory has moved, which
// does not lag; it starts again from the reading whenever meminfo catches
// up with it, and after holdFor.
func newWatch(r guardReading, now time.Time) *heldRelease {
	h := &heldRelease{watch: true}
	h.rebase(r, now)
	return h
}

// rebase starts a watch again from reading r.
func (h *heldRelease) rebase(r guardReading, now time.Time) {
	h.since = now
	h.base, h.waste0, h.wastePeak, h.lastWaste = r.charged, r.waste, r.waste, r.waste
	h.groups0 = r.procs
}

func newHeldRelease(waste int64) *heldRelease {
	return &heldRelease{waste0: waste, wastePeak: waste, lastWaste: waste}
}

// observe takes a reading. The waste tells what the killed groups still
// hold, but the guard may not see it rise at all: the sentry gives a dead
// group's pages back within milliseconds when nothing else runs, between
// two of its samples. So the charge read bounds it too, when no live
// group grows past heldSlack (and so little that a live group took can
// be missing from the reading): the killed groups cannot hold more than
// the charge read less the base. The bound errs low by what meminfo never
// counted of the killed group (what it touched after the sentry's last
// scan), as the threshold does for a bomb's growth between two samples;
// the reserve covers both.
func (h *heldRelease) observe(r guardReading) {
	if r.waste >= 0 {
		h.lastWaste = r.waste
		h.wastePeak = max(h.wastePeak, r.waste)
	}
	if !h.watch && r.groups != nil && h.growth(r) <= heldSlack {
		h.bound = min(h.bound, max(0, r.charged-h.base))
	}
}

// pending is what the killed groups still hold. Their pages become waste
// as they die, and leave it as they are given back or recycled (a
// recycled page shows in its new group's growth instead), so what they
// still hold is the waste above where it was before the first kill; but
// until at least half of what they held has shown as waste they may not
// be dead yet, and all of it is held; and what never showed as waste
// (meminfo had not counted it before they died) is held until the end.
// A live command's own freed memory, which it soon recycles, counts as
// theirs while it is waste: the floor errs high, never low, for it. The
// bound from the charge read (see observe) caps it all.
func (h *heldRelease) pending() int64 {
	if h.watch {
		// How the waste has moved since the start: given back, it is
		// no longer charged; recycled, it shows in growth instead.
		return h.lastWaste - h.waste0
	}
	seen := h.wastePeak - h.waste0
	if h.waste0 < 0 || seen < h.killed/2 {
		return min(h.bound, h.killed)
	}
	return min(h.bound, h.killed, max(0, h.lastWaste-h.waste0)+max(0, h.killed-seen))
}

// growth is what the live groups have grown by since the last kill; a
// group started since counts whole. A watch counts the processes it
// started with, and only them: a process started since (a compiler in a
// build) counts its shared libraries whole in its resident memory though
// they were charged before, while a bomb that meminfo lags is a process
// that was already there, growing.
func (h *heldRelease) growth(r guardReading) int64 {
	var n int64
	if h.watch {
		for pid, rss0 := range h.groups0 {
			if rss, ok := r.procs[pid]; ok {
				n += max(0, rss-rss0)
			}
		}
		return n
	}
	for g, rss := range r.groups {
		n += max(0, rss-h.groups0[g])
	}
	return n
}

// floor is the least the pod is charged now, by what the guard holds.
// A watch counts what its processes gave up too (their resident memory
// fell, and what they freed is now waste, or given back; a process that
// ended gave up all it held): it has no killed group's memory to hold
// apart.
func (h *heldRelease) floor(r guardReading) int64 {
	if !h.watch {
		return h.base + h.pending() + h.growth(r)
	}
	n := h.base + h.pending()
	for pid, rss0 := range h.groups0 {
		n += r.procs[pid] - rss0
	}
	return n
}

// over reports whether the release is over: the killed groups hold next
// to nothing more, or the waste is back where it was before the first
// kill after having risen (what meminfo never counted went with it), or
// holdFor has passed since the last kill.
func (h *heldRelease) over(now time.Time) bool {
	switch {
	case h.watch:
		return false // the policy ends a watch
	case now.Sub(h.since) >= holdFor:
		return true
	case h.pending() <= settleSlack:
		return true
	case h.waste0 < 0:
		return false
	}
	return h.wastePeak > h.waste0+settleSlack && h.lastWaste <= h.waste0+settleSlack
}

// kill records a kill of a group that held killed bytes, when the charge
// was charged and the live groups (the killed one left out) held groups.
// What earlier kills still hold is held on with it; the waste they show
// now is the new start of what is seen.
func (h *heldRelease) kill(now time.Time, charged, killed int64, groups map[int]int64) {
	h.killed = h.pending() + killed
	h.bound = h.killed
	h.wastePeak = h.lastWaste
	h.since = now
	h.base = max(0, charged-h.pending())
	h.groups0 = groups
}

// MemInfo reads the sandbox's /proc/meminfo for the memory guard once a
// sample (each reading makes the sentry scan for committed pages): InUse
// is MemInfoInUse, and Waste is MemInfoWaste as of InUse's last reading.
type MemInfo struct {
	mu    sync.Mutex
	waste int64
	err   error
}

// NewMemInfo returns a MemInfo that has read nothing yet.
func NewMemInfo() *MemInfo { return &MemInfo{err: errors.New("/proc/meminfo not read yet")} }

// InUse reads /proc/meminfo, as MemInfoInUse.
func (m *MemInfo) InUse() (int64, error) {
	data, err := os.ReadFile("/proc/meminfo")
	if err != nil {
		return 0, err
	}
	waste, werr := memInfoWaste(bytes.NewReader(data))
	m.mu.Lock()
	m.waste, m.err = waste, werr
	m.mu.Unlock()
	return memInfoInUse(bytes.NewReader(data))
}

// Waste is MemInfoWaste as of the last InUse.
func (m *MemInfo) Waste() (int64, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.waste, m.err
}

// MemInfoWaste reads what the sandbox's /proc/meminfo counts as in use
// that is neither anonymous memory (AnonPages, tmpfs included) nor page
// cache (Mapped, which is gVisor's whole page cache): under gVisor, the
// sentry's "System" memory, which holds ended processes' pages until its
// page allocator gives them back to the host or recycles them.
func MemInfoWaste() (int64, error) {
	f, err := os.Open("/proc/meminfo")
	if err != nil {
		return 0, err
	}
	defer f.Close()
	return memInfoWaste(f)
}

func memInfoWaste(r io.Reader) (int64, error) {
	v := map[string]int64{"MemTotal": -1, "MemAvailable": -1, "AnonPages": -1, "Mapped": -1}
	sc := bufio.NewScanner(r)
	for sc.Scan() {
		k, val, ok := strings.Cut(sc.Text(), ":")
		if _, want := v[k]; !ok || !want {
			continue
		}
		kb, err := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(val), "kB")), 10, 64)
		if err == nil {
			v[k] = kb << 10
		}
	}
	for k, n := range v {
		if n < 0 {
			return 0, errors.New("/proc/meminfo has no " + k)
		}
	}
	return max(0, v["MemTotal"]-v["MemAvailable"]-v["AnonPages"]-v["Mapped"]), nil
}
