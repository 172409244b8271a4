package workspace

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"testing"
)

// TestCopyFull: the content reaches the volume in writes of the copy
// buffer, however small the pieces it arrives in, and a read error after
// some content is returned, not taken for the end.
func TestCopyFull(t *testing.T) {
	var sizes []int
	w := writerFunc(func(p []byte) (int, error) { sizes = append(sizes, len(p)); return len(p), nil })
	data := bytes.Repeat([]byte("x"), 100<<10)
	n, err := copyFull(w, &trickle{data: data, piece: 16 << 10}, make([]byte, 64<<10))
	if err != nil || n != 100<<10 {
		t.Fatalf("copied %d, %v", n, err)
	}
	if want := []int{64 << 10, 36 << 10}; fmt.Sprint(sizes) != fmt.Sprint(want) {
		t.Errorf("writes of %v, want %v", sizes, want)
	}
	boom := errors.New("boom")
	sizes = nil
	n, err = copyFull(w, io.MultiReader(&trickle{data: data[:10<<10], piece: 4 << 10}, &failing{boom}), make([]byte, 64<<10))
	if !errors.Is(err, boom) || n != 10<<10 {
		t.Errorf("a failing source: copied %d, %v", n, err)
	}
	var empty []int
	sizes = empty
	if n, err := copyFull(w, bytes.NewBuffer(nil), make([]byte, 64<<10)); n != 0 || err != nil || len(sizes) != 0 {
		t.Errorf("an empty source: %d, %v, writes %v", n, err, sizes)
	}
}

type writerFunc func([]byte) (int, error)

func (f writerFunc) Write(p []byte) (int, error) { return f(p) }

// trickle gives its data piece bytes at a time, as a TLS connection does.
type trickle struct {
	data  []byte
	piece int
}

func (t *trickle) Read(p []byte) (int, error) {
	if len(t.data) == 0 {
		return 0, io.EOF
	}
	n := copy(p[:min(len(p), t.piece)], t.data)
	t.data = t.data[n:]
	return n, nil
}

type failing struct{ err error }

func (f *failing) Read([]byte) (int, error) { return 0, f.err }
