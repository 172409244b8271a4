package toolchain

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/agentbox/terraform-provider-agentbox/internal/ociimage"
	"github.com/agentbox/terraform-provider-agentbox/internal/progress"
)

// Image references of the test node's own images. The ".test" domain is
// reserved and never resolves, so nothing can try to pull them.
const (
	PauseImage   = "agentbox.test/pause:3.10"
	BusyboxImage = "agentbox.test/busybox:test"
	pausePackage = "github.com/agentbox/terraform-provider-agentbox/internal/testenv/pause"
	// LocalPathProvisioner serves the test cluster's default StorageClass.
	LocalPathProvisioner = "agentbox-local-path"
	localPathPackage     = "github.com/agentbox/terraform-provider-agentbox/internal/testenv/localpath"
	busyboxPath          = "/bin/busybox"
)

// ImageDir holds the OCI archives the test node imports at start.
func ImageDir(dir string) string { return filepath.Join(dir, "images") }

// buildOwnTools builds the test cluster's components that live in this
// repository. go build's cache makes a rebuild without changes take about a
// second.
func (b *Builder) buildOwnTools(ctx context.Context) error {
	t := time.Now()
	tools := []binary{{LocalPathProvisioner, localPathPackage}}
	if !b.ClusterOnly {
		tools = append(tools, binary{CSIHostPath, csiHostPathPackage})
	}
	var names []string
	for _, tool := range tools {
		if err := b.goBuild(ctx, tool.out, filepath.Join(BinDir(b.Dir), tool.out), tool.pkg); err != nil {
			return fmt.Errorf("build %s: %w", tool.out, err)
		}
		names = append(names, tool.out)
	}
	b.logf("own tools: %s (%s)", strings.Join(names, " "), time.Since(t).Round(time.Millisecond))
	return nil
}

// goBuild builds one of this repository's commands, static.
func (b *Builder) goBuild(ctx context.Context, label, out, pkg string) error {
	return b.cmd(label, "", append(os.Environ(), "CGO_ENABLED=0")).GoBuild(ctx, progress.GoBuild{
		Flags: []string{"-trimpath", "-ldflags", "-s -w"}, Out: out, Packages: []string{pkg}})
}

// buildImages builds the pause and busybox images. They are rebuilt only when
// the binaries inside them change.
func (b *Builder) buildImages(ctx context.Context) error {
	t := time.Now()
	work := filepath.Join(b.Dir, "src", "images")
	pauseRoot := filepath.Join(work, "pause")
	boxRoot := filepath.Join(work, "busybox")
	if err := os.RemoveAll(work); err != nil {
		return err
	}
	for _, d := range []string{pauseRoot, filepath.Join(boxRoot, "bin"), filepath.Join(boxRoot, "tmp"), ImageDir(b.Dir)} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return err
		}
	}
	if err := b.goBuild(ctx, "pause", filepath.Join(pauseRoot, "pause"), pausePackage); err != nil {
		return fmt.Errorf("build pause: %w", err)
	}
	if err := copyFile(busyboxPath, filepath.Join(boxRoot, "bin", "busybox"), 0o755); err != nil {
		return fmt.Errorf("busybox image needs Debian's busybox-static: %w", err)
	}
	// busybox finds its applets by the name it is called by.
	for _, applet := range []string{"sh", "cat", "echo", "httpd", "nc", "sleep", "uname", "wget", "ls", "id", "mkdir", "hostname"} {
		if err := os.Symlink("busybox", filepath.Join(boxRoot, "bin", applet)); err != nil {
			return err
		}
	}
	if err := os.Chmod(filepath.Join(boxRoot, "tmp"), 0o1777); err != nil {
		return err
	}
	stamp, err := hashFiles(filepath.Join(pauseRoot, "pause"), filepath.Join(boxRoot, "bin", "busybox"))
	if err != nil {
		return err
	}
	stampFile := filepath.Join(b.Dir, "stamps", "images")
	if got, err := os.ReadFile(stampFile); err == nil && string(got) == stamp &&
		fileExists(filepath.Join(ImageDir(b.Dir), "pause.tar")) && fileExists(filepath.Join(ImageDir(b.Dir), "busybox.tar")) {
		b.logf("images: pause busybox (cached)")
		return os.RemoveAll(work)
	}
	if _, err := ociimage.WriteArchive(ociimage.Image{Ref: PauseImage, Rootfs: pauseRoot, Entrypoint: []string{"/pause"}, User: "65535:65535"},
		filepath.Join(ImageDir(b.Dir), "pause.tar")); err != nil {
		return fmt.Errorf("pause image: %w", err)
	}
	if _, err := ociimage.WriteArchive(ociimage.Image{Ref: BusyboxImage, Rootfs: boxRoot, Entrypoint: []string{"/bin/sh"}, Env: []string{"PATH=/bin"}},
		filepath.Join(ImageDir(b.Dir), "busybox.tar")); err != nil {
		return fmt.Errorf("busybox image: %w", err)
	}
	if err := os.WriteFile(stampFile, []byte(stamp), 0o644); err != nil {
		return err
	}
	b.logf("images: pause busybox built in %s", time.Since(t).Round(time.Millisecond))
	return os.RemoveAll(work)
}

func hashFiles(paths ...string) (string, error) {
	h := sha256.New()
	for _, p := range paths {
		f, err := os.Open(p)
		if err != nil {
			return "", err
		}
		_, err = io.Copy(h, f)
		f.Close()
		if err != nil {
			return "", err
		}
	}
	return hex.EncodeToString(h.Sum(nil))[:16], nil
}

func copyFile(src, dst string, mode os.FileMode) error {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	out, err := os.OpenFile(dst, os.O_CREATE|os.O_WRONLY|os.O_TRUNC, mode)
	if err != nil {
		return err
	}
	if _, err := io.Copy(out, in); err != nil {
		out.Close()
		return err
	}
	return out.Close()
}

func fileExists(p string) bool { _, err := os.Stat(p); return err == nil }
