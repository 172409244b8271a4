package main

import (
	"bytes"
	"context"
	"crypto/rand"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/agentbox/terraform-provider-agentbox/internal/testenv/loopvol"
)

// TestSnapshotRoundTrip drives the driver over its CSI socket as the
// sidecars do: a volume, a snapshot of it, a volume restored from the
// snapshot, and the deletes; the restored volume must hold the same bytes,
// modes and symlink. Each volume is a filesystem of its size, and the
// deletes leave no mount, loop device or image. Publishing (a bind mount)
// is left to the cluster tests.
func TestSnapshotRoundTrip(t *testing.T) {
	if os.Geteuid() != 0 {
		if os.Getenv("CI") != "" {
			t.Fatal("volumes are loop-mounted filesystems, which needs root, and CI runs as root on these machines")
		}
		t.Skip("volumes are loop-mounted filesystems, which needs root")
	}
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
	if got := vol.GetVolume().GetCapacityBytes(); got != size {
		t.Errorf("capacity = %d, want %d", got, size)
	}
	src := filepath.Join(dir, "data", "volumes", vol.GetVolume().GetVolumeId())
	var fs syscall.Statfs_t
	if err := syscall.Statfs(src, &fs); err != nil {
		t.Fatal(err)
	}
	if total := int64(fs.Blocks) * fs.Bsize; total > size || total < size*9/10 {
		t.Errorf("the volume's filesystem holds %d bytes; want its size, %d, less the filesystem's metadata", total, size)
	}
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
	for _, sub := range []string{"volumes", "images", "snapshots", "volume-meta", "tmp"} {
		if entries, _ := os.ReadDir(filepath.Join(dir, "data", sub)); len(entries) > 0 {
			t.Errorf("%s not empty after the deletes: %v", sub, entries)
		}
	}
	if mi, _ := os.ReadFile("/proc/self/mountinfo"); bytes.Contains(mi, []byte(dir+"/")) {
		t.Errorf("mounts left below %s:\n%s", dir, mi)
	}
	devs, err := loopvol.Devices()
	if err != nil {
		t.Fatal(err)
	}
	for _, d := range devs {
		if strings.HasPrefix(d.Backing, dir+"/") {
			t.Errorf("loop device %s of %s left attached", d.Path, d.Backing)
		}
	}
}

// TestSmallVolume checks that a volume asked for less than loopvol.MinSize,
// or for no size, gets MinSize, and reports it.
func TestSmallVolume(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("volumes are loop-mounted filesystems, which needs root")
	}
	dir := t.TempDir()
	d := &driver{name: "test", node: "node-0", dir: dir, vols: filepath.Join(dir, "volumes"), images: filepath.Join(dir, "images"),
		snaps: filepath.Join(dir, "snapshots"), log: slog.New(slog.NewTextHandler(io.Discard, nil))}
	for _, p := range []string{d.vols, d.images, d.snaps, d.metaDir(), d.tmpDir()} {
		must(t, os.MkdirAll(p, 0o755))
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	for _, c := range []struct {
		id  string
		req *csi.CapacityRange
	}{{"tiny", &csi.CapacityRange{RequiredBytes: 1 << 20}}, {"unsized", nil}} {
		resp, err := d.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: c.id, CapacityRange: c.req})
		if err != nil {
			t.Fatal(err)
		}
		if got := resp.GetVolume().GetCapacityBytes(); got != loopvol.MinSize {
			t.Errorf("%s: capacity %d, want %d", c.id, got, loopvol.MinSize)
		}
		var fs syscall.Statfs_t
		must(t, syscall.Statfs(d.volPath(c.id), &fs))
		if total := int64(fs.Blocks) * fs.Bsize; total > loopvol.MinSize || total < loopvol.MinSize/2 {
			t.Errorf("%s: filesystem of %d bytes, want about %d", c.id, total, loopvol.MinSize)
		}
		if _, err := d.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: c.id}); err != nil {
			t.Fatal(err)
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
