package store

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"time"
)

// UserTokenKey is a signing key of the user tokens the Compute API
// issues. PrivateJWK is secret: it is the key itself, as a JSON Web Key.
type UserTokenKey struct {
	ID         string
	Algorithm  string
	PrivateJWK string
	// The key signs during [NotBefore, NotAfter).
	NotBefore, NotAfter time.Time
	CreatedAt           time.Time
}

// AddUserTokenKey records k unless a key with its ID exists, and returns
// the key stored under that ID: replicas that rotate at the same moment
// all end up with (and sign with) the first one's key.
func (s *Store) AddUserTokenKey(ctx context.Context, k UserTokenKey) (UserTokenKey, error) {
	if k.ID == "" || k.PrivateJWK == "" || k.Algorithm == "" || !k.NotBefore.Before(k.NotAfter) {
		return UserTokenKey{}, fmt.Errorf("%w: user token key needs an id, an algorithm, a key and a validity window", ErrInvalid)
	}
	if _, err := s.wdb.ExecContext(ctx, `INSERT INTO user_token_keys
		(id, algorithm, private_jwk, not_before, not_after, created_at)
		VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT DO NOTHING`,
		k.ID, k.Algorithm, k.PrivateJWK, dbTime(k.NotBefore), dbTime(k.NotAfter), s.now()); err != nil {
		return UserTokenKey{}, fmt.Errorf("add user token key: %w", err)
	}
	var got UserTokenKey
	err := s.wdb.QueryRowContext(ctx, `SELECT id, algorithm, private_jwk, not_before, not_after, created_at
		FROM user_token_keys WHERE id = $1`, k.ID).
		Scan(&got.ID, &got.Algorithm, &got.PrivateJWK, &got.NotBefore, &got.NotAfter, &got.CreatedAt)
	if err != nil {
		return UserTokenKey{}, fmt.Errorf("read user token key %s: %w", k.ID, err)
	}
	got.NotBefore, got.NotAfter, got.CreatedAt = got.NotBefore.UTC(), got.NotAfter.UTC(), got.CreatedAt.UTC()
	return got, nil
}

// UserTokenKeys returns the keys that signed or may sign tokens still
// valid after since (NotAfter later than since), oldest first.
func (s *Store) UserTokenKeys(ctx context.Context, since time.Time) ([]UserTokenKey, error) {
	rows, err := s.db.QueryContext(ctx, `SELECT id, algorithm, private_jwk, not_before, not_after, created_at
		FROM user_token_keys WHERE not_after > $1 ORDER BY not_before, id`, dbTime(since))
	if err != nil {
		return nil, fmt.Errorf("list user token keys: %w", err)
	}
	defer rows.Close()
	var keys []UserTokenKey
	for rows.Next() {
		var k UserTokenKey
		if err := rows.Scan(&k.ID, &k.Algorithm, &k.PrivateJWK, &k.NotBefore, &k.NotAfter, &k.CreatedAt); err != nil {
			return nil, fmt.Errorf("list user token keys: %w", err)
		}
		k.NotBefore, k.NotAfter, k.CreatedAt = k.NotBefore.UTC(), k.NotAfter.UTC(), k.CreatedAt.UTC()
		keys = append(keys, k)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("list user token keys: %w", err)
	}
	return keys, nil
}

// DeleteUserTokenKeys deletes the keys whose NotAfter is before before:
// no token they signed can still be valid.
func (s *Store) DeleteUserTokenKeys(ctx context.Context, before time.Time) (int64, error) {
	res, err := s.wdb.ExecContext(ctx, `DELETE FROM user_token_keys WHERE not_after < $1`, dbTime(before))
	if err != nil {
		return 0, fmt.Errorf("delete user token keys: %w", err)
	}
	return res.RowsAffected()
}

// RevokeUserToken records the revocation of the user token with id jti,
// which expires at expiresAt; revoking it again keeps the first record.
func (s *Store) RevokeUserToken(ctx context.Context, jti string, expiresAt time.Time) error {
	if jti == "" {
		return fmt.Errorf("%w: empty token id", ErrInvalid)
	}
	if err := checkText("token id", jti); err != nil {
		return err
	}
	if _, err := s.wdb.ExecContext(ctx, `INSERT INTO user_token_revocations (jti, expires_at, revoked_at)
		VALUES ($1, $2, $3) ON CONFLICT DO NOTHING`, jti, dbTime(expiresAt), s.now()); err != nil {
		return fmt.Errorf("revoke user token: %w", err)
	}
	return nil
}

// UserTokenRevoked reports whether the user token with id jti was revoked.
func (s *Store) UserTokenRevoked(ctx context.Context, jti string) (bool, error) {
	var one int
	err := s.db.QueryRowContext(ctx, `SELECT 1 FROM user_token_revocations WHERE jti = $1`, jti).Scan(&one)
	if errors.Is(err, sql.ErrNoRows) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("look up user token revocation: %w", err)
	}
	return true, nil
}

// PruneUserTokenRevocations forgets the revocations of tokens that expired
// before before: verification refuses those anyway.
func (s *Store) PruneUserTokenRevocations(ctx context.Context, before time.Time) (int64, error) {
	res, err := s.wdb.ExecContext(ctx, `DELETE FROM user_token_revocations WHERE expires_at < $1`, dbTime(before))
	if err != nil {
		return 0, fmt.Errorf("prune user token revocations: %w", err)
	}
	return res.RowsAffected()
}
