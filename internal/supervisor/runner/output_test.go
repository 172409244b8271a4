package runner

import (
	"bytes"
	"testing"
)

// The buffers must never grow past the cap, however the output arrives.
func TestOutputBuffersStayWithinCap(t *testing.T) {
	const limit = 1 << 20
	o := NewOutput(limit)
	chunk := bytes.Repeat([]byte("z"), 32<<10)
	for i := 0; i < 96; i++ {
		w := o.stdout
		if i%3 == 0 {
			w = o.stderr
		}
		if n, err := w.Write(chunk); n != len(chunk) || err != nil {
			t.Fatalf("Write = %d, %v; want every byte accepted", n, err)
		}
	}
	held := 0
	for _, w := range []*cappedWriter{o.stdout, o.stderr} {
		for _, c := range w.chunks {
			held += cap(c)
		}
	}
	if held > limit+2*maxChunk {
		t.Fatalf("buffers hold %d bytes, cap is %d", held, limit)
	}
	t.Logf("kept %d bytes in %d bytes of buffers", limit, held)
	if o.stdout.n+o.stderr.n != limit || !o.truncated {
		t.Fatalf("kept %d bytes, truncated %v", o.stdout.n+o.stderr.n, o.truncated)
	}
	stdout, stderr, _ := o.Result()
	if len(stdout)+len(stderr) != limit {
		t.Fatalf("result has %d bytes, want %d", len(stdout)+len(stderr), limit)
	}
}
