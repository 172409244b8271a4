// Package s3server runs a real S3-compatible server for tests: versitygw
// with its posix backend, built from the Go module proxy by `make testenv`
// (the toolchain's versitygw component). Each server serves a fresh
// temporary directory on a free loopback port and is stopped when the test
// ends; tests that find no binary skip with a message saying how to build
// it.
package s3server

import (
	"bufio"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/minio/minio-go/v7"
	"github.com/minio/minio-go/v7/pkg/credentials"

	"github.com/agentbox/terraform-provider-agentbox/internal/testenv/toolchain"
)

// Binary is the versitygw file name under the toolchain's bin directory.
const Binary = "versitygw"

// Server is one running versitygw.
type Server struct {
	// Endpoint is the server's URL, http://127.0.0.1:<port>.
	Endpoint string
	// Bucket exists, empty, when Start returns.
	Bucket string
	// Region the server answers for.
	Region string
	// AccessKeyID and SecretAccessKey are the root account's, random per
	// server.
	AccessKeyID, SecretAccessKey string
	// DataDir is the posix backend's root: one directory per bucket.
	DataDir string

	cmd  *exec.Cmd
	done chan struct{}
	mu   sync.Mutex
	log  strings.Builder
}

// BinaryPath returns where `make testenv` puts versitygw.
func BinaryPath() (string, error) {
	dir, err := toolchain.DefaultDir()
	if err != nil {
		return "", err
	}
	return filepath.Join(toolchain.BinDir(dir), Binary), nil
}

// Start runs a server with one bucket, or skips the test when the binary has
// not been built. The server is stopped, and its directory removed, when
// the test ends.
func Start(tb testing.TB) *Server {
	tb.Helper()
	return StartOn(tb, "127.0.0.1")
}

// StartOn is Start on a free port of host, an address of this machine:
// pods of the test cluster reach testenv.NodeIP, not the loopback address.
func StartOn(tb testing.TB, host string) *Server {
	tb.Helper()
	bin, err := BinaryPath()
	if err != nil {
		tb.Skipf("no S3 server: %v", err)
	}
	if _, err := os.Stat(bin); err != nil {
		tb.Skipf("no S3 server: %s is not built; run `make testenv` (it builds versitygw from the Go module proxy)", bin)
	}
	root := tb.TempDir()
	s := &Server{
		Bucket:          "agentbox-test",
		Region:          "us-east-1",
		AccessKeyID:     "test" + randomHex(tb, 8),
		SecretAccessKey: randomHex(tb, 20),
		DataDir:         filepath.Join(root, "data"),
	}
	meta := filepath.Join(root, "meta")
	for _, d := range []string{s.DataDir, meta} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			tb.Fatal(err)
		}
	}
	// The port is picked by the kernel and handed over; another process
	// may take it in between, so a failed start is retried.
	for attempt := 1; ; attempt++ {
		addr := freeAddr(tb, host)
		// The metadata goes to a sidecar directory rather than extended
		// attributes, which not every test filesystem supports.
		err := s.start(bin, addr, meta)
		if err == nil {
			break
		}
		if attempt == 3 {
			tb.Fatalf("start versitygw: %v\n%s", err, s.output())
		}
	}
	tb.Cleanup(s.Stop)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := s.Client(tb).MakeBucket(ctx, s.Bucket, minio.MakeBucketOptions{Region: s.Region}); err != nil {
		tb.Fatalf("create bucket %s: %v\n%s", s.Bucket, err, s.output())
	}
	return s
}

func (s *Server) start(bin, addr, meta string) error {
	s.cmd = exec.Command(bin,
		"--access", s.AccessKeyID, "--secret", s.SecretAccessKey, "--region", s.Region,
		"--port", addr, "--quiet",
		"posix", "--sidecar", meta, s.DataDir)
	// Credentials travel as flags, not through the environment, so that
	// nothing of the test's environment leaks into the server's.
	s.cmd.Env = []string{"PATH=" + os.Getenv("PATH")}
	out, err := s.cmd.StdoutPipe()
	if err != nil {
		return err
	}
	s.cmd.Stderr = s.cmd.Stdout
	if err := s.cmd.Start(); err != nil {
		return err
	}
	s.done = make(chan struct{})
	go func() {
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			s.mu.Lock()
			s.log.WriteString(sc.Text() + "\n")
			s.mu.Unlock()
		}
		_ = s.cmd.Wait()
		close(s.done)
	}()
	s.Endpoint = "http://" + addr
	deadline := time.Now().Add(20 * time.Second)
	for {
		c, err := net.DialTimeout("tcp", addr, time.Second)
		if err == nil {
			c.Close()
			return nil
		}
		select {
		case <-s.done:
			return errors.New("versitygw exited before listening")
		case <-time.After(50 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			s.Stop()
			return fmt.Errorf("versitygw did not listen on %s within 20s", addr)
		}
	}
}

// Client returns a client for the server as its root account.
func (s *Server) Client(tb testing.TB) *minio.Client {
	tb.Helper()
	c, err := minio.New(strings.TrimPrefix(s.Endpoint, "http://"), &minio.Options{
		Creds:  credentials.NewStaticV4(s.AccessKeyID, s.SecretAccessKey, ""),
		Region: s.Region,
	})
	if err != nil {
		tb.Fatal(err)
	}
	return c
}

// Stop ends the server (SIGTERM, then SIGKILL after 5 s) and waits for it.
// It may be called more than once.
func (s *Server) Stop() {
	if s.cmd == nil || s.cmd.Process == nil {
		return
	}
	select {
	case <-s.done:
		return
	default:
	}
	_ = s.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-s.done:
	case <-time.After(5 * time.Second):
		_ = s.cmd.Process.Kill()
		<-s.done
	}
}

func (s *Server) output() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.log.String()
}

func freeAddr(tb testing.TB, host string) string {
	tb.Helper()
	l, err := net.Listen("tcp", net.JoinHostPort(host, "0"))
	if err != nil {
		tb.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}

func randomHex(tb testing.TB, n int) string {
	b := make([]byte, n)
	if _, err := io.ReadFull(rand.Reader, b); err != nil {
		tb.Fatal(err)
	}
	return hex.EncodeToString(b)
}
