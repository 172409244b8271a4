package store_test

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"io"
	"sync"
	"testing"
	"time"

	"github.com/agentbox/terraform-provider-agentbox/internal/store"
)

// TestFilespaceBlobs runs the blob store against both backends.
func TestFilespaceBlobs(t *testing.T) {
	for _, b := range backends {
		t.Run(b.name, func(t *testing.T) { testFilespaceBlobs(t, b) })
	}
}

func sumOf(b []byte) string {
	h := sha256.Sum256(b)
	return hex.EncodeToString(h[:])
}

func readBlob(t *testing.T, s *store.Store, sum string) []byte {
	t.Helper()
	rc, size, err := s.OpenBlob(context.Background(), sum)
	if err != nil {
		t.Fatalf("open blob %s: %v", sum, err)
	}
	defer rc.Close()
	data, err := io.ReadAll(rc)
	if err != nil {
		t.Fatalf("read blob %s: %v", sum, err)
	}
	if int64(len(data)) != size {
		t.Fatalf("blob %s: read %d bytes, size says %d", sum, len(data), size)
	}
	return data
}

func testFilespaceBlobs(t *testing.T, b backend) {
	ctx := context.Background()
	clk := newClock()
	s := open(t, b.newDSN(t), store.Options{Now: clk.Now})

	// Sizes around the chunk boundary, and the empty file.
	for _, n := range []int{0, 1, store.BlobChunkSize - 1, store.BlobChunkSize, 2*store.BlobChunkSize + 17} {
		data := make([]byte, n)
		if _, err := rand.Read(data); err != nil {
			t.Fatal(err)
		}
		sum := sumOf(data)
		info, err := s.PutBlob(ctx, sum, bytes.NewReader(data))
		if err != nil || info.Existed || info.SizeBytes != int64(n) {
			t.Fatalf("put %d bytes: %+v, %v", n, info, err)
		}
		if got := readBlob(t, s, sum); !bytes.Equal(got, data) {
			t.Fatalf("%d bytes read back differently", n)
		}
		// A second put of the same content does not read it.
		again, err := s.PutBlob(ctx, sum, iotestErrReader{})
		if err != nil || !again.Existed || again.SizeBytes != int64(n) {
			t.Fatalf("second put of %d bytes: %+v, %v", n, again, err)
		}
	}

	// Bytes that do not match the named digest store nothing.
	wrong := sumOf([]byte("something else"))
	if _, err := s.PutBlob(ctx, wrong, bytes.NewReader(make([]byte, store.BlobChunkSize+5))); !errors.Is(err, store.ErrDigestMismatch) {
		t.Fatalf("mismatched put: %v", err)
	}
	if _, ok, err := s.BlobExists(ctx, wrong); ok || err != nil {
		t.Fatalf("a mismatched put left a blob: %v, %v", ok, err)
	}
	if n := countRows(t, s, "filespace_blob_chunks"); n != chunksStored(t, s) {
		t.Fatalf("a mismatched put left %d chunks beyond the stored blobs'", n-chunksStored(t, s))
	}
	if _, _, err := s.OpenBlob(ctx, wrong); !errors.Is(err, store.ErrNotFound) {
		t.Fatalf("open missing blob: %v", err)
	}
	for _, bad := range []string{"", "abc", sumOf(nil)[:63] + "G", "ABCDEF" + sumOf(nil)[6:]} {
		if _, err := s.PutBlob(ctx, bad, bytes.NewReader(nil)); !errors.Is(err, store.ErrInvalid) {
			t.Errorf("digest %q accepted: %v", bad, err)
		}
	}

	// Concurrent puts of the same content leave one blob and its chunks.
	data := make([]byte, 3*store.BlobChunkSize/2)
	if _, err := rand.Read(data); err != nil {
		t.Fatal(err)
	}
	sum := sumOf(data)
	var wg sync.WaitGroup
	errs := make([]error, 4)
	for i := range errs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, errs[i] = s.PutBlob(ctx, sum, bytes.NewReader(data))
		}()
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Fatalf("concurrent put %d: %v", i, err)
		}
	}
	if got := readBlob(t, s, sum); !bytes.Equal(got, data) {
		t.Fatal("concurrently put blob reads back differently")
	}
	if n, want := countRows(t, s, "filespace_blob_chunks"), chunksStored(t, s); n != want {
		t.Fatalf("%d chunks stored, the blobs name %d", n, want)
	}

	// Tampered chunks fail the read instead of returning other bytes.
	if _, err := s.RawDB().ExecContext(ctx, `UPDATE filespace_blob_chunks SET data = $1
		WHERE upload_id = (SELECT upload_id FROM filespace_blobs WHERE sha256 = $2) AND seq = 0`,
		make([]byte, store.BlobChunkSize), sum); err != nil {
		t.Fatal(err)
	}
	rc, _, err := s.OpenBlob(ctx, sum)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := io.ReadAll(rc); !errors.Is(err, store.ErrDigestMismatch) {
		t.Fatalf("tampered blob read: %v", err)
	}
	rc.Close()

	// Purge keeps what a live file names and what is too recent.
	keep := []byte("kept: a live file names me")
	if _, err := s.PutBlob(ctx, sumOf(keep), bytes.NewReader(keep)); err != nil {
		t.Fatal(err)
	}
	if _, err := s.PutFile(ctx, store.FileNode{AgentID: "a1", Path: "k.txt", SizeBytes: int64(len(keep)),
		SHA256: sumOf(keep), UpdatedAt: clk.Now()}); err != nil {
		t.Fatal(err)
	}
	gone := []byte("deleted file's content")
	if _, err := s.PutBlob(ctx, sumOf(gone), bytes.NewReader(gone)); err != nil {
		t.Fatal(err)
	}
	if _, err := s.PutFile(ctx, store.FileNode{AgentID: "a1", Path: "g.txt", SizeBytes: int64(len(gone)),
		SHA256: sumOf(gone), UpdatedAt: clk.Now()}); err != nil {
		t.Fatal(err)
	}
	if _, err := s.PutFile(ctx, store.FileNode{AgentID: "a1", Path: "g.txt", UpdatedAt: clk.Now().Add(time.Second), Deleted: true}); err != nil {
		t.Fatal(err)
	}
	if n, err := s.PurgeBlobs(ctx, clk.Now().Add(-time.Hour)); err != nil || n != 0 {
		t.Fatalf("purge before everything removed %d, %v", n, err)
	}
	n, err := s.PurgeBlobs(ctx, clk.Now().Add(time.Minute))
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("purged %d blobs", n)
	if _, ok, _ := s.BlobExists(ctx, sumOf(keep)); !ok {
		t.Error("purge removed a blob a live file names")
	}
	if _, ok, _ := s.BlobExists(ctx, sumOf(gone)); ok {
		t.Error("purge kept the blob of a deleted file")
	}
	if _, ok, _ := s.BlobExists(ctx, sum); ok {
		t.Error("purge kept an unnamed blob")
	}
	if got := readBlob(t, s, sumOf(keep)); !bytes.Equal(got, keep) {
		t.Error("kept blob reads back differently")
	}
	if n, want := countRows(t, s, "filespace_blob_chunks"), chunksStored(t, s); n != want {
		t.Fatalf("after purge %d chunks stored, the blobs name %d", n, want)
	}
}

// chunksStored is the number of chunks the stored blobs name.
func chunksStored(t *testing.T, s *store.Store) int {
	t.Helper()
	var n int
	if err := s.RawDB().QueryRow(`SELECT CAST(COALESCE(SUM(chunks), 0) AS BIGINT) FROM filespace_blobs`).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// iotestErrReader fails every read: a put that reads it did more than it
// needed.
type iotestErrReader struct{}

func (iotestErrReader) Read([]byte) (int, error) {
	return 0, errors.New("read when the blob was already stored")
}
