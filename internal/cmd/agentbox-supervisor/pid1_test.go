package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	api "github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"
)

// procStatus reads a process's state, parent and process group; ok is
// false once the process is gone (reaped).
func procStatus(pid int) (state byte, ppid, pgrp int, ok bool) {
	data, err := os.ReadFile(filepath.Join("/proc", strconv.Itoa(pid), "stat"))
	if err != nil {
		return 0, 0, 0, false
	}
	i := bytes.LastIndexByte(data, ')')
	if i < 0 {
		return 0, 0, 0, false
	}
	f := strings.Fields(string(data[i+1:]))
	if len(f) < 3 {
		return 0, 0, 0, false
	}
	ppid, _ = strconv.Atoi(f[1])
	pgrp, _ = strconv.Atoi(f[2])
	return f[0][0], ppid, pgrp, true
}

// groupMembers lists the live (not zombie) processes in process group
// pgid.
func groupMembers(pgid int) []int {
	entries, _ := os.ReadDir("/proc")
	var out []int
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		if state, _, pgrp, ok := procStatus(pid); ok && pgrp == pgid && state != 'Z' {
			out = append(out, pid)
		}
	}
	return out
}

func waitForPIDFile(t *testing.T, path string) int {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		data, _ := os.ReadFile(path)
		if pid, err := strconv.Atoi(strings.TrimSpace(string(data))); err == nil && pid > 0 {
			return pid
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s was not written", filepath.Base(path))
		}
	}
}

// An orphaned grandchild is re-parented to the real supervisor (a child
// subreaper here, PID 1 in a pod) and reaped when it exits: no zombie is
// left holding its PID.
func TestSupervisorProcessReapsOrphans(t *testing.T) {
	bin := buildSupervisor(t)
	p := startSupervisor(t, bin,
		[]string{"-insecure-listen", "127.0.0.1:0", "-workdir", t.TempDir(), "-reap-orphans"},
		[]string{"PATH=" + os.Getenv("PATH")})
	client := api.NewClient("http://"+p.addr, nil)
	ctx := context.Background()

	var orphans []int
	for i := 0; i < 5; i++ {
		// The shell exits at once, leaving the sleep without a parent.
		res, err := client.RunCommand(ctx, api.CommandRequest{Command: []string{"sh", "-c", "sleep 0.7 </dev/null >/dev/null 2>&1 & echo $!"}})
		if err != nil {
			t.Fatal(err)
		}
		pid, err := strconv.Atoi(strings.TrimSpace(res.Stdout))
		if err != nil {
			t.Fatalf("orphan PID: %v (%+v)", err, res)
		}
		orphans = append(orphans, pid)
	}
	// While they run, they belong to the supervisor rather than to init:
	// the test would prove nothing if someone else were reaping them.
	for _, pid := range orphans {
		state, ppid, _, ok := procStatus(pid)
		if ok && ppid != p.cmd.Process.Pid {
			t.Fatalf("orphan %d (state %c) has parent %d, not the supervisor %d", pid, state, ppid, p.cmd.Process.Pid)
		}
	}
	for _, pid := range orphans {
		for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(20 * time.Millisecond) {
			state, ppid, _, ok := procStatus(pid)
			if !ok {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("orphan %d is still there (state %c, parent %d): not reaped", pid, state, ppid)
			}
		}
	}
	// The supervisor is still serving, and its own children's exit
	// statuses are still theirs.
	res, err := client.RunCommand(ctx, api.CommandRequest{Command: []string{"sh", "-c", "exit 9"}})
	if err != nil || res.ExitCode != 9 {
		t.Fatalf("command after reaping: %+v, %v", res, err)
	}
}

// SIGTERM to the supervisor: after the grace period, running commands get
// SIGTERM on their process groups, those that ignore it SIGKILL, the audit
// log is closed with whole lines, and the process exits 0.
func TestSupervisorProcessSIGTERMStopsCommands(t *testing.T) {
	bin := buildSupervisor(t)
	workdir := t.TempDir()
	auditPath := filepath.Join(t.TempDir(), "audit.jsonl")
	args := []string{"-insecure-listen", "127.0.0.1:0", "-workdir", workdir, "-audit-log", auditPath,
		"-shutdown-grace", "300ms", "-kill-grace", "1s"}
	python := ""
	if p, err := exec.LookPath("python3"); err == nil {
		// The interpreter itself: a version manager's shim needs
		// environment that commands do not get.
		if out, err := exec.Command(p, "-c", "import sys; print(sys.executable)").Output(); err == nil {
			python = strings.TrimSpace(string(out))
			args = append(args, "-python", python)
		}
	}
	p := startSupervisor(t, bin, args, []string{"PATH=" + os.Getenv("PATH")})
	client := api.NewClient("http://"+p.addr, nil)
	ctx := context.Background()

	if python != "" {
		res, err := client.RunPython(ctx, api.PythonRequest{Code: "print(6*7)"})
		if err != nil || res.Stdout != "42\n" {
			t.Fatalf("RunPython: %+v, %v", res, err)
		}
	} else {
		t.Log("python3 is not installed on this host; skipping the python_exec call")
	}

	type outcome struct {
		res *api.CommandResult
		err error
	}
	polite, stubborn := make(chan outcome, 1), make(chan outcome, 1)
	go func() {
		// Exits cleanly on SIGTERM; its background sleep is in its group.
		res, err := client.RunCommand(ctx, api.CommandRequest{Command: []string{"sh", "-c",
			"trap 'echo term > got-term; exit 7' TERM; echo $$ > pid-polite; sleep 100 & wait"}})
		polite <- outcome{res, err}
	}()
	go func() {
		// Ignores SIGTERM, and so does the sleep it starts.
		res, err := client.RunCommand(ctx, api.CommandRequest{Command: []string{"sh", "-c",
			"trap '' TERM; echo $$ > pid-stubborn; sleep 100"}})
		stubborn <- outcome{res, err}
	}()
	politePID := waitForPIDFile(t, filepath.Join(workdir, "pid-polite"))
	stubbornPID := waitForPIDFile(t, filepath.Join(workdir, "pid-stubborn"))
	// The polite shell writes its pid file before it starts its
	// background sleep; wait for the sleep, or SIGTERM could come before
	// the group has a member other than the shell.
	for deadline := time.Now().Add(10 * time.Second); len(groupMembers(politePID)) < 2 || len(groupMembers(stubbornPID)) < 1; time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("process groups before SIGTERM: %v, %v", groupMembers(politePID), groupMembers(stubbornPID))
		}
	}

	elapsed := sigterm(t, p, 20*time.Second)
	t.Logf("exited %s after SIGTERM (grace 300ms, kill grace 1s)", elapsed)
	if elapsed < time.Second {
		t.Errorf("exited after %s: the stubborn command was not given its kill grace", elapsed)
	}

	o := <-polite
	if o.err != nil || o.res.ExitCode != 7 {
		t.Fatalf("command that handles SIGTERM: %+v, %v; want its trap's exit 7", o.res, o.err)
	}
	if data, err := os.ReadFile(filepath.Join(workdir, "got-term")); err != nil || string(data) != "term\n" {
		t.Fatalf("the polite command's trap did not run: %q, %v", data, err)
	}
	o = <-stubborn
	t.Logf("command that ignores SIGTERM: %+v, %v", o.res, o.err)
	for _, pgid := range []int{politePID, stubbornPID} {
		waitGroupEmpty(t, pgid, 3*time.Second)
	}

	data, err := os.ReadFile(auditPath)
	if err != nil {
		t.Fatal(err)
	}
	if len(data) == 0 || data[len(data)-1] != '\n' {
		t.Fatalf("audit log's last line is incomplete: %q", data)
	}
	var entries []map[string]any
	sc := bufio.NewScanner(bytes.NewReader(data))
	for sc.Scan() {
		var e map[string]any
		if err := json.Unmarshal(sc.Bytes(), &e); err != nil {
			t.Fatalf("audit line %q: %v", sc.Text(), err)
		}
		entries = append(entries, e)
	}
	var sawPolite, sawStubborn, sawPython bool
	for _, e := range entries {
		if len(asString(e["params_sha256"])) != 64 || asString(e["time"]) == "" || e["duration_ms"] == nil || e["http_status"] == nil {
			t.Errorf("audit line lacks a field: %v", e)
		}
		switch {
		case e["tool"] == "run_command" && e["exit_code"] == float64(7):
			sawPolite = true
		case e["tool"] == "run_command" && e["signal"] == "SIGKILL":
			sawStubborn = true
		case e["tool"] == "python_exec" && e["exit_code"] == float64(0):
			sawPython = true
		}
	}
	if !sawPolite || !sawStubborn || (python != "" && !sawPython) {
		t.Errorf("audit log (polite %v, stubborn %v, python %v):\n%s", sawPolite, sawStubborn, sawPython, data)
	}
	if strings.Contains(string(data), "sleep") || strings.Contains(string(data), "6*7") {
		t.Errorf("the audit log holds parameters:\n%s", data)
	}
	var closed bool
	for _, l := range p.logLines() {
		if l["msg"] == "audit log closed" {
			closed = true
		}
	}
	if !closed {
		t.Error("no log line says the audit log was closed")
	}
}
