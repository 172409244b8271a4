package archive

import (
	"bufio"
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"strings"
	"syscall"
)

// dirStore keeps the archives as files under a directory: in the control
// plane, a volume of its own (the chart's embedded store), so that idle
// stop works on any cluster without an object store or CSI snapshots.
//
// # Whole objects only
//
// put writes into a temporary file beside the object's, named
// .<file>.partial-<random>, syncs it, renames it over the object's name and
// syncs the directory. A rename replaces a name atomically, so the name
// always holds a whole file: the old one or the new one, never a part. A put
// cut short (an error, a cancelled context, a killed process) leaves at most
// a temporary file, which readers never look at and removeIncomplete
// deletes, as S3 aborts an incomplete multipart upload.
//
// # Metadata
//
// Each file starts with one line of JSON, {"format":"agentbox-archive/v1",
// "meta":{...}}, followed by the archive itself. The metadata is written and
// renamed with the archive, so the two cannot disagree (a sidecar file could,
// between two renames), and it needs nothing of the filesystem (extended
// attributes are not everywhere). `tail -n +2 file` gives the archive.
//
// # Paths
//
// Keys are slash-separated relative paths whose segments are not empty,
// "." or "..", and do not start with "." (which the temporary files do).
// Every access goes through an os.Root of the directory, which refuses
// names, and symbolic links, that lead out of it.
type dirStore struct {
	dir string
}

// fileFormat marks the header line of the files.
const fileFormat = "agentbox-archive/v1"

// maxHeader bounds the header line a reader accepts.
const maxHeader = 16 << 10

// partialMarker separates an object's file name from the random suffix of
// its temporary files.
const partialMarker = ".partial-"

type fileHeader struct {
	Format string            `json:"format"`
	Meta   map[string]string `json:"meta"`
}

func newDirStore(dir string) (*dirStore, error) {
	if !filepath.IsAbs(dir) {
		return nil, fmt.Errorf("archive: the store directory %q must be an absolute path", dir)
	}
	return &dirStore{dir: filepath.Clean(dir)}, nil
}

func (s *dirStore) kind() string { return StoreEmbedded }

func (s *dirStore) location(key string) string { return filepath.Join(s.dir, filepath.FromSlash(key)) }

// checkKey refuses keys that are not plain relative paths under the
// directory. The driver builds keys only from checked names; this is the
// store's own line of defence.
func checkKey(key string) error {
	if key == "" {
		return errors.New("archive: empty key")
	}
	for _, seg := range strings.Split(key, "/") {
		if seg == "" || seg == "." || seg == ".." || strings.HasPrefix(seg, ".") || strings.ContainsAny(seg, "\x00\\") {
			return fmt.Errorf("archive: key %q: segment %q is empty, a dot name or has a forbidden character", key, seg)
		}
	}
	return nil
}

func (s *dirStore) open() (*os.Root, error) {
	root, err := os.OpenRoot(s.dir)
	if err != nil {
		return nil, fmt.Errorf("archive: the embedded store %s: %w", s.dir, err)
	}
	return root, nil
}

func (s *dirStore) put(ctx context.Context, key string, r io.Reader, meta map[string]string, _ string, _ int64) (err error) {
	if err := checkKey(key); err != nil {
		return err
	}
	root, err := s.open()
	if err != nil {
		return err
	}
	defer root.Close()
	dir, base := path.Split(key)
	if dir != "" {
		if err := root.MkdirAll(dir, 0o750); err != nil {
			return fmt.Errorf("create %s: %w", s.location(dir), err)
		}
	}
	suffix := make([]byte, 8)
	_, _ = rand.Read(suffix)
	tmp := dir + "." + base + partialMarker + hex.EncodeToString(suffix)
	f, err := root.OpenFile(tmp, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o640)
	if err != nil {
		return fmt.Errorf("create %s: %w", s.location(tmp), err)
	}
	defer func() {
		if err != nil {
			_ = f.Close()
			_ = root.Remove(tmp)
		}
	}()
	hdr, err := json.Marshal(fileHeader{Format: fileFormat, Meta: meta})
	if err != nil {
		return fmt.Errorf("encode the metadata: %w", err)
	}
	if len(hdr)+1 > maxHeader {
		return fmt.Errorf("metadata of %d bytes exceeds %d", len(hdr), maxHeader)
	}
	w := bufio.NewWriterSize(f, 256<<10)
	if _, err := w.Write(append(hdr, '\n')); err != nil {
		return fmt.Errorf("write %s: %w", s.location(tmp), err)
	}
	if _, err := io.Copy(w, ctxReader{ctx: ctx, r: r}); err != nil {
		return err
	}
	if err := w.Flush(); err != nil {
		return fmt.Errorf("write %s: %w", s.location(tmp), err)
	}
	// Durable before it is visible: after a power loss the name must not
	// point at a file whose blocks never reached the disk.
	if err := f.Sync(); err != nil {
		return fmt.Errorf("sync %s: %w", s.location(tmp), err)
	}
	if err := f.Close(); err != nil {
		return fmt.Errorf("close %s: %w", s.location(tmp), err)
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	if err := root.Rename(tmp, key); err != nil {
		return fmt.Errorf("rename %s into place: %w", s.location(tmp), err)
	}
	// The rename itself is durable once the directory is.
	if d, err := root.Open(dirOrDot(dir)); err == nil {
		_ = d.Sync()
		_ = d.Close()
	}
	return nil
}

func dirOrDot(dir string) string {
	if dir = strings.TrimSuffix(dir, "/"); dir == "" {
		return "."
	}
	return dir
}

// ctxReader ends a copy when its context does.
type ctxReader struct {
	ctx context.Context
	r   io.Reader
}

func (c ctxReader) Read(p []byte) (int, error) {
	if err := c.ctx.Err(); err != nil {
		return 0, err
	}
	return c.r.Read(p)
}

func (s *dirStore) stat(_ context.Context, key string) (objectInfo, error) {
	if err := checkKey(key); err != nil {
		return objectInfo{}, err
	}
	root, err := s.open()
	if err != nil {
		return objectInfo{}, err
	}
	defer root.Close()
	f, err := root.Open(key)
	if errors.Is(err, fs.ErrNotExist) {
		return objectInfo{}, errObjectNotFound
	}
	if err != nil {
		return objectInfo{}, err
	}
	defer f.Close()
	info, _, err := describe(f)
	return info, err
}

// describe reads the header of the open file f and returns what it says
// with the header's length.
func describe(f *os.File) (objectInfo, int64, error) {
	fi, err := f.Stat()
	if err != nil {
		return objectInfo{}, 0, err
	}
	if !fi.Mode().IsRegular() {
		return objectInfo{}, 0, fmt.Errorf("%s is not a regular file", f.Name())
	}
	line, err := bufio.NewReaderSize(io.LimitReader(f, maxHeader), maxHeader).ReadSlice('\n')
	if err != nil {
		return objectInfo{}, 0, fmt.Errorf("%s has no header line: %w", f.Name(), err)
	}
	var h fileHeader
	dec := json.NewDecoder(bytes.NewReader(line))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&h); err != nil || h.Format != fileFormat {
		return objectInfo{}, 0, fmt.Errorf("%s does not start with an %s header (%v)", f.Name(), fileFormat, err)
	}
	n := int64(len(line))
	return objectInfo{size: fi.Size() - n, modTime: fi.ModTime(), meta: h.Meta, version: fileVersion(fi)}, n, nil
}

// fileVersion identifies one write of a file: a rename puts a new inode
// under the name.
func fileVersion(fi fs.FileInfo) string {
	if st, ok := fi.Sys().(*syscall.Stat_t); ok {
		return fmt.Sprintf("%d:%d:%d:%d", st.Dev, st.Ino, fi.Size(), fi.ModTime().UnixNano())
	}
	return fmt.Sprintf("%d:%d", fi.Size(), fi.ModTime().UnixNano())
}

func (s *dirStore) get(_ context.Context, key string, want objectInfo) (io.ReadCloser, error) {
	if err := checkKey(key); err != nil {
		return nil, err
	}
	root, err := s.open()
	if err != nil {
		return nil, err
	}
	defer root.Close()
	f, err := root.Open(key)
	if err != nil {
		return nil, err
	}
	info, n, err := describe(f)
	if err == nil && info.version != want.version {
		err = fmt.Errorf("%s was replaced after it was looked at", s.location(key))
	}
	if err == nil {
		_, err = f.Seek(n, io.SeekStart)
	}
	if err != nil {
		_ = f.Close()
		return nil, err
	}
	return f, nil
}

func (s *dirStore) remove(_ context.Context, key string) error {
	if err := checkKey(key); err != nil {
		return err
	}
	root, err := s.open()
	if err != nil {
		return err
	}
	defer root.Close()
	if err := root.Remove(key); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	// The sandbox's and namespace's folders go with their last archive;
	// Remove refuses folders that still hold something.
	for dir := path.Dir(key); dir != "." && dir != "/"; dir = path.Dir(dir) {
		if root.Remove(dir) != nil {
			break
		}
	}
	return nil
}

func (s *dirStore) removeIncomplete(_ context.Context, key string) error {
	if err := checkKey(key); err != nil {
		return err
	}
	root, err := s.open()
	if err != nil {
		return err
	}
	defer root.Close()
	dir, base := path.Split(key)
	d, err := root.Open(dirOrDot(dir))
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	names, err := d.Readdirnames(-1)
	_ = d.Close()
	if err != nil {
		return err
	}
	var errs []error
	for _, name := range names {
		if strings.HasPrefix(name, "."+base+partialMarker) {
			if err := root.Remove(dir + name); err != nil && !errors.Is(err, fs.ErrNotExist) {
				errs = append(errs, err)
			}
		}
	}
	return errors.Join(errs...)
}

// check writes, syncs and removes a file in the directory: what a put
// needs, short of the archive.
func (s *dirStore) check(context.Context) error {
	root, err := s.open()
	if err != nil {
		return err
	}
	defer root.Close()
	suffix := make([]byte, 8)
	_, _ = rand.Read(suffix)
	name := ".agentbox-check" + partialMarker + hex.EncodeToString(suffix)
	f, err := root.OpenFile(name, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o640)
	if err != nil {
		return fmt.Errorf("archive: the embedded store %s is not writable: %w", s.dir, err)
	}
	_, err = f.Write([]byte("agentbox\n"))
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if rerr := root.Remove(name); err == nil {
		err = rerr
	}
	if err != nil {
		return fmt.Errorf("archive: the embedded store %s is not writable: %w", s.dir, err)
	}
	return nil
}
