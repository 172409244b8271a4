// Package pyenv keeps the sandbox's cached Python virtual environments
// (/v1/envs): one per name or per requirement set, built once and
// reused by every run that asks for the same thing, and evicted least
// recently used first when there are too many of them or they take too
// much disk, or, with a time-to-live, when they have not been used for
// longer than it.
//
// The directory may outlive the process: on a sandbox's workspace volume
// it is carried by an idle stop's snapshot and restored on resume, so a
// resumed sandbox finds its environments again. What the environments
// were built with may have changed meanwhile (a new sandbox image with
// another Python), so an environment found on disk is checked against the
// interpreter before its first use, and rebuilt from its recorded
// requirements when it no longer runs or runs another Python version.
//
// An environment is built with uv when the supervisor finds it, else with
// python3 -m venv --without-pip and pip running from outside the
// environment (pip --python): the environment then holds only what was
// asked for, which keeps it small and makes its size on disk a fair
// measure for eviction. Packages come only from the configured indexes;
// requirements are names with version specifiers, never URLs or paths, and
// with an allowlist every name is checked before anything is installed
// and every package that was installed (dependencies too) after.
//
// The package starts no process itself: every build step goes through the
// Runner the supervisor gives it, so builds share the commands'
// confinement (own process group, killed when the build is cancelled or
// times out, tracked for shutdown and by the orphan reaper).
package pyenv

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"net"
	"net/url"
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

// Defaults for Config's zero values.
const (
	DefaultMaxEnvs             = 8
	DefaultMaxBytes            = 2 << 30
	DefaultCreateTimeout       = 5 * time.Minute
	DefaultMaxConcurrentBuilds = 2
)

// metaFile marks a finished environment; a directory without it is a build
// that did not complete and is removed.
const metaFile = "agentbox-env.json"

// usedFile records when the environment was last used, so that the
// time-to-live and the least-recently-used order hold across restarts
// (and across an idle stop, whose restore does not keep modification
// times).
const usedFile = "agentbox-env.used"

// usedWriteEvery bounds how often usedFile is rewritten for one
// environment: often enough for a time-to-live of minutes, without a
// write per run.
const usedWriteEvery = time.Minute

// verifyTimeout bounds the interpreter check of an environment found on
// disk: one start of Python, slower under gVisor than natively.
const verifyTimeout = 30 * time.Second

// installerDir holds a pip for building environments when the base
// interpreter has none (Debian's python3 without python3-pip).
const installerDir = ".installer"

// Runner runs one build step, argv in dir with exactly env, and waits for
// it. It kills the step's whole process group when ctx is done. exitCode
// is -1 when the step was ended by a signal; err is for a step that could
// not be started or waited for.
type Runner func(ctx context.Context, argv, env []string, dir string, stdout, stderr io.Writer) (exitCode int, err error)

// Config configures a Manager.
type Config struct {
	// Dir holds the environments, one directory each. It is created if
	// missing. Directories in it that are not finished environments are
	// removed when the Manager starts: they are builds a crash cut short.
	Dir string
	// Python is the base interpreter, a path or a name the Runner looks up.
	// Empty means "python3".
	Python string
	// UV is the path of uv; empty means build with venv and pip.
	UV string
	// IndexURL is the package index (PEP 503 "simple" URL); empty means
	// the installer's default. ExtraIndexURLs are searched too.
	IndexURL       string
	ExtraIndexURLs []string
	// TrustedHosts are index hosts (host or host:port) the installer may
	// reach over plain HTTP or without verifying their certificate: pip's
	// --trusted-host, uv's --allow-insecure-host.
	TrustedHosts []string
	// SealKey, when set, seals each environment built (see VerifySeal),
	// so that a warm pool reusing the sandbox can keep the environments
	// nobody changed for its next holder. It must be a key the sandbox's
	// commands cannot read.
	SealKey []byte
	// AllowedPackages, when not empty, are the only projects that may be
	// installed, dependencies included. Names are compared normalised
	// (PEP 503).
	AllowedPackages []string
	// MaxEnvs and MaxBytes bound the environments kept and their total size
	// on disk; past either the least recently used idle environments are
	// removed. An environment in use is never removed, so the bounds can
	// be passed while runs hold environments. Zero means the defaults.
	MaxEnvs  int
	MaxBytes int64
	// TTL, when positive, removes an idle environment that has not been
	// used for longer than it. Zero keeps environments until the count or
	// size limits evict them.
	TTL time.Duration
	// CreateTimeout bounds one environment's build. Zero means
	// DefaultCreateTimeout.
	CreateTimeout time.Duration
	// MaxConcurrentBuilds bounds builds running at once; more wait.
	MaxConcurrentBuilds int
	// Env is the environment of build steps (PATH, HOME, LANG, proxies);
	// the manager adds the variables that keep pip and uv from reading
	// configuration files.
	Env []string
	// Run runs build steps. Required.
	Run    Runner
	Logger *slog.Logger
}

// Kind classifies an Error.
type Kind int

const (
	// KindInvalid is a request that is malformed.
	KindInvalid Kind = iota + 1
	// KindNotAllowed is a package or index outside the configuration.
	KindNotAllowed
	// KindNotFound is a named environment that does not exist.
	KindNotFound
	// KindBuildFailed is an installer that failed: a requirement that
	// cannot be satisfied, an index that cannot be reached.
	KindBuildFailed
	// KindTimeout is a build that ran out of time.
	KindTimeout
	// KindTooLarge is an environment larger than MaxBytes on its own.
	KindTooLarge
	// KindBusy is an environment being built when it was to be deleted.
	KindBusy
	// KindUnavailable is a manager that is closed or shutting down.
	KindUnavailable
)

// Error is an error of the manager, with a message meant for the caller.
type Error struct {
	Kind Kind
	Msg  string
	Err  error
}

func (e *Error) Error() string { return e.Msg }
func (e *Error) Unwrap() error { return e.Err }

func errorf(kind Kind, format string, args ...any) *Error {
	return &Error{Kind: kind, Msg: fmt.Sprintf(format, args...)}
}

// KindOf returns the Kind of the *Error in err's chain, or 0.
func KindOf(err error) Kind {
	var e *Error
	if errors.As(err, &e) {
		return e.Kind
	}
	return 0
}

// Info describes one environment.
type Info struct {
	Name string
	// Requirements are as asked for, in canonical spelling; Packages are
	// what is installed, "name==version", dependencies included.
	Requirements  []string
	Packages      []string
	PythonVersion string
	// SizeBytes is the disk the environment's directory uses, measured
	// when it was built.
	SizeBytes  int64
	CreatedAt  time.Time
	LastUsedAt time.Time
	// InUse counts the runs holding the environment now.
	InUse int
	// Dir is the environment's directory (its sys.prefix).
	Dir string
	// State is StateReady, or StateUnverified for an environment found on
	// disk whose interpreter is checked at its first use.
	State string
}

// The states of an environment in Info.
const (
	StateReady      = "ready"
	StateUnverified = "unverified"
)

// Stats sums up the cache.
type Stats struct {
	Count, MaxCount int
	Bytes, MaxBytes int64
	// Building counts environments being built now.
	Building int
	// Installer is "uv" or "pip".
	Installer string
	// TTL is Config.TTL; zero for none.
	TTL time.Duration
}

// Request asks for an environment.
type Request struct {
	// Name names the environment. Empty means one named after the
	// requirement set, shared by every request for the same set.
	Name string
	// Requirements to install. A named environment that exists with
	// other requirements is rebuilt with these; without requirements, a
	// named environment is used as it is.
	Requirements []string
	// IndexURL replaces the configured index for this environment. With
	// indexes configured it must be one of them; without, any http(s) URL
	// is taken (the sandbox's egress policy then decides).
	IndexURL string
	// CreateEmpty builds an empty environment for a Name that does not
	// exist and comes without requirements; otherwise that is KindNotFound.
	CreateEmpty bool
}

// Manager owns the environments in Config.Dir.
type Manager struct {
	cfg     Config
	dir     string
	allowed map[string]bool
	log     *slog.Logger
	lock    io.Closer

	ctx    context.Context // cancelled by Close; builds run under it
	cancel context.CancelFunc
	wg     sync.WaitGroup
	sem    chan struct{}

	mu     sync.Mutex
	envs   map[string]*env
	builds map[string]*build
	closed bool

	installerMu sync.Mutex
	installer   []string // argv prefix that runs pip, once found

	now func() time.Time // the clock of the time-to-live; tests set it
}

type env struct {
	name      string
	dir       string
	spec      spec
	packages  []string
	pyVersion string
	size      int64
	created   time.Time
	lastUsed  time.Time
	users     int
	// usedWritten is when usedFile was last written.
	usedWritten time.Time
	// verified: built by this process, or found on disk and checked
	// against the interpreter since.
	verified bool
	// retired: no longer in the index (evicted, deleted or replaced); its
	// directory goes when the last user releases it.
	retired bool
}

type build struct {
	spec spec
	done chan struct{}
	err  error // set before done is closed
}

// meta is the content of metaFile.
type meta struct {
	Name          string    `json:"name"`
	Spec          spec      `json:"spec"`
	Packages      []string  `json:"packages"`
	PythonVersion string    `json:"python_version"`
	SizeBytes     int64     `json:"size_bytes"`
	CreatedAt     time.Time `json:"created_at"`
}

// New opens (creating it if needed) the environment directory, takes its
// lock, removes unfinished builds and loads the finished environments.
// Only one Manager may use a directory at a time: a second one would
// remove the first one's builds in progress as unfinished.
func New(cfg Config) (*Manager, error) {
	if cfg.Dir == "" {
		return nil, errors.New("pyenv: no directory")
	}
	if cfg.Run == nil {
		return nil, errors.New("pyenv: no runner")
	}
	if cfg.Python == "" {
		cfg.Python = "python3"
	}
	if cfg.MaxEnvs <= 0 {
		cfg.MaxEnvs = DefaultMaxEnvs
	}
	if cfg.MaxBytes <= 0 {
		cfg.MaxBytes = DefaultMaxBytes
	}
	if cfg.CreateTimeout <= 0 {
		cfg.CreateTimeout = DefaultCreateTimeout
	}
	if cfg.MaxConcurrentBuilds <= 0 {
		cfg.MaxConcurrentBuilds = DefaultMaxConcurrentBuilds
	}
	indexes := cfg.ExtraIndexURLs
	if cfg.IndexURL != "" {
		indexes = append([]string{cfg.IndexURL}, indexes...)
	}
	for _, u := range indexes {
		if err := checkIndexURL(u); err != nil {
			return nil, fmt.Errorf("pyenv: %w", err)
		}
	}
	for _, h := range cfg.TrustedHosts {
		if err := checkTrustedHost(h); err != nil {
			return nil, fmt.Errorf("pyenv: %w", err)
		}
	}
	log := cfg.Logger
	if log == nil {
		log = slog.Default()
	}
	allowed := map[string]bool{}
	for _, n := range cfg.AllowedPackages {
		if n = strings.TrimSpace(n); n != "" {
			allowed[NormalizeName(n)] = true
		}
	}
	dir, err := filepath.Abs(cfg.Dir)
	if err != nil {
		return nil, fmt.Errorf("pyenv: %w", err)
	}
	// The directory is made by the first build, not here: it lives on the
	// workspace volume, and an agent that never builds an environment must
	// find its workspace empty (a `git clone URL .` refuses a directory
	// that is not). So the lock that keeps a second manager off the
	// directory is no file: it is an abstract Unix socket named after the
	// directory, which leaves nothing in the workspace or in the /tmp the
	// sandbox's commands share, and which the kernel releases with the
	// process. Abstract sockets are per network namespace, that is per pod,
	// which is as far as a workspace is shared.
	sum := sha256.Sum256([]byte(dir))
	lock, err := net.ListenUnix("unix", &net.UnixAddr{Name: "@agentbox-envs-" + hex.EncodeToString(sum[:8]), Net: "unix"})
	if errors.Is(err, syscall.EADDRINUSE) {
		return nil, fmt.Errorf("pyenv: %s is in use by another process", dir)
	}
	if err != nil {
		return nil, fmt.Errorf("pyenv: lock %s: %w", dir, err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	m := &Manager{
		cfg: cfg, dir: dir, allowed: allowed, log: log, lock: lock,
		ctx: ctx, cancel: cancel,
		sem:    make(chan struct{}, cfg.MaxConcurrentBuilds),
		envs:   map[string]*env{},
		builds: map[string]*build{},
		now:    time.Now,
	}
	m.load()
	if cfg.TTL > 0 {
		m.wg.Add(1)
		go m.expireLoop(min(max(cfg.TTL/4, time.Second), time.Minute))
	}
	return m, nil
}

// expireLoop removes environments past the time-to-live even when nothing
// uses the cache: they hold disk on the sandbox's volume.
func (m *Manager) expireLoop(every time.Duration) {
	defer m.wg.Done()
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		select {
		case <-m.ctx.Done():
			return
		case <-t.C:
			m.expire()
		}
	}
}

// expire enforces the limits, the time-to-live among them, now.
func (m *Manager) expire() {
	m.mu.Lock()
	remove := m.enforceLocked(nil)
	m.mu.Unlock()
	m.removeDirs(remove)
}

// load takes in the finished environments found in the directory and
// removes everything else of the manager's.
func (m *Manager) load() {
	entries, err := os.ReadDir(m.dir)
	if errors.Is(err, fs.ErrNotExist) {
		return
	}
	if err != nil {
		m.log.Warn("reading the environment directory failed", "dir", m.dir, "error", err.Error())
		return
	}
	var remove []string
	for _, de := range entries {
		name := de.Name()
		if name == installerDir {
			continue
		}
		p := filepath.Join(m.dir, name)
		e, err := readMeta(p)
		if err != nil {
			m.log.Info("removing an unfinished environment", "dir", p, "reason", err.Error())
			remove = append(remove, p)
			continue
		}
		if old := m.envs[e.name]; old != nil {
			if old.created.After(e.created) {
				remove = append(remove, p)
				continue
			}
			remove = append(remove, old.dir)
		}
		m.envs[e.name] = e
	}
	remove = append(remove, m.enforceLocked(nil)...)
	m.removeDirs(remove)
	if len(m.envs) > 0 {
		m.log.Info("loaded cached environments", "count", len(m.envs), "dir", m.dir)
	}
}

func readMeta(dir string) (*env, error) {
	data, err := os.ReadFile(filepath.Join(dir, metaFile))
	if err != nil {
		return nil, fmt.Errorf("no %s", metaFile)
	}
	var md meta
	if err := json.Unmarshal(data, &md); err != nil {
		return nil, fmt.Errorf("%s: %w", metaFile, err)
	}
	if err := ValidName(md.Name); err != nil {
		return nil, err
	}
	if !strings.HasPrefix(filepath.Base(dir), md.Name+".") {
		return nil, fmt.Errorf("directory does not match the name %q", md.Name)
	}
	e := &env{
		name: md.Name, dir: dir, spec: md.Spec, packages: md.Packages, pyVersion: md.PythonVersion,
		size: md.SizeBytes, created: md.CreatedAt, lastUsed: md.CreatedAt,
	}
	if data, err := os.ReadFile(filepath.Join(dir, usedFile)); err == nil {
		if t, err := time.Parse(time.RFC3339Nano, strings.TrimSpace(string(data))); err == nil && t.After(e.lastUsed) {
			e.lastUsed, e.usedWritten = t, t
		}
	}
	return e, nil
}

// Close cancels the builds in progress (their steps are killed and their
// directories removed), waits for them and releases the directory.
func (m *Manager) Close() error {
	m.mu.Lock()
	m.closed = true
	m.mu.Unlock()
	m.cancel()
	m.wg.Wait()
	return m.lock.Close()
}

// Dir is the directory holding the environments.
func (m *Manager) Dir() string { return m.dir }

// Ensure returns a pin on the environment r asks for, building it if
// needed. created reports whether this call built it. Concurrent calls for
// the same environment share one build; a caller whose ctx ends stops
// waiting, but the build goes on for the others and for the cache.
func (m *Manager) Ensure(ctx context.Context, r Request) (pin *Pin, created bool, err error) {
	name, sp, asIs, err := m.resolve(r)
	if err != nil {
		return nil, false, err
	}
	for range 4 {
		m.mu.Lock()
		if m.closed {
			m.mu.Unlock()
			return nil, false, errorf(KindUnavailable, "the environment cache is shutting down")
		}
		if e := m.envs[name]; e != nil && (asIs || e.spec.equal(sp)) {
			if !e.verified {
				m.mu.Unlock()
				if !m.verify(ctx, e) {
					if ctx.Err() != nil {
						return nil, false, fmt.Errorf("checking environment %q: %w", name, context.Cause(ctx))
					}
					// Rebuilt with what it was built with: a request by
					// name alone asks for the environment as it was.
					if asIs {
						sp, asIs = e.spec, false
					}
				}
				continue
			}
			e.users++
			e.lastUsed = m.now()
			m.mu.Unlock()
			return &Pin{m: m, e: e}, created, nil
		}
		b := m.builds[name]
		if b == nil && m.envs[name] == nil {
			// Restored since the last look (see adoptLocked)?
			if remove := m.adoptLocked(); len(remove) > 0 || m.envs[name] != nil {
				m.mu.Unlock()
				m.removeDirs(remove)
				continue
			}
		}
		leader := false
		if b == nil {
			if asIs && !r.CreateEmpty {
				m.mu.Unlock()
				return nil, false, errorf(KindNotFound, "environment %q does not exist (it may have been evicted); send its requirements to create it", name)
			}
			b = m.startBuildLocked(name, sp)
			leader = true
		}
		m.mu.Unlock()
		select {
		case <-b.done:
		case <-ctx.Done():
			return nil, false, fmt.Errorf("waiting for environment %q: %w", name, context.Cause(ctx))
		}
		if b.err != nil && (leader || asIs || b.spec.equal(sp)) {
			return nil, false, b.err
		}
		created = created || leader
	}
	return nil, false, errorf(KindBusy, "environment %q keeps changing under concurrent requests; try again", name)
}

// resolve validates r and works out the environment's name and spec; asIs
// means the request names an environment without saying what it holds.
func (m *Manager) resolve(r Request) (name string, sp spec, asIs bool, err error) {
	reqs, perr := ParseRequirements(r.Requirements)
	if perr != nil {
		return "", spec{}, false, &Error{Kind: KindInvalid, Msg: perr.Error(), Err: perr}
	}
	if len(m.allowed) > 0 {
		var refused []string
		for _, q := range reqs {
			if !m.allowed[q.Name] {
				refused = append(refused, q.Name)
			}
		}
		if len(refused) > 0 {
			return "", spec{}, false, errorf(KindNotAllowed, "package %s not on this sandbox's allowlist; nothing was installed", quoteList(refused))
		}
	}
	sp.IndexURL, sp.ExtraIndexes = m.cfg.IndexURL, m.cfg.ExtraIndexURLs
	if r.IndexURL != "" {
		if err := checkIndexURL(r.IndexURL); err != nil {
			return "", spec{}, false, &Error{Kind: KindInvalid, Msg: err.Error(), Err: err}
		}
		configured := slices.DeleteFunc(append([]string{m.cfg.IndexURL}, m.cfg.ExtraIndexURLs...), func(u string) bool { return u == "" })
		if len(configured) > 0 && !slices.Contains(configured, r.IndexURL) {
			return "", spec{}, false, errorf(KindNotAllowed, "python_index %q is not one of this sandbox's package indexes", r.IndexURL)
		}
		sp.IndexURL = r.IndexURL
		sp.ExtraIndexes = slices.DeleteFunc(slices.Clone(m.cfg.ExtraIndexURLs), func(u string) bool { return u == r.IndexURL })
	}
	for _, q := range reqs {
		sp.Requirements = append(sp.Requirements, q.String)
	}
	name = r.Name
	switch {
	case name != "":
		if err := ValidName(name); err != nil {
			return "", spec{}, false, &Error{Kind: KindInvalid, Msg: err.Error(), Err: err}
		}
	case len(reqs) == 0:
		return "", spec{}, false, errorf(KindInvalid, "an environment needs a name or requirements")
	default:
		name = sp.keyName()
	}
	// A named environment without requirements is used as it is, whatever
	// index it came from: an index alone must not rebuild it empty.
	return name, sp, len(reqs) == 0, nil
}

func checkIndexURL(s string) error {
	u, err := url.Parse(s)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return fmt.Errorf("package index %q is not an http(s) URL", s)
	}
	return nil
}

// trustedHostRE is a host name or address with an optional port: what
// pip's --trusted-host and uv's --allow-insecure-host take, and nothing
// either could read as an option or a URL.
var trustedHostRE = regexp.MustCompile(`^[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?(:[0-9]{1,5})?$`)

func checkTrustedHost(s string) error {
	if len(s) > 261 || !trustedHostRE.MatchString(s) {
		return fmt.Errorf("trusted host %q is not a host or host:port", s)
	}
	return nil
}

func quoteList(names []string) string {
	q := make([]string, len(names))
	for i, n := range names {
		q[i] = strconv.Quote(n)
	}
	if len(q) == 1 {
		return q[0] + " is"
	}
	return strings.Join(q, ", ") + " are"
}

func (m *Manager) startBuildLocked(name string, sp spec) *build {
	b := &build{spec: sp, done: make(chan struct{})}
	m.builds[name] = b
	m.wg.Add(1)
	go func() {
		defer m.wg.Done()
		start := time.Now()
		e, err := m.build(name, sp)
		m.mu.Lock()
		delete(m.builds, name)
		var remove []string
		if err == nil {
			remove, err = m.installLocked(e)
		}
		m.mu.Unlock()
		// Evicted and replaced directories are gone before any caller
		// hears of the result, so that disk use is back under the limit.
		m.removeDirs(remove)
		b.err = err
		close(b.done)
		if err != nil {
			m.log.Warn("building a Python environment failed", "env", name, "requirements", sp.Requirements,
				"duration_ms", time.Since(start).Milliseconds(), "error", err.Error())
			return
		}
		m.log.Info("built a Python environment", "env", name, "requirements", sp.Requirements, "packages", len(e.packages),
			"size_bytes", e.size, "duration_ms", time.Since(start).Milliseconds())
	}()
	return b
}

// installLocked puts a built environment in the index in place of any of
// the same name, then evicts to the limits. It returns the directories to
// remove once the lock is released.
func (m *Manager) installLocked(e *env) ([]string, error) {
	if e.size > m.cfg.MaxBytes {
		return []string{e.dir}, errorf(KindTooLarge, "environment %q takes %d bytes on disk, more than the cache's %d; it was removed", e.name, e.size, m.cfg.MaxBytes)
	}
	if m.closed {
		return []string{e.dir}, errorf(KindUnavailable, "the environment cache is shutting down")
	}
	var remove []string
	if old := m.envs[e.name]; old != nil {
		remove = append(remove, m.retireLocked(old)...)
	}
	e.lastUsed, e.verified = m.now(), true
	m.envs[e.name] = e
	return append(remove, m.enforceLocked(e)...), nil
}

// retireLocked takes e out of the index; its directory is returned for
// removal now, or removed when its last user releases it.
func (m *Manager) retireLocked(e *env) []string {
	delete(m.envs, e.name)
	e.retired = true
	if e.users == 0 {
		return []string{e.dir}
	}
	return nil
}

// enforceLocked evicts the idle environments unused for longer than the
// time-to-live, then idle environments least recently used first until
// the count and size limits hold or only environments in use (and keep,
// just built) are left.
func (m *Manager) enforceLocked(keep *env) []string {
	var remove []string
	if ttl := m.cfg.TTL; ttl > 0 {
		now := m.now()
		for _, e := range m.envs {
			if e != keep && e.users == 0 && now.Sub(e.lastUsed) > ttl {
				m.log.Info("removing a Python environment unused for longer than its time-to-live", "env", e.name,
					"size_bytes", e.size, "last_used", e.lastUsed, "ttl", ttl.String())
				remove = append(remove, m.retireLocked(e)...)
			}
		}
	}
	for {
		var total int64
		for _, e := range m.envs {
			total += e.size
		}
		if len(m.envs) <= m.cfg.MaxEnvs && total <= m.cfg.MaxBytes {
			return remove
		}
		var victim *env
		for _, e := range m.envs {
			if e == keep || e.users > 0 {
				continue
			}
			if victim == nil || e.lastUsed.Before(victim.lastUsed) {
				victim = e
			}
		}
		if victim == nil {
			return remove
		}
		m.log.Info("evicting a Python environment", "env", victim.name, "size_bytes", victim.size,
			"last_used", victim.lastUsed, "count", len(m.envs), "total_bytes", total)
		remove = append(remove, m.retireLocked(victim)...)
	}
}

func (m *Manager) removeDirs(dirs []string) {
	for _, d := range dirs {
		if err := os.RemoveAll(d); err != nil {
			m.log.Warn("removing an environment directory failed", "dir", d, "error", err.Error())
		}
	}
}

// Delete removes the named environment. One in use is removed from the
// index at once and from disk when its runs end.
func (m *Manager) Delete(name string) (Info, error) {
	m.mu.Lock()
	adoptRemove := m.adoptLocked()
	defer m.removeDirs(adoptRemove)
	if m.builds[name] != nil {
		m.mu.Unlock()
		return Info{}, errorf(KindBusy, "environment %q is being built; delete it when the build has finished", name)
	}
	e := m.envs[name]
	if e == nil {
		m.mu.Unlock()
		return Info{}, errorf(KindNotFound, "environment %q does not exist", name)
	}
	info := e.info()
	remove := m.retireLocked(e)
	m.mu.Unlock()
	m.removeDirs(remove)
	return info, nil
}

// adoptLocked takes in the finished environments that appeared in the
// directory since the manager loaded it: an idle stop's snapshot is
// restored into a fresh workspace through the running supervisor, whose
// manager started on the empty directory. Directories it does not know and
// cannot read are left alone (they may be builds in progress); an
// environment whose name is taken keeps the one in the index. It returns
// the directories that the limits then evict.
func (m *Manager) adoptLocked() []string {
	if m.closed {
		return nil
	}
	entries, err := os.ReadDir(m.dir)
	if err != nil {
		return nil
	}
	known := make(map[string]bool, len(m.envs))
	for _, e := range m.envs {
		known[filepath.Base(e.dir)] = true
	}
	adopted := 0
	for _, de := range entries {
		name := de.Name()
		if !de.IsDir() || known[name] || strings.HasPrefix(name, ".") {
			continue
		}
		e, err := readMeta(filepath.Join(m.dir, name))
		if err != nil || m.envs[e.name] != nil || m.builds[e.name] != nil {
			continue
		}
		m.envs[e.name] = e
		adopted++
	}
	if adopted == 0 {
		return nil
	}
	m.log.Info("found restored Python environments", "count", adopted, "dir", m.dir)
	return m.enforceLocked(nil)
}

// List describes the environments, sorted by name.
func (m *Manager) List() []Info {
	m.mu.Lock()
	remove := m.adoptLocked()
	defer func() {
		m.mu.Unlock()
		m.removeDirs(remove)
	}()
	out := make([]Info, 0, len(m.envs))
	for _, e := range m.envs {
		out = append(out, e.info())
	}
	slices.SortFunc(out, func(a, b Info) int { return strings.Compare(a.Name, b.Name) })
	return out
}

// Stats sums up the cache.
func (m *Manager) Stats() Stats {
	m.mu.Lock()
	defer m.mu.Unlock()
	s := Stats{Count: len(m.envs), MaxCount: m.cfg.MaxEnvs, MaxBytes: m.cfg.MaxBytes, Building: len(m.builds), Installer: "pip", TTL: m.cfg.TTL}
	if m.cfg.UV != "" {
		s.Installer = "uv"
	}
	for _, e := range m.envs {
		s.Bytes += e.size
	}
	return s
}

func (e *env) info() Info {
	state := StateReady
	if !e.verified {
		state = StateUnverified
	}
	return Info{
		Name: e.name, Requirements: slices.Clone(e.spec.Requirements), Packages: slices.Clone(e.packages),
		PythonVersion: e.pyVersion, SizeBytes: e.size, CreatedAt: e.created, LastUsedAt: e.lastUsed,
		InUse: e.users, Dir: e.dir, State: state,
	}
}

// verify checks an environment found on disk against the interpreter it
// runs now: its python must start and be the Python version it was built
// with (major.minor, which names its site-packages). One that fails is
// retired, to be rebuilt. It reports whether e passed; a check cut short
// by ctx passes nothing and retires nothing.
func (m *Manager) verify(ctx context.Context, e *env) bool {
	vctx, cancel := context.WithTimeout(ctx, verifyTimeout)
	defer cancel()
	out := &tailBuffer{max: 4 << 10}
	python := filepath.Join(e.dir, "bin", "python")
	code, err := m.cfg.Run(vctx, []string{python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"}, m.buildEnv(), m.dir, out, out)
	if ctx.Err() != nil {
		return false
	}
	got := strings.TrimSpace(out.String())
	var why string
	switch {
	case err != nil:
		why = "its interpreter does not start: " + err.Error()
	case code != 0:
		why = fmt.Sprintf("its interpreter exited with status %d: %s", code, out.summary())
	case e.pyVersion != "" && got != majorMinor(e.pyVersion):
		why = fmt.Sprintf("it was built for Python %s and the interpreter is now Python %s", e.pyVersion, got)
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if why == "" {
		e.verified = true
		return true
	}
	if m.envs[e.name] == e {
		m.log.Info("rebuilding a Python environment found on disk", "env", e.name, "reason", why)
		remove := m.retireLocked(e)
		// Removed under the lock, so that the rebuild, which starts as
		// soon as the lock is released, does not race with it; the
		// directory holds a few hundred megabytes at most.
		m.removeDirs(remove)
	}
	return false
}

// majorMinor cuts "3.11.2" to "3.11".
func majorMinor(v string) string {
	parts := strings.SplitN(strings.TrimSpace(v), ".", 3)
	if len(parts) < 2 {
		return v
	}
	return parts[0] + "." + parts[1]
}
