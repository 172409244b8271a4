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

func TestAccepts(t *testing.T) {
	for _, c := range []struct {
		header string
		want   bool
	}{
		{"", false},
		{"gzip", false},
		{"zstd", true},
		{"gzip, zstd", true},
		{"ZSTD;q=0.5", true},
		{"zstd;q=0", false},
		{"zstd; q=0.0", false},
		{"*", true},
		{"identity", false},
	} {
		h := http.Header{}
		if c.header != "" {
			h.Set("Accept-Encoding", c.header)
		}
		if got := Accepts(h); got != c.want {
			t.Errorf("Accepts(%q) = %v, want %v", c.header, got, c.want)
		}
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
	SetCoded(h, 1234)
	if n, err := DecodedLength(h); n != 1234 || err != nil || h.Get("Content-Encoding") != Zstd {
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
	if Advertised(resp) {
		t.Error("a response without Accept-Encoding advertised zstd")
	}
	Advertise(resp.Header)
	if !Advertised(resp) {
		t.Error("Advertise did not advertise zstd")
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

// TestRoundTrip: Encode and NewWriter code what NewReader decodes, and
// source-like text comes out much smaller.
func TestRoundTrip(t *testing.T) {
	data := sourceLike(5 << 20)
	coded, err := io.ReadAll(Encode(bytes.NewReader(data)))
	if err != nil {
		t.Fatal(err)
	}
	if len(coded) > len(data)/4 {
		t.Errorf("coded %d bytes into %d", len(data), len(coded))
	}
	var viaWriter bytes.Buffer
	zw := NewWriter(&viaWriter)
	if _, err := io.Copy(zw, bytes.NewReader(data)); err != nil {
		t.Fatal(err)
	}
	if err := zw.Close(); err != nil {
		t.Fatal(err)
	}
	for name, c := range map[string][]byte{"Encode": coded, "NewWriter": viaWriter.Bytes()} {
		r, err := NewReader(bytes.NewReader(c))
		if err != nil {
			t.Fatal(err)
		}
		got, err := io.ReadAll(iotest.OneByteReader(r))
		if err != nil || !bytes.Equal(got, data) {
			t.Errorf("%s: decoded %d bytes, %v", name, len(got), err)
		}
		var viaWriteTo bytes.Buffer
		r2, _ := NewReader(bytes.NewReader(c))
		if _, err := r2.(io.WriterTo).WriteTo(&viaWriteTo); err != nil || !bytes.Equal(viaWriteTo.Bytes(), data) {
			t.Errorf("%s: WriteTo decoded %d bytes, %v", name, viaWriteTo.Len(), err)
		}
		_ = r.Close()
		_ = r2.Close()
	}
}

// TestCorruptBodyFails: a body that is not zstd, or is cut short, is a
// read error, never a short success.
func TestCorruptBodyFails(t *testing.T) {
	coded, _ := io.ReadAll(Encode(bytes.NewReader(sourceLike(1 << 20))))
	for name, body := range map[string][]byte{
		"not zstd":  []byte("plain text, not a zstd frame at all"),
		"truncated": coded[:len(coded)/2],
	} {
		r, err := NewReader(bytes.NewReader(body))
		if err != nil {
			continue
		}
		if _, err := io.ReadAll(r); err == nil {
			t.Errorf("%s: read without error", name)
		}
		_ = r.Close()
	}
}

// TestEncodeSourceError: a failing source fails the coded stream.
func TestEncodeSourceError(t *testing.T) {
	boom := errors.New("boom")
	_, err := io.ReadAll(Encode(io.MultiReader(bytes.NewReader(sourceLike(1<<20)), iotest.ErrReader(boom))))
	if !errors.Is(err, boom) {
		t.Errorf("got %v, want %v", err, boom)
	}
}

// TestCloseClosesBody: closing the decoding closes the body it reads.
func TestCloseClosesBody(t *testing.T) {
	coded, _ := io.ReadAll(Encode(bytes.NewReader(sourceLike(8 << 10))))
	body := &closeRecorder{Reader: bytes.NewReader(coded)}
	r, err := NewReader(body)
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
