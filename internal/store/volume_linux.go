package store

import "golang.org/x/sys/unix"

// volumeSpace is the file system's own answer: the blocks free to a
// writer without privileges (the control plane runs as one), and the size.
func volumeSpace(dir string) (free, size int64, err error) {
	var st unix.Statfs_t
	if err := unix.Statfs(dir, &st); err != nil {
		return 0, 0, err
	}
	return int64(st.Bavail) * st.Bsize, int64(st.Blocks) * st.Bsize, nil
}
