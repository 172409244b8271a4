package workspace

import (
	api "github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"

	"archive/tar"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net/http"
	"os"
	"path"
	"strings"
	"syscall"

	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/httpcall"
)

// getTar streams rel as a tar. Errors before the first byte are returned;
// after it, the response can only be cut off, so that the client sees a
// broken stream rather than a tar that looks complete.
func (ws *Workspace) getTar(w http.ResponseWriter, r *http.Request, rel string, info *httpcall.Info) *api.Error {
	rel, apiErr := ws.resolveLinks(rel, true)
	if apiErr != nil {
		return apiErr
	}
	st, err := ws.root.Stat(rel)
	if err != nil {
		return FSError("get", rel, err)
	}
	var sub *os.Root
	var single string
	if st.IsDir() {
		// A root on the directory itself: the tar can hold nothing from
		// outside it, even through a link swapped in during the walk.
		if sub, err = ws.root.OpenRoot(rel); err != nil {
			return FSError("get", rel, err)
		}
	} else {
		dir := path.Dir(rel)
		if sub, err = ws.root.OpenRoot(dir); err != nil {
			return FSError("get", rel, err)
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
			info.Abort(fmt.Errorf("tar %q: %w", rel, err))
			return nil
		}
	} else if err := walkRoot(sub, ".", add); err != nil {
		info.Abort(fmt.Errorf("tar %q: %w", rel, err))
		return nil
	}
	if err := tw.Close(); err != nil {
		info.Abort(fmt.Errorf("tar %q: %w", rel, err))
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

// putTar extracts a tar stream into the directory rel. Each entry is
// checked like a request path, relative to rel, and written through the
// same os.Root, so neither a "../" name nor a symbolic link (from the tar
// or already in the workspace) can place a file outside. Symbolic link
// entries whose target is absolute or climbs out of the workspace are
// refused outright, although os.Root would refuse to follow them anyway:
// such a link is never useful inside the sandbox and the early error is
// clearer. Hard links and special files are refused.
//
// keepLinks (api.LinksKeep, a snapshot's restore) extracts those links as
// they are instead: commands made them (a venv's bin/python is a link to
// the image's interpreter), and the restore gives the workspace back as
// they left it. Extraction still never goes through such a link: entries
// under it are refused as above, and the supervisor's own path resolution
// refuses them too.
func (ws *Workspace) putTar(rel string, body io.Reader, keepLinks bool) (*api.TarResult, *api.Error) {
	if apiErr := ws.mkdirAll("put", rel, 0o755); apiErr != nil {
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
		if t, _ := ws.RelPath(target); t != target {
			return nil, api.Errorf(api.CodePathEscapesWorkspace, "tar entry %q climbs out of the workspace", name)
		}
		// Links already in the workspace (or made by earlier entries)
		// among the entry's directories; see resolveLinks.
		target, apiErr := ws.resolveLinks(target, false)
		if apiErr != nil {
			return nil, apiErr
		}
		switch hdr.Typeflag {
		case tar.TypeDir:
			if apiErr := ws.mkdirAll("tar entry", target, fs.FileMode(hdr.Mode).Perm()|0o700); apiErr != nil {
				return nil, apiErr
			}
			res.Dirs++
		case tar.TypeReg:
			if clean == "." {
				return nil, api.Errorf(api.CodeInvalidArgument, "tar entry %q: a file cannot be the target directory", name)
			}
			n, apiErr := ws.WriteFile(target, tr, fs.FileMode(hdr.Mode).Perm(), hdr.Size)
			if apiErr != nil {
				return nil, apiErr
			}
			res.Files++
			res.Bytes += n
		case tar.TypeSymlink:
			if apiErr := ws.putSymlink(target, hdr.Linkname, keepLinks); apiErr != nil {
				return nil, apiErr
			}
			res.Symlinks++
		default:
			return nil, api.Errorf(api.CodeInvalidArgument, "tar entry %q: type %q is not supported (only files, directories and symbolic links)", name, hdr.Typeflag)
		}
	}
}

// putSymlink creates (or atomically replaces) the symbolic link target
// pointing at linkname, which must stay inside the workspace lexically
// unless keep is set.
func (ws *Workspace) putSymlink(target, linkname string, keep bool) *api.Error {
	switch {
	case linkname == "" || strings.IndexByte(linkname, 0) >= 0:
		return api.Errorf(api.CodeInvalidArgument, "tar entry %q: invalid link target %q", target, linkname)
	case path.IsAbs(linkname) && !keep:
		return api.Errorf(api.CodePathEscapesWorkspace, "tar entry %q: absolute link target %q is refused", target, linkname)
	}
	if resolved := path.Join(path.Dir(target), linkname); !keep && (resolved == ".." || strings.HasPrefix(resolved, "../")) {
		return api.Errorf(api.CodePathEscapesWorkspace, "tar entry %q: link target %q points out of the workspace", target, linkname)
	}
	dir := path.Dir(target)
	if apiErr := ws.mkdirAll("tar entry", dir, 0o755); apiErr != nil {
		return apiErr
	}
	if fi, err := ws.root.Lstat(target); err == nil && fi.IsDir() {
		return api.Errorf(api.CodeIsADirectory, "tar entry %q: is a directory", target)
	}
	tmp := path.Join(dir, tempName())
	if err := ws.root.Symlink(linkname, tmp); err != nil {
		return FSError("tar entry", target, err)
	}
	if err := ws.root.Rename(tmp, target); err != nil {
		_ = ws.root.Remove(tmp)
		return FSError("tar entry", target, err)
	}
	return nil
}
