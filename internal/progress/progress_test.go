package progress

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"
)

type lines struct {
	mu sync.Mutex
	l  []string
}

func (l *lines) logf(format string, args ...any) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.l = append(l.l, fmt.Sprintf(format, args...))
}

func (l *lines) all() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]string(nil), l.l...)
}

// A real go build of a small module, reporting every millisecond: the
// binary is built, and the reports name the step and how far along it is.
func TestGoBuildReportsAndBuilds(t *testing.T) {
	dir := t.TempDir()
	write := func(name, content string) {
		t.Helper()
		if err := os.MkdirAll(filepath.Dir(filepath.Join(dir, name)), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, name), []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	write("go.mod", "module example.test/hello\n\ngo 1.22\n")
	write("greet/greet.go", "package greet\n\nfunc Hello() string { return \"hello\" }\n")
	write("cmd/hello/main.go", "package main\n\nimport (\n\t\"fmt\"\n\n\t\"example.test/hello/greet\"\n)\n\nfunc main() { fmt.Println(greet.Hello()) }\n")
	var got lines
	c := Cmd{Dir: dir, Env: append(os.Environ(), "GOFLAGS=", "GOWORK=off"), Logf: got.logf, Label: "hello", Interval: time.Millisecond}
	out := filepath.Join(dir, "bin") + string(filepath.Separator)
	if err := c.GoBuild(context.Background(), GoBuild{Out: out, Packages: []string{"./cmd/hello"}}); err != nil {
		t.Fatal(err)
	}
	if fi, err := os.Stat(filepath.Join(dir, "bin", "hello")); err != nil || fi.Size() == 0 {
		t.Fatalf("binary not built: %v", err)
	}
	reports := got.all()
	if len(reports) == 0 {
		t.Fatal("no report in a build that ran for more than a millisecond")
	}
	for _, r := range reports {
		if !strings.HasPrefix(r, "hello: ") || !strings.HasSuffix(r, ")") {
			t.Errorf("report %q does not name the label and the elapsed time", r)
		}
		if !strings.Contains(r, "compiling, ") && !strings.Contains(r, "linking hello") {
			t.Errorf("report %q names no step", r)
		}
	}
}

func TestBuildCountFollowsGoBuildOutput(t *testing.T) {
	c := newBuildCount([]string{"example.test/cmd/a", "example.test/cmd/b/v2"})
	if got, want := c.status(""), "compiling, 0 packages"; got != want {
		t.Errorf("before go list answers: %q, want %q", got, want)
	}
	c.total.Store(4)
	if got, want := c.status(""), "compiling, 0/4 packages"; got != want {
		t.Errorf("start: %q, want %q", got, want)
	}
	steps := []struct{ line, want string }{
		{"go: downloading example.test/dep v1.0.0", "downloading modules (last example.test/dep v1.0.0)"},
		{"example.test/lib", "compiling, 1/4 packages (last example.test/lib)"},
		{"example.test/cmd/a", "compiling, 2/4 packages (last example.test/cmd/a)"},
		{"# example.test/lib", ""},
		{"example.test/cmd/b/v2", "linking a b (3 packages compiled)"},
	}
	for _, s := range steps {
		got, ok := c.see(s.line)
		if s.want == "" {
			if ok {
				t.Errorf("%q changed the status to %q", s.line, got)
			}
			continue
		}
		if got != s.want {
			t.Errorf("after %q: %q, want %q", s.line, got, s.want)
		}
	}
}

func TestDefaultBinaryName(t *testing.T) {
	for pkg, want := range map[string]string{
		"go.etcd.io/etcd/server/v3":                  "server",
		"k8s.io/kubernetes/cmd/kube-apiserver":       "kube-apiserver",
		"gvisor.dev/gvisor/runsc":                    "runsc",
		"github.com/versity/versitygw/cmd/versitygw": "versitygw",
		"example.test/v1":                            "v1",
		"./internal/cmd/agentbox":                    "agentbox",
	} {
		if got := DefaultBinaryName(pkg); got != want {
			t.Errorf("DefaultBinaryName(%q) = %q, want %q", pkg, got, want)
		}
	}
}

// A failing command's error names it and carries the end of its output.
func TestRunFailureCarriesTheOutput(t *testing.T) {
	var got lines
	err := Cmd{Logf: got.logf, Label: "fail"}.Run(context.Background(), "running", nil, "sh", "-c", "for i in $(seq 1 50); do echo line $i; done; exit 3")
	var e *Error
	if !errors.As(err, &e) {
		t.Fatalf("error %v is not an *Error", err)
	}
	if !strings.Contains(e.Output, "line 50") || strings.Contains(e.Output, "line 10\n") {
		t.Errorf("output is not the last 40 lines: %q", e.Output)
	}
	if !strings.Contains(err.Error(), "exit status 3") {
		t.Errorf("error %q does not say how the command ended", err)
	}
}

// Reports stop when the step ends.
func TestStepStops(t *testing.T) {
	var got lines
	s := Start(got.logf, "wait", "pods pending", time.Millisecond)
	time.Sleep(20 * time.Millisecond)
	s.Set("pods running")
	s.Stop()
	n := len(got.all())
	time.Sleep(20 * time.Millisecond)
	if len(got.all()) != n {
		t.Error("reports went on after Stop")
	}
	if n == 0 || !strings.HasPrefix(got.all()[0], "wait: pods pending (") {
		t.Errorf("first report %v does not say the step", got.all())
	}
}
