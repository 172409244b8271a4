package store

import (
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"errors"
	"fmt"
	"net/url"
	"path/filepath"
	"strings"
	"time"
	"unicode/utf8"

	_ "github.com/jackc/pgx/v5/stdlib" // registers the "pgx" database/sql driver
	_ "modernc.org/sqlite"             // registers the "sqlite" database/sql driver
)

// Errors the store returns, possibly wrapped. Callers compare with errors.Is.
var (
	// ErrNotFound means no record matched.
	ErrNotFound = errors.New("store: not found")
	// ErrConflict means a record with the same identity already exists, or
	// a state change was asked for twice (a console session connected again).
	ErrConflict = errors.New("store: conflict")
	// ErrExpired means a token or console session is past its expiry.
	ErrExpired = errors.New("store: expired")
	// ErrRevoked means a token was revoked.
	ErrRevoked = errors.New("store: revoked")
	// ErrInvalid means the caller passed a record the store refuses to hold.
	ErrInvalid = errors.New("store: invalid argument")
	// ErrSchemaTooNew means the database was migrated by a newer agentbox,
	// whose schema this binary does not know; running on it could corrupt it.
	ErrSchemaTooNew = errors.New("store: database schema is newer than this binary")
	// ErrStoreFull means the store has no room for filespace contents: they
	// would eat into what a SQLite store keeps free on its volume for the
	// audit log and everything else, or the database itself is full.
	ErrStoreFull = errors.New("store: no room for filespace contents")
)

// Options tune a Store. The zero value is ready for production use.
type Options struct {
	// Now is the clock for created/expiry times and audit timestamps.
	// Tests replace it; nil means time.Now.
	Now func() time.Time
	// MaxOpenConns bounds the PostgreSQL connection pool (default 16). The
	// SQLite writer always has exactly one connection.
	MaxOpenConns int
	// BusyTimeout is how long a SQLite writer waits for another process's
	// write lock before failing (default 10s).
	BusyTimeout time.Duration
	// MaxTranscript caps a console session's stored transcript in bytes
	// (default 256 KiB); the rest is dropped and the session marked truncated.
	MaxTranscript int
	// VolumeSpace measures the volume that holds a SQLite store's
	// directory: the bytes free to an unprivileged writer, and its size.
	// Tests replace it; nil asks the file system (statfs).
	VolumeSpace func(dir string) (free, size int64, err error)
}

func (o Options) withDefaults() Options {
	if o.Now == nil {
		o.Now = time.Now
	}
	if o.MaxOpenConns <= 0 {
		o.MaxOpenConns = 16
	}
	if o.BusyTimeout <= 0 {
		o.BusyTimeout = 10 * time.Second
	}
	if o.MaxTranscript <= 0 {
		o.MaxTranscript = 256 << 10
	}
	if o.VolumeSpace == nil {
		o.VolumeSpace = volumeSpace
	}
	return o
}

// Store is the control plane's metadata and audit store. It is safe for
// concurrent use, and several Stores (in one or many processes) may share a
// database: on PostgreSQL that is how replicas run.
type Store struct {
	dialect *dialect
	// db serves reads. On PostgreSQL it also serves writes.
	db *sql.DB
	// wdb serves writes. On SQLite it is a single connection whose
	// transactions begin IMMEDIATE, so a write transaction holds the file's
	// write lock from its first statement and never fails half-way with
	// SQLITE_BUSY when it upgrades from reading to writing.
	wdb  *sql.DB
	opts Options
	// dir is a SQLite store's directory, whose volume BlobRoom measures;
	// empty on PostgreSQL.
	dir string
}

// Open opens the store named by dsn and applies pending migrations. A dsn
// beginning with postgres:// or postgresql:// selects PostgreSQL; anything
// else is a SQLite file path, optionally prefixed with sqlite://.
func Open(ctx context.Context, dsn string, opts Options) (*Store, error) {
	switch {
	case strings.HasPrefix(dsn, "postgres://"), strings.HasPrefix(dsn, "postgresql://"):
		return OpenPostgres(ctx, dsn, opts)
	case strings.HasPrefix(dsn, "sqlite://"):
		return OpenSQLite(ctx, strings.TrimPrefix(dsn, "sqlite://"), opts)
	default:
		return OpenSQLite(ctx, dsn, opts)
	}
}

// OpenSQLite opens (creating if needed) the SQLite database at path, in WAL
// mode, and applies pending migrations. Only one process should use a SQLite
// store at a time for throughput, though several stay correct: the write
// lock and busy timeout serialise them.
func OpenSQLite(ctx context.Context, path string, opts Options) (*Store, error) {
	opts = opts.withDefaults()
	if path == "" || strings.ContainsRune(path, '?') {
		return nil, fmt.Errorf("%w: sqlite path %q", ErrInvalid, path)
	}
	common := url.Values{}
	common.Add("_pragma", fmt.Sprintf("busy_timeout(%d)", opts.BusyTimeout.Milliseconds()))
	common.Add("_pragma", "foreign_keys(1)")
	// Times bind as Unix microseconds and TIMESTAMP columns scan back into
	// time.Time, so the SQL and Go code are the same as on PostgreSQL.
	common.Set("_time_integer_format", "unix_micro")
	common.Set("_inttotime", "1")

	w := cloneValues(common)
	w.Add("_pragma", "journal_mode(WAL)")
	// NORMAL in WAL mode survives a crash of the control plane; only a
	// power loss of the node can drop the last commits. FULL would add an
	// fsync to every audited API call.
	w.Add("_pragma", "synchronous(NORMAL)")
	w.Set("_txlock", "immediate")
	wdb, err := sql.Open("sqlite", path+"?"+w.Encode())
	if err != nil {
		return nil, fmt.Errorf("open sqlite %s: %w", path, err)
	}
	wdb.SetMaxOpenConns(1)
	wdb.SetMaxIdleConns(1)
	wdb.SetConnMaxIdleTime(0)
	wdb.SetConnMaxLifetime(0)

	s := &Store{dialect: sqliteDialect, db: wdb, wdb: wdb, opts: opts, dir: filepath.Dir(path)}
	if err := s.migrate(ctx); err != nil {
		_ = wdb.Close()
		return nil, err
	}

	r := cloneValues(common)
	r.Add("_pragma", "query_only(1)")
	rdb, err := sql.Open("sqlite", path+"?"+r.Encode())
	if err != nil {
		_ = wdb.Close()
		return nil, fmt.Errorf("open sqlite %s: %w", path, err)
	}
	rdb.SetMaxOpenConns(4)
	rdb.SetMaxIdleConns(4)
	s.db = rdb
	return s, nil
}

// OpenPostgres connects to the PostgreSQL database named by dsn (a pgx
// connection string) and applies pending migrations, holding an advisory
// lock so that replicas starting together migrate once.
func OpenPostgres(ctx context.Context, dsn string, opts Options) (*Store, error) {
	opts = opts.withDefaults()
	db, err := sql.Open("pgx", dsn)
	if err != nil {
		return nil, fmt.Errorf("open postgres: %w", err)
	}
	db.SetMaxOpenConns(opts.MaxOpenConns)
	db.SetMaxIdleConns(opts.MaxOpenConns)
	db.SetConnMaxIdleTime(5 * time.Minute)
	s := &Store{dialect: postgresDialect, db: db, wdb: db, opts: opts}
	if err := db.PingContext(ctx); err != nil {
		_ = db.Close()
		return nil, fmt.Errorf("connect to postgres: %w", err)
	}
	if err := s.migrate(ctx); err != nil {
		_ = db.Close()
		return nil, err
	}
	return s, nil
}

// Close releases the store's connections.
func (s *Store) Close() error {
	err := s.wdb.Close()
	if s.db != s.wdb {
		err = errors.Join(err, s.db.Close())
	}
	return err
}

// Dialect is "sqlite" or "postgres".
func (s *Store) Dialect() string { return s.dialect.name }

// Ping checks that the database answers, for readiness probes.
func (s *Store) Ping(ctx context.Context) error {
	if err := s.wdb.PingContext(ctx); err != nil {
		return fmt.Errorf("ping %s store: %w", s.dialect.name, err)
	}
	return nil
}

// now returns the store clock's time at the precision both databases keep,
// so that what is returned to callers equals what a later read returns.
func (s *Store) now() time.Time { return dbTime(s.opts.Now()) }

func dbTime(t time.Time) time.Time { return t.UTC().Truncate(time.Microsecond) }

// writeTx runs fn in a write transaction and commits it if fn succeeds.
func (s *Store) writeTx(ctx context.Context, fn func(*sql.Tx) error) error {
	tx, err := s.wdb.BeginTx(ctx, nil)
	if err != nil {
		return fmt.Errorf("begin: %w", err)
	}
	if err := fn(tx); err != nil {
		_ = tx.Rollback()
		return err
	}
	if err := tx.Commit(); err != nil {
		return fmt.Errorf("commit: %w", err)
	}
	return nil
}

// newID returns a random 128-bit identifier in hex.
func newID() string {
	var b [16]byte
	_, _ = rand.Read(b[:]) // crypto/rand.Read never fails on Linux
	return hex.EncodeToString(b[:])
}

// checkText refuses strings one of the databases could not store as they
// are (PostgreSQL's text has no NUL and must be UTF-8), so both backends
// accept and refuse the same records.
func checkText(field, v string) error {
	if !utf8.ValidString(v) || strings.IndexByte(v, 0) >= 0 {
		return fmt.Errorf("%w: %s is not NUL-free UTF-8", ErrInvalid, field)
	}
	return nil
}

func cloneValues(v url.Values) url.Values {
	out := url.Values{}
	for k, vs := range v {
		out[k] = append([]string(nil), vs...)
	}
	return out
}

// nullTime maps an optional time to a column value.
func nullTime(t *time.Time) sql.NullTime {
	if t == nil || t.IsZero() {
		return sql.NullTime{}
	}
	return sql.NullTime{Time: dbTime(*t), Valid: true}
}

// timePtr maps a nullable column back to an optional time.
func timePtr(t sql.NullTime) *time.Time {
	if !t.Valid {
		return nil
	}
	u := t.Time.UTC()
	return &u
}

// where builds a WHERE clause from the filters a caller set, numbering
// placeholders as it goes. Leaving unset filters out (rather than writing
// "$1 = ” OR col = $1") lets both databases use their indexes and spares
// PostgreSQL from guessing the type of an unused parameter.
type where struct {
	conds []string
	args  []any
}

// arg adds a parameter and returns its placeholder.
func (w *where) arg(v any) string {
	w.args = append(w.args, v)
	return fmt.Sprintf("$%d", len(w.args))
}

// add adds a condition; each %s in cond takes the placeholder of the next
// value.
func (w *where) add(cond string, vals ...any) {
	ph := make([]any, len(vals))
	for i, v := range vals {
		ph[i] = w.arg(v)
	}
	w.conds = append(w.conds, fmt.Sprintf(cond, ph...))
}

func (w *where) String() string {
	if len(w.conds) == 0 {
		return ""
	}
	return " WHERE " + strings.Join(w.conds, " AND ")
}
