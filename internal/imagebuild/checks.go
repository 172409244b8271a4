package imagebuild

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/agentbox/terraform-provider-agentbox/internal/ociimage"
)

// check runs a program of an image in a chroot of its root filesystem when
// the image holds the package the program comes from: nothing runs a
// maintainer script here, so a tool that cannot start (a missing library,
// an alternative never made) fails the build instead of an agent's first
// call.
type check struct {
	pkg string
	run func(c *chroot) (string, error)
}

// expect runs args and wants want in their output.
func expect(want string, args ...string) func(c *chroot) (string, error) {
	return func(c *chroot) (string, error) { return c.expect(want, args...) }
}

var checks = []check{
	{"python3", func(c *chroot) (string, error) { return pythonVersion(c) }},
	// The supervisor's environment cache needs venv with ensurepip,
	// which Debian ships apart from python3, and the pip wheel it
	// installs.
	{"python3-venv", expect("ok", "python3", "-c", "import venv, ensurepip; ensurepip.version(); print('ok')")},
	{"python3-pip", expect("pip ", "pip", "--version")},
	{"python-is-python3", expect("Python 3", "python", "--version")},
	{"bash", expect("ok", "bash", "-c", "echo ok")},
	{"dash", expect("ok", "/bin/sh", "-c", "echo ok")},
	{"coreutils", expect("ok", "echo", "ok")},
	{"findutils", expect("/", "find", "/", "-maxdepth", "0")},
	{"grep", expect("GNU grep", "grep", "--version")},
	{"sed", expect("GNU sed", "sed", "--version")},
	{"gawk", expect("ok", "gawk", "BEGIN { print \"ok\" }")},
	{"diffutils", expect("GNU diffutils", "diff", "--version")},
	{"patch", expect("GNU patch", "patch", "--version")},
	{"less", expect("less ", "less", "--version")},
	// ps itself wants /proc, which the chroot lacks; pgrep loads the same
	// library.
	{"procps", expect("procps-ng", "pgrep", "--version")},
	{"curl", expect("curl ", "curl", "--version")},
	{"git", expect("git version", "git", "--version")},
	{"openssh-client", expect("OpenSSH", "ssh", "-V")},
	{"jq", expect("jq-", "jq", "--version")},
	{"unzip", expect("UnZip", "unzip", "-v")},
	{"zip", expect("Zip", "zip", "-v")},
	{"xz-utils", expect("xz (XZ Utils)", "xz", "--version")},
	{"tar", expect("GNU tar", "tar", "--version")},
	{"gzip", expect("gzip", "gzip", "--version")},
	{"libc-bin", expect("root", "getent", "passwd", "0")},
	{"make", expect("GNU Make", "make", "--version")},
	{"gcc", compiles},
	{"python3-dev", buildsExtension},
	{"nodejs", expect("ok", "node", "-e", "console.log('ok')")},
	{"busybox", expect("ok", "busybox", "echo", "ok")},
	// The database writeDpkgDatabase made: dpkg reads it, and apt finds
	// every installed package's dependencies installed, without which it
	// would refuse to install anything in an image built FROM this one.
	{"dpkg", expect("install ok installed", "dpkg-query", "-W", "-f", "${Status}", "dpkg")},
	// Without its caches, which it would otherwise write into the image.
	{"apt", expect("", "apt-get", "check", "-q", "-o", "Dir::Cache::pkgcache=", "-o", "Dir::Cache::srcpkgcache=")},
}

// compiles builds and runs a C program, as make and pip do. (The cc
// they call is one of the base's links, which are checked to resolve.)
func compiles(c *chroot) (string, error) {
	if err := c.write("hello.c", "#include <stdio.h>\nint main(void) { puts(\"hello\"); return 0; }\n"); err != nil {
		return "", err
	}
	if _, err := c.expect("", "gcc", "-o", c.path("hello"), c.path("hello.c")); err != nil {
		return "", err
	}
	return c.expect("hello", c.path("hello"))
}

// buildsExtension compiles a C extension against Python's headers, what
// pip does for a wheel that is not prebuilt.
func buildsExtension(c *chroot) (string, error) {
	inc, err := c.expect("", "python3", "-c", "import sysconfig; print(sysconfig.get_paths()['include'])")
	if err != nil {
		return "", err
	}
	if err := c.write("ext.c", "#include <Python.h>\nstatic struct PyModuleDef m = {PyModuleDef_HEAD_INIT, \"ext\"};\n"+
		"PyMODINIT_FUNC PyInit_ext(void) { return PyModule_Create(&m); }\n"); err != nil {
		return "", err
	}
	return c.expect("", "gcc", "-shared", "-fPIC", "-I"+strings.TrimSpace(inc), "-o", c.path("ext.so"), c.path("ext.c"))
}

func pythonVersion(c *chroot) (string, error) {
	v, err := c.expect("3.", "python3", "-c", "import json, platform, ssl, sqlite3; print(platform.python_version())")
	return strings.TrimSpace(v), err
}

// PythonVersion runs the rootfs's python3 under chroot, which needs root,
// and checks that the standard library's json, ssl and sqlite3 import.
func PythonVersion(ctx context.Context, rootfs string) (string, error) {
	c, err := newChroot(ctx, rootfs)
	if err != nil {
		return "", err
	}
	defer c.close()
	return pythonVersion(c)
}

// CheckRootfs runs the checks of the packages an image holds, in a chroot
// of rootfs (which needs root), and returns the Python version when the
// image has Python. What the checks write goes into a folder of /tmp that
// is removed afterwards, so the image is as unpacked.
func CheckRootfs(ctx context.Context, rootfs string, packages []string, logf func(string, ...any)) (python string, err error) {
	c, err := newChroot(ctx, rootfs)
	if err != nil {
		return "", err
	}
	defer c.close()
	var ran []string
	for _, ch := range checks {
		if !slices.Contains(packages, ch.pkg) {
			continue
		}
		out, err := ch.run(c)
		if err != nil {
			return "", fmt.Errorf("check of package %s in the image failed: %w", ch.pkg, err)
		}
		if ch.pkg == "python3" {
			python = out
		}
		ran = append(ran, ch.pkg)
	}
	if logf != nil {
		logf("%d programs ran in a chroot of the image: %s", len(ran), strings.Join(ran, " "))
	}
	return python, nil
}

// chroot runs programs in a root filesystem, with a scratch folder in its
// /tmp for what they write and a /dev/null (git, for one, opens it at
// start), both removed again by close.
type chroot struct {
	ctx     context.Context
	root    string
	tmp     string // inside the image
	made    []string
	madeDev bool
}

func newChroot(ctx context.Context, root string) (_ *chroot, err error) {
	// Absolute: the programs run from the host's /.
	root, err = filepath.Abs(root)
	if err != nil {
		return nil, err
	}
	c := &chroot{ctx: ctx, root: root}
	defer func() {
		if err != nil {
			c.close()
		}
	}()
	if err := os.MkdirAll(filepath.Join(root, "tmp"), 0o755); err != nil {
		return nil, err
	}
	dir, err := os.MkdirTemp(filepath.Join(root, "tmp"), ".agentbox-check-")
	if err != nil {
		return nil, err
	}
	c.made = append(c.made, dir)
	c.tmp = "/tmp/" + filepath.Base(dir)
	dev := filepath.Join(root, "dev")
	if _, err := os.Lstat(dev); errors.Is(err, fs.ErrNotExist) {
		if err := os.Mkdir(dev, 0o755); err != nil {
			return nil, err
		}
		c.madeDev = true
	}
	null := filepath.Join(dev, "null")
	if _, err := os.Lstat(null); errors.Is(err, fs.ErrNotExist) {
		if err := unix.Mknod(null, unix.S_IFCHR|0o666, int(unix.Mkdev(1, 3))); err != nil {
			return nil, fmt.Errorf("making /dev/null for the image's checks: %w", err)
		}
		c.made = append(c.made, null)
		if err := os.Chmod(null, 0o666); err != nil {
			return nil, err
		}
	}
	return c, nil
}

func (c *chroot) close() {
	for _, p := range c.made {
		os.RemoveAll(p)
	}
	if c.madeDev {
		os.Remove(filepath.Join(c.root, "dev"))
	}
}

func (c *chroot) path(name string) string { return c.tmp + "/" + name }

func (c *chroot) write(name, content string) error {
	return os.WriteFile(filepath.Join(c.root, c.tmp, name), []byte(content), 0o644)
}

// expect runs args and returns their output, which must contain want.
func (c *chroot) expect(want string, args ...string) (string, error) {
	cmd := exec.CommandContext(c.ctx, "chroot", append([]string{c.root}, args...)...)
	cmd.Dir = "/"
	// A clean environment: the host's variables mean nothing in the
	// chroot. HOME is the scratch folder, for tools that write there.
	cmd.Env = []string{ociimage.DefaultPath, "LANG=C.UTF-8", "PYTHONDONTWRITEBYTECODE=1", "HOME=" + c.tmp, "TMPDIR=" + c.tmp}
	out, err := cmd.CombinedOutput()
	text := strings.TrimSpace(string(out))
	if err != nil {
		return "", fmt.Errorf("%s: %w: %s", strings.Join(args, " "), err, text)
	}
	if !strings.Contains(text, want) {
		return "", fmt.Errorf("%s: printed %q, no %q", strings.Join(args, " "), text, want)
	}
	return text, nil
}
