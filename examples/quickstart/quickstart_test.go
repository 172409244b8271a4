// Package quickstart_test runs quickstart.sh the way a newcomer does, on a
// machine that lacks one prerequisite at a time: it must stop at once, with
// one line naming what is missing and how to get it, before building
// anything.
package quickstart_test

import (
	"bytes"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// tools are what quickstart.sh's prerequisite check runs besides the
// prerequisites themselves.
var tools = []string{"bash", "env", "id", "sed", "sort", "head", "date", "awk", "dirname", "cat", "printf", "timeout", "mkdir", "rm"}

func TestMissingPrerequisiteStopsAtOnce(t *testing.T) {
	real := map[string]string{}
	for _, name := range append(tools, "go", "terraform", "kubectl", "apt-get", "dpkg-deb") {
		if p, err := exec.LookPath(name); err == nil {
			real[name] = p
		}
	}
	for _, name := range []string{"bash", "go", "id", "sed", "sort"} {
		if real[name] == "" {
			t.Skipf("%s is not on PATH", name)
		}
	}
	fake := map[string]string{
		"id":        "#!/bin/sh\necho 0\n",
		"terraform": "#!/bin/sh\necho Terraform v1.11.4\n",
		"kubectl":   "#!/bin/sh\nexit 0\n",
		"apt-get":   "#!/bin/sh\n[ \"$1\" = indextargets ] && echo /var/lib/apt/lists/x_Packages\nexit 0\n",
		"dpkg-deb":  "#!/bin/sh\nexit 0\n",
	}
	cases := []struct {
		name    string
		change  map[string]string // file name → script; "" removes it
		missing string            // what the line must name
	}{
		{"not root", map[string]string{"id": "#!/bin/sh\necho 1000\n"}, "root is needed"},
		{"go too old", map[string]string{"go": "#!/bin/sh\n[ \"$1 $2\" = \"env GOVERSION\" ] && echo go1.21.5\n"}, "Go 1."},
		{"no terraform", map[string]string{"terraform": ""}, "terraform is needed"},
		{"no kubectl", map[string]string{"kubectl": ""}, "kubectl is needed"},
		{"no apt", map[string]string{"apt-get": ""}, "apt is needed"},
		{"no apt lists and no apt access", map[string]string{"apt-get": "#!/bin/sh\nexit 100\n"}, "apt access is needed"},
	}
	repo, err := filepath.Abs("../..")
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			// A copy of the script in a repository of its own, so that
			// nothing it might build lands in the real one.
			root := t.TempDir()
			if err := os.MkdirAll(filepath.Join(root, "examples", "quickstart"), 0o755); err != nil {
				t.Fatal(err)
			}
			for _, f := range []string{"go.mod", "examples/quickstart/quickstart.sh"} {
				b, err := os.ReadFile(filepath.Join(repo, f))
				if err != nil {
					t.Fatal(err)
				}
				if err := os.WriteFile(filepath.Join(root, f), b, 0o755); err != nil {
					t.Fatal(err)
				}
			}
			bin := t.TempDir()
			for _, name := range append(tools, "go") {
				if real[name] != "" {
					if err := os.Symlink(real[name], filepath.Join(bin, name)); err != nil {
						t.Fatal(err)
					}
				}
			}
			scripts := map[string]string{}
			for k, v := range fake {
				scripts[k] = v
			}
			for k, v := range tc.change {
				scripts[k] = v
			}
			for name, script := range scripts {
				os.Remove(filepath.Join(bin, name))
				if script == "" {
					continue
				}
				if err := os.WriteFile(filepath.Join(bin, name), []byte(script), 0o755); err != nil {
					t.Fatal(err)
				}
			}
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			cmd := exec.CommandContext(ctx, real["bash"], filepath.Join(root, "examples", "quickstart", "quickstart.sh"), "up")
			cmd.Env = []string{"PATH=" + bin, "HOME=" + t.TempDir()}
			var stdout, stderr bytes.Buffer
			cmd.Stdout, cmd.Stderr = &stdout, &stderr
			start := time.Now()
			err := cmd.Run()
			if err == nil {
				t.Fatalf("quickstart.sh went on without %s:\n%s", tc.name, stdout.String())
			}
			lines := strings.Split(strings.TrimSpace(stderr.String()), "\n")
			if len(lines) != 1 || !strings.HasPrefix(lines[0], "quickstart: ") || !strings.Contains(lines[0], tc.missing) {
				t.Errorf("stderr is not one line naming %q:\n%s", tc.missing, stderr.String())
			}
			if _, err := os.Stat(filepath.Join(root, ".build")); err == nil {
				t.Error("quickstart.sh created .build before its prerequisites were checked")
			}
			t.Logf("%s: %q in %s", tc.name, lines[0], time.Since(start).Round(time.Millisecond))
		})
	}
}
