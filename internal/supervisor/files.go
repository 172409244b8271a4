package supervisor

import (
	"archive/tar"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net/http"
	"os"
	"path"
	"strings"
	"syscall"
	"time"

	api "github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"
)

// Confinement. Every file operation goes through an *os.Root opened on
// the workspace once, at startup. os.Root resolves each path component
// relative to an open directory descriptor (openat with O_NOFOLLOW, reading
// and checking every symbolic link itself), so a ".." or a symbolic link
// that leads outside the workspace fails with an error, and a component
// swapped for a symbolic link between a check and the use is still
// resolved inside the root: there is no separate check that could be
// raced. Before that, request paths are also cleaned lexically, so that
// "../x" and absolute paths outside the workspace get a clear error
// without touching the file system.

const (
	// tempPrefix names the temporary files writes go through. The usage
	// walk skips only the temporary files of writes in flight, so an
	// agent's own files with this prefix still count.
	tempPrefix = ".agentbox-tmp-"
	// fileIdleTimeout bounds how long a file transfer may make no
	// progress. The server's own read and write timeouts are sized for
	// commands, not for a gigabyte upload, so file handlers push the
	// deadlines forward as bytes move.
	fileIdleTimeout = time.Minute
	copyBufferSize  = 256 << 10
)

// serveFiles handles the file endpoints and reports whether the path was
// one of theirs.
func (s *Server) serveFiles(w *recorder, r *http.Request, info *requestInfo) bool {
	var prefix string
	for _, p := range []string{api.PathFiles, api.PathStat, api.PathList} {
		if strings.HasPrefix(r.URL.Path, p) {
			prefix = p
			break
		}
	}
	if prefix == "" {
		return false
	}
	fail := func(e *api.Error) {
		info.err = e
		writeError(w, e)
	}
	if s.root == nil {
		fail(api.Errorf(api.CodeUnavailable, "this supervisor serves no workspace (%s does not exist)", DefaultWorkspace))
		return true
	}
	rel, apiErr := s.confine(strings.TrimPrefix(r.URL.Path, prefix))
	if apiErr != nil {
		fail(apiErr)
		return true
	}
	info.file = rel
	q := r.URL.Query()
	switch {
	case prefix == api.PathStat && (r.Method == http.MethodGet || r.Method == http.MethodHead):
		fi, apiErr := s.stat(rel)
		if apiErr != nil {
			fail(apiErr)
			return true
		}
		writeJSON(w, http.StatusOK, fi)
	case prefix == api.PathList && (r.Method == http.MethodGet || r.Method == http.MethodHead):
		res, apiErr := s.list(rel)
		if apiErr != nil {
			fail(apiErr)
			return true
		}
		writeJSON(w, http.StatusOK, res)
	case prefix == api.PathStat || prefix == api.PathList:
		methodNotAllowed(w, r, "GET, HEAD")
	case r.Method == http.MethodGet || r.Method == http.MethodHead:
		format := q.Get("format")
		if format == "" && acceptsTar(r.Header.Get("Accept")) {
			format = api.FormatTar
		}
		switch format {
		case "":
			apiErr = s.getFile(w, r, rel)
		case api.FormatTar:
			apiErr = s.getTar(w, r, rel, info)
		default:
			apiErr = api.Errorf(api.CodeInvalidArgument, "format must be %q or absent, not %q", api.FormatTar, format)
		}
		if apiErr != nil {
			fail(apiErr)
		}
	case r.Method == http.MethodPut:
		body := &progressReader{r: r.Body, rc: http.NewResponseController(w)}
		switch format := q.Get("format"); format {
		case "":
			var fi *api.FileInfo
			if fi, apiErr = s.putFile(rel, body, q.Get("mode"), r.ContentLength); apiErr == nil {
				writeJSON(w, http.StatusOK, fi)
			}
		case api.FormatTar:
			var res *api.TarResult
			if res, apiErr = s.putTar(rel, body); apiErr == nil {
				writeJSON(w, http.StatusOK, res)
			}
		default:
			apiErr = api.Errorf(api.CodeInvalidArgument, "format must be %q or absent, not %q", api.FormatTar, format)
		}
		if apiErr != nil {
			fail(apiErr)
		}
	case r.Method == http.MethodDelete:
		recursive := false
		switch v := q.Get("recursive"); v {
		case "", "false":
		case "true":
			recursive = true
		default:
			fail(api.Errorf(api.CodeInvalidArgument, "recursive must be true or false, not %q", v))
			return true
		}
		if apiErr := s.deletePath(rel, recursive); apiErr != nil {
			fail(apiErr)
			return true
		}
		w.WriteHeader(http.StatusNoContent)
	default:
		methodNotAllowed(w, r, "GET, HEAD, PUT, DELETE")
	}
	return true
}

func acceptsTar(accept string) bool {
	for _, part := range strings.Split(accept, ",") {
		mt, _, _ := strings.Cut(part, ";")
		if strings.EqualFold(strings.TrimSpace(mt), api.ContentTypeTar) {
			return true
		}
	}
	return false
}

// relPath turns a request path into a clean slash-separated path relative
// to the workspace ("." for the workspace itself). An absolute path is
// accepted only under the workspace. This is the lexical half of
// confinement, for clear errors; os.Root does the half that matters.
func (s *Server) relPath(p string) (string, *api.Error) {
	if strings.IndexByte(p, 0) >= 0 {
		return "", api.Errorf(api.CodeInvalidArgument, "path contains a NUL byte")
	}
	if strings.HasPrefix(p, "/") {
		clean := path.Clean(p)
		for _, ws := range append([]string{s.workspace}, s.workspaceAliases...) {
			switch {
			case clean == ws:
				return ".", nil
			case strings.HasPrefix(clean, ws+"/"):
				return clean[len(ws)+1:], nil
			}
		}
		return "", api.Errorf(api.CodePathEscapesWorkspace, "absolute path %q is outside the workspace %s", p, s.workspace)
	}
	clean := path.Clean(p)
	if clean == ".." || strings.HasPrefix(clean, "../") {
		return "", api.Errorf(api.CodePathEscapesWorkspace, "path %q climbs out of the workspace", p)
	}
	return clean, nil
}

// fsError turns an error from an os.Root operation into a typed error
// that names the workspace-relative path, never the host path.
func fsError(op, rel string, err error) *api.Error {
	var errno syscall.Errno
	cause := err
	var pe *fs.PathError
	var le *os.LinkError
	switch {
	case errors.As(err, &pe):
		cause = pe.Err
	case errors.As(err, &le):
		cause = le.Err
	}
	switch {
	case isEscape(err):
		return api.Errorf(api.CodePathEscapesWorkspace, "%s %q: the path leads out of the workspace (through \"..\" or a symbolic link that points outside or is absolute)", op, rel)
	case errors.Is(err, errWorkspaceFull):
		return api.Errorf(api.CodeWorkspaceFull, "%s %q: %v", op, rel, cause)
	case errors.Is(err, fs.ErrNotExist):
		return api.Errorf(api.CodeNotFound, "%s %q: no such file or directory", op, rel)
	case errors.Is(err, syscall.ENOTDIR):
		return api.Errorf(api.CodeNotADirectory, "%s %q: a component of the path is not a directory", op, rel)
	case errors.Is(err, syscall.EISDIR):
		return api.Errorf(api.CodeIsADirectory, "%s %q: is a directory", op, rel)
	case errors.Is(err, fs.ErrPermission):
		return api.Errorf(api.CodePermissionDenied, "%s %q: permission denied", op, rel)
	case errors.Is(err, syscall.ENOSPC), errors.Is(err, syscall.EDQUOT):
		return api.Errorf(api.CodeWorkspaceFull, "%s %q: no space left on the device", op, rel)
	case errors.As(err, &errno) && (errno == syscall.ENAMETOOLONG || errno == syscall.ELOOP || errno == syscall.EINVAL):
		return api.Errorf(api.CodeInvalidArgument, "%s %q: %v", op, rel, cause)
	default:
		return api.Errorf(api.CodeInternal, "%s %q: %v", op, rel, cause)
	}
}

// isEscape reports whether err is os.Root refusing a path that leaves the
// root. The os package does not export that error, so it is recognised by
// its text anywhere in the chain.
func isEscape(err error) bool {
	for ; err != nil; err = errors.Unwrap(err) {
		if err.Error() == "path escapes from parent" {
			return true
		}
	}
	return false
}

func (s *Server) fileInfo(rel string, fi fs.FileInfo) api.FileInfo {
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
		out.LinkTarget, _ = s.root.Readlink(rel)
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

func (s *Server) stat(rel string) (*api.FileInfo, *api.Error) {
	fi, err := s.root.Lstat(rel)
	if err != nil {
		return nil, fsError("stat", rel, err)
	}
	out := s.fileInfo(rel, fi)
	return &out, nil
}

func (s *Server) list(rel string) (*api.ListResult, *api.Error) {
	rel, apiErr := s.resolveLinks(rel, true)
	if apiErr != nil {
		return nil, apiErr
	}
	st, err := s.root.Stat(rel)
	if err != nil {
		return nil, fsError("list", rel, err)
	}
	if !st.IsDir() {
		return nil, api.Errorf(api.CodeNotADirectory, "list %q: not a directory", rel)
	}
	res := &api.ListResult{Path: rel, Entries: []api.FileInfo{}}
	err = walkRoot(s.root, rel, func(p string, fi fs.FileInfo) error {
		res.Entries = append(res.Entries, s.fileInfo(p, fi))
		return fs.SkipDir
	})
	if err != nil {
		return nil, fsError("list", rel, err)
	}
	return res, nil
}

// openRegular opens rel for reading, following symbolic links inside the
// workspace, and refuses anything but a regular file. O_NONBLOCK keeps a
// FIFO planted in the workspace from blocking the open forever; it does
// not affect regular files.
func (s *Server) openRegular(op, rel string) (*os.File, fs.FileInfo, *api.Error) {
	rel, apiErr := s.resolveLinks(rel, true)
	if apiErr != nil {
		return nil, nil, apiErr
	}
	f, err := s.root.OpenFile(rel, os.O_RDONLY|syscall.O_NONBLOCK, 0)
	if err != nil {
		return nil, nil, fsError(op, rel, err)
	}
	fi, err := f.Stat()
	if err != nil {
		f.Close()
		return nil, nil, fsError(op, rel, err)
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

func (s *Server) getFile(w http.ResponseWriter, r *http.Request, rel string) *api.Error {
	f, fi, apiErr := s.openRegular("get", rel)
	if apiErr != nil {
		return apiErr
	}
	defer f.Close()
	h := w.Header()
	// Set before ServeContent so it does not sniff the content.
	h.Set("Content-Type", "application/octet-stream")
	h.Set("X-Content-Type-Options", "nosniff")
	h.Set("Cache-Control", "no-store")
	// ServeContent sends Content-Length and serves ranges, so a client can
	// resume a large download.
	http.ServeContent(&progressWriter{ResponseWriter: w, rc: http.NewResponseController(w)}, r, fi.Name(), fi.ModTime(), f)
	return nil
}

// getTar streams rel as a tar. Errors before the first byte are returned;
// after it, the response can only be cut off, so that the client sees a
// broken stream rather than a tar that looks complete.
func (s *Server) getTar(w http.ResponseWriter, r *http.Request, rel string, info *requestInfo) *api.Error {
	rel, apiErr := s.resolveLinks(rel, true)
	if apiErr != nil {
		return apiErr
	}
	st, err := s.root.Stat(rel)
	if err != nil {
		return fsError("get", rel, err)
	}
	var sub *os.Root
	var single string
	if st.IsDir() {
		// A root on the directory itself: the tar can hold nothing from
		// outside it, even through a link swapped in during the walk.
		if sub, err = s.root.OpenRoot(rel); err != nil {
			return fsError("get", rel, err)
		}
	} else {
		dir := path.Dir(rel)
		if sub, err = s.root.OpenRoot(dir); err != nil {
			return fsError("get", rel, err)
		}
		single = path.Base(rel)
	}
	defer sub.Close()

	h := w.Header()
	h.Set("Content-Type", api.ContentTypeTar)
	h.Set("X-Content-Type-Options", "nosniff")
	h.Set("Cache-Control", "no-store")
	w.WriteHeader(http.StatusOK)
	if r.Method == http.MethodHead {
		return nil
	}
	tw := tar.NewWriter(&progressWriter{ResponseWriter: w, rc: http.NewResponseController(w)})
	add := func(name string, fi fs.FileInfo) error {
		return addTarEntry(tw, sub, name, fi)
	}
	if single != "" {
		fi, err := sub.Lstat(single)
		if err == nil {
			err = add(single, fi)
		}
		if err != nil {
			info.abort(fmt.Errorf("tar %q: %w", rel, err))
			return nil
		}
	} else if err := walkRoot(sub, ".", add); err != nil {
		info.abort(fmt.Errorf("tar %q: %w", rel, err))
		return nil
	}
	if err := tw.Close(); err != nil {
		info.abort(fmt.Errorf("tar %q: %w", rel, err))
	}
	return nil
}

// addTarEntry writes one entry. Headers are built by hand rather than with
// tar.FileInfoHeader, which would look up user and group names.
func addTarEntry(tw *tar.Writer, root *os.Root, name string, fi fs.FileInfo) error {
	hdr := &tar.Header{Name: name, Mode: int64(fi.Mode().Perm()), ModTime: fi.ModTime(), Format: tar.FormatPAX}
	switch {
	case fi.IsDir():
		hdr.Typeflag, hdr.Name = tar.TypeDir, name+"/"
		return tw.WriteHeader(hdr)
	case fi.Mode()&fs.ModeSymlink != 0:
		target, err := root.Readlink(name)
		if errors.Is(err, fs.ErrNotExist) {
			return nil
		}
		if err != nil {
			return err
		}
		hdr.Typeflag, hdr.Linkname = tar.TypeSymlink, target
		return tw.WriteHeader(hdr)
	case fi.Mode().IsRegular():
		f, err := root.OpenFile(name, os.O_RDONLY|syscall.O_NONBLOCK, 0)
		if errors.Is(err, fs.ErrNotExist) {
			return nil
		}
		if err != nil {
			return err
		}
		defer f.Close()
		// The size comes from the open file, not the walk's Lstat: the
		// name may have been replaced in between.
		st, err := f.Stat()
		if err != nil {
			return err
		}
		if !st.Mode().IsRegular() {
			return nil
		}
		hdr.Typeflag, hdr.Size, hdr.Mode, hdr.ModTime = tar.TypeReg, st.Size(), int64(st.Mode().Perm()), st.ModTime()
		if err := tw.WriteHeader(hdr); err != nil {
			return err
		}
		// A file that shrinks while being read fails here; one that grows
		// is cut at the size in the header.
		if _, err := io.CopyN(tw, f, st.Size()); err != nil {
			return fmt.Errorf("%s: %w", name, err)
		}
		return nil
	default:
		// Devices, FIFOs and sockets have no content to transfer.
		return nil
	}
}

func (s *Server) putFile(rel string, body io.Reader, modeStr string, size int64) (*api.FileInfo, *api.Error) {
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
	if _, apiErr := s.writeFile(rel, body, mode, size); apiErr != nil {
		return nil, apiErr
	}
	return s.stat(rel)
}

// writeFile writes rel atomically: the content goes to a temporary file in
// the same directory, which is synced and then renamed over rel, so rel
// holds either its old content or the new, also after a crash. Bytes are
// charged against the workspace cap as they are written; a write that
// would pass it stops, the temporary file is removed and rel is never
// touched. size is the expected length, or -1 if unknown.
func (s *Server) writeFile(rel string, body io.Reader, mode fs.FileMode, size int64) (int64, *api.Error) {
	dir := path.Dir(rel)
	if apiErr := s.mkdirAll("put", dir, 0o755); apiErr != nil {
		return 0, apiErr
	}
	var credit int64
	switch fi, err := s.root.Lstat(rel); {
	case err == nil && fi.IsDir():
		return 0, api.Errorf(api.CodeIsADirectory, "put %q: is a directory", rel)
	case err == nil && fi.Mode().IsRegular():
		credit = fi.Size()
	case err == nil && fi.Mode()&fs.ModeSymlink != 0:
		// The rename will replace the link itself, not write through it,
		// so nothing outside could be touched; a link that leads out is
		// still refused, so that every path through such a link is
		// refused alike.
		if _, err := s.root.Stat(rel); isEscape(err) {
			return 0, fsError("put", rel, err)
		}
	case err != nil && !errors.Is(err, fs.ErrNotExist):
		return 0, fsError("put", rel, err)
	}

	tmp := path.Join(dir, tempName())
	res := s.usage.begin(tmp, credit)
	defer res.abort()
	full := func() *api.Error {
		return api.Errorf(api.CodeWorkspaceFull, "put %q: the write would take the workspace past its cap of %d bytes (%d in use); nothing was changed",
			rel, s.usage.cap, s.usage.snapshot())
	}
	if size > 0 && !res.fits(size) {
		return 0, full()
	}
	// 0600 until the content is complete; the requested mode is set on
	// the descriptor, so the umask does not apply.
	f, err := s.root.OpenFile(tmp, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return 0, fsError("put", rel, err)
	}
	committed := false
	defer func() {
		if !committed {
			f.Close()
			_ = s.root.Remove(tmp)
		}
	}()
	qw := &quotaWriter{f: f, res: res}
	n, err := io.CopyBuffer(qw, body, make([]byte, copyBufferSize))
	switch {
	case errors.Is(qw.err, errWorkspaceFull):
		return 0, full()
	case qw.err != nil:
		return 0, fsError("put", rel, qw.err)
	case err != nil:
		return 0, api.Errorf(api.CodeInvalidArgument, "put %q: reading the content: %v; nothing was changed", rel, err)
	case size >= 0 && n != size:
		return 0, api.Errorf(api.CodeInvalidArgument, "put %q: got %d bytes, expected %d; nothing was changed", rel, n, size)
	}
	if err := f.Chmod(mode); err != nil {
		return 0, fsError("put", rel, err)
	}
	if err := f.Sync(); err != nil {
		return 0, fsError("put", rel, err)
	}
	if err := f.Close(); err != nil {
		return 0, fsError("put", rel, err)
	}
	if err := s.root.Rename(tmp, rel); err != nil {
		return 0, fsError("put", rel, err)
	}
	committed = true
	res.commit()
	s.syncDir(dir)
	return n, nil
}

// mkdirAll creates dir and its parents. MkdirAll reports a file in the
// way as "file exists"; here that means a component is not a directory.
func (s *Server) mkdirAll(op, dir string, perm fs.FileMode) *api.Error {
	err := s.root.MkdirAll(dir, perm)
	if err == nil {
		return nil
	}
	if errors.Is(err, fs.ErrExist) && !isEscape(err) {
		return api.Errorf(api.CodeNotADirectory, "%s %q: a component of the path is a file, not a directory", op, dir)
	}
	return fsError(op, dir, err)
}

// syncDir makes a rename in dir durable. It is best effort: the content is
// already synced and the rename done, so a failure here is not the
// caller's.
func (s *Server) syncDir(dir string) {
	if d, err := s.root.Open(dir); err == nil {
		if err := d.Sync(); err != nil {
			s.log.Warn("sync directory", "dir", dir, "error", err.Error())
		}
		d.Close()
	}
}

func tempName() string {
	var b [8]byte
	// crypto/rand.Read does not fail on Linux (it would crash the
	// program instead).
	_, _ = rand.Read(b[:])
	return tempPrefix + hex.EncodeToString(b[:])
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

// putTar extracts a tar stream into the directory rel. Each entry is
// checked like a request path, relative to rel, and written through the
// same os.Root, so neither a "../" name nor a symbolic link (from the tar
// or already in the workspace) can place a file outside. Symbolic link
// entries whose target is absolute or climbs out of the workspace are
// refused outright, although os.Root would refuse to follow them anyway:
// such a link is never useful inside the sandbox and the early error is
// clearer. Hard links and special files are refused.
func (s *Server) putTar(rel string, body io.Reader) (*api.TarResult, *api.Error) {
	if apiErr := s.mkdirAll("put", rel, 0o755); apiErr != nil {
		return nil, apiErr
	}
	res := &api.TarResult{}
	tr := tar.NewReader(body)
	for {
		hdr, err := tr.Next()
		if err == io.EOF {
			return res, nil
		}
		if err != nil {
			return nil, api.Errorf(api.CodeInvalidArgument, "put %q: reading the tar stream after %d entries: %v", rel, res.Files+res.Dirs+res.Symlinks, err)
		}
		name := hdr.Name
		if strings.IndexByte(name, 0) >= 0 {
			return nil, api.Errorf(api.CodeInvalidArgument, "tar entry %q: the name contains a NUL byte", name)
		}
		if strings.HasPrefix(name, "/") {
			return nil, api.Errorf(api.CodePathEscapesWorkspace, "tar entry %q: absolute names are refused", name)
		}
		clean := path.Clean(name)
		if clean == ".." || strings.HasPrefix(clean, "../") {
			return nil, api.Errorf(api.CodePathEscapesWorkspace, "tar entry %q climbs out of the target directory", name)
		}
		target := path.Join(rel, clean)
		if t, _ := s.relPath(target); t != target {
			return nil, api.Errorf(api.CodePathEscapesWorkspace, "tar entry %q climbs out of the workspace", name)
		}
		// Links already in the workspace (or made by earlier entries)
		// among the entry's directories; see resolveLinks.
		target, apiErr := s.resolveLinks(target, false)
		if apiErr != nil {
			return nil, apiErr
		}
		switch hdr.Typeflag {
		case tar.TypeDir:
			if apiErr := s.mkdirAll("tar entry", target, fs.FileMode(hdr.Mode).Perm()|0o700); apiErr != nil {
				return nil, apiErr
			}
			res.Dirs++
		case tar.TypeReg:
			if clean == "." {
				return nil, api.Errorf(api.CodeInvalidArgument, "tar entry %q: a file cannot be the target directory", name)
			}
			n, apiErr := s.writeFile(target, tr, fs.FileMode(hdr.Mode).Perm(), hdr.Size)
			if apiErr != nil {
				return nil, apiErr
			}
			res.Files++
			res.Bytes += n
		case tar.TypeSymlink:
			if apiErr := s.putSymlink(target, hdr.Linkname); apiErr != nil {
				return nil, apiErr
			}
			res.Symlinks++
		default:
			return nil, api.Errorf(api.CodeInvalidArgument, "tar entry %q: type %q is not supported (only files, directories and symbolic links)", name, hdr.Typeflag)
		}
	}
}

// putSymlink creates (or atomically replaces) the symbolic link target
// pointing at linkname, which must stay inside the workspace lexically.
func (s *Server) putSymlink(target, linkname string) *api.Error {
	switch {
	case linkname == "" || strings.IndexByte(linkname, 0) >= 0:
		return api.Errorf(api.CodeInvalidArgument, "tar entry %q: invalid link target %q", target, linkname)
	case path.IsAbs(linkname):
		return api.Errorf(api.CodePathEscapesWorkspace, "tar entry %q: absolute link target %q is refused", target, linkname)
	}
	if resolved := path.Join(path.Dir(target), linkname); resolved == ".." || strings.HasPrefix(resolved, "../") {
		return api.Errorf(api.CodePathEscapesWorkspace, "tar entry %q: link target %q points out of the workspace", target, linkname)
	}
	dir := path.Dir(target)
	if apiErr := s.mkdirAll("tar entry", dir, 0o755); apiErr != nil {
		return apiErr
	}
	if fi, err := s.root.Lstat(target); err == nil && fi.IsDir() {
		return api.Errorf(api.CodeIsADirectory, "tar entry %q: is a directory", target)
	}
	tmp := path.Join(dir, tempName())
	if err := s.root.Symlink(linkname, tmp); err != nil {
		return fsError("tar entry", target, err)
	}
	if err := s.root.Rename(tmp, target); err != nil {
		_ = s.root.Remove(tmp)
		return fsError("tar entry", target, err)
	}
	return nil
}

func (s *Server) deletePath(rel string, recursive bool) *api.Error {
	if rel == "." {
		return api.Errorf(api.CodeInvalidArgument, "delete: the workspace itself cannot be deleted")
	}
	fi, err := s.root.Lstat(rel)
	if err != nil {
		return fsError("delete", rel, err)
	}
	if fi.IsDir() {
		if !recursive {
			return api.Errorf(api.CodeIsADirectory, "delete %q: is a directory; pass recursive=true to delete it and its contents", rel)
		}
		// RemoveAll through the root unlinks entries relative to open
		// directory descriptors and never follows symbolic links.
		err := s.root.RemoveAll(rel)
		// Whatever part was removed is uncounted either way.
		s.usage.invalidate()
		if err != nil {
			return fsError("delete", rel, err)
		}
		return nil
	}
	if err := s.root.Remove(rel); err != nil {
		return fsError("delete", rel, err)
	}
	if fi.Mode().IsRegular() {
		s.usage.removed(fi.Size())
	}
	return nil
}

// progressReader pushes the connection's read deadline forward while a
// request body keeps arriving.
type progressReader struct {
	r    io.Reader
	rc   *http.ResponseController
	last time.Time
}

func (p *progressReader) Read(b []byte) (int, error) {
	if now := time.Now(); now.Sub(p.last) > time.Second {
		p.last = now
		// Not every ResponseWriter supports deadlines (tests use
		// recorders); without one, the server's own timeout applies.
		_ = p.rc.SetReadDeadline(now.Add(fileIdleTimeout))
	}
	return p.r.Read(b)
}

// progressWriter pushes the connection's write deadline forward while a
// response body keeps moving.
type progressWriter struct {
	http.ResponseWriter
	rc   *http.ResponseController
	last time.Time
}

// ReadFrom is what http.ServeContent copies a file through. Without it
// io.Copy would read the file 32 KiB at a time, and under gVisor every
// read is a system call into the sentry.
func (p *progressWriter) ReadFrom(src io.Reader) (int64, error) {
	return io.CopyBuffer(writerOnly{p}, src, make([]byte, copyBufferSize))
}

// writerOnly hides progressWriter's ReadFrom from io.CopyBuffer, which
// would otherwise call it again.
type writerOnly struct{ io.Writer }

func (p *progressWriter) Write(b []byte) (int, error) {
	if now := time.Now(); now.Sub(p.last) > time.Second {
		p.last = now
		_ = p.rc.SetWriteDeadline(now.Add(fileIdleTimeout))
	}
	return p.ResponseWriter.Write(b)
}
