// Package postgres starts a throwaway PostgreSQL server for tests, from the
// server binaries of the host's Debian packages (make testenv installs
// them). The server listens on a Unix socket in its own temporary folder,
// and on TCP only at an address the caller names (StartWith), for pods of
// the test cluster; Stop leaves no process and no files behind.
//
// PostgreSQL refuses to run as root, so when the tests are root the server
// runs as the "postgres" user the Debian package creates, or "nobody".
package postgres

import (
	"bytes"
	"context"
	"database/sql"
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"time"

	_ "github.com/jackc/pgx/v5/stdlib" // the "pgx" database/sql driver
)

// ErrNotInstalled means no PostgreSQL server binaries were found.
var ErrNotInstalled = errors.New("postgresql server binaries (initdb, postgres) not found: install Debian's postgresql package (make testenv does)")

// BinDirEnv overrides where the server binaries are looked up.
const BinDirEnv = "AGENTBOX_POSTGRES_BIN"

// port only names the socket file (.s.PGSQL.<port>): the server opens no
// TCP port.
const port = 5432

// FindBinDir returns the folder holding initdb and postgres: $BinDirEnv,
// else the newest /usr/lib/postgresql/<major>/bin, else the folder of
// "postgres" on PATH.
func FindBinDir() (string, error) {
	if d := os.Getenv(BinDirEnv); d != "" {
		if hasServer(d) {
			return d, nil
		}
		return "", fmt.Errorf("%s=%s: %w", BinDirEnv, d, ErrNotInstalled)
	}
	dirs, _ := filepath.Glob("/usr/lib/postgresql/*/bin")
	sort.Slice(dirs, func(i, j int) bool { return majorOf(dirs[i]) > majorOf(dirs[j]) })
	for _, d := range dirs {
		if hasServer(d) {
			return d, nil
		}
	}
	if p, err := exec.LookPath("postgres"); err == nil {
		if real, err := filepath.EvalSymlinks(p); err == nil {
			p = real
		}
		if d := filepath.Dir(p); hasServer(d) {
			return d, nil
		}
	}
	return "", ErrNotInstalled
}

func majorOf(binDir string) int {
	n, _ := strconv.Atoi(filepath.Base(filepath.Dir(binDir)))
	return n
}

func hasServer(dir string) bool {
	for _, b := range []string{"initdb", "postgres"} {
		if fi, err := os.Stat(filepath.Join(dir, b)); err != nil || fi.IsDir() || fi.Mode()&0o111 == 0 {
			return false
		}
	}
	return true
}

// Server is a running PostgreSQL server. Its superuser is "postgres",
// trusted on the socket without a password.
type Server struct {
	// Version is the server's version line, e.g. "postgres (PostgreSQL) 15.18 ...".
	Version string
	// Dir holds the data folder, the socket and the server log.
	Dir string
	// Host and Port are the TCP address of Options.Listen; Host is empty
	// without one.
	Host string
	Port int

	cmd      *exec.Cmd
	sockPort int
	done     chan struct{}
	err      error // the server's exit status, once done is closed
}

// Start initialises a database cluster in a new temporary folder and
// starts a server on it, returning once it accepts connections. Log lines
// go to Dir/server.log.
func Start(ctx context.Context) (*Server, error) { return StartWith(ctx, Options{}) }

// Options configure StartWith.
type Options struct {
	// Listen, when set, is an IP address the server also listens on over
	// TCP, on a free port (Server.Port), for clients that cannot reach
	// its socket: pods of the test cluster reach the node's address
	// (testenv.NodeIP). It must be an address of this host.
	Listen string
	// Trust is the network (CIDR) whose TCP clients are trusted without a
	// password, e.g. the test cluster's pod range. Required with Listen.
	Trust string
}

// StartWith is Start with options.
func StartWith(ctx context.Context, opts Options) (*Server, error) {
	if (opts.Listen == "") != (opts.Trust == "") {
		return nil, errors.New("postgres: Listen and Trust go together")
	}
	bin, err := FindBinDir()
	if err != nil {
		return nil, err
	}
	cred, owner, err := serverCredential()
	if err != nil {
		return nil, err
	}
	base := os.TempDir()
	if cred != nil && !traversable(base) {
		base = "/tmp"
	}
	dir, err := os.MkdirTemp(base, "agentbox-pg-")
	if err != nil {
		return nil, fmt.Errorf("postgres temp dir: %w", err)
	}
	s := &Server{Dir: dir, done: make(chan struct{})}
	fail := func(err error) (*Server, error) {
		_ = os.RemoveAll(dir)
		return nil, err
	}
	if owner != nil {
		if err := os.Chown(dir, owner.uid, owner.gid); err != nil {
			return fail(fmt.Errorf("give %s to %s: %w", dir, owner.name, err))
		}
	}
	if err := os.Chmod(dir, 0o700); err != nil {
		return fail(err)
	}

	out, err := exec.CommandContext(ctx, filepath.Join(bin, "postgres"), "--version").Output()
	if err != nil {
		return fail(fmt.Errorf("postgres --version: %w", err))
	}
	s.Version = strings.TrimSpace(string(out))

	data := filepath.Join(dir, "data")
	initdb := s.command(ctx, bin, "initdb", cred,
		"-D", data, "-U", "postgres", "--auth=trust", "--encoding=UTF8", "--locale=C", "--no-sync")
	var initOut bytes.Buffer
	initdb.Stdout, initdb.Stderr = &initOut, &initOut
	if err := initdb.Run(); err != nil {
		return fail(fmt.Errorf("initdb: %w\n%s", err, initOut.String()))
	}

	listen, err := s.listenTCP(data, opts)
	if err != nil {
		return fail(err)
	}
	s.sockPort = port
	if s.Port != 0 {
		// One port number names both the socket and the TCP port.
		s.sockPort = s.Port
	}
	if err := s.serve(ctx, bin, data, listen, cred); err != nil {
		return nil, err
	}
	return s, nil
}

// listenTCP sets the server up to listen on opts.Listen, on a free port,
// trusting the clients of opts.Trust, and returns the listen_addresses
// setting: empty, which keeps the server off the network, when opts.Listen
// is.
func (s *Server) listenTCP(data string, opts Options) (string, error) {
	if opts.Listen == "" {
		return "", nil
	}
	p, err := freePort(opts.Listen)
	if err != nil {
		return "", fmt.Errorf("a port on %s: %w", opts.Listen, err)
	}
	s.Port, s.Host = p, opts.Listen
	hba, err := os.OpenFile(filepath.Join(data, "pg_hba.conf"), os.O_APPEND|os.O_WRONLY, 0)
	if err != nil {
		return "", err
	}
	_, err = fmt.Fprintf(hba, "host all all %s trust\n", opts.Trust)
	if cerr := hba.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return "", fmt.Errorf("pg_hba.conf: %w", err)
	}
	return opts.Listen, nil
}

// serve starts the server on data and returns once it accepts
// connections. On failure nothing of the server is left: its folder is
// removed.
func (s *Server) serve(ctx context.Context, bin, data, listen string, cred *syscall.Credential) error {
	logPath := filepath.Join(s.Dir, "server.log")
	logFile, err := os.Create(logPath)
	if err != nil {
		_ = os.RemoveAll(s.Dir)
		return err
	}
	defer logFile.Close()
	// The settings trade durability for speed (the data is thrown away)
	// and keep the server off the network unless asked: listen_addresses
	// is empty then.
	s.cmd = s.command(context.Background(), bin, "postgres", cred,
		"-D", data, "-k", s.Dir, "-p", strconv.Itoa(s.sockPort),
		"-c", "listen_addresses="+listen,
		"-c", "fsync=off", "-c", "synchronous_commit=off", "-c", "full_page_writes=off",
		"-c", "max_connections=200", "-c", "shared_buffers=32MB")
	s.cmd.Stdout, s.cmd.Stderr = logFile, logFile
	// Its own process group lets Stop kill stragglers; the death signal
	// (SIGQUIT: immediate shutdown) stops it if the test binary dies.
	s.cmd.SysProcAttr.Setpgid = true
	s.cmd.SysProcAttr.Pdeathsig = syscall.SIGQUIT
	if err := s.cmd.Start(); err != nil {
		_ = os.RemoveAll(s.Dir)
		return fmt.Errorf("start postgres: %w", err)
	}
	go func() {
		s.err = s.cmd.Wait()
		close(s.done)
	}()
	if err := s.waitReady(ctx, 60*time.Second); err != nil {
		_ = s.Stop()
		log, _ := os.ReadFile(logPath)
		return fmt.Errorf("%w\nserver log:\n%s", err, log)
	}
	return nil
}

func (s *Server) command(ctx context.Context, bin, name string, cred *syscall.Credential, args ...string) *exec.Cmd {
	cmd := exec.CommandContext(ctx, filepath.Join(bin, name), args...)
	cmd.Dir = s.Dir
	cmd.Env = []string{"PATH=/usr/bin:/bin", "LANG=C", "LC_ALL=C", "HOME=" + s.Dir, "TZ=UTC"}
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: cred}
	return cmd
}

type account struct {
	name     string
	uid, gid int
}

// serverCredential picks the unprivileged account to run as when the
// tests are root; it returns nils otherwise.
func serverCredential() (*syscall.Credential, *account, error) {
	if os.Geteuid() != 0 {
		return nil, nil, nil
	}
	for _, name := range []string{"postgres", "nobody"} {
		u, err := user.Lookup(name)
		if err != nil {
			continue
		}
		uid, err1 := strconv.Atoi(u.Uid)
		gid, err2 := strconv.Atoi(u.Gid)
		if err1 != nil || err2 != nil || uid == 0 {
			continue
		}
		return &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid)}, &account{name: name, uid: uid, gid: gid}, nil
	}
	return nil, nil, errors.New("running as root and found neither a postgres nor a nobody user to run PostgreSQL as")
}

// traversable reports whether every folder down to dir can be entered by
// other users, as the unprivileged server must reach its folder.
func traversable(dir string) bool {
	dir, err := filepath.Abs(dir)
	if err != nil {
		return false
	}
	for d := dir; ; d = filepath.Dir(d) {
		fi, err := os.Stat(d)
		if err != nil || fi.Mode().Perm()&0o001 == 0 {
			return false
		}
		if d == filepath.Dir(d) {
			return true
		}
	}
}

func (s *Server) waitReady(ctx context.Context, timeout time.Duration) error {
	db, err := sql.Open("pgx", s.DSN("postgres"))
	if err != nil {
		return err
	}
	defer db.Close()
	deadline := time.Now().Add(timeout)
	for {
		pctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		err = db.PingContext(pctx)
		cancel()
		if err == nil {
			return nil
		}
		select {
		case <-s.done:
			return fmt.Errorf("postgres exited before accepting connections: %v", s.err)
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("postgres did not accept connections within %s: %w", timeout, err)
		}
	}
}

// DSN returns a connection URL for the given database as the superuser.
func (s *Server) DSN(database string) string {
	q := url.Values{"host": {s.Dir}, "port": {strconv.Itoa(s.sockPort)}, "sslmode": {"disable"}}
	return (&url.URL{Scheme: "postgres", User: url.User("postgres"), Path: "/" + database, RawQuery: q.Encode()}).String()
}

// TCPDSN returns a connection URL for the given database over TCP, at
// Options.Listen; "" without one.
func (s *Server) TCPDSN(database string) string {
	if s.Host == "" {
		return ""
	}
	return (&url.URL{Scheme: "postgres", User: url.User("postgres"), Host: net.JoinHostPort(s.Host, strconv.Itoa(s.Port)),
		Path: "/" + database, RawQuery: "sslmode=disable"}).String()
}

// Pause stops every process of the server (SIGSTOP to the postmaster and
// its children): connections stay open and queries hang, as when the
// database's host stalls or its network drops packets. Resume undoes it.
func (s *Server) Pause() error { return s.signalAll(syscall.SIGSTOP) }

// Resume continues a paused server.
func (s *Server) Resume() error { return s.signalAll(syscall.SIGCONT) }

// signalAll signals the postmaster first (a stopped postmaster forks no
// new backend), then its children: each backend and auxiliary process
// makes a session of its own, so the process group does not reach them.
func (s *Server) signalAll(sig syscall.Signal) error {
	select {
	case <-s.done:
		return fmt.Errorf("postgres exited: %v", s.err)
	default:
	}
	pid := s.cmd.Process.Pid
	if err := syscall.Kill(pid, sig); err != nil {
		return fmt.Errorf("signal postgres: %w", err)
	}
	for _, child := range childrenOf(pid) {
		// A child may exit in between; that is not a failure.
		_ = syscall.Kill(child, sig)
	}
	return nil
}

// childrenOf lists the processes whose parent is pid.
func childrenOf(pid int) []int {
	entries, _ := os.ReadDir("/proc")
	var kids []int
	for _, e := range entries {
		p, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		b, err := os.ReadFile(filepath.Join("/proc", e.Name(), "stat"))
		if err != nil {
			continue
		}
		// The parent's pid is the second field after the parenthesised
		// command name, which may itself contain spaces.
		i := bytes.LastIndexByte(b, ')')
		if i < 0 {
			continue
		}
		f := strings.Fields(string(b[i+1:]))
		if len(f) > 1 && f[1] == strconv.Itoa(pid) {
			kids = append(kids, p)
		}
	}
	return kids
}

func freePort(ip string) (int, error) {
	l, err := net.Listen("tcp", net.JoinHostPort(ip, "0"))
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// Pid is the postmaster's process id.
func (s *Server) Pid() int { return s.cmd.Process.Pid }

var dbName = regexp.MustCompile(`^[a-z_][a-z0-9_]{0,62}$`)

// CreateDatabase creates an empty database and returns its DSN.
func (s *Server) CreateDatabase(ctx context.Context, name string) (string, error) {
	if !dbName.MatchString(name) {
		return "", fmt.Errorf("database name %q: use lower-case letters, digits and _", name)
	}
	db, err := sql.Open("pgx", s.DSN("postgres"))
	if err != nil {
		return "", err
	}
	defer db.Close()
	if _, err := db.ExecContext(ctx, `CREATE DATABASE "`+name+`"`); err != nil {
		return "", fmt.Errorf("create database %s: %w", name, err)
	}
	return s.DSN(name), nil
}

// Stop shuts the server down (fast shutdown, then SIGKILL to its process
// group after 30 s), waits for it, and removes its folder.
func (s *Server) Stop() error {
	if s.cmd != nil && s.cmd.Process != nil {
		select {
		case <-s.done:
		default:
			// A paused server must run to shut down.
			_ = s.signalAll(syscall.SIGCONT)
			_ = s.cmd.Process.Signal(syscall.SIGINT)
			select {
			case <-s.done:
			case <-time.After(30 * time.Second):
				_ = syscall.Kill(-s.cmd.Process.Pid, syscall.SIGKILL)
				<-s.done
			}
		}
	}
	if err := os.RemoveAll(s.Dir); err != nil {
		return fmt.Errorf("remove %s: %w", s.Dir, err)
	}
	return nil
}
