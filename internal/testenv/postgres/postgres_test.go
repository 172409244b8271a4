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
