package imagebuild

import (
	"errors"
	"fmt"
	"io"
	"io/fs"
	"maps"
	"os"
	"path"
	"path/filepath"
	"slices"
	"strings"

	securejoin "github.com/cyphar/filepath-securejoin"
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
	h, _, err := s.write(out)
	return h, err
}

// write is Write, also returning the size of the root filesystem.
func (s StaticImage) write(out string) (v1.Hash, int64, error) {
	dir, err := os.MkdirTemp(filepath.Dir(out), ".rootfs-"+s.Name+"-")
	if err != nil {
		return v1.Hash{}, 0, err
	}
	defer os.RemoveAll(dir)
	if err := StaticRootfs(dir, s.Name, s.Binary, s.CABundle); err != nil {
		return v1.Hash{}, 0, err
	}
	for _, f := range s.Extra {
		if err := copyFile(f.From, filepath.Join(dir, filepath.FromSlash(f.Path)), 0o755); err != nil {
			return v1.Hash{}, 0, err
		}
	}
	size, err := dirSize(dir)
	if err != nil {
		return v1.Hash{}, 0, err
	}
	h, err := ociimage.WriteArchive(ociimage.Image{
		Ref:        s.Ref,
		Rootfs:     dir,
		Entrypoint: []string{"/usr/local/bin/" + s.Name},
		User:       fmt.Sprintf("%d:%d", NonRootUID, NonRootUID),
		Labels:     s.Labels,
	}, out)
	return h, size, err
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

// SandboxFiles adds to a Debian root filesystem what makes it a sandbox
// image: the sandbox user with /workspace as home, /tmp, and the host's CA
// bundle where OpenSSL (and so Python's ssl, curl and git) looks by
// default, so HTTPS through the egress proxy verifies although no
// maintainer script (ca-certificates' would build the bundle) ever runs.
// The supervisor is not among them: the platform injects it into the pod.
func SandboxFiles(dir, caBundle string) error {
	if caBundle == "" {
		caBundle = HostCABundle
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
			// apt downloads as _apt where it can.
			"_apt:x:42:65534::/nonexistent:/usr/sbin/nologin\n"+
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

// addFiles copies a spec's host files into the root filesystem and makes
// its links; each lands where the package layout puts it (/bin/sh in
// /usr/bin, as a merged /usr has it) and replaces what a package left
// there. A link whose target the image lacks is an error: it would only
// fail once the image runs.
func addFiles(dir string, files []SpecFile, links map[string]string) error {
	root, err := os.OpenRoot(dir)
	if err != nil {
		return err
	}
	defer root.Close()
	place := func(p string) (string, error) {
		name := usrPath(strings.TrimPrefix(p, "/"))
		if parent := path.Dir(name); parent != "." {
			if err := root.MkdirAll(parent, 0o755); err != nil {
				return "", err
			}
		}
		return name, removeNonDir(root, name)
	}
	for _, f := range files {
		name, err := place(f.Path)
		if err != nil {
			return fmt.Errorf("%s: %w", f.Path, err)
		}
		mode, err := fileMode(f)
		if err != nil {
			return err
		}
		if err := copyInto(root, f.From, name, mode); err != nil {
			return fmt.Errorf("%s: %w", f.Path, err)
		}
	}
	for _, p := range slices.Sorted(maps.Keys(links)) {
		name, err := place(p)
		if err != nil {
			return fmt.Errorf("%s: %w", p, err)
		}
		if err := root.Symlink(links[p], name); err != nil {
			return fmt.Errorf("%s: %w", p, err)
		}
	}
	for _, p := range slices.Sorted(maps.Keys(links)) {
		// Resolved as the image will see it, absolute targets from its
		// root.
		target, err := securejoin.SecureJoin(dir, p)
		if err != nil {
			return fmt.Errorf("link %s: %w", p, err)
		}
		if _, err := os.Stat(target); err != nil {
			return fmt.Errorf("link %s -> %s: the target is not in the image", p, links[p])
		}
	}
	return nil
}

func fileMode(f SpecFile) (fs.FileMode, error) {
	if f.Mode != "" {
		return parseMode(f.Mode)
	}
	fi, err := os.Stat(f.From)
	if err != nil {
		return 0, err
	}
	return fi.Mode().Perm(), nil
}

func copyInto(root *os.Root, src, name string, mode fs.FileMode) error {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	out, err := root.OpenFile(name, os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o600)
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
	return root.Chmod(name, mode)
}
