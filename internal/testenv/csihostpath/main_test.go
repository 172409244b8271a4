package main

import (
	"bytes"
	"context"
	"crypto/rand"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
)

// TestSnapshotRoundTrip drives the driver over its CSI socket as the
// sidecars do: a volume, a snapshot of it, a volume restored from the
// snapshot, and the deletes; the restored volume must hold the same bytes,
// modes and symlink. Publishing (a bind mount) needs root and is left to the
// cluster tests.
func TestSnapshotRoundTrip(t *testing.T) {
	dir := t.TempDir()
	sock := filepath.Join(dir, "csi.sock")
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		done <- run(ctx, sock, "", filepath.Join(dir, "data"), "test.csi.agentbox.test", "node-0", slog.New(slog.NewTextHandler(io.Discard, nil)))
	}()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("run: %v", err)
		}
	})
	conn, err := grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	ids, ctl := csi.NewIdentityClient(conn), csi.NewControllerClient(conn)
	cctx, ccancel := context.WithTimeout(ctx, time.Minute)
	defer ccancel()
	waitReady(cctx, t, ids)

	caps := []*csi.VolumeCapability{{AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{}},
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER}}}
	const size = 1 << 30
	vol, err := ctl.CreateVolume(cctx, &csi.CreateVolumeRequest{Name: "pvc-1", VolumeCapabilities: caps, CapacityRange: &csi.CapacityRange{RequiredBytes: size}})
	if err != nil {
		t.Fatal(err)
	}
	src := filepath.Join(dir, "data", "volumes", vol.GetVolume().GetVolumeId())
	blob := make([]byte, 1<<20)
	_, _ = rand.Read(blob)
	must(t, os.MkdirAll(filepath.Join(src, "notes"), 0o755))
	must(t, os.WriteFile(filepath.Join(src, "blob"), blob, 0o644))
	must(t, os.WriteFile(filepath.Join(src, "notes", "a.txt"), []byte("first words\n"), 0o600))
	must(t, os.Symlink("notes/a.txt", filepath.Join(src, "link")))

	snap, err := ctl.CreateSnapshot(cctx, &csi.CreateSnapshotRequest{Name: "snapshot-1", SourceVolumeId: vol.GetVolume().GetVolumeId()})
	if err != nil {
		t.Fatal(err)
	}
	if s := snap.GetSnapshot(); !s.GetReadyToUse() || s.GetSizeBytes() != size || s.GetSourceVolumeId() != "pvc-1" {
		t.Errorf("snapshot = %+v; want ready, of pvc-1, the size of its volume", s)
	}
	// A retry of the same request, as csi-snapshotter makes after a lost
	// answer, gets the same snapshot.
	again, err := ctl.CreateSnapshot(cctx, &csi.CreateSnapshotRequest{Name: "snapshot-1", SourceVolumeId: "pvc-1"})
	if err != nil || !again.GetSnapshot().GetCreationTime().AsTime().Equal(snap.GetSnapshot().GetCreationTime().AsTime()) {
		t.Errorf("second CreateSnapshot = %v, %v; want the first snapshot", again, err)
	}
	// Changes after the snapshot are not in it.
	must(t, os.WriteFile(filepath.Join(src, "later"), []byte("later"), 0o644))

	source := &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Snapshot{Snapshot: &csi.VolumeContentSource_SnapshotSource{SnapshotId: snap.GetSnapshot().GetSnapshotId()}}}
	restored, err := ctl.CreateVolume(cctx, &csi.CreateVolumeRequest{Name: "pvc-2", VolumeCapabilities: caps,
		CapacityRange: &csi.CapacityRange{RequiredBytes: size}, VolumeContentSource: source})
	if err != nil {
		t.Fatal(err)
	}
	if restored.GetVolume().GetContentSource().GetSnapshot().GetSnapshotId() != "snapshot-1" {
		t.Errorf("restored volume's content source = %v", restored.GetVolume().GetContentSource())
	}
	dst := filepath.Join(dir, "data", "volumes", restored.GetVolume().GetVolumeId())
	if got, err := os.ReadFile(filepath.Join(dst, "blob")); err != nil || !bytes.Equal(got, blob) {
		t.Errorf("restored blob differs (read: %v)", err)
	}
	if fi, err := os.Stat(filepath.Join(dst, "notes", "a.txt")); err != nil || fi.Mode().Perm() != 0o600 {
		t.Errorf("restored notes/a.txt: %v, %v; want mode 0600", fi, err)
	}
	if target, err := os.Readlink(filepath.Join(dst, "link")); err != nil || target != "notes/a.txt" {
		t.Errorf("restored link -> %q, %v", target, err)
	}
	if _, err := os.Stat(filepath.Join(dst, "later")); !os.IsNotExist(err) {
		t.Errorf("a file written after the snapshot was restored (stat: %v)", err)
	}

	_, err = ctl.CreateVolume(cctx, &csi.CreateVolumeRequest{Name: "pvc-3", VolumeCapabilities: caps,
		VolumeContentSource: &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Snapshot{Snapshot: &csi.VolumeContentSource_SnapshotSource{SnapshotId: "snapshot-missing"}}}})
	if status.Code(err) != codes.NotFound {
		t.Errorf("restore from a missing snapshot: %v, want NotFound", err)
	}
	for _, bad := range []string{".", "..", "../x", "a/b", ""} {
		if _, err := ctl.DeleteVolume(cctx, &csi.DeleteVolumeRequest{VolumeId: bad}); status.Code(err) != codes.InvalidArgument {
			t.Errorf("DeleteVolume(%q): %v, want InvalidArgument", bad, err)
		}
	}

	if _, err := ctl.DeleteSnapshot(cctx, &csi.DeleteSnapshotRequest{SnapshotId: "snapshot-1"}); err != nil {
		t.Fatal(err)
	}
	for _, id := range []string{"pvc-1", "pvc-2"} {
		if _, err := ctl.DeleteVolume(cctx, &csi.DeleteVolumeRequest{VolumeId: id}); err != nil {
			t.Fatal(err)
		}
	}
	for _, sub := range []string{"volumes", "snapshots", "volume-meta", "tmp"} {
		if entries, _ := os.ReadDir(filepath.Join(dir, "data", sub)); len(entries) > 0 {
			t.Errorf("%s not empty after the deletes: %v", sub, entries)
		}
	}
}

func waitReady(ctx context.Context, t *testing.T, ids csi.IdentityClient) {
	t.Helper()
	for {
		_, err := ids.Probe(ctx, &csi.ProbeRequest{})
		if err == nil {
			return
		}
		select {
		case <-ctx.Done():
			t.Fatalf("the driver never answered Probe: %v", err)
		case <-time.After(20 * time.Millisecond):
		}
	}
}

func must(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}
