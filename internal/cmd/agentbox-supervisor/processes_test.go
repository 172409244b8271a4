package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	api "github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"
)

// waitGroupEmpty fails unless no live process is left in group pgid
// within d, killing any that are so they do not outlive the test.
func waitGroupEmpty(t *testing.T, pgid int, d time.Duration) {
	t.Helper()
	for deadline := time.Now().Add(d); ; time.Sleep(20 * time.Millisecond) {
		members := groupMembers(pgid)
		if len(members) == 0 {
			return
		}
		if time.Now().After(deadline) {
			for _, m := range members {
				_ = syscall.Kill(m, syscall.SIGKILL)
			}
			t.Fatalf("process group %d still has %v", pgid, members)
		}
	}
}

// sigterm sends SIGTERM to the supervisor and waits for it to exit with
// status 0, returning how long that took.
func sigterm(t *testing.T, p *supervisorProcess, within time.Duration) time.Duration {
	t.Helper()
	start := time.Now()
	if err := p.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-p.done:
		if err != nil {
			t.Fatalf("supervisor exit: %v, want status 0", err)
		}
	case <-time.After(within):
		t.Fatalf("supervisor did not exit within %s of SIGTERM", within)
	}
	return time.Since(start)
}

// sleepers counts the members of group pgid that are running sleep.
func sleepers(pgid int) int {
	n := 0
	for _, pid := range groupMembers(pgid) {
		if comm, _ := os.ReadFile(filepath.Join("/proc", strconv.Itoa(pid), "comm")); strings.TrimSpace(string(comm)) == "sleep" {
			n++
		}
	}
	return n
}

func waitFor(t *testing.T, what string, d time.Duration, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(d); !cond(); time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
	}
}

// Background processes through the real binary: they outlive the call
// that started them, can be listed and read, are bounded in number, are
// stopped with their whole process group by DELETE, and the supervisor's
// SIGTERM stops those left, members that ignore SIGTERM included.
func TestSupervisorProcessBackgroundProcesses(t *testing.T) {
	bin := buildSupervisor(t)
	workdir := t.TempDir()
	auditPath := filepath.Join(t.TempDir(), "audit.jsonl")
	p := startSupervisor(t, bin, []string{"-insecure-listen", "127.0.0.1:0", "-workdir", workdir, "-audit-log", auditPath,
		"-max-processes", "2", "-kill-grace", "1s", "-shutdown-grace", "300ms"},
		[]string{"PATH=" + os.Getenv("PATH")})
	client := api.NewClient("http://"+p.addr, nil)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()

	ticker, err := client.StartProcess(ctx, api.ProcessRequest{Command: []string{"sh", "-c",
		"echo started; sleep 100 & echo $! > ticker-child; while :; do echo tick; sleep 0.1; done"}})
	if err != nil {
		t.Fatal(err)
	}
	stubborn, err := client.StartProcess(ctx, api.ProcessRequest{Command: []string{"sh", "-c", "trap '' TERM; echo ignoring; sleep 100"}})
	if err != nil {
		t.Fatal(err)
	}
	if !ticker.Running || ticker.PID <= 0 || ticker.ID == "" || ticker.ID == stubborn.ID || ticker.StartedAt.IsZero() {
		t.Fatalf("started %+v and %+v", ticker, stubborn)
	}
	// Its own process group, child of the supervisor.
	if _, ppid, pgrp, ok := procStatus(ticker.PID); !ok || pgrp != ticker.PID || ppid != p.cmd.Process.Pid {
		t.Fatalf("process %d: parent %d, group %d", ticker.PID, ppid, pgrp)
	}
	childPID := waitForPIDFile(t, filepath.Join(workdir, "ticker-child"))

	list, err := client.ListProcesses(ctx)
	if err != nil || len(list) != 2 || list[0].ID != ticker.ID || list[1].ID != stubborn.ID || !list[0].Running ||
		!slices.Equal(list[1].Command, []string{"sh", "-c", "trap '' TERM; echo ignoring; sleep 100"}) || list[0].Stdout != "" {
		t.Fatalf("ListProcesses = %+v, %v", list, err)
	}

	waitFor(t, "ticks", 10*time.Second, func() bool {
		info, err := client.GetProcess(ctx, ticker.ID)
		return err == nil && strings.HasPrefix(info.Stdout, "started\ntick\ntick\n")
	})

	// The limit: both places are taken by running processes.
	if _, err := client.StartProcess(ctx, api.ProcessRequest{Command: []string{"true"}}); api.CodeOf(err) != api.CodeResourceExhausted {
		t.Fatalf("third process: %v, want resource_exhausted", err)
	}

	start := time.Now()
	killed, err := client.KillProcess(ctx, ticker.ID)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("ticker stopped in %s: %+v (stdout %d bytes)", time.Since(start), killed.Exit, len(killed.Stdout))
	if killed.Running || killed.Exit == nil || killed.Exit.Signal != "SIGTERM" || !strings.Contains(killed.Stdout, "tick") {
		t.Fatalf("KillProcess = %+v", killed)
	}
	waitGroupEmpty(t, ticker.PID, 2*time.Second)
	if !gone(childPID) {
		t.Fatalf("the ticker's background sleep %d survived", childPID)
	}
	if _, err := client.GetProcess(ctx, ticker.ID); api.CodeOf(err) != api.CodeNotFound {
		t.Fatalf("GetProcess after DELETE: %v", err)
	}

	// An exited process keeps its place until a new one needs it.
	quick, err := client.StartProcess(ctx, api.ProcessRequest{Command: []string{"sh", "-c", "echo bye >&2; exit 3"}})
	if err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the quick process to exit", 10*time.Second, func() bool {
		info, err := client.GetProcess(ctx, quick.ID)
		return err == nil && !info.Running && info.Exit != nil && info.Exit.ExitCode == 3 && info.Stderr == "bye\n"
	})
	// Leader ignores SIGTERM, so shutdown has to kill it.
	leaderIgnores, err := client.StartProcess(ctx, api.ProcessRequest{Command: []string{"sh", "-c", "trap '' TERM; sleep 100 & sleep 100"}})
	if err != nil {
		t.Fatalf("start in the place of an exited process: %v", err)
	}
	if list, err := client.ListProcesses(ctx); err != nil || len(list) != 2 || list[1].ID != leaderIgnores.ID {
		t.Fatalf("after eviction: %+v, %v", list, err)
	}

	waitFor(t, "the stubborn process's trap", 10*time.Second, func() bool {
		info, err := client.GetProcess(ctx, stubborn.ID)
		return err == nil && info.Stdout == "ignoring\n"
	})
	start = time.Now()
	killed, err = client.KillProcess(ctx, stubborn.ID)
	took := time.Since(start)
	if err != nil || killed.Exit == nil || killed.Exit.Signal != "SIGKILL" || killed.Stdout != "ignoring\n" {
		t.Fatalf("KillProcess(stubborn) = %+v, %v", killed, err)
	}
	t.Logf("process ignoring SIGTERM killed after %s (kill grace 1s)", took)
	if took < time.Second {
		t.Errorf("killed after %s, before the 1s grace", took)
	}
	waitGroupEmpty(t, stubborn.PID, 2*time.Second)

	// Leader dies of SIGTERM, a member ignores it.
	memberIgnores, err := client.StartProcess(ctx, api.ProcessRequest{Command: []string{"sh", "-c", "(trap '' TERM; exec sleep 100) & sleep 100"}})
	if err != nil {
		t.Fatal(err)
	}
	// A sleep runs only once the trap before it is set.
	waitFor(t, "both groups' sleeps", 10*time.Second, func() bool {
		return sleepers(leaderIgnores.PID) == 2 && sleepers(memberIgnores.PID) == 2
	})

	took = sigterm(t, p, 20*time.Second)
	t.Logf("supervisor exited %s after SIGTERM with two background processes (grace 300ms, kill grace 1s)", took)
	waitGroupEmpty(t, leaderIgnores.PID, 2*time.Second)
	waitGroupEmpty(t, memberIgnores.PID, 2*time.Second)

	tools := map[string]int{}
	for _, e := range readAudit(t, auditPath) {
		tools[asString(e["tool"])]++
		if len(asString(e["params_sha256"])) != 64 {
			t.Errorf("audit line %v", e)
		}
	}
	for tool, n := range map[string]int{"start_process": 6, "list_processes": 2, "kill_process": 2} {
		if tools[tool] != n {
			t.Errorf("audit: %d %s lines, want %d (%v)", tools[tool], tool, n, tools)
		}
	}
	if tools["get_process"] < 3 {
		t.Errorf("audit: %v", tools)
	}
}

func readAudit(t *testing.T, path string) []map[string]any {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var out []map[string]any
	sc := bufio.NewScanner(bytes.NewReader(data))
	for sc.Scan() {
		var e map[string]any
		if err := json.Unmarshal(sc.Bytes(), &e); err != nil {
			t.Fatalf("audit line %q: %v", sc.Text(), err)
		}
		out = append(out, e)
	}
	return out
}

// The stream through the real binary and its HTTP server: lines arrive as
// they are printed, and a client that leaves gets the group killed.
func TestSupervisorProcessCommandStream(t *testing.T) {
	bin := buildSupervisor(t)
	p := startSupervisor(t, bin, []string{"-insecure-listen", "127.0.0.1:0", "-workdir", t.TempDir()},
		[]string{"PATH=" + os.Getenv("PATH")})
	client := api.NewClient("http://"+p.addr, nil)
	ctx := context.Background()

	start := time.Now()
	var first time.Duration
	var data strings.Builder
	res, err := client.RunCommandStream(ctx, api.CommandRequest{Command: []string{"sh", "-c", "for i in 1 2 3; do echo line $i; sleep 0.5; done"}},
		func(ev api.CommandEvent) error {
			if first == 0 {
				first = time.Since(start)
			}
			data.WriteString(ev.Data)
			return nil
		})
	total := time.Since(start)
	if err != nil || res.ExitCode != 0 || data.String() != "line 1\nline 2\nline 3\n" {
		t.Fatalf("stream: %+v, %v, %q", res, err, data.String())
	}
	t.Logf("first line after %s of %s", first, total)
	if first > 500*time.Millisecond || total < 1500*time.Millisecond {
		t.Fatalf("first line after %s of %s: not streamed", first, total)
	}

	stop := errors.New("stop")
	var pgid int
	_, err = client.RunCommandStream(ctx, api.CommandRequest{Command: []string{"sh", "-c", "sleep 100 & echo $$; sleep 100"}, TimeoutSeconds: 300},
		func(ev api.CommandEvent) error {
			pgid, _ = strconv.Atoi(strings.TrimSpace(ev.Data))
			waitFor(t, "both sleeps", 5*time.Second, func() bool { return sleepers(pgid) == 2 })
			return stop
		})
	if !errors.Is(err, stop) || pgid == 0 {
		t.Fatalf("RunCommandStream = %v (pgid %d)", err, pgid)
	}
	left := time.Now()
	waitGroupEmpty(t, pgid, 3*time.Second)
	t.Logf("process group %d gone %s after the client left", pgid, time.Since(left))
}
