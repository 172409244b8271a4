package main

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/coder/websocket"

	"github.com/agentbox/terraform-provider-agentbox/internal/pki"
	api "github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"
)

// console is a client's view of a PTY session: what the terminal printed
// so far, collected as it arrives.
type console struct {
	p    *api.PTY
	mu   sync.Mutex
	buf  bytes.Buffer
	more chan struct{}
	eof  chan error
}

func openConsole(t *testing.T, client *api.Client, req api.PTYRequest) *console {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	p, err := client.OpenPTY(ctx, req)
	if err != nil {
		t.Fatalf("OpenPTY(%+v): %v", req, err)
	}
	c := &console{p: p, more: make(chan struct{}, 1), eof: make(chan error, 1)}
	go func() {
		b := make([]byte, 8192)
		for {
			n, err := p.Read(b)
			c.mu.Lock()
			c.buf.Write(b[:n])
			c.mu.Unlock()
			select {
			case c.more <- struct{}{}:
			default:
			}
			if err != nil {
				if err == io.EOF {
					err = nil
				}
				c.eof <- err
				return
			}
		}
	}()
	t.Cleanup(func() { p.Close() })
	return c
}

func (c *console) output() string {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.buf.String()
}

// expect waits until the output holds want after position from, and
// returns the output up to and including it.
func (c *console) expect(t *testing.T, from int, want string) string {
	t.Helper()
	deadline := time.After(15 * time.Second)
	for {
		out := c.output()
		if i := strings.Index(out[min(from, len(out)):], want); i >= 0 {
			return out[:from+i+len(want)]
		}
		select {
		case <-c.more:
		case <-deadline:
			t.Fatalf("terminal output %q has no %q after byte %d", out, want, from)
		}
	}
}

func (c *console) typeLine(t *testing.T, line string) int {
	t.Helper()
	from := len(c.output())
	if _, err := c.p.Write([]byte(line + "\r")); err != nil {
		t.Fatalf("typing %q: %v", line, err)
	}
	return from
}

func (c *console) exit(t *testing.T) *api.PTYExit {
	t.Helper()
	select {
	case err := <-c.eof:
		if err != nil {
			t.Fatalf("terminal read: %v; output %q", err, c.output())
		}
	case <-time.After(20 * time.Second):
		t.Fatalf("the session did not end; output %q", c.output())
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	exit, err := c.p.Wait(ctx)
	if err != nil {
		t.Fatalf("Wait: %v", err)
	}
	return exit
}

// sessionMembers lists the live processes of session sid.
func sessionMembers(sid int) []int {
	entries, _ := os.ReadDir("/proc")
	var out []int
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		data, err := os.ReadFile(filepath.Join("/proc", e.Name(), "stat"))
		if err != nil {
			continue
		}
		i := bytes.LastIndexByte(data, ')')
		f := strings.Fields(string(data[i+1:]))
		if len(f) > 3 && f[0] != "Z" && f[3] == strconv.Itoa(sid) {
			out = append(out, pid)
		}
	}
	return out
}

func waitSessionEmpty(t *testing.T, sid int, d time.Duration) time.Duration {
	t.Helper()
	start := time.Now()
	for {
		members := sessionMembers(sid)
		if len(members) == 0 {
			return time.Since(start)
		}
		if time.Since(start) > d {
			for _, m := range members {
				_ = syscall.Kill(m, syscall.SIGKILL)
			}
			t.Fatalf("session %d still has %v after %s", sid, members, d)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// pids parses "PIDS <a> <b> ..." from a line the session printed.
func pids(t *testing.T, out, tag string) []int {
	t.Helper()
	i := strings.LastIndex(out, tag+" ")
	if i < 0 {
		t.Fatalf("no %q in %q", tag, out)
	}
	line, _, _ := strings.Cut(out[i+len(tag)+1:], "\r\n")
	var res []int
	for _, f := range strings.Fields(line) {
		n, err := strconv.Atoi(f)
		if err != nil {
			t.Fatalf("%s line %q", tag, line)
		}
		res = append(res, n)
	}
	return res
}

// TestSupervisorProcessPTY drives interactive sessions through the real
// binary over mTLS, as the console will.
func TestSupervisorProcessPTY(t *testing.T) {
	bin := buildSupervisor(t)
	ca, err := pki.NewCA("agentbox-test-ca")
	if err != nil {
		t.Fatal(err)
	}
	sandboxID := pki.SandboxID("", "agents", "sb-pty").String()
	tlsDir := writeTLSDir(t, ca, issue(t, ca, sandboxID, pki.UsageServer))
	controlPlane := issue(t, ca, pki.ControlPlaneID("", "platform").String(), pki.UsageClient)
	workdir := t.TempDir()
	auditPath := filepath.Join(t.TempDir(), "audit.jsonl")
	p := startSupervisor(t, bin,
		[]string{"-listen", "127.0.0.1:0", "-tls-dir", tlsDir, "-workdir", workdir, "-audit-log", auditPath, "-kill-grace", "1s", "-shutdown-grace", "500ms"},
		[]string{"AGENTBOX_NAMESPACE=platform", "PATH=" + os.Getenv("PATH")})
	client := clientFor(t, p.addr, controlPlane, ca, sandboxID)

	t.Run("shell", func(t *testing.T) {
		c := openConsole(t, client, api.PTYRequest{Cols: 120, Rows: 40})
		// tr drops the N that a test run under nice adds to the state.
		out := c.expect(t, c.typeLine(t, "tty; stty size; echo TERM=$TERM; ps -o stat= -p $$ | tr -d N"), "TERM=xterm-256color")
		if !strings.Contains(out, "/dev/pts/") || !strings.Contains(out, "40 120\r\n") {
			t.Fatalf("tty and size: %q", out)
		}
		// The shell leads its session ("s" in its state).
		c.expect(t, len(out), "Ss\r\n")

		if err := c.p.Resize(context.Background(), 90, 33); err != nil {
			t.Fatal(err)
		}
		c.expect(t, c.typeLine(t, "stty size"), "33 90\r\n")

		// The input is typed once the shell says it is about to read (the
		// quotes keep the echoed command line from matching): typed
		// earlier, it can reach bash while readline is still restoring the
		// terminal, which may discard it.
		from := c.typeLine(t, "echo rea\"\"dy; read x; echo got:$x")
		c.expect(t, from, "ready\r\n")
		c.expect(t, c.typeLine(t, "hello there"), "got:hello there\r\n")

		// Ctrl-C reaches the foreground job through the line discipline.
		c.expect(t, c.typeLine(t, "sh -c 'echo sta\"\"rted; exec sleep 100'"), "started\r\n")
		if _, err := c.p.Write([]byte{3}); err != nil {
			t.Fatal(err)
		}
		c.expect(t, c.typeLine(t, "echo status=$?"), "status=130")

		c.typeLine(t, "exit 7")
		exit := c.exit(t)
		if exit.ExitCode != 7 || exit.Signal != "" || exit.Reason != "" {
			t.Fatalf("exit %+v, want code 7", exit)
		}
		t.Logf("shell session: %+v", exit)
	})

	t.Run("command", func(t *testing.T) {
		c := openConsole(t, client, api.PTYRequest{Command: []string{"sh", "-c", "tty; stty size; exit 3"}, Cwd: workdir})
		exit := c.exit(t)
		out := c.output()
		if exit.ExitCode != 3 || !strings.HasPrefix(out, "/dev/pts/") || !strings.HasSuffix(out, "24 80\r\n") {
			t.Fatalf("exit %+v, output %q", exit, out)
		}
		// Output printed just before the exit is all delivered.
		c = openConsole(t, client, api.PTYRequest{Command: []string{"sh", "-c", "head -c 300000 /dev/zero | tr '\\0' x; echo; echo END"}})
		if exit := c.exit(t); exit.ExitCode != 0 || !strings.HasSuffix(c.output(), "END\r\n") || strings.Count(c.output(), "x") != 300000 {
			t.Fatalf("exit %+v, %d bytes of output ending %q", exit, len(c.output()), c.output()[max(0, len(c.output())-20):])
		}
	})

	// A client that leaves ends the whole session: the shell, and a job
	// that job control put in a process group of its own. It may leave
	// with a close frame or by dropping the connection.
	for _, how := range []string{"close", "drop"} {
		t.Run("disconnect-"+how, func(t *testing.T) {
			var out string
			var leave func()
			line := "sleep 1000 & echo PI''DS $$ $!"
			if how == "close" {
				c := openConsole(t, client, api.PTYRequest{Command: []string{"bash", "--norc", "-i"}})
				c.typeLine(t, line)
				out = c.expect(t, len(c.expect(t, 0, "PIDS ")), "\r\n")
				leave = func() { c.p.Close() }
			} else {
				conn, read := rawSession(t, client, []string{"bash", "--norc", "-i"})
				if err := conn.Write(context.Background(), websocket.MessageBinary, []byte(line+"\r")); err != nil {
					t.Fatal(err)
				}
				out = read(0, "PIDS ")
				out = read(strings.Index(out, "PIDS "), "\r\n")
				leave = func() { conn.CloseNow() }
			}
			ids := pids(t, out, "PIDS")
			shell, job := ids[0], ids[1]
			if _, _, pgrp, ok := procStatus(job); !ok || pgrp == shell {
				t.Fatalf("job %d in group %d: job control did not give it its own", job, pgrp)
			}
			leave()
			took := waitSessionEmpty(t, shell, 5*time.Second)
			t.Logf("%s: session of shell %d and job %d gone %s after the client left", how, shell, job, took)
			if !gone(shell) || !gone(job) {
				t.Fatalf("shell %d or job %d survived", shell, job)
			}
		})
	}

	// A process that ignores SIGHUP is killed after the grace.
	t.Run("disconnect-ignores-hup", func(t *testing.T) {
		c := openConsole(t, client, api.PTYRequest{Command: []string{"sh", "-c", "trap '' HUP; echo PIDS $$; sleep 1000"}})
		shell := pids(t, c.expect(t, 0, "\r\n"), "PIDS")[0]
		start := time.Now()
		c.p.Close()
		took := waitSessionEmpty(t, shell, 6*time.Second)
		t.Logf("session ignoring SIGHUP gone %s after the client left (kill grace 1s)", took)
		if time.Since(start) < 900*time.Millisecond {
			t.Errorf("killed %s after the hangup, before the 1s grace", time.Since(start))
		}
	})

	t.Run("concurrent", func(t *testing.T) {
		const n = 4
		var wg sync.WaitGroup
		errs := make(chan error, n)
		for i := range n {
			wg.Add(1)
			go func() {
				defer wg.Done()
				ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
				defer cancel()
				pt, err := client.OpenPTY(ctx, api.PTYRequest{Command: []string{"sh", "-c", "read x; echo got-$x-$$; exit $x"}})
				if err != nil {
					errs <- err
					return
				}
				defer pt.Close()
				if _, err := fmt.Fprintf(pt, "%d\r", i); err != nil {
					errs <- err
					return
				}
				out, err := io.ReadAll(pt)
				if err != nil {
					errs <- fmt.Errorf("session %d: %w", i, err)
					return
				}
				exit, err := pt.Wait(ctx)
				switch {
				case err != nil:
					errs <- err
				case exit.ExitCode != i || !strings.Contains(string(out), fmt.Sprintf("got-%d-", i)):
					errs <- fmt.Errorf("session %d: exit %+v, output %q", i, exit, out)
				}
			}()
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			t.Error(err)
		}
	})

	t.Run("latency", func(t *testing.T) {
		c := openConsole(t, client, api.PTYRequest{Command: []string{"sh", "-c", "stty raw -echo; echo ready; exec cat"}})
		// Raw mode turns output processing off too: no \r before \n.
		c.expect(t, 0, "ready\n")
		const rounds = 200
		lat := make([]time.Duration, 0, rounds)
		for i := range rounds {
			b := byte('a' + i%26)
			from := len(c.output())
			start := time.Now()
			if _, err := c.p.Write([]byte{b}); err != nil {
				t.Fatal(err)
			}
			c.expect(t, from, string(b))
			lat = append(lat, time.Since(start))
		}
		slices.Sort(lat)
		t.Logf("PTY round trip over mTLS (keystroke to echo by cat, %d rounds): median %s, p90 %s, max %s",
			rounds, lat[rounds/2], lat[rounds*9/10], lat[rounds-1])
	})

	// SIGTERM to the supervisor hangs up the sessions, tells the client
	// why, and the supervisor still exits cleanly with the sessions
	// audited.
	c := openConsole(t, client, api.PTYRequest{Command: []string{"bash", "--norc", "-i"}})
	out := c.expect(t, c.typeLine(t, "echo PI''DS $$"), "PIDS ")
	shell := pids(t, c.expect(t, len(out), "\r\n"), "PIDS")[0]
	took := sigterm(t, p, 15*time.Second)
	exit := c.exit(t)
	t.Logf("supervisor exited %s after SIGTERM with a shell session open; session exit %+v", took, exit)
	if exit.Reason != api.PTYReasonShutdown || exit.Signal != "SIGHUP" {
		t.Fatalf("exit %+v, want a shutdown hangup", exit)
	}
	waitSessionEmpty(t, shell, 2*time.Second)

	var sessions []map[string]any
	for _, e := range readAudit(t, auditPath) {
		if e["tool"] == "pty_session" {
			sessions = append(sessions, e)
		}
	}
	// shell, command (2), disconnects (2), ignores-hup, concurrent (4),
	// latency, shutdown.
	if len(sessions) != 12 {
		t.Errorf("%d pty_session audit lines, want 12: %v", len(sessions), sessions)
	}
	for _, e := range sessions {
		if e["http_status"] != float64(101) || e["exit_code"] == nil || e["duration_ms"] == nil || len(asString(e["params_sha256"])) != 64 {
			t.Errorf("audit line %v", e)
		}
	}
	if first := sessions[0]; first["exit_code"] != float64(7) {
		t.Errorf("first session's audit line %v, want exit_code 7", first)
	}
}

// rawSession opens a session on a bare WebSocket, so that a test can
// drop the connection without a close frame as a client whose network
// vanished would. read waits until the output after byte from contains
// want and returns all of it.
func rawSession(t *testing.T, client *api.Client, command []string) (*websocket.Conn, func(from int, want string) string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	q := api.PTYRequest{Command: command}.Query()
	conn, _, err := websocket.Dial(ctx, client.BaseURL+api.PathPTY+"?"+q.Encode(), &websocket.DialOptions{
		HTTPClient: client.HTTPClient, Subprotocols: []string{api.PTYSubprotocol},
	})
	if err != nil {
		cancel()
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cancel()
		conn.CloseNow()
	})
	var out []byte
	return conn, func(from int, want string) string {
		t.Helper()
		for len(out) < from || !bytes.Contains(out[from:], []byte(want)) {
			_, data, err := conn.Read(ctx)
			if err != nil {
				t.Fatalf("reading for %q: %v; output %q", want, err, out)
			}
			out = append(out, data...)
		}
		return string(out)
	}
}
