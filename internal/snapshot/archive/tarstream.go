package archive

import (
	"archive/tar"
	"fmt"
	"io"
)

// tarStats describes a tar that went through copyTar.
type tarStats struct {
	Entries int
	Bytes   int64
}

// copyTar copies one tar stream from src to dst, byte for byte, and fails
// unless it is whole: every entry read to its end and the end-of-archive
// marker (two zero blocks) present. It stops right after the marker.
func copyTar(dst io.Writer, src io.Reader) (tarStats, error) {
	tw := &tailWriter{w: dst}
	tr := tar.NewReader(io.TeeReader(src, tw))
	// Larger reads than io.Copy's 32 KiB make fewer, larger writes to the
	// compressor and the pipe; the struct hides io.Discard's ReadFrom,
	// which would use its own small buffer.
	buf := make([]byte, 256<<10)
	var st tarStats
	for {
		hdr, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			return st, fmt.Errorf("tar stream after %d entries: %w", st.Entries, err)
		}
		st.Entries++
		if _, err := io.CopyBuffer(struct{ io.Writer }{io.Discard}, tr, buf); err != nil {
			return st, fmt.Errorf("tar entry %q: %w", hdr.Name, err)
		}
	}
	st.Bytes = tw.n
	// tar.Reader also reports EOF for a stream that stops cleanly between
	// two entries; only the marker tells a whole tar from a cut one.
	if tw.zeros < 2*512 {
		return st, fmt.Errorf("tar stream ended after %d entries without its end-of-archive marker", st.Entries)
	}
	return st, nil
}

// tailWriter counts what it passes on and how many zero bytes end it.
type tailWriter struct {
	w     io.Writer
	n     int64
	zeros int64
}

func (t *tailWriter) Write(p []byte) (int, error) {
	n, err := t.w.Write(p)
	t.n += int64(n)
	q := p[:n]
	i := len(q)
	for i > 0 && q[i-1] == 0 {
		i--
	}
	if i == 0 {
		t.zeros += int64(n)
	} else {
		t.zeros = int64(n - i)
	}
	return n, err
}
