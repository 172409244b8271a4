package controller

import (
	"context"
	"errors"
	"fmt"
	"os"
	"slices"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	"github.com/agentbox/terraform-provider-agentbox/internal/computeapi"
	apiclient "github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
	"github.com/agentbox/terraform-provider-agentbox/internal/pki"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"
)

// waitPoolFull waits until the pool reports n ready sandboxes and Ready
// PoolFull, and returns its ready warm sandboxes by name with their pods'
// UIDs.
func (e *clusterEnv) waitPoolFull(name string, n int32) map[string]types.UID {
	e.t.Helper()
	warm := map[string]types.UID{}
	e.eventually(fmt.Sprintf("warm pool %s to have %d ready sandboxes", name, n), func() error {
		var pool v1alpha1.SandboxWarmPool
		if err := e.get(name, &pool); err != nil {
			return err
		}
		c := meta.FindStatusCondition(pool.Status.Conditions, v1alpha1.ConditionReady)
		if pool.Status.ReadyReplicas != n || pool.Status.Replicas != n || c == nil || c.Reason != v1alpha1.ReasonPoolFull ||
			pool.Status.ObservedGeneration != pool.Generation {
			return fmt.Errorf("replicas %d, ready %d, condition %+v", pool.Status.Replicas, pool.Status.ReadyReplicas, c)
		}
		var list v1alpha1.SandboxList
		if err := e.c.List(e.ctx, &list, client.InNamespace(e.ns), client.MatchingLabels{v1alpha1.LabelWarmPool: name}); err != nil {
			return err
		}
		clear(warm)
		for _, s := range list.Items {
			if !s.DeletionTimestamp.IsZero() || s.Annotations[v1alpha1.AnnotationAdoptedBy] != "" || v1alpha1.PoolLeased(&s) || !sandboxReady(&s) {
				continue
			}
			var pod corev1.Pod
			if err := e.get(PodName(s.Name), &pod); err != nil {
				return err
			}
			warm[s.Name] = pod.UID
		}
		if len(warm) != int(n) {
			return fmt.Errorf("%d ready warm sandboxes listed", len(warm))
		}
		return nil
	})
	return warm
}

// firstCall creates a sandbox and returns how long it took until a
// run_command of `true` through the Compute API first succeeded. The API
// answers an unknown agent at once, so it is retried until the sandbox
// exists for it; from then on the API waits for the sandbox itself.
func (e *clusterEnv) firstCall(api *apiclient.Client, name, template string) time.Duration {
	e.t.Helper()
	start := time.Now()
	// The Compute API looks agents up across namespaces, so the agent is
	// unique to this test's namespace: a repeated run (-count) must not
	// find the sandbox of the run before, whose namespace may still be
	// going away.
	sbx := &v1alpha1.Sandbox{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: e.ns},
		Spec: v1alpha1.SandboxSpec{
			AgentID:     "agent:" + name + "@" + e.ns + ".example.com",
			TemplateRef: v1alpha1.LocalObjectReference{Name: template},
		},
	}
	must(e.t, e.c.Create(e.ctx, sbx))
	var err error
	var tries []string
	for time.Since(start) < waitTimeout {
		var res *apiclient.CommandResult
		callStart := time.Now()
		res, err = api.RunCommand(e.ctx, sbx.Spec.AgentID, apiclient.RunCommandRequest{Command: []string{"true"}})
		if err == nil && res.ExitCode == 0 {
			took := time.Since(start)
			if took > 2*time.Second {
				// Slow starts are the ones worth explaining.
				e.t.Logf("%s: earlier attempts %v; the successful call took %s", name, tries, time.Since(callStart).Round(time.Millisecond))
			}
			return took
		}
		if err == nil {
			err = fmt.Errorf("exit %d: %s", res.ExitCode, res.Stderr)
		}
		tries = append(tries, fmt.Sprintf("%s after %s: %v", time.Since(start).Round(time.Millisecond), time.Since(callStart).Round(time.Millisecond), err))
		time.Sleep(50 * time.Millisecond)
	}
	e.t.Fatalf("run_command on new sandbox %s: %v", name, err)
	return 0
}

func median(ds []time.Duration) time.Duration {
	s := slices.Clone(ds)
	slices.Sort(s)
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

// TestWarmPoolAdoption runs a pool of two real sandboxes on the cluster and
// measures, side by side, how long a new agent waits for its first command
// when its sandbox adopts a warm one and when it starts cold. The adopted
// sandbox must run in the warm sandbox's very pod, the Compute API must
// reach it through the real mTLS pool (verifying the supervisor's identity,
// the warm sandbox's name), and the pool must fill up again.
func TestWarmPoolAdoption(t *testing.T) {
	t.Parallel()
	image := os.Getenv(EnvSandboxImage)
	if image == "" {
		t.Skipf("%s is not set: adoption is measured to the first command, which needs the real supervisor", EnvSandboxImage)
	}
	var supervisors *computeapi.SupervisorPool
	e := newClusterEnv(t, withSnapshots(t, nil, &supervisors))
	api := e.computeAPI(supervisors)
	for _, name := range []string{"warm", "cold"} {
		e.template(name, func(tpl *v1alpha1.SandboxTemplate) {
			tpl.Spec.Image = image
			// Longer than the test: warm or not, nothing idles out here.
			tpl.Spec.IdleTimeout = metav1.Duration{Duration: time.Hour}
		})
	}
	must(t, e.c.Create(e.ctx, &v1alpha1.SandboxWarmPool{
		ObjectMeta: metav1.ObjectMeta{Name: "pool", Namespace: e.ns},
		Spec:       v1alpha1.SandboxWarmPoolSpec{TemplateRef: v1alpha1.LocalObjectReference{Name: "warm"}, Replicas: 2},
	}))
	poolFilled := time.Now()
	warm := e.waitPoolFull("pool", 2)
	t.Logf("the pool of 2 filled in %s", time.Since(poolFilled).Round(time.Millisecond))
	// The pool's state as its metrics report it, read from this cluster.
	elected := make(chan struct{})
	close(elected)
	reg := prometheus.NewPedanticRegistry()
	must(t, reg.Register(&StateMetrics{Reader: e.c, Elected: elected, Namespaces: ServedNamespaces{e.ns}}))
	for state, want := range map[string]float64{"total": 2, "ready": 2, "leased": 0} {
		if got := gaugeValue(t, reg, "agentbox_warm_pool_sandboxes", map[string]string{"namespace": e.ns, "pool": "pool", "state": state}); got != want {
			t.Errorf("agentbox_warm_pool_sandboxes{state=%q} of the full pool = %v, want %v", state, got, want)
		}
	}

	const n = 3
	var adopted, cold []time.Duration
	for i := range n {
		// Each measurement starts from a full pool and a quiet node, so
		// that the pool's own refills do not weigh on either side.
		name := fmt.Sprintf("adopter-%d", i)
		adopted = append(adopted, e.firstCall(api, name, "warm"))
		var sbx v1alpha1.Sandbox
		must(t, e.get(name, &sbx))
		wantUID, ok := warm[sbx.Status.Workload]
		if !ok {
			t.Fatalf("sandbox %s has workload %q, not one of the warm sandboxes %v", name, sbx.Status.Workload, warm)
		}
		if reason := readyReason(&sbx); sbx.Status.Phase != v1alpha1.SandboxPhaseRunning || reason != v1alpha1.ReasonAdoptedFromWarmPool {
			t.Errorf("sandbox %s: %s/%s", name, sbx.Status.Phase, reason)
		}
		var pod corev1.Pod
		must(t, e.get(PodName(sbx.Status.Workload), &pod))
		if pod.UID != wantUID {
			t.Errorf("sandbox %s runs in pod %s (UID %s), not the warm pod (UID %s)", name, pod.Name, pod.UID, wantUID)
		}
		assertControlledBy(t, &pod, &sbx)
		if pod.Labels[v1alpha1.LabelSandbox] != name {
			t.Errorf("pod %s labels %v", pod.Name, pod.Labels)
		}
		e.gone(&v1alpha1.Sandbox{}, sbx.Status.Workload)
		if i == 0 {
			e.checkIdentity(&sbx)
		}
		warm = e.waitPoolFull("pool", 2)

		name = fmt.Sprintf("cold-%d", i)
		cold = append(cold, e.firstCall(api, name, "cold"))
		must(t, e.get(name, &sbx))
		if sbx.Status.Workload != "" || readyReason(&sbx) != v1alpha1.ReasonRunning {
			t.Errorf("cold sandbox %s: workload %q, reason %s", name, sbx.Status.Workload, readyReason(&sbx))
		}
		// Wait for the cold sandbox to settle before the next adoption.
		e.waitPhase(name, v1alpha1.SandboxPhaseRunning, v1alpha1.ReasonRunning)
	}
	ma, mc := median(adopted), median(cold)
	t.Logf("create to first run_command: adopted from the pool %v (median %s), cold %v (median %s); cold/adopted = %.1f",
		adopted, ma.Round(time.Millisecond), cold, mc.Round(time.Millisecond), float64(mc)/float64(ma))
	if ma >= mc {
		t.Errorf("adoption (median %s) was not faster than a cold start (median %s)", ma, mc)
	}
}

// checkIdentity shows that the identity the API verified is the workload's:
// the supervisor of an adopted sandbox proves the warm sandbox's name, and
// a client that expects the adopter's own name is refused.
func (e *clusterEnv) checkIdentity(sbx *v1alpha1.Sandbox) {
	t := e.t
	t.Helper()
	e.supervisor(t, sbx) // expects sbx.WorkloadName(); fails the test otherwise
	leaf, err := e.ca.Issue(pki.LeafOptions{ID: pki.ControlPlaneID(testTrustDomain, testPlatformNamespace), Usage: pki.UsageClient})
	must(t, err)
	cert, err := leaf.TLSCertificate()
	must(t, err)
	tlsConf := pki.ClientTLS(cert, e.ca.Pool(), pki.SandboxID(testTrustDomain, sbx.Namespace, sbx.Name).String())
	sup := supervisorapi.NewClient(sbx.Status.ServiceEndpoint, supervisorapi.NewHTTPClient(tlsConf))
	ctx, cancel := context.WithTimeout(e.ctx, 30*time.Second)
	defer cancel()
	if _, err := sup.Health(ctx); err == nil {
		t.Error("the adopted sandbox's supervisor passed as the adopter's own name; identity is not being checked")
	} else if errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("dialling with the wrong identity timed out rather than being refused: %v", err)
	}
}
