package supervisor

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"os"
	"path/filepath"
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
