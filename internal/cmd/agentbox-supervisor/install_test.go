package main

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// TestSupervisorProcessInstall runs -install as a sandbox pod's init
// container does: the real binary copies itself into a directory, the
// copy is executable by everyone and runs, nothing else is left there, and
// a second install (a restarted init container) replaces the first.
func TestSupervisorProcessInstall(t *testing.T) {
	bin := buildSupervisor(t)
	dir := t.TempDir()
	for range 2 {
		out, err := exec.Command(bin, "-install", dir).CombinedOutput()
		if err != nil {
			t.Fatalf("-install %s: %v\n%s", dir, err, out)
		}
	}
	installed := filepath.Join(dir, "agentbox-supervisor")
	st, err := os.Stat(installed)
	if err != nil {
		t.Fatal(err)
	}
	if st.Mode().Perm() != 0o755 {
		t.Errorf("installed mode %v, want 0755", st.Mode().Perm())
	}
	orig, err := os.Stat(bin)
	if err != nil {
		t.Fatal(err)
	}
	if st.Size() != orig.Size() {
		t.Errorf("installed %d bytes, the binary has %d", st.Size(), orig.Size())
	}
	entries, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	if len(entries) != 1 {
		var names []string
		for _, e := range entries {
			names = append(names, e.Name())
		}
		t.Errorf("the directory holds %q, want only agentbox-supervisor", names)
	}
	out, err := exec.Command(installed, "-version").CombinedOutput()
	if err != nil || strings.TrimSpace(string(out)) != "test-build" {
		t.Errorf("the installed copy's -version: %v %q, want test-build", err, out)
	}

	// A directory that is not there, not a directory or not writable is
	// an error that names it, and a non-zero exit.
	for what, target := range map[string]string{"a missing directory": filepath.Join(dir, "missing"), "a file": installed} {
		out, err = exec.Command(bin, "-install", target).CombinedOutput()
		if ee, ok := err.(*exec.ExitError); !ok || ee.ExitCode() == 0 || !strings.Contains(string(out), target) {
			t.Errorf("-install into %s: %v %q, want a failure naming %s", what, err, out, target)
		}
	}
	if os.Geteuid() != 0 {
		ro := t.TempDir()
		if err := os.Chmod(ro, 0o555); err != nil {
			t.Fatal(err)
		}
		out, err = exec.Command(bin, "-install", ro).CombinedOutput()
		if ee, ok := err.(*exec.ExitError); !ok || ee.ExitCode() == 0 || !strings.Contains(string(out), ro) {
			t.Errorf("-install into a read-only directory: %v %q, want a failure naming it", err, out)
		}
	}
}
