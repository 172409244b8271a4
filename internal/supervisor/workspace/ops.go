package workspace

import (
	api "github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"

	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path"
	"syscall"
)

func (ws *Workspace) fileInfo(rel string, fi fs.FileInfo) api.FileInfo {
	out := api.FileInfo{
		Name:      path.Base(rel),
		Path:      rel,
		Size:      fi.Size(),
		Mode:      formatMode(fi.Mode()),
		ModTime:   fi.ModTime().UTC(),
		IsDir:     fi.IsDir(),
		IsSymlink: fi.Mode()&fs.ModeSymlink != 0,
	}
	if out.IsSymlink {
		// Best effort: a link that vanished since the Lstat just has no
		// target to report.
		out.LinkTarget, _ = ws.root.Readlink(rel)
	}
	return out
}

func formatMode(m fs.FileMode) string {
	v := uint32(m.Perm())
	if m&fs.ModeSetuid != 0 {
		v |= 0o4000
	}
	if m&fs.ModeSetgid != 0 {
		v |= 0o2000
	}
	if m&fs.ModeSticky != 0 {
		v |= 0o1000
	}
	return fmt.Sprintf("%04o", v)
}

// Stat describes rel (a confined path) without following a final link.
func (ws *Workspace) Stat(rel string) (*api.FileInfo, *api.Error) {
	fi, err := ws.root.Lstat(rel)
	if err != nil {
		return nil, FSError("stat", rel, err)
	}
	out := ws.fileInfo(rel, fi)
	return &out, nil
}

// List lists the directory rel (a confined path), one level.
func (ws *Workspace) List(rel string) (*api.ListResult, *api.Error) {
	rel, apiErr := ws.resolveLinks(rel, true)
	if apiErr != nil {
		return nil, apiErr
	}
	st, err := ws.root.Stat(rel)
	if err != nil {
		return nil, FSError("list", rel, err)
	}
	if !st.IsDir() {
		return nil, api.Errorf(api.CodeNotADirectory, "list %q: not a directory", rel)
	}
	res := &api.ListResult{Path: rel, Entries: []api.FileInfo{}}
	err = walkRoot(ws.root, rel, func(p string, fi fs.FileInfo) error {
		res.Entries = append(res.Entries, ws.fileInfo(p, fi))
		return fs.SkipDir
	})
	if err != nil {
		return nil, FSError("list", rel, err)
	}
	return res, nil
}

// OpenRegular opens rel for reading, following symbolic links inside the
// workspace, and refuses anything but a regular file. O_NONBLOCK keeps a
// FIFO planted in the workspace from blocking the open forever; it does
// not affect regular files.
func (ws *Workspace) OpenRegular(op, rel string) (*os.File, fs.FileInfo, *api.Error) {
	rel, apiErr := ws.resolveLinks(rel, true)
	if apiErr != nil {
		return nil, nil, apiErr
	}
	f, err := ws.root.OpenFile(rel, os.O_RDONLY|syscall.O_NONBLOCK, 0)
	if err != nil {
		return nil, nil, FSError(op, rel, err)
	}
	fi, err := f.Stat()
	if err != nil {
		f.Close()
		return nil, nil, FSError(op, rel, err)
	}
	switch {
	case fi.IsDir():
		f.Close()
		return nil, nil, api.Errorf(api.CodeIsADirectory, "%s %q: is a directory; ask for a tar with ?format=tar or Accept: %s", op, rel, api.ContentTypeTar)
	case !fi.Mode().IsRegular():
		f.Close()
		return nil, nil, api.Errorf(api.CodeInvalidArgument, "%s %q: not a regular file (%s)", op, rel, fi.Mode().Type())
	}
	return f, fi, nil
}

// PutFile writes rel (a confined path) from body, of size bytes (-1 if
// unknown), with the mode given in octal (the default if empty).
func (ws *Workspace) PutFile(rel string, body io.Reader, modeStr string, size int64) (*api.FileInfo, *api.Error) {
	if rel == "." {
		return nil, api.Errorf(api.CodeIsADirectory, "put: the workspace itself is a directory; name a file, or send a tar with ?format=tar")
	}
	mode := fs.FileMode(api.DefaultFileMode)
	if modeStr != "" {
		m, err := api.ParseMode(modeStr)
		if err != nil {
			return nil, api.Errorf(api.CodeInvalidArgument, "put %q: %v", rel, err)
		}
		mode = m
	}
	if _, apiErr := ws.WriteFile(rel, body, mode, size); apiErr != nil {
		return nil, apiErr
	}
	return ws.Stat(rel)
}

// WriteFile writes rel atomically: the content goes to a temporary file in
// the same directory, which is synced and then renamed over rel, so rel
// holds either its old content or the new, also after a crash. Bytes are
// charged against the workspace cap as they are written; a write that
// would pass it stops, the temporary file is removed and rel is never
// touched. size is the expected length, or -1 if unknown.
func (ws *Workspace) WriteFile(rel string, body io.Reader, mode fs.FileMode, size int64) (int64, *api.Error) {
	dir := path.Dir(rel)
	if apiErr := ws.mkdirAll("put", dir, 0o755); apiErr != nil {
		return 0, apiErr
	}
	var credit int64
	switch fi, err := ws.root.Lstat(rel); {
	case err == nil && fi.IsDir():
		return 0, api.Errorf(api.CodeIsADirectory, "put %q: is a directory", rel)
	case err == nil && fi.Mode().IsRegular():
		credit = fi.Size()
	case err == nil && fi.Mode()&fs.ModeSymlink != 0:
		// The rename will replace the link itself, not write through it,
		// so nothing outside could be touched; a link that leads out is
		// still refused, so that every path through such a link is
		// refused alike.
		if _, err := ws.root.Stat(rel); isEscape(err) {
			return 0, FSError("put", rel, err)
		}
	case err != nil && !errors.Is(err, fs.ErrNotExist):
		return 0, FSError("put", rel, err)
	}

	tmp := path.Join(dir, tempName())
	res := ws.usage.begin(tmp, credit)
	defer res.abort()
	full := func() *api.Error {
		return api.Errorf(api.CodeWorkspaceFull, "put %q: the write would take the workspace past its cap of %d bytes (%d in use); nothing was changed",
			rel, ws.usage.cap, ws.usage.snapshot())
	}
	if size > 0 && !res.fits(size) {
		return 0, full()
	}
	// 0600 until the content is complete; the requested mode is set on
	// the descriptor, so the umask does not apply.
	f, err := ws.root.OpenFile(tmp, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return 0, FSError("put", rel, err)
	}
	committed := false
	defer func() {
		if !committed {
			f.Close()
			_ = ws.root.Remove(tmp)
		}
	}()
	qw := &quotaWriter{f: f, res: res}
	n, err := copyFull(qw, body, make([]byte, copyBufferSize))
	switch {
	case errors.Is(qw.err, errWorkspaceFull):
		return 0, full()
	case qw.err != nil:
		return 0, FSError("put", rel, qw.err)
	case err != nil:
		return 0, api.Errorf(api.CodeInvalidArgument, "put %q: reading the content: %v; nothing was changed", rel, err)
	case size >= 0 && n != size:
		return 0, api.Errorf(api.CodeInvalidArgument, "put %q: got %d bytes, expected %d; nothing was changed", rel, n, size)
	}
	if err := f.Chmod(mode); err != nil {
		return 0, FSError("put", rel, err)
	}
	if err := f.Sync(); err != nil {
		return 0, FSError("put", rel, err)
	}
	if err := f.Close(); err != nil {
		return 0, FSError("put", rel, err)
	}
	if err := ws.root.Rename(tmp, rel); err != nil {
		return 0, FSError("put", rel, err)
	}
	committed = true
	res.commit()
	ws.syncDir(dir)
	return n, nil
}

// mkdirAll creates dir and its parents. MkdirAll reports a file in the
// way as "file exists"; here that means a component is not a directory.
func (ws *Workspace) mkdirAll(op, dir string, perm fs.FileMode) *api.Error {
	err := ws.root.MkdirAll(dir, perm)
	if err == nil {
		return nil
	}
	if errors.Is(err, fs.ErrExist) && !isEscape(err) {
		return api.Errorf(api.CodeNotADirectory, "%s %q: a component of the path is a file, not a directory", op, dir)
	}
	return FSError(op, dir, err)
}

// syncDir makes a rename in dir durable. It is best effort: the content is
// already synced and the rename done, so a failure here is not the
// caller's.
func (ws *Workspace) syncDir(dir string) {
	if d, err := ws.root.Open(dir); err == nil {
		if err := d.Sync(); err != nil {
			ws.log.Warn("sync directory", "dir", dir, "error", err.Error())
		}
		d.Close()
	}
}

func tempName() string {
	var b [8]byte
	// crypto/rand.Read does not fail on Linux (it would crash the
	// program instead).
	_, _ = rand.Read(b[:])
	return TempPrefix + hex.EncodeToString(b[:])
}

// copyFull copies src to dst in writes of len(buf), bar the last. A body
// read off the network arrives a TLS record (16 KiB) at a time, and
// under gVisor every write to the volume is a trip through the sandbox
// kernel; filling the buffer first makes a sixteenth of the writes. A
// src that writes itself out (a decoder) does so in its own blocks.
func copyFull(dst io.Writer, src io.Reader, buf []byte) (int64, error) {
	if wt, ok := src.(io.WriterTo); ok {
		return wt.WriteTo(dst)
	}
	var n int64
	for {
		m := 0
		var rerr error
		for m < len(buf) && rerr == nil {
			var k int
			k, rerr = src.Read(buf[m:])
			m += k
		}
		if m > 0 {
			w, werr := dst.Write(buf[:m])
			n += int64(w)
			if werr != nil {
				return n, werr
			}
		}
		if errors.Is(rerr, io.EOF) {
			return n, nil
		}
		if rerr != nil {
			return n, rerr
		}
	}
}

// quotaWriter charges every write to the reservation before making it.
type quotaWriter struct {
	f   *os.File
	res *reservation
	err error
}

func (w *quotaWriter) Write(p []byte) (int, error) {
	if err := w.res.grow(int64(len(p))); err != nil {
		w.err = err
		return 0, err
	}
	n, err := w.f.Write(p)
	if err != nil {
		w.err = err
	}
	return n, err
}

// Delete deletes rel (a confined path); a directory only if recursive.
func (ws *Workspace) Delete(rel string, recursive bool) *api.Error {
	if rel == "." {
		return api.Errorf(api.CodeInvalidArgument, "delete: the workspace itself cannot be deleted")
	}
	fi, err := ws.root.Lstat(rel)
	if err != nil {
		return FSError("delete", rel, err)
	}
	if fi.IsDir() {
		if !recursive {
			return api.Errorf(api.CodeIsADirectory, "delete %q: is a directory; pass recursive=true to delete it and its contents", rel)
		}
		// RemoveAll through the root unlinks entries relative to open
		// directory descriptors and never follows symbolic links.
		err := ws.root.RemoveAll(rel)
		// Whatever part was removed is uncounted either way.
		ws.usage.invalidate()
		if err != nil {
			return FSError("delete", rel, err)
		}
		return nil
	}
	if err := ws.root.Remove(rel); err != nil {
		return FSError("delete", rel, err)
	}
	if fi.Mode().IsRegular() {
		ws.usage.removed(fi.Size())
	}
	return nil
}

// IsSymlink reports whether rel (a confined path) is a symbolic link.
func (ws *Workspace) IsSymlink(rel string) bool {
	fi, err := ws.root.Lstat(rel)
	return err == nil && fi.Mode()&fs.ModeSymlink != 0
}
