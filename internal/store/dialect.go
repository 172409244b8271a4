package store

import (
	"context"
	"embed"
	"errors"
	"fmt"
	"io/fs"

	"github.com/pressly/goose/v3"
	"github.com/pressly/goose/v3/lock"
)

// dialect holds everything that differs between SQLite and PostgreSQL. The
// rest of the package is written once: both take $n placeholders, ON
// CONFLICT upserts, RETURNING, and (through the driver settings in Open)
// time.Time values.
type dialect struct {
	name  string
	goose goose.Dialect
	// migrations is the folder of this dialect's SQL files in migrationsFS.
	migrations string
	// rowLock is appended to a SELECT in a write transaction to lock the rows
	// it reads until the transaction ends. SQLite needs none: its write
	// transactions already hold the database's single write lock from BEGIN
	// (IMMEDIATE).
	rowLock string
	// sessionLocker serialises migrations across processes, or nil.
	sessionLocker func() (lock.SessionLocker, error)
	// tables lists the store's tables, for tests and tooling.
	tables string
}

var sqliteDialect = &dialect{
	name:       "sqlite",
	goose:      goose.DialectSQLite3,
	migrations: "migrations/sqlite",
	tables:     `SELECT name FROM sqlite_schema WHERE type = 'table' AND name NOT LIKE 'sqlite_%' ORDER BY name`,
}

var postgresDialect = &dialect{
	name:       "postgres",
	goose:      goose.DialectPostgres,
	migrations: "migrations/postgres",
	rowLock:    ` FOR UPDATE`,
	sessionLocker: func() (lock.SessionLocker, error) {
		// Poll once a second for up to five minutes: a replica waits while
		// another one migrates.
		return lock.NewPostgresSessionLocker(lock.WithLockID(migrationLockID), lock.WithLockTimeout(1, 300))
	},
	tables: `SELECT table_name FROM information_schema.tables
		WHERE table_schema = current_schema() AND table_type = 'BASE TABLE' ORDER BY table_name`,
}

// migrationLockID is the advisory lock key that serialises migrations: the
// store's own, so that other goose users of the database do not wait on it.
const migrationLockID = 0x6167656e74626f78 // "agentbox"

// forUpdate is the row-locking suffix for a SELECT in a write transaction.
func (d *dialect) forUpdate() string { return d.rowLock }

//go:embed migrations
var migrationsFS embed.FS

// MigrationsTable is where applied schema versions are recorded.
const MigrationsTable = "schema_migrations"

// migrate applies the embedded migrations that the database lacks, after
// refusing a database that a newer binary has migrated further.
func (s *Store) migrate(ctx context.Context) error {
	p, err := s.migrationProvider()
	if err != nil {
		return err
	}
	known := p.ListSources()
	if len(known) == 0 {
		return errors.New("store: no embedded migrations")
	}
	latest := known[len(known)-1].Version
	current, err := p.GetDBVersion(ctx)
	if err != nil {
		return fmt.Errorf("read schema version: %w", err)
	}
	if current > latest {
		return fmt.Errorf("%w: database is at version %d, this binary knows up to %d", ErrSchemaTooNew, current, latest)
	}
	if _, err := p.Up(ctx); err != nil {
		return fmt.Errorf("migrate %s store: %w", s.dialect.name, err)
	}
	return nil
}

func (s *Store) migrationProvider() (*goose.Provider, error) {
	sub, err := fs.Sub(migrationsFS, s.dialect.migrations)
	if err != nil {
		return nil, fmt.Errorf("migrations: %w", err)
	}
	opts := []goose.ProviderOption{
		goose.WithTableName(MigrationsTable),
		goose.WithDisableGlobalRegistry(true),
	}
	if s.dialect.sessionLocker != nil {
		l, err := s.dialect.sessionLocker()
		if err != nil {
			return nil, fmt.Errorf("migration lock: %w", err)
		}
		opts = append(opts, goose.WithSessionLocker(l))
	}
	p, err := goose.NewProvider(s.dialect.goose, s.wdb, sub, opts...)
	if err != nil {
		return nil, fmt.Errorf("migrations: %w", err)
	}
	return p, nil
}

// SchemaVersion returns the highest migration applied to the database and
// the highest this binary knows.
func (s *Store) SchemaVersion(ctx context.Context) (current, latest int64, err error) {
	p, err := s.migrationProvider()
	if err != nil {
		return 0, 0, err
	}
	current, latest, err = p.GetVersions(ctx)
	if err != nil {
		return 0, 0, fmt.Errorf("read schema version: %w", err)
	}
	return current, latest, nil
}
