package workspace

import (
	"errors"
	"io"
	"net/http"
	"strings"
	"time"

	"github.com/agentbox/terraform-provider-agentbox/internal/contentcoding"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/httpcall"
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
	// TempPrefix names the temporary files writes go through. The usage
	// walk skips only the temporary files of writes in flight, so an
	// agent's own files with this prefix still count.
	TempPrefix = ".agentbox-tmp-"
	// fileIdleTimeout bounds how long a file transfer may make no
	// progress. The server's own read and write timeouts are sized for
	// commands, not for a gigabyte upload, so file handlers push the
	// deadlines forward as bytes move.
	fileIdleTimeout = time.Minute
	copyBufferSize  = 256 << 10
)

// ServeFiles serves the file endpoints under prefix (api.PathFiles,
// api.PathStat or api.PathList), every method: the path is confined to the
// workspace before the method is looked at.
func (ws *Workspace) ServeFiles(w http.ResponseWriter, r *http.Request, prefix string, info *httpcall.Info) {
	rel, apiErr := ws.Confine(strings.TrimPrefix(r.URL.Path, prefix))
	if apiErr != nil {
		info.Fail(w, apiErr)
		return
	}
	info.File = rel
	getOrHead := r.Method == http.MethodGet || r.Method == http.MethodHead
	switch {
	case prefix == api.PathStat && getOrHead:
		fi, apiErr := ws.Stat(rel)
		answer(w, info, fi, apiErr)
	case prefix == api.PathList && getOrHead:
		res, apiErr := ws.List(rel)
		answer(w, info, res, apiErr)
	case prefix == api.PathStat || prefix == api.PathList:
		httpcall.MethodNotAllowed(w, r, "GET, HEAD")
	case getOrHead:
		ws.serveGet(w, r, rel, info)
	case r.Method == http.MethodPut:
		ws.servePut(w, r, rel, info)
	case r.Method == http.MethodDelete:
		ws.serveDelete(w, r, rel, info)
	default:
		httpcall.MethodNotAllowed(w, r, "GET, HEAD, PUT, DELETE")
	}
}

// answer writes v, or fails with e.
func answer[T any](w http.ResponseWriter, info *httpcall.Info, v *T, e *api.Error) {
	if e != nil {
		info.Fail(w, e)
		return
	}
	httpcall.WriteJSON(w, http.StatusOK, v)
}

// serveGet sends a file, or a tar of a directory or file.
func (ws *Workspace) serveGet(w http.ResponseWriter, r *http.Request, rel string, info *httpcall.Info) {
	format := r.URL.Query().Get("format")
	if format == "" && acceptsTar(r.Header.Get("Accept")) {
		format = api.FormatTar
	}
	var apiErr *api.Error
	switch format {
	case "":
		apiErr = ws.getFile(w, r, rel, info)
	case api.FormatTar:
		apiErr = ws.getTar(w, r, rel, info)
	default:
		apiErr = api.Errorf(api.CodeInvalidArgument, "format must be %q or absent, not %q", api.FormatTar, format)
	}
	if apiErr != nil {
		info.Fail(w, apiErr)
	}
}

// servePut writes a file, or extracts a tar into a directory. A body
// in a content coding (Content-Encoding) is decoded as it is written; its
// decoded length, when the caller sends it, stands for Content-Length.
func (ws *Workspace) servePut(w http.ResponseWriter, r *http.Request, rel string, info *httpcall.Info) {
	q := r.URL.Query()
	var body io.Reader = &progressReader{r: r.Body, rc: http.NewResponseController(w)}
	size := r.ContentLength
	coding, err := contentcoding.Of(r.Header)
	if err != nil {
		info.Fail(w, api.Errorf(api.CodeInvalidArgument, "put %q: %v", rel, err))
		return
	}
	if coding != "" {
		if size, err = contentcoding.DecodedLength(r.Header); err != nil {
			info.Fail(w, api.Errorf(api.CodeInvalidArgument, "put %q: %v", rel, err))
			return
		}
		dec, err := contentcoding.NewReader(coding, body)
		if err != nil {
			info.Fail(w, api.Errorf(api.CodeInternal, "put %q: %v", rel, err))
			return
		}
		defer dec.Close()
		body = dec
	}
	switch format := q.Get("format"); format {
	case "":
		fi, apiErr := ws.PutFile(rel, body, q.Get("mode"), size)
		answer(w, info, fi, apiErr)
	case api.FormatTar:
		var keepLinks bool
		switch v := q.Get(api.QueryLinks); v {
		case "":
		case api.LinksKeep:
			keepLinks = true
		default:
			info.Fail(w, api.Errorf(api.CodeInvalidArgument, "%s must be %q or absent, not %q", api.QueryLinks, api.LinksKeep, v))
			return
		}
		res, apiErr := ws.putTar(rel, body, keepLinks)
		answer(w, info, res, apiErr)
	default:
		info.Fail(w, api.Errorf(api.CodeInvalidArgument, "format must be %q or absent, not %q", api.FormatTar, format))
	}
}

// serveDelete deletes a file, or a directory with ?recursive=true.
func (ws *Workspace) serveDelete(w http.ResponseWriter, r *http.Request, rel string, info *httpcall.Info) {
	recursive := false
	switch v := r.URL.Query().Get("recursive"); v {
	case "", "false":
	case "true":
		recursive = true
	default:
		info.Fail(w, api.Errorf(api.CodeInvalidArgument, "recursive must be true or false, not %q", v))
		return
	}
	if apiErr := ws.Delete(rel, recursive); apiErr != nil {
		info.Fail(w, apiErr)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

func (ws *Workspace) getFile(w http.ResponseWriter, r *http.Request, rel string, info *httpcall.Info) *api.Error {
	f, fi, apiErr := ws.OpenRegular("get", rel)
	if apiErr != nil {
		return apiErr
	}
	defer f.Close()
	h := w.Header()
	// Set before ServeContent so it does not sniff the content.
	h.Set("Content-Type", "application/octet-stream")
	h.Set("X-Content-Type-Options", "nosniff")
	h.Set("Cache-Control", "no-store")
	h.Set("Vary", "Accept-Encoding")
	pw := &progressWriter{ResponseWriter: w, rc: http.NewResponseController(w)}
	if coding := codeDownload(r, f, fi.Size()); coding != "" {
		zw, err := contentcoding.NewWriter(coding, writerOnly{pw})
		if err != nil {
			return api.Errorf(api.CodeInternal, "get %q: %v", rel, err)
		}
		contentcoding.SetCoded(h, coding, fi.Size())
		w.WriteHeader(http.StatusOK)
		_, err = zw.ReadFrom(io.NewSectionReader(f, 0, fi.Size()))
		if cerr := zw.Close(); err == nil {
			err = cerr
		}
		if err != nil {
			// The status is sent; the connection is cut, which is what
			// tells the caller the body is incomplete.
			info.Abort(err)
		}
		return nil
	}
	// ServeContent sends Content-Length and serves ranges, so a client can
	// resume a large download.
	http.ServeContent(pw, r, fi.Name(), fi.ModTime(), f)
	return nil
}

// codeDownload returns the content coding a download goes in, or "":
// the caller accepts one, wants the whole file (ranges address the file's
// own bytes, so a ranged download is served as it is), and the file's
// start compresses (see contentcoding.Compressible).
func codeDownload(r *http.Request, f io.ReaderAt, size int64) string {
	coding := contentcoding.Preferred(r.Header)
	if r.Method != http.MethodGet || r.Header.Get("Range") != "" || coding == "" {
		return ""
	}
	sample := make([]byte, min(size, contentcoding.SampleSize))
	n, err := f.ReadAt(sample, 0)
	if err != nil && !errors.Is(err, io.EOF) || !contentcoding.Compressible(sample[:n], size) {
		return ""
	}
	return coding
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
