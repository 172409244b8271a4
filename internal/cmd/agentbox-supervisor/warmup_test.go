package main

import (
	"context"
	"io"
	"os"
	"os/exec"
	"testing"
	"time"

	"github.com/agentbox/terraform-provider-agentbox/internal/pki"
	api "github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"
)

// TestWarmUpBeforeListening runs the real binary: it warms up before it
// listens (the sandbox counts as ready once the port accepts), and a
// warm-up that fails (no `true` in the commands' PATH) is logged and the
// supervisor serves all the same; -warm-up=false skips it.
func TestWarmUpBeforeListening(t *testing.T) {
	bin := buildSupervisor(t)
	ca, err := pki.NewCA("agentbox-test-ca")
	if err != nil {
		t.Fatal(err)
	}
	sandboxID := pki.SandboxID("", "agents", "sb-1").String()
	tlsDir := writeTLSDir(t, ca, issue(t, ca, sandboxID, pki.UsageServer))
	controlPlane := issue(t, ca, pki.ControlPlaneID("", "platform").String(), pki.UsageClient)
	// By its path: in one case the commands' PATH has nothing.
	echo, err := exec.LookPath("echo")
	if err != nil {
		t.Skip(err)
	}

	for _, tc := range []struct {
		name string
		args []string
		path string // the commands' PATH (the supervisor passes its whole environment)
		want string // the warm-up's log message before "listening"; "" for none
	}{
		{"warm", nil, os.Getenv("PATH"), "warmed up"},
		{"no true in PATH", nil, t.TempDir(), "warm-up command failed; the first command will pay for the start"},
		{"off", []string{"-warm-up=false"}, os.Getenv("PATH"), ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			workdir := t.TempDir()
			p := startSupervisor(t, bin,
				append([]string{"-listen", "127.0.0.1:0", "-tls-dir", tlsDir, "-workdir", workdir, "-pass-env", "*"}, tc.args...),
				[]string{"AGENTBOX_NAMESPACE=platform", "PATH=" + tc.path})
			var before []string
			for _, l := range p.logLines() {
				msg, _ := l["msg"].(string)
				if msg == "listening" {
					break
				}
				before = append(before, msg)
			}
			found := false
			for _, msg := range before {
				switch msg {
				case "warmed up", "warm-up command failed; the first command will pay for the start":
					if msg != tc.want {
						t.Errorf("logged %q before listening; want %q", msg, tc.want)
					}
					found = true
				}
			}
			if tc.want != "" && !found {
				t.Errorf("no %q before listening; logged %q", tc.want, before)
			}

			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			client := clientFor(t, p.addr, controlPlane, ca, sandboxID)
			res, err := client.RunCommand(ctx, api.CommandRequest{Command: []string{echo, "served"}})
			if err != nil || res.ExitCode != 0 || res.Stdout != "served\n" {
				t.Fatalf("echo after the start: %+v, %v", res, err)
			}
		})
	}
}

func TestParseWarmUpOptions(t *testing.T) {
	getenv := func(string) string { return "" }
	o, err := parseOptions(nil, getenv, io.Discard)
	if err != nil || !o.warmUp || o.idleTrim != 5*time.Second {
		t.Fatalf("defaults: %+v, %v; want the warm-up on and a 5s idle trim", o, err)
	}
	env := map[string]string{"AGENTBOX_WARM_UP": "false", "AGENTBOX_IDLE_TRIM": "0"}
	o, err = parseOptions(nil, func(k string) string { return env[k] }, io.Discard)
	if err != nil || o.warmUp || o.idleTrim != 0 || idleTrim(o.idleTrim) >= 0 {
		t.Fatalf("from the environment: %+v, %v; want both off", o, err)
	}
	for _, bad := range [][]string{{"-warm-up", "maybe"}, {"-idle-trim", "-1s"}, {"-idle-trim", "soon"}} {
		if _, err := parseOptions(bad, getenv, io.Discard); err == nil {
			t.Errorf("%q accepted", bad)
		}
	}
}
