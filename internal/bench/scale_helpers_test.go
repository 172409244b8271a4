package bench

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os/exec"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/rand"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	statsv1alpha1 "k8s.io/kubelet/pkg/apis/stats/v1alpha1"

	"github.com/agentbox/terraform-provider-agentbox/internal/testenv"
	"github.com/agentbox/terraform-provider-agentbox/internal/testenv/kwok"
)

// scaleClient is a clientset without client-side throttling worth the
// name: creating a thousand objects at client-go's default 5/s would
// measure the client, not the platform.
func scaleClient(t *testing.T) (*kubernetes.Clientset, *rest.Config, string) {
	t.Helper()
	cfg, kubeconfig := testenv.Shared(t)
	cfg = rest.CopyConfig(cfg)
	cfg.QPS, cfg.Burst = 200, 400
	cs, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return cs, cfg, kubeconfig
}

// fakeNode starts kwok and registers one fake node for the test; both go
// when the test ends, after every cleanup registered later (which is why
// it is called first: the sandboxes' pods and claims need kwok to go away).
func fakeNode(t *testing.T, cs kubernetes.Interface, kubeconfig string) string {
	t.Helper()
	return fakeNodeFor(t, cs, kubeconfig, 0)
}

// fakeNodeFor is fakeNode with room for pods pods (kwok's default when 0)
// and a few more.
func fakeNodeFor(t *testing.T, cs kubernetes.Interface, kubeconfig string, pods int) string {
	t.Helper()
	ctx := t.Context()
	k, err := kwok.Start(ctx, kubeconfig, t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	name := "kwok-bench-" + rand.String(5)
	t.Cleanup(func() {
		ctx := context.Background()
		if err := kwok.DeleteNode(ctx, cs, name); err != nil {
			t.Errorf("delete fake node: %v", err)
		}
		if err := k.Stop(); err != nil {
			t.Errorf("stop kwok: %v", err)
		}
		if t.Failed() {
			t.Logf("kwok log (tail):\n%s", lastLines(k.Log(), 30))
		}
	})
	if _, err := kwok.AddNode(ctx, cs, name, kwok.NodeOptions{Pods: max(2000, pods+100)}); err != nil {
		t.Fatal(err)
	}
	if err := kwok.EnsureStorageClass(ctx, cs); err != nil {
		t.Fatal(err)
	}
	return name
}

// scaleNamespace creates ns and, at cleanup, deletes it and waits until it
// and the fake volumes of its claims are gone.
func scaleNamespace(t *testing.T, cs kubernetes.Interface, ns string) {
	t.Helper()
	obj := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}
	if _, err := cs.CoreV1().Namespaces().Create(t.Context(), obj, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Minute)
		defer cancel()
		start := time.Now()
		if err := cs.CoreV1().Namespaces().Delete(ctx, ns, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
			t.Errorf("delete namespace %s: %v", ns, err)
			return
		}
		err := wait.PollUntilContextCancel(ctx, 2*time.Second, true, func(ctx context.Context) (bool, error) {
			_, err := cs.CoreV1().Namespaces().Get(ctx, ns, metav1.GetOptions{})
			return apierrors.IsNotFound(err), nil
		})
		if err != nil {
			t.Errorf("namespace %s not gone after %s: %v", ns, time.Since(start).Round(time.Second), err)
			return
		}
		err = wait.PollUntilContextCancel(ctx, 2*time.Second, true, func(ctx context.Context) (bool, error) {
			pvs, err := cs.CoreV1().PersistentVolumes().List(ctx, metav1.ListOptions{})
			if err != nil {
				return false, nil
			}
			return !slices.ContainsFunc(pvs.Items, func(pv corev1.PersistentVolume) bool {
				return pv.Spec.ClaimRef != nil && pv.Spec.ClaimRef.Namespace == ns
			}), nil
		})
		if err != nil {
			t.Errorf("volumes of %s not gone: %v", ns, err)
		}
		t.Logf("namespace %s and its volumes gone after %s", ns, time.Since(start).Round(time.Second))
	})
}

// tfRun runs terraform and returns its exit code; unlike tfCLI.exec, exit
// code 2 of `plan -detailed-exitcode` (changes present) is an answer, not
// a failure.
func tfRun(tf tfCLI, dir string, args ...string) (int, string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, tf.path, args...)
	cmd.Dir = dir
	cmd.Env = tf.env
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	err := cmd.Run()
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		return ee.ExitCode(), out.String(), nil
	}
	if err != nil {
		return -1, out.String(), fmt.Errorf("terraform %s: %w", args[0], err)
	}
	return 0, out.String(), nil
}

// controlPlanePod is the running control plane pod of the platform.
func controlPlanePod(t *testing.T, cs kubernetes.Interface) *corev1.Pod {
	t.Helper()
	pods, err := cs.CoreV1().Pods(platformNamespace).List(t.Context(), metav1.ListOptions{LabelSelector: "app.kubernetes.io/component=controlplane"})
	if err != nil {
		t.Fatal(err)
	}
	for i := range pods.Items {
		if p := &pods.Items[i]; p.Status.Phase == corev1.PodRunning && p.DeletionTimestamp == nil {
			return p
		}
	}
	t.Fatalf("no running control plane pod in %s (%d pods)", platformNamespace, len(pods.Items))
	return nil
}

// usage is one reading of the control plane container's resources, as the
// kubelet's summary API reports them.
type usage struct {
	memTime, cpuTime time.Time
	workingSet       uint64 // bytes
	cpuNanos         uint64 // cumulative core-nanoseconds
}

// readUsage reads the pod's container stats from its node's kubelet,
// through the API server's node proxy.
func readUsage(ctx context.Context, cs kubernetes.Interface, pod *corev1.Pod) (usage, error) {
	raw, err := cs.CoreV1().RESTClient().Get().AbsPath("/api/v1/nodes", pod.Spec.NodeName, "proxy", "stats", "summary").DoRaw(ctx)
	if err != nil {
		return usage{}, fmt.Errorf("stats summary of node %s: %w", pod.Spec.NodeName, err)
	}
	var s statsv1alpha1.Summary
	if err := json.Unmarshal(raw, &s); err != nil {
		return usage{}, fmt.Errorf("stats summary: %w", err)
	}
	for _, ps := range s.Pods {
		if ps.PodRef.Namespace != pod.Namespace || ps.PodRef.Name != pod.Name {
			continue
		}
		for _, c := range ps.Containers {
			if c.Name != pod.Spec.Containers[0].Name {
				continue
			}
			if c.Memory == nil || c.Memory.WorkingSetBytes == nil || c.CPU == nil || c.CPU.UsageCoreNanoSeconds == nil {
				return usage{}, fmt.Errorf("container %s has no memory or CPU stats yet", c.Name)
			}
			return usage{memTime: c.Memory.Time.Time, cpuTime: c.CPU.Time.Time,
				workingSet: *c.Memory.WorkingSetBytes, cpuNanos: *c.CPU.UsageCoreNanoSeconds}, nil
		}
	}
	return usage{}, fmt.Errorf("no stats for %s/%s on node %s", pod.Namespace, pod.Name, pod.Spec.NodeName)
}

// sampleUsage reads the usage every interval for d and returns the working
// set of each distinct reading (MiB) and the CPU between consecutive
// readings (millicores). The kubelet refreshes container stats every 10 to
// 15 s, so readings in between repeat the last one and are dropped.
func sampleUsage(t *testing.T, cs kubernetes.Interface, pod *corev1.Pod, d, interval time.Duration) (memMiB, cpuMilli []float64) {
	t.Helper()
	var prev *usage
	deadline := time.Now().Add(d)
	for {
		u, err := readUsage(t.Context(), cs, pod)
		if err != nil {
			t.Fatal(err)
		}
		if prev == nil || u.memTime.After(prev.memTime) {
			memMiB = append(memMiB, float64(u.workingSet)/(1<<20))
		}
		if prev != nil && u.cpuTime.After(prev.cpuTime) {
			dt := u.cpuTime.Sub(prev.cpuTime).Seconds()
			cpuMilli = append(cpuMilli, float64(u.cpuNanos-prev.cpuNanos)/1e6/dt)
		}
		if prev == nil || u.cpuTime.After(prev.cpuTime) {
			prev = &u
		}
		if !time.Now().Add(interval).Before(deadline) {
			return memMiB, cpuMilli
		}
		select {
		case <-t.Context().Done():
			t.Fatal(t.Context().Err())
		case <-time.After(interval):
		}
	}
}

// controllerMetrics reads the control plane's Prometheus metrics through
// the API server's pod proxy and returns the sum of each family named,
// optionally restricted to samples with the label controller or name.
func controllerMetrics(ctx context.Context, cs kubernetes.Interface, pod *corev1.Pod, port string, want map[string]string) (map[string]float64, error) {
	raw, err := cs.CoreV1().Pods(pod.Namespace).ProxyGet("http", pod.Name, port, "metrics", nil).DoRaw(ctx)
	if err != nil {
		return nil, fmt.Errorf("metrics of %s: %w", pod.Name, err)
	}
	p := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := p.TextToMetricFamilies(bytes.NewReader(raw))
	if err != nil {
		return nil, fmt.Errorf("parse metrics: %w", err)
	}
	out := map[string]float64{}
	for name, selector := range want {
		fam := fams[name]
		if fam == nil {
			continue
		}
		var sum float64
		for _, m := range fam.GetMetric() {
			if selector != "" && !hasLabel(m.GetLabel(), selector) {
				continue
			}
			switch {
			case m.GetCounter() != nil:
				sum += m.GetCounter().GetValue()
			case m.GetGauge() != nil:
				sum += m.GetGauge().GetValue()
			case m.GetUntyped() != nil:
				sum += m.GetUntyped().GetValue()
			}
		}
		out[name] = sum
	}
	return out, nil
}

// hasLabel reports whether labels hold the pair "name=value" of selector.
func hasLabel[L interface {
	GetName() string
	GetValue() string
}](labels []L, selector string) bool {
	k, v, _ := strings.Cut(selector, "=")
	for _, l := range labels {
		if l.GetName() == k && l.GetValue() == v {
			return true
		}
	}
	return false
}

func lastLines(s string, n int) string {
	l := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(l) > n {
		l = l[len(l)-n:]
	}
	return strings.Join(l, "\n")
}
