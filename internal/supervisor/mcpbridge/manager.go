// Package mcpbridge runs a sandbox template's stdio MCP servers inside the
// pod, connects to its remote (Streamable HTTP) ones, and bridges their
// JSON-RPC onto the supervisor's HTTP API.
//
// Why it exists: a stdio MCP server has to be a child of something that
// lives in the sandbox, next to the code and files it works on, and the
// control plane can only reach the pod over the supervisor's mutually
// authenticated HTTP. So the supervisor owns the servers' lifetimes (a
// server that dies must come back without anyone asking, but one that
// dies at once must not spin and take the supervisor down with it) and
// speaks MCP to them through the official SDK rather than a hand-written
// JSON-RPC client, so that handshake, protocol-version negotiation and
// message framing follow the specification as it changes. The tool list is
// cached because the control plane builds its tool catalog from it and
// should not wake every server each time it does.
//
// The package is kept apart from package supervisor so that the MCP SDK
// is the only thing it adds to the supervisor, and it never links
// client-go or control-plane code.
package mcpbridge

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"sync"
	"syscall"
	"time"

	api "github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"

	"github.com/modelcontextprotocol/go-sdk/mcp"

	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/procenv"
)

// Defaults for Config's zero values.
const (
	DefaultInitialBackoff  = 500 * time.Millisecond
	DefaultMaxBackoff      = 30 * time.Second
	DefaultStableAfter     = time.Minute
	DefaultStartTimeout    = 30 * time.Second
	DefaultCallTimeout     = 60 * time.Second
	DefaultMaxCallTimeout  = 10 * time.Minute
	DefaultStopGrace       = 3 * time.Second
	DefaultMaxRequestBytes = 1 << 20
	DefaultMaxConcurrent   = 32
	DefaultPath            = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
	// stderrTail is how much of a server's standard error is kept to
	// explain why it died.
	stderrTail = 4 << 10
)

// ServerConfig is one MCP server of the template: stdio (Command) or
// remote (URL). It is the supervisor API's type, because the control
// plane writes it (from the SandboxTemplate) and the supervisor reads it.
type ServerConfig = api.MCPServerConfig

// ChildTracker is told about the processes the Manager starts. The
// supervisor's orphan reaper must not reap them, or the exit status the
// Manager waits for would be stolen; a tracker lets it register them.
type ChildTracker interface {
	// Start calls start, which starts one process and returns its PID,
	// and records the PID as a child that its owner waits for itself.
	Start(start func() (pid int, err error)) error
	// Done is called once the process has been waited for.
	Done(pid int)
}

// Config configures a Manager. Zero values mean the defaults above.
type Config struct {
	Servers []ServerConfig
	// BaseEnv is every server's starting environment. Nil means
	// PATH=DefaultPath and LANG=C.UTF-8. HOME is the server's directory
	// unless BaseEnv or the server's Env sets it.
	BaseEnv map[string]string
	// DefaultDir is where servers without a Dir run; empty means the
	// supervisor's working directory.
	DefaultDir string
	// InitialBackoff is the wait before the first restart; it doubles up
	// to MaxBackoff with each failure in a row, and starts over once a
	// server has run for StableAfter.
	InitialBackoff time.Duration
	MaxBackoff     time.Duration
	StableAfter    time.Duration
	// StartTimeout bounds a server's start-up: the MCP handshake and the
	// first tools/list.
	StartTimeout time.Duration
	// CallTimeout bounds each bridged call unless the request asks for
	// less or more (up to MaxCallTimeout) with the X-Timeout-Seconds
	// header.
	CallTimeout    time.Duration
	MaxCallTimeout time.Duration
	// StopGrace is how long Stop waits after SIGTERM before SIGKILL.
	StopGrace time.Duration
	// MaxRequestBytes bounds a bridged request's body.
	MaxRequestBytes int64
	// MaxConcurrentCalls bounds the bridged calls in flight across all
	// servers; more are refused with resource_exhausted.
	MaxConcurrentCalls int
	// Tracker, when set, is told about every process started.
	Tracker ChildTracker
	// RemoteTransport carries the HTTP requests to remote servers. Nil
	// means RemoteTransport(BaseEnv): the sandbox's egress proxy and trust
	// store.
	RemoteTransport http.RoundTripper
	// ClientName and Version are what the bridge calls itself in the MCP
	// handshake.
	ClientName string
	Version    string
	Logger     *slog.Logger
}

// State is where a server is in its life cycle.
type State string

const (
	StateStarting State = "starting" // started, handshake not finished
	StateRunning  State = "running"  // accepting calls
	StateBackoff  State = "backoff"  // exited or failed to start; waiting to restart
	StateStopped  State = "stopped"  // Stop was called, or Start never was
)

// Status is a server's state as GET /mcp reports it.
type Status struct {
	Name  string `json:"name"`
	State State  `json:"state"`
	// URL is a remote server's endpoint; PID a stdio server's process.
	URL string `json:"url,omitempty"`
	PID int    `json:"pid,omitempty"`
	// Restarts counts the starts after the first.
	Restarts int `json:"restarts"`
	// LastError is why the server last exited or failed to start,
	// including the end of its standard error.
	LastError   string     `json:"last_error,omitempty"`
	LastExitAt  *time.Time `json:"last_exit_at,omitempty"`
	StartedAt   *time.Time `json:"started_at,omitempty"`
	BackoffMS   int64      `json:"backoff_ms,omitempty"`
	NextStartAt *time.Time `json:"next_start_at,omitempty"`
	// ServerInfo and ProtocolVersion come from the handshake.
	ServerInfo      *mcp.Implementation `json:"server_info,omitempty"`
	ProtocolVersion string              `json:"protocol_version,omitempty"`
	Tools           int                 `json:"tools"`
	ToolsUpdatedAt  *time.Time          `json:"tools_updated_at,omitempty"`
	ToolsError      string              `json:"tools_error,omitempty"`
}

// Manager starts, supervises and stops the servers, and serves the bridge
// (see ServeHTTP).
type Manager struct {
	cfg     Config
	log     *slog.Logger
	servers map[string]*server
	names   []string
	slots   chan struct{}
	// remoteBase is the transport under every remote server's.
	remoteBase http.RoundTripper

	mu      sync.Mutex
	started bool
	cancel  context.CancelFunc
	wg      sync.WaitGroup
}

// server is one supervised MCP server.
type server struct {
	m       *Manager
	cfg     ServerConfig
	dir     string
	env     []string
	pathEnv string // PATH of the server's environment
	// httpClient reaches a remote server (cfg.URL); nil for stdio ones.
	httpClient *http.Client

	mu          sync.Mutex
	state       State
	session     *mcp.ClientSession
	gen         uint64 // counts sessions, so a late refresh cannot touch a newer one
	pid         int
	restarts    int
	lastErr     string
	lastExitAt  time.Time
	startedAt   time.Time
	backoff     time.Duration
	nextStartAt time.Time
	tools       []*mcp.Tool
	toolsAt     time.Time
	toolsErr    string
}

var validName = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$`)

// New checks cfg and returns a Manager; nothing starts before Start.
func New(cfg Config) (*Manager, error) {
	def := func(d *time.Duration, v time.Duration) {
		if *d <= 0 {
			*d = v
		}
	}
	def(&cfg.InitialBackoff, DefaultInitialBackoff)
	def(&cfg.MaxBackoff, DefaultMaxBackoff)
	def(&cfg.StableAfter, DefaultStableAfter)
	def(&cfg.StartTimeout, DefaultStartTimeout)
	def(&cfg.CallTimeout, DefaultCallTimeout)
	def(&cfg.MaxCallTimeout, DefaultMaxCallTimeout)
	def(&cfg.StopGrace, DefaultStopGrace)
	if cfg.InitialBackoff > cfg.MaxBackoff {
		return nil, fmt.Errorf("initial backoff %s exceeds the maximum %s", cfg.InitialBackoff, cfg.MaxBackoff)
	}
	if cfg.CallTimeout > cfg.MaxCallTimeout {
		return nil, fmt.Errorf("call timeout %s exceeds the maximum %s", cfg.CallTimeout, cfg.MaxCallTimeout)
	}
	if cfg.MaxRequestBytes <= 0 {
		cfg.MaxRequestBytes = DefaultMaxRequestBytes
	}
	if cfg.MaxConcurrentCalls <= 0 {
		cfg.MaxConcurrentCalls = DefaultMaxConcurrent
	}
	if cfg.ClientName == "" {
		cfg.ClientName = "agentbox-supervisor"
	}
	if cfg.Version == "" {
		cfg.Version = "dev"
	}
	log := cfg.Logger
	if log == nil {
		log = slog.Default()
	}
	if err := procenv.Validate(cfg.BaseEnv); err != nil {
		return nil, fmt.Errorf("base environment: %w", err)
	}
	defDir := cfg.DefaultDir
	if defDir == "" {
		wd, err := os.Getwd()
		if err != nil {
			return nil, fmt.Errorf("default dir: %w", err)
		}
		defDir = wd
	}
	m := &Manager{
		cfg:     cfg,
		log:     log,
		servers: make(map[string]*server, len(cfg.Servers)),
		slots:   make(chan struct{}, cfg.MaxConcurrentCalls),
	}
	for i, sc := range cfg.Servers {
		s, err := m.newServer(sc, defDir)
		if err != nil {
			return nil, fmt.Errorf("mcp server %d (%q): %w", i, sc.Name, err)
		}
		if _, dup := m.servers[sc.Name]; dup {
			return nil, fmt.Errorf("mcp server %q is configured twice", sc.Name)
		}
		m.servers[sc.Name] = s
		m.names = append(m.names, sc.Name)
	}
	sort.Strings(m.names)
	return m, nil
}

func (m *Manager) newServer(sc ServerConfig, defDir string) (*server, error) {
	if !validName.MatchString(sc.Name) {
		return nil, errors.New("name must be 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit")
	}
	if sc.URL != "" {
		return m.newRemoteServer(sc)
	}
	if sc.Command == "" {
		return nil, errors.New("command or url must be set")
	}
	for i, a := range append([]string{sc.Command, sc.Dir}, sc.Args...) {
		if strings.IndexByte(a, 0) >= 0 {
			return nil, fmt.Errorf("command, dir or argument %d contains a NUL byte", i)
		}
	}
	if err := procenv.Validate(sc.Env); err != nil {
		return nil, fmt.Errorf("env: %w", err)
	}
	dir := sc.Dir
	if dir == "" {
		dir = defDir
	} else if !filepath.IsAbs(dir) {
		dir = filepath.Join(defDir, dir)
	}
	env := map[string]string{}
	if m.cfg.BaseEnv == nil {
		env = map[string]string{"PATH": DefaultPath, "LANG": "C.UTF-8"}
	}
	for k, v := range m.cfg.BaseEnv {
		env[k] = v
	}
	if _, ok := env["HOME"]; !ok {
		// npm-based servers want a HOME for their caches.
		env["HOME"] = dir
	}
	for k, v := range sc.Env {
		env[k] = v
	}
	list := make([]string, 0, len(env))
	for k, v := range env {
		list = append(list, k+"="+v)
	}
	sort.Strings(list)
	return &server{
		m:       m,
		cfg:     sc,
		dir:     dir,
		env:     list,
		pathEnv: env["PATH"],
		state:   StateStopped,
	}, nil
}

// Names lists the configured servers, sorted.
func (m *Manager) Names() []string { return append([]string(nil), m.names...) }

// Start launches every server and supervises it until Stop. It returns at
// once: servers start in the background, and one that fails is retried
// with backoff rather than failing Start. ctx bounds the supervision.
func (m *Manager) Start(ctx context.Context) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.started {
		return
	}
	m.started = true
	ctx, m.cancel = context.WithCancel(ctx)
	for _, name := range m.names {
		s := m.servers[name]
		m.wg.Add(1)
		go func() {
			defer m.wg.Done()
			s.supervise(ctx)
		}()
	}
}

// Stop stops supervising, sends SIGTERM to every server's process group,
// SIGKILL after StopGrace, and returns once all are gone or ctx is done.
func (m *Manager) Stop(ctx context.Context) error {
	m.mu.Lock()
	cancel := m.cancel
	m.mu.Unlock()
	if cancel == nil {
		return nil
	}
	cancel()
	done := make(chan struct{})
	go func() {
		m.wg.Wait()
		close(done)
	}()
	select {
	case <-done:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// Statuses reports every server, sorted by name.
func (m *Manager) Statuses() []Status {
	out := make([]Status, 0, len(m.names))
	for _, name := range m.names {
		out = append(out, m.servers[name].status())
	}
	return out
}

// Status reports one server.
func (m *Manager) Status(name string) (Status, bool) {
	s, ok := m.servers[name]
	if !ok {
		return Status{}, false
	}
	return s.status(), true
}

func (s *server) status() Status {
	s.mu.Lock()
	defer s.mu.Unlock()
	st := Status{
		Name:       s.cfg.Name,
		URL:        s.cfg.URL,
		State:      s.state,
		PID:        s.pid,
		Restarts:   s.restarts,
		LastError:  s.lastErr,
		Tools:      len(s.tools),
		ToolsError: s.toolsErr,
	}
	tp := func(t time.Time) *time.Time {
		if t.IsZero() {
			return nil
		}
		t = t.UTC()
		return &t
	}
	st.LastExitAt = tp(s.lastExitAt)
	st.ToolsUpdatedAt = tp(s.toolsAt)
	switch s.state {
	case StateRunning, StateStarting:
		st.StartedAt = tp(s.startedAt)
	case StateBackoff:
		st.BackoffMS = s.backoff.Milliseconds()
		st.NextStartAt = tp(s.nextStartAt)
	}
	if s.state == StateRunning && s.session != nil {
		if ir := s.session.InitializeResult(); ir != nil {
			st.ServerInfo = ir.ServerInfo
			st.ProtocolVersion = ir.ProtocolVersion
		}
	}
	return st
}

// supervise runs the server until ctx is done, restarting it with
// exponential backoff.
func (s *server) supervise(ctx context.Context) {
	cfg := &s.m.cfg
	backoff := cfg.InitialBackoff
	for first := true; ; first = false {
		s.mu.Lock()
		if !first {
			s.restarts++
		}
		s.state, s.startedAt, s.backoff, s.nextStartAt = StateStarting, time.Now(), 0, time.Time{}
		s.mu.Unlock()

		started := time.Now()
		err := s.runOnce(ctx)
		if ctx.Err() != nil {
			s.mu.Lock()
			s.state, s.pid, s.session = StateStopped, 0, nil
			s.mu.Unlock()
			return
		}
		if time.Since(started) >= cfg.StableAfter {
			backoff = cfg.InitialBackoff
		}
		now := time.Now()
		s.mu.Lock()
		s.state, s.pid, s.session = StateBackoff, 0, nil
		s.lastErr, s.lastExitAt = err.Error(), now
		s.backoff, s.nextStartAt = backoff, now.Add(backoff)
		s.tools, s.toolsAt, s.toolsErr = nil, time.Time{}, ""
		s.mu.Unlock()
		s.m.log.Warn("mcp server exited; restarting after backoff", "server", s.cfg.Name, "error", err.Error(),
			"backoff", backoff.String())

		t := time.NewTimer(backoff)
		select {
		case <-ctx.Done():
			t.Stop()
			s.mu.Lock()
			s.state, s.backoff, s.nextStartAt = StateStopped, 0, time.Time{}
			s.mu.Unlock()
			return
		case <-t.C:
		}
		backoff = min(2*backoff, cfg.MaxBackoff)
	}
}

// runOnce starts the server, does the MCP handshake, serves until the
// server exits or ctx is done, and makes sure its whole process group is
// gone before it returns. The error says why the server ended.
func (s *server) runOnce(ctx context.Context) error {
	if s.cfg.URL != "" {
		return s.runRemote(ctx)
	}
	cfg := &s.m.cfg
	cmd, tail, err := s.command()
	if err != nil {
		return err
	}
	s.mu.Lock()
	s.gen++
	gen := s.gen
	s.mu.Unlock()
	p := &process{cmd: cmd, tracker: cfg.Tracker, exited: make(chan struct{})}
	defer p.reap()
	startCtx, cancelStart := context.WithTimeout(ctx, cfg.StartTimeout)
	defer cancelStart()
	// A server that hangs before answering the handshake is killed when
	// the start-up times out or Stop is called.
	stopWatch := context.AfterFunc(startCtx, func() { p.killGroup(syscall.SIGKILL) })
	session, err := s.client(gen).Connect(startCtx, p, nil)
	if err != nil {
		stopWatch()
		p.killGroup(syscall.SIGKILL)
		p.reap()
		return p.exitError("start", err, tail, startCtx)
	}

	s.mu.Lock()
	s.session, s.pid = session, p.pid
	s.mu.Unlock()
	if ir := session.InitializeResult(); ir == nil || ir.Capabilities == nil || ir.Capabilities.Tools != nil {
		s.loadTools(startCtx, session, gen)
	}
	stopWatch()
	s.mu.Lock()
	s.state = StateRunning
	s.mu.Unlock()
	s.m.log.Info("mcp server running", "server", s.cfg.Name, "pid", p.pid)

	sessionErr := s.serve(ctx, session, p)
	// Whatever is left of the group goes with the server.
	p.killGroup(syscall.SIGKILL)
	_ = session.Close()
	p.reap()
	return p.exitError("run", sessionErr, tail, ctx)
}

// command is the server's process, set up to start, and the tail of its
// standard error.
func (s *server) command() (*exec.Cmd, *tailBuffer, error) {
	path, err := procenv.LookPath(s.cfg.Command, s.pathEnv, s.dir)
	if err != nil {
		return nil, nil, fmt.Errorf("start: %w", err)
	}
	cmd := exec.Command(path, s.cfg.Args...)
	cmd.Args[0] = s.cfg.Command
	cmd.Dir = s.dir
	cmd.Env = s.env
	// Its own group, so that Stop and a restart also end whatever the
	// server started (npx, shells and the like spawn the real server).
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	tail := &tailBuffer{max: stderrTail}
	cmd.Stderr = tail
	// Something that left the group (setsid) and kept stderr open must not
	// keep Wait from returning once the server is dead.
	cmd.WaitDelay = time.Second
	return cmd, tail, nil
}

// client is the MCP client of the server's gen-th run.
func (s *server) client(gen uint64) *mcp.Client {
	cfg := &s.m.cfg
	return mcp.NewClient(&mcp.Implementation{Name: cfg.ClientName, Version: cfg.Version}, &mcp.ClientOptions{
		// No roots, sampling or elicitation: nobody is there to answer
		// the server's questions.
		Capabilities: &mcp.ClientCapabilities{},
		ToolListChangedHandler: func(context.Context, *mcp.ToolListChangedRequest) {
			// Not on the session's reading goroutine, which the
			// tools/list response has to come through.
			go s.refreshTools(gen)
		},
		Logger: s.m.log.With("mcp_server", s.cfg.Name),
	})
}

// serve waits until the session ends, the server's leader exits, or ctx
// is done, which stops the server (SIGTERM, then StopGrace). It returns
// the session's error, if it ended.
func (s *server) serve(ctx context.Context, session *mcp.ClientSession, p *process) error {
	ended := make(chan error, 1)
	go func() { ended <- session.Wait() }()
	select {
	case err := <-ended:
		return err
	case <-p.exited:
		// The leader is gone even if a straggler keeps its stdout open.
	case <-ctx.Done():
		s.mu.Lock()
		s.state = StateStopped
		s.mu.Unlock()
		p.killGroup(syscall.SIGTERM)
		t := time.NewTimer(s.m.cfg.StopGrace)
		select {
		case <-p.exited:
		case <-t.C:
		}
		t.Stop()
	}
	return nil
}

// loadTools fetches the complete tool list for the cache.
func (s *server) loadTools(ctx context.Context, session *mcp.ClientSession, gen uint64) {
	var tools []*mcp.Tool
	var err error
	for t, e := range session.Tools(ctx, nil) {
		if e != nil {
			err = e
			break
		}
		tools = append(tools, t)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if gen != s.gen {
		return
	}
	if err != nil {
		s.toolsErr = err.Error()
		s.m.log.Warn("mcp tools/list failed", "server", s.cfg.Name, "error", err.Error())
		return
	}
	if tools == nil {
		tools = []*mcp.Tool{}
	}
	s.tools, s.toolsAt, s.toolsErr = tools, time.Now(), ""
}

// refreshTools reloads the cache after the server said its tools changed.
func (s *server) refreshTools(gen uint64) {
	s.mu.Lock()
	session := s.session
	current := gen == s.gen && session != nil
	s.mu.Unlock()
	if !current {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), s.m.cfg.CallTimeout)
	defer cancel()
	s.loadTools(ctx, session, gen)
}

// running returns the session to call if the server is running, else
// its status.
func (s *server) running() (*mcp.ClientSession, Status, bool) {
	s.mu.Lock()
	session, state := s.session, s.state
	s.mu.Unlock()
	if state == StateRunning && session != nil {
		return session, Status{}, true
	}
	return nil, s.status(), false
}
