// Package loopvol gives the test node's volumes a real size limit: each
// volume is an ext4 filesystem in a sparse image file of the claim's size,
// mounted through a loop device, so that a write past the size fails with
// ENOSPC on the node's kernel, whatever the writer is (a gVisor sandbox's
// gofer passes the host's error through). A plain folder on the host's disk
// has no limit: one sandbox's `dd` could fill the machine's disk.
//
// The images are sparse: a volume costs the host only what is written to
// it. Loop devices are attached with the kernel's autoclear flag (mount's
// `-o loop` sets it), so unmounting a volume's last mount detaches its
// device; Detach and DetachUnder detach by force whatever a crash left
// attached, found by where the backing image lives.
//
// It needs root and the tools of Debian's e2fsprogs (mkfs.ext4, debugfs)
// and mount (mount, umount) packages, which `make testenv` installs.
package loopvol

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// MinSize is the smallest volume made. ext4 with a journal needs a few MiB
// of metadata (a 4 MiB filesystem has under 3 MiB free); 16 MiB leaves a
// small claim, or one that names no size, most of what it is given. Since
// images are sparse, rounding up costs the host nothing until written.
const MinSize = 16 << 20

// Size is the size of the image made for a claim that requests requested
// bytes: the request, or MinSize if that is more. The filesystem's own
// metadata takes a few percent of it, as on a cloud disk of that size.
func Size(requested int64) int64 { return max(requested, MinSize) }

// toolTimeout bounds each mkfs, debugfs, mount and umount: on a sparse
// image they take milliseconds.
const toolTimeout = time.Minute

// Tools are the programs loopvol runs, and the Debian packages they come
// from.
var Tools = map[string]string{"mkfs.ext4": "e2fsprogs", "debugfs": "e2fsprogs", "mount": "mount", "umount": "mount"}

// Check reports what this host lacks to make volumes: loop device support
// in its kernel, or one of Tools.
func Check() error {
	var errs []error
	if _, err := os.Stat("/dev/loop-control"); err != nil {
		errs = append(errs, fmt.Errorf("the kernel offers no loop devices (%w)", err))
	}
	for name, pkg := range Tools {
		if p := tool(name); !filepath.IsAbs(p) {
			errs = append(errs, fmt.Errorf("%s (Debian package %s) is not installed", name, pkg))
		}
	}
	return errors.Join(errs...)
}

// Format makes image a fresh ext4 filesystem of size bytes (at least
// MinSize), its root folder of mode rootMode, with no lost+found: a
// sandbox runs as a non-root user, and a root-only folder in its workspace
// would stop it from reading or archiving the workspace whole. e2fsck makes
// lost+found again if it ever needs one. Whatever was at image is replaced.
//
// No blocks are reserved for root (-m 0): the sandbox's user is not root,
// and reserved blocks would silently shrink its volume by 5%. The inode
// tables and the journal are left for the kernel to initialise lazily, so
// that the image stays sparse and formatting a volume of any size takes
// milliseconds.
func Format(ctx context.Context, image string, size int64, rootMode os.FileMode) error {
	if err := os.Remove(image); err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	f, err := os.OpenFile(image, os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o600)
	if err != nil {
		return err
	}
	err = f.Truncate(Size(size))
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return fmt.Errorf("size image %s: %w", image, err)
	}
	if err := run(ctx, "mkfs.ext4", "-q", "-F", "-m", "0", "-E", "lazy_itable_init=1,lazy_journal_init=1,root_owner=0:0", image); err != nil {
		return err
	}
	// debugfs edits the unmounted image, so the volume is whole before it
	// is ever mounted.
	cmds := fmt.Sprintf("rmdir lost+found\nsif / mode 0%o\n", uint32(syscall.S_IFDIR)|uint32(rootMode.Perm()))
	dctx, cancel := context.WithTimeout(ctx, toolTimeout)
	defer cancel()
	cmd := exec.CommandContext(dctx, tool("debugfs"), "-w", "-f", "-", image)
	cmd.Stdin = strings.NewReader(cmds)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("debugfs %s: %w: %s", image, err, bytes.TrimSpace(stderr.Bytes()))
	}
	// debugfs exits 0 when a request fails; it says so on stderr, after
	// its version banner.
	for _, line := range strings.Split(strings.TrimSpace(stderr.String()), "\n") {
		if line != "" && !debugfsBanner.MatchString(line) {
			return fmt.Errorf("debugfs %s: %s", image, strings.TrimSpace(stderr.String()))
		}
	}
	return nil
}

var debugfsBanner = regexp.MustCompile(`^debugfs [0-9]`)

// Mount mounts the filesystem in image on dir, which it makes if missing,
// through a loop device that the kernel detaches when the last mount of it
// is gone. It is a no-op when dir is already a mount point.
//
// The mount is made in the caller's mount namespace. On the test node
// kubelet, containerd and the provisioners share the host's namespace, whose
// root mount may be private (it is on the machines the tests run on): a
// mount made after a pod's sandbox started would then not reach it. So a volume must be mounted before its PersistentVolume
// exists, hence before any pod can use it.
func Mount(ctx context.Context, image, dir string) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	if m, err := Mounted(dir); err != nil || m {
		return err
	}
	return run(ctx, "mount", "-t", "ext4", "-o", "loop", image, dir)
}

// Unmount unmounts dir if it is a mount point. The loop device goes with
// the last mount of it.
func Unmount(ctx context.Context, dir string) error {
	m, err := Mounted(dir)
	if err != nil || !m {
		return err
	}
	return run(ctx, "umount", dir)
}

// ErrBusy is returned when a loop device stays attached after it was told
// to detach: some mount of its filesystem is still in use, perhaps in
// another mount namespace. The kernel detaches it when that use ends.
var ErrBusy = errors.New("loop device still in use")

// Detach detaches every loop device whose backing file is image, and
// reports ErrBusy for those that stay attached.
func Detach(image string) error {
	_, err := detach(func(backing string) bool { return backing == filepath.Clean(image) })
	return err
}

// DetachUnder detaches every loop device whose backing file is below dir,
// waiting up to wait for busy ones, then reports ErrBusy for those that are
// still attached. It returns the devices it found. Teardown uses it for what
// a crashed provisioner left.
func DetachUnder(dir string, wait time.Duration) ([]Device, error) {
	prefix := strings.TrimSuffix(filepath.Clean(dir), "/") + "/"
	under := func(backing string) bool { return strings.HasPrefix(backing, prefix) }
	deadline := time.Now().Add(wait)
	var found []Device
	for {
		devs, err := detach(under)
		for _, d := range devs {
			if !slices.Contains(found, d) {
				found = append(found, d)
			}
		}
		if !errors.Is(err, ErrBusy) || time.Now().After(deadline) {
			return found, err
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// detach detaches the devices whose backing file matches, and returns
// them.
func detach(match func(backing string) bool) ([]Device, error) {
	devs, err := Devices()
	if err != nil {
		return nil, err
	}
	var errs []error
	var detached []Device
	for _, d := range devs {
		if !match(d.Backing) {
			continue
		}
		// A busy device is only marked to detach when its last user goes
		// (the ioctl still succeeds), hence the check below.
		if err := clearFD(d.Path); err != nil && !errors.Is(err, unix.ENXIO) {
			errs = append(errs, fmt.Errorf("detach %s (%s): %w", d.Path, d.Backing, err))
			continue
		}
		detached = append(detached, d)
	}
	if len(detached) > 0 {
		now, err := Devices()
		if err != nil {
			return detached, err
		}
		for _, d := range detached {
			for _, n := range now {
				if n.Path == d.Path && n.Backing == d.Backing {
					errs = append(errs, fmt.Errorf("%s (%s): %w", d.Path, d.Backing, ErrBusy))
				}
			}
		}
	}
	return detached, errors.Join(errs...)
}

func clearFD(dev string) error {
	f, err := os.OpenFile(dev, os.O_RDONLY, 0)
	if err != nil {
		return err
	}
	defer f.Close()
	return unix.IoctlSetInt(int(f.Fd()), unix.LOOP_CLR_FD, 0)
}

// Device is an attached loop device.
type Device struct {
	// Path is the device node, /dev/loopN.
	Path string
	// Backing is the path of its backing file, as the kernel reports it,
	// without the " (deleted)" the kernel adds once the file is removed.
	Backing string
}

// Devices lists the attached loop devices, read from sysfs.
func Devices() ([]Device, error) {
	names, err := filepath.Glob("/sys/block/loop*/loop/backing_file")
	if err != nil {
		return nil, err
	}
	var devs []Device
	for _, n := range names {
		b, err := os.ReadFile(n)
		if err != nil {
			// Detached between the glob and the read.
			continue
		}
		backing := strings.TrimSuffix(strings.TrimRight(string(b), "\n"), " (deleted)")
		dev := filepath.Base(filepath.Dir(filepath.Dir(n)))
		devs = append(devs, Device{Path: "/dev/" + dev, Backing: backing})
	}
	return devs, nil
}

// Mounted reports whether path is a mount point in the caller's mount
// namespace. A bind mount of a folder on the same filesystem keeps its
// device number, so mountinfo is the only record.
func Mounted(path string) (bool, error) {
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return false, err
	}
	defer f.Close()
	path = filepath.Clean(path)
	s := bufio.NewScanner(f)
	for s.Scan() {
		if fields := strings.Fields(s.Text()); len(fields) > 4 && UnescapeMount(fields[4]) == path {
			return true, nil
		}
	}
	return false, s.Err()
}

// UnescapeMount undoes the octal escapes mountinfo uses for spaces, tabs,
// newlines and backslashes.
func UnescapeMount(s string) string {
	return strings.NewReplacer(`\040`, " ", `\011`, "\t", `\012`, "\n", `\134`, `\`).Replace(s)
}

func run(ctx context.Context, name string, args ...string) error {
	ctx, cancel := context.WithTimeout(ctx, toolTimeout)
	defer cancel()
	out, err := exec.CommandContext(ctx, tool(name), args...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("%s %s: %w: %s", name, strings.Join(args, " "), err, bytes.TrimSpace(out))
	}
	return nil
}

// tool finds a system tool also when PATH lacks the sbin folders, as a
// non-login root shell's PATH may.
func tool(name string) string {
	if p, err := exec.LookPath(name); err == nil {
		return p
	}
	for _, dir := range []string{"/usr/sbin", "/sbin", "/usr/bin", "/bin"} {
		if p := filepath.Join(dir, name); fileExists(p) {
			return p
		}
	}
	return name
}

func fileExists(p string) bool { _, err := os.Stat(p); return err == nil }
