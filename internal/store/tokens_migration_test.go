package store

import (
	"context"
	"errors"
	"path/filepath"
	"testing"
)

// Migration 00013 lets exchange tokens in (SQLite rebuilds the table):
// tokens made before it still authenticate, and migrating down drops the
// exchange tokens, which the old constraint cannot hold, and keeps the rest.
func TestExchangeTokenMigration(t *testing.T) {
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
	if _, err := p.DownTo(ctx, 12); err != nil {
		t.Fatalf("down to 00012: %v", err)
	}
	agent := Token{Hash: TokenHash{1}, Kind: TokenAgent, AgentID: "agent-1"}
	if _, err := s.CreateToken(ctx, agent); err != nil {
		t.Fatal(err)
	}
	if _, err := s.CreateToken(ctx, Token{Hash: TokenHash{2}, Kind: TokenExchange}); err == nil {
		t.Fatal("an exchange token was stored before the migration allows them")
	}
	if _, err := p.Up(ctx); err != nil {
		t.Fatalf("up: %v", err)
	}
	if got, err := s.LookupToken(ctx, agent.Hash); err != nil || got.AgentID != "agent-1" {
		t.Fatalf("agent token after the migration: %+v, %v", got, err)
	}
	if _, err := s.CreateToken(ctx, Token{Hash: TokenHash{2}, Kind: TokenExchange, Subject: "idp"}); err != nil {
		t.Fatalf("exchange token: %v", err)
	}
	if got, err := s.LookupToken(ctx, TokenHash{2}); err != nil || got.Kind != TokenExchange || got.Subject != "idp" {
		t.Fatalf("exchange token read back: %+v, %v", got, err)
	}
	if _, err := s.CreateToken(ctx, Token{Hash: TokenHash{3}, Kind: TokenExchange, AgentID: "agent-1"}); !errors.Is(err, ErrInvalid) {
		t.Errorf("exchange token bound to an agent: %v", err)
	}
	if _, err := p.DownTo(ctx, 12); err != nil {
		t.Fatalf("down to 00012 again: %v", err)
	}
	if _, err := s.LookupToken(ctx, TokenHash{2}); !errors.Is(err, ErrNotFound) {
		t.Errorf("exchange token after migrating down: %v", err)
	}
	if _, err := s.LookupToken(ctx, agent.Hash); err != nil {
		t.Errorf("agent token after migrating down: %v", err)
	}
}
