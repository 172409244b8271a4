package store

import (
	"bytes"
	"context"
	"crypto/sha256"
	"database/sql"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"time"

	"github.com/agentbox/terraform-provider-agentbox/internal/redact"
)

// AuditEntry is what a caller records about one API call.
type AuditEntry struct {
	// Time is when the call happened; zero means the append's time.
	Time time.Time
	// Caller identifies who called (a token id or staff id), and
	// CallerKind how they authenticated (agent, admin, staff, or
	// "anonymous" for a refused call).
	Caller     string
	CallerKind string
	AgentID    string
	Operation  string
	// ParamsHash is the hex SHA-256 of the call's parameters, so the log
	// proves what was asked without holding secrets or file contents.
	ParamsHash string
	Duration   time.Duration
	// Result is a short outcome: "ok", "denied", "error", ...
	Result string
	// Status is the HTTP status the call answered with, or the command's
	// exit code where the operation defines it so.
	Status    int
	RequestID string
	// Detail is optional free text (JSON by convention) that a reviewer
	// needs, such as a truncated error message. Known secret formats are
	// redacted from it, and from AgentID and RequestID, as it is stored
	// (see package redact).
	Detail string
}

// AuditRecord is an AuditEntry as stored: numbered and chained.
type AuditRecord struct {
	AuditEntry
	// Seq numbers records from 1 without gaps.
	Seq int64
	// PrevHash is the previous record's Hash (32 zero bytes for Seq 1), and
	// Hash is SHA-256(PrevHash || canonical encoding of this record).
	PrevHash []byte
	Hash     []byte
}

// auditFormat versions the canonical encoding; it is hashed first, so a
// future encoding can never produce a hash that an old one explains.
const auditFormat = 1

// canonical encodes a record's fields deterministically: the format byte,
// then each field in declaration order, integers as 8-byte big-endian and
// strings as a uvarint length followed by their bytes. Anyone can recompute
// a hash from a database dump with this description alone.
func (r *AuditRecord) canonical() []byte {
	b := make([]byte, 0, 128+len(r.Detail))
	b = append(b, auditFormat)
	b = binary.BigEndian.AppendUint64(b, uint64(r.Seq))
	b = binary.BigEndian.AppendUint64(b, uint64(r.Time.UnixMicro()))
	str := func(s string) {
		b = binary.AppendUvarint(b, uint64(len(s)))
		b = append(b, s...)
	}
	str(r.Caller)
	str(r.CallerKind)
	str(r.AgentID)
	str(r.Operation)
	str(r.ParamsHash)
	b = binary.BigEndian.AppendUint64(b, uint64(r.Duration.Nanoseconds()))
	str(r.Result)
	b = binary.BigEndian.AppendUint64(b, uint64(int64(r.Status)))
	str(r.RequestID)
	str(r.Detail)
	return b
}

// computeHash returns SHA-256(PrevHash || canonical encoding).
func (r *AuditRecord) computeHash() []byte {
	h := sha256.New()
	h.Write(r.PrevHash)
	h.Write(r.canonical())
	return h.Sum(nil)
}

// AppendAudit appends an entry to the audit log and returns it as stored.
// Appends are serialised on the chain's head row, so writers in any number
// of goroutines and processes (replicas, on PostgreSQL) extend one linear
// chain.
func (s *Store) AppendAudit(ctx context.Context, e AuditEntry) (AuditRecord, error) {
	recs, err := s.AppendAuditBatch(ctx, []AuditEntry{e})
	if err != nil {
		return AuditRecord{}, err
	}
	return recs[0], nil
}

// AppendAuditBatch appends entries in order, in one transaction: all of
// them or none. A caller that buffers entries for a few milliseconds pays
// one commit for many records.
func (s *Store) AppendAuditBatch(ctx context.Context, entries []AuditEntry) ([]AuditRecord, error) {
	if len(entries) == 0 {
		return nil, nil
	}
	for i, e := range entries {
		if e.Caller == "" || e.Operation == "" {
			return nil, fmt.Errorf("%w: audit entry %d needs a caller and an operation", ErrInvalid, i)
		}
		for f, v := range map[string]string{
			"caller": e.Caller, "caller kind": e.CallerKind, "agent id": e.AgentID, "operation": e.Operation,
			"params hash": e.ParamsHash, "result": e.Result, "request id": e.RequestID, "detail": e.Detail,
		} {
			if err := checkText(f, v); err != nil {
				return nil, err
			}
		}
	}
	recs := make([]AuditRecord, len(entries))
	err := s.writeTx(ctx, func(tx *sql.Tx) error {
		var seq int64
		var prev []byte
		if err := tx.QueryRowContext(ctx, `SELECT seq, hash FROM audit_head WHERE id = 1`+s.dialect.forUpdate()).
			Scan(&seq, &prev); err != nil {
			return fmt.Errorf("read audit head: %w", err)
		}
		// The time is taken under the lock, so record times never go
		// backwards along the chain unless the caller supplied them.
		now := s.now()
		for i, e := range entries {
			// The free text of a record (a detail, a path's agent ID, a
			// client's request ID) can quote what a caller typed; known
			// secret formats are kept out before the record is hashed.
			e.AgentID, e.RequestID, e.Detail = redact.String(e.AgentID), redact.String(e.RequestID), redact.String(e.Detail)
			r := AuditRecord{AuditEntry: e, Seq: seq + 1, PrevHash: prev}
			if r.Time.IsZero() {
				r.Time = now
			}
			r.Time = dbTime(r.Time)
			r.Hash = r.computeHash()
			if _, err := tx.ExecContext(ctx, `INSERT INTO audit_log
				(seq, at, caller, caller_kind, agent_id, operation, params_hash, duration_ns,
				 result, status, request_id, detail, prev_hash, hash)
				VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14)`,
				r.Seq, r.Time, r.Caller, r.CallerKind, r.AgentID, r.Operation, r.ParamsHash, r.Duration.Nanoseconds(),
				r.Result, r.Status, r.RequestID, r.Detail, r.PrevHash, r.Hash); err != nil {
				return fmt.Errorf("insert audit record: %w", err)
			}
			recs[i] = r
			seq, prev = r.Seq, r.Hash
		}
		if _, err := tx.ExecContext(ctx, `UPDATE audit_head SET seq = $1, hash = $2 WHERE id = 1`, seq, prev); err != nil {
			return fmt.Errorf("advance audit head: %w", err)
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("append audit: %w", err)
	}
	return recs, nil
}

const auditColumns = `seq, at, caller, caller_kind, agent_id, operation, params_hash, duration_ns,
	result, status, request_id, detail, prev_hash, hash`

func scanAudit(row interface{ Scan(...any) error }) (AuditRecord, error) {
	var (
		r   AuditRecord
		dur int64
	)
	if err := row.Scan(&r.Seq, &r.Time, &r.Caller, &r.CallerKind, &r.AgentID, &r.Operation, &r.ParamsHash, &dur,
		&r.Result, &r.Status, &r.RequestID, &r.Detail, &r.PrevHash, &r.Hash); err != nil {
		return AuditRecord{}, err
	}
	r.Time, r.Duration = r.Time.UTC(), time.Duration(dur)
	return r, nil
}

// AuditQuery selects audit records; empty fields match everything.
type AuditQuery struct {
	AgentID   string
	Caller    string
	Operation string
	// Since and Until bound the record time: Since <= Time < Until.
	Since, Until time.Time
	// Cursor pages: records after it (or before it when Newest) are
	// returned; pass the previous page's Next. Zero starts at the
	// beginning (or the end).
	Cursor int64
	// Newest lists the most recent records first.
	Newest bool
	Limit  int
}

// AuditPage is one page of a query. Next is the cursor of the following
// page, or zero when this page is the last.
type AuditPage struct {
	Records []AuditRecord
	Next    int64
}

// QueryAudit lists audit records matching q, in chain order (or reverse).
func (s *Store) QueryAudit(ctx context.Context, q AuditQuery) (AuditPage, error) {
	var w where
	if q.AgentID != "" {
		w.add(`agent_id = %s`, q.AgentID)
	}
	if q.Caller != "" {
		w.add(`caller = %s`, q.Caller)
	}
	if q.Operation != "" {
		w.add(`operation = %s`, q.Operation)
	}
	if !q.Since.IsZero() {
		w.add(`at >= %s`, dbTime(q.Since))
	}
	if !q.Until.IsZero() {
		w.add(`at < %s`, dbTime(q.Until))
	}
	order := `ASC`
	switch {
	case q.Newest:
		order = `DESC`
		if q.Cursor > 0 {
			w.add(`seq < %s`, q.Cursor)
		}
	case q.Cursor > 0:
		w.add(`seq > %s`, q.Cursor)
	}
	limit := pageSize(q.Limit)
	// One more row than the page tells whether another page follows.
	rows, err := s.db.QueryContext(ctx, `SELECT `+auditColumns+` FROM audit_log`+w.String()+
		` ORDER BY seq `+order+` LIMIT `+w.arg(limit+1), w.args...)
	if err != nil {
		return AuditPage{}, fmt.Errorf("query audit: %w", err)
	}
	defer rows.Close()
	var page AuditPage
	for rows.Next() {
		r, err := scanAudit(rows)
		if err != nil {
			return AuditPage{}, fmt.Errorf("query audit: %w", err)
		}
		page.Records = append(page.Records, r)
	}
	if err := rows.Err(); err != nil {
		return AuditPage{}, fmt.Errorf("query audit: %w", err)
	}
	if len(page.Records) > limit {
		page.Records = page.Records[:limit]
		page.Next = page.Records[limit-1].Seq
	}
	return page, nil
}

// AuditHead is the tip of the chain. Copying it somewhere the database's
// administrators cannot write (logs, a ticket) anchors the chain: a later
// Verify with that anchor detects even a rewrite of the whole chain.
type AuditHead struct {
	Seq  int64
	Hash []byte
}

// String renders the head as "seq:hexhash".
func (h AuditHead) String() string { return fmt.Sprintf("%d:%s", h.Seq, hex.EncodeToString(h.Hash)) }

// Head returns the tip of the audit chain.
func (s *Store) Head(ctx context.Context) (AuditHead, error) {
	var h AuditHead
	err := s.db.QueryRowContext(ctx, `SELECT seq, hash FROM audit_head WHERE id = 1`).Scan(&h.Seq, &h.Hash)
	if errors.Is(err, sql.ErrNoRows) {
		return AuditHead{}, fmt.Errorf("read audit head: %w", ErrNotFound)
	}
	if err != nil {
		return AuditHead{}, fmt.Errorf("read audit head: %w", err)
	}
	return h, nil
}

// BreakKind classifies the first inconsistency Verify finds.
type BreakKind string

const (
	// BreakHash: a record's fields no longer match its hash (a field was
	// changed).
	BreakHash BreakKind = "hash-mismatch"
	// BreakLink: a record's PrevHash is not its predecessor's hash (rows
	// were reordered, replaced or rewritten).
	BreakLink BreakKind = "link-mismatch"
	// BreakGap: a sequence number is missing (a row was deleted).
	BreakGap BreakKind = "missing-record"
	// BreakHead: the chain ends short of, or differs from, the head (the
	// newest rows were deleted or rewritten).
	BreakHead BreakKind = "head-mismatch"
	// BreakAnchor: the record at an anchor's Seq does not have the
	// anchor's hash (the chain was rewritten since the anchor was taken).
	BreakAnchor BreakKind = "anchor-mismatch"
)

// ChainBreak is the first broken record Verify found.
type ChainBreak struct {
	// Seq is the first record that cannot be trusted: the changed one, the
	// first missing one, or the first whose link is wrong.
	Seq    int64
	Kind   BreakKind
	Detail string
}

func (b *ChainBreak) Error() string {
	return fmt.Sprintf("audit chain broken at seq %d (%s): %s", b.Seq, b.Kind, b.Detail)
}

// VerifyReport is the outcome of Verify.
type VerifyReport struct {
	// Records is how many records were checked, and Head the tip they
	// were checked against.
	Records int64
	Head    AuditHead
	// Break is the first inconsistency, or nil when the chain is intact.
	Break *ChainBreak
}

// OK reports whether the chain verified.
func (v VerifyReport) OK() bool { return v.Break == nil }

// VerifyAudit walks the audit chain from its first record to the head it
// read when it started, recomputing every hash, and reports the first
// broken record. Records appended while it runs are not checked. Anchors
// are heads recorded earlier (see AuditHead); each must still be on the
// chain. An error means the chain could not be read, not that it is
// broken.
func (s *Store) VerifyAudit(ctx context.Context, anchors ...AuditHead) (VerifyReport, error) {
	head, err := s.Head(ctx)
	if errors.Is(err, ErrNotFound) {
		return VerifyReport{Break: &ChainBreak{Seq: 1, Kind: BreakHead, Detail: "the head row is missing"}}, nil
	}
	if err != nil {
		return VerifyReport{}, err
	}
	rep := VerifyReport{Head: head}
	want := make(map[int64][]byte, len(anchors))
	for _, a := range anchors {
		want[a.Seq] = a.Hash
		if a.Seq > head.Seq {
			rep.Break = &ChainBreak{Seq: head.Seq + 1, Kind: BreakAnchor,
				Detail: fmt.Sprintf("anchor %d is beyond the head %d", a.Seq, head.Seq)}
			return rep, nil
		}
	}
	prev := AuditRecord{Hash: make([]byte, sha256.Size)}
	const batch = 1000
	for prev.Seq < head.Seq {
		rows, err := s.db.QueryContext(ctx, `SELECT `+auditColumns+` FROM audit_log
			WHERE seq > $1 AND seq <= $2 ORDER BY seq LIMIT $3`, prev.Seq, head.Seq, batch)
		if err != nil {
			return VerifyReport{}, fmt.Errorf("verify audit: %w", err)
		}
		var got int
		for rows.Next() {
			r, err := scanAudit(rows)
			if err != nil {
				rows.Close()
				return VerifyReport{}, fmt.Errorf("verify audit: %w", err)
			}
			got++
			if b := checkLink(prev, r, want); b != nil {
				rows.Close()
				rep.Break = b
				return rep, nil
			}
			rep.Records++
			prev = r
		}
		rows.Close()
		if err := rows.Err(); err != nil {
			return VerifyReport{}, fmt.Errorf("verify audit: %w", err)
		}
		if got == 0 {
			break
		}
	}
	switch {
	case prev.Seq != head.Seq:
		rep.Break = &ChainBreak{Seq: prev.Seq + 1, Kind: BreakHead,
			Detail: fmt.Sprintf("the chain ends at %d but the head is at %d", prev.Seq, head.Seq)}
	case !bytes.Equal(prev.Hash, head.Hash):
		rep.Break = &ChainBreak{Seq: head.Seq, Kind: BreakHead, Detail: "the last record's hash differs from the head's"}
	}
	return rep, nil
}

// checkLink checks r against its predecessor prev and the anchors.
func checkLink(prev, r AuditRecord, anchors map[int64][]byte) *ChainBreak {
	if r.Seq != prev.Seq+1 {
		return &ChainBreak{Seq: prev.Seq + 1, Kind: BreakGap,
			Detail: fmt.Sprintf("record %d follows record %d", r.Seq, prev.Seq)}
	}
	if !bytes.Equal(r.PrevHash, prev.Hash) {
		return &ChainBreak{Seq: r.Seq, Kind: BreakLink, Detail: "its previous-hash is not the hash of the record before it"}
	}
	if !bytes.Equal(r.computeHash(), r.Hash) {
		return &ChainBreak{Seq: r.Seq, Kind: BreakHash, Detail: "its fields do not match its hash"}
	}
	if a, ok := anchors[r.Seq]; ok && !bytes.Equal(a, r.Hash) {
		return &ChainBreak{Seq: r.Seq, Kind: BreakAnchor, Detail: "its hash differs from the anchor's"}
	}
	return nil
}

// ErrChainBroken is wrapped by VerifyReport.Err for a broken chain.
var ErrChainBroken = errors.New("store: audit chain broken")

// Err returns nil for an intact chain and an error wrapping ErrChainBroken
// that describes the first break otherwise.
func (v VerifyReport) Err() error {
	if v.Break == nil {
		return nil
	}
	return fmt.Errorf("%w: %w", ErrChainBroken, v.Break)
}
