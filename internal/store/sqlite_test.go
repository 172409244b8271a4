package store

import (
	"context"
	"path/filepath"
	"testing"
	"time"
)

// TestSQLiteSettings checks what OpenSQLite promises of every connection:
// WAL, the busy timeout, and a read pool that cannot write.
func TestSQLiteSettings(t *testing.T) {
	ctx := context.Background()
	s, err := OpenSQLite(ctx, filepath.Join(t.TempDir(), "agentbox.db"), Options{BusyTimeout: 7 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	want := map[string]string{"journal_mode": "wal", "synchronous": "1", "busy_timeout": "7000", "foreign_keys": "1"}
	for pragma, v := range want {
		var got string
		if err := s.wdb.QueryRowContext(ctx, "PRAGMA "+pragma).Scan(&got); err != nil {
			t.Fatal(err)
		}
		if got != v {
			t.Errorf("writer %s = %s, want %s", pragma, got, v)
		}
	}
	var bt string
	if err := s.db.QueryRowContext(ctx, "PRAGMA busy_timeout").Scan(&bt); err != nil || bt != "7000" {
		t.Errorf("reader busy_timeout = %s, %v", bt, err)
	}
	if _, err := s.db.ExecContext(ctx, `UPDATE audit_head SET seq = seq`); err == nil {
		t.Error("the read pool accepted a write")
	}
	if _, err := OpenSQLite(ctx, "x.db?mode=memory", Options{}); err == nil {
		t.Error("a path with a query string was accepted")
	}
}
