package supervisor

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"os"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	api "github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"
)

// TestManifest lists regular files recursively with their digests and
// times, skips links and special files, and stays in the workspace.
func TestManifest(t *testing.T) {
	fsrv := newFileServer(t, Config{WorkspaceCap: 1 << 20})
	ctx := context.Background()
	files := map[string]string{"a.txt": "alpha", "dir/b.bin": "bravo!", "dir/sub/empty": ""}
	for p, content := range files {
		full := filepath.Join(fsrv.ws, p)
		if err := os.MkdirAll(filepath.Dir(full), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(full, []byte(content), 0o640); err != nil {
			t.Fatal(err)
		}
	}
	mtime := time.Date(2026, 1, 2, 3, 4, 5, 600000000, time.UTC)
	if err := os.Chtimes(filepath.Join(fsrv.ws, "a.txt"), mtime, mtime); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink("a.txt", filepath.Join(fsrv.ws, "link")); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink("/etc", filepath.Join(fsrv.ws, "escape")); err != nil {
		t.Fatal(err)
	}

	m, err := fsrv.client.Manifest(ctx, "")
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("manifest: %+v", *m)
	if len(m.Files) != len(files) || m.Skipped != 2 || m.CapBytes != 1<<20 || m.TotalBytes != 11 {
		t.Fatalf("manifest %+v", m)
	}
	for _, e := range m.Files {
		want, ok := files[e.Path]
		sum := sha256.Sum256([]byte(want))
		if !ok || e.Size != int64(len(want)) || e.SHA256 != hex.EncodeToString(sum[:]) || e.Mode != "0640" {
			t.Errorf("entry %+v", e)
		}
		if e.Path == "a.txt" && !e.ModTime.Equal(mtime) {
			t.Errorf("a.txt mod time %s, want %s", e.ModTime, mtime)
		}
	}

	sub, err := fsrv.client.Manifest(ctx, "dir")
	if err != nil || len(sub.Files) != 2 || sub.Files[0].Path != "dir/b.bin" {
		t.Fatalf("manifest of dir: %+v, %v", sub, err)
	}
	for p, code := range map[string]api.Code{
		"../x": api.CodePathEscapesWorkspace, "escape": api.CodePathEscapesWorkspace,
		"a.txt": api.CodeNotADirectory, "nope": api.CodeNotFound,
	} {
		if _, err := fsrv.client.Manifest(ctx, p); api.CodeOf(err) != code {
			t.Errorf("manifest of %s: %v, want %s", p, err, code)
		}
	}
}

// TestManifestDigestCache checks that remembered digests never hide a
// change: a rewrite of the same size with the old modification time put
// back, a deletion, and a file written within the racy window.
func TestManifestDigestCache(t *testing.T) {
	fsrv := newFileServer(t, Config{})
	fsrv.s.digests.racy = 0
	ctx := context.Background()
	write := func(p, content string) {
		t.Helper()
		if err := os.WriteFile(filepath.Join(fsrv.ws, p), []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	digests := func() map[string]string {
		t.Helper()
		m, err := fsrv.client.Manifest(ctx, "")
		if err != nil {
			t.Fatal(err)
		}
		out := map[string]string{}
		for _, e := range m.Files {
			out[e.Path] = e.SHA256
		}
		return out
	}
	sha := func(s string) string { sum := sha256.Sum256([]byte(s)); return hex.EncodeToString(sum[:]) }
	cached := func() int {
		fsrv.s.digests.mu.Lock()
		defer fsrv.s.digests.mu.Unlock()
		return len(fsrv.s.digests.m)
	}

	write("a.txt", "alpha")
	write("b.txt", "bravo")
	if got := digests(); got["a.txt"] != sha("alpha") || got["b.txt"] != sha("bravo") {
		t.Fatalf("first manifest %v", got)
	}
	if n := cached(); n != 2 {
		t.Fatalf("%d digests cached, want 2", n)
	}

	fi, err := os.Stat(filepath.Join(fsrv.ws, "a.txt"))
	if err != nil {
		t.Fatal(err)
	}
	write("a.txt", "ALPHA")
	if err := os.Chtimes(filepath.Join(fsrv.ws, "a.txt"), fi.ModTime(), fi.ModTime()); err != nil {
		t.Fatal(err)
	}
	if err := os.Remove(filepath.Join(fsrv.ws, "b.txt")); err != nil {
		t.Fatal(err)
	}
	got := digests()
	if got["a.txt"] != sha("ALPHA") || len(got) != 1 {
		t.Errorf("after a same-size rewrite with the old time and a deletion: %v", got)
	}
	if n := cached(); n != 1 {
		t.Errorf("%d digests cached after b.txt was deleted, want 1", n)
	}

	fsrv.s.digests.racy = racyWindow
	write("c.txt", "charlie")
	if got := digests(); got["c.txt"] != sha("charlie") {
		t.Errorf("c.txt: %v", got)
	}
	if n := cached(); n != 1 {
		t.Errorf("a file written just now was cached (%d entries)", n)
	}
}

// BenchmarkManifest measures a manifest of 64 files of 1 MiB, the first
// (every file read) against the next (digests remembered).
func BenchmarkManifest(b *testing.B) {
	for _, warm := range []bool{false, true} {
		name := "cold"
		if warm {
			name = "cached"
		}
		b.Run(name, func(b *testing.B) {
			fsrv := newFileServer(b, Config{})
			fsrv.s.digests.racy = 0
			data := make([]byte, 1<<20)
			for i := range 64 {
				if err := os.WriteFile(filepath.Join(fsrv.ws, "f"+strconv.Itoa(i)), data, 0o644); err != nil {
					b.Fatal(err)
				}
			}
			ctx := context.Background()
			b.SetBytes(64 << 20)
			for b.Loop() {
				if !warm {
					fsrv.s.digests = newDigestCache()
				}
				if _, err := fsrv.client.Manifest(ctx, ""); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
