//go:build !linux

package store

// volumeSpace is not measured off Linux, where the control plane never
// runs; a SQLite store there takes filespace contents until it is full.
func volumeSpace(string) (int64, int64, error) {
	return 0, 0, errUnmeasured
}
