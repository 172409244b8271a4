package contentcoding

import (
	"bytes"
	"crypto/rand"
	"errors"
	"io"
	"net/http"
	"strings"
	"testing"
	"testing/iotest"
)

// sourceLike is text with the repetition of a source tree.
func sourceLike(n int) []byte {
	var b bytes.Buffer
	for i := 0; b.Len() < n; i++ {
		b.WriteString("func (s *Server) handle")
		b.WriteString(strings.Repeat("x", i%7))
		b.WriteString("(w http.ResponseWriter, r *http.Request) {\n\tif err := s.check(r); err != nil {\n\t\treturn\n\t}\n}\n")
	}
	return b.Bytes()[:n]
}

func random(n int) []byte {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return b
}

func TestPreferred(t *testing.T) {
	for _, c := range []struct {
		header, want string
	}{
		{"", ""},
		{"gzip", ""},
		{"zstd", Zstd},
		{"gzip, zstd", Zstd},
		{"ZSTD;q=0.5", Zstd},
		{"zstd;q=0", ""},
		{"zstd; q=0.0", ""},
		{"s2", S2},
		{"zstd, s2", S2},
		{"s2;q=0, zstd", Zstd},
		{"*", S2},
		{"identity", ""},
		{AcceptAll, S2},
	} {
		h := http.Header{}
		if c.header != "" {
			h.Set("Accept-Encoding", c.header)
		}
		if got := Preferred(h); got != c.want {
			t.Errorf("Preferred(%q) = %q, want %q", c.header, got, c.want)
		}
	}
}

func TestLists(t *testing.T) {
	h := http.Header{"Accept-Encoding": {"s2;q=0, zstd"}}
	if Lists(h, S2) || !Lists(h, Zstd) || Lists(h, "gzip") {
		t.Errorf("Lists on %v", h)
	}
	if !Lists(http.Header{"Accept-Encoding": {"*"}}, Zstd) {
		t.Error("* does not list zstd")
	}
}

func TestOf(t *testing.T) {
	for _, c := range []struct {
		header, want string
		unsupported  bool
	}{
		{"", "", false},
		{"identity", "", false},
		{"zstd", Zstd, false},
		{" Zstd ", Zstd, false},
		{"s2", S2, false},
		{"gzip", "", true},
		{"zstd, gzip", "", true},
	} {
		h := http.Header{}
		if c.header != "" {
			h.Set("Content-Encoding", c.header)
		}
		got, err := Of(h)
		if got != c.want || errors.Is(err, ErrUnsupported) != c.unsupported {
			t.Errorf("Of(%q) = %q, %v; want %q, unsupported %v", c.header, got, err, c.want, c.unsupported)
		}
	}
}

func TestDecodedLength(t *testing.T) {
	h := http.Header{}
	if n, err := DecodedLength(h); n != -1 || err != nil {
		t.Errorf("absent: %d, %v", n, err)
	}
	SetCoded(h, S2, 1234)
	if n, err := DecodedLength(h); n != 1234 || err != nil || h.Get("Content-Encoding") != S2 {
		t.Errorf("set: %d, %v, %v", n, err, h)
	}
	h.Set(HeaderDecodedLength, "-5")
	if _, err := DecodedLength(h); err == nil {
		t.Error("a negative length was accepted")
	}
}

// TestAdvertise: a response that advertises the coding is recognised,
// and one that does not is not.
func TestAdvertise(t *testing.T) {
	resp := &http.Response{Header: http.Header{}}
	if got := Advertised(resp); got != "" {
		t.Errorf("a response without Accept-Encoding advertised %q", got)
	}
	Advertise(resp.Header)
	if got := Advertised(resp); got != S2 {
		t.Errorf("Advertise advertised %q first, want %q", got, S2)
	}
}

func TestCompressible(t *testing.T) {
	if !Compressible(sourceLike(SampleSize), -1) {
		t.Error("source-like text was found incompressible")
	}
	if Compressible(random(SampleSize), -1) {
		t.Error("random bytes were found compressible")
	}
	if Compressible(sourceLike(100), 100) {
		t.Error("a body below the minimum was to be coded")
	}
	if Compressible(sourceLike(SampleSize), 1000) {
		t.Error("a declared length below the minimum was to be coded")
	}
}

// TestSniffPassesEverythingOn: the reader Sniff returns gives the whole
// body, whether it is shorter than the sample, as long, or longer, and
// read a byte at a time.
func TestSniffPassesEverythingOn(t *testing.T) {
	for _, n := range []int{0, 10, SampleSize - 1, SampleSize, SampleSize + 1, 3 * SampleSize} {
		for name, data := range map[string][]byte{"source": sourceLike(n), "random": random(n)} {
			r, ok, err := Sniff(iotest.OneByteReader(bytes.NewReader(data)), int64(n))
			if err != nil {
				t.Fatal(err)
			}
			if want := name == "source" && n >= minCompressible; ok != want {
				t.Errorf("%s %d: compressible %v, want %v", name, n, ok, want)
			}
			got, err := io.ReadAll(r)
			if err != nil || !bytes.Equal(got, data) {
				t.Errorf("%s %d: read back %d bytes, %v", name, n, len(got), err)
			}
		}
	}
}

func TestSniffReadError(t *testing.T) {
	boom := errors.New("boom")
	if _, _, err := Sniff(iotest.ErrReader(boom), -1); !errors.Is(err, boom) {
		t.Errorf("got %v, want %v", err, boom)
	}
}

// TestRoundTrip: Encode and NewWriter code what NewReader decodes, in
// each coding, and source-like text comes out much smaller.
func TestRoundTrip(t *testing.T) {
	data := sourceLike(5 << 20)
	for _, coding := range []string{S2, Zstd} {
		enc, err := Encode(coding, bytes.NewReader(data))
		if err != nil {
			t.Fatal(err)
		}
		coded, err := io.ReadAll(enc)
		if err != nil {
			t.Fatal(err)
		}
		if len(coded) > len(data)/4 {
			t.Errorf("%s: coded %d bytes into %d", coding, len(data), len(coded))
		}
		var viaWriter bytes.Buffer
		zw, err := NewWriter(coding, &viaWriter)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := io.Copy(zw, bytes.NewReader(data)); err != nil {
			t.Fatal(err)
		}
		if err := zw.Close(); err != nil {
			t.Fatal(err)
		}
		for name, c := range map[string][]byte{"Encode": coded, "NewWriter": viaWriter.Bytes()} {
			r, err := NewReader(coding, bytes.NewReader(c))
			if err != nil {
				t.Fatal(err)
			}
			got, err := io.ReadAll(iotest.OneByteReader(r))
			if err != nil || !bytes.Equal(got, data) {
				t.Errorf("%s %s: decoded %d bytes, %v", coding, name, len(got), err)
			}
			_ = r.Close()
		}
	}
	if _, err := NewWriter("gzip", io.Discard); !errors.Is(err, ErrUnsupported) {
		t.Errorf("NewWriter(gzip): %v", err)
	}
	if _, err := NewReader("gzip", bytes.NewReader(nil)); !errors.Is(err, ErrUnsupported) {
		t.Errorf("NewReader(gzip): %v", err)
	}
}

func encoded(t *testing.T, coding string, data []byte) []byte {
	t.Helper()
	enc, err := Encode(coding, bytes.NewReader(data))
	if err != nil {
		t.Fatal(err)
	}
	c, err := io.ReadAll(enc)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// TestCorruptBodyFails: a body that is not in the coding is a read error,
// never a success; so is a zstd body cut short (an S2 stream cut at a
// block boundary is not detectable in the stream, which is why coded
// bodies carry their decoded length).
func TestCorruptBodyFails(t *testing.T) {
	for _, coding := range []string{S2, Zstd} {
		bodies := map[string][]byte{"not coded": []byte("plain text, not a coded stream at all")}
		if coding == Zstd {
			c := encoded(t, coding, sourceLike(1<<20))
			bodies["truncated"] = c[:len(c)/2]
		}
		for name, body := range bodies {
			r, err := NewReader(coding, bytes.NewReader(body))
			if err != nil {
				continue
			}
			if _, err := io.ReadAll(r); err == nil {
				t.Errorf("%s %s: read without error", coding, name)
			}
			_ = r.Close()
		}
	}
}

// TestEncodeSourceError: a failing source fails the coded stream.
func TestEncodeSourceError(t *testing.T) {
	boom := errors.New("boom")
	for _, coding := range []string{S2, Zstd} {
		enc, err := Encode(coding, io.MultiReader(bytes.NewReader(sourceLike(1<<20)), iotest.ErrReader(boom)))
		if err != nil {
			t.Fatal(err)
		}
		if _, err := io.ReadAll(enc); !errors.Is(err, boom) {
			t.Errorf("%s: got %v, want %v", coding, err, boom)
		}
	}
}

// TestEncodeCloseStops: closing a coding before it is read to the end
// returns once the coder has stopped.
func TestEncodeCloseStops(t *testing.T) {
	enc, err := Encode(S2, bytes.NewReader(sourceLike(8<<20)))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := io.ReadFull(enc, make([]byte, 1000)); err != nil {
		t.Fatal(err)
	}
	_ = enc.Close()
	if _, err := enc.Read(make([]byte, 10)); err == nil {
		t.Error("read after close succeeded")
	}
}

// TestCloseClosesBody: closing the decoding closes the body it reads.
func TestCloseClosesBody(t *testing.T) {
	coded := encoded(t, Zstd, sourceLike(8<<10))
	body := &closeRecorder{Reader: bytes.NewReader(coded)}
	r, err := NewReader(Zstd, body)
	if err != nil {
		t.Fatal(err)
	}
	if err := r.Close(); err != nil || !body.closed {
		t.Errorf("Close: %v, body closed %v", err, body.closed)
	}
}

type closeRecorder struct {
	io.Reader
	closed bool
}

func (c *closeRecorder) Close() error { c.closed = true; return nil }
