package supervisor

import (
	"archive/tar"
	"bytes"
	"context"
	"crypto/rand"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"testing"
	"time"

	api "github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/workspace"
)

// fileServer is a supervisor on a real HTTP listener with a temporary
// workspace, and a client for it.
type fileServer struct {
	s      *Server
	ws     string
	client *api.Client
	url    string
}

func newFileServer(t testing.TB, cfg Config) *fileServer {
	t.Helper()
	if cfg.Workspace == "" {
		cfg.Workspace = t.TempDir()
	}
	s := newServer(t, cfg)
	t.Cleanup(func() { s.Close() })
	srv := httptest.NewServer(s)
	t.Cleanup(srv.Close)
	return &fileServer{s: s, ws: s.Workspace(), client: api.NewClient(srv.URL, srv.Client()), url: srv.URL}
}

// raw sends a request with the path exactly as given (no escaping), so
// that tests can send what a hostile caller would.
func (f *fileServer) raw(t testing.TB, method, target string, body io.Reader, header ...string) (int, []byte, http.Header) {
	t.Helper()
	req, err := http.NewRequest(method, f.url+target, body)
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Set(header[i], header[i+1])
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp.StatusCode, data, resp.Header
}

func wantCode(t testing.TB, what string, err error, code api.Code) {
	t.Helper()
	var e *api.Error
	if !errors.As(err, &e) {
		t.Fatalf("%s: %v, want a typed %s error", what, err, code)
	}
	if e.Code != code || e.Status != code.HTTPStatus() {
		t.Fatalf("%s: %s (%d) %q, want %s (%d)", what, e.Code, e.Status, e.Message, code, code.HTTPStatus())
	}
}

func mustWrite(t testing.TB, name string, data []byte) {
	t.Helper()
	if err := os.MkdirAll(filepath.Dir(name), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(name, data, 0o644); err != nil {
		t.Fatal(err)
	}
}

// readAll returns a function that reads a GetFile or GetTar result, so
// that the call can be passed as its arguments.
func readAll(t testing.TB) func(io.ReadCloser, error) []byte {
	return func(rc io.ReadCloser, err error) []byte {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
		defer rc.Close()
		data, err := io.ReadAll(rc)
		if err != nil {
			t.Fatal(err)
		}
		return data
	}
}

func randomBytes(t testing.TB, n int) []byte {
	t.Helper()
	b := make([]byte, n)
	if _, err := rand.Read(b); err != nil {
		t.Fatal(err)
	}
	return b
}

func countTemps(dir string) int {
	n := 0
	_ = filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err == nil && strings.HasPrefix(d.Name(), workspace.TempPrefix) {
			n++
		}
		return nil
	})
	return n
}

func waitFor(t testing.TB, what string, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); !cond(); time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
	}
}

// noTemps fails if a write left a temporary file anywhere in dir.
func noTemps(t testing.TB, dir string) {
	t.Helper()
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err == nil && strings.HasPrefix(d.Name(), workspace.TempPrefix) {
			t.Errorf("temporary file left behind: %s", p)
		}
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
}

func TestFilesRoundTrip(t *testing.T) {
	f := newFileServer(t, Config{})
	c, ctx := f.client, context.Background()

	// Binary content, all 256 byte values, through a new directory.
	content := append(randomBytes(t, 100_000), []byte("\x00\xff\r\n")...)
	fi, err := c.PutFile(ctx, "a/b/data.bin", bytes.NewReader(content), 0o600)
	if err != nil {
		t.Fatal(err)
	}
	if fi.Name != "data.bin" || fi.Path != "a/b/data.bin" || fi.Size != int64(len(content)) || fi.Mode != "0600" || fi.IsDir || fi.IsSymlink {
		t.Fatalf("PutFile = %+v", fi)
	}
	if st, err := os.Stat(filepath.Join(f.ws, "a/b/data.bin")); err != nil || st.Mode().Perm() != 0o600 {
		t.Fatalf("on disk: %v %v", st, err)
	}
	if got := readAll(t)(c.GetFile(ctx, "a/b/data.bin")); !bytes.Equal(got, content) {
		t.Fatalf("GetFile returned %d bytes that differ from the %d written", len(got), len(content))
	}
	// Absolute paths under the workspace are the same files.
	if got := readAll(t)(c.GetFile(ctx, filepath.Join(f.ws, "a/b/data.bin"))); !bytes.Equal(got, content) {
		t.Fatal("absolute path under the workspace returned other content")
	}
	// No Content-Length: the answer goes chunked, to carry the
	// supervisor's record of the call as its trailer.
	status, body, hdr := f.raw(t, http.MethodGet, "/v1/files/a/b/data.bin", nil)
	if status != 200 || hdr.Get("Content-Type") != "application/octet-stream" || !bytes.Equal(body, content) {
		t.Fatalf("raw GET: %d %v", status, hdr)
	}
	// Ranges let a client resume.
	status, body, _ = f.raw(t, http.MethodGet, "/v1/files/a/b/data.bin", nil, "Range", "bytes=10-19")
	if status != http.StatusPartialContent || !bytes.Equal(body, content[10:20]) {
		t.Fatalf("range GET: %d %q", status, body)
	}

	// Overwrite with the default mode; an empty file is a file.
	if fi, err = c.PutFile(ctx, "a/b/data.bin", strings.NewReader("v2"), 0); err != nil || fi.Size != 2 || fi.Mode != "0644" {
		t.Fatalf("overwrite: %+v %v", fi, err)
	}
	if fi, err = c.PutFile(ctx, "empty", strings.NewReader(""), 0); err != nil || fi.Size != 0 {
		t.Fatalf("empty file: %+v %v", fi, err)
	}
	if err := os.Symlink("a/b/data.bin", filepath.Join(f.ws, "link")); err != nil {
		t.Fatal(err)
	}
	if got := readAll(t)(c.GetFile(ctx, "link")); string(got) != "v2" {
		t.Fatalf("GET through a link inside the workspace: %q", got)
	}

	st, err := c.Stat(ctx, "a/b")
	if err != nil || !st.IsDir || st.Name != "b" || st.Mode != "0755" || st.ModTime.IsZero() {
		t.Fatalf("Stat(a/b) = %+v, %v", st, err)
	}
	if st, err = c.Stat(ctx, "link"); err != nil || !st.IsSymlink || st.IsDir || st.LinkTarget != "a/b/data.bin" {
		t.Fatalf("Stat(link) = %+v, %v", st, err)
	}
	if st, err = c.Stat(ctx, ""); err != nil || !st.IsDir || st.Name != "." {
		t.Fatalf("Stat(workspace) = %+v, %v", st, err)
	}
	status, body, _ = f.raw(t, http.MethodGet, "/v1/stat/a/b/data.bin", nil)
	var rawInfo map[string]any
	if err := json.Unmarshal(body, &rawInfo); status != 200 || err != nil {
		t.Fatalf("raw stat: %d %s", status, body)
	}
	for _, k := range []string{"name", "size", "mode", "mod_time", "is_dir", "is_symlink"} {
		if _, ok := rawInfo[k]; !ok {
			t.Errorf("stat JSON lacks %q: %s", k, body)
		}
	}

	ls, err := c.List(ctx, "")
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, e := range ls.Entries {
		names = append(names, fmt.Sprintf("%s:%v:%v", e.Name, e.IsDir, e.IsSymlink))
	}
	if got := strings.Join(names, " "); got != "a:true:false empty:false:false link:false:true" {
		t.Fatalf("List = %s", got)
	}
	if ls, err = c.List(ctx, "a/b"); err != nil || len(ls.Entries) != 1 || ls.Entries[0].Path != "a/b/data.bin" || ls.Entries[0].Size != 2 {
		t.Fatalf("List(a/b) = %+v, %v", ls, err)
	}

	// Errors of the wrong kind of path.
	_, err = c.GetFile(ctx, "a")
	wantCode(t, "GET a directory", err, api.CodeIsADirectory)
	_, err = c.GetFile(ctx, "missing")
	wantCode(t, "GET a missing file", err, api.CodeNotFound)
	_, err = c.PutFile(ctx, "a/b/data.bin/x", strings.NewReader("x"), 0)
	wantCode(t, "PUT under a file", err, api.CodeNotADirectory)
	_, err = c.PutFile(ctx, "a", strings.NewReader("x"), 0)
	wantCode(t, "PUT onto a directory", err, api.CodeIsADirectory)
	_, err = c.PutFile(ctx, "", strings.NewReader("x"), 0)
	wantCode(t, "PUT onto the workspace", err, api.CodeIsADirectory)
	_, err = c.List(ctx, "empty")
	wantCode(t, "List a file", err, api.CodeNotADirectory)
	_, err = c.Stat(ctx, "nope/nope")
	wantCode(t, "Stat a missing path", err, api.CodeNotFound)
	status, body, _ = f.raw(t, http.MethodPut, "/v1/files/x?mode=4755", strings.NewReader("x"))
	if status != 400 || !strings.Contains(string(body), "invalid_argument") {
		t.Fatalf("setuid mode: %d %s", status, body)
	}
	status, _, _ = f.raw(t, http.MethodPut, "/v1/files/x?format=zip", strings.NewReader("x"))
	if status != 400 {
		t.Fatalf("unknown format: %d", status)
	}
	status, _, hdr = f.raw(t, http.MethodPost, "/v1/files/x", strings.NewReader("x"))
	if status != 405 || hdr.Get("Allow") == "" {
		t.Fatalf("POST a file: %d", status)
	}
	status, body, _ = f.raw(t, http.MethodGet, "/v1/files/a%00b", nil)
	if status != 400 {
		t.Fatalf("NUL in path: %d %s", status, body)
	}

	// Delete.
	wantCode(t, "Delete a directory without recursive", c.Delete(ctx, "a", false), api.CodeIsADirectory)
	wantCode(t, "Delete the workspace", c.Delete(ctx, "", true), api.CodeInvalidArgument)
	wantCode(t, "Delete a missing file", c.Delete(ctx, "missing", false), api.CodeNotFound)
	if err := c.Delete(ctx, "link", false); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(f.ws, "a/b/data.bin")); err != nil {
		t.Fatal("deleting a link removed its target")
	}
	if err := c.Delete(ctx, "empty", false); err != nil {
		t.Fatal(err)
	}
	if err := c.Delete(ctx, "a", true); err != nil {
		t.Fatal(err)
	}
	if ents, _ := os.ReadDir(f.ws); len(ents) != 0 {
		t.Fatalf("workspace not empty after deletes: %v", ents)
	}
	noTemps(t, f.ws)
}

// Every way out of the workspace is refused, on every endpoint, and
// nothing outside is read, written or removed.
func TestFilesEscapes(t *testing.T) {
	f := newFileServer(t, Config{})
	c, ctx := f.client, context.Background()
	outside := t.TempDir()
	secret := []byte("outside secret")
	mustWrite(t, filepath.Join(outside, "secret"), secret)
	mustWrite(t, filepath.Join(f.ws, "sub/ok"), []byte("ok"))
	for name, target := range map[string]string{
		"etc":          "/etc",          // absolute, outside
		"out":          outside,         // absolute, outside
		"sub/up":       "../..",         // relative, climbs out
		"sub/deep/up2": "../../" + "..", // relative, from a deeper directory
		"abs-inside":   f.ws + "/sub",   // absolute, though inside: os.Root refuses absolute links
		// relative, far enough up to reach the file system's root
		"rel-out": strings.Repeat("../", strings.Count(f.ws, "/")+2),
	} {
		if err := os.MkdirAll(filepath.Dir(filepath.Join(f.ws, name)), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.Symlink(target, filepath.Join(f.ws, name)); err != nil {
			t.Fatal(err)
		}
	}

	paths := []string{
		"../x", "a/../../x", "..", "sub/../../x",
		"/etc/passwd", outside + "/secret", f.ws + "/../x", f.ws + "x/y",
		"etc/passwd", "etc", "out/secret", "out", "out/new/file",
		"sub/up/x", "sub/deep/up2/x", "abs-inside/ok", "rel-out/etc/passwd",
	}
	for _, p := range paths {
		t.Run(strings.ReplaceAll(p, "/", "|"), func(t *testing.T) {
			_, err := c.GetFile(ctx, p)
			wantCode(t, "GetFile", err, api.CodePathEscapesWorkspace)
			_, err = c.GetTar(ctx, p)
			wantCode(t, "GetTar", err, api.CodePathEscapesWorkspace)
			_, err = c.PutFile(ctx, p, strings.NewReader("pwned"), 0)
			wantCode(t, "PutFile", err, api.CodePathEscapesWorkspace)
			_, err = c.PutTar(ctx, p, bytes.NewReader(makeTar(t, tarEntry{name: "pwned", body: "x"})))
			wantCode(t, "PutTar", err, api.CodePathEscapesWorkspace)
			_, err = c.List(ctx, p)
			wantCode(t, "List", err, api.CodePathEscapesWorkspace)
			// Stat and Delete act on a final symbolic link itself, which
			// is inside; through it, or with "..", they are refused.
			if !isLinkName(p) {
				_, err = c.Stat(ctx, p)
				wantCode(t, "Stat", err, api.CodePathEscapesWorkspace)
				wantCode(t, "Delete", c.Delete(ctx, p, true), api.CodePathEscapesWorkspace)
			}
		})
	}
	// Percent-encoded dots are decoded before the check.
	status, body, _ := f.raw(t, http.MethodGet, "/v1/files/%2e%2e/x", nil)
	if status != 403 || !strings.Contains(string(body), string(api.CodePathEscapesWorkspace)) {
		t.Fatalf("%%2e%%2e: %d %s", status, body)
	}
	status, body, _ = f.raw(t, http.MethodGet, "/v1/files//etc/passwd", nil)
	if status != 403 {
		t.Fatalf("//etc/passwd: %d %s", status, body)
	}

	// The links themselves can be described and removed.
	st, err := c.Stat(ctx, "out")
	if err != nil || !st.IsSymlink || st.LinkTarget != outside {
		t.Fatalf("Stat(out) = %+v, %v", st, err)
	}
	// A tar of a directory holding them stores links, not what they
	// point at.
	tr := tar.NewReader(bytes.NewReader(readAll(t)(c.GetTar(ctx, ""))))
	for {
		hdr, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		data, _ := io.ReadAll(tr)
		if bytes.Contains(data, secret) || strings.Contains(hdr.Name, "passwd") {
			t.Fatalf("tar of the workspace holds %q from outside", hdr.Name)
		}
	}
	if err := c.Delete(ctx, "out", false); err != nil {
		t.Fatal(err)
	}

	// Nothing outside changed.
	ents, err := os.ReadDir(outside)
	if err != nil || len(ents) != 1 || ents[0].Name() != "secret" {
		t.Fatalf("outside directory now holds %v (%v)", ents, err)
	}
	if got, _ := os.ReadFile(filepath.Join(outside, "secret")); !bytes.Equal(got, secret) {
		t.Fatal("outside file changed")
	}
	noTemps(t, f.ws)
}

func isLinkName(p string) bool {
	switch p {
	case "etc", "out":
		return true
	}
	return false
}

type tarEntry struct {
	name, body, link string
	typ              byte
}

func makeTar(t testing.TB, entries ...tarEntry) []byte {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, e := range entries {
		hdr := &tar.Header{Name: e.name, Mode: 0o644, Typeflag: e.typ, Linkname: e.link, ModTime: time.Unix(1700000000, 0)}
		switch {
		case hdr.Typeflag == 0:
			hdr.Typeflag, hdr.Size = tar.TypeReg, int64(len(e.body))
		case hdr.Typeflag == tar.TypeDir:
			hdr.Mode = 0o755
		}
		if err := tw.WriteHeader(hdr); err != nil {
			t.Fatal(err)
		}
		if hdr.Typeflag == tar.TypeReg {
			if _, err := tw.Write([]byte(e.body)); err != nil {
				t.Fatal(err)
			}
		}
	}
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

// readTar lists a tar as "name -> content" (or "-> @target" for links,
// "/" for directories).
func readTar(t testing.TB, data []byte) []string {
	t.Helper()
	var out []string
	tr := tar.NewReader(bytes.NewReader(data))
	for {
		hdr, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		switch hdr.Typeflag {
		case tar.TypeDir:
			out = append(out, hdr.Name)
		case tar.TypeSymlink:
			out = append(out, hdr.Name+" -> @"+hdr.Linkname)
		default:
			b, _ := io.ReadAll(tr)
			out = append(out, fmt.Sprintf("%s %04o -> %s", hdr.Name, hdr.Mode, b))
		}
	}
	sort.Strings(out)
	return out
}

func TestFilesTar(t *testing.T) {
	f := newFileServer(t, Config{})
	c, ctx := f.client, context.Background()

	in := makeTar(t,
		tarEntry{name: "./", typ: tar.TypeDir},
		tarEntry{name: "src/", typ: tar.TypeDir},
		tarEntry{name: "src/main.py", body: "print('hi')\n"},
		tarEntry{name: "src/pkg/__init__.py", body: ""}, // parent not listed first
		tarEntry{name: "README", body: "read me"},
		tarEntry{name: "src/link", typ: tar.TypeSymlink, link: "../README"},
	)
	res, err := c.PutTar(ctx, "proj", bytes.NewReader(in))
	if err != nil {
		t.Fatal(err)
	}
	if res.Files != 3 || res.Dirs != 2 || res.Symlinks != 1 || res.Bytes != int64(len("print('hi')\n")+len("read me")) {
		t.Fatalf("PutTar = %+v", res)
	}
	if got, _ := os.ReadFile(filepath.Join(f.ws, "proj/src/link")); string(got) != "read me" {
		t.Fatalf("extracted link reads %q", got)
	}
	want := []string{"README 0644 -> read me", "src/", "src/link -> @../README", "src/main.py 0644 -> print('hi')\n", "src/pkg/", "src/pkg/__init__.py 0644 -> "}
	if got := readTar(t, readAll(t)(c.GetTar(ctx, "proj"))); strings.Join(got, "|") != strings.Join(want, "|") {
		t.Fatalf("GetTar(proj) =\n%q\nwant\n%q", got, want)
	}
	// Accept: application/x-tar asks for the same thing.
	status, body, hdr := f.raw(t, http.MethodGet, "/v1/files/proj/src", nil, "Accept", api.ContentTypeTar)
	if status != 200 || hdr.Get("Content-Type") != api.ContentTypeTar || len(readTar(t, body)) != 4 {
		t.Fatalf("tar by Accept: %d %v %q", status, hdr, readTar(t, body))
	}
	// A tar of a single file holds that file.
	if got := readTar(t, readAll(t)(c.GetTar(ctx, "proj/README"))); len(got) != 1 || got[0] != "README 0644 -> read me" {
		t.Fatalf("tar of a file: %q", got)
	}
	// Extracting over existing files replaces them.
	if _, err := c.PutTar(ctx, "proj", bytes.NewReader(makeTar(t, tarEntry{name: "README", body: "v2"}))); err != nil {
		t.Fatal(err)
	}
	if got, _ := os.ReadFile(filepath.Join(f.ws, "proj/README")); string(got) != "v2" {
		t.Fatalf("README = %q", got)
	}
	_, err = c.PutTar(ctx, "proj/README", bytes.NewReader(makeTar(t, tarEntry{name: "x", body: "x"})))
	wantCode(t, "tar into a file", err, api.CodeNotADirectory)
	_, err = c.PutTar(ctx, "bad", strings.NewReader("this is not a tar stream, not even close to 512 bytes"))
	wantCode(t, "garbage tar", err, api.CodeInvalidArgument)
	noTemps(t, f.ws)
}

// Hostile tar streams: nothing lands outside the workspace.
func TestFilesTarEscapes(t *testing.T) {
	f := newFileServer(t, Config{})
	c, ctx := f.client, context.Background()
	outside := t.TempDir()
	// A link to outside that is already in the workspace (made by a
	// command, say).
	for _, dir := range []string{"", "x/y"} {
		if err := os.MkdirAll(filepath.Join(f.ws, dir), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.Symlink(outside, filepath.Join(f.ws, dir, "planted")); err != nil {
			t.Fatal(err)
		}
	}
	cases := []struct {
		name    string
		entries []tarEntry
		code    api.Code
	}{
		{"dot-dot entry", []tarEntry{{name: "ok", body: "x"}, {name: "../evil", body: "x"}}, api.CodePathEscapesWorkspace},
		{"deep dot-dot entry", []tarEntry{{name: "a/../../../evil", body: "x"}}, api.CodePathEscapesWorkspace},
		{"absolute entry", []tarEntry{{name: outside + "/evil", body: "x"}}, api.CodePathEscapesWorkspace},
		{"symlink out then a file through it", []tarEntry{
			{name: "esc", typ: tar.TypeSymlink, link: "../../../../../../../../" + outside},
			{name: "esc/evil", body: "x"},
		}, api.CodePathEscapesWorkspace},
		{"absolute symlink then a file through it", []tarEntry{
			{name: "esc", typ: tar.TypeSymlink, link: outside},
			{name: "esc/evil", body: "x"},
		}, api.CodePathEscapesWorkspace},
		{"file through a planted link", []tarEntry{{name: "planted/evil", body: "x"}}, api.CodePathEscapesWorkspace},
		{"directory through a planted link", []tarEntry{{name: "planted/dir/", typ: tar.TypeDir}}, api.CodePathEscapesWorkspace},
		{"symlink through a planted link", []tarEntry{{name: "planted/l", typ: tar.TypeSymlink, link: "x"}}, api.CodePathEscapesWorkspace},
		{"hard link", []tarEntry{{name: "h", typ: tar.TypeLink, link: "/etc/passwd"}}, api.CodeInvalidArgument},
		{"device", []tarEntry{{name: "d", typ: tar.TypeChar}}, api.CodeInvalidArgument},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			for _, dir := range []string{"", "x/y"} {
				_, err := c.PutTar(ctx, dir, bytes.NewReader(makeTar(t, tc.entries...)))
				wantCode(t, "PutTar into "+dir, err, tc.code)
				if _, err := os.Lstat(filepath.Join(f.ws, dir, "esc")); err == nil {
					t.Fatal("the escaping link was created")
				}
			}
		})
	}
	ents, err := os.ReadDir(outside)
	if err != nil || len(ents) != 0 {
		t.Fatalf("outside directory now holds %v (%v)", ents, err)
	}
	// Entries before the refused one were extracted (each atomically);
	// nothing was written in the workspace's parent.
	if got, _ := os.ReadFile(filepath.Join(f.ws, "ok")); string(got) != "x" {
		t.Fatalf("entry before the refused one: %q", got)
	}
	if _, err := os.Stat(filepath.Join(filepath.Dir(f.ws), "evil")); err == nil {
		t.Fatal("a tar entry escaped to the workspace's parent")
	}
	noTemps(t, f.ws)
}

// failingReader yields data and then fails, like a client that dies
// mid-upload.
type failingReader struct {
	data []byte
	err  error
}

func (r *failingReader) Read(p []byte) (int, error) {
	if len(r.data) == 0 {
		return 0, r.err
	}
	n := copy(p, r.data)
	r.data = r.data[n:]
	return n, nil
}

// A write that fails part way leaves the file it would have replaced
// exactly as it was, and no temporary file.
func TestFilesAtomicity(t *testing.T) {
	f := newFileServer(t, Config{})
	old := randomBytes(t, 300_000)
	mustWrite(t, filepath.Join(f.ws, "f"), old)

	// The body breaks after 1 MiB, before the declared length.
	req := httptest.NewRequest(http.MethodPut, "/v1/files/f", &failingReader{data: bytes.Repeat([]byte("n"), 1<<20), err: errors.New("connection reset")})
	req.ContentLength = 4 << 20
	rec := httptest.NewRecorder()
	f.s.ServeHTTP(rec, req)
	if rec.Code != http.StatusBadRequest || !strings.Contains(rec.Body.String(), "nothing was changed") {
		t.Fatalf("broken body: %d %s", rec.Code, rec.Body)
	}
	// A body shorter than its Content-Length is refused too.
	req = httptest.NewRequest(http.MethodPut, "/v1/files/f", strings.NewReader("short"))
	req.ContentLength = 10
	rec = httptest.NewRecorder()
	f.s.ServeHTTP(rec, req)
	if rec.Code != http.StatusBadRequest {
		t.Fatalf("short body: %d %s", rec.Code, rec.Body)
	}
	// A client that goes away mid-upload, once the handler is writing.
	ctx, cancel := context.WithCancel(context.Background())
	pr, pw := io.Pipe()
	go func() { _, _ = pw.Write(bytes.Repeat([]byte("c"), 2<<20)) }()
	result := make(chan error, 1)
	go func() {
		_, err := f.client.PutFile(ctx, "f", pr, 0)
		result <- err
	}()
	waitFor(t, "the temporary file to appear", func() bool { return countTemps(f.ws) == 1 })
	cancel()
	pw.CloseWithError(context.Canceled)
	if err := <-result; err == nil {
		t.Fatal("a cancelled upload succeeded")
	}
	waitFor(t, "the temporary file to go", func() bool { return countTemps(f.ws) == 0 })
	if got, _ := os.ReadFile(filepath.Join(f.ws, "f")); !bytes.Equal(got, old) {
		t.Fatalf("the old content was changed (%d bytes now)", len(got))
	}
	noTemps(t, f.ws)

	// Readers during a write see the old content, then the new, never a
	// partial file.
	pr2, pw2 := io.Pipe()
	done := make(chan error, 1)
	go func() {
		_, err := f.client.PutFile(context.Background(), "f", pr2, 0)
		done <- err
	}()
	newContent := randomBytes(t, 500_000)
	if _, err := pw2.Write(newContent[:250_000]); err != nil {
		t.Fatal(err)
	}
	if got := readAll(t)(f.client.GetFile(context.Background(), "f")); !bytes.Equal(got, old) {
		t.Fatalf("read during a write returned %d bytes, not the old content", len(got))
	}
	if _, err := pw2.Write(newContent[250_000:]); err != nil {
		t.Fatal(err)
	}
	pw2.Close()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if got := readAll(t)(f.client.GetFile(context.Background(), "f")); !bytes.Equal(got, newContent) {
		t.Fatal("read after the write did not return the new content")
	}
}

func health(t testing.TB, f *fileServer) *api.WorkspaceUsage {
	t.Helper()
	h, err := f.client.Health(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if h.Workspace == nil {
		t.Fatal("health reports no workspace")
	}
	return h.Workspace
}

func TestWorkspaceCap(t *testing.T) {
	const capBytes = 1 << 20
	f := newFileServer(t, Config{WorkspaceCap: capBytes, WorkspaceUsageTTL: 10 * time.Millisecond})
	c, ctx := f.client, context.Background()

	if u := health(t, f); u.UsedBytes != 0 || u.CapBytes != capBytes {
		t.Fatalf("empty workspace: %+v", u)
	}
	first := randomBytes(t, 900<<10)
	if _, err := c.PutFile(ctx, "big", bytes.NewReader(first), 0); err != nil {
		t.Fatal(err)
	}
	if u := health(t, f); u.UsedBytes != 900<<10 {
		t.Fatalf("after 900 KiB: %+v", u)
	}

	// Crossing the cap with a known length fails before reading; with an
	// unknown length (chunked) it fails part way. Either way the error is
	// workspace_full with 507 and nothing is written.
	_, err := c.PutFile(ctx, "more", bytes.NewReader(randomBytes(t, 200<<10)), 0)
	wantCode(t, "known length past the cap", err, api.CodeWorkspaceFull)
	_, err = c.PutFile(ctx, "more", io.MultiReader(bytes.NewReader(randomBytes(t, 200<<10))), 0)
	wantCode(t, "chunked past the cap", err, api.CodeWorkspaceFull)
	if !strings.Contains(err.Error(), "cap of 1048576 bytes") {
		t.Errorf("message does not name the cap: %v", err)
	}
	if _, err := os.Stat(filepath.Join(f.ws, "more")); err == nil {
		t.Fatal("the refused file exists")
	}

	// Replacing a file is charged only for its growth.
	second := randomBytes(t, 1000<<10)
	if _, err := c.PutFile(ctx, "big", io.MultiReader(bytes.NewReader(second)), 0); err != nil {
		t.Fatalf("replacing 900 KiB with 1000 KiB under a 1 MiB cap: %v", err)
	}
	// A replacement past the cap fails, and the previous content is
	// intact, not truncated.
	_, err = c.PutFile(ctx, "big", io.MultiReader(bytes.NewReader(randomBytes(t, 1100<<10))), 0)
	wantCode(t, "replacement past the cap", err, api.CodeWorkspaceFull)
	if got, _ := os.ReadFile(filepath.Join(f.ws, "big")); !bytes.Equal(got, second) {
		t.Fatalf("big holds %d bytes that are not the previous content", len(got))
	}
	if u := health(t, f); u.UsedBytes != 1000<<10 {
		t.Fatalf("after the refusals: %+v", u)
	}

	// A tar that crosses the cap stops at the entry that crosses it.
	tarred := makeTar(t, tarEntry{name: "t/small", body: strings.Repeat("s", 10<<10)}, tarEntry{name: "t/huge", body: strings.Repeat("h", 100<<10)})
	_, err = c.PutTar(ctx, "", bytes.NewReader(tarred))
	wantCode(t, "tar past the cap", err, api.CodeWorkspaceFull)
	if _, err := os.Stat(filepath.Join(f.ws, "t/huge")); err == nil {
		t.Fatal("the entry past the cap exists")
	}
	if got, _ := os.ReadFile(filepath.Join(f.ws, "big")); !bytes.Equal(got, second) {
		t.Fatal("big changed")
	}

	// Files written behind the supervisor's back (by commands) count once
	// the usage TTL has passed.
	mustWrite(t, filepath.Join(f.ws, "by-command"), make([]byte, 4<<10))
	time.Sleep(20 * time.Millisecond)
	if u := health(t, f); u.UsedBytes != 1000<<10+10<<10+4<<10 {
		t.Fatalf("after a command's write: %+v", u)
	}
	_, err = c.PutFile(ctx, "tiny", bytes.NewReader(make([]byte, 20<<10)), 0)
	wantCode(t, "write that only fails because of a command's file", err, api.CodeWorkspaceFull)

	// Deleting frees space at once.
	if err := c.Delete(ctx, "big", false); err != nil {
		t.Fatal(err)
	}
	if u := health(t, f); u.UsedBytes != 10<<10+4<<10 {
		t.Fatalf("after delete: %+v", u)
	}
	if _, err := c.PutFile(ctx, "more", bytes.NewReader(randomBytes(t, 200<<10)), 0); err != nil {
		t.Fatal(err)
	}
	if err := c.Delete(ctx, "t", true); err != nil {
		t.Fatal(err)
	}
	if u := health(t, f); u.UsedBytes != 200<<10+4<<10 {
		t.Fatalf("after recursive delete: %+v", u)
	}
	noTemps(t, f.ws)
}

// Concurrent writers together cannot pass the cap: each byte is charged
// before it is written.
func TestWorkspaceCapConcurrent(t *testing.T) {
	const capBytes = 1 << 20
	f := newFileServer(t, Config{WorkspaceCap: capBytes})
	errs := make(chan error, 8)
	for i := range 8 {
		go func() {
			_, err := f.client.PutFile(context.Background(), fmt.Sprintf("f%d", i), io.MultiReader(bytes.NewReader(make([]byte, 300<<10))), 0)
			errs <- err
		}()
	}
	ok := 0
	for range 8 {
		if err := <-errs; err == nil {
			ok++
		} else if api.CodeOf(err) != api.CodeWorkspaceFull {
			t.Fatal(err)
		}
	}
	var total int64
	ents, _ := os.ReadDir(f.ws)
	for _, e := range ents {
		fi, _ := e.Info()
		total += fi.Size()
	}
	// How many succeed depends on the interleaving (failed writes hold
	// their partial charge until they abort), but never more than fit.
	if ok > 3 || total != int64(ok)*300<<10 || total > capBytes || health(t, f).UsedBytes != total {
		t.Fatalf("%d writes succeeded, %d bytes on disk, %d reported; at most 3 of 300 KiB fit in 1 MiB", ok, total, health(t, f).UsedBytes)
	}
	t.Logf("%d of 8 concurrent 300 KiB writes fit under the 1 MiB cap", ok)
	noTemps(t, f.ws)
}

func TestNoWorkspace(t *testing.T) {
	if _, err := os.Stat(DefaultWorkspace); err == nil {
		t.Skip(DefaultWorkspace + " exists on this machine")
	}
	s := newServer(t, Config{})
	rec := httptest.NewRecorder()
	s.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/v1/files/x", nil))
	if rec.Code != http.StatusServiceUnavailable {
		t.Fatalf("file endpoint without a workspace: %d %s", rec.Code, rec.Body)
	}
	if _, err := New(Config{Workspace: filepath.Join(t.TempDir(), "missing")}); err == nil {
		t.Fatal("a missing explicit workspace was accepted")
	}
}

// BenchmarkPutGet100MiB puts and gets 100 MiB through the handler over
// loopback HTTP (no TLS). MB/s counts the 100 MiB once per direction.
func BenchmarkPutGet100MiB(b *testing.B) {
	const size = 100 << 20
	f := newFileServer(b, Config{WorkspaceCap: 4 * size})
	data := randomBytes(b, size)
	ctx := context.Background()
	b.SetBytes(2 * size)
	b.ResetTimer()
	var putTime, getTime time.Duration
	for b.Loop() {
		start := time.Now()
		if _, err := f.client.PutFile(ctx, "big.bin", bytes.NewReader(data), 0); err != nil {
			b.Fatal(err)
		}
		putTime += time.Since(start)
		start = time.Now()
		rc, err := f.client.GetFile(ctx, "big.bin")
		if err != nil {
			b.Fatal(err)
		}
		n, err := io.Copy(io.Discard, rc)
		rc.Close()
		if err != nil || n != size {
			b.Fatalf("get: %d bytes, %v", n, err)
		}
		getTime += time.Since(start)
	}
	b.ReportMetric(float64(size)*float64(b.N)/1e6/putTime.Seconds(), "put_MB/s")
	b.ReportMetric(float64(size)*float64(b.N)/1e6/getTime.Seconds(), "get_MB/s")
}

// FuzzRelPath checks the lexical half of confinement: whatever the
// request path, the result is relative and does not climb out.
func FuzzRelPath(f *testing.F) {
	ws := f.TempDir()
	s := newServer(f, Config{Workspace: ws})
	for _, seed := range []string{"", ".", "..", "../x", "a/../../x", "/etc/passwd", ws + "/a", ws + "/../x", ws + "x", "a//b/./c/", "\x00", "a/..", "..."} {
		f.Add(seed)
	}
	f.Fuzz(func(t *testing.T, p string) {
		rel, apiErr := s.ws.RelPath(p)
		if apiErr != nil {
			if apiErr.Code != api.CodePathEscapesWorkspace && apiErr.Code != api.CodeInvalidArgument {
				t.Fatalf("relPath(%q): unexpected code %s", p, apiErr.Code)
			}
			return
		}
		if strings.HasPrefix(rel, "/") || rel == ".." || strings.HasPrefix(rel, "../") || strings.Contains(rel, "/../") || strings.HasSuffix(rel, "/..") {
			t.Fatalf("relPath(%q) = %q leaves the workspace", p, rel)
		}
	})
}

// FuzzPutTar extracts arbitrary tar streams and checks that nothing ever
// appears next to the workspace.
func FuzzPutTar(f *testing.F) {
	parent := f.TempDir()
	ws := filepath.Join(parent, "ws")
	if err := os.Mkdir(ws, 0o755); err != nil {
		f.Fatal(err)
	}
	if err := os.Symlink(parent, filepath.Join(ws, "planted")); err != nil {
		f.Fatal(err)
	}
	s := newServer(f, Config{Workspace: ws, WorkspaceCap: 1 << 20})
	f.Add(makeTar(f, tarEntry{name: "ok", body: "x"}))
	f.Add(makeTar(f, tarEntry{name: "../evil", body: "x"}))
	f.Add(makeTar(f, tarEntry{name: "l", typ: tar.TypeSymlink, link: ".."}, tarEntry{name: "l/evil", body: "x"}))
	f.Add(makeTar(f, tarEntry{name: "planted/evil", body: "x"}))
	f.Add(makeTar(f, tarEntry{name: "d/", typ: tar.TypeDir}, tarEntry{name: "d/../../evil", body: "x"}))
	f.Fuzz(func(t *testing.T, data []byte) {
		req := httptest.NewRequest(http.MethodPut, "/v1/files/in?format=tar", bytes.NewReader(data))
		rec := httptest.NewRecorder()
		s.ServeHTTP(rec, req)
		ents, err := os.ReadDir(parent)
		if err != nil {
			t.Fatal(err)
		}
		if len(ents) != 1 || ents[0].Name() != "ws" {
			t.Fatalf("a tar stream wrote next to the workspace: %v (status %d %s)", ents, rec.Code, rec.Body)
		}
		if rec.Code >= 500 && rec.Code != http.StatusInsufficientStorage {
			t.Fatalf("status %d: %s", rec.Code, rec.Body)
		}
	})
}

// A snapshot's restore (RestoreTar) gives back the links commands made,
// those pointing outside the workspace too (a venv's bin/python), which a
// plain PutTar refuses; nothing is ever extracted through one. Manifests
// leave the platform directory, where the environments live, out.
func TestFilesTarRestoreKeepsLinks(t *testing.T) {
	src := newFileServer(t, Config{})
	ctx := context.Background()
	venv := filepath.Join(src.ws, api.EnvsDir, "e.1234")
	if err := os.MkdirAll(filepath.Join(venv, "bin"), 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink("/usr/bin/python3", filepath.Join(venv, "bin", "python")); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink("../../../../../../lib", filepath.Join(venv, "lib64")); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(venv, "pyvenv.cfg"), []byte("home = /usr/bin\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(src.ws, "notes.txt"), []byte("mine"), 0o644); err != nil {
		t.Fatal(err)
	}
	m, err := src.client.Manifest(ctx, ".")
	if err != nil {
		t.Fatal(err)
	}
	if len(m.Files) != 1 || m.Files[0].Path != "notes.txt" {
		t.Fatalf("manifest %+v, want notes.txt alone", m.Files)
	}
	snapshot := readAll(t)(src.client.GetTar(ctx, "."))

	dst := newFileServer(t, Config{})
	_, err = dst.client.PutTar(ctx, ".", bytes.NewReader(snapshot))
	wantCode(t, "PutTar of links out", err, api.CodePathEscapesWorkspace)
	res, err := dst.client.RestoreTar(ctx, ".", bytes.NewReader(snapshot))
	if err != nil {
		t.Fatal(err)
	}
	if res.Symlinks != 2 || res.Files != 2 {
		t.Fatalf("RestoreTar = %+v", res)
	}
	rvenv := filepath.Join(dst.ws, api.EnvsDir, "e.1234")
	for link, want := range map[string]string{"bin/python": "/usr/bin/python3", "lib64": "../../../../../../lib"} {
		if got, err := os.Readlink(filepath.Join(rvenv, link)); err != nil || got != want {
			t.Errorf("restored %s -> %q (%v), want %q", link, got, err, want)
		}
	}
	// Kept, but never gone through.
	outside := t.TempDir()
	_, err = dst.client.RestoreTar(ctx, ".", bytes.NewReader(makeTar(t,
		tarEntry{name: "esc", typ: tar.TypeSymlink, link: outside},
		tarEntry{name: "esc/evil", body: "x"},
	)))
	wantCode(t, "RestoreTar through a kept link", err, api.CodePathEscapesWorkspace)
	if ents, _ := os.ReadDir(outside); len(ents) != 0 {
		t.Fatalf("a file was extracted through a link: %v", ents)
	}
	status, _, _ := dst.raw(t, http.MethodPut, "/v1/files/x?format=tar&links=all", bytes.NewReader(makeTar(t, tarEntry{name: "a", body: "x"})))
	if status != http.StatusBadRequest {
		t.Errorf("links=all: status %d, want 400", status)
	}
}
