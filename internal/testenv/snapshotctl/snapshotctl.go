// Package snapshotctl runs the real CSI snapshot-controller (external-
// snapshotter's, built from the Go module proxy by `make testenv`) against
// the test cluster, with the snapshot.storage.k8s.io CRDs of the same
// release. The controller turns VolumeSnapshots into VolumeSnapshotContents;
// cutting the snapshots is the CSI side's job. Package csistack runs that
// side for real on a cluster with a node (a CSI driver whose snapshots are
// tar archives of its folder volumes, with the real csi-snapshotter and
// csi-provisioner), so tests that start both move real data through
// VolumeSnapshots and claims restored from them. Tests that start only the
// controller have no CSI side: they must play csi-snapshotter themselves,
// and say so.
package snapshotctl

import (
	"bufio"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"k8s.io/client-go/rest"

	"github.com/agentbox/terraform-provider-agentbox/internal/testenv"
	"github.com/agentbox/terraform-provider-agentbox/internal/testenv/toolchain"
)

// Controller is one running snapshot-controller.
type Controller struct {
	cmd  *exec.Cmd
	done chan struct{}
	mu   sync.Mutex
	log  strings.Builder
}

// Start applies the snapshot CRDs to the cluster and runs a
// snapshot-controller on it until the test ends, or skips the test when
// `make testenv` has not built them. The controller watches every
// namespace, so there must be one active per cluster: test packages that
// share the cluster each start one, and leader election makes all but one
// of them wait, a follower taking over within seconds when the leader's
// test ends.
func Start(tb testing.TB, cfg *rest.Config, kubeconfig string) *Controller {
	tb.Helper()
	dir, err := toolchain.DefaultDir()
	if err != nil {
		tb.Skipf("no snapshot-controller: %v", err)
	}
	bin := filepath.Join(toolchain.BinDir(dir), toolchain.SnapshotController)
	crds := toolchain.SnapshotCRDDir(dir)
	for _, f := range append([]string{bin}, crdPaths(crds)...) {
		if _, err := os.Stat(f); err != nil {
			tb.Skipf("no snapshot-controller: %s is not built; run `make testenv` (it builds external-snapshotter %s from the Go module proxy)", f, toolchain.ExternalSnapshotterVersion)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	if err := testenv.ApplyCRDs(ctx, cfg, filepath.Join(crds, "*.yaml")); err != nil {
		tb.Fatalf("apply snapshot CRDs: %v", err)
	}

	c := &Controller{done: make(chan struct{})}
	c.cmd = exec.Command(bin,
		"--kubeconfig="+kubeconfig,
		"--leader-election=true", "--leader-election-namespace=kube-system",
		// Short terms: a follower waits out the lease of a leader whose
		// test has ended (it does not give the lease back when stopped).
		"--leader-election-lease-duration=8s", "--leader-election-renew-deadline=6s", "--leader-election-retry-period=1s",
		"--worker-threads=4",
		// Without the group snapshot CRDs (not applied: nothing here uses
		// them) the controller would wait 30 s for them at start.
		"--feature-gates=CSIVolumeGroupSnapshot=false",
		// The defaults are sized for CSI drivers that take minutes; the
		// tests' stand-in answers within a second, and client-side
		// throttling would be most of what a test measures.
		"--retry-interval-max=5s",
		"--kube-api-qps=50", "--kube-api-burst=100",
		"-v=4")
	c.cmd.Env = []string{"PATH=" + os.Getenv("PATH")}
	out, err := c.cmd.StdoutPipe()
	if err != nil {
		tb.Fatal(err)
	}
	c.cmd.Stderr = c.cmd.Stdout
	if err := c.cmd.Start(); err != nil {
		tb.Fatalf("start %s: %v", bin, err)
	}
	go func() {
		sc := bufio.NewScanner(out)
		sc.Buffer(make([]byte, 64*1024), 1024*1024)
		for sc.Scan() {
			c.mu.Lock()
			c.log.WriteString(sc.Text() + "\n")
			c.mu.Unlock()
		}
		_ = c.cmd.Wait()
		close(c.done)
	}()
	tb.Cleanup(func() {
		c.Stop()
		if tb.Failed() {
			tb.Logf("snapshot-controller output:\n%s", c.Output())
		}
	})
	return c
}

func crdPaths(dir string) []string {
	paths := make([]string, len(toolchain.SnapshotCRDs))
	for i, f := range toolchain.SnapshotCRDs {
		paths[i] = filepath.Join(dir, f)
	}
	return paths
}

// Exited reports whether the controller has stopped, which before Stop
// means it failed; its output says why.
func (c *Controller) Exited() bool {
	select {
	case <-c.done:
		return true
	default:
		return false
	}
}

// Output is everything the controller has logged so far.
func (c *Controller) Output() string {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.log.String()
}

// Stop ends the controller (SIGTERM, then SIGKILL after 5 s) and waits for
// it. It may be called more than once.
func (c *Controller) Stop() {
	if c.cmd == nil || c.cmd.Process == nil || c.Exited() {
		return
	}
	_ = c.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-c.done:
	case <-time.After(5 * time.Second):
		_ = c.cmd.Process.Kill()
		<-c.done
	}
}
