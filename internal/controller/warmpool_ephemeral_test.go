package controller

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	"github.com/agentbox/terraform-provider-agentbox/internal/computeapi"
	apiclient "github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
	"github.com/agentbox/terraform-provider-agentbox/internal/store"
)

// TestEphemeralPoolLease runs the ephemeral pool-lease cycle on real gVisor
// sandboxes through the real Compute API: sandboxes are leased from a warm
// pool (exclusively, idempotently), used, and destroyed when the lease is
// released or expires, while the pool keeps its ready count; a later run
// finds nothing an earlier run left.
func TestEphemeralPoolLease(t *testing.T) {
	t.Parallel()
	image := os.Getenv(EnvSandboxImage)
	if image == "" {
		t.Skipf("%s is not set: an ephemeral run is a real command in a real sandbox", EnvSandboxImage)
	}
	var supervisors *computeapi.SupervisorPool
	// The API and the controllers take warm sandboxes through one store,
	// as in the control plane.
	st, err := store.Open(context.Background(), filepath.Join(t.TempDir(), "agentbox.db"), store.Options{})
	must(t, err)
	t.Cleanup(func() { st.Close() })
	e := newClusterEnv(t, withSnapshots(t, nil, &supervisors), func(r *SandboxReconciler) { r.WarmTakes = st })
	api := e.computeAPIWithStore(supervisors, st)
	e.template("eph", func(tpl *v1alpha1.SandboxTemplate) {
		tpl.Spec.Image = image
		tpl.Spec.IdleTimeout = metav1.Duration{Duration: time.Hour}
	})
	must(t, e.c.Create(e.ctx, &v1alpha1.SandboxWarmPool{
		ObjectMeta: metav1.ObjectMeta{Name: "pool", Namespace: e.ns},
		Spec:       v1alpha1.SandboxWarmPoolSpec{TemplateRef: v1alpha1.LocalObjectReference{Name: "eph"}, Replicas: 2},
	}))
	filled := time.Now()
	e.waitPoolFull("pool", 2)
	t.Logf("the pool of 2 filled in %s", time.Since(filled).Round(time.Millisecond))

	// Three callers race for two sandboxes.
	var (
		wg        sync.WaitGroup
		mu        sync.Mutex
		leases    []*apiclient.PoolLease
		exhausted int
		took      []time.Duration
	)
	for i := range 3 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			start := time.Now()
			l, err := api.AcquirePoolLease(e.ctx, e.ns, "pool",
				apiclient.AcquireLeaseRequest{Holder: fmt.Sprintf("run-%d", i), RequestID: "req", TTLSeconds: 900})
			mu.Lock()
			defer mu.Unlock()
			took = append(took, time.Since(start))
			switch {
			case err == nil:
				leases = append(leases, l)
			case errors.Is(err, &apiclient.Error{Code: apiclient.CodePoolExhausted}):
				exhausted++
			default:
				t.Errorf("acquire: %v", err)
			}
		}()
	}
	wg.Wait()
	if len(leases) != 2 || exhausted != 1 || leases[0].Sandbox == leases[1].Sandbox {
		t.Fatalf("3 acquires on a pool of 2: %d leases %+v, %d exhausted", len(leases), leases, exhausted)
	}
	t.Logf("3 concurrent acquires answered in %v", took)
	a, b := leases[0], leases[1]
	again, err := api.AcquirePoolLease(e.ctx, e.ns, "pool", apiclient.AcquireLeaseRequest{Holder: a.Holder, RequestID: "req", TTLSeconds: 900})
	must(t, err)
	if again.LeaseID != a.LeaseID || again.Sandbox != a.Sandbox {
		t.Fatalf("a retried acquire got %+v, not %+v", again, a)
	}

	// The run leaves a file behind in its workspace.
	out := e.runVia(api, a.AgentID, "echo secret-of-run-a > /workspace/left-behind && cat /workspace/left-behind")
	if out != "secret-of-run-a\n" {
		t.Fatalf("run a printed %q", out)
	}

	released := time.Now()
	must(t, api.ReleaseLease(e.ctx, a.AgentID, apiclient.ReleaseLeaseRequest{Holder: a.Holder, LeaseID: a.LeaseID}))
	e.gone(&v1alpha1.Sandbox{}, a.Sandbox)
	t.Logf("released sandbox %s deleted %s after the release", a.Sandbox, time.Since(released).Round(time.Millisecond))

	// The pool is back to two ready, with b still out.
	e.waitPoolFull("pool", 2)
	e.eventually("the pool to report one leased sandbox", func() error {
		var pool v1alpha1.SandboxWarmPool
		if err := e.get("pool", &pool); err != nil {
			return err
		}
		if pool.Status.LeasedReplicas != 1 {
			return fmt.Errorf("leasedReplicas %d", pool.Status.LeasedReplicas)
		}
		return nil
	})
	t.Logf("pool full again %s after the release", time.Since(released).Round(time.Millisecond))

	// The next run: a fresh sandbox with nothing of run a's, measured from
	// the acquire to the first output.
	start := time.Now()
	c, err := api.AcquirePoolLease(e.ctx, e.ns, "pool", apiclient.AcquireLeaseRequest{Holder: "run-c", RequestID: "req-c", TTLSeconds: 2})
	must(t, err)
	// (The platform's directory, with the empty environment cache the
	// supervisor makes at its start, is not run a's.)
	out = e.runVia(api, c.AgentID, "ls -A /workspace | grep -vx .agentbox; echo end")
	t.Logf("lease from a full pool to first output: %s", time.Since(start).Round(time.Millisecond))
	if c.Sandbox == a.Sandbox || out != "end\n" {
		t.Fatalf("run c in sandbox %s (run a was in %s) saw workspace %q", c.Sandbox, a.Sandbox, out)
	}

	// Run c's holder goes quiet: the lease expires and the sandbox goes.
	// (The run itself does not move the expiry: the acquire counted as
	// activity, and renewals are throttled.)
	e.gone(&v1alpha1.Sandbox{}, c.Sandbox)
	t.Logf("expired sandbox %s deleted %s after its lease's expiry", c.Sandbox, time.Since(c.ExpiresAt).Round(time.Millisecond))

	must(t, api.ReleaseLease(e.ctx, b.AgentID, apiclient.ReleaseLeaseRequest{Holder: b.Holder, LeaseID: b.LeaseID}))
	e.gone(&v1alpha1.Sandbox{}, b.Sandbox)
	e.waitPoolFull("pool", 2)
}

// runVia runs a shell script through the Compute API and returns its
// stdout, failing the test on any error or non-zero exit.
func (e *clusterEnv) runVia(api *apiclient.Client, agentID, script string) string {
	e.t.Helper()
	ctx, cancel := context.WithTimeout(e.ctx, waitTimeout)
	defer cancel()
	res, err := api.RunCommand(ctx, agentID, apiclient.RunCommandRequest{Command: []string{"sh", "-c", script}})
	must(e.t, err)
	if res.ExitCode != 0 {
		e.t.Fatalf("%q in %s: exit %d: %s", script, agentID, res.ExitCode, res.Stderr)
	}
	return res.Stdout
}
