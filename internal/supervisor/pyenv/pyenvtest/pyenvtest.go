// Package pyenvtest serves a PEP 503 "simple" package index on loopback,
// with pure-Python wheels it builds itself, so that tests install real
// packages with the real pip or uv and no network beyond 127.0.0.1.
package pyenvtest

import (
	"archive/zip"
	"bytes"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"fmt"
	"html"
	"net/http"
	"net/http/httptest"
	"regexp"
	"slices"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"
)

// Package is one project with one version, built as a wheel.
type Package struct {
	Name    string
	Version string
	// Files are the wheel's importable contents: path in site-packages ->
	// content, e.g. {"greet/__init__.py": "def hi(): return 'hi'"}.
	Files map[string][]byte
	// Requires become Requires-Dist lines: dependencies pip resolves from
	// the same index.
	Requires []string
	// Stall holds each download of the wheel back this long (or until the
	// client goes away), for builds that run out of time.
	Stall time.Duration
}

var separators = regexp.MustCompile(`[-_.]+`)

// Normalize is PEP 503's project name normalisation.
func Normalize(name string) string {
	return strings.ToLower(separators.ReplaceAllString(name, "-"))
}

// WheelName is the file name of p's wheel.
func (p Package) WheelName() string {
	return fmt.Sprintf("%s-%s-py3-none-any.whl", p.distName(), p.Version)
}

// distName is the name as wheel file and .dist-info names spell it.
func (p Package) distName() string {
	return strings.ReplaceAll(Normalize(p.Name), "-", "_")
}

// Wheel builds p's wheel: its files, and a .dist-info with METADATA, WHEEL
// and a RECORD holding every other file's hash.
func (p Package) Wheel() ([]byte, error) {
	distInfo := fmt.Sprintf("%s-%s.dist-info", p.distName(), p.Version)
	var metadata strings.Builder
	fmt.Fprintf(&metadata, "Metadata-Version: 2.1\nName: %s\nVersion: %s\nSummary: agentbox test package\n", p.Name, p.Version)
	for _, r := range p.Requires {
		fmt.Fprintf(&metadata, "Requires-Dist: %s\n", r)
	}
	files := map[string][]byte{
		distInfo + "/METADATA": []byte(metadata.String()),
		distInfo + "/WHEEL":    []byte("Wheel-Version: 1.0\nGenerator: agentbox-pyenvtest\nRoot-Is-Purelib: true\nTag: py3-none-any\n"),
	}
	for name, data := range p.Files {
		files[name] = data
	}
	names := make([]string, 0, len(files))
	for n := range files {
		names = append(names, n)
	}
	sort.Strings(names)

	var buf bytes.Buffer
	zw := zip.NewWriter(&buf)
	var record strings.Builder
	for _, n := range names {
		w, err := zw.Create(n)
		if err != nil {
			return nil, err
		}
		if _, err := w.Write(files[n]); err != nil {
			return nil, err
		}
		sum := sha256.Sum256(files[n])
		fmt.Fprintf(&record, "%s,sha256=%s,%d\n", n, base64.RawURLEncoding.EncodeToString(sum[:]), len(files[n]))
	}
	fmt.Fprintf(&record, "%s/RECORD,,\n", distInfo)
	w, err := zw.Create(distInfo + "/RECORD")
	if err != nil {
		return nil, err
	}
	if _, err := w.Write([]byte(record.String())); err != nil {
		return nil, err
	}
	if err := zw.Close(); err != nil {
		return nil, err
	}
	return buf.Bytes(), nil
}

// Index is a running package index.
type Index struct {
	// URL is the index's simple URL, http://127.0.0.1:port/simple/.
	URL string

	srv      *httptest.Server
	projects map[string][]Package // normalised name -> versions
	wheels   map[string][]byte    // file name -> wheel
	stalls   map[string]time.Duration

	mu        sync.Mutex
	downloads map[string]int // file name -> GETs
	pages     map[string]int // normalised project -> page GETs
}

// NewIndex builds the packages' wheels and serves them on 127.0.0.1 until
// the test ends.
func NewIndex(t testing.TB, pkgs ...Package) *Index {
	t.Helper()
	ix := &Index{projects: map[string][]Package{}, wheels: map[string][]byte{}, stalls: map[string]time.Duration{},
		downloads: map[string]int{}, pages: map[string]int{}}
	for _, p := range pkgs {
		data, err := p.Wheel()
		if err != nil {
			t.Fatalf("build wheel %s: %v", p.WheelName(), err)
		}
		ix.wheels[p.WheelName()] = data
		ix.stalls[p.WheelName()] = p.Stall
		n := Normalize(p.Name)
		ix.projects[n] = append(ix.projects[n], p)
	}
	// httptest listens on 127.0.0.1 only.
	ix.srv = httptest.NewServer(http.HandlerFunc(ix.serve))
	t.Cleanup(ix.srv.Close)
	ix.URL = ix.srv.URL + "/simple/"
	return ix
}

func (ix *Index) serve(w http.ResponseWriter, r *http.Request) {
	switch p := r.URL.Path; {
	case p == "/simple/" || p == "/simple":
		names := make([]string, 0, len(ix.projects))
		for n := range ix.projects {
			names = append(names, n)
		}
		w.Header().Set("Content-Type", "text/html")
		fmt.Fprint(w, rootPage(names))
	case strings.HasPrefix(p, "/simple/"):
		name := Normalize(strings.Trim(strings.TrimPrefix(p, "/simple/"), "/"))
		ix.mu.Lock()
		ix.pages[name]++
		ix.mu.Unlock()
		versions, ok := ix.projects[name]
		if !ok {
			http.NotFound(w, r)
			return
		}
		if !strings.HasSuffix(p, "/") {
			http.Redirect(w, r, p+"/", http.StatusMovedPermanently)
			return
		}
		w.Header().Set("Content-Type", "text/html")
		fmt.Fprint(w, projectPage(name, versions, ix.wheels))
	case strings.HasPrefix(p, "/files/"):
		file := strings.TrimPrefix(p, "/files/")
		data, ok := ix.wheels[file]
		if !ok {
			http.NotFound(w, r)
			return
		}
		ix.mu.Lock()
		ix.downloads[file]++
		ix.mu.Unlock()
		if d := ix.stalls[file]; d > 0 {
			select {
			case <-time.After(d):
			case <-r.Context().Done():
				return
			}
		}
		w.Header().Set("Content-Type", "application/octet-stream")
		_, _ = w.Write(data)
	default:
		http.NotFound(w, r)
	}
}

// rootPage is the index's /simple/ page, listing the projects.
func rootPage(names []string) string {
	slices.Sort(names)
	var b strings.Builder
	b.WriteString("<!DOCTYPE html><html><body>\n")
	for _, n := range names {
		fmt.Fprintf(&b, "<a href=\"%s/\">%s</a>\n", html.EscapeString(n), html.EscapeString(n))
	}
	b.WriteString("</body></html>\n")
	return b.String()
}

// projectPage is a project's /simple/<name>/ page: a link to each wheel
// under /files/, with its hash.
func projectPage(name string, versions []Package, wheels map[string][]byte) string {
	var b strings.Builder
	fmt.Fprintf(&b, "<!DOCTYPE html><html><body><h1>Links for %s</h1>\n", html.EscapeString(name))
	for _, v := range versions {
		file := v.WheelName()
		sum := sha256.Sum256(wheels[file])
		fmt.Fprintf(&b, "<a href=\"../../files/%s#sha256=%s\">%s</a>\n", html.EscapeString(file), hex.EncodeToString(sum[:]), html.EscapeString(file))
	}
	b.WriteString("</body></html>\n")
	return b.String()
}

// StaticTree is the index as files, for a plain web server that serves a
// folder's index.html for the folder (busybox httpd in a test pod): path
// under the server's root -> content.
func StaticTree(pkgs ...Package) (map[string][]byte, error) {
	projects := map[string][]Package{}
	wheels := map[string][]byte{}
	tree := map[string][]byte{}
	for _, p := range pkgs {
		data, err := p.Wheel()
		if err != nil {
			return nil, fmt.Errorf("build wheel %s: %w", p.WheelName(), err)
		}
		wheels[p.WheelName()] = data
		tree["files/"+p.WheelName()] = data
		n := Normalize(p.Name)
		projects[n] = append(projects[n], p)
	}
	names := make([]string, 0, len(projects))
	for n, versions := range projects {
		names = append(names, n)
		tree["simple/"+n+"/index.html"] = []byte(projectPage(n, versions, wheels))
	}
	tree["simple/index.html"] = []byte(rootPage(names))
	return tree, nil
}

// Downloads counts the GETs of the project's wheels, all versions.
func (ix *Index) Downloads(project string) int {
	ix.mu.Lock()
	defer ix.mu.Unlock()
	n := 0
	for _, p := range ix.projects[Normalize(project)] {
		n += ix.downloads[p.WheelName()]
	}
	return n
}

// PageRequests counts the GETs of the project's index page, whether or
// not the index has the project.
func (ix *Index) PageRequests(project string) int {
	ix.mu.Lock()
	defer ix.mu.Unlock()
	return ix.pages[Normalize(project)]
}
