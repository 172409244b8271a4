// Package progress keeps long build steps from going quiet. A cold build of
// the test cluster compiles for many minutes at a time; without a line now
// and then nobody can tell a slow build from a hung one. Every step run
// through this package prints what it is doing (which component, which
// step, how far along, how long so far) at a fixed interval until it ends.
package progress

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"io"
	"os/exec"
	"path"
	"regexp"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// Interval is how often a running step reports. The promise made to people
// watching a build is a line at least every 15 seconds.
const Interval = 10 * time.Second

// Logf prints one line of progress.
type Logf func(format string, args ...any)

// Step is a long step being watched. Its status is what the next report
// says besides the elapsed time.
type Step struct {
	label string
	start time.Time
	logf  Logf

	mu     sync.Mutex
	status string
	stop   chan struct{}
	done   chan struct{}
}

// Start begins reporting on a step named label every interval (Interval
// when zero) until Stop.
func Start(logf Logf, label, status string, interval time.Duration) *Step {
	if interval <= 0 {
		interval = Interval
	}
	s := &Step{label: label, start: time.Now(), logf: logf, status: status, stop: make(chan struct{}), done: make(chan struct{})}
	go func() {
		defer close(s.done)
		t := time.NewTicker(interval)
		defer t.Stop()
		for {
			select {
			case <-s.stop:
				return
			case <-t.C:
				s.mu.Lock()
				st := s.status
				s.mu.Unlock()
				s.logf("%s: %s (%s)", s.label, st, Elapsed(s.start))
			}
		}
	}()
	return s
}

// Set changes what the next report says.
func (s *Step) Set(format string, args ...any) {
	s.mu.Lock()
	s.status = fmt.Sprintf(format, args...)
	s.mu.Unlock()
}

// Stop ends the reports and returns the step's duration.
func (s *Step) Stop() time.Duration {
	select {
	case <-s.stop:
	default:
		close(s.stop)
	}
	<-s.done
	return time.Since(s.start)
}

// Elapsed formats the time since t the way reports show it.
func Elapsed(t time.Time) string {
	d := time.Since(t)
	if d < time.Minute {
		return d.Round(100 * time.Millisecond).String()
	}
	return d.Round(time.Second).String()
}

// Cmd runs a command and reports on it while it runs. Its output is kept
// out of the log unless it fails; each line of it goes to the callback
// given to Run, which may update the step's status.
type Cmd struct {
	Dir string
	// Env is the command's environment; nil means this process's.
	Env []string
	// Logf receives the reports.
	Logf Logf
	// Label names what is being built or waited for ("k8s", "agentbox-sandbox.tar").
	Label string
	// Interval between reports; Interval when zero.
	Interval time.Duration
}

// Run runs name args, starting with status, and calls line with each line
// of its output (stdout and stderr together).
func (c Cmd) Run(ctx context.Context, status string, line func(s *Step, text string), name string, args ...string) error {
	cmd := exec.CommandContext(ctx, name, args...)
	cmd.Dir = c.Dir
	cmd.Env = c.Env
	pr, pw := io.Pipe()
	cmd.Stdout, cmd.Stderr = pw, pw
	step := Start(c.Logf, c.Label, status, c.Interval)
	defer step.Stop()
	var out bytes.Buffer
	scanned := make(chan struct{})
	go func() {
		defer close(scanned)
		sc := bufio.NewScanner(pr)
		sc.Buffer(make([]byte, 64*1024), 1024*1024)
		for sc.Scan() {
			out.Write(sc.Bytes())
			out.WriteByte('\n')
			if line != nil {
				line(step, sc.Text())
			}
		}
		_, _ = io.Copy(io.Discard, pr)
	}()
	err := cmd.Start()
	if err == nil {
		err = cmd.Wait()
	}
	pw.Close()
	<-scanned
	if err != nil {
		return &Error{Cmd: name + " " + strings.Join(args, " "), Dir: c.Dir, Output: Tail(out.String(), 40), Err: err}
	}
	return nil
}

// Error says exactly which command failed, where, and what it printed last.
type Error struct {
	Cmd, Dir, Output string
	Err              error
}

func (e *Error) Error() string {
	where := ""
	if e.Dir != "" {
		where = " (in " + e.Dir + ")"
	}
	return fmt.Sprintf("%s%s failed: %v\n--- last output ---\n%s", e.Cmd, where, e.Err, e.Output)
}

func (e *Error) Unwrap() error { return e.Err }

// Tail keeps the last n lines of s.
func Tail(s string, n int) string {
	l := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(l) > n {
		l = l[len(l)-n:]
	}
	return strings.Join(l, "\n")
}

// GoModules runs a go command that resolves or downloads modules (go mod
// tidy, go mod download, go mod vendor) and reports how many modules it has
// downloaded so far.
func (c Cmd) GoModules(ctx context.Context, goCmd string, args ...string) error {
	n := 0
	return c.Run(ctx, "resolving modules", func(s *Step, text string) {
		if strings.HasPrefix(text, "go: downloading ") {
			n++
			s.Set("resolving modules, %d downloaded (last %s)", n, strings.TrimPrefix(text, "go: downloading "))
		}
	}, goOr(goCmd), args...)
}

// GoBuild is one `go build` of one or more main packages.
type GoBuild struct {
	// Go is the go command; "go" when empty.
	Go string
	// Flags go before the packages: -trimpath, -ldflags, -tags, -mod.
	Flags []string
	// Out is the binary's path for one package, or a folder (ending in a
	// slash) for several, where each binary gets its default name.
	Out      string
	Packages []string
}

// GoBuild compiles with -v, which prints each package as it is compiled,
// and reports packages compiled out of those the build depends on (from
// go list -deps, run beside the build, since listing a large graph takes
// seconds; a warm build cache compiles fewer, so the count is an upper
// bound), then "linking" once every main package is compiled.
func (c Cmd) GoBuild(ctx context.Context, b GoBuild) error {
	goCmd := goOr(b.Go)
	count := newBuildCount(b.Packages)
	go func() {
		// Without a total the reports still count packages compiled; the
		// build itself reports whatever made listing fail.
		if n, err := c.countDeps(ctx, goCmd, b.Flags, b.Packages); err == nil {
			count.total.Store(int64(n))
		}
	}()
	args := append([]string{"build", "-v"}, b.Flags...)
	args = append(args, "-o", b.Out)
	args = append(args, b.Packages...)
	return c.Run(ctx, count.status(""), func(s *Step, text string) {
		if st, ok := count.see(text); ok {
			s.Set("%s", st)
		}
	}, goCmd, args...)
}

// buildCount follows go build -v's output.
type buildCount struct {
	total                   atomic.Int64 // 0 until go list answers
	compiled, mainsCompiled int
	mains                   map[string]bool
	names                   []string
}

func newBuildCount(pkgs []string) *buildCount {
	c := &buildCount{mains: map[string]bool{}}
	for _, p := range pkgs {
		c.mains[p] = true
		c.names = append(c.names, DefaultBinaryName(p))
	}
	return c
}

// see takes one line of output and returns the new status, if the line
// changes it.
func (c *buildCount) see(text string) (string, bool) {
	if strings.HasPrefix(text, "go: downloading ") {
		return "downloading modules (last " + strings.TrimPrefix(text, "go: downloading ") + ")", true
	}
	if text == "" || strings.ContainsAny(text, " \t") {
		return "", false // not a package path: a warning or an error
	}
	c.compiled++
	if c.mains[text] {
		c.mainsCompiled++
	}
	return c.status(text), true
}

func (c *buildCount) status(last string) string {
	if c.mainsCompiled == len(c.mains) {
		return fmt.Sprintf("linking %s (%d packages compiled)", strings.Join(c.names, " "), c.compiled)
	}
	s := fmt.Sprintf("compiling, %d packages", c.compiled)
	if total := c.total.Load(); total > 0 {
		s = fmt.Sprintf("compiling, %d/%d packages", c.compiled, total)
	}
	if last != "" {
		s += " (last " + last + ")"
	}
	return s
}

func (c Cmd) countDeps(ctx context.Context, goCmd string, flags, pkgs []string) (int, error) {
	// go list takes the build flags that change the package graph; -o and
	// -ldflags are the build's alone.
	var listFlags []string
	for i := 0; i < len(flags); i++ {
		f := flags[i]
		switch {
		case f == "-tags" && i+1 < len(flags):
			listFlags = append(listFlags, f, flags[i+1])
			i++
		case strings.HasPrefix(f, "-tags=") || strings.HasPrefix(f, "-mod="):
			listFlags = append(listFlags, f)
		case f == "-ldflags" || f == "-gcflags":
			i++
		}
	}
	args := append([]string{"list", "-deps"}, listFlags...)
	args = append(args, pkgs...)
	cmd := exec.CommandContext(ctx, goCmd, args...)
	cmd.Dir = c.Dir
	cmd.Env = c.Env
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return 0, &Error{Cmd: goCmd + " " + strings.Join(args, " "), Dir: c.Dir, Output: Tail(stderr.String(), 40), Err: err}
	}
	n := 0
	for _, l := range strings.Split(string(out), "\n") {
		// unsafe is part of every graph and never compiled.
		if l != "" && l != "unsafe" {
			n++
		}
	}
	return n, nil
}

var majorVersion = regexp.MustCompile(`^v[2-9][0-9]*$`)

// DefaultBinaryName is the file name go build gives a main package's
// binary when -o names a folder: the last element of its import path, or
// the one before a major version suffix.
func DefaultBinaryName(pkg string) string {
	base := path.Base(pkg)
	if majorVersion.MatchString(base) {
		return path.Base(path.Dir(pkg))
	}
	return base
}

func goOr(g string) string {
	if g == "" {
		return "go"
	}
	return g
}
