package imagebuild

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strings"

	v1 "github.com/google/go-containerregistry/pkg/v1"

	"github.com/agentbox/terraform-provider-agentbox/internal/ociimage"
)

// HostCABundle is Debian's bundle of the Mozilla CA list (package
// ca-certificates), the file Go's crypto/x509 and OpenSSL read first.
const HostCABundle = "/etc/ssl/certs/ca-certificates.crt"

// NonRootUID is the user every agentbox container runs as; 65532 is the
// "nonroot" user of distroless images, so policies written for those fit.
const NonRootUID = 65532

// StaticImage describes an image holding one static binary and nothing
// else but what a Go server needs from the file system.
type StaticImage struct {
	Ref    string
	Name   string // the binary's name, installed as /usr/local/bin/<Name>
	Binary string // path of the static binary on the host
	// CABundle defaults to HostCABundle.
	CABundle string
	Labels   map[string]string
	// Extra are further executables the image holds.
	Extra []ExtraFile
}

// ExtraFile is an executable copied into an image.
type ExtraFile struct {
	Path string // absolute path in the image
	From string // path on the host
}

// Write builds the image into the OCI archive out.
func (s StaticImage) Write(out string) (v1.Hash, error) {
	dir, err := os.MkdirTemp(filepath.Dir(out), ".rootfs-"+s.Name+"-")
	if err != nil {
		return v1.Hash{}, err
	}
	defer os.RemoveAll(dir)
	if err := StaticRootfs(dir, s.Name, s.Binary, s.CABundle); err != nil {
		return v1.Hash{}, err
	}
	for _, f := range s.Extra {
		if err := copyFile(f.From, filepath.Join(dir, filepath.FromSlash(f.Path)), 0o755); err != nil {
			return v1.Hash{}, err
		}
	}
	return ociimage.WriteArchive(ociimage.Image{
		Ref:        s.Ref,
		Rootfs:     dir,
		Entrypoint: []string{"/usr/local/bin/" + s.Name},
		User:       fmt.Sprintf("%d:%d", NonRootUID, NonRootUID),
		Labels:     s.Labels,
	}, out)
}

// StaticRootfs lays out dir for a static binary: the binary, the CA bundle
// (for TLS to the API server and beyond), a passwd and group naming user
// 65532 (so tools and libraries asking "who am I" get an answer) and a
// world-writable /tmp.
func StaticRootfs(dir, name, binary, caBundle string) error {
	if caBundle == "" {
		caBundle = HostCABundle
	}
	files := []struct {
		path    string
		mode    fs.FileMode
		content string
		from    string
	}{
		{path: "usr/local/bin/" + name, mode: 0o755, from: binary},
		{path: "etc/ssl/certs/ca-certificates.crt", mode: 0o644, from: caBundle},
		{path: "etc/passwd", mode: 0o644, content: "root:x:0:0:root:/root:/sbin/nologin\n" +
			"nobody:x:65534:65534:nobody:/nonexistent:/sbin/nologin\n" +
			"nonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin\n"},
		{path: "etc/group", mode: 0o644, content: "root:x:0:\nnogroup:x:65534:\nnonroot:x:65532:\n"},
	}
	for _, f := range files {
		var err error
		if f.from != "" {
			err = copyFile(f.from, filepath.Join(dir, f.path), f.mode)
		} else {
			err = writeFile(filepath.Join(dir, f.path), f.content, f.mode)
		}
		if err != nil {
			if f.from == caBundle && errors.Is(err, fs.ErrNotExist) {
				return fmt.Errorf("%s not found: install Debian's ca-certificates package (apt-get install ca-certificates): %w", caBundle, err)
			}
			return err
		}
	}
	if err := mkdirMode(filepath.Join(dir, "tmp"), 0o777|fs.ModeSticky); err != nil {
		return err
	}
	return ownedDir(filepath.Join(dir, "home", "nonroot"), 0o700)
}

// SandboxFiles adds to a Debian root filesystem what makes it the sandbox:
// the supervisor, the sandbox user with /workspace as home, /tmp, and the
// host's CA bundle where OpenSSL (and so Python's ssl) looks by default, so
// HTTPS through the egress proxy verifies without the ca-certificates
// package and the perl-based tooling it drags in.
func SandboxFiles(dir, supervisor, caBundle string) error {
	if caBundle == "" {
		caBundle = HostCABundle
	}
	if err := copyFile(supervisor, filepath.Join(dir, "usr/local/bin/agentbox-supervisor"), 0o755); err != nil {
		return err
	}
	if err := copyFile(caBundle, filepath.Join(dir, "etc/ssl/certs/ca-certificates.crt"), 0o644); err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return fmt.Errorf("%s not found: install Debian's ca-certificates package (apt-get install ca-certificates): %w", caBundle, err)
		}
		return err
	}
	// The links the openssl package would make; libssl3 alone does not.
	for link, target := range map[string]string{
		"usr/lib/ssl/cert.pem": "/etc/ssl/certs/ca-certificates.crt",
		"usr/lib/ssl/certs":    "/etc/ssl/certs",
	} {
		p := filepath.Join(dir, link)
		if _, err := os.Lstat(p); err == nil {
			continue
		}
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			return err
		}
		if err := os.Symlink(target, p); err != nil {
			return err
		}
	}
	if err := writeFile(filepath.Join(dir, "etc/passwd"),
		"root:x:0:0:root:/root:/bin/sh\n"+
			"nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"+
			"sandbox:x:65532:65532:sandbox:/workspace:/bin/sh\n", 0o644); err != nil {
		return err
	}
	if err := writeFile(filepath.Join(dir, "etc/group"), "root:x:0:\nnogroup:x:65534:\nsandbox:x:65532:\n", 0o644); err != nil {
		return err
	}
	if err := mkdirMode(filepath.Join(dir, "tmp"), 0o777|fs.ModeSticky); err != nil {
		return err
	}
	if os.Geteuid() != 0 {
		// Without root the folder cannot belong to 65532; sticky and
		// world-writable it still lets the sandbox user work in it.
		return mkdirMode(filepath.Join(dir, "workspace"), 0o777|fs.ModeSticky)
	}
	return ownedDir(filepath.Join(dir, "workspace"), 0o755)
}

// PythonVersion runs the rootfs's python3 under chroot, which needs root,
// and checks that the modules the sandbox promises import.
func PythonVersion(ctx context.Context, rootfs string) (string, error) {
	cmd := exec.CommandContext(ctx, "chroot", rootfs, "/usr/bin/python3", "-c",
		"import json, platform, venv, ssl, sqlite3; print(platform.python_version())")
	// A clean environment: the host's PYTHON* variables mean nothing in
	// the chroot.
	cmd.Env = []string{"PATH=/usr/local/bin:/usr/bin:/bin", "LANG=C.UTF-8", "PYTHONDONTWRITEBYTECODE=1"}
	out, err := cmd.CombinedOutput()
	if err != nil {
		return "", fmt.Errorf("chroot %s python3: %w: %s", rootfs, err, strings.TrimSpace(string(out)))
	}
	return strings.TrimSpace(string(out)), nil
}

func writeFile(p, content string, mode fs.FileMode) error {
	if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
		return err
	}
	if err := os.WriteFile(p, []byte(content), mode); err != nil {
		return err
	}
	return os.Chmod(p, mode)
}

func copyFile(src, dst string, mode fs.FileMode) error {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	if err := os.MkdirAll(filepath.Dir(dst), 0o755); err != nil {
		return err
	}
	os.Remove(dst)
	out, err := os.OpenFile(dst, os.O_CREATE|os.O_EXCL|os.O_WRONLY, mode)
	if err != nil {
		return err
	}
	if _, err := io.Copy(out, in); err != nil {
		out.Close()
		return err
	}
	if err := out.Close(); err != nil {
		return err
	}
	return os.Chmod(dst, mode)
}

// mkdirMode makes a folder with exactly mode; MkdirAll alone is subject to
// the umask and cannot set the sticky bit.
func mkdirMode(p string, mode fs.FileMode) error {
	if err := os.MkdirAll(p, 0o755); err != nil {
		return err
	}
	return os.Chmod(p, mode)
}

// ownedDir makes a folder belonging to the non-root user when run as root;
// otherwise it belongs to the builder, which ociimage records as root.
func ownedDir(p string, mode fs.FileMode) error {
	if err := mkdirMode(p, mode); err != nil {
		return err
	}
	if os.Geteuid() == 0 {
		return os.Lchown(p, NonRootUID, NonRootUID)
	}
	return nil
}
