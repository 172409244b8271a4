package store_test

import (
	"bytes"
	"context"
	"crypto/rand"
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/agentbox/terraform-provider-agentbox/internal/store"
)

// TestFilespaceBlobRoom: a SQLite store refuses filespace contents that
// would eat into the room it keeps free on its volume for the audit log,
// before writing any of them, and goes on taking audit records.
func TestFilespaceBlobRoom(t *testing.T) {
	ctx := context.Background()
	const gib = 1 << 30
	// A 10 GiB volume holding only the store, whose files take what they
	// take of budget.
	budget := int64(gib)
	dir := t.TempDir()
	s := open(t, filepath.Join(dir, "agentbox.db"), store.Options{
		VolumeSpace: func(d string) (int64, int64, error) {
			if d != dir {
				t.Errorf("measured %s, want the store's directory %s", d, dir)
			}
			entries, err := os.ReadDir(d)
			if err != nil {
				return 0, 0, err
			}
			used := int64(0)
			for _, e := range entries {
				if fi, err := e.Info(); err == nil {
					used += fi.Size()
				}
			}
			return budget - used, 10 * gib, nil
		},
	})
	room, err := s.BlobRoom(ctx)
	if err != nil {
		t.Fatal(err)
	}
	// A twentieth of the volume is kept.
	if !room.Known || room.Reserve != gib/2 || room.VolumeBytes != 10*gib || room.Free > gib || room.Free < gib-(16<<20) ||
		room.Bytes != room.Free-gib/2 {
		t.Fatalf("room %+v", room)
	}

	data := make([]byte, 8*store.BlobChunkSize)
	_, _ = rand.Read(data)
	sum := sumOf(data)
	// Room for a few chunks above the reserve, not for all eight.
	budget = gib - room.Free + gib/2 + 4*store.BlobChunkSize
	_, err = s.PutBlob(ctx, sum, bytes.NewReader(data))
	if !errors.Is(err, store.ErrStoreFull) || !strings.Contains(err.Error(), "keeps for its audit log") {
		t.Fatalf("a blob past the room: %v, want ErrStoreFull", err)
	}
	t.Logf("refused: %v", err)
	if _, ok, err := s.BlobExists(ctx, sum); ok || err != nil {
		t.Fatalf("the refused blob exists: %v, %v", ok, err)
	}
	var chunks int
	if err := s.RawDB().QueryRowContext(ctx, `SELECT count(*) FROM filespace_blob_chunks`).Scan(&chunks); err != nil || chunks != 0 {
		t.Fatalf("%d chunks of the refused blob left (%v)", chunks, err)
	}
	if _, err := s.AppendAudit(ctx, store.AuditEntry{Caller: "c", CallerKind: "admin", Operation: "status", Result: "ok"}); err != nil {
		t.Fatalf("an audit record after the refused blob: %v", err)
	}
	// The refused chunks' pages are free again in the database: room.
	budget += 8 * store.BlobChunkSize
	if _, err := s.PutBlob(ctx, sum, bytes.NewReader(data)); err != nil {
		t.Fatalf("the blob once there is room: %v", err)
	}
}

// TestFilespaceBlobDatabaseFull: a database that fills up (SQLITE_FULL,
// here from max_page_count) fails the blob with ErrStoreFull, removes its
// chunks, and takes audit records afterwards.
func TestFilespaceBlobDatabaseFull(t *testing.T) {
	ctx := context.Background()
	s := open(t, filepath.Join(t.TempDir(), "agentbox.db"), store.Options{})
	db := s.RawDB()
	var pages int64
	if err := db.QueryRowContext(ctx, `PRAGMA page_count`).Scan(&pages); err != nil {
		t.Fatal(err)
	}
	// The writer has one connection, so the limit holds for every write.
	if _, err := db.ExecContext(ctx, `PRAGMA max_page_count = `+strconv.FormatInt(pages+200, 10)); err != nil {
		t.Fatal(err)
	}
	data := make([]byte, 4*store.BlobChunkSize)
	_, _ = rand.Read(data)
	_, err := s.PutBlob(ctx, sumOf(data), bytes.NewReader(data))
	if !errors.Is(err, store.ErrStoreFull) {
		t.Fatalf("a blob past a full database: %v, want ErrStoreFull", err)
	}
	var chunks int
	if err := db.QueryRowContext(ctx, `SELECT count(*) FROM filespace_blob_chunks`).Scan(&chunks); err != nil || chunks != 0 {
		t.Fatalf("%d chunks of the failed blob left (%v)", chunks, err)
	}
	if _, err := s.AppendAudit(ctx, store.AuditEntry{Caller: "c", CallerKind: "admin", Operation: "status", Result: "ok"}); err != nil {
		t.Fatalf("an audit record after the database filled: %v", err)
	}
}

// TestFilespaceBlobRoomPostgres: PostgreSQL's room is its operator's to
// watch; the store does not claim to know it.
func TestFilespaceBlobRoomPostgres(t *testing.T) {
	s := open(t, backends[1].newDSN(t), store.Options{})
	room, err := s.BlobRoom(context.Background())
	if err != nil || room.Known {
		t.Fatalf("room %+v, %v; want unknown", room, err)
	}
}
