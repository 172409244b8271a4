// Package contentcoding is the content codings that file transfers
// negotiate between the Go client, the Compute API and the supervisor.
//
// Every byte of a file transfer crosses the sandbox kernel's network
// stack, and sending fewer bytes across it is a lever that stays outside
// the sandbox; but the coding costs CPU on both ends, and on a few shared
// cores a coder slower than the link makes the transfer slower, not
// faster. Two codings are offered: S2 (the Snappy-derived format of
// github.com/klauspost/compress/s2, private token "s2"), fast enough to
// pay off at the rates the sandbox's network stack reaches, which the
// agentbox clients prefer; and zstd (RFC 8878), for HTTP clients that know
// only the registered codings. The coding is negotiated the HTTP way, so
// that a peer that does not know it is never sent it:
//
//   - a download asks with Accept-Encoding and gets Content-Encoding only
//     when the content is worth coding (Compressible);
//   - an upload is coded only for a peer that said which codings it
//     accepts, by answering Accept-Encoding (RFC 7694) on an earlier
//     response (Advertise, Advertised);
//   - a coded body carries its decoded length in HeaderDecodedLength, so
//     that the workspace cap is checked before the body moves, as it is
//     for an uncoded body with a Content-Length.
//
// Content that does not compress (random, or already compressed) is sent
// as it is, so an incompressible transfer costs one trial coding of a
// sample and nothing else.
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

	"github.com/klauspost/compress/s2"
	"github.com/klauspost/compress/zstd"
)

const (
	// S2 is the coding agentbox's own clients prefer.
	S2 = "s2"
	// Zstd is the registered coding offered beside it.
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
	// windowSize bounds the zstd coder's memory per transfer: a
	// supervisor may run in a small sandbox, and the API codes many
	// transfers at once.
	windowSize = 2 << 20
	// encoderConcurrency is how many blocks a stream's coder works on at
	// once: one is coded while the next is read and the one before is
	// sent, which overlaps the coder with the network.
	encoderConcurrency = 2
	// s2BlockSize is the S2 coder's block, which bounds the decoder's
	// buffers too: a body with larger blocks fails to read.
	s2BlockSize = 1 << 20
	// maxDecodeWindow is the largest window a zstd body may ask the
	// decoder for; the zstd tool's default levels stay below it, and
	// long-distance mode, which needs far more memory, is refused.
	maxDecodeWindow = 8 << 20
)

// codings are the codings offered, preferred first.
var codings = []string{S2, Zstd}

// ErrUnsupported is returned for a Content-Encoding other than one of
// the codings or identity.
var ErrUnsupported = errors.New("unsupported content encoding")

// Of returns the content coding a request's or response's header
// declares: "" for none (or identity), S2 or Zstd, or an error wrapping
// ErrUnsupported for anything else, which the body cannot be read as.
func Of(h http.Header) (string, error) {
	v := strings.TrimSpace(h.Get("Content-Encoding"))
	if v == "" || strings.EqualFold(v, "identity") {
		return "", nil
	}
	for _, c := range codings {
		if strings.EqualFold(v, c) {
			return c, nil
		}
	}
	return "", fmt.Errorf("%w %q; send %s or none", ErrUnsupported, v, strings.Join(codings, ", "))
}

// Preferred returns the coding to answer with for a request whose
// Accept-Encoding is in h: the first of S2 and Zstd that it lists (or *)
// without q=0, or "" when it lists neither.
func Preferred(h http.Header) string {
	listed := map[string]bool{}
	star := false
	for _, line := range h.Values("Accept-Encoding") {
		for _, part := range strings.Split(line, ",") {
			name, params, _ := strings.Cut(part, ";")
			name = strings.ToLower(strings.TrimSpace(name))
			if q, ok := strings.CutPrefix(strings.ReplaceAll(params, " ", ""), "q="); ok {
				if f, err := strconv.ParseFloat(q, 64); err == nil && f == 0 {
					continue
				}
			}
			if name == "*" {
				star = true
			}
			listed[name] = true
		}
	}
	for _, c := range codings {
		if listed[c] {
			return c
		}
	}
	if star {
		return codings[0]
	}
	return ""
}

// Lists reports whether the Accept-Encoding of h lists coding (or *)
// without q=0.
func Lists(h http.Header, coding string) bool {
	for _, line := range h.Values("Accept-Encoding") {
		for _, part := range strings.Split(line, ",") {
			name, params, _ := strings.Cut(part, ";")
			name = strings.TrimSpace(name)
			if !strings.EqualFold(name, coding) && name != "*" {
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

// AcceptAll is the Accept-Encoding of a client that takes every coding,
// preferred first.
var AcceptAll = strings.Join(codings, ", ")

// Advertise says on a response which codings the server takes for
// request bodies (RFC 7694, section 3).
func Advertise(h http.Header) { h.Set("Accept-Encoding", AcceptAll) }

// Advertised returns the coding a response said its server takes for
// request bodies, preferred first, or "".
func Advertised(resp *http.Response) string { return Preferred(resp.Header) }

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

// SetCoded labels h for a body in coding whose decoded length is n (-1
// if unknown).
func SetCoded(h http.Header, coding string, n int64) {
	h.Set("Content-Encoding", coding)
	if n >= 0 {
		h.Set(HeaderDecodedLength, strconv.FormatInt(n, 10))
	}
}

// Compressible reports whether sample, the start of a body of total
// bytes (-1 if unknown), is worth coding: large enough, and compressing
// to at most maxRatio of itself with the fast coder.
func Compressible(sample []byte, total int64) bool {
	if len(sample) < minCompressible || total >= 0 && total < minCompressible {
		return false
	}
	buf := bufPool.Get().(*[]byte)
	defer bufPool.Put(buf)
	if need := s2.MaxEncodedLen(len(sample)); cap(*buf) < need {
		*buf = make([]byte, need)
	}
	coded := s2.EncodeBetter((*buf)[:cap(*buf)], sample)
	return float64(len(coded)) <= maxRatio*float64(len(sample))
}

var bufPool = sync.Pool{New: func() any { b := make([]byte, 0, s2.MaxEncodedLen(SampleSize)); return &b }}

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

var (
	zstdEncoders = sync.Pool{New: func() any {
		enc, err := zstd.NewWriter(nil,
			zstd.WithEncoderLevel(zstd.SpeedFastest),
			zstd.WithEncoderConcurrency(encoderConcurrency),
			zstd.WithWindowSize(windowSize),
			zstd.WithLowerEncoderMem(true))
		if err != nil {
			panic(err) // the options are constants
		}
		return enc
	}}
	s2Encoders = sync.Pool{New: func() any {
		return s2.NewWriter(nil, s2.WriterConcurrency(encoderConcurrency), s2.WriterBetterCompression(), s2.WriterBlockSize(s2BlockSize))
	}}
)

// coder is what the zstd and S2 stream writers have in common.
type coder interface {
	io.Writer
	io.ReaderFrom
	Close() error
	Reset(io.Writer)
}

type zstdCoder struct{ *zstd.Encoder }

func (z zstdCoder) Reset(w io.Writer) { z.Encoder.Reset(w) }

// Writer codes what is written to it onto w. Close ends the stream (it
// does not close w) and must be called once the body is written.
type Writer struct {
	c    coder
	pool *sync.Pool
}

// NewWriter returns a Writer of coding (S2 or Zstd) onto w.
func NewWriter(coding string, w io.Writer) (*Writer, error) {
	switch coding {
	case S2:
		c := s2Encoders.Get().(*s2.Writer)
		c.Reset(w)
		return &Writer{c: c, pool: &s2Encoders}, nil
	case Zstd:
		enc := zstdEncoders.Get().(*zstd.Encoder)
		enc.Reset(w)
		return &Writer{c: zstdCoder{enc}, pool: &zstdEncoders}, nil
	}
	return nil, fmt.Errorf("%w %q", ErrUnsupported, coding)
}

func (w *Writer) Write(p []byte) (int, error) { return w.c.Write(p) }

// ReadFrom codes all of r, in the coder's block size rather than in
// whatever size the caller's copy would use.
func (w *Writer) ReadFrom(r io.Reader) (int64, error) { return w.c.ReadFrom(r) }

// Close ends the stream and returns the coder to the pool.
func (w *Writer) Close() error {
	if w.c == nil {
		return nil
	}
	err := w.c.Close()
	w.c.Reset(nil)
	switch c := w.c.(type) {
	case zstdCoder:
		w.pool.Put(c.Encoder)
	default:
		w.pool.Put(c)
	}
	w.c = nil
	return err
}

// Encode returns the coding of r, coded as it is read. Close stops the
// coding early and returns once the coder has stopped reading r (it does
// not close r).
func Encode(coding string, r io.Reader) (io.ReadCloser, error) {
	pr, pw := io.Pipe()
	zw, err := NewWriter(coding, pw)
	if err != nil {
		return nil, err
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		_, err := zw.ReadFrom(r)
		if cerr := zw.Close(); err == nil {
			err = cerr
		}
		pw.CloseWithError(err)
	}()
	return &encoding{PipeReader: pr, done: done}, nil
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
	dec     io.Reader
	release func()
	body    io.Reader
}

// NewReader returns the decoding of r from coding (S2 or Zstd), bounded
// in memory (a body that asks for larger blocks or windows than the
// coders here make fails to read).
func NewReader(coding string, r io.Reader) (io.ReadCloser, error) {
	switch coding {
	case S2:
		return &reader{dec: s2.NewReader(r, s2.ReaderMaxBlockSize(s2BlockSize)), release: func() {}, body: r}, nil
	case Zstd:
		dec, err := zstd.NewReader(r, zstd.WithDecoderConcurrency(1), zstd.WithDecoderMaxWindow(maxDecodeWindow), zstd.WithDecoderLowmem(true))
		if err != nil {
			return nil, fmt.Errorf("zstd: %w", err)
		}
		return &reader{dec: dec, release: dec.Close, body: r}, nil
	}
	return nil, fmt.Errorf("%w %q", ErrUnsupported, coding)
}

func (r *reader) Read(p []byte) (int, error) {
	if r.dec == nil {
		return 0, errors.New("content coding: read after close")
	}
	n, err := r.dec.Read(p)
	if err != nil && !errors.Is(err, io.EOF) {
		err = fmt.Errorf("content coding: %w", err)
	}
	return n, err
}

func (r *reader) Close() error {
	if r.dec != nil {
		r.release()
		r.dec = nil
	}
	if c, ok := r.body.(io.Closer); ok {
		return c.Close()
	}
	return nil
}
