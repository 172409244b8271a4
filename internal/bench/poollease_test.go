package bench

import (
	"fmt"
	"os"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/utils/ptr"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	"github.com/agentbox/terraform-provider-agentbox/internal/benchreport"
	apiclient "github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
	"github.com/agentbox/terraform-provider-agentbox/internal/testenv/kwok"
)

// leaseNamespace holds the sustained pool lease benchmark's pool.
const leaseNamespace = "agentbox-bench-leases"

// The sustained pool lease benchmark's knobs: the pool's ready sandboxes
// and the concurrent clients; defaults leasePool and leaseClients.
const (
	EnvLeasePool    = "AGENTBOX_BENCH_LEASE_POOL"
	EnvLeaseClients = "AGENTBOX_BENCH_LEASE_CLIENTS"
)

const (
	leasePool    = 500
	leaseClients = 32
	// leaseWindow is how long the clients lease for, at most: they stop
	// earlier when the pool has no ready sandbox left.
	leaseWindow = 10 * time.Second
	// The targets.
	leaseRateMin = 1000.0 // per second
	leaseP99Max  = 50.0   // ms
)

// TestBenchPoolLeaseRate measures pool leases through the Compute API the
// way a workflow engine's fan-out makes them: N clients, each with its own
// connection, acquiring from one warm pool of hundreds of ready sandboxes
// (on a kwok node, as no real node of this machine holds them) back to
// back, for leaseWindow or until the pool has none ready left. Acquire
// only: a released pool sandbox is deleted and replaced, never leased
// again, so releases would only add the replacements' load. It reports
// leases per second over the window and the acquire latency, and profiles
// the control plane's CPU meanwhile.
func TestBenchPoolLeaseRate(t *testing.T) {
	p := platform(t)
	size := envInt(t, EnvLeasePool, leasePool)
	clients := envInt(t, EnvLeaseClients, leaseClients)
	cs, _, kubeconfig := scaleClient(t)
	// The pool refills what is leased while the clients lease.
	fakeNodeFor(t, cs, kubeconfig, 2*size)
	const ns = leaseNamespace
	scaleNamespace(t, cs, ns)
	ctx := t.Context()
	tpl := &v1alpha1.SandboxTemplate{
		ObjectMeta: metav1.ObjectMeta{Name: "kwok", Namespace: ns},
		Spec: v1alpha1.SandboxTemplateSpec{
			NodeSelector: kwok.NodeSelector(),
			Tolerations:  []corev1.Toleration{kwok.Toleration()},
			Workspace:    v1alpha1.WorkspaceSpec{Size: resource.MustParse("64Mi"), StorageClassName: ptr.To(kwok.StorageClass)},
		},
	}
	if err := p.kube.Create(ctx, tpl); err != nil {
		t.Fatal(err)
	}
	pool := &v1alpha1.SandboxWarmPool{
		ObjectMeta: metav1.ObjectMeta{Name: "kwok", Namespace: ns},
		Spec:       v1alpha1.SandboxWarmPoolSpec{TemplateRef: v1alpha1.LocalObjectReference{Name: tpl.Name}, Replicas: int32(size)},
	}
	start := time.Now()
	if err := p.kube.Create(ctx, pool); err != nil {
		t.Fatal(err)
	}
	b := &apiBench{p: p, ns: ns, pool: pool.Name}
	b.waitClaimable(t, size)
	t.Logf("warm pool of %d ready sandboxes after %s", size, time.Since(start).Round(time.Second))

	// One client, so one connection, per caller: a shared transport
	// would keep two idle connections and measure its own handshakes.
	apis := make([]*apiclient.Client, clients)
	for i := range apis {
		apis[i] = p.admin(t)
		// Connected and authenticated before the window: an unknown pool
		// answers at once.
		_, _ = apis[i].AcquirePoolLease(ctx, ns, "no-such-pool", apiclient.AcquireLeaseRequest{Holder: "bench", RequestID: requestID(), TTLSeconds: 600})
	}
	writesBefore := b.kubeWrites(t)
	stopProfile := p.profile(t, "pool-leases", leaseWindow+2*time.Second)
	var (
		mu        sync.Mutex
		latencies []time.Duration
		failures  []error
		exhausted time.Duration // when the first client found the pool empty
	)
	gate := make(chan struct{})
	var wg sync.WaitGroup
	var began time.Time
	for _, api := range apis {
		wg.Go(func() {
			<-gate
			var mine []time.Duration
			defer func() {
				mu.Lock()
				latencies = append(latencies, mine...)
				mu.Unlock()
			}()
			for time.Since(began) < leaseWindow {
				s := time.Now()
				_, err := api.AcquirePoolLease(ctx, ns, pool.Name, apiclient.AcquireLeaseRequest{Holder: "bench", RequestID: requestID(), TTLSeconds: 600})
				took := time.Since(s)
				if apiclient.CodeOf(err) == apiclient.CodePoolExhausted {
					mu.Lock()
					if exhausted == 0 {
						exhausted = time.Since(began)
					}
					mu.Unlock()
					return
				}
				if err != nil {
					mu.Lock()
					failures = append(failures, err)
					mu.Unlock()
					return
				}
				mine = append(mine, took)
			}
		})
	}
	began = time.Now()
	close(gate)
	wg.Wait()
	window := time.Since(began)
	stopProfile()
	writes := describeWrites(writesBefore, b.kubeWrites(t))
	for _, err := range failures[:min(len(failures), 5)] {
		t.Errorf("pool lease: %v", err)
	}
	n := len(latencies)
	rate := float64(n) / window.Seconds()
	ms := benchreport.Millis(latencies)
	slices.Sort(ms)
	ended := fmt.Sprintf("the full %s", leaseWindow)
	switch {
	case len(failures) > 0:
		ended = fmt.Sprintf("%.2f s, when %d clients failed", window.Seconds(), len(failures))
	case exhausted > 0:
		ended = fmt.Sprintf("%.2f s, when the pool had no ready sandbox left (its refill is the controller's pace, not the API's)", window.Seconds())
	}
	ended += "; " + controlPlaneRestarts(t, cs)
	t.Logf("%d pool leases by %d clients in %s: %.0f/s; p50 %.1f ms, p99 %.1f ms; %s", n, clients, window.Round(time.Millisecond), rate,
		benchreport.Percentile(ms, 50), benchreport.Percentile(ms, 99), writes)
	benchreport.Record(t, benchreport.Figure{
		Name: "sustained pool leases per second", Unit: "/s", Values: []float64{rate},
		Target: fmt.Sprintf(">= %.0f/s", leaseRateMin), Met: benchreport.Bool(rate >= leaseRateMin),
		Note: fmt.Sprintf("%d leases by %d concurrent clients (one connection each), acquire only, from a pool of %d ready sandboxes (kwok) over %s; %s",
			n, clients, size, ended, writes),
	})
	p99 := benchreport.Percentile(ms, 99)
	benchreport.Record(t, benchreport.Figure{
		Name: "pool lease latency, sustained", Unit: "ms", Values: ms,
		Target: fmt.Sprintf("p99 <= %.0f ms", leaseP99Max), Met: benchreport.Bool(n > 0 && p99 <= leaseP99Max),
		Note: fmt.Sprintf("acquire latency of the leases of the row above: p50 %.1f ms, p99 %.1f ms, max %.1f ms",
			benchreport.Percentile(ms, 50), p99, slices.Max(append(ms, 0))),
	})
}

// envInt is the positive integer in the variable name, or def.
func envInt(t *testing.T, name string, def int) int {
	t.Helper()
	v := os.Getenv(name)
	if v == "" {
		return def
	}
	n, err := strconv.Atoi(v)
	if err != nil || n <= 0 {
		t.Fatalf("%s=%q: want a positive whole number", name, v)
	}
	return n
}

// controlPlaneRestarts says how often the control plane's containers
// restarted, and why the last time: a control plane killed under the load
// ends a window early, and its figures must say so.
func controlPlaneRestarts(t *testing.T, cs kubernetes.Interface) string {
	t.Helper()
	pods, err := cs.CoreV1().Pods(platformNamespace).List(t.Context(), metav1.ListOptions{LabelSelector: "app.kubernetes.io/component=controlplane"})
	if err != nil {
		return fmt.Sprintf("control plane restarts unknown: %v", err)
	}
	restarts, why := int32(0), ""
	for _, p := range pods.Items {
		for _, c := range p.Status.ContainerStatuses {
			restarts += c.RestartCount
			if term := c.LastTerminationState.Terminated; term != nil {
				why = fmt.Sprintf(" (last: %s, exit %d)", term.Reason, term.ExitCode)
				raw, err := cs.CoreV1().Pods(p.Namespace).GetLogs(p.Name, &corev1.PodLogOptions{Container: c.Name, Previous: true,
					TailLines: ptr.To(int64(40))}).DoRaw(t.Context())
				t.Logf("control plane container %s of %s restarted%s; its last log lines (%v):\n%s", c.Name, p.Name, why, err, raw)
			}
		}
	}
	return fmt.Sprintf("control plane restarts %d%s", restarts, why)
}
