package supervisor

import (
	"errors"
	"os"

	"golang.org/x/sys/unix"
)

// limitProcesses sets pid's RLIMIT_NPROC, soft and hard, to n.
func limitProcesses(pid, n int) error {
	lim := &unix.Rlimit{Cur: uint64(n), Max: uint64(n)}
	err := unix.Prlimit(pid, unix.RLIMIT_NPROC, lim, nil)
	if errors.Is(err, unix.ESRCH) {
		return os.ErrProcessDone
	}
	return err
}
