package archive_test

import (
	"archive/tar"
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/minio/minio-go/v7"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	"github.com/agentbox/terraform-provider-agentbox/internal/snapshot"
	"github.com/agentbox/terraform-provider-agentbox/internal/snapshot/archive"
	"github.com/agentbox/terraform-provider-agentbox/internal/testenv/s3server"
)

func TestNewValidates(t *testing.T) {
	ok := archive.Config{Endpoint: "https://s3.example.com", Bucket: "snapshots", AccessKeyID: "a", SecretAccessKey: "s"}
	cases := map[string]struct {
		mod  func(*archive.Config)
		want string // "" means accepted
	}{
		"valid https":           {func(*archive.Config) {}, ""},
		"loopback http":         {func(c *archive.Config) { c.Endpoint = "http://127.0.0.1:9000" }, ""},
		"localhost http":        {func(c *archive.Config) { c.Endpoint = "http://localhost:9000/" }, ""},
		"ipv6 loopback http":    {func(c *archive.Config) { c.Endpoint = "http://[::1]:9000" }, ""},
		"allowed remote http":   {func(c *archive.Config) { c.Endpoint, c.AllowHTTP = "http://minio.minio.svc:9000", true }, ""},
		"no endpoint":           {func(c *archive.Config) { c.Endpoint = "" }, "endpoint URL is required"},
		"no scheme":             {func(c *archive.Config) { c.Endpoint = "s3.example.com" }, "http:// or https://"},
		"ftp":                   {func(c *archive.Config) { c.Endpoint = "ftp://s3.example.com" }, "http:// or https://"},
		"path":                  {func(c *archive.Config) { c.Endpoint = "https://s3.example.com/bucket" }, "without a path"},
		"query":                 {func(c *archive.Config) { c.Endpoint = "https://s3.example.com?x=1" }, "without a path or query"},
		"user info":             {func(c *archive.Config) { c.Endpoint = "https://ak:sk@s3.example.com" }, "must not carry credentials"},
		"remote http":           {func(c *archive.Config) { c.Endpoint = "http://s3.example.com" }, "plain http"},
		"CA with http":          {func(c *archive.Config) { c.Endpoint, c.CAPEM = "http://127.0.0.1:9000", []byte("x") }, "not https"},
		"CA not PEM":            {func(c *archive.Config) { c.CAPEM = []byte("not a certificate") }, "no PEM certificate"},
		"no bucket":             {func(c *archive.Config) { c.Bucket = "" }, "bucket is required"},
		"bad bucket":            {func(c *archive.Config) { c.Bucket = "Not_A_Bucket" }, `bucket "Not_A_Bucket"`},
		"no access key":         {func(c *archive.Config) { c.AccessKeyID = "" }, "access key ID and the secret access key"},
		"no secret key":         {func(c *archive.Config) { c.SecretAccessKey = "" }, "access key ID and the secret access key"},
		"bad compression":       {func(c *archive.Config) { c.Compression = "zstd" }, `compression "zstd"`},
		"small parts":           {func(c *archive.Config) { c.PartSize = 1 << 20 }, "below S3's minimum"},
		"empty prefix segment":  {func(c *archive.Config) { c.Prefix = "a//b" }, "empty segment"},
		"slashes around prefix": {func(c *archive.Config) { c.Prefix = "/a/b/" }, ""},
		"directory and S3":      {func(c *archive.Config) { c.Dir = "/var/lib/agentbox-snapshots" }, "configure one store"},
		"directory alone": {func(c *archive.Config) {
			*c = archive.Config{Dir: "/var/lib/agentbox-snapshots", Prefix: "agentbox/"}
		}, ""},
		"relative directory":     {func(c *archive.Config) { *c = archive.Config{Dir: "snapshots"} }, "absolute path"},
		"dot prefix, directory":  {func(c *archive.Config) { *c = archive.Config{Dir: "/s", Prefix: "a/../../etc"} }, "not a plain relative path"},
		"dot segment, directory": {func(c *archive.Config) { *c = archive.Config{Dir: "/s", Prefix: ".hidden"} }, "not a plain relative path"},
	}
	for name, tc := range cases {
		t.Run(name, func(t *testing.T) {
			cfg := ok
			tc.mod(&cfg)
			d, err := archive.New(cfg)
			if tc.want == "" {
				if err != nil {
					t.Fatalf("rejected: %v", err)
				}
				d.Close()
				return
			}
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("error %v, want one mentioning %q", err, tc.want)
			}
			if strings.Contains(err.Error(), "sk@") {
				t.Errorf("the error repeats the credentials: %v", err)
			}
		})
	}
}

func TestKeyLayout(t *testing.T) {
	for _, tc := range []struct {
		prefix string
		comp   archive.Compression
		want   string
	}{
		{"agentbox/snapshots", "", "agentbox/snapshots/team-a/agent-1/agent-1-3.tar.gz"},
		{"/agentbox/", archive.CompressionNone, "agentbox/team-a/agent-1/agent-1-3.tar"},
		{"", archive.CompressionGzip, "team-a/agent-1/agent-1-3.tar.gz"},
	} {
		d, err := archive.New(archive.Config{Endpoint: "http://127.0.0.1:1", Bucket: "snapshots", AccessKeyID: "a", SecretAccessKey: "s", Prefix: tc.prefix, Compression: tc.comp})
		if err != nil {
			t.Fatal(err)
		}
		if got := d.Key(newSandbox("agent-1", "u1"), "agent-1-3"); got != tc.want {
			t.Errorf("prefix %q, compression %q: key %q, want %q", tc.prefix, tc.comp, got, tc.want)
		}
		d.Close()
	}
}

// TestRoundTrip stops a workspace into the real S3 server through a real
// supervisor, restores it through another supervisor on an empty
// directory, and compares every path.
func TestRoundTrip(t *testing.T) { forEachBackend(t, testRoundTrip) }

func testRoundTrip(t *testing.T, b *backend) {
	p := newPKI(t)
	for _, comp := range []archive.Compression{archive.CompressionGzip, archive.CompressionNone} {
		t.Run(string(comp), func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
			defer cancel()
			d := b.driver(t, func(c *archive.Config) { c.Compression = comp })
			sb := newSandbox("agent-"+string(comp), "uid-"+string(comp))
			ws := t.TempDir()
			content := fillWorkspace(t, ws, 7<<20) // more than one 5 MiB part
			want := scanTree(t, ws)
			src := startSupervisor(t, p, sb, ws, supervisorOptions{})

			start := time.Now()
			st, calls, err := takeUntilDone(ctx, d, snapshot.Request{Sandbox: sb, Name: "snap-1", Supervisor: src.client, ClaimName: "ws"})
			if err != nil || !st.Ready {
				t.Fatalf("Take = %+v after %d calls, %v", st, calls, err)
			}
			t.Logf("Take: %d entries, %d bytes of files -> %d-byte object in %s (%d calls)", len(want), content, st.SizeBytes, time.Since(start).Round(time.Millisecond), calls)
			size, ok := b.object(t, ctx, d.Key(sb, "snap-1"))
			if !ok {
				t.Fatalf("the archive is not at %s", d.Location(sb, "snap-1"))
			}
			if size != st.SizeBytes || st.ReadyTime.IsZero() {
				t.Errorf("State %+v, object size %d", st, size)
			}
			if comp == archive.CompressionGzip && st.SizeBytes >= content {
				t.Errorf("gzip archive of %d bytes is not smaller than the %d bytes of files", st.SizeBytes, content)
			}
			if comp == archive.CompressionNone && st.SizeBytes < content {
				t.Errorf("plain archive of %d bytes is smaller than the %d bytes of files", st.SizeBytes, content)
			}

			// The pod is gone; a new one starts with an empty workspace.
			src.kill()
			fresh := t.TempDir()
			dst := startSupervisor(t, p, sb, fresh, supervisorOptions{})
			start = time.Now()
			if err := d.Restore(ctx, snapshot.RestoreRequest{Sandbox: sb, Snapshot: &v1alpha1.SandboxSnapshot{Name: "snap-1"}, Supervisor: dst.client}); err != nil {
				t.Fatalf("Restore: %v", err)
			}
			t.Logf("Restore in %s", time.Since(start).Round(time.Millisecond))
			compareTrees(t, want, scanTree(t, fresh))
		})
	}
}

// A driver configured for the other compression still restores an
// archive, so a configuration change does not strand stopped sandboxes.
func TestRestoreAfterCompressionChange(t *testing.T) {
	forEachBackend(t, testRestoreAfterCompressionChange)
}

func testRestoreAfterCompressionChange(t *testing.T, b *backend) {
	p := newPKI(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	sb := newSandbox("agent-1", "uid-1")
	ws := t.TempDir()
	fillWorkspace(t, ws, 1<<10)
	src := startSupervisor(t, p, sb, ws, supervisorOptions{})
	gz := b.driver(t, nil)
	if st, _, err := takeUntilDone(ctx, gz, snapshot.Request{Sandbox: sb, Name: "s1", Supervisor: src.client}); err != nil || !st.Ready {
		t.Fatalf("Take = %+v, %v", st, err)
	}
	plain := b.driver(t, func(c *archive.Config) { c.Compression = archive.CompressionNone })
	fresh := t.TempDir()
	dst := startSupervisor(t, p, sb, fresh, supervisorOptions{})
	if err := plain.Restore(ctx, snapshot.RestoreRequest{Sandbox: sb, Snapshot: &v1alpha1.SandboxSnapshot{Name: "s1"}, Supervisor: dst.client}); err != nil {
		t.Fatalf("Restore with the other compression configured: %v", err)
	}
	compareTrees(t, scanTree(t, ws), scanTree(t, fresh))
}

// Take on a snapshot that is already stored reports it without reading the
// workspace again, also from a new driver (a restarted control plane).
func TestTakeIsIdempotent(t *testing.T) { forEachBackend(t, testTakeIsIdempotent) }

func testTakeIsIdempotent(t *testing.T, b *backend) {
	p := newPKI(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	sb := newSandbox("agent-1", "uid-1")
	ws := t.TempDir()
	fillWorkspace(t, ws, 1<<20)
	sup := startSupervisor(t, p, sb, ws, supervisorOptions{})
	d := b.driver(t, nil)
	req := snapshot.Request{Sandbox: sb, Name: "s1", Supervisor: sup.client}

	first, _, err := takeUntilDone(ctx, d, req)
	if err != nil || !first.Ready {
		t.Fatalf("Take = %+v, %v", first, err)
	}
	// The workspace changes after the snapshot; a second Take must not
	// pick that up.
	if err := os.WriteFile(ws+"/after.txt", []byte("later"), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, drv := range []*archive.Driver{d, b.driver(t, nil)} {
		again, err := drv.Take(ctx, req)
		if err != nil || !again.Ready || again.SizeBytes != first.SizeBytes || !again.ReadyTime.Equal(first.ReadyTime) {
			t.Fatalf("second Take = %+v, %v; first was %+v", again, err, first)
		}
	}
	// A repeat after the pod is gone (a restarted control plane, a stale
	// cache) has no supervisor and must still find the snapshot ready.
	noPod := req
	noPod.Supervisor = nil
	if again, err := b.driver(t, nil).Take(ctx, noPod); err != nil || !again.Ready {
		t.Fatalf("Take without a supervisor after the upload = %+v, %v; want ready", again, err)
	}
	noPod.Name = "never-taken"
	if _, err := d.Take(ctx, noPod); err == nil || !strings.Contains(err.Error(), "supervisor") {
		t.Errorf("Take without a supervisor of a missing archive: %v; want an error naming the supervisor", err)
	}
	if n := sup.getTars.Load(); n != 1 {
		t.Errorf("the workspace was read %d times, want once", n)
	}
	// Same size and time: the object was not written again.
	if again, err := d.Take(ctx, req); err != nil || again.SizeBytes != first.SizeBytes || !again.ReadyTime.Equal(first.ReadyTime) {
		t.Errorf("the object changed: %+v, %v; first was %+v", again, err, first)
	}
}

// A sandbox re-created under the same name (a new UID) never restores its
// predecessor's archive, and its own Take replaces it.
func TestUIDMismatch(t *testing.T) { forEachBackend(t, testUIDMismatch) }

func testUIDMismatch(t *testing.T, b *backend) {
	p := newPKI(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	d := b.driver(t, nil)
	old, successor := newSandbox("agent-1", "uid-old"), newSandbox("agent-1", "uid-new")
	ws := t.TempDir()
	fillWorkspace(t, ws, 1<<10)
	sup := startSupervisor(t, p, old, ws, supervisorOptions{})
	if st, _, err := takeUntilDone(ctx, d, snapshot.Request{Sandbox: old, Name: "s1", Supervisor: sup.client}); err != nil || !st.Ready {
		t.Fatalf("Take = %+v, %v", st, err)
	}

	fresh := t.TempDir()
	dst := startSupervisor(t, p, successor, fresh, supervisorOptions{})
	err := d.Restore(ctx, snapshot.RestoreRequest{Sandbox: successor, Snapshot: &v1alpha1.SandboxSnapshot{Name: "s1"}, Supervisor: dst.client})
	if !errors.Is(err, snapshot.ErrNotFound) || !strings.Contains(err.Error(), "uid-old") {
		t.Fatalf("Restore of a predecessor's archive: %v, want ErrNotFound naming its UID", err)
	}
	t.Logf("refused: %v", err)
	if entries, _ := os.ReadDir(fresh); len(entries) != 0 {
		t.Errorf("the refused restore wrote %d entries", len(entries))
	}

	// The successor's own snapshot under the same name replaces the
	// archive instead of taking the old one for its own.
	ws2 := t.TempDir()
	if err := os.WriteFile(ws2+"/mine.txt", []byte("successor"), 0o644); err != nil {
		t.Fatal(err)
	}
	sup2 := startSupervisor(t, p, successor, ws2, supervisorOptions{})
	if st, _, err := takeUntilDone(ctx, d, snapshot.Request{Sandbox: successor, Name: "s1", Supervisor: sup2.client}); err != nil || !st.Ready {
		t.Fatalf("successor's Take = %+v, %v", st, err)
	}
	if sup2.getTars.Load() != 1 {
		t.Fatalf("the successor's workspace was read %d times, want once", sup2.getTars.Load())
	}
	if err := d.Restore(ctx, snapshot.RestoreRequest{Sandbox: successor, Snapshot: &v1alpha1.SandboxSnapshot{Name: "s1"}, Supervisor: dst.client}); err != nil {
		t.Fatal(err)
	}
	compareTrees(t, scanTree(t, ws2), scanTree(t, fresh))
	err = d.Restore(ctx, snapshot.RestoreRequest{Sandbox: old, Snapshot: &v1alpha1.SandboxSnapshot{Name: "s1"}, Supervisor: dst.client})
	if !errors.Is(err, snapshot.ErrNotFound) {
		t.Fatalf("Restore by the predecessor after the successor's snapshot: %v, want ErrNotFound", err)
	}
}

func TestMissingAndDelete(t *testing.T) { forEachBackend(t, testMissingAndDelete) }

func testMissingAndDelete(t *testing.T, b *backend) {
	p := newPKI(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	d := b.driver(t, nil)
	sb := newSandbox("agent-1", "uid-1")
	ws := t.TempDir()
	fillWorkspace(t, ws, 1<<10)
	sup := startSupervisor(t, p, sb, ws, supervisorOptions{})
	restore := func(name string) error {
		return d.Restore(ctx, snapshot.RestoreRequest{Sandbox: sb, Snapshot: &v1alpha1.SandboxSnapshot{Name: name}, Supervisor: sup.client})
	}

	if err := restore("never-taken"); !errors.Is(err, snapshot.ErrNotFound) {
		t.Fatalf("Restore of a snapshot never taken: %v, want ErrNotFound", err)
	}
	if st, _, err := takeUntilDone(ctx, d, snapshot.Request{Sandbox: sb, Name: "s1", Supervisor: sup.client}); err != nil || !st.Ready {
		t.Fatalf("Take = %+v, %v", st, err)
	}
	for i := 0; i < 2; i++ { // deleting what is gone is not an error
		if err := d.Delete(ctx, sb, "s1"); err != nil {
			t.Fatalf("Delete #%d: %v", i+1, err)
		}
	}
	if _, ok := b.object(t, ctx, d.Key(sb, "s1")); ok {
		t.Fatal("the archive is still there after Delete")
	}
	if err := restore("s1"); !errors.Is(err, snapshot.ErrNotFound) {
		t.Fatalf("Restore after Delete: %v, want ErrNotFound", err)
	}

	// A bucket or directory that is gone is a configuration error to fix,
	// not a lost snapshot.
	wrongBucket := b.broken(t)
	err := wrongBucket.Restore(ctx, snapshot.RestoreRequest{Sandbox: sb, Snapshot: &v1alpha1.SandboxSnapshot{Name: "s1"}, Supervisor: sup.client})
	if err == nil || errors.Is(err, snapshot.ErrNotFound) {
		t.Fatalf("Restore from a missing bucket: %v, want an error other than ErrNotFound", err)
	}
	if err := wrongBucket.Check(ctx); err == nil {
		t.Error("Check passed on a missing bucket")
	} else {
		t.Logf("Check: %v", err)
	}
	if err := d.Check(ctx); err != nil {
		t.Errorf("Check: %v", err)
	}
	if _, err := wrongBucket.Take(ctx, snapshot.Request{Sandbox: sb, Name: "s2", Supervisor: sup.client}); err == nil {
		t.Error("Take into a missing bucket succeeded")
	}
}

// A store that is down is a transient error for every operation, never a
// failed snapshot or a lost one.
func TestStoreDown(t *testing.T) {
	p := newPKI(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	// A loopback port nothing listens on.
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close()
	d, err := archive.New(archive.Config{Endpoint: "http://" + addr, Bucket: "agentbox-snapshots", AccessKeyID: "a", SecretAccessKey: "s", MaxRetries: 1})
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	sb := newSandbox("agent-1", "uid-1")
	ws := t.TempDir()
	fillWorkspace(t, ws, 1<<10)
	sup := startSupervisor(t, p, sb, ws, supervisorOptions{})

	st, _, err := takeUntilDone(ctx, d, snapshot.Request{Sandbox: sb, Name: "s1", Supervisor: sup.client})
	if err == nil || st.Ready || st.Failed != "" {
		t.Fatalf("Take with the store down = %+v, %v; want an error and neither ready nor failed", st, err)
	}
	t.Logf("Take: %v", err)
	err = d.Restore(ctx, snapshot.RestoreRequest{Sandbox: sb, Snapshot: &v1alpha1.SandboxSnapshot{Name: "s1"}, Supervisor: sup.client})
	if err == nil || errors.Is(err, snapshot.ErrNotFound) {
		t.Fatalf("Restore with the store down: %v, want an error other than ErrNotFound", err)
	}
	if err := d.Delete(ctx, sb, "s1"); err == nil {
		t.Fatal("Delete with the store down succeeded")
	}
	if err := d.Check(ctx); err == nil {
		t.Fatal("Check with the store down succeeded")
	}
}

// stallTransport lets a GET tar response through up to limit bytes, then
// reports that on reached and blocks reads until release is closed; the
// test kills the supervisor in between.
type stallTransport struct {
	base    http.RoundTripper
	limit   int64
	reached chan struct{}
	release chan struct{}
	once    sync.Once
}

func (s *stallTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	resp, err := s.base.RoundTrip(r)
	if err != nil || r.Method != http.MethodGet || r.URL.Query().Get("format") != "tar" {
		return resp, err
	}
	resp.Body = &stallBody{ReadCloser: resp.Body, t: s}
	return resp, nil
}

type stallBody struct {
	io.ReadCloser
	t *stallTransport
	n int64
}

func (b *stallBody) Read(p []byte) (int, error) {
	if b.n >= b.t.limit {
		b.t.once.Do(func() { close(b.t.reached) })
		<-b.t.release
	}
	if rest := b.t.limit - b.n; rest > 0 && int64(len(p)) > rest {
		p = p[:rest]
	}
	n, err := b.ReadCloser.Read(p)
	b.n += int64(n)
	return n, err
}

// TestInterruptedUpload cuts a snapshot half-way in the two ways it can
// be cut: the supervisor dies (the stream breaks), and the control plane
// stops (the upload is abandoned, as in a crash). Neither may ever leave
// an archive that Take reports ready or that Restore reads; the next
// attempt succeeds.
func TestInterruptedUpload(t *testing.T) {
	t.Run(archive.StoreS3, func(t *testing.T) {
		s3 := s3server.Start(t)
		testInterruptedUpload(t, s3Backend(t, s3), func(t *testing.T, ctx context.Context, d *archive.Driver, key string, sb *v1alpha1.Sandbox) {
			// A control plane killed mid-upload cannot abort: its parts
			// stay as an incomplete upload, with this sandbox's metadata.
			// Leave one behind the way it would, through the S3 API.
			core := minio.Core{Client: s3.Client(t)}
			meta := map[string]string{"Agentbox-Sandbox-Uid": string(sb.UID)}
			id, err := core.NewMultipartUpload(ctx, s3.Bucket, key, minio.PutObjectOptions{UserMetadata: meta})
			if err != nil {
				t.Fatal(err)
			}
			part := bytes.Repeat([]byte{7}, archive.MinPartSize)
			if _, err := core.PutObjectPart(ctx, s3.Bucket, key, id, 1, bytes.NewReader(part), int64(len(part)), minio.PutObjectPartOptions{}); err != nil {
				t.Fatal(err)
			}
		})
	})
	t.Run(archive.StoreEmbedded, func(t *testing.T) {
		b := dirBackend(t)
		testInterruptedUpload(t, b, func(t *testing.T, _ context.Context, d *archive.Driver, key string, sb *v1alpha1.Sandbox) {
			// A control plane killed mid-write leaves its temporary file,
			// header and all, beside the archive's name.
			path := d.Location(sb, "s3")
			if err := os.MkdirAll(filepath.Dir(path), 0o750); err != nil {
				t.Fatal(err)
			}
			header := `{"format":"agentbox-archive/v1","meta":{"Agentbox-Sandbox-Uid":"` + string(sb.UID) + `"}}` + "\n"
			partial := filepath.Join(filepath.Dir(path), "."+filepath.Base(path)+".partial-0123456789abcdef")
			if err := os.WriteFile(partial, append([]byte(header), bytes.Repeat([]byte{7}, 1<<20)...), 0o640); err != nil {
				t.Fatal(err)
			}
		})
	})
}

// testInterruptedUpload is TestInterruptedUpload against one store;
// leaveIncomplete leaves behind what a control plane killed in the middle
// of writing key would.
func testInterruptedUpload(t *testing.T, b *backend, leaveIncomplete func(t *testing.T, ctx context.Context, d *archive.Driver, key string, sb *v1alpha1.Sandbox)) {
	p := newPKI(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	sb := newSandbox("agent-1", "uid-1")
	ws := t.TempDir()
	fillWorkspace(t, ws, 24<<20)
	incomplete := func(key string) int { return b.incomplete(t, ctx, key) }
	visible := func(key string) bool {
		_, ok := b.object(t, ctx, key)
		return ok
	}

	t.Run("supervisor dies", func(t *testing.T) {
		// Uncompressed, so that 12 MiB of tar are two whole 5 MiB parts
		// already uploaded when the stream breaks.
		d := b.driver(t, func(c *archive.Config) { c.Compression = archive.CompressionNone; c.TakeWait = time.Minute })
		stall := &stallTransport{limit: 12 << 20, reached: make(chan struct{}), release: make(chan struct{})}
		sup := startSupervisor(t, p, sb, ws, supervisorOptions{wrap: func(rt http.RoundTripper) http.RoundTripper { stall.base = rt; return stall }})
		key := d.Key(sb, "s1")
		type result struct {
			st  snapshot.State
			err error
		}
		res := make(chan result, 1)
		go func() {
			st, err := d.Take(ctx, snapshot.Request{Sandbox: sb, Name: "s1", Supervisor: sup.client})
			res <- result{st, err}
		}()
		<-stall.reached
		// Parts are written, and the write is in progress, not visible.
		if n := incomplete(key); n != 1 {
			t.Errorf("%d writes in progress, want 1", n)
		}
		if visible(key) {
			t.Error("the half-written archive is visible")
		}
		sup.kill()
		close(stall.release)
		r := <-res
		if r.err == nil || r.st.Ready {
			t.Fatalf("Take with the supervisor killed mid-stream = %+v, %v; want an error", r.st, r.err)
		}
		t.Logf("Take: %v", r.err)
		if visible(key) {
			t.Error("an archive is visible after the failed write")
		}
		if n := incomplete(key); n != 0 {
			t.Errorf("the failed write was not discarded: %d left", n)
		}
		// The next Take, on a new pod, starts over and completes.
		sup2 := startSupervisor(t, p, sb, ws, supervisorOptions{})
		if st, _, err := takeUntilDone(ctx, d, snapshot.Request{Sandbox: sb, Name: "s1", Supervisor: sup2.client}); err != nil || !st.Ready {
			t.Fatalf("Take after the failure = %+v, %v", st, err)
		}
	})

	t.Run("control plane stops", func(t *testing.T) {
		d := b.driver(t, func(c *archive.Config) { c.Compression = archive.CompressionNone })
		stall := &stallTransport{limit: 12 << 20, reached: make(chan struct{}), release: make(chan struct{})}
		sup := startSupervisor(t, p, sb, ws, supervisorOptions{wrap: func(rt http.RoundTripper) http.RoundTripper { stall.base = rt; return stall }})
		key := d.Key(sb, "s2")
		st, err := d.Take(ctx, snapshot.Request{Sandbox: sb, Name: "s2", Supervisor: sup.client})
		if err != nil || st.Ready {
			t.Fatalf("first Take = %+v, %v; want in progress", st, err)
		}
		<-stall.reached
		// The driver is closed with the upload in flight: the upload is
		// cancelled and aborted.
		d.Close()
		close(stall.release)
		deadline := time.Now().Add(30 * time.Second)
		for incomplete(key) != 0 && time.Now().Before(deadline) {
			time.Sleep(50 * time.Millisecond)
		}
		if n := incomplete(key); n != 0 {
			t.Errorf("%d incomplete writes left behind by Close", n)
		}
		if visible(key) {
			t.Fatal("a cancelled write is visible")
		}
	})

	t.Run("control plane killed", func(t *testing.T) {
		d := b.driver(t, func(c *archive.Config) { c.Compression = archive.CompressionNone })
		key := d.Key(sb, "s3")
		leaveIncomplete(t, ctx, d, key, sb)
		if n := incomplete(key); n != 1 {
			t.Fatalf("%d incomplete writes, want the one left behind", n)
		}
		if visible(key) {
			t.Fatal("an incomplete write is visible")
		}
		if st, err := d.Take(ctx, snapshot.Request{Sandbox: sb, Name: "s3"}); err == nil || st.Ready {
			t.Fatalf("Take without a supervisor over an incomplete write = %+v, %v; want not ready", st, err)
		}
		err := d.Restore(ctx, snapshot.RestoreRequest{Sandbox: sb, Snapshot: &v1alpha1.SandboxSnapshot{Name: "s3"}, Supervisor: nil})
		if err == nil {
			t.Fatal("Restore without a supervisor succeeded")
		}
		// The restarted control plane does not take the leftover for a
		// snapshot: it reads the workspace again, and clears the leftover.
		sup := startSupervisor(t, p, sb, ws, supervisorOptions{})
		st, calls, err := takeUntilDone(ctx, d, snapshot.Request{Sandbox: sb, Name: "s3", Supervisor: sup.client})
		if err != nil || !st.Ready {
			t.Fatalf("Take after the crash = %+v, %v", st, err)
		}
		if n := sup.getTars.Load(); n != 1 {
			t.Errorf("the workspace was read %d times, want once", n)
		}
		if n := incomplete(key); n != 0 {
			t.Errorf("%d incomplete uploads left after the retry", n)
		}
		fresh := t.TempDir()
		dst := startSupervisor(t, p, sb, fresh, supervisorOptions{})
		if err := d.Restore(ctx, snapshot.RestoreRequest{Sandbox: sb, Snapshot: &v1alpha1.SandboxSnapshot{Name: "s3"}, Supervisor: dst.client}); err != nil {
			t.Fatal(err)
		}
		compareTrees(t, scanTree(t, ws), scanTree(t, fresh))
		t.Logf("ready after %d calls", calls)
	})
}

// copyTar's guard: a tar cut exactly between two entries parses to a
// clean EOF, and only the missing end-of-archive marker gives it away.
func TestTruncatedTarBetweenEntries(t *testing.T) {
	var whole bytes.Buffer
	tw := tar.NewWriter(&whole)
	for _, name := range []string{"a", "b"} {
		data := []byte(strings.Repeat(name, 512)) // a whole block: no padding
		if err := tw.WriteHeader(&tar.Header{Name: name, Mode: 0o644, Size: int64(len(data)), Typeflag: tar.TypeReg}); err != nil {
			t.Fatal(err)
		}
		if _, err := tw.Write(data); err != nil {
			t.Fatal(err)
		}
	}
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	cut := whole.Bytes()[:2*1024] // header+data of a, header+data of b
	// The standard reader sees nothing wrong.
	tr := tar.NewReader(bytes.NewReader(cut))
	for {
		_, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatalf("archive/tar now notices the cut (%v); the guard may be redundant", err)
		}
	}
	if _, err := archive.CopyTar(io.Discard, bytes.NewReader(cut)); err == nil || !strings.Contains(err.Error(), "end-of-archive marker") {
		t.Fatalf("copyTar of a cut tar: %v, want a missing marker error", err)
	}
	var out bytes.Buffer
	if n, err := archive.CopyTar(&out, bytes.NewReader(whole.Bytes())); err != nil || n != 2 || !bytes.Equal(out.Bytes(), whole.Bytes()) {
		t.Fatalf("copyTar of a whole tar: %d entries, %v; bytes equal %v", n, err, bytes.Equal(out.Bytes(), whole.Bytes()))
	}
}
