package runner

import (
	"io"
	"strings"
	"sync"
	"unicode/utf8"
)

// Output collects stdout and stderr under one byte budget. Writes beyond
// the budget are accepted and dropped, so the command's pipes keep
// draining and the command never blocks on a full pipe.
type Output struct {
	mu             sync.Mutex
	remaining      int64
	truncated      bool
	stdout, stderr *cappedWriter
}

// Output is kept in chunks rather than one growing slice: growing a slice
// copies it and briefly holds twice its size, and its doubling can reserve
// far more than the budget. Chunks start small, so a command that prints a
// line costs little, and no chunk is larger than the budget left when it
// was allocated, so the memory held never exceeds the cap by more than one
// partly filled chunk per stream.
const (
	minChunk = 512
	maxChunk = 32 << 10
)

type cappedWriter struct {
	o      *Output
	chunks [][]byte
	n      int
	cut    bool // this stream lost bytes, so its tail may be a partial rune
}

// NewOutput returns an Output that keeps at most limit bytes.
func NewOutput(limit int64) *Output {
	o := &Output{remaining: limit}
	o.stdout = &cappedWriter{o: o}
	o.stderr = &cappedWriter{o: o}
	return o
}

// Stdout is where the command's standard output goes.
func (o *Output) Stdout() io.Writer { return o.stdout }

// Stderr is where the command's standard error goes.
func (o *Output) Stderr() io.Writer { return o.stderr }

func (w *cappedWriter) Write(p []byte) (int, error) {
	o := w.o
	o.mu.Lock()
	defer o.mu.Unlock()
	keep := p
	if int64(len(keep)) > o.remaining {
		keep = keep[:o.remaining]
		o.truncated, w.cut = true, true
	}
	for len(keep) > 0 {
		var last []byte
		if len(w.chunks) > 0 {
			last = w.chunks[len(w.chunks)-1]
		}
		if len(last) == cap(last) {
			size := min(max(2*cap(last), minChunk), maxChunk, int(o.remaining))
			last = make([]byte, 0, size)
			w.chunks = append(w.chunks, last)
		}
		n := min(len(keep), cap(last)-len(last))
		last = append(last, keep[:n]...)
		w.chunks[len(w.chunks)-1] = last
		keep = keep[n:]
		w.n += n
		o.remaining -= int64(n)
	}
	return len(p), nil
}

// Result is what was kept of each stream, as valid UTF-8, and whether
// anything was dropped.
func (o *Output) Result() (stdout, stderr string, truncated bool) {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.stdout.text(), o.stderr.text(), o.truncated
}

func (w *cappedWriter) text() string {
	var b strings.Builder
	b.Grow(w.n)
	for _, c := range w.chunks {
		b.Write(c)
	}
	s := b.String()
	if w.cut {
		s = TrimPartialRune(s)
	}
	// Returns s itself, without a copy, when it is valid already.
	return strings.ToValidUTF8(s, "\uFFFD")
}

// TrimPartialRune drops a multi-byte character a cap cut in half, which
// would otherwise show up as a spurious replacement character.
func TrimPartialRune(s string) string {
	for i := len(s) - 1; i >= 0 && i >= len(s)-utf8.UTFMax; i-- {
		if utf8.RuneStart(s[i]) {
			if !utf8.FullRuneInString(s[i:]) {
				return s[:i]
			}
			break
		}
	}
	return s
}
