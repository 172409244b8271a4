package store_test

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/agentbox/terraform-provider-agentbox/internal/store"
	"github.com/agentbox/terraform-provider-agentbox/internal/testenv/postgres"
)

// One PostgreSQL server serves the whole test binary, started on first use
// and stopped by TestMain; every test gets a database of its own.
var pg struct {
	once sync.Once
	srv  *postgres.Server
	err  error
	n    atomic.Int64
}

// appendProcessEnv makes the test binary a second audit writer process
// (see testAuditConcurrent) instead of running tests.
const appendProcessEnv = "AGENTBOX_STORE_TEST_APPEND_DSN"

func TestMain(m *testing.M) {
	if dsn := os.Getenv(appendProcessEnv); dsn != "" {
		os.Exit(appendProcess(dsn))
	}
	code := m.Run()
	if pg.srv != nil {
		if err := pg.srv.Stop(); err != nil {
			fmt.Fprintln(os.Stderr, "stop postgres:", err)
			code = 1
		}
	}
	os.Exit(code)
}

func pgServer(tb testing.TB) *postgres.Server {
	tb.Helper()
	pg.once.Do(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		defer cancel()
		start := time.Now()
		pg.srv, pg.err = postgres.Start(ctx)
		if pg.err == nil {
			fmt.Printf("postgres: %s, started in %s\n", pg.srv.Version, time.Since(start).Round(time.Millisecond))
		}
	})
	if errors.Is(pg.err, postgres.ErrNotInstalled) {
		tb.Skipf("skipping the PostgreSQL backend: %v", pg.err)
	}
	if pg.err != nil {
		tb.Fatalf("start postgres: %v", pg.err)
	}
	return pg.srv
}

// backend is one database the shared suite runs against.
type backend struct {
	name string
	// newDSN returns the DSN of a new, empty database.
	newDSN func(tb testing.TB) string
}

var backends = []backend{
	{name: "sqlite", newDSN: func(tb testing.TB) string {
		return filepath.Join(tb.TempDir(), "agentbox.db")
	}},
	{name: "postgres", newDSN: func(tb testing.TB) string {
		srv := pgServer(tb)
		dsn, err := srv.CreateDatabase(context.Background(), fmt.Sprintf("t%d", pg.n.Add(1)))
		if err != nil {
			tb.Fatal(err)
		}
		return dsn
	}},
}

// clock is a settable clock for expiry tests.
type clock struct {
	mu sync.Mutex
	t  time.Time
}

func newClock() *clock {
	return &clock{t: time.Date(2026, 11, 23, 12, 0, 0, 123456789, time.UTC)}
}

func (c *clock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

func (c *clock) Advance(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.t = c.t.Add(d)
}

// open opens a store on dsn and closes it when the test ends.
func open(tb testing.TB, dsn string, opts store.Options) *store.Store {
	tb.Helper()
	s, err := store.Open(context.Background(), dsn, opts)
	if err != nil {
		tb.Fatalf("open store: %v", err)
	}
	tb.Cleanup(func() {
		if err := s.Close(); err != nil {
			tb.Errorf("close store: %v", err)
		}
	})
	return s
}

// appendProcess opens the store, says "ready", waits for a line on stdin,
// then appends processAppends audit entries.
func appendProcess(dsn string) int {
	ctx := context.Background()
	s, err := store.Open(ctx, dsn, store.Options{})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer s.Close()
	fmt.Println("ready")
	if _, err := bufio.NewReader(os.Stdin).ReadString('\n'); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	for i := range processAppends {
		if _, err := s.AppendAudit(ctx, store.AuditEntry{Caller: "process-2", Operation: "op", Detail: fmt.Sprint(i)}); err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
	}
	return 0
}

const processAppends = 100
