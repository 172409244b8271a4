package postgres_test

import (
	"context"
	"database/sql"
	"errors"
	"os"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/agentbox/terraform-provider-agentbox/internal/testenv/postgres"
)

// TestServerLifecycle starts a real server, uses it, and checks that Stop
// leaves neither a process nor its folder behind.
func TestServerLifecycle(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	start := time.Now()
	srv, err := postgres.Start(ctx)
	if errors.Is(err, postgres.ErrNotInstalled) {
		t.Skipf("skipping: %v", err)
	}
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("%s started in %s at %s", srv.Version, time.Since(start).Round(time.Millisecond), srv.Dir)
	pid := srv.Pid()
	stopped := false
	defer func() {
		if !stopped {
			_ = srv.Stop()
		}
	}()

	if os.Geteuid() == 0 {
		status, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/status")
		if err != nil {
			t.Fatal(err)
		}
		for _, line := range strings.Split(string(status), "\n") {
			if strings.HasPrefix(line, "Uid:") && strings.Fields(line)[1] == "0" {
				t.Fatalf("postgres runs as root: %s", line)
			}
		}
	}

	dsn, err := srv.CreateDatabase(ctx, "lifecycle")
	if err != nil {
		t.Fatal(err)
	}
	db, err := sql.Open("pgx", dsn)
	if err != nil {
		t.Fatal(err)
	}
	var version, listen, current string
	if err := db.QueryRowContext(ctx, `SELECT version(), current_setting('listen_addresses'), current_database()`).
		Scan(&version, &listen, &current); err != nil {
		t.Fatal(err)
	}
	_ = db.Close()
	t.Logf("server: %s", version)
	if listen != "" {
		t.Errorf("listen_addresses = %q, want none (socket only)", listen)
	}
	if current != "lifecycle" {
		t.Errorf("connected to %q, want the created database", current)
	}

	if err := srv.Stop(); err != nil {
		t.Fatal(err)
	}
	stopped = true
	if err := syscall.Kill(pid, 0); !errors.Is(err, syscall.ESRCH) {
		t.Errorf("postmaster %d still exists after Stop (kill 0: %v)", pid, err)
	}
	if err := syscall.Kill(-pid, 0); !errors.Is(err, syscall.ESRCH) {
		t.Errorf("processes of group %d still exist after Stop (kill 0: %v)", pid, err)
	}
	if _, err := os.Stat(srv.Dir); !os.IsNotExist(err) {
		t.Errorf("%s still exists after Stop: %v", srv.Dir, err)
	}
}

// TestServerTCPAndPause serves over TCP to the trusted network only, and
// checks that a paused server answers nothing until it is resumed, and
// that Stop stops a paused server.
func TestServerTCPAndPause(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	srv, err := postgres.StartWith(ctx, postgres.Options{Listen: "127.0.0.1", Trust: "127.0.0.1/32"})
	if errors.Is(err, postgres.ErrNotInstalled) {
		t.Skipf("skipping: %v", err)
	}
	if err != nil {
		t.Fatal(err)
	}
	pid := srv.Pid()
	defer func() { _ = srv.Stop() }()
	if _, err := srv.CreateDatabase(ctx, "tcp"); err != nil {
		t.Fatal(err)
	}
	dsn := srv.TCPDSN("tcp")
	if !strings.HasPrefix(dsn, "postgres://postgres@127.0.0.1:"+strconv.Itoa(srv.Port)+"/tcp?") {
		t.Errorf("TCPDSN = %q", dsn)
	}
	db, err := sql.Open("pgx", dsn)
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	db.SetMaxOpenConns(1)
	query := func(timeout time.Duration) error {
		qctx, cancel := context.WithTimeout(ctx, timeout)
		defer cancel()
		var addr string
		return db.QueryRowContext(qctx, `SELECT coalesce(inet_server_addr()::text, '')`).Scan(&addr)
	}
	if err := query(10 * time.Second); err != nil {
		t.Fatalf("query over TCP: %v", err)
	}

	if err := srv.Pause(); err != nil {
		t.Fatal(err)
	}
	if err := query(time.Second); err == nil {
		t.Error("a paused server answered")
	}
	if err := srv.Resume(); err != nil {
		t.Fatal(err)
	}
	if err := query(10 * time.Second); err != nil {
		t.Errorf("query after Resume: %v", err)
	}

	if err := srv.Pause(); err != nil {
		t.Fatal(err)
	}
	_ = db.Close()
	if err := srv.Stop(); err != nil {
		t.Fatal(err)
	}
	if err := syscall.Kill(-pid, 0); !errors.Is(err, syscall.ESRCH) {
		t.Errorf("processes of group %d still exist after stopping a paused server (kill 0: %v)", pid, err)
	}
}
