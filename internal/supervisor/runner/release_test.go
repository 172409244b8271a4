package runner

import (
	"fmt"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"
)

// readStep is one full reading the policy is given (the waste and the
// live groups' resident memory beside the charge), and what it must
// decide. killPgid, when the policy kills, is the group the guard kills
// (largestGroup's choice).
type readStep struct {
	after    time.Duration
	used     int64
	waste    int64
	groups   map[int]int64
	kill     bool
	killPgid int
}

// runReadings gives p the readings from start on, and returns the time of
// the last.
func runReadings(t *testing.T, p *guardPolicy, start time.Time, steps []readStep) time.Time {
	t.Helper()
	now := start
	for i, s := range steps {
		now = now.Add(s.after)
		// Each group here is one process, whose PID is the group's.
		r := guardReading{charged: s.used, waste: s.waste}
		if p.holding() {
			r.groups, r.procs = s.groups, s.groups
		}
		kill, _ := p.read(r, now)
		if kill != s.kill {
			held := "nothing held"
			if h := p.held; h != nil {
				held = fmt.Sprintf("held: base %d MiB, pending %d MiB, growth %d MiB", h.base/mib, h.pending()/mib, h.growth(r)/mib)
			}
			t.Errorf("reading %d (%d MiB, waste %d MiB, groups %v): kill %v, want %v (%s)", i+1, s.used/mib, s.waste/mib, s.groups, kill, s.kill, held)
		}
		if kill {
			r.groups, r.procs = s.groups, s.groups
			p.killed(r, s.killPgid, now)
		}
	}
	return now
}

var t0 = time.Unix(1_700_000_000, 0)

const (
	bomb2  = 101 // the killed bomb's process group
	shell  = 102 // a small command
	bomb3  = 103 // the next bomb
	legit  = 104 // a big command that is no bomb
	before = 2 * mib
)

// The case the hold is for: a bomb starts while the previous one's memory
// is being given back, and meminfo shows neither what the new bomb took
// from the dead one's pages (recycled) nor what it touched since the
// sentry's last scan, so the charge read stays under the threshold while
// the pod fills up. The hold kills it.
func TestGuardHoldCatchesABombGrowingDuringTheRelease(t *testing.T) {
	runReadings(t, newPolicy(), t0, []readStep{
		{0, 170 * mib, before, map[int]int64{bomb2: 120 * mib, shell: 2 * mib}, true, bomb2},
		// The bomb's pages become waste: still charged, still counted.
		{fast, 170 * mib, 122 * mib, map[int]int64{shell: 2 * mib}, false, 0},
		// The next bomb recycles 60 MiB of them, which leave meminfo's
		// count, and touches 10 MiB more that it has not seen yet.
		{fast, 110 * mib, 62 * mib, map[int]int64{bomb3: 40 * mib}, false, 0},
		{fast, 112 * mib, 50 * mib, map[int]int64{bomb3: 75 * mib}, true, bomb3},
	})
}

// Without the hold the same readings kill nothing: the charge read never
// passes the threshold, nor rises past its lowest since the kill by more
// than settleSlack until the bomb is well past it on the host.
func TestGuardWithoutHoldMissesTheBombDuringTheRelease(t *testing.T) {
	p := newPolicy()
	now := time.Unix(1_700_000_000, 0)
	if kill, _ := p.sample(170*mib, now); !kill {
		t.Fatal("first bomb not killed")
	}
	for _, used := range []int64{170 * mib, 110 * mib, 112 * mib} {
		now = now.Add(fast)
		if kill, _ := p.sample(used, now); kill {
			t.Fatalf("kill at %d MiB without the hold: the readings no longer show what the hold is for", used/mib)
		}
	}
}

// A small command started right after a kill (the shell a user runs to
// look around) is not killed for the memory the killed group still holds.
func TestGuardHoldSparesASmallCommand(t *testing.T) {
	runReadings(t, newPolicy(), t0, []readStep{
		{0, 170 * mib, before, map[int]int64{bomb2: 120 * mib}, true, bomb2},
		{fast, 170 * mib, 122 * mib, map[int]int64{}, false, 0},
		{fast, 171 * mib, 122 * mib, map[int]int64{shell: 3 * mib}, false, 0},
		{fast, 172 * mib, 122 * mib, map[int]int64{shell: heldSlack}, false, 0},
	})
}

// Once the killed group's memory has left meminfo's waste, nothing is
// held: a big command that fits under the threshold runs, and one that
// does not is killed by the threshold as before.
func TestGuardHoldEndsWhenTheMemoryIsBack(t *testing.T) {
	p := newPolicy()
	now := runReadings(t, p, t0, []readStep{
		{0, 170 * mib, before, map[int]int64{bomb2: 120 * mib}, true, bomb2},
		{fast, 170 * mib, 122 * mib, map[int]int64{}, false, 0},
		{fast, 120 * mib, 72 * mib, map[int]int64{}, false, 0},
		{fast, 50 * mib, before, map[int]int64{}, false, 0},
	})
	if p.holding() {
		t.Fatal("still holding after the waste came back")
	}
	runReadings(t, p, now, []readStep{
		{fast, 150 * mib, before, map[int]int64{legit: 100 * mib}, false, 0},
		{memorySettle, 150 * mib, before, nil, false, 0},
		{fast, 161 * mib, before, nil, true, legit},
	})
}

// Recycled pages are not counted twice: what a new command took from the
// dead group's waste shows in its growth, and has left the waste. Right
// after the kill everything the group held is still held, so any growth
// past heldSlack is killed; once some is given back, a command that fits
// runs on.
func TestGuardHoldCountsRecycledPagesOnce(t *testing.T) {
	p := newPolicy()
	runReadings(t, p, t0, []readStep{
		{0, 170 * mib, before, map[int]int64{bomb2: 120 * mib}, true, bomb2},
		{fast, 170 * mib, 122 * mib, map[int]int64{}, false, 0},
		// 70 MiB given back.
		{fast, 100 * mib, 52 * mib, map[int]int64{}, false, 0},
		// A command takes 20 MiB of what is left: 50 + 30 + 20.
		{fast, 80 * mib, 32 * mib, map[int]int64{legit: 20 * mib}, false, 0},
	})
	if got := p.held.floor(guardReading{groups: map[int]int64{legit: 20 * mib}}); got != 100*mib {
		t.Errorf("held floor %d MiB, want 100 (120 if the recycled pages counted twice)", got/mib)
	}
}

// A bomb frees its temporaries as it grows (this one copies each 16 MiB
// it builds), and takes them back at its next step: the waste rises and
// falls with them, and that fall is not taken for the killed group's
// memory being given back, or the bomb would hide behind its own churn.
func TestGuardHoldSeesABombThroughItsOwnChurn(t *testing.T) {
	runReadings(t, newPolicy(), t0, []readStep{
		{0, 165 * mib, before, map[int]int64{bomb2: 100 * mib}, true, bomb2},
		{fast, 165 * mib, 102 * mib, map[int]int64{}, false, 0},
		// 60 MiB of it given back; 40 held over a base of 65.
		{fast, 105 * mib, 42 * mib, map[int]int64{}, false, 0},
		{fast, 110 * mib, 42 * mib, map[int]int64{bomb3: 10 * mib}, false, 0},
		{fast, 115 * mib, 58 * mib, map[int]int64{bomb3: 26 * mib}, false, 0},
		{fast, 115 * mib, 42 * mib, map[int]int64{bomb3: 32 * mib}, false, 0},
		{fast, 118 * mib, 58 * mib, map[int]int64{bomb3: 38 * mib}, false, 0},
		// 65 + 40 + 60: had the churn's falls counted as given back,
		// only 8 would be held, and the bomb would go on.
		{fast, 118 * mib, 42 * mib, map[int]int64{bomb3: 60 * mib}, true, bomb3},
	})
}

// What the killed group held is held whole until at least half of it has
// shown as waste: a group takes a moment to die.
func TestHeldReleaseWaitsForTheGroupToDie(t *testing.T) {
	h := newHeldRelease(before)
	h.kill(t0, 170*mib, 120*mib, nil)
	for _, c := range []struct{ waste, pending int64 }{
		{before, 120}, {50 * mib, 120}, {61 * mib, 120},
		{62 * mib, 120}, // 60 seen: the rest (60) never showed, and stays held
		{32 * mib, 90}, {122 * mib, 120}, {12 * mib, 10},
	} {
		h.observe(guardReading{charged: 170 * mib, waste: c.waste})
		if got := h.pending(); got != c.pending*mib {
			t.Errorf("waste %d MiB: pending %d MiB, want %d", c.waste/mib, got/mib, c.pending)
		}
	}
	h.observe(guardReading{charged: 170 * mib, waste: -1}) // unknown: nothing changes
	if h.pending() != 10*mib {
		t.Errorf("an unknown reading changed the hold: pending %d MiB", h.pending()/mib)
	}
}

// When meminfo's waste cannot be read, the killed group's memory is held
// for holdFor, no longer.
func TestGuardHoldWithoutWasteLastsHoldFor(t *testing.T) {
	p := newPolicy()
	now := runReadings(t, p, t0, []readStep{
		{0, 170 * mib, -1, map[int]int64{bomb2: 120 * mib}, true, bomb2},
		{fast, 130 * mib, -1, map[int]int64{}, false, 0},
		{holdFor - fast - time.Millisecond, 130 * mib, -1, map[int]int64{}, false, 0},
	})
	if !p.holding() {
		t.Fatal("the hold ended before holdFor")
	}
	runReadings(t, p, now, []readStep{{time.Millisecond, 130 * mib, -1, map[int]int64{legit: 30 * mib}, false, 0}})
	if p.held != nil {
		t.Fatal("still holding after holdFor")
	}
}

// A second kill while the first group's memory is still held adds to
// what is held, and the charge at the second kill is the hold's floor if
// meminfo shows less.
func TestGuardHoldAcrossTwoKills(t *testing.T) {
	p := newPolicy()
	now := runReadings(t, p, t0, []readStep{
		{0, 170 * mib, before, map[int]int64{bomb2: 120 * mib}, true, bomb2},
		{fast, 170 * mib, 122 * mib, map[int]int64{}, false, 0},
		{fast, 110 * mib, 62 * mib, map[int]int64{bomb3: 40 * mib}, false, 0},
		{fast, 112 * mib, 50 * mib, map[int]int64{bomb3: 75 * mib}, true, bomb3},
	})
	h := p.held
	// Held: 48 of the first bomb and 75 of the second, over a base of 50
	// (the floor at the kill was 173).
	if h.killed != 123*mib || h.pending() != 123*mib || h.base != 50*mib {
		t.Fatalf("after the second kill: killed %d, pending %d, base %d MiB; want 123, 123, 50",
			h.killed/mib, h.pending()/mib, h.base/mib)
	}
	runReadings(t, p, now, []readStep{
		{fast, 112 * mib, 50 * mib, map[int]int64{shell: 2 * mib}, false, 0},
		// The second bomb's pages are waste too now.
		{fast, 112 * mib, 125 * mib, map[int]int64{shell: 2 * mib}, false, 0},
		{fast, 60 * mib, before, map[int]int64{shell: 2 * mib}, false, 0},
	})
	if p.holding() {
		t.Error("still holding after the waste came back to where it was")
	}
}

func TestMemInfoWasteParsesGVisor(t *testing.T) {
	// gVisor's /proc/meminfo 0.1 s after a 120 MiB bomb was killed: its
	// pages are the sentry's ("System"), neither AnonPages nor Mapped.
	const meminfo = `MemTotal:        2097152 kB
MemFree:         1900000 kB
MemAvailable:    1900000 kB
Buffers:               0 kB
Cached:            20000 kB
AnonPages:         50000 kB
Mapped:            18000 kB
Shmem:              2000 kB
`
	got, err := memInfoWaste(strings.NewReader(meminfo))
	if want := int64(2097152-1900000-50000-18000) << 10; err != nil || got != want {
		t.Errorf("memInfoWaste = %d, %v; want %d", got, err, want)
	}
	if _, err := memInfoWaste(strings.NewReader("MemTotal: 1 kB\nMemAvailable: 1 kB\n")); err == nil {
		t.Error("memInfoWaste without AnonPages and Mapped: no error")
	}
}

// When nothing else runs, the sentry gives a dead group's pages back
// within milliseconds, between two samples: the waste never shows them.
// The charge read then bounds what is held, and a command that fits under
// the threshold runs on (in a 256 MiB pod, gVisor gave a 150 MiB bomb
// back 15 to 50 ms after the kill).
func TestGuardHoldBoundedByTheChargeRead(t *testing.T) {
	p := newPolicy()
	runReadings(t, p, t0, []readStep{
		{0, 182 * mib, before, map[int]int64{bomb2: 150 * mib}, true, bomb2},
		{fast, 50 * mib, before, map[int]int64{}, false, 0},
		{fast, 52 * mib, before, map[int]int64{legit: 20 * mib}, false, 0},
		// 32 + 18 + 100, whatever the lagging charge read says.
		{fast, 60 * mib, before, map[int]int64{legit: 100 * mib}, false, 0},
		{fast, 60 * mib, before, map[int]int64{legit: 110 * mib}, true, legit},
	})
}

// scanGroups reads real processes: a command's group, with its resident
// memory and its process count, and not a group the guard has killed.
func TestScanGroupsReadsTheCommandsGroups(t *testing.T) {
	rn := New(Config{})
	var pgids []int
	for range 2 {
		cmd := exec.Command("sleep", "30")
		cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
		pgids = append(pgids, cmd.Process.Pid)
		rn.track(cmd.Process.Pid)
	}
	rn.oomKilled[pgids[1]] = true
	// A process just started may not have exec'd yet, and holds nothing
	// of its own until it has.
	var rss, pids map[int]int64
	var procs map[int]int
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		rss, procs, pids = rn.scanGroups()
		if rss[pgids[0]] > 0 || time.Now().After(deadline) {
			break
		}
	}
	if rss[pgids[0]] <= 0 || procs[pgids[0]] != 1 {
		t.Errorf("scanGroups: group %d has %d bytes in %d processes; want its one sleep's resident memory", pgids[0], rss[pgids[0]], procs[pgids[0]])
	}
	if pids[pgids[0]] != rss[pgids[0]] {
		t.Errorf("scanGroups: process %d has %d bytes, its group %d", pgids[0], pids[pgids[0]], rss[pgids[0]])
	}
	if _, ok := rss[pgids[1]]; ok {
		t.Errorf("scanGroups read group %d, which the guard killed", pgids[1])
	}
	if _, ok := pids[pgids[1]]; ok {
		t.Errorf("scanGroups read process %d, whose group the guard killed", pgids[1])
	}
	pgid, cost, rss, _ := rn.largestGroup()
	if pgid != pgids[0] || cost != rss[pgids[0]]+hiddenPerProcess {
		t.Errorf("largestGroup = %d, %d; want %d, %d", pgid, cost, pgids[0], rss[pgids[0]]+hiddenPerProcess)
	}
}

func TestMemInfoWasteReadsThisMachine(t *testing.T) {
	if n, err := MemInfoWaste(); err != nil || n < 0 {
		t.Errorf("MemInfoWaste() = %d, %v", n, err)
	}
	mi := NewMemInfo()
	if _, err := mi.Waste(); err == nil {
		t.Error("MemInfo.Waste before any reading: no error")
	}
	if n, err := mi.InUse(); err != nil || n <= 0 {
		t.Errorf("MemInfo.InUse() = %d, %v", n, err)
	}
	if n, err := mi.Waste(); err != nil || n < 0 {
		t.Errorf("MemInfo.Waste() after a reading = %d, %v", n, err)
	}
}

// A first bomb, with no kill before it: meminfo lags its growth (the
// sentry's scan for committed pages is throttled), but from three
// quarters of the threshold on the guard watches the groups' resident
// memory, which does not lag.
func TestGuardWatchCatchesABombMeminfoLags(t *testing.T) {
	p := newPolicy()
	runReadings(t, p, t0, []readStep{
		{0, 100 * mib, before, nil, false, 0},
		{slow, 125 * mib, before, nil, false, 0},
		{fast, 126 * mib, before, map[int]int64{bomb2: 90 * mib}, false, 0},
		{fast, 128 * mib, before, map[int]int64{bomb2: 110 * mib}, false, 0},
		// 126 + 40, though the reading says 130.
		{fast, 130 * mib, before, map[int]int64{bomb2: 130 * mib}, true, bomb2},
	})
	if p.held == nil || p.held.watch {
		t.Fatal("after the kill the guard does not hold the bomb's memory")
	}
}

// A command that starts while the previous command's memory is still
// being given back is not blamed for that memory: the watch counts the
// waste as it falls.
func TestGuardWatchFollowsTheRelease(t *testing.T) {
	p := newPolicy()
	runReadings(t, p, t0, []readStep{
		{0, 150 * mib, 102 * mib, nil, false, 0},
		{fast, 150 * mib, 102 * mib, map[int]int64{legit: 14 * mib}, false, 0},
		// 50 MiB given back as the command grows by 46: 150 - 50 + 46.
		{fast, 140 * mib, 52 * mib, map[int]int64{legit: 60 * mib}, false, 0},
		// All given back: 150 - 100 + 96.
		{fast, 140 * mib, before, map[int]int64{legit: 110 * mib}, false, 0},
		{fast, 146 * mib, before, map[int]int64{legit: 110 * mib}, false, 0},
	})
	if p.held == nil || !p.held.watch || p.held.base != 146*mib {
		t.Fatalf("the watch did not start again from the reading that caught up with it: %+v", p.held)
	}
	// The command ends, and what it held becomes waste: still charged.
	runReadings(t, p, t0.Add(time.Second), []readStep{{fast, 146 * mib, 112 * mib, map[int]int64{}, false, 0}})
	if got := p.held.floor(guardReading{groups: map[int]int64{}, procs: map[int]int64{}}); got != 146*mib {
		t.Errorf("floor once the command ended: %d MiB, want 146", got/mib)
	}
	// Given back: the reading falls under three quarters, and so does the
	// floor.
	runReadings(t, p, t0.Add(2*time.Second), []readStep{{fast, 40 * mib, before, map[int]int64{}, false, 0}})
	if p.held != nil {
		t.Fatal("still watching after the reading fell")
	}
}

// A build near the threshold: a compiler started since the watch began
// maps shared libraries that were charged before, and its resident memory
// counts them whole; it is not taken for growth.
func TestGuardWatchLeavesNewProcessesOut(t *testing.T) {
	p := newPolicy()
	runReadings(t, p, t0, []readStep{
		{0, 125 * mib, before, nil, false, 0},
		{fast, 125 * mib, before, map[int]int64{legit: 60 * mib}, false, 0},
		{fast, 126 * mib, before, map[int]int64{legit: 60 * mib, shell: 40 * mib}, false, 0},
		// The process that was there grows, and meminfo lags: 125 + 36.
		{fast, 130 * mib, before, map[int]int64{legit: 96 * mib, shell: 40 * mib}, true, legit},
	})
}
