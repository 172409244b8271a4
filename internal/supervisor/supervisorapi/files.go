package supervisorapi

import (
	"context"
	"fmt"
	"io"
	"io/fs"
	"net/http"
	"net/url"
	"strconv"
	"strings"

	"github.com/agentbox/terraform-provider-agentbox/internal/contentcoding"
	"github.com/agentbox/terraform-provider-agentbox/internal/wire"
)

// FilePath returns the URL path of endpoint prefix (PathFiles, PathStat or
// PathList) for the workspace path p. Each segment is percent-escaped, so
// names with "?", "#" or "%" survive; ".." is sent as it is, for the
// supervisor to refuse.
func FilePath(prefix, p string) string {
	segs := strings.Split(p, "/")
	for i, s := range segs {
		segs[i] = url.PathEscape(s)
	}
	return prefix + strings.Join(segs, "/")
}

// PutFile writes body to the workspace file at path, atomically: readers
// see the old content or the new, never a mix, and a failed write (for
// example one that would pass the workspace cap, CodeWorkspaceFull) leaves
// the old content intact. Parent directories are created. mode 0 means
// DefaultFileMode; only permission bits are accepted.
func (c *Client) PutFile(ctx context.Context, path string, body io.Reader, mode fs.FileMode) (*FileInfo, error) {
	q := url.Values{}
	if mode != 0 {
		q.Set("mode", fmt.Sprintf("%04o", uint32(mode)))
	}
	resp, err := c.stream(ctx, http.MethodPut, FilePath(PathFiles, path), q, body, "application/octet-stream", "application/json")
	if err != nil {
		return nil, err
	}
	var fi FileInfo
	if err := c.decodeJSON(resp, &fi); err != nil {
		return nil, err
	}
	return &fi, nil
}

// PutFileCoded is PutFile for a body in content coding (see package
// contentcoding) whose decoded length is decodedLen (-1 if unknown): the
// supervisor decodes it as it writes, and checks the decoded length
// against the workspace cap before reading, as PutFile does with a Sized
// body. Send it only in a coding the supervisor named (AcceptsCoding);
// one that does not know the coding would store the coded bytes.
func (c *Client) PutFileCoded(ctx context.Context, path string, body io.Reader, coding string, decodedLen int64, mode fs.FileMode) (*FileInfo, error) {
	q := url.Values{}
	if mode != 0 {
		q.Set("mode", fmt.Sprintf("%04o", uint32(mode)))
	}
	h := http.Header{}
	contentcoding.SetCoded(h, coding, decodedLen)
	resp, err := c.transport().Send(ctx, wire.Request{Method: http.MethodPut, Path: FilePath(PathFiles, path), Query: q, Body: body,
		ContentType: "application/octet-stream", Accept: "application/json", Header: h})
	if err != nil {
		return nil, err
	}
	var fi FileInfo
	if err := c.decodeJSON(resp, &fi); err != nil {
		return nil, err
	}
	return &fi, nil
}

// CodedFile is a download that may be coded.
type CodedFile struct {
	// Body is the content as sent; the caller closes it.
	Body io.ReadCloser
	// Coding is Body's content coding, "" for none; DecodedLength is
	// then the file's length (-1 if the supervisor did not say).
	Coding        string
	DecodedLength int64
}

// GetFileCoded is GetFile taking the content coded, with accept as the
// request's Accept-Encoding. The supervisor codes only content worth it,
// so the answer may come as it is (CodedFile.Coding ""); a supervisor of
// a version before the codings always answers that way.
func (c *Client) GetFileCoded(ctx context.Context, path, accept string) (*CodedFile, error) {
	resp, err := c.transport().Send(ctx, wire.Request{Method: http.MethodGet, Path: FilePath(PathFiles, path),
		Accept: "application/octet-stream", Header: http.Header{"Accept-Encoding": {accept}}})
	if err != nil {
		return nil, err
	}
	coding, err := contentcoding.Of(resp.Header)
	if err != nil {
		resp.Body.Close()
		return nil, fmt.Errorf("supervisor GET %s: %w", path, err)
	}
	f := &CodedFile{Body: resp.Body, Coding: coding, DecodedLength: -1}
	if coding != "" {
		if n, err := contentcoding.DecodedLength(resp.Header); err == nil {
			f.DecodedLength = n
		}
	}
	return f, nil
}

// Sized declares that body holds exactly n bytes, for a PutFile or PutTar
// body whose length http cannot see (a request body being forwarded). The
// supervisor then refuses a write that cannot fit before reading it, and
// one that delivers a different number of bytes changes nothing.
func Sized(body io.Reader, n int64) io.Reader { return wire.Sized(body, n) }

// GetFile streams the workspace file at path. The caller closes the
// reader. A directory is CodeIsADirectory; use GetTar for one.
func (c *Client) GetFile(ctx context.Context, path string) (io.ReadCloser, error) {
	resp, err := c.stream(ctx, http.MethodGet, FilePath(PathFiles, path), nil, nil, "", "application/octet-stream")
	if err != nil {
		return nil, err
	}
	return resp.Body, nil
}

// GetTar streams the directory at path (or a single file) as an
// uncompressed tar whose names are relative to path. Symbolic links are
// stored as links, not followed. The caller closes the reader; a read
// error before the tar's end means the supervisor aborted the stream.
func (c *Client) GetTar(ctx context.Context, path string) (io.ReadCloser, error) {
	q := url.Values{"format": {FormatTar}}
	resp, err := c.stream(ctx, http.MethodGet, FilePath(PathFiles, path), q, nil, "", ContentTypeTar)
	if err != nil {
		return nil, err
	}
	return resp.Body, nil
}

// PutTar extracts the tar stream into the directory at dir, creating it.
// Every entry is confined to the workspace like a PutFile path, and every
// file is written atomically; an entry that fails stops the extraction,
// and the entries before it stay.
func (c *Client) PutTar(ctx context.Context, dir string, tarStream io.Reader) (*TarResult, error) {
	return c.putTar(ctx, dir, tarStream, url.Values{"format": {FormatTar}})
}

// RestoreTar is PutTar for a snapshot's restore: symbolic links are
// extracted as they were taken, those whose targets are absolute or lead
// out of the workspace included (see QueryLinks).
func (c *Client) RestoreTar(ctx context.Context, dir string, tarStream io.Reader) (*TarResult, error) {
	return c.putTar(ctx, dir, tarStream, url.Values{"format": {FormatTar}, QueryLinks: {LinksKeep}})
}

func (c *Client) putTar(ctx context.Context, dir string, tarStream io.Reader, q url.Values) (*TarResult, error) {
	resp, err := c.stream(ctx, http.MethodPut, FilePath(PathFiles, dir), q, tarStream, ContentTypeTar, "application/json")
	if err != nil {
		return nil, err
	}
	var res TarResult
	if err := c.decodeJSON(resp, &res); err != nil {
		return nil, err
	}
	return &res, nil
}

// Delete removes the file or symbolic link at path; a directory needs
// recursive. A missing path is CodeNotFound.
func (c *Client) Delete(ctx context.Context, path string, recursive bool) error {
	var q url.Values
	if recursive {
		q = url.Values{"recursive": {"true"}}
	}
	resp, err := c.stream(ctx, http.MethodDelete, FilePath(PathFiles, path), q, nil, "", "application/json")
	if err != nil {
		return err
	}
	_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 1<<16))
	return resp.Body.Close()
}

// Stat describes the workspace path, without following a final symbolic
// link.
func (c *Client) Stat(ctx context.Context, path string) (*FileInfo, error) {
	var fi FileInfo
	if err := c.getJSON(ctx, FilePath(PathStat, path), &fi); err != nil {
		return nil, err
	}
	return &fi, nil
}

// List returns the entries of the workspace directory at path.
func (c *Client) List(ctx context.Context, path string) (*ListResult, error) {
	var res ListResult
	if err := c.getJSON(ctx, FilePath(PathList, path), &res); err != nil {
		return nil, err
	}
	return &res, nil
}

func (c *Client) getJSON(ctx context.Context, path string, out any) error {
	resp, err := c.stream(ctx, http.MethodGet, path, nil, nil, "", "application/json")
	if err != nil {
		return err
	}
	return c.decodeJSON(resp, out)
}

// stream sends a request whose body (if any) is streamed, and returns the
// response of a 2xx status with its body unread; any other status is
// returned as *Error.
func (c *Client) stream(ctx context.Context, method, path string, q url.Values, body io.Reader, contentType, accept string) (*http.Response, error) {
	return c.transport().Send(ctx, wire.Request{Method: method, Path: path, Query: q, Body: body, ContentType: contentType, Accept: accept})
}

func (c *Client) decodeJSON(resp *http.Response, out any) error {
	return c.transport().DecodeJSON(resp, out)
}

// ParseMode parses an octal permission string such as "0644" or "755".
// Only permission bits (0777) are accepted.
func ParseMode(s string) (fs.FileMode, error) {
	v, err := strconv.ParseUint(s, 8, 32)
	if err != nil {
		return 0, fmt.Errorf("mode %q is not an octal number: %w", s, err)
	}
	if v > 0o777 {
		return 0, fmt.Errorf("mode %q has bits other than permissions (0777)", s)
	}
	return fs.FileMode(v), nil
}
