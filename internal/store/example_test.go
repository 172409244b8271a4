package store_test

import (
	"context"
	"crypto/sha256"
	"fmt"
	"os"
	"path/filepath"

	"github.com/agentbox/terraform-provider-agentbox/internal/store"
)

// The control plane opens the store once (a SQLite file on its PVC, or a
// postgres:// DSN), keeps only token hashes, and audits every call.
func Example() {
	dir, err := os.MkdirTemp("", "agentbox-store-example-")
	if err != nil {
		panic(err)
	}
	defer os.RemoveAll(dir)
	ctx := context.Background()

	s, err := store.Open(ctx, filepath.Join(dir, "agentbox.db"), store.Options{})
	if err != nil {
		panic(err)
	}
	defer s.Close()

	// Issue a token: hand the raw token to the agent, keep only its hash.
	raw := "abx_example-token"
	tok, err := s.CreateToken(ctx, store.Token{Hash: sha256.Sum256([]byte(raw)), Kind: store.TokenAgent, AgentID: "agent-1"})
	if err != nil {
		panic(err)
	}

	// Authenticate a request carrying the raw token.
	caller, err := s.LookupToken(ctx, sha256.Sum256([]byte(raw)))
	if err != nil {
		panic(err)
	}
	fmt.Println("caller may address", caller.AgentID)

	// Audit the call, then check the chain.
	if _, err := s.AppendAudit(ctx, store.AuditEntry{Caller: tok.ID, CallerKind: string(tok.Kind),
		AgentID: "agent-1", Operation: "run_command", Result: "ok", Status: 200}); err != nil {
		panic(err)
	}
	report, err := s.VerifyAudit(ctx)
	if err != nil {
		panic(err)
	}
	fmt.Println("audit chain intact:", report.OK(), "records:", report.Records)
	// Output:
	// caller may address agent-1
	// audit chain intact: true records: 1
}
