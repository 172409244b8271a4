package supervisor

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
