package store

import (
	"context"
	"path/filepath"
	"testing"
	"time"
)

// Migration 00010 makes SQLite's run_events again (to let it hold artifact
// events): the events of runs recorded before it are kept, in order, and
// migrating down drops the artifact events and keeps the rest.
func TestRunArtifactsMigrationKeepsEvents(t *testing.T) {
	ctx := context.Background()
	s, err := OpenSQLite(ctx, filepath.Join(t.TempDir(), "agentbox.db"), Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	p, err := s.migrationProvider()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := p.DownTo(ctx, 8); err != nil {
		t.Fatalf("down to 00008: %v", err)
	}
	now := time.Now().UTC()
	if _, err := s.wdb.ExecContext(ctx, `INSERT INTO runs (id, caller, mode, agent_id, command, status, created_at)
		VALUES ('run-1', 'tok', 'agent', 'agent-1', '{"argv":["true"]}', 'running', $1)`, now); err != nil {
		t.Fatal(err)
	}
	if _, err := s.wdb.ExecContext(ctx, `INSERT INTO run_events (run_id, seq, type, data, at)
		VALUES ('run-1', 1, 'state', '{"status":"running"}', $1), ('run-1', 2, 'stdout', '{"text":"hi\n"}', $1)`, now); err != nil {
		t.Fatal(err)
	}
	if _, err := p.Up(ctx); err != nil {
		t.Fatalf("up: %v", err)
	}
	if _, err := s.RecordRunArtifact(ctx, RunArtifact{RunID: "run-1", Path: "a", Size: 1, SHA256: "x", ObjectKey: "k"}); err != nil {
		t.Fatal(err)
	}
	evs, err := s.ListRunEvents(ctx, "run-1", 0, 0)
	if err != nil || len(evs) != 3 || evs[1].Type != RunEventStdout || evs[2].Type != RunEventArtifact || evs[2].Seq != 3 {
		t.Fatalf("events after the migration: %+v, %v", evs, err)
	}
	// The run's events still go with it.
	if _, err := s.wdb.ExecContext(ctx, `INSERT INTO runs (id, caller, mode, agent_id, command, status, created_at)
		VALUES ('run-2', 'tok', 'agent', 'agent-1', '{"argv":["true"]}', 'running', $1)`, now); err != nil {
		t.Fatal(err)
	}
	if _, err := s.AppendRunEvents(ctx, "run-2", RunEvent{Type: RunEventStdout, Data: `{"text":"x"}`}); err != nil {
		t.Fatal(err)
	}
	if _, err := s.wdb.ExecContext(ctx, `DELETE FROM runs WHERE id = 'run-2'`); err != nil {
		t.Fatal(err)
	}
	if evs, err := s.ListRunEvents(ctx, "run-2", 0, 0); err != nil || len(evs) != 0 {
		t.Errorf("events outlived their run: %+v, %v", evs, err)
	}
	if _, err := p.DownTo(ctx, 8); err != nil {
		t.Fatalf("down to 00008 again: %v", err)
	}
	if evs, err := s.ListRunEvents(ctx, "run-1", 0, 0); err != nil || len(evs) != 2 {
		t.Errorf("events after migrating down: %+v, %v", evs, err)
	}
}
