package archive_test

import (
	"bufio"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/minio/minio-go/v7"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	"github.com/agentbox/terraform-provider-agentbox/internal/pki"
	"github.com/agentbox/terraform-provider-agentbox/internal/snapshot"
	"github.com/agentbox/terraform-provider-agentbox/internal/snapshot/archive"
	api "github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"
	"github.com/agentbox/terraform-provider-agentbox/internal/testenv/s3server"
)

const supervisorPkg = "github.com/agentbox/terraform-provider-agentbox/internal/cmd/agentbox-supervisor"

var (
	buildOnce sync.Once
	buildBin  string
	buildErr  error
)

// supervisorBinary builds the real supervisor once per test run.
func supervisorBinary(tb testing.TB) string {
	tb.Helper()
	buildOnce.Do(func() {
		goBin, err := exec.LookPath("go")
		if err != nil {
			buildErr = fmt.Errorf("go toolchain not in PATH: %w", err)
			return
		}
		dir, err := os.MkdirTemp("", "agentbox-archive-test-")
		if err != nil {
			buildErr = err
			return
		}
		buildBin = filepath.Join(dir, "agentbox-supervisor")
		cmd := exec.Command(goBin, "build", "-trimpath", "-o", buildBin, supervisorPkg)
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
		if out, err := cmd.CombinedOutput(); err != nil {
			buildErr = fmt.Errorf("go build %s: %w\n%s", supervisorPkg, err, out)
		}
	})
	if buildErr != nil {
		tb.Fatal(buildErr)
	}
	return buildBin
}

// TestMain removes the supervisor binary built for the run.
func TestMain(m *testing.M) {
	code := m.Run()
	if buildBin != "" {
		_ = os.RemoveAll(filepath.Dir(buildBin))
	}
	os.Exit(code)
}

// platformPKI is the CA and the control plane's client certificate, as the
// control plane holds them.
type platformPKI struct {
	ca     *pki.CA
	client *pki.Leaf
}

func newPKI(tb testing.TB) *platformPKI {
	tb.Helper()
	ca, err := pki.NewCA("agentbox-archive-test-ca")
	if err != nil {
		tb.Fatal(err)
	}
	leaf, err := ca.Issue(pki.LeafOptions{ID: pki.ControlPlaneID("", "platform"), Usage: pki.UsageClient})
	if err != nil {
		tb.Fatal(err)
	}
	return &platformPKI{ca: ca, client: leaf}
}

// supervisorProc is a real supervisor process serving one workspace over
// mTLS.
type supervisorProc struct {
	cmd       *exec.Cmd
	done      chan struct{}
	workspace string
	client    *api.Client
	// getTars counts GET tar requests sent to it.
	getTars atomic.Int32
}

type supervisorOptions struct {
	// wrap, when set, wraps the client's transport (to observe or stall
	// the streams).
	wrap func(http.RoundTripper) http.RoundTripper
}

func startSupervisor(tb testing.TB, p *platformPKI, sandbox *v1alpha1.Sandbox, workspace string, o supervisorOptions) *supervisorProc {
	tb.Helper()
	bin := supervisorBinary(tb)
	sandboxID := pki.SandboxID("", sandbox.Namespace, sandbox.Name)
	server, err := p.ca.Issue(pki.LeafOptions{ID: sandboxID, Usage: pki.UsageServer})
	if err != nil {
		tb.Fatal(err)
	}
	tlsDir := tb.TempDir()
	for name, data := range map[string][]byte{"tls.crt": server.CertPEM, "tls.key": server.KeyPEM, "ca.crt": p.ca.CertPEM} {
		if err := os.WriteFile(filepath.Join(tlsDir, name), data, 0o600); err != nil {
			tb.Fatal(err)
		}
	}
	cmd := exec.Command(bin, "-listen", "127.0.0.1:0", "-tls-dir", tlsDir, "-workdir", workspace, "-workspace", workspace,
		"-workspace-cap", "1GiB", "-shutdown-grace", "1s")
	cmd.Env = []string{"AGENTBOX_NAMESPACE=platform", "PATH=" + os.Getenv("PATH")}
	stderr, err := cmd.StderrPipe()
	if err != nil {
		tb.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		tb.Fatal(err)
	}
	s := &supervisorProc{cmd: cmd, done: make(chan struct{}), workspace: workspace}
	listening := make(chan string, 1)
	go func() {
		sc := bufio.NewScanner(stderr)
		for sc.Scan() {
			var line map[string]any
			if json.Unmarshal(sc.Bytes(), &line) != nil {
				continue
			}
			if line["msg"] == "listening" {
				if addr, ok := line["addr"].(string); ok {
					select {
					case listening <- addr:
					default:
					}
				}
			}
			if lvl, _ := line["level"].(string); lvl == "ERROR" || lvl == "WARN" {
				tb.Logf("supervisor: %s", sc.Text())
			}
		}
		_ = cmd.Wait()
		close(s.done)
	}()
	tb.Cleanup(s.kill)
	var addr string
	select {
	case addr = <-listening:
	case <-s.done:
		tb.Fatal("supervisor exited before listening")
	case <-time.After(30 * time.Second):
		tb.Fatal("supervisor did not listen within 30s")
	}
	cert, err := p.client.TLSCertificate()
	if err != nil {
		tb.Fatal(err)
	}
	hc := api.NewHTTPClient(pki.ClientTLS(cert, p.ca.Pool(), sandboxID.String()))
	var rt http.RoundTripper = countingTransport{base: hc.Transport, n: &s.getTars}
	if o.wrap != nil {
		rt = o.wrap(rt)
	}
	hc.Transport = rt
	s.client = api.NewClient("https://"+addr, hc)
	return s
}

func (s *supervisorProc) kill() {
	if s.cmd.Process == nil {
		return
	}
	select {
	case <-s.done:
	default:
		_ = s.cmd.Process.Kill()
		<-s.done
	}
}

type countingTransport struct {
	base http.RoundTripper
	n    *atomic.Int32
}

func (c countingTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	if r.Method == http.MethodGet && r.URL.Query().Get("format") == api.FormatTar {
		c.n.Add(1)
	}
	return c.base.RoundTrip(r)
}

func newSandbox(name, uid string) *v1alpha1.Sandbox {
	return &v1alpha1.Sandbox{ObjectMeta: metav1.ObjectMeta{Namespace: "team-a", Name: name, UID: types.UID(uid)}}
}

func newDriver(tb testing.TB, s3 *s3server.Server, mod func(*archive.Config)) *archive.Driver {
	tb.Helper()
	cfg := archive.Config{
		Endpoint:        s3.Endpoint,
		Bucket:          s3.Bucket,
		Prefix:          "agentbox/snapshots",
		Region:          s3.Region,
		AccessKeyID:     s3.AccessKeyID,
		SecretAccessKey: s3.SecretAccessKey,
		PartSize:        archive.MinPartSize,
	}
	if mod != nil {
		mod(&cfg)
	}
	d, err := archive.New(cfg)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(d.Close)
	return d
}

// backend is one kind of object store the driver's tests run against,
// with what the tests need to look into it behind the driver's back.
type backend struct {
	// driver returns a driver of the store; mod may change its config.
	driver func(tb testing.TB, mod func(*archive.Config)) *archive.Driver
	// broken returns a driver whose store is misconfigured: a bucket or
	// a directory that does not exist.
	broken func(tb testing.TB) *archive.Driver
	// object reports whether key is visible in the store, and its size.
	object func(tb testing.TB, ctx context.Context, key string) (int64, bool)
	// incomplete counts the interrupted writes of key left in the store.
	incomplete func(tb testing.TB, ctx context.Context, key string) int
}

// forEachBackend runs test against a real S3 server and against a
// directory (the embedded store). The S3 server is started inside its
// subtest, so that a machine without it skips only that half.
func forEachBackend(t *testing.T, test func(t *testing.T, b *backend)) {
	t.Run(archive.StoreS3, func(t *testing.T) { test(t, s3Backend(t, s3server.Start(t))) })
	t.Run(archive.StoreEmbedded, func(t *testing.T) { test(t, dirBackend(t)) })
}

func s3Backend(t *testing.T, s3 *s3server.Server) *backend {
	mc := s3.Client(t)
	return &backend{
		driver: func(tb testing.TB, mod func(*archive.Config)) *archive.Driver { return newDriver(tb, s3, mod) },
		broken: func(tb testing.TB) *archive.Driver {
			return newDriver(tb, s3, func(c *archive.Config) { c.Bucket = "no-such-bucket" })
		},
		object: func(tb testing.TB, ctx context.Context, key string) (int64, bool) {
			tb.Helper()
			info, err := mc.StatObject(ctx, s3.Bucket, key, minio.StatObjectOptions{})
			if minio.ToErrorResponse(err).Code == minio.NoSuchKey {
				return 0, false
			}
			if err != nil {
				tb.Fatalf("stat %s: %v", key, err)
			}
			return info.Size, true
		},
		incomplete: func(tb testing.TB, ctx context.Context, key string) int {
			tb.Helper()
			n := 0
			for u := range mc.ListIncompleteUploads(ctx, s3.Bucket, key, true) {
				if u.Err != nil {
					tb.Fatal(u.Err)
				}
				n++
			}
			return n
		},
	}
}

func dirBackend(t *testing.T) *backend {
	dir := t.TempDir()
	newDir := func(tb testing.TB, d string, mod func(*archive.Config)) *archive.Driver {
		tb.Helper()
		cfg := archive.Config{Dir: d, Prefix: "agentbox/snapshots"}
		if mod != nil {
			mod(&cfg)
		}
		drv, err := archive.New(cfg)
		if err != nil {
			tb.Fatal(err)
		}
		tb.Cleanup(drv.Close)
		return drv
	}
	return &backend{
		driver: func(tb testing.TB, mod func(*archive.Config)) *archive.Driver { return newDir(tb, dir, mod) },
		broken: func(tb testing.TB) *archive.Driver {
			return newDir(tb, filepath.Join(tb.TempDir(), "not-mounted"), nil)
		},
		object: func(tb testing.TB, _ context.Context, key string) (int64, bool) {
			tb.Helper()
			f, err := os.Open(filepath.Join(dir, filepath.FromSlash(key)))
			if errors.Is(err, fs.ErrNotExist) {
				return 0, false
			}
			if err != nil {
				tb.Fatal(err)
			}
			defer f.Close()
			fi, err := f.Stat()
			if err != nil {
				tb.Fatal(err)
			}
			// The archive follows one header line of JSON metadata.
			header, err := bufio.NewReader(f).ReadString('\n')
			if err != nil || !json.Valid([]byte(header)) {
				tb.Fatalf("%s does not start with a JSON line: %q, %v", key, header, err)
			}
			return fi.Size() - int64(len(header)), true
		},
		incomplete: func(tb testing.TB, _ context.Context, key string) int {
			tb.Helper()
			d, base := filepath.Split(filepath.Join(dir, filepath.FromSlash(key)))
			entries, err := os.ReadDir(d)
			if errors.Is(err, fs.ErrNotExist) {
				return 0
			}
			if err != nil {
				tb.Fatal(err)
			}
			n := 0
			for _, e := range entries {
				if strings.HasPrefix(e.Name(), "."+base+".partial-") {
					n++
				}
			}
			return n
		},
	}
}

// takeUntilDone calls Take as the controller does, until the snapshot is
// ready or failed, or Take returns an error.
func takeUntilDone(ctx context.Context, d *archive.Driver, req snapshot.Request) (snapshot.State, int, error) {
	for calls := 1; ; calls++ {
		st, err := d.Take(ctx, req)
		if err != nil || st.Ready || st.Failed != "" {
			return st, calls, err
		}
		select {
		case <-ctx.Done():
			return st, calls, ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// fillWorkspace writes a workspace with the kinds of entry the tar carries
// and returns how many bytes of file content it holds.
func fillWorkspace(tb testing.TB, dir string, randomBytes int) int64 {
	tb.Helper()
	var total int64
	write := func(rel string, data []byte, mode fs.FileMode) {
		p := filepath.Join(dir, rel)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			tb.Fatal(err)
		}
		if err := os.WriteFile(p, data, 0o600); err != nil {
			tb.Fatal(err)
		}
		if err := os.Chmod(p, mode); err != nil {
			tb.Fatal(err)
		}
		total += int64(len(data))
	}
	random := func(n int) []byte {
		b := make([]byte, n)
		if _, err := io.ReadFull(rand.Reader, b); err != nil {
			tb.Fatal(err)
		}
		return b
	}
	write("README.md", []byte("# project\n"), 0o644)
	write("src/main.py", []byte(strings.Repeat("print('hello, workspace')\n", 2000)), 0o644)
	write("src/pkg/deep/er/still/module.py", []byte("x = 1\n"), 0o644)
	write("bin/run.sh", []byte("#!/bin/sh\necho run\n"), 0o755)
	write("secret/key.pem", []byte("not really a key\n"), 0o600)
	write("readonly.txt", []byte("frozen\n"), 0o444)
	write("empty-file", nil, 0o644)
	write("data/blob.bin", random(randomBytes), 0o640)
	write("data/small.bin", random(1234), 0o644)
	for _, odd := range []string{"with space.txt", "ünïcødé-名前.txt", "q?h#p%.txt", "-leading-dash", ".hidden", "semi;colon&amp", "tab\tname"} {
		write("odd/"+odd, []byte("odd name "+odd+"\n"), 0o644)
	}
	for _, d := range []string{"empty-dir", "nested/empty/dir"} {
		if err := os.MkdirAll(filepath.Join(dir, d), 0o755); err != nil {
			tb.Fatal(err)
		}
	}
	if err := os.MkdirAll(filepath.Join(dir, "private"), 0o700); err != nil {
		tb.Fatal(err)
	}
	write("private/notes.txt", []byte("mine\n"), 0o600)
	if err := os.Chmod(filepath.Join(dir, "private"), 0o750); err != nil {
		tb.Fatal(err)
	}
	for link, target := range map[string]string{
		"link-to-readme":        "README.md",
		"src/link-to-module":    "pkg/deep/er/still/module.py",
		"nested/link-up":        "../data",
		"dangling-link-in-tree": "does/not/exist",
	} {
		if err := os.Symlink(target, filepath.Join(dir, link)); err != nil {
			tb.Fatal(err)
		}
	}
	return total
}

// entry is what a restored workspace must reproduce of one path.
type entry struct {
	Type   string // "file", "dir" or "symlink"
	Mode   fs.FileMode
	SHA256 string
	Size   int64
	Target string
}

func scanTree(tb testing.TB, root string) map[string]entry {
	tb.Helper()
	out := map[string]entry{}
	err := filepath.WalkDir(root, func(p string, de fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(root, p)
		if rel == "." {
			return nil
		}
		fi, err := os.Lstat(p)
		if err != nil {
			return err
		}
		e := entry{Mode: fi.Mode().Perm()}
		switch {
		case fi.Mode()&fs.ModeSymlink != 0:
			e.Type, e.Mode = "symlink", 0
			if e.Target, err = os.Readlink(p); err != nil {
				return err
			}
		case fi.IsDir():
			e.Type = "dir"
		case fi.Mode().IsRegular():
			e.Type, e.Size = "file", fi.Size()
			f, err := os.Open(p)
			if err != nil {
				return err
			}
			h := sha256.New()
			_, err = io.Copy(h, f)
			f.Close()
			if err != nil {
				return err
			}
			e.SHA256 = hex.EncodeToString(h.Sum(nil))
		default:
			e.Type = fi.Mode().Type().String()
		}
		out[rel] = e
		return nil
	})
	if err != nil {
		tb.Fatal(err)
	}
	return out
}

// compareTrees fails the test for every path that differs.
func compareTrees(tb testing.TB, want, got map[string]entry) {
	tb.Helper()
	var paths []string
	for p := range want {
		paths = append(paths, p)
	}
	for p := range got {
		if _, ok := want[p]; !ok {
			paths = append(paths, p)
		}
	}
	sort.Strings(paths)
	bad := 0
	for _, p := range paths {
		w, wok := want[p]
		g, gok := got[p]
		switch {
		case !gok:
			tb.Errorf("%q missing after restore (%+v)", p, w)
		case !wok:
			tb.Errorf("%q appeared after restore (%+v)", p, g)
		case w != g:
			tb.Errorf("%q differs:\n  before %+v\n  after  %+v", p, w, g)
		default:
			continue
		}
		if bad++; bad > 20 {
			tb.Fatal("too many differences")
		}
	}
}
