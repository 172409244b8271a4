package ociimage

import (
	"archive/tar"
	"errors"
	"io"
	"io/fs"
	"math/rand/v2"
	"os"
	"path/filepath"
	"reflect"
	"runtime"
	"strings"
	"testing"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/types"
	"github.com/google/go-containerregistry/pkg/v1/validate"
)

const testRef = "agentbox.local/supervisor:dev"

// makeRootfs builds a small tree exercising each entry type the layer must
// carry.
func makeRootfs(t testing.TB) string {
	t.Helper()
	root := t.TempDir()
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	must(os.MkdirAll(filepath.Join(root, "etc"), 0o755))
	must(os.WriteFile(filepath.Join(root, "etc/hello.txt"), []byte("hello\n"), 0o644))
	must(os.MkdirAll(filepath.Join(root, "usr/local/bin"), 0o755))
	must(os.WriteFile(filepath.Join(root, "usr/local/bin/supervisor"), []byte("#!/bin/sh\necho hi\n"), 0o755))
	must(os.Symlink("usr/local/bin", filepath.Join(root, "bin")))
	must(os.Link(filepath.Join(root, "usr/local/bin/supervisor"), filepath.Join(root, "usr/local/bin/sv")))
	must(os.Mkdir(filepath.Join(root, "tmp"), 0o755))
	// Chmod after creation because the umask would strip the sticky bit.
	must(os.Chmod(filepath.Join(root, "tmp"), 0o777|fs.ModeSticky))
	must(os.WriteFile(filepath.Join(root, "etc/secret"), []byte("x"), 0o600))
	return root
}

// openArchive unpacks an archive the way an importer sees it and opens it
// with go-containerregistry's own OCI layout reader.
func openArchive(t *testing.T, archive string) v1.ImageIndex {
	t.Helper()
	dir := t.TempDir()
	f, err := os.Open(archive)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	tr := tar.NewReader(f)
	for {
		hdr, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		if strings.Contains(hdr.Name, "..") || strings.HasPrefix(hdr.Name, "/") {
			t.Fatalf("unsafe name %q in archive", hdr.Name)
		}
		p := filepath.Join(dir, hdr.Name)
		switch hdr.Typeflag {
		case tar.TypeDir:
			if err := os.MkdirAll(p, 0o755); err != nil {
				t.Fatal(err)
			}
		case tar.TypeReg:
			if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
				t.Fatal(err)
			}
			out, err := os.Create(p)
			if err != nil {
				t.Fatal(err)
			}
			if _, err := io.Copy(out, tr); err != nil {
				t.Fatal(err)
			}
			if err := out.Close(); err != nil {
				t.Fatal(err)
			}
		default:
			t.Fatalf("unexpected entry type %c for %s in archive", hdr.Typeflag, hdr.Name)
		}
	}
	idx, err := layout.ImageIndexFromPath(dir)
	if err != nil {
		t.Fatal(err)
	}
	return idx
}

func TestWriteArchive(t *testing.T) {
	root := makeRootfs(t)
	out := filepath.Join(t.TempDir(), "supervisor.tar")
	img := Image{
		Ref:        testRef,
		Rootfs:     root,
		Entrypoint: []string{"/usr/local/bin/supervisor"},
		Cmd:        []string{"--serve"},
		WorkingDir: "/",
		User:       "65532:65532",
		Labels:     map[string]string{"org.opencontainers.image.source": "agentbox"},
	}
	digest, err := WriteArchive(img, out)
	if err != nil {
		t.Fatal(err)
	}

	idx := openArchive(t, out)
	im, err := idx.IndexManifest()
	if err != nil {
		t.Fatal(err)
	}
	if len(im.Manifests) != 1 {
		t.Fatalf("index has %d manifests, want 1", len(im.Manifests))
	}
	desc := im.Manifests[0]
	if desc.Digest != digest {
		t.Errorf("index points at %s, WriteArchive returned %s", desc.Digest, digest)
	}
	if got := desc.Annotations[AnnotationImageName]; got != testRef {
		t.Errorf("%s = %q, want %q", AnnotationImageName, got, testRef)
	}
	if got := desc.Annotations[AnnotationRefName]; got != "dev" {
		t.Errorf("%s = %q, want %q", AnnotationRefName, got, "dev")
	}
	if desc.MediaType != types.OCIManifestSchema1 {
		t.Errorf("manifest media type %s", desc.MediaType)
	}

	image, err := idx.Image(digest)
	if err != nil {
		t.Fatal(err)
	}
	// Recomputes every digest, diff ID and size against the blobs.
	if err := validate.Image(image); err != nil {
		t.Fatalf("invalid image: %v", err)
	}
	m, err := image.Manifest()
	if err != nil {
		t.Fatal(err)
	}
	if m.MediaType != types.OCIManifestSchema1 || m.Config.MediaType != types.OCIConfigJSON {
		t.Errorf("media types: manifest %s, config %s", m.MediaType, m.Config.MediaType)
	}
	if len(m.Layers) != 1 || m.Layers[0].MediaType != types.OCILayer {
		t.Fatalf("layers: %+v", m.Layers)
	}

	cf, err := image.ConfigFile()
	if err != nil {
		t.Fatal(err)
	}
	if cf.Architecture != runtime.GOARCH || cf.OS != runtime.GOOS {
		t.Errorf("platform %s/%s", cf.OS, cf.Architecture)
	}
	c := cf.Config
	if !reflect.DeepEqual(c.Entrypoint, img.Entrypoint) || !reflect.DeepEqual(c.Cmd, img.Cmd) {
		t.Errorf("entrypoint %q cmd %q", c.Entrypoint, c.Cmd)
	}
	if !reflect.DeepEqual(c.Env, []string{DefaultPath}) {
		t.Errorf("env %q, want default PATH", c.Env)
	}
	if c.User != "65532:65532" || c.WorkingDir != "/" {
		t.Errorf("user %q workdir %q", c.User, c.WorkingDir)
	}
	if c.Labels["org.opencontainers.image.source"] != "agentbox" {
		t.Errorf("labels %v", c.Labels)
	}
	if !cf.Created.Time.Equal(time.Unix(0, 0)) {
		t.Errorf("created %v, want the epoch", cf.Created)
	}

	layers, err := image.Layers()
	if err != nil {
		t.Fatal(err)
	}
	rc, err := layers[0].Uncompressed()
	if err != nil {
		t.Fatal(err)
	}
	defer rc.Close()
	var names []string
	entries := map[string]*tar.Header{}
	tr := tar.NewReader(rc)
	for {
		hdr, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		names = append(names, hdr.Name)
		entries[hdr.Name] = hdr
		if hdr.Uid != 0 || hdr.Gid != 0 {
			t.Errorf("%s owned by %d:%d, want 0:0", hdr.Name, hdr.Uid, hdr.Gid)
		}
		if hdr.Uname != "" || hdr.Gname != "" {
			t.Errorf("%s carries owner names %q:%q", hdr.Name, hdr.Uname, hdr.Gname)
		}
		if !hdr.ModTime.Equal(time.Unix(0, 0)) {
			t.Errorf("%s mtime %v", hdr.Name, hdr.ModTime)
		}
	}
	wantNames := []string{
		"bin",
		"etc/",
		"etc/hello.txt",
		"etc/secret",
		"tmp/",
		"usr/",
		"usr/local/",
		"usr/local/bin/",
		"usr/local/bin/supervisor",
		"usr/local/bin/sv",
	}
	if !reflect.DeepEqual(names, wantNames) {
		t.Fatalf("layer entries\n got %q\nwant %q", names, wantNames)
	}
	check := func(name string, typ byte, mode int64) *tar.Header {
		t.Helper()
		h := entries[name]
		if h.Typeflag != typ || h.Mode != mode {
			t.Errorf("%s: type %c mode %o, want type %c mode %o", name, h.Typeflag, h.Mode, typ, mode)
		}
		return h
	}
	if h := check("bin", tar.TypeSymlink, 0o777); h.Linkname != "usr/local/bin" {
		t.Errorf("bin links to %q", h.Linkname)
	}
	check("etc/", tar.TypeDir, 0o755)
	if h := check("etc/hello.txt", tar.TypeReg, 0o644); h.Size != 6 {
		t.Errorf("etc/hello.txt size %d", h.Size)
	}
	check("etc/secret", tar.TypeReg, 0o600)
	check("tmp/", tar.TypeDir, 0o1777)
	check("usr/local/bin/supervisor", tar.TypeReg, 0o755)
	if h := check("usr/local/bin/sv", tar.TypeLink, 0o755); h.Linkname != "usr/local/bin/supervisor" {
		t.Errorf("sv hard-links to %q", h.Linkname)
	}

	fi, err := os.Stat(out)
	if err != nil {
		t.Fatal(err)
	}
	if fi.Mode().Perm() != 0o644 {
		t.Errorf("archive mode %v", fi.Mode())
	}
	leftovers, _ := filepath.Glob(filepath.Join(filepath.Dir(out), ".*"))
	if len(leftovers) != 0 {
		t.Errorf("temporary files left behind: %q", leftovers)
	}
}

func TestWriteArchiveReproducible(t *testing.T) {
	root := makeRootfs(t)
	dir := t.TempDir()
	img := Image{Ref: testRef, Rootfs: root, Entrypoint: []string{"/bin/supervisor"}}
	first, err := WriteArchive(img, filepath.Join(dir, "a.tar"))
	if err != nil {
		t.Fatal(err)
	}
	// mtimes and atimes change between builds in real life; they must not
	// leak into the digest.
	later := time.Now().Add(time.Hour)
	if err := os.Chtimes(filepath.Join(root, "etc/hello.txt"), later, later); err != nil {
		t.Fatal(err)
	}
	second, err := WriteArchive(img, filepath.Join(dir, "b.tar"))
	if err != nil {
		t.Fatal(err)
	}
	if first != second {
		t.Errorf("two builds of one folder: %s then %s", first, second)
	}
	a, _ := os.ReadFile(filepath.Join(dir, "a.tar"))
	b, _ := os.ReadFile(filepath.Join(dir, "b.tar"))
	if string(a) != string(b) {
		t.Error("archives differ byte for byte")
	}

	// Overwriting an existing archive goes through rename.
	third, err := WriteArchive(img, filepath.Join(dir, "a.tar"))
	if err != nil || third != first {
		t.Errorf("rewrite: %s, %v", third, err)
	}

	t.Setenv("SOURCE_DATE_EPOCH", "1700000000")
	dated, err := WriteArchive(img, filepath.Join(dir, "c.tar"))
	if err != nil {
		t.Fatal(err)
	}
	if dated == first {
		t.Error("SOURCE_DATE_EPOCH did not change the digest")
	}
	cf, err := imageConfig(t, filepath.Join(dir, "c.tar"))
	if err != nil {
		t.Fatal(err)
	}
	if cf.Created.Unix() != 1700000000 {
		t.Errorf("created %v", cf.Created)
	}
}

func imageConfig(t *testing.T, archive string) (*v1.ConfigFile, error) {
	idx := openArchive(t, archive)
	im, err := idx.IndexManifest()
	if err != nil {
		return nil, err
	}
	img, err := idx.Image(im.Manifests[0].Digest)
	if err != nil {
		return nil, err
	}
	return img.ConfigFile()
}

// Run as root, files chowned to another user must keep that numeric owner,
// as a distroless-style nonroot home directory needs.
func TestWriteArchiveKeepsOtherOwners(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root to chown")
	}
	root := makeRootfs(t)
	home := filepath.Join(root, "home/nonroot")
	if err := os.MkdirAll(home, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.Chown(home, 65532, 65533); err != nil {
		t.Fatal(err)
	}
	out := filepath.Join(t.TempDir(), "img.tar")
	if _, err := WriteArchive(Image{Ref: testRef, Rootfs: root, Env: []string{"A=b"}}, out); err != nil {
		t.Fatal(err)
	}
	idx := openArchive(t, out)
	im, _ := idx.IndexManifest()
	img, err := idx.Image(im.Manifests[0].Digest)
	if err != nil {
		t.Fatal(err)
	}
	cf, _ := img.ConfigFile()
	if !reflect.DeepEqual(cf.Config.Env, []string{"A=b"}) {
		t.Errorf("env %q", cf.Config.Env)
	}
	layers, _ := img.Layers()
	rc, err := layers[0].Uncompressed()
	if err != nil {
		t.Fatal(err)
	}
	defer rc.Close()
	tr := tar.NewReader(rc)
	for {
		hdr, err := tr.Next()
		if err == io.EOF {
			t.Fatal("home/nonroot/ missing from layer")
		}
		if err != nil {
			t.Fatal(err)
		}
		if hdr.Name == "home/nonroot/" {
			if hdr.Uid != 65532 || hdr.Gid != 65533 || hdr.Mode != 0o700 {
				t.Errorf("home/nonroot/ %d:%d mode %o", hdr.Uid, hdr.Gid, hdr.Mode)
			}
			return
		}
	}
}

func TestWriteArchiveErrors(t *testing.T) {
	dir := t.TempDir()
	out := filepath.Join(dir, "img.tar")

	missing := filepath.Join(dir, "no-such-rootfs")
	_, err := WriteArchive(Image{Ref: testRef, Rootfs: missing}, out)
	if !errors.Is(err, fs.ErrNotExist) || !strings.Contains(err.Error(), "rootfs") || !strings.Contains(err.Error(), missing) {
		t.Errorf("missing rootfs: %v", err)
	}

	file := filepath.Join(dir, "file")
	if err := os.WriteFile(file, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := WriteArchive(Image{Ref: testRef, Rootfs: file}, out); err == nil || !strings.Contains(err.Error(), "not a directory") {
		t.Errorf("rootfs is a file: %v", err)
	}

	root := makeRootfs(t)
	for _, ref := range []string{"", "supervisor:dev", "agentbox.local/supervisor", "agentbox.local/Supervisor:dev"} {
		if _, err := WriteArchive(Image{Ref: ref, Rootfs: root}, out); err == nil || !strings.Contains(err.Error(), "ref") {
			t.Errorf("ref %q: %v", ref, err)
		}
	}

	t.Setenv("SOURCE_DATE_EPOCH", "yesterday")
	if _, err := WriteArchive(Image{Ref: testRef, Rootfs: root}, out); err == nil || !strings.Contains(err.Error(), "SOURCE_DATE_EPOCH") {
		t.Errorf("bad SOURCE_DATE_EPOCH: %v", err)
	}

	if _, err := os.Stat(out); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("failed builds left %s behind: %v", out, err)
	}
	leftovers, _ := filepath.Glob(filepath.Join(dir, ".*"))
	if len(leftovers) != 0 {
		t.Errorf("temporary files left behind: %q", leftovers)
	}
}

func BenchmarkWriteArchive(b *testing.B) {
	root := b.TempDir()
	// Half random, half text-like, so gzip does real work on both kinds of
	// content found in a rootfs.
	rng := rand.New(rand.NewPCG(1, 2))
	var total int64
	for i := range 200 {
		dir := filepath.Join(root, "d"+string(rune('a'+i%20)))
		if err := os.MkdirAll(dir, 0o755); err != nil {
			b.Fatal(err)
		}
		data := make([]byte, 100<<10)
		if i%2 == 0 {
			for j := range data {
				data[j] = byte(rng.Uint32())
			}
		} else {
			words := []string{"container ", "image ", "layer ", "kubelet ", "\n"}
			for j := 0; j < len(data); {
				j += copy(data[j:], words[rng.IntN(len(words))])
			}
		}
		if err := os.WriteFile(filepath.Join(dir, "f"+string(rune('a'+i/20))), data, 0o644); err != nil {
			b.Fatal(err)
		}
		total += int64(len(data))
	}
	out := filepath.Join(b.TempDir(), "bench.tar")
	img := Image{Ref: testRef, Rootfs: root}
	b.SetBytes(total)
	for b.Loop() {
		if _, err := WriteArchive(img, out); err != nil {
			b.Fatal(err)
		}
	}
}
