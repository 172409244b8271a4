package runner

import (
	"os"
	"sync"
)

// The pod is charged for more than the sandbox's meminfo shows, and most
// of the difference grows with the number of processes. gVisor's systrap
// platform backs every address space (every process, not thread) with a
// stub process on the host, and never ends one: when the process exits,
// its stub is emptied and kept in a pool for the next process (gVisor's
// pkg/sentry/platform/systrap/subprocess.go, subprocess.Release, and
// subprocess_pool.go). The stub's host memory (its page tables, kernel
// stacks and the pages it shares with the sentry) and the sentry's own
// state for each task are charged to the pod, and meminfo shows only a
// small part of it.
//
// Measured in a 1 GiB gVisor pod with 100 to 600 idle `sleep`s (its
// memory cgroup against the sandbox's meminfo): each live process was
// charged 0.63 MiB, of which meminfo showed 0.15; after they had all been
// killed, meminfo was back where it started but the pod stayed charged
// 0.32 MiB for each, for as long as it ran (13 s later, unchanged). A fork
// bomb under a limit of 1024 processes took a 256 MiB sandbox down in two
// seconds without the guard seeing anything.
//
// Nothing the sandbox can read holds the pod's real charge: its cgroupfs
// memory.usage_in_bytes is the same sentry accounting as meminfo
// (pkg/sentry/fsimpl/cgroupfs/memory.go). And nothing in runsc's
// configuration shrinks the pool: no runsc flag or dev.gvisor.* annotation
// bounds it (runsc/config/flags.go), and the sentry's Usage.Reduce control
// call, which only the node can make, waits for page cache evictions and
// runs Go's GC (pkg/sentry/control/usage.go). So the guard estimates.
const (
	// hiddenPerProcess is what a live process costs the pod beyond what
	// meminfo shows.
	hiddenPerProcess = 512 << 10
	// pooledPerProcess is what an ended process's stub keeps charged.
	pooledPerProcess = 320 << 10
	// chargePerProcess is all that a live process costs the pod, with
	// what meminfo shows of it.
	chargePerProcess = 640 << 10
)

// ChargeEstimate estimates what the pod is charged from inside a gVisor
// sandbox: the memory in use that meminfo shows, plus what the live
// processes cost beyond it, plus what the stubs of the most processes
// ever alive at once keep after their processes ended. It is what the
// memory guard compares with the pod's limit, so that a fork bomb, or a
// memory bomb after one, meets the guard rather than the pod's limit.
type ChargeEstimate struct {
	// InUse reads the memory in use the sandbox shows (MemInfoInUse).
	InUse func() (int64, error)
	// Processes counts the processes now alive (CountProcesses).
	Processes func() (int, error)

	mu   sync.Mutex
	peak int // the most processes seen alive at once
}

// NewChargeEstimate reads the sandbox's own /proc.
func NewChargeEstimate() *ChargeEstimate {
	return &ChargeEstimate{InUse: MemInfoInUse, Processes: CountProcesses}
}

// Charged returns the estimate, in bytes.
func (c *ChargeEstimate) Charged() (int64, error) {
	used, err := c.InUse()
	if err != nil {
		return 0, err
	}
	n, err := c.Processes()
	if err != nil {
		return 0, err
	}
	c.mu.Lock()
	c.peak = max(c.peak, n)
	pooled := c.peak - n
	c.mu.Unlock()
	return used + int64(n)*hiddenPerProcess + int64(pooled)*pooledPerProcess, nil
}

// CountProcesses counts the processes in /proc: under gVisor, every
// process of the sandbox, the supervisor's included.
func CountProcesses() (int, error) {
	f, err := os.Open("/proc")
	if err != nil {
		return 0, err
	}
	defer f.Close()
	names, err := f.Readdirnames(-1)
	if err != nil {
		return 0, err
	}
	n := 0
	for _, name := range names {
		if name != "" && name[0] >= '1' && name[0] <= '9' {
			n++
		}
	}
	return n, nil
}
