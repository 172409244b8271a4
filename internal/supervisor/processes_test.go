package supervisor

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	api "github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"
)

func TestRing(t *testing.T) {
	r := newRing(8)
	r.Write([]byte("abc"))
	if s, cut := r.text(); s != "abc" || cut {
		t.Fatalf("%q %v", s, cut)
	}
	r.Write([]byte("defgh"))
	if s, cut := r.text(); s != "abcdefgh" || cut {
		t.Fatalf("%q %v", s, cut)
	}
	r.Write([]byte("ij"))
	if s, cut := r.text(); s != "cdefghij" || !cut {
		t.Fatalf("%q %v", s, cut)
	}
	r.Write([]byte("0123456789"))
	if s, cut := r.text(); s != "23456789" || !cut || len(r.buf) != 8 {
		t.Fatalf("%q %v", s, cut)
	}
	// A character whose first bytes were dropped is dropped whole.
	r = newRing(4)
	r.Write([]byte("x€yz"))
	if s, _ := r.text(); s != "yz" {
		t.Fatalf("ring of 4 after x€yz: %q, want the tail without the cut euro", s)
	}
}

func TestProcessEndpoints(t *testing.T) {
	s := newServer(t, Config{MaxProcesses: 1, ProcessOutputBytes: 16, ProcessKillGrace: 200 * time.Millisecond})
	srv := httptest.NewServer(s)
	defer srv.Close()
	c := api.NewClient(srv.URL, srv.Client())
	ctx := context.Background()

	for _, tc := range []struct {
		method, path string
		status       int
	}{
		{http.MethodPut, api.PathProcesses, http.StatusMethodNotAllowed},
		{http.MethodPost, api.PathProcesses + "/x", http.StatusMethodNotAllowed},
		{http.MethodGet, api.PathProcesses + "/nope", http.StatusNotFound},
		{http.MethodDelete, api.PathProcesses + "/nope", http.StatusNotFound},
	} {
		rec := httptest.NewRecorder()
		s.ServeHTTP(rec, httptest.NewRequest(tc.method, tc.path, nil))
		if rec.Code != tc.status {
			t.Errorf("%s %s: %d, want %d", tc.method, tc.path, rec.Code, tc.status)
		}
	}
	if _, err := c.StartProcess(ctx, api.ProcessRequest{}); api.CodeOf(err) != api.CodeInvalidArgument {
		t.Errorf("empty command: %v", err)
	}
	if _, err := c.StartProcess(ctx, api.ProcessRequest{Command: []string{"no-such-program-here"}}); api.CodeOf(err) != api.CodeNotFound {
		t.Errorf("missing program: %v", err)
	}

	// Only the last 16 bytes of each stream are kept.
	p, err := c.StartProcess(ctx, api.ProcessRequest{Command: []string{"sh", "-c", "seq 1 100; read x; echo got $x"}, Stdin: "hello\n"})
	if err != nil {
		t.Fatal(err)
	}
	var info *api.ProcessInfo
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		if info, err = c.GetProcess(ctx, p.ID); err != nil {
			t.Fatal(err)
		}
		if !info.Running {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("process did not exit")
		}
	}
	if info.Stdout != "98\n99\n100\ngot hello\n"[len("98\n99\n100\ngot hello\n")-16:] || !info.Truncated || info.Exit.ExitCode != 0 {
		t.Fatalf("GetProcess = %+v", info)
	}

	// After Terminate no new process is started, and Kill ends the rest.
	long, err := c.StartProcess(ctx, api.ProcessRequest{Command: []string{"sh", "-c", "trap '' TERM; echo ready; sleep 100"}})
	if err != nil {
		t.Fatalf("start in the place of an exited process: %v", err)
	}
	// SIGTERM before the trap is set would end it.
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		if info, err = c.GetProcess(ctx, long.ID); err != nil || info.Stdout == "ready\n" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the trap was not set")
		}
	}
	if n := s.Terminate(); n != 1 {
		t.Errorf("Terminate signalled %d groups, want 1", n)
	}
	if _, err := c.StartProcess(ctx, api.ProcessRequest{Command: []string{"true"}}); api.CodeOf(err) != api.CodeUnavailable {
		t.Errorf("start after Terminate: %v", err)
	}
	waitCtx, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
	defer cancel()
	if err := s.Wait(waitCtx); err == nil {
		t.Fatal("Wait returned while a background process ignoring SIGTERM runs")
	}
	s.Kill()
	if err := s.Wait(ctx); err != nil {
		t.Fatal(err)
	}
	info, err = c.GetProcess(ctx, long.ID)
	if err != nil || info.Running || info.Exit.Signal != "SIGKILL" || !strings.HasPrefix(info.Command[2], "trap") {
		t.Fatalf("after Kill: %+v, %v", info, err)
	}
}
