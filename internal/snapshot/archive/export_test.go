package archive

import "io"

// CopyTar exposes copyTar to the external tests; it returns the entries.
func CopyTar(dst io.Writer, src io.Reader) (int, error) {
	st, err := copyTar(dst, src)
	return st.Entries, err
}
