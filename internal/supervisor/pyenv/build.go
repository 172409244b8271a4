package pyenv

import (
	"bufio"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
)

// build makes the environment in a fresh directory. On any failure the
// directory is removed, so no half-built environment is ever found.
func (m *Manager) build(name string, sp spec) (_ *env, err error) {
	select {
	case m.sem <- struct{}{}:
		defer func() { <-m.sem }()
	case <-m.ctx.Done():
		return nil, errorf(KindUnavailable, "the environment cache is shutting down")
	}
	ctx, cancel := context.WithTimeout(m.ctx, m.cfg.CreateTimeout)
	defer cancel()
	// Private: the environments are code every run imports.
	if err := os.MkdirAll(m.dir, 0o700); err != nil {
		return nil, &Error{Kind: KindBuildFailed, Msg: "the environment directory cannot be made: " + err.Error(), Err: err}
	}
	dir := filepath.Join(m.dir, name+"."+randomSuffix())
	defer func() {
		if err != nil {
			if rmErr := os.RemoveAll(dir); rmErr != nil {
				m.log.Warn("removing a failed build failed", "dir", dir, "error", rmErr.Error())
			}
		}
	}()
	b := &building{m: m, ctx: ctx, name: name, dir: dir, spec: sp}
	if err := b.install(); err != nil {
		return nil, err
	}
	e := &env{name: name, dir: dir, spec: sp, created: time.Now()}
	if err := b.describe(e); err != nil {
		return nil, err
	}
	if len(m.cfg.SealKey) > 0 {
		if err := Seal(dir, m.cfg.SealKey); err != nil {
			return nil, b.failed("sealing it", err)
		}
	}
	if err := b.writeMeta(e); err != nil {
		return nil, b.failed("writing its metadata", err)
	}
	return e, nil
}

// building is one build of an environment in dir.
type building struct {
	m    *Manager
	ctx  context.Context // bounded by CreateTimeout
	name string
	dir  string
	spec spec
}

// failed is the error of a build step that failed with err while doing
// what.
func (b *building) failed(what string, err error) error {
	switch {
	case b.m.ctx.Err() != nil:
		return errorf(KindUnavailable, "building environment %q was cancelled: the supervisor is shutting down", b.name)
	case b.ctx.Err() != nil:
		return &Error{Kind: KindTimeout, Msg: fmt.Sprintf("building environment %q timed out after %s (while %s); nothing was kept", b.name, b.m.cfg.CreateTimeout, what), Err: err}
	}
	return &Error{Kind: KindBuildFailed, Msg: fmt.Sprintf("environment %q: %s failed: %v; nothing was kept", b.name, what, err), Err: err}
}

// install creates the virtual environment and installs the requirements
// into it, with uv when there is one, else venv and pip.
func (b *building) install() error {
	m, ctx, sp := b.m, b.ctx, b.spec
	python := filepath.Join(b.dir, "bin", "python")
	if m.cfg.UV != "" {
		if err := m.step(ctx, []string{m.cfg.UV, "venv", "--python", m.cfg.Python, b.dir}); err != nil {
			return b.failed("creating the virtual environment", err)
		}
	} else {
		if err := m.step(ctx, []string{m.cfg.Python, "-m", "venv", "--without-pip", b.dir}); err != nil {
			return b.failed("creating the virtual environment", err)
		}
	}
	if len(sp.Requirements) == 0 {
		return nil
	}
	var argv []string
	if m.cfg.UV != "" {
		argv = []string{m.cfg.UV, "pip", "install", "--python", python}
	} else {
		pip, err := m.pip(ctx)
		if err != nil {
			return b.failed("finding pip", err)
		}
		argv = append(slices.Clone(pip), "--python", python, "install", "--no-input", "--disable-pip-version-check", "--no-cache-dir")
	}
	if sp.IndexURL != "" {
		argv = append(argv, "--index-url", sp.IndexURL)
	}
	for _, u := range sp.ExtraIndexes {
		argv = append(argv, "--extra-index-url", u)
	}
	// The hosts are the template's, not the request's: a trusted host is
	// not what an environment is, only how it may be fetched, so it is no
	// part of the spec an environment is shared by.
	trust := "--trusted-host"
	if m.cfg.UV != "" {
		trust = "--allow-insecure-host"
	}
	for _, h := range m.cfg.TrustedHosts {
		argv = append(argv, trust, h)
	}
	// Requirements never start with "-" (ParseRequirement), and "--"
	// makes sure no installer reads one as an option.
	argv = append(append(argv, "--"), sp.Requirements...)
	if err := m.step(ctx, argv); err != nil {
		return b.failed("installing "+strings.Join(sp.Requirements, " "), err)
	}
	return nil
}

// describe fills in what e holds (packages, Python version, size), and
// refuses packages the allowlist does not name.
func (b *building) describe(e *env) error {
	installed, err := installedPackages(b.dir)
	if err != nil {
		return b.failed("listing the installed packages", err)
	}
	if len(b.m.allowed) > 0 {
		var refused []string
		for _, p := range installed {
			if !b.m.allowed[p.name] {
				refused = append(refused, p.name)
			}
		}
		if len(refused) > 0 {
			return errorf(KindNotAllowed, "installing %s pulled in dependencies not on this sandbox's allowlist: %s; the environment was removed",
				strings.Join(b.spec.Requirements, " "), strings.Join(refused, ", "))
		}
	}
	for _, p := range installed {
		e.packages = append(e.packages, p.display+"=="+p.version)
	}
	e.pyVersion = pythonVersion(b.dir)
	if e.size, err = diskUsage(b.dir); err != nil {
		return b.failed("measuring the environment", err)
	}
	return nil
}

// writeMeta writes the environment's metadata last, and atomically: its
// presence is what marks the build finished.
func (b *building) writeMeta(e *env) error {
	md, err := json.Marshal(meta{Name: e.name, Spec: e.spec, Packages: e.packages, PythonVersion: e.pyVersion, SizeBytes: e.size, CreatedAt: e.created})
	if err != nil {
		return err
	}
	tmp := filepath.Join(b.dir, metaFile+".tmp")
	if err := os.WriteFile(tmp, md, 0o600); err != nil {
		return err
	}
	return os.Rename(tmp, filepath.Join(b.dir, metaFile))
}

// buildEnv is the environment of build steps: the configured one, minus
// whatever could point pip or uv elsewhere, plus settings that make them
// ignore configuration files so the configured indexes are the only ones.
func (m *Manager) buildEnv() []string {
	out := make([]string, 0, len(m.cfg.Env)+8)
	for _, kv := range m.cfg.Env {
		k, _, _ := strings.Cut(kv, "=")
		if strings.HasPrefix(k, "PIP_") || strings.HasPrefix(k, "UV_") || k == "VIRTUAL_ENV" || k == "PYTHONPATH" || k == "PYTHONHOME" {
			continue
		}
		out = append(out, kv)
	}
	return append(out,
		"PIP_CONFIG_FILE="+os.DevNull,
		"PIP_NO_INPUT=1",
		"PIP_DISABLE_PIP_VERSION_CHECK=1",
		"UV_NO_CONFIG=1",
		"UV_NO_CACHE=1",
		"UV_PYTHON_DOWNLOADS=never",
		"UV_NO_PROGRESS=1",
	)
}

// step runs one build step and turns a failure into an error carrying the
// end of its output, where installers say what went wrong.
func (m *Manager) step(ctx context.Context, argv []string) error {
	out := &tailBuffer{max: 16 << 10}
	code, err := m.cfg.Run(ctx, argv, m.buildEnv(), m.dir, out, out)
	if err != nil {
		return err
	}
	if ctx.Err() != nil {
		return ctx.Err()
	}
	if code != 0 {
		return fmt.Errorf("%s exited with status %d: %s", filepath.Base(argv[0]), code, out.summary())
	}
	return nil
}

// pip returns the argv prefix that runs a pip able to install into another
// interpreter's environment (--python, pip 22.3 and later): the base
// interpreter's own if it has one, else one in an installer environment
// made once with ensurepip.
func (m *Manager) pip(ctx context.Context) ([]string, error) {
	m.installerMu.Lock()
	defer m.installerMu.Unlock()
	if m.installer != nil {
		return m.installer, nil
	}
	candidates := [][]string{{m.cfg.Python, "-m", "pip"}}
	installer := filepath.Join(m.dir, installerDir)
	ipython := filepath.Join(installer, "bin", "python")
	if _, err := os.Stat(ipython); err == nil {
		candidates = append(candidates, []string{ipython, "-m", "pip"})
	}
	for _, c := range candidates {
		if m.pipUsable(ctx, c) {
			m.installer = c
			return c, nil
		}
	}
	// A fresh installer environment, built beside and renamed into place
	// so that a half-made one is never used.
	tmp := filepath.Join(m.dir, installerDir+"-"+randomSuffix())
	defer os.RemoveAll(tmp)
	if err := m.step(ctx, []string{m.cfg.Python, "-m", "venv", tmp}); err != nil {
		return nil, fmt.Errorf("%s has no pip, and creating one with ensurepip failed (on Debian, install python3-venv): %w", m.cfg.Python, err)
	}
	_ = os.RemoveAll(installer)
	if err := os.Rename(tmp, installer); err != nil {
		return nil, err
	}
	c := []string{ipython, "-m", "pip"}
	if !m.pipUsable(ctx, c) {
		return nil, fmt.Errorf("the pip that ensurepip installed is older than 22.3 and cannot install into another environment")
	}
	m.installer = c
	return c, nil
}

var pipVersionRE = regexp.MustCompile(`^pip (\d+)\.(\d+)`)

func (m *Manager) pipUsable(ctx context.Context, argv []string) bool {
	out := &tailBuffer{max: 4 << 10}
	code, err := m.cfg.Run(ctx, append(slices.Clone(argv), "--version"), m.buildEnv(), m.dir, out, io.Discard)
	if err != nil || code != 0 {
		return false
	}
	v := pipVersionRE.FindStringSubmatch(strings.TrimSpace(out.String()))
	if v == nil {
		return false
	}
	major, _ := strconv.Atoi(v[1])
	minor, _ := strconv.Atoi(v[2])
	return major > 22 || major == 22 && minor >= 3
}

type installed struct{ name, display, version string }

// installedPackages reads the distributions in the environment's
// site-packages from their METADATA.
func installedPackages(dir string) ([]installed, error) {
	metas, err := filepath.Glob(filepath.Join(dir, "lib", "python*", "site-packages", "*.dist-info", "METADATA"))
	if err != nil {
		return nil, err
	}
	var out []installed
	for _, p := range metas {
		name, version, err := readDistMetadata(p)
		if err != nil {
			return nil, err
		}
		out = append(out, installed{name: NormalizeName(name), display: name, version: version})
	}
	slices.SortFunc(out, func(a, b installed) int { return strings.Compare(a.name, b.name) })
	return out, nil
}

func readDistMetadata(path string) (name, version string, err error) {
	f, err := os.Open(path)
	if err != nil {
		return "", "", err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line := sc.Text()
		if line == "" {
			break // the headers end at the first blank line
		}
		if v, ok := strings.CutPrefix(line, "Name:"); ok {
			name = strings.TrimSpace(v)
		} else if v, ok := strings.CutPrefix(line, "Version:"); ok {
			version = strings.TrimSpace(v)
		}
	}
	if err := sc.Err(); err != nil {
		return "", "", err
	}
	if name == "" || version == "" {
		return "", "", fmt.Errorf("%s names no Name or Version", path)
	}
	return name, version, nil
}

// pythonVersion reads the interpreter version venv or uv recorded.
func pythonVersion(dir string) string {
	data, err := os.ReadFile(filepath.Join(dir, "pyvenv.cfg"))
	if err != nil {
		return ""
	}
	for _, line := range strings.Split(string(data), "\n") {
		k, v, ok := strings.Cut(line, "=")
		if !ok {
			continue
		}
		if k = strings.TrimSpace(k); k == "version" || k == "version_info" {
			return strings.TrimSpace(v)
		}
	}
	return ""
}

// diskUsage is the space the files under dir take (allocated blocks, each
// inode counted once), which is what fills a disk, rather than their
// apparent sizes.
func diskUsage(dir string) (int64, error) {
	type inode struct{ dev, ino uint64 }
	seen := map[inode]bool{}
	var total int64
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		fi, err := d.Info()
		if err != nil {
			return err
		}
		st, ok := fi.Sys().(*syscall.Stat_t)
		if !ok {
			total += fi.Size()
			return nil
		}
		k := inode{uint64(st.Dev), st.Ino}
		if seen[k] {
			return nil
		}
		seen[k] = true
		total += st.Blocks * 512
		return nil
	})
	return total, err
}

func randomSuffix() string {
	b := make([]byte, 4)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// tailBuffer keeps the last max bytes written to it.
type tailBuffer struct {
	mu  sync.Mutex
	max int
	buf []byte
}

func (t *tailBuffer) Write(p []byte) (int, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.buf = append(t.buf, p...)
	if over := len(t.buf) - t.max; over > 0 {
		t.buf = append(t.buf[:0], t.buf[over:]...)
	}
	return len(p), nil
}

func (t *tailBuffer) String() string {
	t.mu.Lock()
	defer t.mu.Unlock()
	return string(t.buf)
}

// summary is the end of the output: the lines an installer prints last
// say what failed, and the lines before are mostly progress.
func (t *tailBuffer) summary() string {
	lines := strings.Split(strings.TrimSpace(strings.ToValidUTF8(t.String(), "\uFFFD")), "\n")
	var errLines []string
	for _, l := range lines {
		if strings.HasPrefix(l, "ERROR:") || strings.HasPrefix(l, "error:") || strings.HasPrefix(l, "  × ") || strings.HasPrefix(l, "  ╰─▶ ") {
			errLines = append(errLines, strings.TrimSpace(l))
		}
	}
	if len(errLines) == 0 {
		errLines = lines[max(0, len(lines)-10):]
	}
	s := strings.Join(errLines, "\n")
	if len(s) > 2000 {
		s = "..." + strings.ToValidUTF8(s[len(s)-2000:], "")
	}
	if s == "" {
		return "(no output)"
	}
	return s
}
