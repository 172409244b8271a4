// Package squid runs Debian's squid as a local forward proxy for tests and
// benchmarks that compare against it (the egress proxy's benchmark does).
//
// Nothing is installed on the system: the .deb files are fetched with
// "apt-get download" and unpacked with "dpkg -x" into a cache folder, and
// squid runs from there with LD_LIBRARY_PATH pointing at the libraries it
// needs that the host lacks. This works without root, and the host's
// package database is never touched. A squid already installed at
// /usr/sbin/squid is used as it is.
//
// A running Server listens on 127.0.0.1 only, resolves names only through
// the hosts file it is given (its DNS server is set to 127.0.0.1, where
// nothing answers), and keeps no cache, so it only forwards.
package squid

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strings"

	"golang.org/x/sys/unix"
)

// ErrUnavailable means squid could not be found nor fetched; callers skip.
var ErrUnavailable = errors.New("squid is not available")

// CacheDirEnv overrides where the unpacked packages are kept.
const CacheDirEnv = "AGENTBOX_SQUID_CACHE"

// packages are what squid needs besides shared libraries: squid-common
// holds mime.conf and the error page stylesheet, squid-langpack the error
// page templates.
var packages = []string{"squid", "squid-common", "squid-langpack"}

// Install is an unpacked squid: Root is the folder holding usr/sbin/squid
// ("/" for the host's own).
type Install struct {
	Root string
}

// Binary is the squid executable.
func (i *Install) Binary() string { return filepath.Join(i.Root, "usr", "sbin", "squid") }

func (i *Install) path(p string) string { return filepath.Join(i.Root, p) }

// env is the environment squid runs with: only PATH, plus the unpacked
// libraries when they are not the system's.
func (i *Install) env() []string {
	env := []string{"PATH=/usr/sbin:/usr/bin:/sbin:/bin"}
	if i.Root != "/" {
		var dirs []string
		for _, d := range []string{"usr/lib/x86_64-linux-gnu", "usr/lib/aarch64-linux-gnu", "lib/x86_64-linux-gnu", "lib/aarch64-linux-gnu", "usr/lib"} {
			if st, err := os.Stat(i.path(d)); err == nil && st.IsDir() {
				dirs = append(dirs, i.path(d))
			}
		}
		env = append(env, "LD_LIBRARY_PATH="+strings.Join(dirs, ":"))
	}
	return env
}

// Version runs "squid -v" and returns its first line; it also proves that
// the binary starts with the libraries it has.
func (i *Install) Version(ctx context.Context) (string, error) {
	cmd := exec.CommandContext(ctx, i.Binary(), "-v")
	cmd.Env = i.env()
	out, err := cmd.CombinedOutput()
	if err != nil {
		return "", fmt.Errorf("%s -v: %w: %s", i.Binary(), err, bytes.TrimSpace(out))
	}
	line, _, _ := strings.Cut(string(out), "\n")
	return strings.TrimSpace(line), nil
}

// DefaultCacheDir is $AGENTBOX_SQUID_CACHE, else agentbox/squid in the
// user's cache folder.
func DefaultCacheDir() (string, error) {
	if d := os.Getenv(CacheDirEnv); d != "" {
		return filepath.Abs(d)
	}
	c, err := os.UserCacheDir()
	if err != nil {
		return "", fmt.Errorf("no user cache folder (set %s): %w", CacheDirEnv, err)
	}
	return filepath.Join(c, "agentbox", "squid"), nil
}

// Ensure returns a squid that runs: the host's, else one unpacked in
// cacheDir earlier, else one fetched now. logf reports progress and may be
// nil. Errors that mean squid cannot be had wrap ErrUnavailable.
func Ensure(ctx context.Context, cacheDir string, logf func(format string, args ...any)) (*Install, error) {
	if logf == nil {
		logf = func(string, ...any) {}
	}
	sys := &Install{Root: "/"}
	if _, err := os.Stat(sys.Binary()); err == nil && hasTemplates(sys) {
		if _, err := sys.Version(ctx); err == nil {
			return sys, nil
		}
	}
	if err := os.MkdirAll(cacheDir, 0o755); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrUnavailable, err)
	}
	// Two test binaries may fetch at the same time (go test runs packages
	// in parallel); the second waits and then finds the first's result.
	lock, err := os.OpenFile(filepath.Join(cacheDir, ".lock"), os.O_CREATE|os.O_RDWR, 0o644)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrUnavailable, err)
	}
	defer lock.Close()
	if err := unix.Flock(int(lock.Fd()), unix.LOCK_EX); err != nil {
		return nil, fmt.Errorf("%w: lock %s: %w", ErrUnavailable, lock.Name(), err)
	}
	defer unix.Flock(int(lock.Fd()), unix.LOCK_UN)

	in := &Install{Root: filepath.Join(cacheDir, "root")}
	if _, err := os.Stat(filepath.Join(cacheDir, "complete")); err == nil {
		if _, err := in.Version(ctx); err == nil {
			return in, nil
		}
	}
	logf("squid: fetching Debian packages into %s", cacheDir)
	if err := fetch(ctx, cacheDir, logf); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrUnavailable, err)
	}
	v, err := in.Version(ctx)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrUnavailable, err)
	}
	if err := os.WriteFile(filepath.Join(cacheDir, "complete"), []byte(v+"\n"), 0o644); err != nil {
		return nil, err
	}
	logf("squid: %s ready", v)
	return in, nil
}

func hasTemplates(i *Install) bool {
	_, err := os.Stat(templatesDir(i))
	return err == nil
}

func templatesDir(i *Install) string {
	for _, d := range []string{"usr/share/squid-langpack/templates", "usr/share/squid/errors/templates"} {
		if _, err := os.Stat(filepath.Join(i.path(d), "ERR_ACCESS_DENIED")); err == nil {
			return i.path(d)
		}
	}
	return i.path("usr/share/squid-langpack/templates")
}

// fetch downloads and unpacks squid into cacheDir/root, then adds the
// library packages that ldd still misses, named from their sonames by
// Debian's library package convention (libecap.so.3 is in libecap3), until
// nothing is missing. The new tree replaces the old one only when whole.
func fetch(ctx context.Context, cacheDir string, logf func(string, ...any)) error {
	work, err := os.MkdirTemp(cacheDir, "fetch-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(work)
	debs, root := filepath.Join(work, "debs"), filepath.Join(work, "root")
	if err := os.MkdirAll(debs, 0o755); err != nil {
		return err
	}
	in := &Install{Root: root}
	want := packages
	fetched := map[string]bool{}
	for round := 0; len(want) > 0; round++ {
		if round > 4 {
			return fmt.Errorf("libraries still missing after %d rounds: %v", round, want)
		}
		if err := download(ctx, debs, want); err != nil {
			return err
		}
		for _, p := range want {
			fetched[p] = true
		}
		files, _ := filepath.Glob(filepath.Join(debs, "*.deb"))
		for _, f := range files {
			if out, err := exec.CommandContext(ctx, "dpkg", "-x", f, root).CombinedOutput(); err != nil {
				return fmt.Errorf("dpkg -x %s: %w: %s", filepath.Base(f), err, bytes.TrimSpace(out))
			}
			if err := os.Remove(f); err != nil {
				return err
			}
		}
		missing, err := missingLibs(ctx, in)
		if err != nil {
			return err
		}
		want = nil
		for _, so := range missing {
			p := packageForSoname(so)
			if p == "" || fetched[p] {
				return fmt.Errorf("squid needs %s and no package for it could be found", so)
			}
			want = append(want, p)
		}
		if len(want) > 0 {
			logf("squid: missing libraries %v, fetching %v", missing, want)
		}
	}
	dst := filepath.Join(cacheDir, "root")
	if err := os.RemoveAll(dst); err != nil {
		return err
	}
	return os.Rename(root, dst)
}

// download runs apt-get download in dir. When that fails because the
// package lists are empty (a fresh machine) and we are root, the lists are
// refreshed once and the download tried again; nothing is installed.
func download(ctx context.Context, dir string, pkgs []string) error {
	run := func(args ...string) error {
		cmd := exec.CommandContext(ctx, "apt-get", args...)
		cmd.Dir = dir
		cmd.Env = append(os.Environ(), "DEBIAN_FRONTEND=noninteractive")
		if out, err := cmd.CombinedOutput(); err != nil {
			return fmt.Errorf("apt-get %s: %w: %s", strings.Join(args, " "), err, tail(string(out), 5))
		}
		return nil
	}
	args := append([]string{"download", "-q"}, pkgs...)
	err := run(args...)
	if err == nil || os.Geteuid() != 0 {
		return err
	}
	if uerr := run("update", "-q"); uerr != nil {
		return errors.Join(err, uerr)
	}
	return run(args...)
}

var notFound = regexp.MustCompile(`(?m)^\s*(\S+) => not found`)

// missingLibs lists the shared libraries ldd cannot find for squid.
func missingLibs(ctx context.Context, in *Install) ([]string, error) {
	cmd := exec.CommandContext(ctx, "ldd", in.Binary())
	cmd.Env = in.env()
	out, err := cmd.CombinedOutput()
	if err != nil {
		return nil, fmt.Errorf("ldd %s: %w: %s", in.Binary(), err, bytes.TrimSpace(out))
	}
	seen := map[string]bool{}
	for _, m := range notFound.FindAllStringSubmatch(string(out), -1) {
		seen[m[1]] = true
	}
	libs := make([]string, 0, len(seen))
	for l := range seen {
		libs = append(libs, l)
	}
	sort.Strings(libs)
	return libs, nil
}

// packageForSoname applies Debian policy 8.1: libfoo.so.3 is shipped by
// libfoo3, and libfoo2.so.1 by libfoo2-1.
func packageForSoname(so string) string {
	name, ver, ok := strings.Cut(so, ".so.")
	if !ok || name == "" || ver == "" {
		return ""
	}
	name = strings.ToLower(strings.ReplaceAll(name, "_", "-"))
	ver, _, _ = strings.Cut(ver, ".")
	if last := name[len(name)-1]; last >= '0' && last <= '9' {
		return name + "-" + ver
	}
	return name + ver
}

func tail(s string, n int) string {
	var lines []string
	sc := bufio.NewScanner(strings.NewReader(s))
	for sc.Scan() {
		lines = append(lines, sc.Text())
	}
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}
