package workspace

import (
	"errors"
	"io/fs"
	"os"
	"path"
	"strings"
	"syscall"

	api "github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"
)

// maxLinkHops bounds symbolic link resolution, as the kernel's MAXSYMLINKS.
const maxLinkHops = 40

// Confine is relPath followed by resolveLinks for the directory
// components: the path every file operation starts from.
func (ws *Workspace) Confine(p string) (string, *api.Error) {
	rel, apiErr := ws.RelPath(p)
	if apiErr != nil {
		return "", apiErr
	}
	return ws.resolveLinks(rel, false)
}

// resolveLinks returns rel with the symbolic links among its directory
// components (and its last component too, with final) replaced by the
// paths they point to, so that what it returns has only real directories
// before its last component. A link that leads out of the workspace, or
// is absolute, is refused.
//
// os.Root alone is not enough under gVisor: it notices a link among the
// directories by opening each with O_NOFOLLOW|O_DIRECTORY and getting
// ELOOP or ENOTDIR, but gVisor's openat follows the link instead, and
// os.Root then walks out of the workspace unawares (the gVisor pod test
// read /etc/passwd and wrote /tmp through planted links). Lstat of a path
// whose directories are real directories behaves the same on Linux and
// gVisor, so the walk here is safe on both. Code in the sandbox could
// swap a directory for a link between this walk and the operation; it
// runs as the same user as the supervisor and can reach those files
// itself, so the race gains it nothing.
func (ws *Workspace) resolveLinks(rel string, final bool) (string, *api.Error) {
	if ws.root == nil || rel == "." {
		return rel, nil
	}
	parts := strings.Split(rel, "/")
	var done []string
	for hops := 0; len(parts) > 0; {
		p := parts[0]
		cur := path.Join(append(done, p)...)
		if len(parts) == 1 && !final {
			done = append(done, p)
			break
		}
		fi, err := ws.root.Lstat(cur)
		if err != nil || fi.Mode()&fs.ModeSymlink == 0 {
			// A real entry, or none (the operation will say so): it is
			// taken as it is.
			done = append(done, p)
			parts = parts[1:]
			continue
		}
		if hops++; hops > maxLinkHops {
			return "", api.Errorf(api.CodeInvalidArgument, "path %q: too many levels of symbolic links", rel)
		}
		target, err := ws.root.Readlink(cur)
		if err != nil {
			return "", FSError("resolve", rel, err)
		}
		if path.IsAbs(target) {
			return "", api.Errorf(api.CodePathEscapesWorkspace,
				"path %q: %s is a symbolic link to the absolute path %q; links in the workspace must be relative and stay inside it", rel, cur, target)
		}
		next := path.Join(path.Join(done...), target)
		if next == ".." || strings.HasPrefix(next, "../") {
			return "", api.Errorf(api.CodePathEscapesWorkspace, "path %q: %s is a symbolic link to %q, which leads out of the workspace", rel, cur, target)
		}
		done = nil
		parts = append(strings.Split(next, "/"), parts[1:]...)
		if next == "." {
			parts = parts[1:]
		}
	}
	if len(done) == 0 {
		return ".", nil
	}
	return path.Join(done...), nil
}

// RelPath turns a request path into a clean slash-separated path relative
// to the workspace ("." for the workspace itself). An absolute path is
// accepted only under the workspace. This is the lexical half of
// confinement, for clear errors; os.Root does the half that matters.
func (ws *Workspace) RelPath(p string) (string, *api.Error) {
	if strings.IndexByte(p, 0) >= 0 {
		return "", api.Errorf(api.CodeInvalidArgument, "path contains a NUL byte")
	}
	if strings.HasPrefix(p, "/") {
		clean := path.Clean(p)
		for _, ws := range append([]string{ws.dir}, ws.aliases...) {
			switch {
			case clean == ws:
				return ".", nil
			case strings.HasPrefix(clean, ws+"/"):
				return clean[len(ws)+1:], nil
			}
		}
		return "", api.Errorf(api.CodePathEscapesWorkspace, "absolute path %q is outside the workspace %s", p, ws.dir)
	}
	clean := path.Clean(p)
	if clean == ".." || strings.HasPrefix(clean, "../") {
		return "", api.Errorf(api.CodePathEscapesWorkspace, "path %q climbs out of the workspace", p)
	}
	return clean, nil
}

// FSError turns an error from an os.Root operation into a typed error
// that names the workspace-relative path, never the host path.
func FSError(op, rel string, err error) *api.Error {
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
