// Package kwok gives tests and benchmarks fake nodes on the test cluster:
// kwok (sigs.k8s.io/kwok) plays the kubelet for the nodes it manages, so
// pods scheduled there become Running without any container, and claims of
// its StorageClass are bound without any disk. Scale benchmarks use it to
// run a thousand sandboxes on a machine that could run a handful.
//
// kwok is built from the Go module proxy into the test environment's
// toolchain cache on first use (about two minutes), and runs as a child
// process of the test. It manages only the nodes annotated
// kwok.x-k8s.io/node=fake, so the real test node is never touched, and the
// fake nodes are tainted so that only pods that ask for them land there.
//
// Fake pods get addresses from PodCIDR, inside the test cluster's fenced
// range, so that a controller dialing them reaches nothing off this host.
package kwok

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/agentbox/terraform-provider-agentbox/internal/testenv/toolchain"
)

// Version is the kwok release that is built and whose stages are used.
const Version = "v0.8.0"

const (
	module  = "sigs.k8s.io/kwok"
	pkg     = module + "/cmd/kwok"
	binName = "kwok"
)

// PodCIDR is where fake pods get their addresses: a block of the test
// cluster's range (198.18.0.0/15) that neither its pods (198.18.0.0/16),
// its Services (198.19.0.0/17) nor its node address use. Nothing answers
// there, and nothing sent there leaves the host.
const PodCIDR = "198.19.240.0/20"

// stageFiles are the stages kwok ships in its module, relative to
// kustomize/stage: nodes become Ready and heartbeat; pods become Ready,
// complete and go away when deleted; claims of StorageClass are bound to
// volumes that exist only as API objects.
var stageFiles = []string{
	"node/fast/node-initialize.yaml",
	"node/heartbeat/node-heartbeat.yaml",
	"pod/fast/pod-ready.yaml",
	"pod/fast/pod-complete.yaml",
	"pod/fast/pod-delete.yaml",
	"volume/fast/pvc-provision.yaml",
	"volume/fast/pv-bind.yaml",
	"volume/fast/pvc-delete.yaml",
	"volume/fast/pv-delete.yaml",
}

// Install is a built kwok and the stage files of the same release.
type Install struct {
	// Binary is the kwok executable in the toolchain cache.
	Binary string
	// StageDir is kwok's kustomize/stage folder in the module cache.
	StageDir string
}

// Ensure returns kwok, building it into the toolchain cache dir (empty
// means toolchain.DefaultDir()) when it is missing or was built by another
// Go release. logf reports progress and may be nil.
func Ensure(ctx context.Context, dir string, logf func(format string, args ...any)) (*Install, error) {
	if logf == nil {
		logf = func(string, ...any) {}
	}
	if dir == "" {
		d, err := toolchain.DefaultDir()
		if err != nil {
			return nil, err
		}
		dir = d
	}
	bin := filepath.Join(toolchain.BinDir(dir), binName)
	stampFile := filepath.Join(dir, "stamps", binName)
	if err := os.MkdirAll(filepath.Dir(stampFile), 0o755); err != nil {
		return nil, err
	}
	// go test runs packages in parallel: the second waits for the
	// first's build and then finds it.
	lock, err := os.OpenFile(stampFile+".lock", os.O_CREATE|os.O_RDWR, 0o644)
	if err != nil {
		return nil, err
	}
	defer lock.Close()
	if err := unix.Flock(int(lock.Fd()), unix.LOCK_EX); err != nil {
		return nil, fmt.Errorf("lock %s: %w", lock.Name(), err)
	}
	defer unix.Flock(int(lock.Fd()), unix.LOCK_UN)

	stamp := Version + " " + runtime.Version() + "\n"
	if got, err := os.ReadFile(stampFile); err != nil || string(got) != stamp || !nonEmpty(bin) {
		t := time.Now()
		logf("kwok: building %s@%s into %s (about two minutes the first time)", pkg, Version, toolchain.BinDir(dir))
		// Plain flags, as anyone would build it, so that a build cache warmed
		// by `go install sigs.k8s.io/kwok/cmd/kwok@` serves this one too.
		cmd := exec.CommandContext(ctx, "go", "install", pkg+"@"+Version)
		cmd.Dir = os.TempDir() // outside any module: the release's own go.mod decides
		cmd.Env = append(os.Environ(), "GOBIN="+toolchain.BinDir(dir), "CGO_ENABLED=0", "GOWORK=off", "GOFLAGS=-buildvcs=false")
		if out, err := cmd.CombinedOutput(); err != nil {
			return nil, fmt.Errorf("go install %s@%s: %w\n%s", pkg, Version, err, tail(out, 30))
		}
		if err := os.WriteFile(stampFile, []byte(stamp), 0o644); err != nil {
			return nil, err
		}
		logf("kwok: built in %s", time.Since(t).Round(time.Second))
	}
	stages, err := stageDir(ctx)
	if err != nil {
		return nil, err
	}
	return &Install{Binary: bin, StageDir: stages}, nil
}

// stageDir finds the release's stage files in the module cache, where go
// install has just put the module (or downloads it, if the cache was
// cleaned since).
func stageDir(ctx context.Context) (string, error) {
	cmd := exec.CommandContext(ctx, "go", "mod", "download", "-json", module+"@"+Version)
	cmd.Dir = os.TempDir()
	cmd.Env = append(os.Environ(), "GOWORK=off", "GOFLAGS=-buildvcs=false")
	out, err := cmd.Output()
	if err != nil {
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			out = append(out, ee.Stderr...)
		}
		return "", fmt.Errorf("go mod download %s@%s: %w\n%s", module, Version, err, tail(out, 10))
	}
	var m struct{ Dir, Error string }
	if err := json.Unmarshal(out, &m); err != nil {
		return "", fmt.Errorf("go mod download -json %s@%s: %w", module, Version, err)
	}
	if m.Error != "" || m.Dir == "" {
		return "", fmt.Errorf("go mod download %s@%s: %s", module, Version, m.Error)
	}
	dir := filepath.Join(m.Dir, "kustomize", "stage")
	for _, f := range stageFiles {
		if !nonEmpty(filepath.Join(dir, f)) {
			return "", fmt.Errorf("kwok %s has no stage %s in %s", Version, f, dir)
		}
	}
	return dir, nil
}

// Kwok is a running kwok process.
type Kwok struct {
	// Addr is the loopback host:port of kwok's server (health, and the
	// kubelet endpoints of its nodes).
	Addr string
	// Dir holds its configuration and log.
	Dir  string
	cmd  *exec.Cmd
	done chan struct{}
	err  error
}

// Start builds kwok if needed (see Ensure) and runs it against the cluster
// of kubeconfig, with its configuration and log in dir, until Stop.
func Start(ctx context.Context, kubeconfig, dir string) (*Kwok, error) {
	in, err := Ensure(ctx, "", nil)
	if err != nil {
		return nil, err
	}
	return in.Start(ctx, kubeconfig, dir)
}

// Start runs kwok on a free loopback port and waits until it serves.
func (in *Install) Start(ctx context.Context, kubeconfig, dir string) (*Kwok, error) {
	var lastErr error
	// The free port is chosen before kwok binds it, so another process
	// may take it first; a few tries cover that.
	for try := 0; try < 3; try++ {
		k, err := in.start(ctx, kubeconfig, dir)
		if err == nil {
			return k, nil
		}
		lastErr = err
		if !strings.Contains(err.Error(), "address already in use") {
			break
		}
	}
	return nil, lastErr
}

func (in *Install) start(ctx context.Context, kubeconfig, dir string) (*Kwok, error) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, err
	}
	config, err := in.config()
	if err != nil {
		return nil, err
	}
	configPath := filepath.Join(dir, "kwok.yaml")
	if err := os.WriteFile(configPath, config, 0o644); err != nil {
		return nil, err
	}
	port, err := freePort()
	if err != nil {
		return nil, err
	}
	addr := net.JoinHostPort("127.0.0.1", strconv.Itoa(port))
	logPath := filepath.Join(dir, "kwok.log")
	logFile, err := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|os.O_TRUNC, 0o644)
	if err != nil {
		return nil, err
	}
	defer logFile.Close()
	cmd := exec.Command(in.Binary,
		"--config="+configPath,
		"--kubeconfig="+kubeconfig,
		"--manage-all-nodes=false",
		"--manage-nodes-with-annotation-selector="+ManageAnnotation+"="+ManageAnnotationValue,
		"--cidr="+PodCIDR,
		// The address the fake nodes report; the API server's node proxy
		// reaches kwok's server there.
		"--node-ip=127.0.0.1",
		"--node-port="+strconv.Itoa(port),
		"--server-address="+addr,
	)
	cmd.Dir = dir
	cmd.Stdout, cmd.Stderr = logFile, logFile
	// kwok must not outlive a test binary that dies without Stop.
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGTERM, Setpgid: true}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start kwok: %w", err)
	}
	k := &Kwok{Addr: addr, Dir: dir, cmd: cmd, done: make(chan struct{})}
	go func() { k.err = cmd.Wait(); close(k.done) }()
	if err := k.waitHealthy(ctx, time.Minute); err != nil {
		_ = k.Stop()
		log, _ := os.ReadFile(logPath)
		return nil, fmt.Errorf("kwok did not become healthy: %w\n%s", err, tail(log, 20))
	}
	return k, nil
}

// config is a KwokConfiguration followed by the stages. Options that come
// from a configuration file get no defaults, so the parallelism is set here.
func (in *Install) config() ([]byte, error) {
	var b bytes.Buffer
	b.WriteString(`apiVersion: config.kwok.x-k8s.io/v1alpha1
kind: KwokConfiguration
options:
  podPlayStageParallelism: 4
  nodePlayStageParallelism: 2
  nodeLeaseParallelism: 2
  podsOnNodeSyncParallelism: 1
`)
	for _, f := range stageFiles {
		data, err := os.ReadFile(filepath.Join(in.StageDir, f))
		if err != nil {
			return nil, err
		}
		b.WriteString("---\n")
		b.Write(bytes.TrimSpace(data))
		b.WriteString("\n")
	}
	return b.Bytes(), nil
}

func (k *Kwok) waitHealthy(ctx context.Context, timeout time.Duration) error {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	hc := &http.Client{Timeout: 2 * time.Second}
	url := "http://" + k.Addr + "/healthz"
	for {
		select {
		case <-k.done:
			return fmt.Errorf("kwok exited: %v", k.err)
		default:
		}
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
		if resp, err := hc.Do(req); err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return nil
			}
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-k.done:
			return fmt.Errorf("kwok exited: %v", k.err)
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// Stop ends kwok: SIGTERM, then SIGKILL after ten seconds. The nodes it
// managed stay; delete them with DeleteNode.
func (k *Kwok) Stop() error {
	select {
	case <-k.done:
		return nil
	default:
	}
	_ = k.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-k.done:
	case <-time.After(10 * time.Second):
		_ = k.cmd.Process.Kill()
		<-k.done
	}
	return nil
}

// Log returns what kwok has written so far.
func (k *Kwok) Log() string {
	b, _ := os.ReadFile(filepath.Join(k.Dir, "kwok.log"))
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

func nonEmpty(p string) bool {
	fi, err := os.Stat(p)
	return err == nil && fi.Size() > 0
}

func tail(b []byte, lines int) string {
	l := strings.Split(strings.TrimRight(string(b), "\n"), "\n")
	if len(l) > lines {
		l = l[len(l)-lines:]
	}
	return strings.Join(l, "\n")
}
