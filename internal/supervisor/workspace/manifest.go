package workspace

import (
	"context"
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

	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/httpcall"
	api "github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"
)

// ServeManifest serves GET /v1/manifest/{dir}, the listing a filespace
// sync compares with the control plane's copy.
func (ws *Workspace) ServeManifest(w http.ResponseWriter, r *http.Request, info *httpcall.Info) {
	rel, apiErr := ws.Confine(strings.TrimPrefix(r.URL.Path, api.PathManifest))
	if apiErr == nil {
		rel, apiErr = ws.resolveLinks(rel, true)
	}
	if apiErr != nil {
		info.Fail(w, apiErr)
		return
	}
	info.File = rel
	m, apiErr := ws.Manifest(r.Context(), rel)
	answer(w, info, m, apiErr)
}

// Manifest lists the regular files under the directory rel, already
// confined, with their digests, leaving out api.PlatformDir.
func (ws *Workspace) Manifest(ctx context.Context, rel string) (*api.Manifest, *api.Error) {
	st, err := ws.root.Stat(rel)
	if err != nil {
		return nil, FSError("manifest", rel, err)
	}
	if !st.IsDir() {
		return nil, api.Errorf(api.CodeNotADirectory, "manifest %q: not a directory", rel)
	}
	m := &api.Manifest{Path: rel, Files: []api.ManifestEntry{}, CapBytes: ws.usage.cap}
	var buf []byte // allocated on the first file the cache does not know
	seen := map[string]struct{}{}
	err = walkRoot(ws.root, rel, func(p string, fi fs.FileInfo) error {
		if err := ctx.Err(); err != nil {
			return err
		}
		switch {
		case p == api.PlatformDir && fi.IsDir():
			// The platform's own state (cached Python environments):
			// not the agent's files, and not to be synced.
			return fs.SkipDir
		case fi.IsDir():
			return nil
		case !fi.Mode().IsRegular():
			m.Skipped++
			return nil
		case ws.inFlight(p):
			return nil
		}
		seen[p] = struct{}{}
		e, err := ws.hashFile(p, &buf)
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
		return nil, FSError("manifest", rel, err)
	}
	ws.digests.keep(rel, seen)
	return m, nil
}

// inFlight reports whether p is the temporary file of a write in progress,
// which is not (yet) a file of the workspace.
func (ws *Workspace) inFlight(p string) bool {
	if !strings.HasPrefix(path.Base(p), TempPrefix) {
		return false
	}
	ws.usage.mu.Lock()
	defer ws.usage.mu.Unlock()
	_, ok := ws.usage.temps[p]
	return ok
}

// hashFile describes the regular file p with its digest, or returns nil if
// it is no longer a regular file. Size and digest are of the bytes read,
// so they agree even if the file changes meanwhile; a digest the cache
// holds for the file as it is now is not read again.
func (ws *Workspace) hashFile(p string, buf *[]byte) (*api.ManifestEntry, error) {
	// O_NONBLOCK: a FIFO swapped in since the Lstat must not block.
	f, err := ws.root.OpenFile(p, os.O_RDONLY|syscall.O_NONBLOCK|syscall.O_NOFOLLOW, 0)
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
	if sum, ok := ws.digests.get(p, fi); ok {
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
		ws.digests.put(p, fi, e.SHA256, hashedAt)
	}
	return e, nil
}
