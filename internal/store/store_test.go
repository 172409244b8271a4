package store_test

import (
	"bufio"
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/agentbox/terraform-provider-agentbox/internal/store"
)

// TestStore is the one suite both backends must pass.
func TestStore(t *testing.T) {
	cases := []struct {
		name string
		run  func(t *testing.T, b backend)
	}{
		{"Migrations", testMigrations},
		{"Tokens", testTokens},
		{"TokenNeverStored", testTokenNeverStored},
		{"ConsoleSessions", testConsoleSessions},
		{"Redaction", testRedaction},
		{"Snapshots", testSnapshots},
		{"LeaseHistory", testLeaseHistory},
		{"WarmTakes", testWarmTakes},
		{"AuditQuery", testAuditQuery},
		{"AuditBatch", testAuditBatch},
		{"AuditTamper", testAuditTamper},
		{"AuditConcurrentAppends", testAuditConcurrent},
		{"Filespace", testFilespace},
		{"ToolCatalogs", testToolCatalogs},
	}
	for _, b := range backends {
		t.Run(b.name, func(t *testing.T) {
			for _, c := range cases {
				t.Run(c.name, func(t *testing.T) { c.run(t, b) })
			}
		})
	}
}

func testMigrations(t *testing.T, b backend) {
	ctx := context.Background()
	dsn := b.newDSN(t)
	s := open(t, dsn, store.Options{})
	cur, latest, err := s.SchemaVersion(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if cur < 1 || cur != latest {
		t.Fatalf("after Open the schema is at %d of %d", cur, latest)
	}
	tables, err := s.Tables(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("schema version %d, tables %v", cur, tables)
	for _, want := range []string{store.MigrationsTable, "api_tokens", "audit_log", "audit_head", "console_sessions",
		"snapshots", "lease_events", "tool_catalogs", "filespace_nodes", "warm_takes", "console_transcript", "runs", "run_events",
		"agent_events", "agent_event_heads", "user_token_keys", "user_token_revocations"} {
		if !contains(tables, want) {
			t.Errorf("table %s missing", want)
		}
	}
	// Data written before a reopen must survive it: migrations that ran
	// once never run again.
	if _, err := s.AppendAudit(ctx, store.AuditEntry{Caller: "c", Operation: "op"}); err != nil {
		t.Fatal(err)
	}
	rowsBefore := countRows(t, s, store.MigrationsTable)

	// Replicas starting together must migrate once and all come up.
	var wg sync.WaitGroup
	errs := make([]error, 3)
	for i := range errs {
		wg.Go(func() {
			s2, err := store.Open(ctx, dsn, store.Options{})
			if err == nil {
				err = s2.Close()
			}
			errs[i] = err
		})
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Fatalf("reopen %d: %v", i, err)
		}
	}
	if got := countRows(t, s, store.MigrationsTable); got != rowsBefore {
		t.Errorf("reopening changed %s from %d to %d rows", store.MigrationsTable, rowsBefore, got)
	}
	if rep, err := s.VerifyAudit(ctx); err != nil || !rep.OK() || rep.Records != 1 {
		t.Errorf("audit after reopen: %+v, %v", rep, err)
	}

	// A database migrated by a newer binary is refused, and left alone.
	if _, err := s.RawDB().ExecContext(ctx, `INSERT INTO `+store.MigrationsTable+
		` (version_id, is_applied) VALUES ($1, $2)`, latest+1, true); err != nil {
		t.Fatal(err)
	}
	rowsBefore = countRows(t, s, store.MigrationsTable)
	_, err = store.Open(ctx, dsn, store.Options{})
	if !errors.Is(err, store.ErrSchemaTooNew) {
		t.Fatalf("Open on a newer schema: %v, want ErrSchemaTooNew", err)
	}
	t.Logf("refused: %v", err)
	if got := countRows(t, s, store.MigrationsTable); got != rowsBefore {
		t.Errorf("the refused Open changed %s", store.MigrationsTable)
	}
}

func testTokens(t *testing.T, b backend) {
	ctx := context.Background()
	clk := newClock()
	s := open(t, b.newDSN(t), store.Options{Now: clk.Now})

	raw := randomToken(t)
	hash := store.TokenHash(sha256.Sum256([]byte(raw)))
	created, err := s.CreateToken(ctx, store.Token{Hash: hash, Kind: store.TokenAgent, AgentID: "agent-1", Subject: "ci"})
	if err != nil {
		t.Fatal(err)
	}
	if created.ID == "" || !created.CreatedAt.Equal(clk.Now().Truncate(time.Microsecond)) {
		t.Errorf("created token: %+v", created)
	}
	got, err := s.LookupToken(ctx, hash)
	if err != nil {
		t.Fatal(err)
	}
	if got.ID != created.ID || got.Kind != store.TokenAgent || got.AgentID != "agent-1" || got.Hash != hash ||
		!got.CreatedAt.Equal(created.CreatedAt) || got.ExpiresAt != nil || got.RevokedAt != nil {
		t.Errorf("lookup = %+v, want %+v", got, created)
	}
	if _, err := s.LookupToken(ctx, store.TokenHash(sha256.Sum256([]byte(raw+"x")))); !errors.Is(err, store.ErrNotFound) {
		t.Errorf("lookup of an unknown hash: %v", err)
	}
	if _, err := s.CreateToken(ctx, store.Token{Hash: hash, Kind: store.TokenAdmin}); !errors.Is(err, store.ErrConflict) {
		t.Errorf("second token with the same hash: %v", err)
	}
	for _, bad := range []store.Token{
		{Hash: hashOf("a"), Kind: store.TokenAgent},
		{Hash: hashOf("b"), Kind: store.TokenAdmin, AgentID: "agent-1"},
		{Hash: hashOf("c"), Kind: "root"},
		{Kind: store.TokenAdmin},
	} {
		if _, err := s.CreateToken(ctx, bad); !errors.Is(err, store.ErrInvalid) {
			t.Errorf("CreateToken(%+v): %v, want ErrInvalid", bad, err)
		}
	}

	// Expiry follows the store's clock.
	exp := clk.Now().Add(time.Hour)
	staff, err := s.CreateToken(ctx, store.Token{Hash: hashOf("staff"), Kind: store.TokenStaff, Subject: "alice", ExpiresAt: &exp})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.LookupToken(ctx, hashOf("staff")); err != nil {
		t.Errorf("staff token before expiry: %v", err)
	}
	clk.Advance(time.Hour)
	tok, err := s.LookupToken(ctx, hashOf("staff"))
	if !errors.Is(err, store.ErrExpired) || tok.ID != staff.ID {
		t.Errorf("staff token at expiry: %+v, %v", tok, err)
	}

	// Revocation.
	if err := s.RevokeToken(ctx, created.ID); err != nil {
		t.Fatal(err)
	}
	tok, err = s.LookupToken(ctx, hash)
	if !errors.Is(err, store.ErrRevoked) || tok.ID != created.ID || tok.RevokedAt == nil {
		t.Errorf("revoked token: %+v, %v", tok, err)
	}
	if err := s.RevokeToken(ctx, "nope"); !errors.Is(err, store.ErrNotFound) {
		t.Errorf("revoke unknown: %v", err)
	}
	for i := range 3 {
		if _, err := s.CreateToken(ctx, store.Token{Hash: hashOf(fmt.Sprint("agent-2-", i)), Kind: store.TokenAgent, AgentID: "agent-2"}); err != nil {
			t.Fatal(err)
		}
	}
	if n, err := s.RevokeAgentTokens(ctx, "agent-2"); err != nil || n != 3 {
		t.Errorf("RevokeAgentTokens = %d, %v; want 3", n, err)
	}
	live, err := s.ListTokens(ctx, store.TokenFilter{})
	if err != nil {
		t.Fatal(err)
	}
	if len(live) != 1 || live[0].ID != staff.ID {
		t.Errorf("live tokens: %+v, want only the staff token", live)
	}
	all, err := s.ListTokens(ctx, store.TokenFilter{Kind: store.TokenAgent, IncludeRevoked: true})
	if err != nil {
		t.Fatal(err)
	}
	if len(all) != 4 {
		t.Errorf("agent tokens including revoked: %d, want 4", len(all))
	}
}

// testTokenNeverStored checks every column of every table for the raw
// token after a token's whole life (create, lookup, audit, revoke).
func testTokenNeverStored(t *testing.T, b backend) {
	ctx := context.Background()
	s := open(t, b.newDSN(t), store.Options{})
	raw := randomToken(t)
	hash := store.TokenHash(sha256.Sum256([]byte(raw)))
	tok, err := s.CreateToken(ctx, store.Token{Hash: hash, Kind: store.TokenAgent, AgentID: "agent-1"})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.LookupToken(ctx, hash); err != nil {
		t.Fatal(err)
	}
	if _, err := s.AppendAudit(ctx, store.AuditEntry{Caller: tok.ID, CallerKind: "agent", AgentID: "agent-1", Operation: "status"}); err != nil {
		t.Fatal(err)
	}
	if err := s.RevokeToken(ctx, tok.ID); err != nil {
		t.Fatal(err)
	}

	tables, err := s.Tables(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var cells int
	sawHash := false
	for _, table := range tables {
		rows, err := s.RawDB().QueryContext(ctx, `SELECT * FROM `+table)
		if err != nil {
			t.Fatal(err)
		}
		cols, _ := rows.Columns()
		for rows.Next() {
			vals := make([]any, len(cols))
			ptrs := make([]any, len(cols))
			for i := range vals {
				ptrs[i] = &vals[i]
			}
			if err := rows.Scan(ptrs...); err != nil {
				t.Fatal(err)
			}
			for i, v := range vals {
				cells++
				var text []byte
				switch v := v.(type) {
				case []byte:
					text = v
					if bytes.Equal(v, hash[:]) {
						sawHash = true
					}
				case string:
					text = []byte(v)
				default:
					text = fmt.Append(nil, v)
				}
				for _, form := range []string{raw, hex.EncodeToString([]byte(raw))} {
					if bytes.Contains(text, []byte(form)) || bytes.Contains([]byte(hex.EncodeToString(text)), []byte(form)) {
						t.Errorf("%s.%s holds the raw token", table, cols[i])
					}
				}
			}
		}
		if err := rows.Err(); err != nil {
			t.Fatal(err)
		}
		rows.Close()
	}
	if !sawHash {
		t.Fatal("the token's hash was not found either: the scan read nothing")
	}
	t.Logf("checked %d cells in %d tables", cells, len(tables))
}

func testConsoleSessions(t *testing.T, b backend) {
	ctx := context.Background()
	clk := newClock()
	s := open(t, b.newDSN(t), store.Options{Now: clk.Now, MaxTranscript: 20})

	if _, err := s.CreateConsoleSession(ctx, "alice", "agent-1", "  ", time.Minute); !errors.Is(err, store.ErrInvalid) {
		t.Errorf("session without a reason: %v", err)
	}
	c, err := s.CreateConsoleSession(ctx, "alice", "agent-1", "ticket 42: agent stuck", 15*time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	clk.Advance(time.Minute)
	conn, err := s.ConnectConsoleSession(ctx, c.ID, "snap-7")
	if err != nil {
		t.Fatal(err)
	}
	if conn.ConnectedAt == nil || !conn.ConnectedAt.Equal(c.CreatedAt.Add(time.Minute)) || conn.SnapshotID != "snap-7" {
		t.Errorf("connected session: %+v", conn)
	}
	if _, err := s.ConnectConsoleSession(ctx, c.ID, "snap-7"); !errors.Is(err, store.ErrConflict) {
		t.Errorf("second connect: %v, want ErrConflict", err)
	}
	in, out := store.TranscriptInput, store.TranscriptOutput
	if err := s.AppendConsoleTranscript(ctx, c.ID, store.TranscriptRecord{Direction: in, Data: []byte("ls\r")},
		store.TranscriptRecord{Direction: out, Data: []byte("$ ls\n")}); err != nil {
		t.Fatal(err)
	}
	clk.Advance(time.Second)
	for _, chunk := range []string{"workspace\n", "$ cat secret-but-long\n"} {
		if err := s.AppendConsoleTranscript(ctx, c.ID, store.TranscriptRecord{Direction: out, Data: []byte(chunk)}); err != nil {
			t.Fatal(err)
		}
	}
	if err := s.AppendConsoleTranscript(ctx, c.ID, store.TranscriptRecord{Direction: "sideways", Data: []byte("x")}); !errors.Is(err, store.ErrInvalid) {
		t.Errorf("a record of no direction: %v", err)
	}
	clk.Advance(2*time.Minute - time.Second)
	done, err := s.DisconnectConsoleSession(ctx, c.ID)
	if err != nil {
		t.Fatal(err)
	}
	got, err := s.GetConsoleSession(ctx, c.ID)
	if err != nil {
		t.Fatal(err)
	}
	if got.StaffID != "alice" || got.AgentID != "agent-1" || got.Reason != "ticket 42: agent stuck" ||
		got.DisconnectedAt == nil || !got.DisconnectedAt.Equal(done.CreatedAt.Add(3*time.Minute)) ||
		string(got.Transcript) != "$ ls\nworkspace\n$ " || !got.TranscriptTruncated ||
		!got.ExpiresAt.Equal(c.CreatedAt.Add(15*time.Minute)) {
		t.Errorf("finished session: %+v (transcript %q)", got, got.Transcript)
	}
	// Both directions, in order, each with its time; the cap of 20 bytes
	// counts both and cuts the record that passes it.
	want := []store.TranscriptRecord{
		{Direction: in, At: c.CreatedAt.Add(time.Minute), Data: []byte("ls\r")},
		{Direction: out, At: c.CreatedAt.Add(time.Minute), Data: []byte("$ ls\n")},
		{Direction: out, At: c.CreatedAt.Add(time.Minute + time.Second), Data: []byte("workspace\n")},
		{Direction: out, At: c.CreatedAt.Add(time.Minute + time.Second), Data: []byte("$ ")},
	}
	if len(got.Records) != len(want) {
		t.Fatalf("records %+v, want %+v", got.Records, want)
	}
	for i, r := range got.Records {
		if r.Direction != want[i].Direction || !r.At.Equal(want[i].At) || string(r.Data) != string(want[i].Data) {
			t.Errorf("record %d: %s %v %q, want %s %v %q", i, r.Direction, r.At, r.Data, want[i].Direction, want[i].At, want[i].Data)
		}
	}

	// Expiry: a session not connected within its time box is refused.
	late, err := s.CreateConsoleSession(ctx, "bob", "agent-1", "on-call check", 10*time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	clk.Advance(10*time.Minute - time.Microsecond)
	if late.Expired(clk.Now()) {
		t.Error("session expired early")
	}
	clk.Advance(time.Microsecond)
	if !late.Expired(clk.Now()) {
		t.Error("session not expired at its expiry")
	}
	if _, err := s.ConnectConsoleSession(ctx, late.ID, "snap-7"); !errors.Is(err, store.ErrExpired) {
		t.Errorf("connect after expiry: %v, want ErrExpired", err)
	}
	if _, err := s.ConnectConsoleSession(ctx, "nope", ""); !errors.Is(err, store.ErrNotFound) {
		t.Errorf("connect unknown: %v", err)
	}
	list, err := s.ListConsoleSessions(ctx, "agent-1", 0)
	if err != nil {
		t.Fatal(err)
	}
	if len(list) != 2 || list[0].ID != late.ID || list[1].ID != c.ID {
		t.Errorf("sessions newest first: %+v", list)
	}
}

// testRedaction: known secret formats in what the store keeps as free text
// (audit details, agent and request IDs, console reasons and transcripts)
// are redacted before they are written, and no cell of any table holds
// them; the audit chain still verifies.
func testRedaction(t *testing.T, b backend) {
	ctx := context.Background()
	s := open(t, b.newDSN(t), store.Options{})
	apiKey := "sk-ant-api03-" + strings.Repeat("xY9_", 8)
	platform := "abx_" + strings.Repeat("Zm9v", 10) + "YmF"
	rec, err := s.AppendAudit(ctx, store.AuditEntry{Caller: "agent:t1", CallerKind: "agent", AgentID: platform,
		Operation: "run_command", RequestID: "req-" + apiKey, Detail: `{"command":"curl -H 'Authorization: Bearer ` + apiKey + `'"}`})
	if err != nil {
		t.Fatal(err)
	}
	if rec.AgentID != "[REDACTED:agentbox_token]" || rec.RequestID != "req-[REDACTED:sk_api_key]" ||
		rec.Detail != `{"command":"curl -H 'Authorization: Bearer [REDACTED:sk_api_key]'"}` {
		t.Errorf("stored audit record %+v", rec)
	}
	if v, err := s.VerifyAudit(ctx); err != nil || !v.OK() {
		t.Errorf("verify: %+v, %v", v, err)
	}

	c, err := s.CreateConsoleSession(ctx, "alice", "agent-1", "rotate "+apiKey, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	if c.Reason != "rotate [REDACTED:sk_api_key]" {
		t.Errorf("reason %q", c.Reason)
	}
	if err := s.AppendConsoleTranscript(ctx, c.ID,
		store.TranscriptRecord{Direction: store.TranscriptInput, Data: []byte("export T=" + platform + "\r")},
		store.TranscriptRecord{Direction: store.TranscriptOutput, Data: []byte("$ export T=" + platform + "\r\n$ ")}); err != nil {
		t.Fatal(err)
	}
	got, err := s.GetConsoleSession(ctx, c.ID)
	if err != nil {
		t.Fatal(err)
	}
	if len(got.Records) != 2 || string(got.Records[0].Data) != "export T=[REDACTED:agentbox_token]\r" ||
		string(got.Records[1].Data) != "$ export T=[REDACTED:agentbox_token]\r\n$ " {
		t.Errorf("stored transcript %+v", got.Records)
	}

	tables, err := s.Tables(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, table := range tables {
		rows, err := s.RawDB().QueryContext(ctx, `SELECT * FROM `+table)
		if err != nil {
			t.Fatal(err)
		}
		cols, _ := rows.Columns()
		for rows.Next() {
			vals := make([]any, len(cols))
			ptrs := make([]any, len(cols))
			for i := range vals {
				ptrs[i] = &vals[i]
			}
			if err := rows.Scan(ptrs...); err != nil {
				t.Fatal(err)
			}
			for i, v := range vals {
				text := fmt.Sprint(v)
				if b, ok := v.([]byte); ok {
					text = string(b)
				}
				for _, secret := range []string{apiKey, platform} {
					if strings.Contains(text, secret) {
						t.Errorf("%s.%s holds a secret: %q", table, cols[i], text)
					}
				}
			}
		}
		if err := rows.Err(); err != nil {
			t.Fatal(err)
		}
		rows.Close()
	}
}

func testSnapshots(t *testing.T, b backend) {
	ctx := context.Background()
	clk := newClock()
	s := open(t, b.newDSN(t), store.Options{Now: clk.Now})
	if _, err := s.LatestSnapshot(ctx, "agent-1"); !errors.Is(err, store.ErrNotFound) {
		t.Errorf("latest of none: %v", err)
	}
	first, err := s.PutSnapshot(ctx, store.Snapshot{ID: "s1", AgentID: "agent-1", Name: "vs-1", Driver: "csi", Status: store.SnapshotPending})
	if err != nil {
		t.Fatal(err)
	}
	ready := clk.Now().Add(time.Second)
	first.Status, first.SizeBytes, first.ReadyAt = store.SnapshotReady, 1234, &ready
	if _, err := s.PutSnapshot(ctx, first); err != nil {
		t.Fatal(err)
	}
	clk.Advance(time.Hour)
	if _, err := s.PutSnapshot(ctx, store.Snapshot{ID: "s2", AgentID: "agent-1", Status: store.SnapshotFailed, Error: "csi timeout"}); err != nil {
		t.Fatal(err)
	}
	latest, err := s.LatestSnapshot(ctx, "agent-1")
	if err != nil {
		t.Fatal(err)
	}
	if latest.ID != "s1" || latest.SizeBytes != 1234 || latest.ReadyAt == nil || !latest.ReadyAt.Equal(ready.Truncate(time.Microsecond)) {
		t.Errorf("latest ready snapshot after a failure: %+v", latest)
	}
	if _, err := s.PutSnapshot(ctx, store.Snapshot{ID: "s1", AgentID: "agent-2", Status: store.SnapshotReady}); !errors.Is(err, store.ErrConflict) {
		t.Errorf("moving a snapshot to another agent: %v", err)
	}
	list, err := s.ListSnapshots(ctx, "agent-1", 0)
	if err != nil {
		t.Fatal(err)
	}
	if len(list) != 2 || list[0].ID != "s2" || list[0].Error != "csi timeout" {
		t.Errorf("snapshots newest first: %+v", list)
	}
	if err := s.DeleteSnapshot(ctx, "s1"); err != nil {
		t.Fatal(err)
	}
	if _, err := s.GetSnapshot(ctx, "s1"); !errors.Is(err, store.ErrNotFound) {
		t.Errorf("deleted snapshot: %v", err)
	}
}

func testLeaseHistory(t *testing.T, b backend) {
	ctx := context.Background()
	clk := newClock()
	s := open(t, b.newDSN(t), store.Options{Now: clk.Now})
	exp := clk.Now().Add(time.Minute)
	acq, created, err := s.RecordLeaseEvent(ctx, store.LeaseEvent{LeaseID: "l1", AgentID: "agent-1", Holder: "wf-1",
		RequestID: "req-1", Event: store.LeaseAcquire, ExpiresAt: &exp})
	if err != nil || !created || acq.ID == 0 {
		t.Fatalf("acquire: %+v, %v, %v", acq, created, err)
	}
	// The retried request gets the first lease back; a different agent's
	// identical request id is its own acquire.
	again, created, err := s.RecordLeaseEvent(ctx, store.LeaseEvent{LeaseID: "l2", AgentID: "agent-1", Holder: "wf-1",
		RequestID: "req-1", Event: store.LeaseAcquire})
	if err != nil || created || again.ID != acq.ID || again.LeaseID != "l1" || again.ExpiresAt == nil {
		t.Errorf("repeated acquire: %+v, created %v, %v", again, created, err)
	}
	if _, created, err := s.RecordLeaseEvent(ctx, store.LeaseEvent{LeaseID: "l3", AgentID: "agent-2",
		RequestID: "req-1", Event: store.LeaseAcquire}); err != nil || !created {
		t.Errorf("same request id, other agent: created %v, %v", created, err)
	}
	for _, e := range []store.LeaseEventKind{store.LeaseHeartbeat, store.LeaseHeartbeat, store.LeaseRelease} {
		clk.Advance(10 * time.Second)
		if _, created, err := s.RecordLeaseEvent(ctx, store.LeaseEvent{LeaseID: "l1", AgentID: "agent-1", Event: e}); err != nil || !created {
			t.Fatalf("%s: %v", e, err)
		}
	}
	if _, _, err := s.RecordLeaseEvent(ctx, store.LeaseEvent{LeaseID: "l1", AgentID: "agent-1", Event: "steal"}); !errors.Is(err, store.ErrInvalid) {
		t.Errorf("unknown event: %v", err)
	}
	page1, err := s.ListLeaseEvents(ctx, store.LeaseQuery{LeaseID: "l1", Limit: 2})
	if err != nil {
		t.Fatal(err)
	}
	page2, err := s.ListLeaseEvents(ctx, store.LeaseQuery{LeaseID: "l1", Limit: 2, AfterID: page1[len(page1)-1].ID})
	if err != nil {
		t.Fatal(err)
	}
	var kinds []store.LeaseEventKind
	for _, e := range append(page1, page2...) {
		kinds = append(kinds, e.Event)
	}
	if fmt.Sprint(kinds) != "[acquire heartbeat heartbeat release]" {
		t.Errorf("history of l1: %v", kinds)
	}
	if byAgent, err := s.ListLeaseEvents(ctx, store.LeaseQuery{AgentID: "agent-2"}); err != nil || len(byAgent) != 1 {
		t.Errorf("history of agent-2: %+v, %v", byAgent, err)
	}
}

func testWarmTakes(t *testing.T, b backend) {
	ctx := context.Background()
	clk := newClock()
	s := open(t, b.newDSN(t), store.Options{Now: clk.Now})
	lease := func(uid, holder, request string) store.WarmTake {
		return store.WarmTake{SandboxUID: uid, Namespace: "ns", Pool: "p", Sandbox: "w-" + uid, Taker: store.WarmTakenByLease,
			Holder: holder, RequestID: request, LeaseID: "lease-" + holder + "-" + request, TTLSeconds: 30}
	}

	// Every kind of taker races for one sandbox, many times over: exactly
	// one of them gets it, and every loser is told who did.
	var (
		wg     sync.WaitGroup
		mu     sync.Mutex
		won    []store.WarmTake
		beaten []store.WarmTake
	)
	for i := range 24 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			t0 := lease("u1", fmt.Sprint("run-", i), "r")
			switch i % 3 {
			case 1:
				t0 = store.WarmTake{SandboxUID: "u1", Namespace: "ns", Pool: "p", Sandbox: "w-u1", Taker: store.WarmTakenByAdoption, Holder: fmt.Sprint("sbx-", i)}
			case 2:
				t0 = store.WarmTake{SandboxUID: "u1", Namespace: "ns", Pool: "p", Sandbox: "w-u1", Taker: store.WarmTakenByRetirement}
			}
			got, ok, err := s.TakeWarm(ctx, t0)
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				t.Error(err)
				return
			}
			if ok {
				won = append(won, got)
			} else {
				beaten = append(beaten, got)
			}
		}()
	}
	wg.Wait()
	if len(won) != 1 || len(beaten) != 23 {
		t.Fatalf("%d takes won, %d lost; want 1 and 23", len(won), len(beaten))
	}
	for _, l := range beaten {
		if l != won[0] {
			t.Errorf("a loser was told %+v, the winner is %+v", l, won[0])
		}
	}
	if !won[0].TakenAt.Equal(clk.Now().Truncate(time.Microsecond)) {
		t.Errorf("taken at %v, want now (%v)", won[0].TakenAt, clk.Now())
	}

	// A retried acquire gets the sandbox its first try took, even when it
	// names another free sandbox this time.
	first, ok, err := s.TakeWarm(ctx, lease("u2", "wf", "req-1"))
	if err != nil || !ok {
		t.Fatalf("take u2: %v, %v", ok, err)
	}
	clk.Advance(time.Second)
	again, ok, err := s.TakeWarm(ctx, lease("u3", "wf", "req-1"))
	if err != nil || ok || again != first {
		t.Errorf("retried acquire = %+v, %v, %v; want the first take %+v", again, ok, err, first)
	}
	if _, err := s.WarmTakeOf(ctx, "u3"); !errors.Is(err, store.ErrNotFound) {
		t.Errorf("u3 after the retried acquire: %v; want it still free", err)
	}
	if got, err := s.FindWarmLease(ctx, "ns", "p", "wf", "req-1"); err != nil || got != first {
		t.Errorf("FindWarmLease = %+v, %v", got, err)
	}
	if _, err := s.FindWarmLease(ctx, "ns", "other-pool", "wf", "req-1"); !errors.Is(err, store.ErrNotFound) {
		t.Errorf("the same request in another pool: %v", err)
	}
	// The same holder with a new request is a new lease.
	if _, ok, err := s.TakeWarm(ctx, lease("u3", "wf", "req-2")); err != nil || !ok {
		t.Errorf("new request: %v, %v", ok, err)
	}

	all, err := s.ListWarmTakes(ctx, "ns", "p")
	if err != nil || len(all) != 3 || all[0].SandboxUID != "u1" || all[1] != first {
		t.Fatalf("ListWarmTakes = %+v, %v", all, err)
	}
	if err := s.ForgetWarmTake(ctx, "u1"); err != nil {
		t.Fatal(err)
	}
	if _, ok, err := s.TakeWarm(ctx, lease("u1", "late", "r")); err != nil || !ok {
		t.Errorf("a forgotten take's UID is free again: %v, %v", ok, err)
	}

	for _, bad := range []store.WarmTake{
		{SandboxUID: "u9", Namespace: "ns", Pool: "p", Sandbox: "w", Taker: "steal"},
		{SandboxUID: "", Namespace: "ns", Pool: "p", Sandbox: "w", Taker: store.WarmTakenByLease},
		{SandboxUID: "u9", Namespace: "ns", Pool: "p", Sandbox: "w", Taker: store.WarmTakenByLease, TTLSeconds: -1},
		{SandboxUID: "u9", Namespace: "ns", Pool: "p", Sandbox: "w", Taker: store.WarmTakenByLease, Holder: "a\x00b"},
	} {
		if _, _, err := s.TakeWarm(ctx, bad); !errors.Is(err, store.ErrInvalid) {
			t.Errorf("TakeWarm(%+v) = %v; want ErrInvalid", bad, err)
		}
	}
}

func testAuditQuery(t *testing.T, b backend) {
	ctx := context.Background()
	clk := newClock()
	s := open(t, b.newDSN(t), store.Options{Now: clk.Now})
	start := clk.Now()
	for i := range 30 {
		clk.Advance(time.Second)
		e := store.AuditEntry{
			Caller: fmt.Sprintf("token-%d", i%3), CallerKind: "agent", AgentID: fmt.Sprintf("agent-%d", i%2),
			Operation: []string{"run_command", "status", "put"}[i%3], ParamsHash: hexHash(fmt.Sprint(i)),
			Duration: time.Duration(i) * time.Millisecond, Result: "ok", Status: 200, RequestID: fmt.Sprint("req-", i),
			Detail: `{"i":` + fmt.Sprint(i) + `}`,
		}
		r, err := s.AppendAudit(ctx, e)
		if err != nil {
			t.Fatal(err)
		}
		if r.Seq != int64(i+1) || !r.Time.Equal(clk.Now().Truncate(time.Microsecond)) || len(r.Hash) != sha256.Size {
			t.Fatalf("record %d: %+v", i, r)
		}
	}
	if _, err := s.AppendAudit(ctx, store.AuditEntry{Caller: "x"}); !errors.Is(err, store.ErrInvalid) {
		t.Errorf("entry without operation: %v", err)
	}

	// Page through agent-0's run_command calls (i = 0, 6, 12, 18, 24).
	var seqs []int64
	q := store.AuditQuery{AgentID: "agent-0", Operation: "run_command", Limit: 2}
	for pages := 0; ; pages++ {
		page, err := s.QueryAudit(ctx, q)
		if err != nil {
			t.Fatal(err)
		}
		for _, r := range page.Records {
			seqs = append(seqs, r.Seq)
			if r.AgentID != "agent-0" || r.Operation != "run_command" {
				t.Errorf("record %d does not match the query: %+v", r.Seq, r)
			}
		}
		if page.Next == 0 {
			break
		}
		if pages > 10 {
			t.Fatal("paging does not end")
		}
		q.Cursor = page.Next
	}
	if fmt.Sprint(seqs) != "[1 7 13 19 25]" {
		t.Errorf("agent-0 run_command seqs: %v", seqs)
	}

	// Caller and a time window [start+10s, start+20s): i = 9..18.
	page, err := s.QueryAudit(ctx, store.AuditQuery{Caller: "token-0", Since: start.Add(10 * time.Second), Until: start.Add(20 * time.Second)})
	if err != nil {
		t.Fatal(err)
	}
	seqs = seqs[:0]
	for _, r := range page.Records {
		seqs = append(seqs, r.Seq)
	}
	if fmt.Sprint(seqs) != "[10 13 16 19]" || page.Next != 0 {
		t.Errorf("token-0 in the window: %v (next %d)", seqs, page.Next)
	}

	newest, err := s.QueryAudit(ctx, store.AuditQuery{Newest: true, Limit: 3})
	if err != nil {
		t.Fatal(err)
	}
	older, err := s.QueryAudit(ctx, store.AuditQuery{Newest: true, Limit: 3, Cursor: newest.Next})
	if err != nil {
		t.Fatal(err)
	}
	seqs = seqs[:0]
	for _, r := range append(newest.Records, older.Records...) {
		seqs = append(seqs, r.Seq)
	}
	if fmt.Sprint(seqs) != "[30 29 28 27 26 25]" {
		t.Errorf("newest first: %v", seqs)
	}
	r := newest.Records[0]
	if r.Detail != `{"i":29}` || r.Duration != 29*time.Millisecond || r.Status != 200 || r.RequestID != "req-29" {
		t.Errorf("record 30 read back: %+v", r)
	}

	rep, err := s.VerifyAudit(ctx)
	if err != nil || !rep.OK() || rep.Records != 30 || rep.Head.Seq != 30 {
		t.Fatalf("verify: %+v, %v", rep, err)
	}
	if rep, err := s.VerifyAudit(ctx, rep.Head, store.AuditHead{Seq: page.Records[1].Seq, Hash: page.Records[1].Hash}); err != nil || !rep.OK() {
		t.Errorf("verify with anchors: %+v, %v", rep.Break, err)
	}
}

func testAuditBatch(t *testing.T, b backend) {
	ctx := context.Background()
	s := open(t, b.newDSN(t), store.Options{})
	if _, err := s.AppendAudit(ctx, store.AuditEntry{Caller: "c", Operation: "first"}); err != nil {
		t.Fatal(err)
	}
	recs, err := s.AppendAuditBatch(ctx, []store.AuditEntry{
		{Caller: "c", Operation: "a"}, {Caller: "c", Operation: "b"}, {Caller: "c", Operation: "c"},
	})
	if err != nil {
		t.Fatal(err)
	}
	for i, r := range recs {
		if r.Seq != int64(i+2) || (i > 0 && !bytes.Equal(r.PrevHash, recs[i-1].Hash)) {
			t.Errorf("batch record %d: seq %d, links %v", i, r.Seq, i == 0 || bytes.Equal(r.PrevHash, recs[i-1].Hash))
		}
	}
	// A batch is all or nothing: one bad entry appends none.
	for _, bad := range [][]store.AuditEntry{
		{{Caller: "c", Operation: "ok"}, {Caller: "c"}},
		{{Caller: "c", Operation: "ok"}, {Caller: "c", Operation: "x", Detail: "\xff\x00"}},
	} {
		if _, err := s.AppendAuditBatch(ctx, bad); !errors.Is(err, store.ErrInvalid) {
			t.Errorf("batch with a bad entry: %v, want ErrInvalid", err)
		}
	}
	rep, err := s.VerifyAudit(ctx)
	if err != nil || !rep.OK() || rep.Records != 4 {
		t.Errorf("after batches: %+v, %v", rep, err)
	}
}

// testAuditTamper changes the log behind the store's back in each way an
// attacker with database access could, and expects Verify to name the
// first broken record.
func testAuditTamper(t *testing.T, b backend) {
	ctx := context.Background()
	const n = 12
	fill := func(t *testing.T) *store.Store {
		s := open(t, b.newDSN(t), store.Options{})
		for i := range n {
			if _, err := s.AppendAudit(ctx, store.AuditEntry{Caller: "token-1", AgentID: "agent-1",
				Operation: "run_command", Result: "denied", Status: 403, Detail: fmt.Sprint(i)}); err != nil {
				t.Fatal(err)
			}
		}
		if rep, err := s.VerifyAudit(ctx); err != nil || !rep.OK() || rep.Records != n {
			t.Fatalf("untouched chain: %+v, %v", rep, err)
		}
		return s
	}
	exec := func(t *testing.T, s *store.Store, q string, args ...any) {
		t.Helper()
		if _, err := s.RawDB().ExecContext(ctx, q, args...); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
	}
	cases := []struct {
		name   string
		tamper func(t *testing.T, s *store.Store)
		seq    int64
		kind   store.BreakKind
	}{
		{"TamperedField", func(t *testing.T, s *store.Store) {
			exec(t, s, `UPDATE audit_log SET result = 'ok', status = 200 WHERE seq = 7`)
		}, 7, store.BreakHash},
		{"TamperedTime", func(t *testing.T, s *store.Store) {
			exec(t, s, `UPDATE audit_log SET at = $1 WHERE seq = 3`, time.Now().Add(-time.Hour))
		}, 3, store.BreakHash},
		{"DeletedRow", func(t *testing.T, s *store.Store) {
			exec(t, s, `DELETE FROM audit_log WHERE seq = 5`)
		}, 5, store.BreakGap},
		{"DeletedFirstRow", func(t *testing.T, s *store.Store) {
			exec(t, s, `DELETE FROM audit_log WHERE seq = 1`)
		}, 1, store.BreakGap},
		{"DeletedLastRow", func(t *testing.T, s *store.Store) {
			exec(t, s, `DELETE FROM audit_log WHERE seq = $1`, n)
		}, n, store.BreakHead},
		{"ReorderedRows", func(t *testing.T, s *store.Store) {
			exec(t, s, `UPDATE audit_log SET seq = -1 WHERE seq = 8`)
			exec(t, s, `UPDATE audit_log SET seq = 8 WHERE seq = 9`)
			exec(t, s, `UPDATE audit_log SET seq = 9 WHERE seq = -1`)
		}, 8, store.BreakLink},
		{"ForgedHash", func(t *testing.T, s *store.Store) {
			exec(t, s, `UPDATE audit_log SET hash = $1 WHERE seq = 4`, make([]byte, 32))
		}, 4, store.BreakHash},
		{"RehashedRow", func(t *testing.T, s *store.Store) {
			// A forger who rewrites a record and recomputes its hash still
			// breaks the next record's link.
			page, err := s.QueryAudit(ctx, store.AuditQuery{Cursor: 3, Limit: 1})
			if err != nil {
				t.Fatal(err)
			}
			r := page.Records[0]
			r.Result, r.Status = "ok", 200
			exec(t, s, `UPDATE audit_log SET result = $1, status = $2, hash = $3 WHERE seq = 4`,
				r.Result, r.Status, store.HashRecord(r))
		}, 5, store.BreakLink},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			s := fill(t)
			// The append-only guard refuses plain rewrites...
			if _, err := s.RawDB().ExecContext(ctx, `UPDATE audit_log SET result = 'ok' WHERE seq = 1`); err == nil {
				t.Fatal("audit_log accepted an UPDATE")
			}
			if _, err := s.RawDB().ExecContext(ctx, `DELETE FROM audit_log WHERE seq = 1`); err == nil {
				t.Fatal("audit_log accepted a DELETE")
			}
			// ...and an attacker who drops it is caught by the chain.
			if err := s.DropAuditGuards(ctx); err != nil {
				t.Fatal(err)
			}
			c.tamper(t, s)
			rep, err := s.VerifyAudit(ctx)
			if err != nil {
				t.Fatal(err)
			}
			if rep.OK() || rep.Break.Seq != c.seq || rep.Break.Kind != c.kind {
				t.Fatalf("verify = %+v (break %+v), want seq %d %s", rep, rep.Break, c.seq, c.kind)
			}
			if !errors.Is(rep.Err(), store.ErrChainBroken) {
				t.Errorf("report error %v does not wrap ErrChainBroken", rep.Err())
			}
			t.Logf("%v", rep.Err())
		})
	}
	t.Run("StaleAnchor", func(t *testing.T) {
		s := fill(t)
		head, err := s.Head(ctx)
		if err != nil {
			t.Fatal(err)
		}
		forged := store.AuditHead{Seq: head.Seq, Hash: bytes.Repeat([]byte{1}, 32)}
		rep, err := s.VerifyAudit(ctx, forged)
		if err != nil || rep.OK() || rep.Break.Kind != store.BreakAnchor || rep.Break.Seq != head.Seq {
			t.Fatalf("verify against an anchor the chain no longer has: %+v, %v", rep.Break, err)
		}
	})
}

// testAuditConcurrent appends from 8 goroutines through two separate
// stores (two connection pools) and from a second process at the same
// time, as replicas would, and expects one gapless, valid chain holding
// every entry once.
func testAuditConcurrent(t *testing.T, b backend) {
	ctx := context.Background()
	dsn := b.newDSN(t)
	stores := []*store.Store{open(t, dsn, store.Options{}), open(t, dsn, store.Options{})}
	const writers, each = 8, 50
	const total = writers*each + processAppends

	proc := exec.Command(os.Args[0])
	proc.Env = append(os.Environ(), appendProcessEnv+"="+dsn)
	proc.Stderr = os.Stderr
	stdin, err := proc.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := proc.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := proc.Start(); err != nil {
		t.Fatal(err)
	}
	if line, err := bufio.NewReader(stdout).ReadString('\n'); err != nil || line != "ready\n" {
		_ = proc.Process.Kill()
		_ = proc.Wait()
		t.Fatalf("append process: %q, %v", line, err)
	}

	start := time.Now()
	if _, err := io.WriteString(stdin, "go\n"); err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	errs := make(chan error, writers)
	for w := range writers {
		wg.Go(func() {
			s := stores[w%len(stores)]
			for i := range each {
				if _, err := s.AppendAudit(ctx, store.AuditEntry{Caller: fmt.Sprint("writer-", w), Operation: "op",
					Detail: fmt.Sprint(i)}); err != nil {
					errs <- fmt.Errorf("writer %d append %d: %w", w, i, err)
					return
				}
			}
		})
	}
	wg.Wait()
	procErr := proc.Wait()
	elapsed := time.Since(start)
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	if procErr != nil {
		t.Fatalf("append process: %v", procErr)
	}
	t.Logf("%d appends from %d goroutines over 2 pools and a second process in %s (%.0f/s)", total, writers,
		elapsed.Round(time.Millisecond), float64(total)/elapsed.Seconds())

	rep, err := stores[1].VerifyAudit(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if !rep.OK() || rep.Records != total || rep.Head.Seq != total {
		t.Fatalf("verify after concurrent appends: %+v, break %+v", rep, rep.Break)
	}
	seen := map[string]bool{}
	// switches counts how often the chain passes between the two
	// processes: more than one shows their appends really interleaved.
	switches, last := 0, ""
	var next int64 = 1
	for cursor := int64(0); ; {
		page, err := stores[0].QueryAudit(ctx, store.AuditQuery{Cursor: cursor, Limit: 1000})
		if err != nil {
			t.Fatal(err)
		}
		for _, r := range page.Records {
			if r.Seq != next {
				t.Fatalf("seq %d where %d was expected", r.Seq, next)
			}
			next++
			key := r.Caller + "/" + r.Detail
			if p := map[bool]string{true: "child", false: "parent"}[r.Caller == "process-2"]; p != last {
				switches, last = switches+1, p
			}
			if seen[key] {
				t.Fatalf("entry %s appended twice", key)
			}
			seen[key] = true
		}
		if page.Next == 0 {
			break
		}
		cursor = page.Next
	}
	if len(seen) != total {
		t.Fatalf("%d distinct entries, want %d", len(seen), total)
	}
	t.Logf("the chain passes between the two processes %d times", switches-1)
}

func testFilespace(t *testing.T, b backend) {
	ctx := context.Background()
	s := open(t, b.newDSN(t), store.Options{})
	t0 := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	at := func(sec int) time.Time { return t0.Add(time.Duration(sec) * time.Second) }
	file := func(sec int, content string) store.FileNode {
		sum := sha256.Sum256([]byte(content))
		return store.FileNode{AgentID: "agent-1", Path: "src/main.py", SizeBytes: int64(len(content)),
			SHA256: hex.EncodeToString(sum[:]), UpdatedAt: at(sec)}
	}
	del := func(sec int) store.FileNode {
		return store.FileNode{AgentID: "agent-1", Path: "src/main.py", UpdatedAt: at(sec), Deleted: true}
	}
	steps := []struct {
		name    string
		node    store.FileNode
		applied bool
		want    store.FileNode
	}{
		{"first write", file(10, "v10"), true, file(10, "v10")},
		{"older write loses", file(5, "v5"), false, file(10, "v10")},
		{"same time loses", file(10, "other"), false, file(10, "v10")},
		{"newer write wins", file(20, "v20"), true, file(20, "v20")},
		{"older deletion loses", del(15), false, file(20, "v20")},
		{"newer deletion wins", del(25), true, del(25)},
		{"write older than the deletion loses", file(22, "v22"), false, del(25)},
		{"newer write resurrects", file(30, "v30"), true, file(30, "v30")},
	}
	for _, st := range steps {
		applied, err := s.PutFile(ctx, st.node)
		if err != nil {
			t.Fatalf("%s: %v", st.name, err)
		}
		got, err := s.GetFile(ctx, "agent-1", "src/main.py")
		if err != nil {
			t.Fatalf("%s: %v", st.name, err)
		}
		if applied != st.applied || got != st.want {
			t.Errorf("%s: applied %v, stored %+v; want %v, %+v", st.name, applied, got, st.applied, st.want)
		}
	}

	// The mode travels with a write; a deletion drops it, and so does a
	// write without one. Only permission bits are taken.
	script := store.FileNode{AgentID: "agent-3", Path: "run.sh", SizeBytes: 3, SHA256: "cc", UpdatedAt: at(1), Mode: 0o755}
	for _, w := range []struct {
		node store.FileNode
		want fs.FileMode
	}{
		{script, 0o755},
		{store.FileNode{AgentID: "agent-3", Path: "run.sh", UpdatedAt: at(2), Deleted: true, Mode: 0o755}, 0},
		{store.FileNode{AgentID: "agent-3", Path: "run.sh", SizeBytes: 3, SHA256: "cc", UpdatedAt: at(3)}, 0},
	} {
		if _, err := s.PutFile(ctx, w.node); err != nil {
			t.Fatal(err)
		}
		if got, err := s.GetFile(ctx, "agent-3", "run.sh"); err != nil || got.Mode != w.want {
			t.Errorf("after %+v: mode %v (%v), want %v", w.node, got.Mode, err, w.want)
		}
	}
	script.Mode, script.UpdatedAt = fs.ModeDir|0o755, at(4)
	if _, err := s.PutFile(ctx, script); !errors.Is(err, store.ErrInvalid) {
		t.Errorf("a mode with more than permission bits: %v, want ErrInvalid", err)
	}

	// A batch: tombstones for unknown paths are kept (so an older write
	// cannot create them), other agents are separate.
	applied, err := s.PutFiles(ctx, "agent-1", []store.FileNode{
		{AgentID: "agent-1", Path: "a.txt", SizeBytes: 100, SHA256: "aa", UpdatedAt: at(40)},
		{AgentID: "agent-1", Path: "b.txt", SizeBytes: 200, SHA256: "bb", UpdatedAt: at(41)},
		{AgentID: "agent-1", Path: "gone.txt", UpdatedAt: at(42), Deleted: true},
		{AgentID: "agent-1", Path: "src/main.py", SizeBytes: 1, UpdatedAt: at(29)},
	})
	if err != nil {
		t.Fatal(err)
	}
	if fmt.Sprint(applied) != "[true true true false]" {
		t.Errorf("batch applied %v", applied)
	}
	if ok, err := s.PutFile(ctx, store.FileNode{AgentID: "agent-1", Path: "gone.txt", SizeBytes: 1, UpdatedAt: at(41)}); err != nil || ok {
		t.Errorf("write older than a tombstone for a never-seen path: applied %v, %v", ok, err)
	}
	if _, err := s.PutFile(ctx, store.FileNode{AgentID: "agent-2", Path: "a.txt", SizeBytes: 7, UpdatedAt: at(1)}); err != nil {
		t.Fatal(err)
	}
	if _, err := s.PutFiles(ctx, "agent-1", []store.FileNode{{AgentID: "agent-2", Path: "x", UpdatedAt: at(1)}}); !errors.Is(err, store.ErrInvalid) {
		t.Errorf("a file of another agent in the batch: %v", err)
	}

	files, bytes, err := s.FilespaceUsage(ctx, "agent-1")
	if err != nil || files != 3 || bytes != 100+200+3 {
		t.Errorf("usage = %d files, %d bytes, %v; want 3, 303", files, bytes, err)
	}
	live, err := s.ListFiles(ctx, "agent-1", store.FileQuery{})
	if err != nil {
		t.Fatal(err)
	}
	if paths(live) != "[a.txt b.txt src/main.py]" {
		t.Errorf("live files: %s", paths(live))
	}
	changed, err := s.ListFiles(ctx, "agent-1", store.FileQuery{ChangedAfter: at(30), IncludeDeleted: true})
	if err != nil {
		t.Fatal(err)
	}
	if paths(changed) != "[a.txt b.txt gone.txt]" {
		t.Errorf("changed after 30s, tombstones included: %s", paths(changed))
	}
	p1, err := s.ListFiles(ctx, "agent-1", store.FileQuery{IncludeDeleted: true, Limit: 2})
	if err != nil {
		t.Fatal(err)
	}
	p2, err := s.ListFiles(ctx, "agent-1", store.FileQuery{IncludeDeleted: true, Limit: 2, AfterPath: p1[len(p1)-1].Path})
	if err != nil {
		t.Fatal(err)
	}
	if paths(append(p1, p2...)) != "[a.txt b.txt gone.txt src/main.py]" {
		t.Errorf("paged: %s + %s", paths(p1), paths(p2))
	}
	if n, err := s.PurgeTombstones(ctx, "agent-1", at(43)); err != nil || n != 1 {
		t.Errorf("purge: %d, %v", n, err)
	}
}

func testToolCatalogs(t *testing.T, b backend) {
	ctx := context.Background()
	clk := newClock()
	s := open(t, b.newDSN(t), store.Options{Now: clk.Now})
	cfgA, cfgB := hexHash("cfg-a"), hexHash("cfg-b")
	if _, err := s.GetToolCatalog(ctx, cfgA); !errors.Is(err, store.ErrNotFound) {
		t.Errorf("catalog never discovered: %v", err)
	}
	toolsA := json.RawMessage(`{"tools":[{"name":"search","inputSchema":{"type":"object"}}]}`)
	toolsB := json.RawMessage(`{"tools":[]}`)
	if _, err := s.PutToolCatalog(ctx, store.ToolCatalog{ConfigHash: cfgA, ServerName: "web", Tools: toolsA}); err != nil {
		t.Fatal(err)
	}
	if _, err := s.PutToolCatalog(ctx, store.ToolCatalog{ConfigHash: cfgB, ServerName: "web", Tools: toolsB}); err != nil {
		t.Fatal(err)
	}
	got, err := s.GetToolCatalog(ctx, cfgA)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got.Tools, toolsA) || got.ServerName != "web" || !got.RefreshedAt.Equal(clk.Now().Truncate(time.Microsecond)) {
		t.Errorf("catalog A: %+v (%s)", got, got.Tools)
	}
	clk.Advance(time.Hour)
	refreshed := json.RawMessage(`{"tools":[{"name":"search"},{"name":"fetch"}]}`)
	if _, err := s.PutToolCatalog(ctx, store.ToolCatalog{ConfigHash: cfgA, ServerName: "web", Tools: refreshed}); err != nil {
		t.Fatal(err)
	}
	got, _ = s.GetToolCatalog(ctx, cfgA)
	other, _ := s.GetToolCatalog(ctx, cfgB)
	if !bytes.Equal(got.Tools, refreshed) || !got.RefreshedAt.Equal(clk.Now().Truncate(time.Microsecond)) || !bytes.Equal(other.Tools, toolsB) {
		t.Errorf("after refreshing A: A %s at %s, B %s", got.Tools, got.RefreshedAt, other.Tools)
	}
	if _, err := s.PutToolCatalog(ctx, store.ToolCatalog{ConfigHash: cfgA, Tools: json.RawMessage(`{`)}); !errors.Is(err, store.ErrInvalid) {
		t.Errorf("catalog that is not JSON: %v", err)
	}
	if err := s.DeleteToolCatalog(ctx, cfgA); err != nil {
		t.Fatal(err)
	}
	if _, err := s.GetToolCatalog(ctx, cfgA); !errors.Is(err, store.ErrNotFound) {
		t.Errorf("deleted catalog: %v", err)
	}
}

func randomToken(t testing.TB) string {
	var b [32]byte
	if _, err := rand.Read(b[:]); err != nil {
		t.Fatal(err)
	}
	return "abx_" + base64.RawURLEncoding.EncodeToString(b[:])
}

func hashOf(s string) store.TokenHash { return sha256.Sum256([]byte(s)) }

func hexHash(s string) string {
	h := sha256.Sum256([]byte(s))
	return hex.EncodeToString(h[:])
}

func contains(list []string, s string) bool {
	for _, v := range list {
		if v == s {
			return true
		}
	}
	return false
}

func countRows(t *testing.T, s *store.Store, table string) int {
	t.Helper()
	var n int
	if err := s.RawDB().QueryRowContext(context.Background(), `SELECT COUNT(*) FROM `+table).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

func paths(files []store.FileNode) string {
	var p []string
	for _, f := range files {
		p = append(p, f.Path)
	}
	return fmt.Sprint(p)
}
