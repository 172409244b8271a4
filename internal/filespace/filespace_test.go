package filespace_test

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"log/slog"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/agentbox/terraform-provider-agentbox/internal/filespace"
	"github.com/agentbox/terraform-provider-agentbox/internal/store"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"
)

const agent = "agent-1"

// sandbox is a real supervisor serving a workspace directory the test can
// also reach on disk (to set modification times).
type sandbox struct {
	dir    string
	client *supervisorapi.Client
}

func newSandbox(t *testing.T, capBytes int64) *sandbox {
	t.Helper()
	dir := t.TempDir()
	sup, err := supervisor.New(supervisor.Config{Workspace: dir, WorkspaceCap: capBytes, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { sup.Close() })
	srv := httptest.NewServer(sup)
	t.Cleanup(srv.Close)
	return &sandbox{dir: dir, client: supervisorapi.NewClient(srv.URL, srv.Client())}
}

func (s *sandbox) write(t *testing.T, p, content string, mtime time.Time) {
	t.Helper()
	if _, err := s.client.PutFile(context.Background(), p, bytes.NewReader([]byte(content)), 0); err != nil {
		t.Fatalf("write %s: %v", p, err)
	}
	if !mtime.IsZero() {
		if err := os.Chtimes(filepath.Join(s.dir, p), mtime, mtime); err != nil {
			t.Fatal(err)
		}
	}
}

func (s *sandbox) remove(t *testing.T, p string) {
	t.Helper()
	if err := s.client.Delete(context.Background(), p, false); err != nil {
		t.Fatalf("delete %s: %v", p, err)
	}
}

// read returns the file's content, or "<absent>".
func (s *sandbox) read(t *testing.T, p string) string {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(s.dir, p))
	if errors.Is(err, os.ErrNotExist) {
		return "<absent>"
	}
	if err != nil {
		t.Fatal(err)
	}
	return string(data)
}

func openStore(t *testing.T) *store.Store {
	t.Helper()
	st, err := store.Open(context.Background(), filepath.Join(t.TempDir(), "agentbox.db"), store.Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	return st
}

func syncAt(t *testing.T, sb *sandbox, st *store.Store, dir filespace.Direction, at time.Time) *filespace.Summary {
	t.Helper()
	sum, err := filespace.Sync(context.Background(), sb.client, st, filespace.Options{
		AgentID: agent, Direction: dir, Now: func() time.Time { return at },
	})
	if err != nil {
		t.Fatalf("%s at %s: %v", dir, at.Format(time.RFC3339), err)
	}
	t.Logf("%s: %+v", dir, *sum)
	return sum
}

func node(t *testing.T, st *store.Store, p string) store.FileNode {
	t.Helper()
	n, err := st.GetFile(context.Background(), agent, p)
	if err != nil {
		t.Fatalf("node %s: %v", p, err)
	}
	return n
}

// TestPushPull moves files from one workspace to another through the
// filespace, byte for byte, and a second sync finds nothing to do.
func TestPushPull(t *testing.T) {
	st := openStore(t)
	a, b := newSandbox(t, 0), newSandbox(t, 0)
	t0 := time.Now().Add(-time.Hour)
	big := string(bytes.Repeat([]byte("0123456789abcdef"), (3<<20)/16+3)) // three chunks and a bit
	a.write(t, "notes/a.txt", "hello", time.Time{})
	a.write(t, "big.bin", big, time.Time{})
	a.write(t, "empty", "", time.Time{})
	// An executable keeps its mode on the way.
	if _, err := a.client.PutFile(context.Background(), "run.sh", strings.NewReader("#!/bin/sh\n"), 0o750); err != nil {
		t.Fatal(err)
	}

	sum := syncAt(t, a, st, filespace.Push, t0)
	if sum.Pushed != 4 || sum.Bytes != int64(len(big)+5+10) || sum.Skipped != 0 {
		t.Fatalf("first push: %+v", sum)
	}
	if n := node(t, st, "run.sh"); n.Mode != 0o750 {
		t.Errorf("run.sh stored with mode %v, want 0750", n.Mode)
	}
	if n := node(t, st, "big.bin"); !n.UpdatedAt.Equal(t0.UTC().Truncate(time.Microsecond)) || n.SizeBytes != int64(len(big)) {
		t.Fatalf("pushed node: %+v", n)
	}
	if sum := syncAt(t, a, st, filespace.Push, t0.Add(time.Minute)); sum.Pushed != 0 || sum.Unchanged != 4 {
		t.Fatalf("second push: %+v", sum)
	}

	sum = syncAt(t, b, st, filespace.Pull, t0.Add(2*time.Minute))
	if sum.Pulled != 4 || sum.Bytes != int64(len(big)+5+10) {
		t.Fatalf("pull: %+v", sum)
	}
	for p, want := range map[string]string{"notes/a.txt": "hello", "big.bin": big, "empty": "", "run.sh": "#!/bin/sh\n"} {
		if got := b.read(t, p); got != want {
			t.Errorf("%s pulled as %d bytes, want %d", p, len(got), len(want))
		}
	}
	if fi, err := os.Stat(filepath.Join(b.dir, "run.sh")); err != nil || fi.Mode().Perm() != 0o750 {
		t.Errorf("run.sh pulled with mode %v (%v), want 0750", fi.Mode(), err)
	}
	if sum := syncAt(t, b, st, filespace.Pull, t0.Add(3*time.Minute)); sum.Pulled != 0 || sum.Unchanged != 4 {
		t.Fatalf("second pull: %+v", sum)
	}
	// The pulled files are not changes to push back.
	if sum := syncAt(t, b, st, filespace.Push, t0.Add(4*time.Minute)); sum.Pushed != 0 || sum.Unchanged != 4 {
		t.Fatalf("push after pull: %+v", sum)
	}
}

// TestPullFromEmptyFilespace leaves a workspace alone, baseline included:
// a new sandbox of an agent that never synced pays a store query only.
func TestPullFromEmptyFilespace(t *testing.T) {
	st := openStore(t)
	a := newSandbox(t, 0)
	a.write(t, "kept.txt", "mine", time.Time{})
	sum, err := filespace.Syncer{Store: st}.Sync(context.Background(), a.client, filespace.Options{AgentID: agent, Direction: filespace.Pull})
	if err != nil {
		t.Fatal(err)
	}
	if sum.Pulled != 0 || sum.Deleted != 0 || sum.WorkspaceBytes != 0 {
		t.Errorf("summary %+v", sum)
	}
	if got := a.read(t, "kept.txt"); got != "mine" {
		t.Errorf("kept.txt is %q", got)
	}
	if got := a.read(t, filespace.StatePath); got != "<absent>" {
		t.Errorf("the pull wrote a baseline: %q", got)
	}
}

// TestLastWriterWins changes a file on both sides and checks that the
// newer change wins in either direction.
func TestLastWriterWins(t *testing.T) {
	st := openStore(t)
	a, b := newSandbox(t, 0), newSandbox(t, 0)
	t0 := time.Now().Add(-time.Hour)
	a.write(t, "f", "v1", time.Time{})
	syncAt(t, a, st, filespace.Push, t0)
	syncAt(t, b, st, filespace.Pull, t0.Add(time.Minute))

	// b writes v2 and pushes it at t0+10m; a changed f at t0+5m, before.
	b.write(t, "f", "v2 from b", time.Time{})
	syncAt(t, b, st, filespace.Push, t0.Add(10*time.Minute))
	a.write(t, "f", "v3 from a (older)", t0.Add(5*time.Minute))
	sum := syncAt(t, a, st, filespace.Push, t0.Add(11*time.Minute))
	if sum.Pushed != 0 || sum.Skipped != 1 || len(sum.Conflicts) != 1 || sum.Conflicts[0].Winner != "filespace" {
		t.Fatalf("push of the older change: %+v", sum)
	}
	if n := node(t, st, "f"); n.SizeBytes != int64(len("v2 from b")) {
		t.Fatalf("the older workspace change overwrote the filespace: %+v", n)
	}
	sum = syncAt(t, a, st, filespace.Pull, t0.Add(12*time.Minute))
	if sum.Pulled != 1 || a.read(t, "f") != "v2 from b" {
		t.Fatalf("pull of the newer filespace version: %+v, f = %q", sum, a.read(t, "f"))
	}

	// Now a changes f after the filespace's last write: a wins both ways.
	b.write(t, "f", "v4 from b", time.Time{})
	syncAt(t, b, st, filespace.Push, t0.Add(20*time.Minute))
	a.write(t, "f", "v5 from a (newer)", t0.Add(25*time.Minute))
	sum = syncAt(t, a, st, filespace.Pull, t0.Add(26*time.Minute))
	if sum.Pulled != 0 || sum.Skipped != 1 || a.read(t, "f") != "v5 from a (newer)" {
		t.Fatalf("pull over a newer workspace change: %+v, f = %q", sum, a.read(t, "f"))
	}
	sum = syncAt(t, a, st, filespace.Push, t0.Add(27*time.Minute))
	if sum.Pushed != 1 {
		t.Fatalf("push of the newer change: %+v", sum)
	}
	syncAt(t, b, st, filespace.Pull, t0.Add(28*time.Minute))
	if got := b.read(t, "f"); got != "v5 from a (newer)" {
		t.Fatalf("b has %q after pulling", got)
	}

	// A change on one side only wins whatever the clocks say: a file
	// copied with an old modification time is still a change.
	b.write(t, "f", "v6 from b, old mtime", t0.Add(-24*time.Hour))
	if sum := syncAt(t, b, st, filespace.Push, t0.Add(30*time.Minute)); sum.Pushed != 1 {
		t.Fatalf("push of a one-sided change with an old mtime: %+v", sum)
	}
}

// TestDeletions propagates a deletion that is newer than the filespace's
// version and keeps the file when the filespace changed it since.
func TestDeletions(t *testing.T) {
	st := openStore(t)
	a, b := newSandbox(t, 0), newSandbox(t, 0)
	t0 := time.Now().Add(-time.Hour)
	a.write(t, "gone", "x", time.Time{})
	a.write(t, "kept", "y", time.Time{})
	syncAt(t, a, st, filespace.Push, t0)
	syncAt(t, b, st, filespace.Pull, t0.Add(time.Minute))

	// Newer deletion: a deletes "gone", nothing else touched it.
	a.remove(t, "gone")
	if sum := syncAt(t, a, st, filespace.Pull, t0.Add(2*time.Minute)); sum.Pulled != 0 || sum.Skipped != 1 || a.read(t, "gone") != "<absent>" {
		t.Fatalf("a pull brought back a file the workspace deleted: %+v", sum)
	}
	sum := syncAt(t, a, st, filespace.Push, t0.Add(3*time.Minute))
	if sum.Deleted != 1 {
		t.Fatalf("push of the deletion: %+v", sum)
	}
	if n := node(t, st, "gone"); !n.Deleted || !n.UpdatedAt.Equal(t0.Add(3*time.Minute).UTC().Truncate(time.Microsecond)) {
		t.Fatalf("tombstone: %+v", n)
	}
	if sum := syncAt(t, b, st, filespace.Pull, t0.Add(4*time.Minute)); sum.Deleted != 1 || b.read(t, "gone") != "<absent>" {
		t.Fatalf("pull of the tombstone: %+v", sum)
	}

	// Older deletion: b rewrites "kept" and pushes; a had deleted it
	// before seeing that, so the deletion must not win.
	b.write(t, "kept", "y2", time.Time{})
	syncAt(t, b, st, filespace.Push, t0.Add(5*time.Minute))
	a.remove(t, "kept")
	sum = syncAt(t, a, st, filespace.Push, t0.Add(6*time.Minute))
	if sum.Deleted != 0 || sum.Skipped != 1 {
		t.Fatalf("push of an older deletion: %+v", sum)
	}
	if n := node(t, st, "kept"); n.Deleted {
		t.Fatalf("an older deletion removed the newer file: %+v", n)
	}
	if sum := syncAt(t, a, st, filespace.Pull, t0.Add(7*time.Minute)); sum.Pulled != 1 || a.read(t, "kept") != "y2" {
		t.Fatalf("pull after an older deletion: %+v", sum)
	}

	// A tombstone older than a workspace write does not delete it: b
	// deleted "kept" and pushed at t0+8m, a rewrote it at t0+9m.
	b.remove(t, "kept")
	syncAt(t, b, st, filespace.Push, t0.Add(8*time.Minute))
	a.write(t, "kept", "y3 after the deletion", t0.Add(9*time.Minute))
	if sum := syncAt(t, a, st, filespace.Pull, t0.Add(10*time.Minute)); sum.Deleted != 0 || a.read(t, "kept") != "y3 after the deletion" {
		t.Fatalf("an older tombstone deleted a newer file: %+v", sum)
	}
	if sum := syncAt(t, a, st, filespace.Push, t0.Add(11*time.Minute)); sum.Pushed != 1 {
		t.Fatalf("push over an older tombstone: %+v", sum)
	}
	if n := node(t, st, "kept"); n.Deleted || n.SizeBytes != int64(len("y3 after the deletion")) {
		t.Fatalf("node after recreating: %+v", n)
	}

	// A tombstone newer than the workspace file deletes it on pull.
	a.remove(t, "kept")
	syncAt(t, a, st, filespace.Push, t0.Add(12*time.Minute))
	b.write(t, "kept", "stale copy", t0.Add(2*time.Minute))
	if sum := syncAt(t, b, st, filespace.Pull, t0.Add(13*time.Minute)); sum.Deleted != 1 || b.read(t, "kept") != "<absent>" {
		t.Fatalf("a newer tombstone kept an older file: %+v", sum)
	}
	// A file the workspace never had is not a deletion.
	c := newSandbox(t, 0)
	if sum := syncAt(t, c, st, filespace.Push, t0.Add(14*time.Minute)); sum.Deleted != 0 {
		t.Fatalf("an empty workspace's push deleted files: %+v", sum)
	}
}

// TestCap refuses to sync a workspace over its cap, and a pull that would
// take it over, without changing anything.
func TestCap(t *testing.T) {
	st := openStore(t)
	a := newSandbox(t, 0)
	t0 := time.Now().Add(-time.Hour)
	a.write(t, "f", string(make([]byte, 3000)), time.Time{})
	_, err := filespace.Sync(context.Background(), a.client, st, filespace.Options{AgentID: agent, Direction: filespace.Push, CapBytes: 2000})
	if !errors.Is(err, filespace.ErrWorkspaceOverCap) {
		t.Fatalf("push over the cap: %v", err)
	}
	t.Log(err)
	if _, err := st.GetFile(context.Background(), agent, "f"); !errors.Is(err, store.ErrNotFound) {
		t.Fatalf("a refused push wrote the filespace: %v", err)
	}
	syncAt(t, a, st, filespace.Push, t0)

	small := newSandbox(t, 0)
	small.write(t, "other", string(make([]byte, 500)), time.Time{})
	_, err = filespace.Sync(context.Background(), small.client, st, filespace.Options{AgentID: agent, Direction: filespace.Pull, CapBytes: 3200})
	if !errors.Is(err, filespace.ErrWorkspaceOverCap) {
		t.Fatalf("pull past the cap: %v", err)
	}
	t.Log(err)
	if small.read(t, "f") != "<absent>" {
		t.Fatal("a refused pull wrote the workspace")
	}
}

// TestPushRefusedWithoutRoom: a push whose new contents the store has no
// room for (here, a SQLite store on a volume that keeps 64 MiB free and has
// 2 MiB more) is refused before any of them is written, with what to do;
// contents the store holds already need no room, and a push of only those
// goes through.
func TestPushRefusedWithoutRoom(t *testing.T) {
	ctx := context.Background()
	free := int64(1 << 30)
	st, err := store.Open(ctx, filepath.Join(t.TempDir(), "agentbox.db"), store.Options{
		VolumeSpace: func(string) (int64, int64, error) { return free, 1 << 30, nil },
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	a := newSandbox(t, 0)
	a.write(t, "small.txt", "hello", time.Time{})
	syncAt(t, a, st, filespace.Push, time.Now().Add(-time.Hour))

	room, err := st.BlobRoom(ctx)
	if err != nil {
		t.Fatal(err)
	}
	free -= room.Bytes - 2<<20
	big := string(bytes.Repeat([]byte("x"), 3<<20))
	a.write(t, "big.bin", big, time.Time{})
	_, err = filespace.Sync(ctx, a.client, st, filespace.Options{AgentID: agent, Direction: filespace.Push})
	if !errors.Is(err, store.ErrStoreFull) || !strings.Contains(err.Error(), "3.0 MiB of new content (in 1 file(s))") ||
		!strings.Contains(err.Error(), "store.persistence.size") {
		t.Fatalf("a push past the store's room: %v, want ErrStoreFull saying what to do", err)
	}
	t.Logf("refused: %v", err)
	if _, err := st.GetFile(ctx, agent, "big.bin"); !errors.Is(err, store.ErrNotFound) {
		t.Fatalf("big.bin in the filespace after the refused push: %v", err)
	}

	// The same content under another name is stored already.
	b := newSandbox(t, 0)
	b.write(t, "again.txt", "hello", time.Time{})
	if sum := syncAt(t, b, st, filespace.Push, time.Now()); sum.Pushed != 1 {
		t.Fatalf("a push of stored content: %+v", sum)
	}
}

// The workspace's platform directory (the cached Python environments)
// travels only with the idle stop's snapshot: a push leaves it out, and a
// node under it in the filespace (written there by other means) is never
// pulled into an environment.
func TestPlatformDirectoryIsNotSynced(t *testing.T) {
	st := openStore(t)
	a, b := newSandbox(t, 0), newSandbox(t, 0)
	t0 := time.Now().Add(-time.Hour)
	a.write(t, "notes.txt", "mine", time.Time{})
	a.write(t, supervisorapi.EnvsDir+"/e.1/lib/site.py", "environment code", time.Time{})
	if sum := syncAt(t, a, st, filespace.Push, t0); sum.Pushed != 1 {
		t.Fatalf("push: %+v, want notes.txt alone", sum)
	}
	if _, err := st.GetFile(context.Background(), agent, supervisorapi.EnvsDir+"/e.1/lib/site.py"); err == nil {
		t.Fatal("the environment's file reached the filespace")
	}

	planted := "import os  # planted\n"
	sum256 := sha256.Sum256([]byte(planted))
	digest := hex.EncodeToString(sum256[:])
	if _, err := st.PutBlob(context.Background(), digest, strings.NewReader(planted)); err != nil {
		t.Fatal(err)
	}
	if _, err := st.PutFile(context.Background(), store.FileNode{AgentID: agent, Path: supervisorapi.EnvsDir + "/e.1/lib/site.py",
		SizeBytes: int64(len(planted)), SHA256: digest, UpdatedAt: t0.Add(time.Minute), Mode: 0o644}); err != nil {
		t.Fatal(err)
	}
	if sum := syncAt(t, b, st, filespace.Pull, t0.Add(2*time.Minute)); sum.Pulled != 1 {
		t.Fatalf("pull: %+v, want notes.txt alone", sum)
	}
	if got := b.read(t, supervisorapi.EnvsDir+"/e.1/lib/site.py"); got != "<absent>" {
		t.Fatalf("pulled into the platform directory: %q", got)
	}
	if got := b.read(t, "notes.txt"); got != "mine" {
		t.Fatalf("notes.txt pulled as %q", got)
	}
}
