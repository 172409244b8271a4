// Package store is the control plane's metadata and audit store: API token
// hashes, staff console sessions, snapshot records, lease history, the
// hash-chained audit log, the MCP tool-catalog cache, filespace metadata,
// the warm takes that decide who gets each ready warm sandbox, and the
// records of runs (commands executed to completion in a sandbox), whose
// every change of state is one conditional update, so that of replicas
// racing to finish, cancel or sweep a run exactly one decides its end.
//
// # Backends
//
// One *Store type runs on two databases through database/sql:
//
//   - SQLite (modernc.org/sqlite, pure Go), the default: a file on the
//     control plane's PVC, in WAL mode with a busy timeout. Writes go
//     through one connection whose transactions begin IMMEDIATE; reads
//     use a small read-only pool.
//   - PostgreSQL (pgx through its database/sql driver), when the chart is
//     given a DSN. It is required for more than one replica.
//
// Open picks the backend from the DSN ("postgres://..." or a file path).
// Everything that differs between the two is in dialect.go and the two
// migrations folders; the queries are written once.
//
// # Migrations
//
// Versioned SQL files per dialect (migrations/sqlite, migrations/postgres)
// are embedded and applied on Open by pressly/goose, recorded in the
// schema_migrations table. On PostgreSQL a session advisory lock makes
// replicas that start together migrate once. Open refuses, with
// ErrSchemaTooNew, a database that a newer binary has migrated further.
// A new migration is a new numbered file in both folders.
//
// # Audit chain
//
// Records are numbered 1, 2, ... without gaps. Each stores the previous
// record's hash and its own:
//
//	hash = SHA-256(prev_hash || canonical(record))
//
// where the first prev_hash is 32 zero bytes and canonical is: the format
// byte 1; seq and the time in Unix microseconds as 8-byte big-endian;
// caller, caller kind, agent id, operation and params hash as strings;
// the duration in nanoseconds (8 bytes); the result (string); the status
// (8 bytes); request id and detail (strings). A string is its length as a
// uvarint followed by its bytes. The audit_head row holds the tip; an
// append locks it (SELECT ... FOR UPDATE on PostgreSQL, the write lock on
// SQLite) so that concurrent writers in any number of processes extend one
// linear chain. Triggers refuse UPDATE and DELETE on audit_log.
//
// Known secret formats (package redact) are redacted from the free text a
// caller put into a record (agent id, request id, detail) before it is
// hashed, and from console reasons and transcripts before they are stored.
//
// VerifyAudit recomputes the chain and names the first record that was
// changed, deleted or moved. Someone able to rewrite the database can
// still rebuild the whole chain from the point they changed; to catch
// that, record Head somewhere else now and then and pass it to
// VerifyAudit as an anchor.
//
// # Example
//
//	s, err := store.Open(ctx, "/var/lib/agentbox/agentbox.db", store.Options{})
//	...
//	tok, err := s.LookupToken(ctx, sha256.Sum256([]byte(bearer)))
//	...
//	_, err = s.AppendAudit(ctx, store.AuditEntry{Caller: tok.ID, CallerKind: string(tok.Kind),
//		AgentID: tok.AgentID, Operation: "run_command", Result: "ok", Status: 200})
package store
