package store

import (
	"context"
	"database/sql"
	"fmt"
)

// RawDB gives tests the database underneath, to tamper with it as an
// attacker with database access would.
func (s *Store) RawDB() *sql.DB { return s.wdb }

// Tables lists the store's tables.
func (s *Store) Tables(ctx context.Context) ([]string, error) {
	rows, err := s.wdb.QueryContext(ctx, s.dialect.tables)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []string
	for rows.Next() {
		var n string
		if err := rows.Scan(&n); err != nil {
			return nil, err
		}
		out = append(out, n)
	}
	return out, rows.Err()
}

// DropAuditGuards removes the append-only triggers, as an attacker with
// DDL rights could, so that tests can tamper with the audit log.
func (s *Store) DropAuditGuards(ctx context.Context) error {
	stmts := []string{`DROP TRIGGER audit_log_no_update`, `DROP TRIGGER audit_log_no_delete`}
	if s.dialect == postgresDialect {
		stmts = []string{`DROP TRIGGER audit_log_no_update ON audit_log`, `DROP TRIGGER audit_log_no_truncate ON audit_log`}
	}
	for _, q := range stmts {
		if _, err := s.wdb.ExecContext(ctx, q); err != nil {
			return fmt.Errorf("%s: %w", q, err)
		}
	}
	return nil
}

// HashRecord computes a record's chain hash, as a forger would.
func HashRecord(r AuditRecord) []byte { return r.computeHash() }
