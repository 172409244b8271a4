// Package ociimage builds single-layer container images from a folder and
// writes them as OCI archives, so that images for a local Kubernetes node can
// be made without Docker or a registry and loaded with
// `ctr -n k8s.io images import`.
package ociimage

import (
	"archive/tar"
	"bufio"
	"bytes"
	"compress/gzip"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"hash"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"syscall"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/types"
	"golang.org/x/sys/unix"
)

// Image describes an image made of one layer from a root filesystem folder.
type Image struct {
	// Ref names the image in containerd, e.g. "agentbox.local/supervisor:dev".
	// It must name a registry host and a tag: containerd uses it verbatim,
	// while the CRI plugin looks images up by their normalised name, so
	// "supervisor:dev" would be stored under a name kubelet never asks for.
	Ref string
	// Rootfs is the folder whose contents become the single layer.
	Rootfs     string
	Entrypoint []string
	Cmd        []string
	// Env defaults to DefaultPath when empty.
	Env        []string
	WorkingDir string
	User       string // e.g. "65532:65532"
	Labels     map[string]string
}

// DefaultPath is the environment an image gets when Image.Env is empty;
// without it, runtimes resolve a bare entrypoint name against an empty PATH.
const DefaultPath = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

// Annotation keys in index.json from which containerd's importer names images.
const (
	AnnotationImageName = "io.containerd.image.name"
	AnnotationRefName   = "org.opencontainers.image.ref.name"
)

// WriteArchive writes img as an OCI image layout in a tar file at out, the
// format `ctr images import` accepts, and returns the manifest digest.
//
// out is replaced atomically, so an importer never sees a half-written file.
// The layer is staged compressed in a temporary file next to out rather than
// in memory or in os.TempDir (often a tmpfs, i.e. memory too).
//
// Timestamps are SOURCE_DATE_EPOCH or else the Unix epoch, so building the
// same folder twice gives the same digest.
func WriteArchive(img Image, out string) (v1.Hash, error) {
	tag, err := name.NewTag(img.Ref, name.StrictValidation)
	if err != nil {
		return v1.Hash{}, fmt.Errorf("ociimage: ref %q must be host/repository:tag, e.g. agentbox.local/name:dev: %w", img.Ref, err)
	}
	epoch, err := sourceDateEpoch()
	if err != nil {
		return v1.Hash{}, err
	}
	root, err := rootfsDir(img.Rootfs)
	if err != nil {
		return v1.Hash{}, err
	}
	dir := filepath.Dir(out)

	layer, err := buildLayer(root, dir, epoch)
	if err != nil {
		return v1.Hash{}, err
	}
	defer os.Remove(layer.path)

	image, err := assemble(img, layer, epoch)
	if err != nil {
		return v1.Hash{}, err
	}
	digest, err := writeLayout(image, layer, img.Ref, tag, out, epoch)
	if err != nil {
		return v1.Hash{}, fmt.Errorf("ociimage: writing %s: %w", out, err)
	}
	return digest, nil
}

func sourceDateEpoch() (time.Time, error) {
	s := os.Getenv("SOURCE_DATE_EPOCH")
	if s == "" {
		return time.Unix(0, 0).UTC(), nil
	}
	// The reproducible-builds spec asks for failure, not a silent fallback,
	// so a typo cannot quietly make builds unreproducible.
	sec, err := strconv.ParseInt(s, 10, 64)
	if err != nil {
		return time.Time{}, fmt.Errorf("ociimage: SOURCE_DATE_EPOCH=%q: %w", s, err)
	}
	return time.Unix(sec, 0).UTC(), nil
}

func rootfsDir(p string) (string, error) {
	if p == "" {
		return "", errors.New("ociimage: rootfs folder not set")
	}
	// Resolved so that a rootfs given through a symlink is archived by its
	// contents; the walk itself never follows links.
	root, err := filepath.EvalSymlinks(p)
	if err != nil {
		return "", fmt.Errorf("ociimage: rootfs: %w", err)
	}
	fi, err := os.Stat(root)
	if err != nil {
		return "", fmt.Errorf("ociimage: rootfs: %w", err)
	}
	if !fi.IsDir() {
		return "", fmt.Errorf("ociimage: rootfs %s is not a directory", p)
	}
	return root, nil
}

func assemble(img Image, layer *fileLayer, epoch time.Time) (v1.Image, error) {
	created := v1.Time{Time: epoch}
	base := mutate.ConfigMediaType(mutate.MediaType(empty.Image, types.OCIManifestSchema1), types.OCIConfigJSON)
	withLayer, err := mutate.Append(base, mutate.Addendum{
		Layer:     layer,
		MediaType: types.OCILayer,
		History:   v1.History{Created: created, CreatedBy: "agentbox ociimage: rootfs folder"},
	})
	if err != nil {
		return nil, fmt.Errorf("ociimage: adding layer: %w", err)
	}
	cf, err := withLayer.ConfigFile()
	if err != nil {
		return nil, fmt.Errorf("ociimage: reading config: %w", err)
	}
	cf = cf.DeepCopy()
	cf.Architecture = runtime.GOARCH
	cf.OS = runtime.GOOS
	cf.Created = created
	env := img.Env
	if len(env) == 0 {
		env = []string{DefaultPath}
	}
	cf.Config = v1.Config{
		Entrypoint: img.Entrypoint,
		Cmd:        img.Cmd,
		Env:        env,
		WorkingDir: img.WorkingDir,
		User:       img.User,
	}
	if len(img.Labels) > 0 {
		cf.Config.Labels = img.Labels
	}
	out, err := mutate.ConfigFile(withLayer, cf)
	if err != nil {
		return nil, fmt.Errorf("ociimage: setting config: %w", err)
	}
	return out, nil
}

// fileLayer is a gzip layer already written to disk whose digests were taken
// while writing. tarball.LayerFromOpener would walk the folder and gzip it
// once more just to learn them, and gzip is most of the cost.
type fileLayer struct {
	path   string
	digest v1.Hash
	diffID v1.Hash
	size   int64
}

var _ v1.Layer = (*fileLayer)(nil)

func (l *fileLayer) Digest() (v1.Hash, error)             { return l.digest, nil }
func (l *fileLayer) DiffID() (v1.Hash, error)             { return l.diffID, nil }
func (l *fileLayer) Size() (int64, error)                 { return l.size, nil }
func (l *fileLayer) MediaType() (types.MediaType, error)  { return types.OCILayer, nil }
func (l *fileLayer) Compressed() (io.ReadCloser, error)   { return os.Open(l.path) }
func (l *fileLayer) Uncompressed() (io.ReadCloser, error) { return openGunzip(l.path) }

type gunzipFile struct {
	*gzip.Reader
	f *os.File
}

func (g gunzipFile) Close() error {
	return errors.Join(g.Reader.Close(), g.f.Close())
}

func openGunzip(p string) (io.ReadCloser, error) {
	f, err := os.Open(p)
	if err != nil {
		return nil, err
	}
	zr, err := gzip.NewReader(bufio.NewReaderSize(f, 1<<20))
	if err != nil {
		f.Close()
		return nil, err
	}
	return gunzipFile{zr, f}, nil
}

type countingWriter struct{ n int64 }

func (c *countingWriter) Write(p []byte) (int, error) {
	c.n += int64(len(p))
	return len(p), nil
}

func sha256Hash(h hash.Hash) v1.Hash {
	return v1.Hash{Algorithm: "sha256", Hex: hex.EncodeToString(h.Sum(nil))}
}

// buildLayer tars and gzips root into a temporary file in dir in one pass,
// hashing both streams on the way.
func buildLayer(root, dir string, epoch time.Time) (_ *fileLayer, err error) {
	f, err := os.CreateTemp(dir, ".ociimage-layer-*")
	if err != nil {
		return nil, fmt.Errorf("ociimage: creating layer file: %w", err)
	}
	defer func() {
		if cerr := f.Close(); err == nil && cerr != nil {
			err = fmt.Errorf("ociimage: writing layer file: %w", cerr)
		}
		if err != nil {
			os.Remove(f.Name())
		}
	}()

	buf := bufio.NewWriterSize(f, 1<<20)
	compressed, counter := sha256.New(), &countingWriter{}
	// BestSpeed: the archive is imported on the same machine, so time matters
	// more than bytes; it is also what go-containerregistry uses by default.
	zw, err := gzip.NewWriterLevel(io.MultiWriter(buf, compressed, counter), gzip.BestSpeed)
	if err != nil {
		return nil, err
	}
	uncompressed := sha256.New()
	tw := tar.NewWriter(io.MultiWriter(zw, uncompressed))

	if err := writeTree(tw, root, epoch); err != nil {
		return nil, err
	}
	if err := tw.Close(); err != nil {
		return nil, fmt.Errorf("ociimage: writing layer: %w", err)
	}
	if err := zw.Close(); err != nil {
		return nil, fmt.Errorf("ociimage: writing layer: %w", err)
	}
	if err := buf.Flush(); err != nil {
		return nil, fmt.Errorf("ociimage: writing layer file: %w", err)
	}
	return &fileLayer{
		path:   f.Name(),
		digest: sha256Hash(compressed),
		diffID: sha256Hash(uncompressed),
		size:   counter.n,
	}, nil
}

type inode struct{ dev, ino uint64 }

// writeTree writes every entry under root, root itself excluded. WalkDir
// visits entries in lexical order, which is what makes the layer
// reproducible.
func writeTree(tw *tar.Writer, root string, epoch time.Time) error {
	w := &treeWriter{
		tw: tw, root: root, epoch: epoch,
		// A builder without root rights cannot create root-owned files, so
		// its own ids stand for root; every other owner is kept as is. Run
		// as root, this maps nothing.
		euid: uint32(os.Geteuid()), egid: uint32(os.Getegid()),
		links:   map[inode]string{},
		copyBuf: make([]byte, 256<<10),
	}
	return filepath.WalkDir(root, w.visit)
}

// treeWriter carries what writeTree's walk keeps from entry to entry.
type treeWriter struct {
	tw         *tar.Writer
	root       string
	epoch      time.Time
	euid, egid uint32
	// links maps each hard-linked inode to the first name it was
	// written under.
	links   map[inode]string
	copyBuf []byte
}

// visit writes one entry: its header, then a regular file's contents.
func (w *treeWriter) visit(p string, d fs.DirEntry, walkErr error) error {
	if walkErr != nil {
		return fmt.Errorf("ociimage: reading rootfs: %w", walkErr)
	}
	if p == w.root {
		return nil
	}
	rel, err := filepath.Rel(w.root, p)
	if err != nil {
		return err
	}
	rel = filepath.ToSlash(rel)
	fi, err := d.Info()
	if err != nil {
		return fmt.Errorf("ociimage: reading rootfs: %w", err)
	}
	st, ok := fi.Sys().(*syscall.Stat_t)
	if !ok {
		return fmt.Errorf("ociimage: %s: no owner information on this platform", p)
	}
	hdr := w.header(rel, fi, st)
	if err := w.setType(hdr, p, rel, fi, st); err != nil {
		return err
	}
	if err := w.tw.WriteHeader(hdr); err != nil {
		return fmt.Errorf("ociimage: %s: %w", p, err)
	}
	if hdr.Typeflag != tar.TypeReg || hdr.Size == 0 {
		return nil
	}
	return w.copyContents(p, hdr.Size)
}

// header is the entry's name, mode, owner and time, before its type.
func (w *treeWriter) header(rel string, fi fs.FileInfo, st *syscall.Stat_t) *tar.Header {
	uid, gid := st.Uid, st.Gid
	if uid == w.euid {
		uid = 0
	}
	if gid == w.egid {
		gid = 0
	}
	return &tar.Header{
		Name:    rel,
		Mode:    tarMode(fi.Mode()),
		Uid:     int(uid),
		Gid:     int(gid),
		ModTime: w.epoch,
	}
}

// setType fills in the entry's type and what goes with it: a size, a link
// target or device numbers.
func (w *treeWriter) setType(hdr *tar.Header, p, rel string, fi fs.FileInfo, st *syscall.Stat_t) error {
	mode := fi.Mode()
	switch {
	case mode.IsRegular():
		// Hard links stay links, else every busybox-style applet would
		// be stored in full. The first name in walk order holds the data.
		if st.Nlink > 1 {
			key := inode{uint64(st.Dev), uint64(st.Ino)}
			if first, ok := w.links[key]; ok {
				hdr.Typeflag = tar.TypeLink
				hdr.Linkname = first
				return nil
			}
			w.links[key] = rel
		}
		hdr.Typeflag = tar.TypeReg
		hdr.Size = fi.Size()
	case mode.IsDir():
		hdr.Typeflag = tar.TypeDir
		hdr.Name += "/"
	case mode&fs.ModeSymlink != 0:
		target, err := os.Readlink(p)
		if err != nil {
			return fmt.Errorf("ociimage: reading rootfs: %w", err)
		}
		hdr.Typeflag = tar.TypeSymlink
		hdr.Linkname = target
	case mode&fs.ModeNamedPipe != 0:
		hdr.Typeflag = tar.TypeFifo
	case mode&fs.ModeDevice != 0:
		hdr.Typeflag = tar.TypeBlock
		if mode&fs.ModeCharDevice != 0 {
			hdr.Typeflag = tar.TypeChar
		}
		hdr.Devmajor = int64(unix.Major(uint64(st.Rdev)))
		hdr.Devminor = int64(unix.Minor(uint64(st.Rdev)))
	default:
		// Sockets only exist while something listens on them; a tar
		// cannot carry one.
		return fmt.Errorf("ociimage: %s: cannot archive file of type %s", p, mode.Type())
	}
	return nil
}

// copyContents writes the size bytes the header announced, and fails if
// the file shrank meanwhile.
func (w *treeWriter) copyContents(p string, size int64) error {
	src, err := os.Open(p)
	if err != nil {
		return fmt.Errorf("ociimage: reading rootfs: %w", err)
	}
	defer src.Close()
	n, err := io.CopyBuffer(w.tw, io.LimitReader(src, size), w.copyBuf)
	if err != nil {
		return fmt.Errorf("ociimage: %s: %w", p, err)
	}
	if n != size {
		return fmt.Errorf("ociimage: %s shrank from %d to %d bytes while being archived", p, size, n)
	}
	return nil
}

// tarMode converts Go's file mode to the Unix bits tar stores, which keep
// setuid, setgid and sticky in different places.
func tarMode(m fs.FileMode) int64 {
	mode := int64(m.Perm())
	if m&fs.ModeSetuid != 0 {
		mode |= 0o4000
	}
	if m&fs.ModeSetgid != 0 {
		mode |= 0o2000
	}
	if m&fs.ModeSticky != 0 {
		mode |= 0o1000
	}
	return mode
}

// writeLayout writes the OCI layout tar directly instead of through
// layout.Write, which would need a second on-disk copy of the layer in a
// directory before it could be tarred.
func writeLayout(img v1.Image, layer *fileLayer, ref string, tag name.Tag, out string, epoch time.Time) (_ v1.Hash, err error) {
	parts, err := layoutPartsOf(img, ref, tag)
	if err != nil {
		return v1.Hash{}, err
	}

	f, err := os.CreateTemp(filepath.Dir(out), "."+filepath.Base(out)+".tmp-*")
	if err != nil {
		return v1.Hash{}, err
	}
	defer func() {
		if err != nil {
			f.Close()
			os.Remove(f.Name())
		}
	}()
	buf := bufio.NewWriterSize(f, 1<<20)
	tw := tar.NewWriter(buf)
	if err := writeLayoutEntries(tw, parts, layer, epoch); err != nil {
		return v1.Hash{}, err
	}
	if err := tw.Close(); err != nil {
		return v1.Hash{}, err
	}
	if err := buf.Flush(); err != nil {
		return v1.Hash{}, err
	}
	if err := installArchive(f, out); err != nil {
		return v1.Hash{}, err
	}
	return parts.manifestDigest, nil
}

// layoutParts are the small files of an OCI layout, beside the layer.
type layoutParts struct {
	manifest, config, index      []byte
	manifestDigest, configDigest v1.Hash
}

func layoutPartsOf(img v1.Image, ref string, tag name.Tag) (*layoutParts, error) {
	var p layoutParts
	var err error
	if p.manifest, err = img.RawManifest(); err != nil {
		return nil, err
	}
	if p.config, err = img.RawConfigFile(); err != nil {
		return nil, err
	}
	if p.manifestDigest, err = img.Digest(); err != nil {
		return nil, err
	}
	if p.configDigest, err = img.ConfigName(); err != nil {
		return nil, err
	}
	p.index, err = json.Marshal(v1.IndexManifest{
		SchemaVersion: 2,
		MediaType:     types.OCIImageIndex,
		Manifests: []v1.Descriptor{{
			MediaType: types.OCIManifestSchema1,
			Size:      int64(len(p.manifest)),
			Digest:    p.manifestDigest,
			Annotations: map[string]string{
				AnnotationImageName: ref,
				AnnotationRefName:   tag.TagStr(),
			},
			Platform: &v1.Platform{Architecture: runtime.GOARCH, OS: runtime.GOOS},
		}},
	})
	if err != nil {
		return nil, err
	}
	return &p, nil
}

// writeLayoutEntries writes the layout's entries in a fixed order, so that
// the archive is reproducible.
func writeLayoutEntries(tw *tar.Writer, parts *layoutParts, layer *fileLayer, epoch time.Time) error {
	dir := func(n string) error {
		return tw.WriteHeader(&tar.Header{Typeflag: tar.TypeDir, Name: n, Mode: 0o755, ModTime: epoch})
	}
	file := func(n string, size int64, r io.Reader) error {
		if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeReg, Name: n, Mode: 0o644, Size: size, ModTime: epoch}); err != nil {
			return err
		}
		_, err := io.Copy(tw, r)
		return err
	}
	blob := func(h v1.Hash) string { return "blobs/" + h.Algorithm + "/" + h.Hex }
	bytesFile := func(n string, b []byte) error { return file(n, int64(len(b)), bytes.NewReader(b)) }

	steps := []func() error{
		func() error { return bytesFile("oci-layout", []byte(`{"imageLayoutVersion":"1.0.0"}`)) },
		func() error { return bytesFile("index.json", parts.index) },
		func() error { return dir("blobs/") },
		func() error { return dir("blobs/sha256/") },
		func() error { return bytesFile(blob(parts.manifestDigest), parts.manifest) },
		func() error { return bytesFile(blob(parts.configDigest), parts.config) },
	}
	for _, step := range steps {
		if err := step(); err != nil {
			return err
		}
	}
	lf, err := os.Open(layer.path)
	if err != nil {
		return err
	}
	defer lf.Close()
	return file(blob(layer.digest), layer.size, lf)
}

// installArchive makes the written temporary file durable and moves it to
// out, so that out is never a half-written archive.
func installArchive(f *os.File, out string) error {
	// CreateTemp makes the file 0600; an archive is not a secret.
	if err := f.Chmod(0o644); err != nil {
		return err
	}
	if err := f.Sync(); err != nil {
		return err
	}
	if err := f.Close(); err != nil {
		return err
	}
	return os.Rename(f.Name(), out)
}
