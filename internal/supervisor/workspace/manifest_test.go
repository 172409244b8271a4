package workspace

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	api "github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"
)

// newTestWorkspace opens a workspace in a temporary directory.
func newTestWorkspace(t testing.TB) *Workspace {
	t.Helper()
	ws, err := Open(t.TempDir(), api.DefaultWorkspaceCapBytes, time.Second, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ws.Close() })
	return ws
}

// TestManifestDigestCache checks that remembered digests never hide a
// change: a rewrite of the same size with the old modification time put
// back, a deletion, and a file written within the racy window.
func TestManifestDigestCache(t *testing.T) {
	fsrv := newTestWorkspace(t)
	fsrv.digests.racy = 0
	ctx := context.Background()
	write := func(p, content string) {
		t.Helper()
		if err := os.WriteFile(filepath.Join(fsrv.Dir(), p), []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	digests := func() map[string]string {
		t.Helper()
		m, err := fsrv.Manifest(ctx, ".")
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
		fsrv.digests.mu.Lock()
		defer fsrv.digests.mu.Unlock()
		return len(fsrv.digests.m)
	}

	write("a.txt", "alpha")
	write("b.txt", "bravo")
	if got := digests(); got["a.txt"] != sha("alpha") || got["b.txt"] != sha("bravo") {
		t.Fatalf("first manifest %v", got)
	}
	if n := cached(); n != 2 {
		t.Fatalf("%d digests cached, want 2", n)
	}

	fi, err := os.Stat(filepath.Join(fsrv.Dir(), "a.txt"))
	if err != nil {
		t.Fatal(err)
	}
	write("a.txt", "ALPHA")
	if err := os.Chtimes(filepath.Join(fsrv.Dir(), "a.txt"), fi.ModTime(), fi.ModTime()); err != nil {
		t.Fatal(err)
	}
	if err := os.Remove(filepath.Join(fsrv.Dir(), "b.txt")); err != nil {
		t.Fatal(err)
	}
	got := digests()
	if got["a.txt"] != sha("ALPHA") || len(got) != 1 {
		t.Errorf("after a same-size rewrite with the old time and a deletion: %v", got)
	}
	if n := cached(); n != 1 {
		t.Errorf("%d digests cached after b.txt was deleted, want 1", n)
	}

	fsrv.digests.racy = racyWindow
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
			fsrv := newTestWorkspace(b)
			fsrv.digests.racy = 0
			data := make([]byte, 1<<20)
			for i := range 64 {
				if err := os.WriteFile(filepath.Join(fsrv.Dir(), "f"+strconv.Itoa(i)), data, 0o644); err != nil {
					b.Fatal(err)
				}
			}
			ctx := context.Background()
			b.SetBytes(64 << 20)
			for b.Loop() {
				if !warm {
					fsrv.digests = newDigestCache()
				}
				if _, err := fsrv.Manifest(ctx, "."); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
