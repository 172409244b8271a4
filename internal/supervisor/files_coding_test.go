package supervisor

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"testing"

	"github.com/agentbox/terraform-provider-agentbox/internal/contentcoding"
	api "github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"
)

// sourceText is text with the repetition of a source file.
func sourceText(n int) []byte {
	var b bytes.Buffer
	for i := 0; b.Len() < n; i++ {
		fmt.Fprintf(&b, "func handler%d(w http.ResponseWriter, r *http.Request) { serve(w, r, %d) }\n", i, i*7)
	}
	return b.Bytes()[:n]
}

func coded(t testing.TB, data []byte) []byte {
	t.Helper()
	enc, err := contentcoding.Encode(contentcoding.S2, bytes.NewReader(data))
	if err != nil {
		t.Fatal(err)
	}
	c, err := io.ReadAll(enc)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// TestFilesCoded: the supervisor says it takes coded uploads, decodes
// them as it writes, checks their decoded length against the cap before
// reading, and codes a download that asks for it only when the file
// compresses and the whole file is asked for.
func TestFilesCoded(t *testing.T) {
	f := newFileServer(t, Config{WorkspaceCap: 8 << 20})
	c, ctx := f.client, context.Background()
	if !c.AcceptsCoding(ctx, contentcoding.S2) || !c.AcceptsCoding(ctx, contentcoding.Zstd) || c.AcceptsCoding(ctx, "gzip") {
		t.Fatal("the supervisor did not say it takes s2 and zstd, and only those")
	}

	text := sourceText(1 << 20)
	fi, err := c.PutFileCoded(ctx, "src/a.go", bytes.NewReader(coded(t, text)), contentcoding.S2, int64(len(text)), 0o640)
	if err != nil || fi.Size != int64(len(text)) || fi.Mode != "0640" {
		t.Fatalf("coded put: %+v, %v", fi, err)
	}
	if got, _ := os.ReadFile(filepath.Join(f.ws, "src/a.go")); !bytes.Equal(got, text) {
		t.Fatalf("the workspace holds %d bytes that are not the text", len(got))
	}
	// Without a decoded length the write is still checked as it goes.
	if _, err := c.PutFileCoded(ctx, "src/b.go", bytes.NewReader(coded(t, text)), contentcoding.S2, -1, 0); err != nil {
		t.Fatal(err)
	}

	// A download that asks gets the text coded, smaller, with its length.
	// In either coding, the first listed that the supervisor knows.
	for accept, want := range map[string]string{"s2": "s2", "zstd": "zstd", "gzip, zstd, s2": "s2", "br, zstd": "zstd"} {
		got, err := c.GetFileCoded(ctx, "src/a.go", accept)
		if err != nil {
			t.Fatal(err)
		}
		wire, _ := io.ReadAll(got.Body)
		got.Body.Close()
		if got.Coding != want || got.DecodedLength != int64(len(text)) || len(wire) > len(text)/4 {
			t.Fatalf("%s: coded get: coding %q, length %d, %d bytes on the wire for %d", accept, got.Coding, got.DecodedLength, len(wire), len(text))
		}
		dec, err := contentcoding.NewReader(got.Coding, bytes.NewReader(wire))
		if err != nil {
			t.Fatal(err)
		}
		if back, err := io.ReadAll(dec); err != nil || !bytes.Equal(back, text) {
			t.Fatalf("%s: decoded %d bytes, %v", accept, len(back), err)
		}
	}
	// A download that does not ask gets the file as it is.
	if back := readAll(t)(c.GetFile(ctx, "src/a.go")); !bytes.Equal(back, text) {
		t.Fatalf("plain get: %d bytes", len(back))
	}
	// Random bytes, and a range, go as they are even when the coding is
	// asked for.
	random := randomBytes(t, 1<<20)
	if _, err := c.PutFile(ctx, "random.bin", bytes.NewReader(random), 0); err != nil {
		t.Fatal(err)
	}
	got, err := c.GetFileCoded(ctx, "random.bin", contentcoding.AcceptAll)
	if err != nil {
		t.Fatal(err)
	}
	back, _ := io.ReadAll(got.Body)
	got.Body.Close()
	if got.Coding != "" || !bytes.Equal(back, random) {
		t.Fatalf("random: coding %q, %d bytes", got.Coding, len(back))
	}
	status, body, h := f.raw(t, http.MethodGet, api.PathFiles+"src/a.go", nil, "Accept-Encoding", "s2", "Range", "bytes=10-19")
	if status != http.StatusPartialContent || h.Get("Content-Encoding") != "" || !bytes.Equal(body, text[10:20]) {
		t.Fatalf("range: %d %q %q", status, h.Get("Content-Encoding"), body)
	}

	// Refusals: an unknown coding, a decoded length that does not match,
	// a body that is not zstd, and a decoded length past the cap, which
	// is refused before the body is read. None leaves anything behind.
	status, body, _ = f.raw(t, http.MethodPut, api.PathFiles+"x", bytes.NewReader(text), "Content-Encoding", "gzip")
	if status != http.StatusBadRequest || !bytes.Contains(body, []byte("unsupported content encoding")) {
		t.Errorf("gzip: %d %s", status, body)
	}
	_, err = c.PutFileCoded(ctx, "x", bytes.NewReader(coded(t, text)), contentcoding.S2, int64(len(text))+1, 0)
	wantCode(t, "wrong decoded length", err, api.CodeInvalidArgument)
	_, err = c.PutFileCoded(ctx, "x", bytes.NewReader(text), contentcoding.Zstd, -1, 0)
	wantCode(t, "a body that is not zstd", err, api.CodeInvalidArgument)
	_, err = c.PutFileCoded(ctx, "x", bytes.NewReader(text), contentcoding.S2, -1, 0)
	wantCode(t, "a body that is not s2", err, api.CodeInvalidArgument)
	status, body, _ = f.raw(t, http.MethodPut, api.PathFiles+"x", bytes.NewReader(coded(t, text)),
		"Content-Encoding", "s2", contentcoding.HeaderDecodedLength, "-1")
	if status != http.StatusBadRequest {
		t.Errorf("a negative decoded length: %d %s", status, body)
	}
	_, err = c.PutFileCoded(ctx, "x", bytes.NewReader(coded(t, text)), contentcoding.S2, 64<<20, 0)
	wantCode(t, "a decoded length past the cap", err, api.CodeWorkspaceFull)
	// A small coded body that decodes past the cap stops at the cap.
	bomb := bytes.Repeat([]byte{0}, 16<<20)
	_, err = c.PutFileCoded(ctx, "x", bytes.NewReader(coded(t, bomb)), contentcoding.S2, -1, 0)
	wantCode(t, "a coded body that decodes past the cap", err, api.CodeWorkspaceFull)
	if _, err := os.Stat(filepath.Join(f.ws, "x")); err == nil {
		t.Fatal("a refused file exists")
	}
	noTemps(t, f.ws)
}

// TestFilesCodedTar: a tar upload may come coded too.
func TestFilesCodedTar(t *testing.T) {
	f := newFileServer(t, Config{})
	text := string(sourceText(64 << 10))
	tarred := makeTar(t, tarEntry{name: "d/one.go", body: text}, tarEntry{name: "d/two.go", body: text})
	status, body, _ := f.raw(t, http.MethodPut, api.PathFiles+"t?format=tar", bytes.NewReader(coded(t, tarred)),
		"Content-Encoding", "s2", "Content-Type", api.ContentTypeTar)
	if status != http.StatusOK {
		t.Fatalf("coded tar: %d %s", status, body)
	}
	for _, name := range []string{"t/d/one.go", "t/d/two.go"} {
		if got, _ := os.ReadFile(filepath.Join(f.ws, name)); string(got) != text {
			t.Errorf("%s: %d bytes", name, len(got))
		}
	}
}
