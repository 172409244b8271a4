package store

import (
	"context"
	"crypto/sha256"
	"database/sql"
	"errors"
	"fmt"
	"time"
)

// TokenKind says what a token may do.
type TokenKind string

const (
	// TokenAgent may address only the sandbox of its bound agent.
	TokenAgent TokenKind = "agent"
	// TokenAdmin may address every sandbox and manage tokens.
	TokenAdmin TokenKind = "admin"
	// TokenStaff may mint time-boxed console sessions (with a reason).
	TokenStaff TokenKind = "staff"
	// TokenExchange may act for users: exchange a user's identity for user
	// tokens bound to an agent, and revoke them. It addresses no sandbox,
	// so the service that vouches for users (an identity gateway) need not
	// hold an admin token.
	TokenExchange TokenKind = "exchange"
)

func (k TokenKind) valid() bool {
	return k == TokenAgent || k == TokenAdmin || k == TokenStaff || k == TokenExchange
}

// TokenHash is the SHA-256 of a bearer token. The store never sees tokens
// themselves, so a copy of the database grants no access.
type TokenHash [sha256.Size]byte

// Token is an API token's record.
type Token struct {
	// ID names the token in logs, the audit log and revocation; it is not a
	// secret. CreateToken fills it in when empty.
	ID   string
	Hash TokenHash
	Kind TokenKind
	// AgentID binds an agent token to its agent; empty for other kinds.
	AgentID string
	// Subject is who holds the token: a staff id, or a label.
	Subject   string
	CreatedAt time.Time
	ExpiresAt *time.Time
	RevokedAt *time.Time
}

// CreateToken records a token. It fails with ErrConflict if the ID or hash
// is already taken, and with ErrInvalid for an agent token without an agent
// (or another kind with one).
func (s *Store) CreateToken(ctx context.Context, t Token) (Token, error) {
	if !t.Kind.valid() {
		return Token{}, fmt.Errorf("%w: token kind %q", ErrInvalid, t.Kind)
	}
	if (t.Kind == TokenAgent) != (t.AgentID != "") {
		return Token{}, fmt.Errorf("%w: only agent tokens (all of them) are bound to an agent", ErrInvalid)
	}
	if t.Hash == (TokenHash{}) {
		return Token{}, fmt.Errorf("%w: empty token hash", ErrInvalid)
	}
	for f, v := range map[string]string{"token id": t.ID, "agent id": t.AgentID, "subject": t.Subject} {
		if err := checkText(f, v); err != nil {
			return Token{}, err
		}
	}
	if t.ID == "" {
		t.ID = newID()
	}
	t.CreatedAt = s.now()
	t.RevokedAt = nil
	if t.ExpiresAt != nil {
		e := dbTime(*t.ExpiresAt)
		t.ExpiresAt = &e
	}
	res, err := s.wdb.ExecContext(ctx, `INSERT INTO api_tokens
		(id, token_hash, kind, agent_id, subject, created_at, expires_at)
		VALUES ($1, $2, $3, $4, $5, $6, $7) ON CONFLICT DO NOTHING`,
		t.ID, t.Hash[:], string(t.Kind), t.AgentID, t.Subject, t.CreatedAt, nullTime(t.ExpiresAt))
	if err != nil {
		return Token{}, fmt.Errorf("create token: %w", err)
	}
	if n, err := res.RowsAffected(); err != nil {
		return Token{}, fmt.Errorf("create token: %w", err)
	} else if n == 0 {
		return Token{}, fmt.Errorf("%w: token id or hash already exists", ErrConflict)
	}
	return t, nil
}

const tokenColumns = `id, token_hash, kind, agent_id, subject, created_at, expires_at, revoked_at`

func scanToken(row interface{ Scan(...any) error }) (Token, error) {
	var (
		t                Token
		hash             []byte
		kind             string
		expires, revoked sql.NullTime
	)
	if err := row.Scan(&t.ID, &hash, &kind, &t.AgentID, &t.Subject, &t.CreatedAt, &expires, &revoked); err != nil {
		return Token{}, err
	}
	if len(hash) != len(t.Hash) {
		return Token{}, fmt.Errorf("token %s: stored hash has %d bytes", t.ID, len(hash))
	}
	copy(t.Hash[:], hash)
	t.Kind = TokenKind(kind)
	t.CreatedAt = t.CreatedAt.UTC()
	t.ExpiresAt, t.RevokedAt = timePtr(expires), timePtr(revoked)
	return t, nil
}

// LookupToken finds the token with the given hash, for authenticating a
// request. An unknown hash gives ErrNotFound. A revoked or expired token
// gives ErrRevoked or ErrExpired together with its record, so the caller
// can audit which token was tried; it must still refuse the request.
func (s *Store) LookupToken(ctx context.Context, hash TokenHash) (Token, error) {
	t, err := scanToken(s.db.QueryRowContext(ctx,
		`SELECT `+tokenColumns+` FROM api_tokens WHERE token_hash = $1`, hash[:]))
	if errors.Is(err, sql.ErrNoRows) {
		return Token{}, ErrNotFound
	}
	if err != nil {
		return Token{}, fmt.Errorf("look up token: %w", err)
	}
	if t.RevokedAt != nil {
		return t, ErrRevoked
	}
	if t.ExpiresAt != nil && !s.now().Before(*t.ExpiresAt) {
		return t, ErrExpired
	}
	return t, nil
}

// GetToken returns the token with the given ID, whatever its state.
func (s *Store) GetToken(ctx context.Context, id string) (Token, error) {
	t, err := scanToken(s.db.QueryRowContext(ctx,
		`SELECT `+tokenColumns+` FROM api_tokens WHERE id = $1`, id))
	if errors.Is(err, sql.ErrNoRows) {
		return Token{}, ErrNotFound
	}
	if err != nil {
		return Token{}, fmt.Errorf("get token: %w", err)
	}
	return t, nil
}

// RevokeToken revokes the token with the given ID. Revoking a revoked
// token keeps its first revocation time and succeeds.
func (s *Store) RevokeToken(ctx context.Context, id string) error {
	res, err := s.wdb.ExecContext(ctx,
		`UPDATE api_tokens SET revoked_at = COALESCE(revoked_at, $2) WHERE id = $1`, id, s.now())
	if err != nil {
		return fmt.Errorf("revoke token: %w", err)
	}
	if n, err := res.RowsAffected(); err != nil {
		return fmt.Errorf("revoke token: %w", err)
	} else if n == 0 {
		return ErrNotFound
	}
	return nil
}

// RevokeAgentTokens revokes every live token bound to agentID, as when its
// sandbox is deleted, and returns how many it revoked.
func (s *Store) RevokeAgentTokens(ctx context.Context, agentID string) (int64, error) {
	res, err := s.wdb.ExecContext(ctx,
		`UPDATE api_tokens SET revoked_at = $2 WHERE agent_id = $1 AND revoked_at IS NULL`, agentID, s.now())
	if err != nil {
		return 0, fmt.Errorf("revoke tokens of agent %s: %w", agentID, err)
	}
	n, err := res.RowsAffected()
	if err != nil {
		return 0, fmt.Errorf("revoke tokens of agent %s: %w", agentID, err)
	}
	return n, nil
}

// TokenFilter selects tokens to list; empty fields match everything.
type TokenFilter struct {
	Kind    TokenKind
	AgentID string
	// IncludeRevoked lists revoked tokens too.
	IncludeRevoked bool
}

// ListTokens lists tokens, oldest first.
func (s *Store) ListTokens(ctx context.Context, f TokenFilter) ([]Token, error) {
	var w where
	if f.Kind != "" {
		w.add(`kind = %s`, string(f.Kind))
	}
	if f.AgentID != "" {
		w.add(`agent_id = %s`, f.AgentID)
	}
	if !f.IncludeRevoked {
		w.add(`revoked_at IS NULL`)
	}
	rows, err := s.db.QueryContext(ctx, `SELECT `+tokenColumns+` FROM api_tokens`+w.String()+
		` ORDER BY created_at, id`, w.args...)
	if err != nil {
		return nil, fmt.Errorf("list tokens: %w", err)
	}
	defer rows.Close()
	var out []Token
	for rows.Next() {
		t, err := scanToken(rows)
		if err != nil {
			return nil, fmt.Errorf("list tokens: %w", err)
		}
		out = append(out, t)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("list tokens: %w", err)
	}
	return out, nil
}
