package objectstore_test

import (
	"bytes"
	"context"
	"crypto/rand"
	"errors"
	"io"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/agentbox/terraform-provider-agentbox/internal/objectstore"
	"github.com/agentbox/terraform-provider-agentbox/internal/testenv/s3server"
)

// forEachStore runs test against a real S3 server and against a
// directory. The S3 server is started inside its subtest, so that a
// machine without it skips only that half.
func forEachStore(t *testing.T, test func(t *testing.T, s objectstore.Store)) {
	t.Run(objectstore.KindS3, func(t *testing.T) {
		srv := s3server.Start(t)
		s, err := objectstore.New(objectstore.Config{Endpoint: srv.Endpoint, Bucket: srv.Bucket, Region: srv.Region,
			AccessKeyID: srv.AccessKeyID, SecretAccessKey: srv.SecretAccessKey, PartSize: objectstore.MinPartSize})
		if err != nil {
			t.Fatal(err)
		}
		test(t, s)
	})
	t.Run(objectstore.KindEmbedded, func(t *testing.T) {
		s, err := objectstore.New(objectstore.Config{Dir: t.TempDir()})
		if err != nil {
			t.Fatal(err)
		}
		test(t, s)
	})
}

func randomBytes(t *testing.T, n int) []byte {
	t.Helper()
	b := make([]byte, n)
	if _, err := rand.Read(b); err != nil {
		t.Fatal(err)
	}
	return b
}

// TestRoundTrip: objects of known and unknown size (one over a multipart
// part) are stored whole with their metadata, read back byte for byte,
// listed under their prefix only, and removed.
func TestRoundTrip(t *testing.T) {
	forEachStore(t, func(t *testing.T, s objectstore.Store) {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		defer cancel()
		if err := s.Check(ctx); err != nil {
			t.Fatalf("check: %v", err)
		}
		small := randomBytes(t, 1000)
		big := randomBytes(t, objectstore.MinPartSize+12345)
		objects := map[string][]byte{"p/run-1/a.txt": small, "p/run-1/sub/big.bin": big, "p/run-10/x": small[:10], "p/run-1/empty": nil}
		for key, data := range objects {
			size := int64(len(data))
			if key == "p/run-1/sub/big.bin" {
				size = -1 // a stream of unknown length
			}
			if err := s.Put(ctx, key, bytes.NewReader(data), size, objectstore.PutOptions{Meta: map[string]string{"Agentbox-Test": key}}); err != nil {
				t.Fatalf("put %s: %v", key, err)
			}
		}
		for key, data := range objects {
			info, err := s.Stat(ctx, key)
			if err != nil || info.Size != int64(len(data)) || objectstore.MetaValue(info.Meta, "Agentbox-Test") != key {
				t.Fatalf("stat %s: %+v, %v", key, info, err)
			}
			r, err := s.Get(ctx, key, info)
			if err != nil {
				t.Fatal(err)
			}
			got, err := io.ReadAll(r)
			_ = r.Close()
			if err != nil || !bytes.Equal(got, data) {
				t.Fatalf("get %s: %d bytes, %v; want %d", key, len(got), err, len(data))
			}
		}
		var listed []string
		var total int64
		if err := s.List(ctx, "p/run-1/", func(i objectstore.Info) error {
			listed = append(listed, i.Key)
			total += i.Size
			return nil
		}); err != nil {
			t.Fatal(err)
		}
		sort.Strings(listed)
		if strings.Join(listed, ",") != "p/run-1/a.txt,p/run-1/empty,p/run-1/sub/big.bin" || total != int64(len(small)+len(big)) {
			t.Fatalf("listed %v (%d bytes)", listed, total)
		}
		stop := errors.New("stop")
		if err := s.List(ctx, "p/", func(objectstore.Info) error { return stop }); !errors.Is(err, stop) {
			t.Errorf("a listing stopped by its callback returned %v", err)
		}
		if err := s.List(ctx, "nothing/here/", func(i objectstore.Info) error {
			t.Errorf("listed %s under an empty prefix", i.Key)
			return nil
		}); err != nil {
			t.Errorf("list of an empty prefix: %v", err)
		}
		for _, key := range listed {
			if err := s.Remove(ctx, key); err != nil {
				t.Fatal(err)
			}
		}
		if err := s.Remove(ctx, "p/run-1/a.txt"); err != nil {
			t.Errorf("removing a removed object: %v", err)
		}
		if _, err := s.Stat(ctx, "p/run-1/a.txt"); !errors.Is(err, objectstore.ErrNotFound) {
			t.Errorf("stat of a removed object: %v", err)
		}
		if _, err := s.Stat(ctx, "p/run-10/x"); err != nil {
			t.Errorf("an object beside the removed ones went too: %v", err)
		}
	})
}

// failingReader fails after some bytes, as a sandbox's stream cut short.
type failingReader struct{ n int }

func (f *failingReader) Read(p []byte) (int, error) {
	if f.n <= 0 {
		return 0, errors.New("the stream broke")
	}
	n := min(len(p), f.n)
	f.n -= n
	return n, nil
}

// TestPutIsWholeOrNothing: a put whose reader fails, or yields less than
// the size it was given, leaves no object behind.
func TestPutIsWholeOrNothing(t *testing.T) {
	forEachStore(t, func(t *testing.T, s objectstore.Store) {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		if err := s.Put(ctx, "k/broken", &failingReader{n: 3 << 20}, -1, objectstore.PutOptions{}); err == nil {
			t.Fatal("a put whose reader failed succeeded")
		}
		if err := s.Put(ctx, "k/short", bytes.NewReader([]byte("abc")), 10, objectstore.PutOptions{}); err == nil {
			t.Fatal("a put of 3 bytes announced as 10 succeeded")
		}
		for _, key := range []string{"k/broken", "k/short"} {
			if _, err := s.Stat(ctx, key); !errors.Is(err, objectstore.ErrNotFound) {
				t.Errorf("%s after a failed put: %v, want not found", key, err)
			}
			_ = s.RemoveIncomplete(ctx, key)
		}
		n := 0
		if err := s.List(ctx, "k/", func(objectstore.Info) error { n++; return nil }); err != nil || n != 0 {
			t.Errorf("failed puts left %d objects (%v)", n, err)
		}
	})
}

// TestDirListSkipsPartials: the directory store's listing shows neither
// the temporary files of puts in flight nor files a key cannot name.
func TestDirListSkipsPartials(t *testing.T) {
	dir := t.TempDir()
	s, err := objectstore.New(objectstore.Config{Dir: dir})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	if err := s.Put(ctx, "r/a", strings.NewReader("x"), 1, objectstore.PutOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "r", ".a.partial-0011"), []byte("half"), 0o600); err != nil {
		t.Fatal(err)
	}
	var keys []string
	if err := s.List(ctx, "r/", func(i objectstore.Info) error { keys = append(keys, i.Key); return nil }); err != nil {
		t.Fatal(err)
	}
	if len(keys) != 1 || keys[0] != "r/a" {
		t.Fatalf("listed %v, want r/a alone", keys)
	}
	if err := s.Put(ctx, "../out", strings.NewReader("x"), 1, objectstore.PutOptions{}); err == nil {
		t.Error("a key climbing out of the directory was accepted")
	}
}

func TestNewValidates(t *testing.T) {
	for name, tc := range map[string]struct {
		cfg  objectstore.Config
		want string
	}{
		"dir and S3":   {objectstore.Config{Dir: "/s", Endpoint: "https://s3.example.com"}, "configure one store"},
		"relative dir": {objectstore.Config{Dir: "s"}, "absolute path"},
		"no endpoint":  {objectstore.Config{}, "endpoint URL is required"},
		"remote http":  {objectstore.Config{Endpoint: "http://s3.example.com", Bucket: "b", AccessKeyID: "a", SecretAccessKey: "s"}, "plain http"},
		"credentials in URL": {objectstore.Config{Endpoint: "https://ak:sk@s3.example.com", Bucket: "b", AccessKeyID: "a", SecretAccessKey: "s"},
			"must not carry credentials"},
		"small parts": {objectstore.Config{Endpoint: "https://s3.example.com", Bucket: "bucket", AccessKeyID: "a", SecretAccessKey: "s", PartSize: 1},
			"below S3's minimum"},
	} {
		t.Run(name, func(t *testing.T) {
			_, err := objectstore.New(tc.cfg)
			if err == nil || !strings.Contains(err.Error(), tc.want) || strings.Contains(err.Error(), "sk@") {
				t.Fatalf("error %v, want one mentioning %q", err, tc.want)
			}
		})
	}
}
