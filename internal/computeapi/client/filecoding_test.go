package client

import (
	"bytes"
	"crypto/rand"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"

	"github.com/agentbox/terraform-provider-agentbox/internal/contentcoding"
)

// fileAPI is an API stand-in that stores one file body as it arrives and
// says, or not, that it takes zstd-coded uploads.
type fileAPI struct {
	advertise bool

	mu       sync.Mutex
	coding   []string // the Content-Encoding of each PUT
	probes   int      // calls before a PUT
	received []byte   // the last PUT's body, decoded
}

func (f *fileAPI) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if f.advertise {
		contentcoding.Advertise(w.Header())
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	switch {
	case r.Method == http.MethodPut:
		enc := r.Header.Get("Content-Encoding")
		f.coding = append(f.coding, enc)
		body := io.Reader(r.Body)
		if enc != "" {
			dec, err := contentcoding.NewReader(enc, r.Body)
			if err != nil {
				http.Error(w, err.Error(), http.StatusBadRequest)
				return
			}
			defer dec.Close()
			body = dec
		}
		data, err := io.ReadAll(body)
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		f.received = data
		fmt.Fprintf(w, `{"path":"f","size":%d,"mode":"0644"}`, len(data))
	case strings.HasSuffix(r.URL.Path, "/status"):
		f.probes++
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprint(w, `{"agent_id":"a","phase":"Running"}`)
	default:
		http.NotFound(w, r)
	}
}

func random(n int) []byte {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return b
}

func text(n int) []byte {
	var b bytes.Buffer
	for i := 0; b.Len() < n; i++ {
		fmt.Fprintf(&b, "func handler%d(w http.ResponseWriter, r *http.Request) { serve(w, r, %d) }\n", i, i*7)
	}
	return b.Bytes()[:n]
}

// TestPutFileNegotiates: a compressible upload goes zstd-coded only to an
// API that said it takes the coding, after one status call when the
// client has had no answer yet; small or incompressible uploads, and a
// client with DisableCompression, go as they are.
func TestPutFileNegotiates(t *testing.T) {
	big := text(2 << 20)
	for _, c := range []struct {
		name      string
		advertise bool
		disable   bool
		body      []byte
		coding    string // of both uploads
		probes    int
	}{
		{"an API that takes the coding", true, false, big, "[s2 s2]", 1},
		{"an API before the coding", false, false, big, "[ ]", 1},
		{"compression disabled", true, true, big, "[ ]", 0},
		// Too small to be worth a probe: the first goes as it is, and its
		// answer says the API takes the coding.
		{"a small upload", true, false, text(64 << 10), "[ s2]", 0},
		{"random bytes", true, false, random(2 << 20), "[ ]", 0},
	} {
		t.Run(c.name, func(t *testing.T) {
			api := &fileAPI{advertise: c.advertise}
			srv := httptest.NewServer(api)
			defer srv.Close()
			cl, err := New(srv.URL, "token", nil)
			if err != nil {
				t.Fatal(err)
			}
			cl.DisableCompression = c.disable
			for i := range 2 {
				fi, err := cl.PutFile(t.Context(), "a", "f", bytes.NewReader(c.body), 0)
				if err != nil || fi.Size != int64(len(c.body)) || !bytes.Equal(api.received, c.body) {
					t.Fatalf("put %d: %+v, %v; the API got %d bytes", i, fi, err, len(api.received))
				}
			}
			// The second upload needs no second probe.
			if fmt.Sprint(api.coding) != c.coding || api.probes != c.probes {
				t.Errorf("codings %q, probes %d; want %s, %d probes", api.coding, api.probes, c.coding, c.probes)
			}
		})
	}
}

// TestGetFileDecodes: a coded answer is decoded as it is read; a plain
// one is passed as it is; a client with DisableCompression does not ask.
func TestGetFileDecodes(t *testing.T) {
	data := text(1 << 20)
	enc, err := contentcoding.Encode(contentcoding.S2, bytes.NewReader(data))
	if err != nil {
		t.Fatal(err)
	}
	coded, _ := io.ReadAll(enc)
	var asked []string
	declared := int64(len(data))
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		coding := contentcoding.Preferred(r.Header)
		asked = append(asked, coding)
		if coding != "" {
			contentcoding.SetCoded(w.Header(), coding, declared)
			_, _ = w.Write(coded)
			return
		}
		_, _ = w.Write(data)
	}))
	defer srv.Close()
	for _, disable := range []bool{false, true} {
		cl, err := New(srv.URL, "token", nil)
		if err != nil {
			t.Fatal(err)
		}
		cl.DisableCompression = disable
		rc, err := cl.GetFile(t.Context(), "a", "f")
		if err != nil {
			t.Fatal(err)
		}
		back, err := io.ReadAll(rc)
		rc.Close()
		if err != nil || !bytes.Equal(back, data) {
			t.Errorf("disable %v: %d bytes, %v", disable, len(back), err)
		}
	}
	if fmt.Sprint(asked) != "[s2 ]" {
		t.Errorf("asked for the coding: %q", asked)
	}
	// A coded file that decodes to less, or more, than its declared
	// length fails to read.
	for _, n := range []int64{declared + 1, declared - 1} {
		declared = n
		cl, _ := New(srv.URL, "token", nil)
		rc, err := cl.GetFile(t.Context(), "a", "f")
		if err != nil {
			t.Fatal(err)
		}
		if _, err := io.ReadAll(rc); err == nil {
			t.Errorf("declared %d for %d: read without error", n, len(data))
		}
		rc.Close()
	}
}
