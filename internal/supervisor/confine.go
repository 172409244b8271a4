package supervisor

import (
	"io/fs"
	"path"
	"strings"

	api "github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"
)

// maxLinkHops bounds symbolic link resolution, as the kernel's MAXSYMLINKS.
const maxLinkHops = 40

// confine is relPath followed by resolveLinks for the directory
// components: the path every file operation starts from.
func (s *Server) confine(p string) (string, *api.Error) {
	rel, apiErr := s.relPath(p)
	if apiErr != nil {
		return "", apiErr
	}
	return s.resolveLinks(rel, false)
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
func (s *Server) resolveLinks(rel string, final bool) (string, *api.Error) {
	if s.root == nil || rel == "." {
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
		fi, err := s.root.Lstat(cur)
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
		target, err := s.root.Readlink(cur)
		if err != nil {
			return "", fsError("resolve", rel, err)
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
