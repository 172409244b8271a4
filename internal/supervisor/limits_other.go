//go:build !linux

package supervisor

// limitProcesses does nothing off Linux: the supervisor runs in Linux
// pods, and the package builds elsewhere only for its tests.
func limitProcesses(pid, n int) error { return nil }
