package main

import (
	"fmt"
	"io"
	"os"
	"sync"
	"time"

	"golang.org/x/term"
)

const (
	// progressDelay keeps quick transfers quiet: only one still running
	// after it is worth a progress line.
	progressDelay = time.Second
	// progressInterval bounds how often the line is redrawn.
	progressInterval = 250 * time.Millisecond
)

// isTerminal reports whether w is a terminal; progress lines are for
// people, and would only clutter a log or a pipe.
func isTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	return ok && term.IsTerminal(int(f.Fd()))
}

// progress draws a transfer's bytes and rate on one terminal line. The
// HTTP transport may read an upload's body from its own goroutine, so the
// counter is guarded.
type progress struct {
	w     io.Writer
	total int64 // -1 when unknown
	now   func() time.Time

	mu      sync.Mutex
	start   time.Time
	last    time.Time
	n       int64
	printed bool
}

// newProgress returns a progress for a transfer of total bytes (-1 if
// unknown) that draws on w if w is a terminal, and is silent otherwise.
func newProgress(w io.Writer, total int64) *progress {
	if !isTerminal(w) {
		w = nil
	}
	return newProgressAt(w, total, time.Now)
}

func newProgressAt(w io.Writer, total int64, now func() time.Time) *progress {
	return &progress{w: w, total: total, now: now, start: now()}
}

func (p *progress) add(n int) {
	if p.w == nil || n <= 0 {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	p.n += int64(n)
	t := p.now()
	if t.Sub(p.start) < progressDelay || t.Sub(p.last) < progressInterval {
		return
	}
	p.last, p.printed = t, true
	// The trailing erase-to-end-of-line removes what a longer previous
	// line left behind.
	fmt.Fprintf(p.w, "\r%s\x1b[K", p.line(t))
}

// done ends the progress line, if one was drawn, with the final figures.
func (p *progress) done() {
	if p.w == nil {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.printed {
		fmt.Fprintf(p.w, "\r%s\x1b[K\n", p.line(p.now()))
	}
}

func (p *progress) line(t time.Time) string {
	elapsed := t.Sub(p.start)
	rate := 0.0
	if elapsed > 0 {
		rate = float64(p.n) / elapsed.Seconds()
	}
	s := mib(p.n)
	if p.total >= 0 {
		pct := 100.0
		if p.total > 0 {
			pct = 100 * float64(p.n) / float64(p.total)
		}
		s += fmt.Sprintf(" / %s (%.0f%%)", mib(p.total), pct)
	}
	return fmt.Sprintf("%s  %.1f MiB/s  %s", s, rate/(1<<20), elapsed.Truncate(100*time.Millisecond))
}

func mib(n int64) string { return fmt.Sprintf("%.1f MiB", float64(n)/(1<<20)) }

// progressReader counts what is read through it.
type progressReader struct {
	r io.Reader
	p *progress
}

func (r progressReader) Read(b []byte) (int, error) {
	n, err := r.r.Read(b)
	r.p.add(n)
	return n, err
}
