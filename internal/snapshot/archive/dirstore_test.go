package archive_test

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	"github.com/agentbox/terraform-provider-agentbox/internal/snapshot"
	"github.com/agentbox/terraform-provider-agentbox/internal/snapshot/archive"
)

// The embedded store never reads, writes or deletes outside its
// directory: not through a symbolic link planted inside it, and not
// through names that climb out.
func TestDirStorePathSafety(t *testing.T) {
	p := newPKI(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	dir, outside := t.TempDir(), t.TempDir()
	d, err := archive.New(archive.Config{Dir: dir, Prefix: "agentbox"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(d.Close)
	sb := newSandbox("agent-1", "uid-1")
	ws := t.TempDir()
	fillWorkspace(t, ws, 1<<10)
	sup := startSupervisor(t, p, sb, ws, supervisorOptions{})

	// A link where the prefix's folder goes, pointing out of the store,
	// with a file where the snapshot would be.
	if err := os.Symlink(outside, filepath.Join(dir, "agentbox")); err != nil {
		t.Fatal(err)
	}
	victim := filepath.Join(outside, "team-a", "agent-1", "s1.tar.gz")
	if err := os.MkdirAll(filepath.Dir(victim), 0o750); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(victim, []byte("not the store's"), 0o640); err != nil {
		t.Fatal(err)
	}
	st, _, err := takeUntilDone(ctx, d, snapshot.Request{Sandbox: sb, Name: "s2", Supervisor: sup.client})
	if err == nil || st.Ready {
		t.Fatalf("Take through a link out of the store = %+v, %v; want an error", st, err)
	}
	t.Logf("Take: %v", err)
	if err := d.Restore(ctx, snapshot.RestoreRequest{Sandbox: sb, Snapshot: &v1alpha1.SandboxSnapshot{Name: "s1"}, Supervisor: sup.client}); err == nil {
		t.Error("Restore read through a link out of the store")
	}
	_ = d.Delete(ctx, sb, "s1")
	if b, err := os.ReadFile(victim); err != nil || string(b) != "not the store's" {
		t.Errorf("the file outside the store was touched: %q, %v", b, err)
	}
	entries, err := os.ReadDir(filepath.Dir(victim))
	if err != nil || len(entries) != 1 {
		t.Errorf("the folder outside the store holds %d entries (%v), want the one file", len(entries), err)
	}

	// Names that climb out are refused before any file is opened.
	clean := t.TempDir()
	d2, err := archive.New(archive.Config{Dir: clean})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(d2.Close)
	for _, ns := range []string{"..", ".hidden", "a/../../b"} {
		bad := newSandbox("agent-1", "uid-1")
		bad.Namespace = ns
		if _, err := d2.Take(ctx, snapshot.Request{Sandbox: bad, Name: "s1", Supervisor: sup.client}); err == nil {
			t.Errorf("Take with namespace %q succeeded", ns)
		}
		if err := d2.Restore(ctx, snapshot.RestoreRequest{Sandbox: bad, Snapshot: &v1alpha1.SandboxSnapshot{Name: "s1"}, Supervisor: sup.client}); err == nil || errors.Is(err, snapshot.ErrNotFound) {
			t.Errorf("Restore with namespace %q: %v, want a refusal", ns, err)
		}
	}
	if entries, _ := os.ReadDir(clean); len(entries) != 0 {
		t.Errorf("refused names left %d entries in the store", len(entries))
	}
}

// A file at an archive's name that the store did not write (no header)
// is an error, never a snapshot that is ready or restorable.
func TestDirStoreForeignFile(t *testing.T) {
	p := newPKI(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	dir := t.TempDir()
	d, err := archive.New(archive.Config{Dir: dir})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(d.Close)
	sb := newSandbox("agent-1", "uid-1")
	path := d.Location(sb, "s1")
	if err := os.MkdirAll(filepath.Dir(path), 0o750); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, []byte("a tarball someone copied here\n"), 0o640); err != nil {
		t.Fatal(err)
	}
	sup := startSupervisor(t, p, sb, t.TempDir(), supervisorOptions{})
	if st, err := d.Take(ctx, snapshot.Request{Sandbox: sb, Name: "s1", Supervisor: sup.client}); err == nil || st.Ready {
		t.Errorf("Take over a foreign file = %+v, %v; want an error", st, err)
	}
	err = d.Restore(ctx, snapshot.RestoreRequest{Sandbox: sb, Snapshot: &v1alpha1.SandboxSnapshot{Name: "s1"}, Supervisor: sup.client})
	if err == nil || !strings.Contains(err.Error(), "header") {
		t.Errorf("Restore of a foreign file: %v, want an error about its header", err)
	}
}

// Check writes in the directory and leaves nothing behind; a directory
// that is missing or not a directory fails it.
func TestDirStoreCheck(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	d, err := archive.New(archive.Config{Dir: dir})
	if err != nil {
		t.Fatal(err)
	}
	if err := d.Check(ctx); err != nil {
		t.Fatalf("Check: %v", err)
	}
	if entries, _ := os.ReadDir(dir); len(entries) != 0 {
		t.Errorf("Check left %d entries", len(entries))
	}
	if d.Name() != archive.Name || d.Store() != archive.StoreEmbedded {
		t.Errorf("Name %q, Store %q", d.Name(), d.Store())
	}
	file := filepath.Join(dir, "a-file")
	if err := os.WriteFile(file, nil, 0o640); err != nil {
		t.Fatal(err)
	}
	for _, bad := range []string{filepath.Join(dir, "missing"), file} {
		d, err := archive.New(archive.Config{Dir: bad})
		if err != nil {
			t.Fatal(err)
		}
		if err := d.Check(ctx); err == nil || !strings.Contains(err.Error(), bad) {
			t.Errorf("Check of %s: %v, want an error naming it", bad, err)
		}
	}
}
