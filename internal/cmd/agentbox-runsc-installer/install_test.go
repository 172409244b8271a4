package main

import (
	"bytes"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

// fakeImage makes a folder standing in for the image's /opt/agentbox/runsc:
// runsc is a shell script printing a version, so the check really runs it.
func fakeImage(t *testing.T, runsc string) string {
	t.Helper()
	if _, err := exec.LookPath("sh"); err != nil {
		t.Skip("no sh to run the stand-in runsc with")
	}
	dir := t.TempDir()
	write(t, filepath.Join(dir, "runsc"), runsc, 0o755)
	write(t, filepath.Join(dir, "containerd-shim-runsc-v1"), "#!/bin/sh\necho shim\n", 0o755)
	return dir
}

const goodRunsc = "#!/bin/sh\necho runsc version fake-1\necho spec: 1.2.1\n"

func write(t *testing.T, p, content string, mode os.FileMode) {
	t.Helper()
	if err := os.WriteFile(p, []byte(content), mode); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(p, mode); err != nil {
		t.Fatal(err)
	}
}

func install(t *testing.T, from, to string) (string, error) {
	t.Helper()
	var out bytes.Buffer
	err := Install(context.Background(), from, to, &out)
	return out.String(), err
}

func assertInstalled(t *testing.T, from, to string) {
	t.Helper()
	for _, f := range Binaries {
		want, _ := os.ReadFile(filepath.Join(from, f))
		got, err := os.ReadFile(filepath.Join(to, f))
		if err != nil || !bytes.Equal(got, want) {
			t.Errorf("%s on the host: %q %v, want the image's", f, got, err)
		}
		if fi, err := os.Stat(filepath.Join(to, f)); err != nil || fi.Mode().Perm() != 0o755 {
			t.Errorf("%s: %v %v, want mode 0755", f, fi, err)
		}
	}
	entries, _ := os.ReadDir(to)
	var names []string
	for _, e := range entries {
		names = append(names, e.Name())
	}
	if len(names) != len(Binaries) {
		t.Errorf("host folder holds %v, want only %v (no temporary files left)", names, Binaries)
	}
}

func TestInstallCopiesAndChecks(t *testing.T) {
	from, to := fakeImage(t, goodRunsc), t.TempDir()
	out, err := install(t, from, to)
	if err != nil {
		t.Fatalf("install: %v\n%s", err, out)
	}
	for _, want := range []string{"installed " + to + "/runsc", "installed " + to + "/containerd-shim-runsc-v1", "runsc version fake-1"} {
		if !strings.Contains(out, want) {
			t.Errorf("output lacks %q:\n%s", want, out)
		}
	}
	assertInstalled(t, from, to)
}

func TestInstallIdempotent(t *testing.T) {
	from, to := fakeImage(t, goodRunsc), t.TempDir()
	if out, err := install(t, from, to); err != nil {
		t.Fatalf("first install: %v\n%s", err, out)
	}
	before := map[string]uint64{}
	for _, f := range Binaries {
		before[f] = inode(t, filepath.Join(to, f))
	}
	out, err := install(t, from, to)
	if err != nil || strings.Contains(out, "installed") || strings.Count(out, "is up to date") != len(Binaries) {
		t.Fatalf("second install: %v\n%s", err, out)
	}
	for _, f := range Binaries {
		if got := inode(t, filepath.Join(to, f)); got != before[f] {
			t.Errorf("%s was rewritten (inode %d, was %d)", f, got, before[f])
		}
	}
	assertInstalled(t, from, to)
}

// TestInstallReplacesAtomically: an older runsc on the host is replaced by
// a rename, so a process holding the old file open keeps reading the old
// content, as a running runsc or shim would.
func TestInstallReplacesAtomically(t *testing.T) {
	from, to := fakeImage(t, goodRunsc), t.TempDir()
	old := "#!/bin/sh\necho runsc version old\n"
	write(t, filepath.Join(to, "runsc"), old, 0o755)
	oldInode := inode(t, filepath.Join(to, "runsc"))
	held, err := os.Open(filepath.Join(to, "runsc"))
	if err != nil {
		t.Fatal(err)
	}
	defer held.Close()

	if out, err := install(t, from, to); err != nil || !strings.Contains(out, "installed "+to+"/runsc") {
		t.Fatalf("install over an old runsc: %v\n%s", err, out)
	}
	assertInstalled(t, from, to)
	if inode(t, filepath.Join(to, "runsc")) == oldInode {
		t.Error("runsc was rewritten in place, not replaced by a rename")
	}
	var b bytes.Buffer
	if _, err := b.ReadFrom(held); err != nil || b.String() != old {
		t.Errorf("the open old file reads %q %v, want its old content", b.String(), err)
	}

	// Same content but the wrong mode is not up to date.
	must(t, os.Chmod(filepath.Join(to, "runsc"), 0o644))
	if out, err := install(t, from, to); err != nil || !strings.Contains(out, "installed "+to+"/runsc") {
		t.Fatalf("install over a non-executable runsc: %v\n%s", err, out)
	}
	assertInstalled(t, from, to)
}

func TestInstallFailsOnBrokenRunsc(t *testing.T) {
	for name, runsc := range map[string]string{
		"exits non-zero": "#!/bin/sh\necho cannot run >&2\nexit 3\n",
		"not runsc":      "#!/bin/sh\necho hello\n",
	} {
		t.Run(name, func(t *testing.T) {
			from, to := fakeImage(t, runsc), t.TempDir()
			out, err := install(t, from, to)
			if err == nil || !strings.Contains(err.Error(), filepath.Join(to, "runsc")) {
				t.Fatalf("install of a broken runsc: %v\n%s", err, out)
			}
			t.Logf("error: %v", err)
		})
	}
}

func TestInstallClearErrors(t *testing.T) {
	from := fakeImage(t, goodRunsc)
	if _, err := install(t, from, filepath.Join(t.TempDir(), "missing")); err == nil || !strings.Contains(err.Error(), "host folder") {
		t.Errorf("missing host folder: %v", err)
	}
	empty := t.TempDir()
	if _, err := install(t, empty, t.TempDir()); err == nil || !strings.Contains(err.Error(), "installer image lacks") {
		t.Errorf("image without the binaries: %v", err)
	}
	must(t, os.Chmod(filepath.Join(from, "runsc"), 0o644))
	if _, err := install(t, from, t.TempDir()); err == nil || !strings.Contains(err.Error(), "not an executable") {
		t.Errorf("non-executable runsc in the image: %v", err)
	}
}

// TestWaitUntilSIGTERM runs the built command: wait must keep running and
// exit 0 on SIGTERM, as kubelet stops the DaemonSet's pod.
func TestWaitUntilSIGTERM(t *testing.T) {
	bin := filepath.Join(t.TempDir(), "agentbox-runsc-installer")
	if out, err := exec.Command("go", "build", "-o", bin, ".").CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	cmd := exec.Command(bin, "wait")
	var out bytes.Buffer
	cmd.Stdout = &out
	must(t, cmd.Start())
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	select {
	case err := <-done:
		t.Fatalf("wait returned before SIGTERM: %v", err)
	case <-time.After(500 * time.Millisecond):
	}
	must(t, cmd.Process.Signal(syscall.SIGTERM))
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("wait after SIGTERM: %v\n%s", err, out.String())
		}
	case <-time.After(10 * time.Second):
		_ = cmd.Process.Kill()
		t.Fatal("wait did not stop on SIGTERM")
	}
}

func TestUsage(t *testing.T) {
	var out, errOut bytes.Buffer
	for _, args := range [][]string{nil, {"install"}, {"bogus"}} {
		if code := run(args, &out, &errOut); code != 2 {
			t.Errorf("%q: exit %d, want 2", args, code)
		}
	}
}

func inode(t *testing.T, p string) uint64 {
	t.Helper()
	fi, err := os.Stat(p)
	if err != nil {
		t.Fatal(err)
	}
	return fi.Sys().(*syscall.Stat_t).Ino
}

func must(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}
