// Package contentcoding is the zstd content coding that file transfers
// negotiate between the Go client, the Compute API and the supervisor.
//
// Every byte of a file transfer crosses the sandbox kernel's network
// stack, which caps the transfer well below what the disks and the host
// network could move; sending fewer bytes is the one lever that stays
// outside the sandbox. The coding is negotiated the HTTP way, so that a
// peer that does not know it is never sent it:
//
//   - a download asks with Accept-Encoding: zstd and gets Content-Encoding:
//     zstd only when the content is worth compressing (Compressible);
//   - an upload is sent with Content-Encoding: zstd only to a peer that
//     said it accepts the coding, by answering Accept-Encoding: zstd
//     (RFC 7694) on an earlier response (Advertise, Advertised);
//   - a coded body carries its decoded length in HeaderDecodedLength, so
//     that the workspace cap is checked before the body moves, as it is
//     for an uncoded body with a Content-Length.
//
// Content that does not compress (random, or already compressed) is sent
// as it is, so an incompressible transfer costs one trial compression of
// a sample and nothing else.
package contentcoding

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"sync"

	"github.com/klauspost/compress/zstd"
)

const (
	// Zstd is the one content coding file transfers negotiate.
	Zstd = "zstd"
	// HeaderDecodedLength carries the length of a coded body once
	// decoded, where it is known.
	HeaderDecodedLength = "Agentbox-Decoded-Length"
	// SampleSize is how much of a body Compressible is shown.
	SampleSize = 128 << 10
	// minCompressible is the smallest body worth coding: below it the
	// frame and a round of the coder cost more than the bytes saved.
	minCompressible = 4 << 10
	// maxRatio is the coded size, as a fraction of the sample, above
	// which the content is sent as it is.
	maxRatio = 0.85
	// windowSize bounds the coder's memory per transfer: a supervisor may
	// run in a small sandbox, and the API codes many transfers at once.
	windowSize = 2 << 20
	// encoderConcurrency is how many blocks a stream's coder works on at
	// once.
	encoderConcurrency = 2
	// maxDecodeWindow is the largest window a coded body may ask the
	// decoder for; the zstd tool's default levels stay below it, and
	// long-distance mode, which needs far more memory, is refused.
	maxDecodeWindow = 8 << 20
)

// ErrUnsupported is returned for a Content-Encoding other than zstd or
// identity.
var ErrUnsupported = errors.New("unsupported content encoding")

// Of returns the content coding a request's or response's header
// declares: "" for none (or identity), Zstd, or an error wrapping
// ErrUnsupported for anything else, which the body cannot be read as.
func Of(h http.Header) (string, error) {
	v := strings.TrimSpace(h.Get("Content-Encoding"))
	switch {
	case v == "" || strings.EqualFold(v, "identity"):
		return "", nil
	case strings.EqualFold(v, Zstd):
		return Zstd, nil
	default:
		return "", fmt.Errorf("%w %q; send zstd or none", ErrUnsupported, v)
	}
}

// Accepts reports whether the Accept-Encoding of h lists zstd (or *)
// without q=0.
func Accepts(h http.Header) bool {
	for _, line := range h.Values("Accept-Encoding") {
		for _, part := range strings.Split(line, ",") {
			name, params, _ := strings.Cut(part, ";")
			name = strings.TrimSpace(name)
			if !strings.EqualFold(name, Zstd) && name != "*" {
				continue
			}
			if q, ok := strings.CutPrefix(strings.ReplaceAll(params, " ", ""), "q="); ok {
				if f, err := strconv.ParseFloat(q, 64); err == nil && f == 0 {
					continue
				}
			}
			return true
		}
	}
	return false
}

// Advertise says on a response that the server accepts zstd-coded
// request bodies (RFC 7694, section 3).
func Advertise(h http.Header) { h.Set("Accept-Encoding", Zstd) }

// Advertised reports whether a response said its server accepts
// zstd-coded request bodies.
func Advertised(resp *http.Response) bool { return Accepts(resp.Header) }

// DecodedLength returns the length HeaderDecodedLength declares, or -1
// when it is absent; a malformed one is an error.
func DecodedLength(h http.Header) (int64, error) {
	v := h.Get(HeaderDecodedLength)
	if v == "" {
		return -1, nil
	}
	n, err := strconv.ParseInt(v, 10, 64)
	if err != nil || n < 0 {
		return 0, fmt.Errorf("%s must be a byte count, got %q", HeaderDecodedLength, v)
	}
	return n, nil
}

// SetCoded labels h for a zstd-coded body whose decoded length is n (-1
// if unknown).
func SetCoded(h http.Header, n int64) {
	h.Set("Content-Encoding", Zstd)
	if n >= 0 {
		h.Set(HeaderDecodedLength, strconv.FormatInt(n, 10))
	}
}

var sampleEncoder = sync.OnceValue(func() *zstd.Encoder {
	enc, err := zstd.NewWriter(nil, encoderOptions()...)
	if err != nil {
		panic(err) // the options are constants
	}
	return enc
})

func encoderOptions() []zstd.EOption {
	return []zstd.EOption{
		zstd.WithEncoderLevel(zstd.SpeedFastest),
		// Two: one block is coded while the next is read and the one
		// before is sent, which overlaps the coder with the network.
		zstd.WithEncoderConcurrency(encoderConcurrency),
		zstd.WithWindowSize(windowSize),
		zstd.WithLowerEncoderMem(true),
	}
}

// Compressible reports whether sample, the start of a body of total
// bytes (-1 if unknown), is worth coding: large enough, and compressing
// to at most maxRatio of itself at the coder's speed.
func Compressible(sample []byte, total int64) bool {
	if len(sample) < minCompressible || total >= 0 && total < minCompressible {
		return false
	}
	buf := bufPool.Get().(*[]byte)
	defer bufPool.Put(buf)
	*buf = sampleEncoder().EncodeAll(sample, (*buf)[:0])
	return float64(len(*buf)) <= maxRatio*float64(len(sample))
}

var bufPool = sync.Pool{New: func() any { b := make([]byte, 0, SampleSize+SampleSize/8); return &b }}

// Sniff reads up to SampleSize bytes of r and says whether the body is
// worth coding (see Compressible); the reader it returns gives the whole
// body, sample included. total is the body's length, -1 if unknown. A
// reader of bytes or a string (bytes.Reader, strings.Reader) is sampled
// where it stands without being read, and returned as it is, so that an
// HTTP request made of it can still be sent again.
func Sniff(r io.Reader, total int64) (io.Reader, bool, error) {
	if ra, ok := r.(sizedReaderAt); ok {
		off := ra.Size() - int64(ra.Len())
		sample := make([]byte, min(int64(ra.Len()), SampleSize))
		n, err := ra.ReadAt(sample, off)
		if err != nil && !errors.Is(err, io.EOF) {
			return nil, false, err
		}
		return r, Compressible(sample[:n], int64(ra.Len())), nil
	}
	sample := make([]byte, SampleSize)
	n, err := io.ReadFull(r, sample)
	switch {
	case errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF):
		sample = sample[:n]
		return bytes.NewReader(sample), Compressible(sample, total), nil
	case err != nil:
		return nil, false, err
	}
	return io.MultiReader(bytes.NewReader(sample), r), Compressible(sample, total), nil
}

// sizedReaderAt is what bytes.Reader and strings.Reader have in common.
type sizedReaderAt interface {
	io.Reader
	io.ReaderAt
	Size() int64
	Len() int
}

var encoders = sync.Pool{New: func() any {
	enc, err := zstd.NewWriter(nil, encoderOptions()...)
	if err != nil {
		panic(err)
	}
	return enc
}}

// Writer codes what is written to it onto w. Close ends the frame (it
// does not close w) and must be called once the body is written.
type Writer struct {
	enc *zstd.Encoder
}

// NewWriter returns a Writer onto w.
func NewWriter(w io.Writer) *Writer {
	enc := encoders.Get().(*zstd.Encoder)
	enc.Reset(w)
	return &Writer{enc: enc}
}

func (w *Writer) Write(p []byte) (int, error) { return w.enc.Write(p) }

// ReadFrom codes all of r, in the coder's block size rather than in
// whatever size the caller's copy would use.
func (w *Writer) ReadFrom(r io.Reader) (int64, error) { return w.enc.ReadFrom(r) }

// Close ends the frame and returns the coder to the pool.
func (w *Writer) Close() error {
	if w.enc == nil {
		return nil
	}
	err := w.enc.Close()
	w.enc.Reset(nil)
	encoders.Put(w.enc)
	w.enc = nil
	return err
}

// Encode returns the zstd coding of r, coded as it is read. Close stops
// the coding early and returns once the coder has stopped reading r (it
// does not close r).
func Encode(r io.Reader) io.ReadCloser {
	pr, pw := io.Pipe()
	done := make(chan struct{})
	go func() {
		defer close(done)
		zw := NewWriter(pw)
		_, err := zw.ReadFrom(r)
		if cerr := zw.Close(); err == nil {
			err = cerr
		}
		pw.CloseWithError(err)
	}()
	return &encoding{PipeReader: pr, done: done}
}

type encoding struct {
	*io.PipeReader
	done chan struct{}
}

func (e *encoding) Close() error {
	err := e.PipeReader.Close()
	<-e.done
	return err
}

// reader decodes a coded body; Close releases the decoder and closes the
// body when it is a Closer.
type reader struct {
	dec  *zstd.Decoder
	body io.Reader
}

// NewReader returns the decoding of r, bounded in memory (a body that
// asks for a window larger than maxDecodeWindow fails to read).
func NewReader(r io.Reader) (io.ReadCloser, error) {
	dec, err := zstd.NewReader(r, zstd.WithDecoderConcurrency(1), zstd.WithDecoderMaxWindow(maxDecodeWindow), zstd.WithDecoderLowmem(true))
	if err != nil {
		return nil, fmt.Errorf("zstd: %w", err)
	}
	return &reader{dec: dec, body: r}, nil
}

func (r *reader) Read(p []byte) (int, error) {
	if r.dec == nil {
		return 0, errors.New("zstd: read after close")
	}
	n, err := r.dec.Read(p)
	if err != nil && !errors.Is(err, io.EOF) {
		err = fmt.Errorf("zstd: %w", err)
	}
	return n, err
}

// WriteTo decodes straight into w, without the caller's copy buffer.
func (r *reader) WriteTo(w io.Writer) (int64, error) {
	if r.dec == nil {
		return 0, errors.New("zstd: read after close")
	}
	n, err := r.dec.WriteTo(w)
	if err != nil {
		err = fmt.Errorf("zstd: %w", err)
	}
	return n, err
}

func (r *reader) Close() error {
	if r.dec != nil {
		r.dec.Close()
		r.dec = nil
	}
	if c, ok := r.body.(io.Closer); ok {
		return c.Close()
	}
	return nil
}
