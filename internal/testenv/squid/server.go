package squid

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"net"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// Config is what a test server allows and how it resolves names.
type Config struct {
	// Allow lists the destination hosts squid lets through, in the
	// egress proxy's syntax: exact names, or "*.example.com", which
	// becomes squid's ".example.com" (that also matches example.com
	// itself, unlike the egress proxy's wildcard).
	Allow []string
	// Hosts maps names to the IP addresses squid resolves them to; it is
	// squid's only source of addresses.
	Hosts map[string]string
	// AccessLog writes one line per request to the run folder, as a
	// deployed squid does; false turns it off.
	AccessLog bool
	// Extra lines are appended to squid.conf.
	Extra []string
}

// Server is a running squid.
type Server struct {
	// Addr is the 127.0.0.1:port squid listens on.
	Addr string
	// Dir is the run folder: squid.conf, logs, pid file.
	Dir  string
	cmd  *exec.Cmd
	done chan struct{} // closed when squid has exited
	err  error         // how it exited, once done is closed
}

// Start runs squid in the foreground (-N: one process, no SMP workers, no
// daemon) on a free loopback port and waits until it accepts connections.
// Stop ends it and removes its folder.
func (i *Install) Start(ctx context.Context, cfg Config) (*Server, error) {
	var lastErr error
	// A free port is chosen before squid binds it (squid refuses port 0),
	// so another process may take it first; a few tries cover that.
	for try := 0; try < 3; try++ {
		s, err := i.start(ctx, cfg)
		if err == nil {
			return s, nil
		}
		lastErr = err
		if !strings.Contains(err.Error(), "in use") {
			break
		}
	}
	return nil, lastErr
}

func (i *Install) start(ctx context.Context, cfg Config) (*Server, error) {
	// Not under a test's TempDir: when the tests run as root squid drops
	// to "nobody", which must be able to reach this folder.
	dir, err := os.MkdirTemp("", "agentbox-squid-")
	if err != nil {
		return nil, err
	}
	ok := false
	defer func() {
		if !ok {
			os.RemoveAll(dir)
		}
	}()
	port, err := freePort()
	if err != nil {
		return nil, err
	}
	// squid reads the error templates after dropping privileges, so they
	// are copied next to the config rather than read from a cache folder
	// that "nobody" may not be allowed into.
	if err := os.CopyFS(filepath.Join(dir, "errors"), os.DirFS(templatesDir(i))); err != nil {
		return nil, fmt.Errorf("copy error templates: %w", err)
	}
	conf, err := i.config(dir, port, cfg)
	if err != nil {
		return nil, err
	}
	if err := os.WriteFile(filepath.Join(dir, "squid.conf"), []byte(conf), 0o644); err != nil {
		return nil, err
	}
	if os.Geteuid() == 0 {
		if err := chownTree(dir, "nobody"); err != nil {
			return nil, err
		}
	}
	stderr, err := os.Create(filepath.Join(dir, "stderr.log"))
	if err != nil {
		return nil, err
	}
	defer stderr.Close()
	cmd := exec.Command(i.Binary(), "-N", "-d", "1", "-f", filepath.Join(dir, "squid.conf"))
	cmd.Env = i.env()
	cmd.Dir = dir
	cmd.Stdout, cmd.Stderr = stderr, stderr
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start squid: %w", err)
	}
	s := &Server{Addr: net.JoinHostPort("127.0.0.1", strconv.Itoa(port)), Dir: dir, cmd: cmd, done: make(chan struct{})}
	go func() {
		s.err = cmd.Wait()
		close(s.done)
	}()
	deadline := time.Now().Add(20 * time.Second)
	for {
		select {
		case <-s.done:
			log, _ := os.ReadFile(filepath.Join(dir, "stderr.log"))
			return nil, fmt.Errorf("squid exited before accepting connections: %v: %s", s.err, tail(string(log), 8))
		case <-ctx.Done():
			s.kill()
			return nil, ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
		if c, err := net.DialTimeout("tcp", s.Addr, time.Second); err == nil {
			c.Close()
			ok = true
			return s, nil
		}
		if time.Now().After(deadline) {
			s.kill()
			return nil, fmt.Errorf("squid did not listen on %s within 20s", s.Addr)
		}
	}
}

func (i *Install) config(dir string, port int, cfg Config) (string, error) {
	var hosts strings.Builder
	names := make([]string, 0, len(cfg.Hosts))
	for n := range cfg.Hosts {
		names = append(names, n)
	}
	sort.Strings(names)
	for _, n := range names {
		if net.ParseIP(cfg.Hosts[n]) == nil {
			return "", fmt.Errorf("hosts: %q is not an IP address", cfg.Hosts[n])
		}
		fmt.Fprintf(&hosts, "%s %s\n", cfg.Hosts[n], n)
	}
	if err := os.WriteFile(filepath.Join(dir, "hosts"), []byte(hosts.String()), 0o644); err != nil {
		return "", err
	}
	var domains []string
	for _, a := range cfg.Allow {
		a = strings.ToLower(strings.TrimSpace(a))
		switch {
		case a == "":
		case a == "*" || strings.Contains(strings.TrimPrefix(a, "*."), "*"):
			return "", fmt.Errorf("allow %q: not supported here", a)
		default:
			domains = append(domains, strings.TrimPrefix(a, "*"))
		}
	}
	if len(domains) == 0 {
		return "", errors.New("empty allowlist")
	}
	access := "access_log none"
	if cfg.AccessLog {
		access = "access_log stdio:" + filepath.Join(dir, "access.log")
	}
	lines := []string{
		fmt.Sprintf("http_port 127.0.0.1:%d", port),
		"visible_hostname agentbox-squid-test",
		"acl allowed dstdomain " + strings.Join(domains, " "),
		"http_access allow allowed",
		"http_access deny all",
		// Forward only, like the egress proxy: no cache, no headers the
		// egress proxy does not add either.
		"cache deny all",
		"cache_mem 0 MB",
		"digest_generation off",
		"via off",
		"forwarded_for delete",
		// Names come from the hosts file only. The name server is
		// loopback, where nothing listens, so a name missing from the
		// file fails instead of reaching real DNS.
		"hosts_file " + filepath.Join(dir, "hosts"),
		"dns_nameservers 127.0.0.1",
		"pinger_enable off",
		"icp_port 0",
		"htcp_port 0",
		"snmp_port 0",
		"cache_effective_user nobody",
		"pid_filename " + filepath.Join(dir, "squid.pid"),
		access,
		"cache_log " + filepath.Join(dir, "cache.log"),
		"cache_store_log none",
		"coredump_dir " + dir,
		// The compiled-in paths are under /usr; an unpacked squid has
		// its files elsewhere.
		"mime_table " + i.path("usr/share/squid/mime.conf"),
		"icon_directory " + i.path("usr/share/squid/icons"),
		"error_directory " + filepath.Join(dir, "errors"),
		"err_page_stylesheet " + i.path("etc/squid/errorpage.css"),
		"unlinkd_program " + i.path("usr/lib/squid/unlinkd"),
		"shutdown_lifetime 0 seconds",
	}
	lines = append(lines, cfg.Extra...)
	return strings.Join(lines, "\n") + "\n", nil
}

// Stop ends squid (SIGTERM, then SIGKILL after 10s) and removes its
// folder. Calling it again does nothing more.
func (s *Server) Stop() error {
	select {
	case <-s.done:
	default:
		s.cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-s.done:
		case <-time.After(10 * time.Second):
			s.kill()
		}
	}
	return os.RemoveAll(s.Dir)
}

func (s *Server) kill() {
	s.cmd.Process.Kill()
	<-s.done
}

// Pid is squid's process id, for reading its CPU time.
func (s *Server) Pid() int { return s.cmd.Process.Pid }

// Log returns squid's cache.log, for a failing test to show.
func (s *Server) Log() string {
	b, _ := os.ReadFile(filepath.Join(s.Dir, "cache.log"))
	return string(b)
}

// AccessLog returns the access log (Config.AccessLog).
func (s *Server) AccessLog() string {
	b, _ := os.ReadFile(filepath.Join(s.Dir, "access.log"))
	return string(b)
}

func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

func chownTree(dir, name string) error {
	u, err := user.Lookup(name)
	if err != nil {
		return fmt.Errorf("squid runs as %q when started by root: %w", name, err)
	}
	uid, _ := strconv.Atoi(u.Uid)
	gid, _ := strconv.Atoi(u.Gid)
	return filepath.WalkDir(dir, func(p string, _ fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		return os.Lchown(p, uid, gid)
	})
}
