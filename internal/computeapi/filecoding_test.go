package computeapi

import (
	"bytes"
	"context"
	"crypto/rand"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"sync/atomic"
	"testing"

	api "github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
	"github.com/agentbox/terraform-provider-agentbox/internal/contentcoding"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor"
)

// sourceText is text with the repetition of a source file.
func sourceText(n int) []byte {
	var b bytes.Buffer
	for i := 0; b.Len() < n; i++ {
		fmt.Fprintf(&b, "func handler%d(w http.ResponseWriter, r *http.Request) { serve(w, r, %d) }\n", i, i*7)
	}
	return b.Bytes()[:n]
}

// codingSeen wraps the supervisor's handler to count what crosses to it:
// request and response body bytes, and the coded requests and answers.
type codingSeen struct {
	in, out            atomic.Int64
	codedIn, codedOut  atomic.Int64
	hideAcceptEncoding bool
}

func (c *codingSeen) wrap(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("Content-Encoding") != "" {
			c.codedIn.Add(1)
		}
		r.Body = &countingBody{ReadCloser: r.Body, n: &c.in}
		cw := &countingWriter{ResponseWriter: w, seen: c}
		h.ServeHTTP(cw, r)
	})
}

type countingBody struct {
	io.ReadCloser
	n *atomic.Int64
}

func (b *countingBody) Read(p []byte) (int, error) {
	n, err := b.ReadCloser.Read(p)
	b.n.Add(int64(n))
	return n, err
}

type countingWriter struct {
	http.ResponseWriter
	seen *codingSeen
}

func (w *countingWriter) WriteHeader(code int) {
	if w.seen.hideAcceptEncoding {
		// A supervisor of a version before the coding.
		w.Header().Del("Accept-Encoding")
	}
	if w.Header().Get("Content-Encoding") != "" {
		w.seen.codedOut.Add(1)
	}
	w.ResponseWriter.WriteHeader(code)
}

func (w *countingWriter) Write(p []byte) (int, error) {
	w.seen.out.Add(int64(len(p)))
	return w.ResponseWriter.Write(p)
}

func (w *countingWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }

// TestFilesCodedThroughTheAPI: a client that negotiates the coding sends
// and receives compressible files coded all the way to the
// supervisor, random ones as they are; a client that does not
// (DisableCompression, or any HTTP client that does not ask) sends and
// gets files as they are; each reads what the other wrote.
func TestFilesCodedThroughTheAPI(t *testing.T) {
	seen := &codingSeen{}
	clients := realSupervisorAPIWith(t, apiSetup{pushDelay: -1, wrapSupervisor: seen.wrap,
		configure: func(c *supervisor.Config) { c.WorkspaceCap = 16 << 20 }})
	ctx := context.Background()
	negotiating := clients(adminToken)
	plain := clients(adminToken)
	plain.DisableCompression = true
	// The negotiating client has had no answer yet: its first upload
	// asks the API whether it takes the coding, and goes coded.
	text := sourceText(2 << 20)
	random := make([]byte, 2<<20)
	_, _ = rand.Read(random)

	for _, c := range []struct {
		name               string
		data               []byte
		put, get           *api.Client
		codedUp, codedDown bool
	}{
		{"text, negotiated both ways", text, negotiating, negotiating, true, true},
		{"text, negotiated up, plain down", text, negotiating, plain, true, false},
		{"text, plain up, negotiated down", text, plain, negotiating, false, true},
		{"text, plain both ways", text, plain, plain, false, false},
		{"random, negotiated both ways", random, negotiating, negotiating, false, false},
	} {
		in0, out0, ci0, co0 := seen.in.Load(), seen.out.Load(), seen.codedIn.Load(), seen.codedOut.Load()
		fi, err := c.put.PutFile(ctx, "agent-1", "src/file", bytes.NewReader(c.data), 0o600)
		if err != nil || fi.Size != int64(len(c.data)) {
			t.Fatalf("%s: put: %+v, %v", c.name, fi, err)
		}
		in, codedIn := seen.in.Load()-in0, seen.codedIn.Load()-ci0
		rc, err := c.get.GetFile(ctx, "agent-1", "src/file")
		if err != nil {
			t.Fatal(err)
		}
		back, err := io.ReadAll(rc)
		rc.Close()
		if err != nil || !bytes.Equal(back, c.data) {
			t.Fatalf("%s: get: %d bytes (want %d identical), %v", c.name, len(back), len(c.data), err)
		}
		out, codedOut := seen.out.Load()-out0, seen.codedOut.Load()-co0
		if (codedIn == 1) != c.codedUp || c.codedUp != (in < int64(len(c.data))/4) {
			t.Errorf("%s: %d coded uploads, %d bytes to the supervisor for %d", c.name, codedIn, in, len(c.data))
		}
		if (codedOut >= 1) != c.codedDown || c.codedDown != (out < int64(len(c.data))/4) {
			t.Errorf("%s: %d coded answers, %d bytes from the supervisor for %d", c.name, codedOut, out, len(c.data))
		}
	}

	// An HTTP client that knows nothing of the coding: a plain upload,
	// and a download without Accept-Encoding, as before the coding.
	hc := negotiating.HTTPClient()
	url := negotiating.Endpoint() + api.PathFile("agent-1", "raw.txt")
	req, _ := http.NewRequestWithContext(ctx, http.MethodPut, url, bytes.NewReader(text))
	req.Header.Set("Authorization", "Bearer "+adminToken)
	resp, err := hc.Do(req)
	if err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("raw put: %v %v", resp, err)
	}
	resp.Body.Close()
	req, _ = http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	req.Header.Set("Authorization", "Bearer "+adminToken)
	resp, err = hc.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	back, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.Header.Get("Content-Encoding") != "" || !bytes.Equal(back, text) || resp.Header.Get("Accept-Encoding") != contentcoding.AcceptAll {
		t.Errorf("raw get: Content-Encoding %q, Accept-Encoding %q, %d bytes", resp.Header.Get("Content-Encoding"), resp.Header.Get("Accept-Encoding"), len(back))
	}

	// An HTTP client that knows only zstd gets zstd, and can send it.
	req, _ = http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	req.Header.Set("Authorization", "Bearer "+adminToken)
	req.Header.Set("Accept-Encoding", "gzip, zstd")
	resp, err = hc.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	dec, err := contentcoding.NewReader(resp.Header.Get("Content-Encoding"), resp.Body)
	if err != nil {
		t.Fatalf("Accept-Encoding gzip, zstd: %v (Content-Encoding %q)", err, resp.Header.Get("Content-Encoding"))
	}
	back, err = io.ReadAll(dec)
	dec.Close()
	if resp.Header.Get("Content-Encoding") != contentcoding.Zstd || err != nil || !bytes.Equal(back, text) {
		t.Errorf("zstd get: Content-Encoding %q, %d bytes, %v", resp.Header.Get("Content-Encoding"), len(back), err)
	}

	// Refusals keep their codes: an unknown coding, a malformed decoded
	// length, and a coded file whose decoded length cannot fit, which the
	// supervisor refuses before the body moves.
	enc, err := contentcoding.Encode(contentcoding.Zstd, bytes.NewReader(text))
	if err != nil {
		t.Fatal(err)
	}
	coded, _ := io.ReadAll(enc)
	for _, r := range []struct {
		name   string
		header map[string]string
		code   api.Code
	}{
		{"gzip", map[string]string{"Content-Encoding": "gzip"}, api.CodeInvalidArgument},
		{"bad length", map[string]string{"Content-Encoding": "zstd", contentcoding.HeaderDecodedLength: "many"}, api.CodeInvalidArgument},
		{"past the cap", map[string]string{"Content-Encoding": "zstd", contentcoding.HeaderDecodedLength: strconv.Itoa(64 << 20)}, api.CodeWorkspaceFull},
		{"zstd, as sent", map[string]string{"Content-Encoding": "zstd", contentcoding.HeaderDecodedLength: strconv.Itoa(len(text))}, ""},
	} {
		req, _ := http.NewRequestWithContext(ctx, http.MethodPut, url, bytes.NewReader(coded))
		req.Header.Set("Authorization", "Bearer "+adminToken)
		for k, v := range r.header {
			req.Header.Set(k, v)
		}
		resp, err := hc.Do(req)
		if err != nil {
			t.Fatalf("%s: %v", r.name, err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if r.code == "" {
			if resp.StatusCode != http.StatusOK {
				t.Errorf("%s: %d %s", r.name, resp.StatusCode, body)
			}
			continue
		}
		if resp.StatusCode != r.code.HTTPStatus() || !bytes.Contains(body, []byte(`"`+string(r.code)+`"`)) {
			t.Errorf("%s: %d %s, want %s", r.name, resp.StatusCode, body, r.code)
		}
	}
}

// TestFilesCodedToAnOlderSupervisor: a supervisor that does not say it
// takes the coding gets a coded upload decoded by the API, and answers
// downloads as they are, which reach the negotiating client whole.
func TestFilesCodedToAnOlderSupervisor(t *testing.T) {
	seen := &codingSeen{hideAcceptEncoding: true}
	clients := realSupervisorAPIWith(t, apiSetup{pushDelay: -1, wrapSupervisor: func(h http.Handler) http.Handler {
		return seen.wrap(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			// A supervisor before the coding neither codes downloads.
			r.Header.Del("Accept-Encoding")
			h.ServeHTTP(w, r)
		}))
	}})
	ctx := context.Background()
	c := clients(adminToken)
	if _, err := c.Status(ctx, "agent-1"); err != nil {
		t.Fatal(err)
	}
	text := sourceText(1 << 20)
	if fi, err := c.PutFile(ctx, "agent-1", "a.go", bytes.NewReader(text), 0); err != nil || fi.Size != int64(len(text)) {
		t.Fatalf("put: %+v, %v", fi, err)
	}
	if seen.codedIn.Load() != 0 || seen.in.Load() != int64(len(text)) {
		t.Errorf("the older supervisor got %d coded uploads, %d bytes", seen.codedIn.Load(), seen.in.Load())
	}
	rc, err := c.GetFile(ctx, "agent-1", "a.go")
	if err != nil {
		t.Fatal(err)
	}
	back, err := io.ReadAll(rc)
	rc.Close()
	if err != nil || !bytes.Equal(back, text) || seen.codedOut.Load() != 0 {
		t.Fatalf("get: %d bytes, %v, %d coded answers", len(back), err, seen.codedOut.Load())
	}
}
