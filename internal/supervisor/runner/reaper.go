package runner

import (
	"os/exec"
	"sync"
)

// children records the processes this package started and has not yet
// waited for, so that the orphan reaper never reaps one of them and steals
// its exit status from exec.Cmd.Wait.
var children = &childSet{pids: make(map[int]struct{})}

type childSet struct {
	// mu is held across Start, so a reaper scan sees either no process or
	// a registered one, never a started but unregistered child.
	mu   sync.Mutex
	pids map[int]struct{}
}

func (c *childSet) start(cmd *exec.Cmd) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if err := cmd.Start(); err != nil {
		return err
	}
	c.pids[cmd.Process.Pid] = struct{}{}
	return nil
}

func (c *childSet) done(pid int) {
	c.mu.Lock()
	delete(c.pids, pid)
	c.mu.Unlock()
}

// ProcessTracker lets code outside this package that starts processes
// (mcpbridge, for the MCP servers) register them, so that the orphan
// reaper leaves them to their own Wait. It satisfies mcpbridge.ChildTracker.
type ProcessTracker struct{}

// Start calls start, which starts one process and returns its PID, with
// the reaper held off, and registers the PID.
func (ProcessTracker) Start(start func() (pid int, err error)) error {
	children.mu.Lock()
	defer children.mu.Unlock()
	pid, err := start()
	if err != nil {
		return err
	}
	children.pids[pid] = struct{}{}
	return nil
}

// Done unregisters a process once it has been waited for.
func (ProcessTracker) Done(pid int) { children.done(pid) }
