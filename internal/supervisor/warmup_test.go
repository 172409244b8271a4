package supervisor

import (
	"context"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"sync/atomic"
	"testing"
	"time"

	api "github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"
)

// TestWarmUp: the throwaway command runs along the command path and is
// not recorded as a call: the audit log stays empty, and the server's
// next command is answered as usual.
func TestWarmUp(t *testing.T) {
	path := filepath.Join(t.TempDir(), "audit.log")
	audit, err := OpenAuditLog(path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = audit.Close() })
	s := newServer(t, Config{Audit: audit})
	if err := s.WarmUp(t.Context()); err != nil {
		t.Fatalf("WarmUp: %v", err)
	}
	if st, err := os.Stat(path); err != nil || st.Size() != 0 {
		t.Fatalf("audit log after the warm-up: %v, %v; want it empty", st, err)
	}
	if code, res, e := post(t, s, api.CommandRequest{Command: []string{"echo", "hi"}}); code != http.StatusOK || res.Stdout != "hi\n" {
		t.Fatalf("command after the warm-up: %d %+v %v", code, res, e)
	}
}

// TestWarmUpFails: an image whose commands' PATH has no `true` fails the
// warm-up with the reason, and the server goes on serving commands.
func TestWarmUpFails(t *testing.T) {
	empty := t.TempDir()
	s := newServer(t, Config{BaseEnv: map[string]string{"PATH": empty}})
	err := s.WarmUp(t.Context())
	if err == nil {
		t.Fatal("WarmUp without `true` in PATH succeeded")
	}
	t.Logf("WarmUp: %v", err)
	echo, err := os.Executable() // any executable by its path; the test binary prints its usage
	if err != nil {
		t.Fatal(err)
	}
	if code, res, e := post(t, s, api.CommandRequest{Command: []string{echo, "-test.run=^$"}}); code != http.StatusOK || res.ExitCode != 0 {
		t.Fatalf("command after a failed warm-up: %d %+v %v", code, res, e)
	}
}

// TestWarmUpCancelled: a warm-up whose context ends returns, not hangs.
func TestWarmUpCancelled(t *testing.T) {
	s := newServer(t, Config{})
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	if err := s.WarmUp(ctx); err == nil {
		t.Fatal("WarmUp with a cancelled context succeeded")
	}
}

// TestIdleTrim: memory is trimmed once the server has been idle for
// IdleTrim after a call, not while a call runs, and never when off.
func TestIdleTrim(t *testing.T) {
	var trims atomic.Int32
	const after = 100 * time.Millisecond
	s := newServer(t, Config{IdleTrim: after, MemoryTrim: func() { trims.Add(1) }})
	t.Cleanup(func() { _ = s.Close() })
	time.Sleep(3 * after)
	if n := trims.Load(); n != 0 {
		t.Fatalf("%d trims before any call; want none", n)
	}

	// A command that outlasts the idle delay several times: no trim under it.
	start := time.Now()
	if code, res, e := post(t, s, api.CommandRequest{Command: []string{"sleep", "0.5"}}); code != http.StatusOK || res.ExitCode != 0 {
		t.Fatalf("sleep: %d %+v %v", code, res, e)
	}
	if n := trims.Load(); n != 0 {
		t.Fatalf("%d trims during a call of %v; want none", n, time.Since(start))
	}
	waitFor(t, "a trim after the call", func() bool { return trims.Load() == 1 })
	time.Sleep(3 * after)
	if n := trims.Load(); n != 1 {
		t.Fatalf("%d trims in one idle spell; want 1", n)
	}

	// A health probe is a call too: one more trim after it.
	rec := httptest.NewRecorder()
	s.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, api.PathHealth, nil))
	if rec.Code != http.StatusOK {
		t.Fatalf("health: %d", rec.Code)
	}
	waitFor(t, "a trim after the probe", func() bool { return trims.Load() == 2 })

	var never atomic.Int32
	off := newServer(t, Config{IdleTrim: -1, MemoryTrim: func() { never.Add(1) }})
	if code, _, e := post(t, off, api.CommandRequest{Command: []string{"true"}}); code != http.StatusOK {
		t.Fatalf("true: %d %v", code, e)
	}
	time.Sleep(3 * after)
	if n := never.Load(); n != 0 {
		t.Fatalf("%d trims with the idle trim off", n)
	}
}
