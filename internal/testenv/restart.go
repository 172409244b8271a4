package testenv

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"k8s.io/client-go/rest"
)

// AttachShared returns the shared test cluster (see Shared) as a Cluster,
// for tests that inject faults into its components. The kubeconfig lives in
// the cluster's state folder, which names the processes to act on. It skips
// like Shared without a cluster.
func AttachShared(t testing.TB) *Cluster {
	t.Helper()
	cfg, path := Shared(t)
	dir, err := filepath.Abs(filepath.Dir(path))
	if err != nil {
		t.Fatal(err)
	}
	st, err := loadState(dir)
	if err != nil {
		t.Fatalf("the shared cluster's state (next to %s): %v", path, err)
	}
	return &Cluster{st: st, Kubeconfig: st.Kubeconfig, Config: cfg, log: io.Discard}
}

// RestartAPIServer stops kube-apiserver (SIGTERM, then SIGKILL after 10 s)
// and starts it again with the same command line, returning once it is
// ready again, and how long it was down. Clients see their watches end and
// connections refused in between, as when a real control plane node
// restarts its API server.
func (c *Cluster) RestartAPIServer(ctx context.Context) (time.Duration, error) {
	st := c.st
	if fresh, err := loadState(st.Dir); err == nil {
		// Another process (a test attached to the cluster) may have
		// restarted it since this Cluster read the state.
		st.Procs = fresh.Procs
	}
	p := st.proc("kube-apiserver")
	if p == nil || !alive(p.PID) {
		return 0, fmt.Errorf("kube-apiserver is not running")
	}
	cmdline, err := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", p.PID))
	if err != nil {
		return 0, fmt.Errorf("read kube-apiserver's command line: %w", err)
	}
	args := strings.Split(string(bytes.TrimRight(cmdline, "\x00")), "\x00")
	if len(args) < 2 {
		return 0, fmt.Errorf("kube-apiserver's command line %q has no flags", cmdline)
	}
	var bind, port string
	for _, a := range args[1:] {
		if v, ok := strings.CutPrefix(a, "--bind-address="); ok {
			bind = v
		}
		if v, ok := strings.CutPrefix(a, "--secure-port="); ok {
			port = v
		}
	}
	if bind == "" || port == "" {
		return 0, fmt.Errorf("kube-apiserver's command line lacks --bind-address or --secure-port")
	}
	start := time.Now()
	stopPID(p.PID, 10*time.Second)
	st.Procs = removeProc(st.Procs, p.PID)
	if err := startProcess(st, "kube-apiserver", args[0], args[1:], nil); err != nil {
		return 0, err
	}
	cfg := c.Config
	if cfg == nil {
		return 0, fmt.Errorf("the cluster has no admin configuration")
	}
	hc, err := rest.HTTPClientFor(cfg)
	if err != nil {
		return 0, err
	}
	if err := waitFor(ctx, st, "kube-apiserver", 90*time.Second, httpOK(hc, "https://"+net.JoinHostPort(bind, port)+"/readyz")); err != nil {
		return 0, err
	}
	down := time.Since(start)
	c.logf("kube-apiserver restarted (down %s)", down.Round(time.Millisecond))
	return down, nil
}

func removeProc(procs []proc, pid int) []proc {
	out := procs[:0:0]
	for _, p := range procs {
		if p.PID != pid {
			out = append(out, p)
		}
	}
	return out
}
