package supervisor

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
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

// serveManifest handles GET /v1/manifest/{dir}, the listing a filespace
// sync compares with the control plane's copy, and reports whether the
// path was its own.
func (s *Server) serveManifest(w *recorder, r *http.Request, info *requestInfo) bool {
	if !strings.HasPrefix(r.URL.Path, api.PathManifest) {
		return false
	}
	if r.Method != http.MethodGet && r.Method != http.MethodHead {
		methodNotAllowed(w, r, "GET, HEAD")
		return true
	}
	if s.root == nil {
		info.fail(w, api.Errorf(api.CodeUnavailable, "this supervisor serves no workspace (%s does not exist)", DefaultWorkspace))
		return true
	}
	rel, apiErr := s.confine(strings.TrimPrefix(r.URL.Path, api.PathManifest))
	if apiErr == nil {
		rel, apiErr = s.resolveLinks(rel, true)
	}
	if apiErr != nil {
		info.fail(w, apiErr)
		return true
	}
	info.file = rel
	m, apiErr := s.manifest(r, rel)
	if apiErr != nil {
		info.fail(w, apiErr)
		return true
	}
	writeJSON(w, http.StatusOK, m)
	return true
}

func (s *Server) manifest(r *http.Request, rel string) (*api.Manifest, *api.Error) {
	st, err := s.root.Stat(rel)
	if err != nil {
		return nil, fsError("manifest", rel, err)
	}
	if !st.IsDir() {
		return nil, api.Errorf(api.CodeNotADirectory, "manifest %q: not a directory", rel)
	}
	m := &api.Manifest{Path: rel, Files: []api.ManifestEntry{}, CapBytes: s.usage.cap}
	var buf []byte // allocated on the first file the cache does not know
	seen := map[string]struct{}{}
	err = walkRoot(s.root, rel, func(p string, fi fs.FileInfo) error {
		if err := r.Context().Err(); err != nil {
			return err
		}
		switch {
		case fi.IsDir():
			return nil
		case !fi.Mode().IsRegular():
			m.Skipped++
			return nil
		case s.inFlight(p):
			return nil
		}
		seen[p] = struct{}{}
		e, err := s.hashFile(p, &buf)
		if errors.Is(err, fs.ErrNotExist) {
			// Removed since the directory was read.
			return nil
		}
		if err != nil {
			return err
		}
		if e == nil {
			m.Skipped++
			return nil
		}
		m.Files = append(m.Files, *e)
		m.TotalBytes += e.Size
		return nil
	})
	if err != nil {
		return nil, fsError("manifest", rel, err)
	}
	s.digests.keep(rel, seen)
	return m, nil
}

// inFlight reports whether p is the temporary file of a write in progress,
// which is not (yet) a file of the workspace.
func (s *Server) inFlight(p string) bool {
	if !strings.HasPrefix(path.Base(p), tempPrefix) {
		return false
	}
	s.usage.mu.Lock()
	defer s.usage.mu.Unlock()
	_, ok := s.usage.temps[p]
	return ok
}

// hashFile describes the regular file p with its digest, or returns nil if
// it is no longer a regular file. Size and digest are of the bytes read,
// so they agree even if the file changes meanwhile; a digest the cache
// holds for the file as it is now is not read again.
func (s *Server) hashFile(p string, buf *[]byte) (*api.ManifestEntry, error) {
	// O_NONBLOCK: a FIFO swapped in since the Lstat must not block.
	f, err := s.root.OpenFile(p, os.O_RDONLY|syscall.O_NONBLOCK|syscall.O_NOFOLLOW, 0)
	if err != nil {
		if errors.Is(err, syscall.ELOOP) {
			return nil, nil
		}
		return nil, err
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return nil, err
	}
	if !fi.Mode().IsRegular() {
		return nil, nil
	}
	e := &api.ManifestEntry{Path: p, Size: fi.Size(), ModTime: fi.ModTime().UTC(), Mode: formatMode(fi.Mode())}
	if sum, ok := s.digests.get(p, fi); ok {
		e.SHA256 = sum
		return e, nil
	}
	if *buf == nil {
		*buf = make([]byte, copyBufferSize)
	}
	hashedAt := time.Now()
	h := sha256.New()
	n, err := io.CopyBuffer(h, f, *buf)
	if err != nil {
		return nil, err
	}
	e.Size, e.SHA256 = n, hex.EncodeToString(h.Sum(nil))
	if n == fi.Size() {
		s.digests.put(p, fi, e.SHA256, hashedAt)
	}
	return e, nil
}
