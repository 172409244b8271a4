package loopvol_test

import (
	"bytes"
	"context"
	"errors"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/agentbox/terraform-provider-agentbox/internal/testenv/loopvol"
)

func requireRoot(t *testing.T) {
	t.Helper()
	if os.Geteuid() != 0 {
		if os.Getenv("CI") != "" {
			t.Fatal("loop devices need root, and CI runs as root on these machines")
		}
		t.Skip("loop devices need root")
	}
}

// TestVolumeLimit formats a volume, fills it past its size, and checks the
// write fails with ENOSPC while the file written before stays whole; then
// that unmounting detaches the loop device.
func TestVolumeLimit(t *testing.T) {
	requireRoot(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	dir := t.TempDir()
	image, mnt := filepath.Join(dir, "vol.img"), filepath.Join(dir, "vol")
	const size = 32 << 20
	start := time.Now()
	if err := loopvol.Format(ctx, image, size, 0o777); err != nil {
		t.Fatal(err)
	}
	t.Logf("formatted a %d MiB volume in %s", size>>20, time.Since(start).Round(time.Millisecond))
	var st syscall.Stat_t
	if err := syscall.Stat(image, &st); err != nil {
		t.Fatal(err)
	}
	if st.Size != size || st.Blocks*512 > size/4 {
		t.Errorf("image is %d bytes with %d allocated; want %d bytes, sparse", st.Size, st.Blocks*512, size)
	}
	if err := loopvol.Mount(ctx, image, mnt); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = loopvol.Unmount(context.Background(), mnt) })
	// Mounting again is a no-op, as a provisioner's retry needs.
	if err := loopvol.Mount(ctx, image, mnt); err != nil {
		t.Fatalf("second mount: %v", err)
	}
	if n := countMounts(t, mnt); n != 1 {
		t.Fatalf("%s is mounted %d times, want once", mnt, n)
	}
	devs := devicesOf(t, image)
	if len(devs) != 1 {
		t.Fatalf("loop devices of %s: %v, want one", image, devs)
	}
	fi, err := os.Stat(mnt)
	if err != nil {
		t.Fatal(err)
	}
	if fi.Mode().Perm() != 0o777 {
		t.Errorf("root of the volume has mode %v, want 0777", fi.Mode().Perm())
	}
	if entries, _ := os.ReadDir(mnt); len(entries) != 0 {
		t.Errorf("a fresh volume holds %v, want nothing (no lost+found)", entries)
	}
	var fs syscall.Statfs_t
	if err := syscall.Statfs(mnt, &fs); err != nil {
		t.Fatal(err)
	}
	total, free := int64(fs.Blocks)*fs.Bsize, int64(fs.Bavail)*fs.Bsize
	t.Logf("statfs: %d bytes, %d free to a non-root user", total, free)
	if total > size || total < size/2 {
		t.Errorf("statfs: %d bytes; want the volume's size less the filesystem's metadata (size %d)", total, size)
	}
	// ext4 holds back up to 2% for its own metadata from everyone; what
	// mkfs reserves for root alone would be lost to a non-root sandbox.
	if out, err := exec.CommandContext(ctx, "dumpe2fs", "-h", image).CombinedOutput(); err != nil {
		t.Errorf("dumpe2fs: %v: %s", err, out)
	} else if !regexp.MustCompile(`(?m)^Reserved block count:\s+0$`).Match(out) {
		t.Errorf("the filesystem reserves blocks for root:\n%s", out)
	}

	kept := bytes.Repeat([]byte("kept\n"), 1000)
	if err := os.WriteFile(filepath.Join(mnt, "kept"), kept, 0o644); err != nil {
		t.Fatal(err)
	}
	f, err := os.Create(filepath.Join(mnt, "big"))
	if err != nil {
		t.Fatal(err)
	}
	n, err := io.Copy(f, io.LimitReader(zeros{}, 2*size))
	if err == nil {
		err = f.Sync()
	}
	f.Close()
	if !errors.Is(err, syscall.ENOSPC) {
		t.Fatalf("writing %d bytes into a %d-byte volume: wrote %d, error %v; want ENOSPC", 2*size, size, n, err)
	}
	t.Logf("write stopped after %d bytes: %v", n, err)
	if got, err := os.ReadFile(filepath.Join(mnt, "kept")); err != nil || !bytes.Equal(got, kept) {
		t.Errorf("the file written before is not intact after the volume filled (read: %v)", err)
	}

	if err := loopvol.Unmount(ctx, mnt); err != nil {
		t.Fatal(err)
	}
	if countMounts(t, mnt) != 0 {
		t.Errorf("%s still mounted", mnt)
	}
	if devs := devicesOf(t, image); len(devs) != 0 {
		t.Errorf("loop devices %v still attached after the volume's last unmount", devs)
	}
	// The data survives a remount: the image is the volume.
	if err := loopvol.Mount(ctx, image, mnt); err != nil {
		t.Fatal(err)
	}
	if got, err := os.ReadFile(filepath.Join(mnt, "kept")); err != nil || !bytes.Equal(got, kept) {
		t.Errorf("the file is not intact after a remount (read: %v)", err)
	}
	if err := loopvol.Unmount(ctx, mnt); err != nil {
		t.Fatal(err)
	}
}

// TestDetachUnder attaches loop devices the way a crash could leave them
// (no autoclear, no mount) and checks that DetachUnder detaches those below
// its folder, also once their images are removed, and no other.
func TestDetachUnder(t *testing.T) {
	requireRoot(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	dir, other := t.TempDir(), t.TempDir()
	var images []string
	for i, d := range []string{dir, filepath.Join(dir, "sub"), dir, other} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
		img := filepath.Join(d, "leftover"+string(rune('a'+i))+".img")
		if err := loopvol.Format(ctx, img, 0, 0o755); err != nil {
			t.Fatal(err)
		}
		out, err := exec.CommandContext(ctx, "losetup", "--find", "--show", img).CombinedOutput()
		if err != nil {
			t.Fatalf("losetup %s: %v: %s", img, err, out)
		}
		dev := strings.TrimSpace(string(out))
		t.Cleanup(func() { _ = exec.Command("losetup", "-d", dev).Run() })
		images = append(images, img)
	}
	// The third image is gone already: the kernel then names it "(deleted)".
	if err := os.Remove(images[2]); err != nil {
		t.Fatal(err)
	}
	found, err := loopvol.DetachUnder(dir, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if len(found) != 3 {
		t.Errorf("DetachUnder found %v, want the three devices below %s", found, dir)
	}
	for _, img := range images[:3] {
		if devs := devicesOf(t, img); len(devs) != 0 {
			t.Errorf("%s still attached as %v", img, devs)
		}
	}
	if devs := devicesOf(t, images[3]); len(devs) != 1 {
		t.Errorf("the image outside the folder has devices %v; want its one device left alone", devs)
	}
	if err := loopvol.Detach(images[3]); err != nil {
		t.Fatal(err)
	}
	if devs := devicesOf(t, images[3]); len(devs) != 0 {
		t.Errorf("%s still attached as %v after Detach", images[3], devs)
	}
}

// TestDetachBusy checks that a loop device whose filesystem is still
// mounted is reported busy, not silently left behind.
func TestDetachBusy(t *testing.T) {
	requireRoot(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	dir := t.TempDir()
	image, mnt := filepath.Join(dir, "vol.img"), filepath.Join(dir, "vol")
	if err := loopvol.Format(ctx, image, 0, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := loopvol.Mount(ctx, image, mnt); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = loopvol.Unmount(context.Background(), mnt) })
	if err := loopvol.Detach(image); !errors.Is(err, loopvol.ErrBusy) {
		t.Fatalf("Detach of a mounted volume's device: %v, want ErrBusy", err)
	}
	// The device was marked to go with its last user.
	if err := loopvol.Unmount(ctx, mnt); err != nil {
		t.Fatal(err)
	}
	if devs := devicesOf(t, image); len(devs) != 0 {
		t.Errorf("%v still attached after the unmount", devs)
	}
}

func TestSize(t *testing.T) {
	for _, c := range []struct{ req, want int64 }{
		{0, loopvol.MinSize},
		{1 << 20, loopvol.MinSize},
		{loopvol.MinSize, loopvol.MinSize},
		{2 << 30, 2 << 30},
	} {
		if got := loopvol.Size(c.req); got != c.want {
			t.Errorf("Size(%d) = %d, want %d", c.req, got, c.want)
		}
	}
}

type zeros struct{}

func (zeros) Read(p []byte) (int, error) {
	clear(p)
	return len(p), nil
}

func countMounts(t *testing.T, path string) int {
	t.Helper()
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, line := range strings.Split(string(b), "\n") {
		if f := strings.Fields(line); len(f) > 4 && loopvol.UnescapeMount(f[4]) == path {
			n++
		}
	}
	return n
}

func devicesOf(t *testing.T, image string) []string {
	t.Helper()
	devs, err := loopvol.Devices()
	if err != nil {
		t.Fatal(err)
	}
	var paths []string
	for _, d := range devs {
		if d.Backing == image {
			paths = append(paths, d.Path)
		}
	}
	return paths
}
