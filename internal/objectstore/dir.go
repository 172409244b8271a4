package objectstore

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

// dirStore keeps the objects as files under a directory: in the control
// plane, a volume of its own (the chart's embedded store), so that idle
// stop and run artifacts work on any cluster without an object store or
// CSI snapshots.
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
// "meta":{...}}, followed by the object itself (the format's name is the
// one the archive snapshot driver first wrote, kept so that existing
// stores stay readable). The metadata is written and
// renamed with the object, so the two cannot disagree (a sidecar file could,
// between two renames), and it needs nothing of the filesystem (extended
// attributes are not everywhere). `tail -n +2 file` gives the object.
//
// # Paths
//
// Keys are slash-separated relative paths (CheckKey) whose segments are not empty,
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
		return nil, fmt.Errorf("the store directory %q must be an absolute path", dir)
	}
	return &dirStore{dir: filepath.Clean(dir)}, nil
}

func (s *dirStore) Kind() string { return KindEmbedded }

func (s *dirStore) Location(key string) string { return filepath.Join(s.dir, filepath.FromSlash(key)) }

// CheckKey refuses keys that are not plain relative paths under a
// directory: empty segments, "." or "..", names starting with "." (which
// the store's temporary files do), NUL or backslash. The directory store
// refuses such keys; callers that build keys from names they were given
// check them first, to say which name is wrong.
func CheckKey(key string) error {
	if key == "" {
		return errors.New("empty key")
	}
	for _, seg := range strings.Split(key, "/") {
		if seg == "" || seg == "." || seg == ".." || strings.HasPrefix(seg, ".") || strings.ContainsAny(seg, "\x00\\") {
			return fmt.Errorf("key %q: segment %q is empty, a dot name or has a forbidden character", key, seg)
		}
	}
	return nil
}

func (s *dirStore) open() (*os.Root, error) {
	root, err := os.OpenRoot(s.dir)
	if err != nil {
		return nil, fmt.Errorf("the embedded store %s: %w", s.dir, err)
	}
	return root, nil
}

func (s *dirStore) Put(ctx context.Context, key string, r io.Reader, size int64, o PutOptions) (err error) {
	if err := CheckKey(key); err != nil {
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
			return fmt.Errorf("create %s: %w", s.Location(dir), err)
		}
	}
	suffix := make([]byte, 8)
	_, _ = rand.Read(suffix)
	tmp := dir + "." + base + partialMarker + hex.EncodeToString(suffix)
	f, err := root.OpenFile(tmp, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o640)
	if err != nil {
		return fmt.Errorf("create %s: %w", s.Location(tmp), err)
	}
	defer func() {
		if err != nil {
			_ = f.Close()
			_ = root.Remove(tmp)
		}
	}()
	hdr, err := json.Marshal(fileHeader{Format: fileFormat, Meta: o.Meta})
	if err != nil {
		return fmt.Errorf("encode the metadata: %w", err)
	}
	if len(hdr)+1 > maxHeader {
		return fmt.Errorf("metadata of %d bytes exceeds %d", len(hdr), maxHeader)
	}
	w := bufio.NewWriterSize(f, 256<<10)
	if _, err := w.Write(append(hdr, '\n')); err != nil {
		return fmt.Errorf("write %s: %w", s.Location(tmp), err)
	}
	n, err := io.Copy(w, ctxReader{ctx: ctx, r: r})
	if err != nil {
		return err
	}
	if size >= 0 && n != size {
		return fmt.Errorf("write %s: the object was to hold %d bytes, its reader gave %d", s.Location(key), size, n)
	}
	if err := w.Flush(); err != nil {
		return fmt.Errorf("write %s: %w", s.Location(tmp), err)
	}
	// Durable before it is visible: after a power loss the name must not
	// point at a file whose blocks never reached the disk.
	if err := f.Sync(); err != nil {
		return fmt.Errorf("sync %s: %w", s.Location(tmp), err)
	}
	if err := f.Close(); err != nil {
		return fmt.Errorf("close %s: %w", s.Location(tmp), err)
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	if err := root.Rename(tmp, key); err != nil {
		return fmt.Errorf("rename %s into place: %w", s.Location(tmp), err)
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

func (s *dirStore) Stat(_ context.Context, key string) (Info, error) {
	if err := CheckKey(key); err != nil {
		return Info{}, err
	}
	root, err := s.open()
	if err != nil {
		return Info{}, err
	}
	defer root.Close()
	f, err := root.Open(key)
	if errors.Is(err, fs.ErrNotExist) {
		return Info{}, ErrNotFound
	}
	if err != nil {
		return Info{}, err
	}
	defer f.Close()
	info, _, err := describe(f)
	info.Key = key
	return info, err
}

// List walks the folder of prefix (what precedes its last slash) and
// reports the objects under it whose keys start with prefix. Temporary
// files of puts in flight, and anything else a key could not name, are
// not objects and are skipped.
func (s *dirStore) List(ctx context.Context, prefix string, fn func(Info) error) error {
	dir := "."
	if i := strings.LastIndexByte(prefix, '/'); i >= 0 {
		dir = prefix[:i]
		if err := CheckKey(dir); err != nil {
			// No object can have such a key.
			return nil
		}
	}
	root, err := s.open()
	if err != nil {
		return err
	}
	defer root.Close()
	err = fs.WalkDir(root.FS(), dir, func(name string, d fs.DirEntry, err error) error {
		if err != nil {
			if name == dir && errors.Is(err, fs.ErrNotExist) {
				return fs.SkipAll
			}
			return err
		}
		if err := ctx.Err(); err != nil {
			return err
		}
		if name != dir && strings.HasPrefix(d.Name(), ".") {
			if d.IsDir() {
				return fs.SkipDir
			}
			return nil
		}
		if d.IsDir() || !d.Type().IsRegular() || !strings.HasPrefix(name, prefix) {
			return nil
		}
		fi, err := d.Info()
		if err != nil {
			return err
		}
		f, err := root.Open(name)
		if err != nil {
			return err
		}
		info, _, err := describe(f)
		_ = f.Close()
		if err != nil {
			return err
		}
		info.Key, info.ModTime = name, fi.ModTime()
		return fn(info)
	})
	return err
}

// describe reads the header of the open file f and returns what it says
// with the header's length.
func describe(f *os.File) (Info, int64, error) {
	fi, err := f.Stat()
	if err != nil {
		return Info{}, 0, err
	}
	if !fi.Mode().IsRegular() {
		return Info{}, 0, fmt.Errorf("%s is not a regular file", f.Name())
	}
	line, err := bufio.NewReaderSize(io.LimitReader(f, maxHeader), maxHeader).ReadSlice('\n')
	if err != nil {
		return Info{}, 0, fmt.Errorf("%s has no header line: %w", f.Name(), err)
	}
	var h fileHeader
	dec := json.NewDecoder(bytes.NewReader(line))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&h); err != nil || h.Format != fileFormat {
		return Info{}, 0, fmt.Errorf("%s does not start with an %s header (%v)", f.Name(), fileFormat, err)
	}
	n := int64(len(line))
	return Info{Size: fi.Size() - n, ModTime: fi.ModTime(), Meta: h.Meta, Version: fileVersion(fi)}, n, nil
}

// fileVersion identifies one write of a file: a rename puts a new inode
// under the name.
func fileVersion(fi fs.FileInfo) string {
	if st, ok := fi.Sys().(*syscall.Stat_t); ok {
		return fmt.Sprintf("%d:%d:%d:%d", st.Dev, st.Ino, fi.Size(), fi.ModTime().UnixNano())
	}
	return fmt.Sprintf("%d:%d", fi.Size(), fi.ModTime().UnixNano())
}

func (s *dirStore) Get(_ context.Context, key string, want Info) (io.ReadCloser, error) {
	if err := CheckKey(key); err != nil {
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
	if err == nil && info.Version != want.Version {
		err = fmt.Errorf("%s was replaced after it was looked at", s.Location(key))
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

func (s *dirStore) Remove(_ context.Context, key string) error {
	if err := CheckKey(key); err != nil {
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
	// The folders above go with their last object; Remove refuses
	// folders that still hold something.
	for dir := path.Dir(key); dir != "." && dir != "/"; dir = path.Dir(dir) {
		if root.Remove(dir) != nil {
			break
		}
	}
	return nil
}

func (s *dirStore) RemoveIncomplete(_ context.Context, key string) error {
	if err := CheckKey(key); err != nil {
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

// Check writes, syncs and removes a file in the directory: what a put
// needs, short of the object.
func (s *dirStore) Check(context.Context) error {
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
		return fmt.Errorf("the embedded store %s is not writable: %w", s.dir, err)
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
		return fmt.Errorf("the embedded store %s is not writable: %w", s.dir, err)
	}
	return nil
}
