package bench

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	"github.com/agentbox/terraform-provider-agentbox/internal/benchreport"
	"github.com/agentbox/terraform-provider-agentbox/internal/controller"
	"github.com/agentbox/terraform-provider-agentbox/internal/testenv/kwok"
)

// The scale benchmarks run their sandboxes on a kwok node: the pods are
// scheduled, bound to claims and reported Running like real ones, but no
// container starts, so a two-core machine can hold thousands of them.
// What they measure is the control side: Terraform and the controller.
const (
	// scaleRunningMax is the bound on the time from creating the
	// first thousand Sandboxes to all of them Running, in every run.
	scaleRunningMax = 100 * time.Second
	// How long the controller is left alone before and while it is
	// sampled.
	scaleSettle = 60 * time.Second
	scaleSample = 60 * time.Second
)

// EnvScaleSandboxes lists the sandbox counts the control plane scale
// benchmark grows through, comma-separated; default scaleCounts. Each
// step creates the difference, waits for all to be Running, and samples
// the idle control plane.
const EnvScaleSandboxes = "AGENTBOX_BENCH_SCALE_SANDBOXES"

var scaleCounts = []int{1000, 5000}

// controlPlaneMemMax is the control plane's memory target at n idle
// sandboxes (MiB), where the issue sets one.
func controlPlaneMemMax(n int) (float64, bool) {
	switch {
	case n <= 1000:
		return 200, true
	case n <= 5000:
		return 300, true
	}
	return 0, false
}

// scaleNamespaceName holds the control plane scale benchmark's sandboxes.
const scaleNamespaceName = "agentbox-bench-scale"

// TestBenchControlPlaneScale measures the control plane pod's memory and
// CPU with no sandboxes, then grows to each of the counts of
// EnvScaleSandboxes (a thousand, then five thousand): how long the
// controller takes to bring the new sandboxes to Running (with the Running
// count every 10 s, where a stall shows), its peak memory meanwhile, and
// its memory and CPU once they are idle, with a heap profile.
func TestBenchControlPlaneScale(t *testing.T) {
	p := platform(t)
	counts := scaleCountsFromEnv(t)
	cs, cfg, kubeconfig := scaleClient(t)
	fakeNodeFor(t, cs, kubeconfig, slices.Max(counts))
	const ns = scaleNamespaceName
	scaleNamespace(t, cs, ns)
	scheme := runtime.NewScheme()
	if err := clientgoscheme.AddToScheme(scheme); err != nil {
		t.Fatal(err)
	}
	if err := v1alpha1.AddToScheme(scheme); err != nil {
		t.Fatal(err)
	}
	kube, err := client.New(cfg, client.Options{Scheme: scheme})
	if err != nil {
		t.Fatal(err)
	}
	ctx := t.Context()
	cp := controlPlanePod(t, cs)
	t.Logf("control plane pod %s on node %s", cp.Name, cp.Spec.NodeName)

	baseMem, _ := sampleUsage(t, cs, cp, 30*time.Second, 5*time.Second)
	benchreport.Record(t, benchreport.Figure{
		Name: "control plane memory, 0 sandboxes", Unit: "MiB", Values: baseMem,
		Note: "baseline for the rows below: working set of the control plane container (kubelet summary API) over 30 s, platform just installed",
	})

	tpl := &v1alpha1.SandboxTemplate{
		ObjectMeta: metav1.ObjectMeta{Name: "kwok", Namespace: ns},
		Spec: v1alpha1.SandboxTemplateSpec{
			NodeSelector: kwok.NodeSelector(),
			Tolerations:  []corev1.Toleration{kwok.Toleration()},
			Workspace:    v1alpha1.WorkspaceSpec{Size: resource.MustParse("64Mi"), StorageClassName: ptr.To(kwok.StorageClass)},
		},
	}
	if err := kube.Create(ctx, tpl); err != nil {
		t.Fatal(err)
	}
	have := 0
	for _, n := range counts {
		scaleStep(t, p, cs, cp, kube, tpl.Name, have, n, baseMem)
		have = n
	}
}

// scaleStep grows the scale namespace from have to n Sandboxes and records
// the step's figures.
func scaleStep(t *testing.T, p *platformEnv, cs kubernetes.Interface, cp *corev1.Pod, kube client.Client, tpl string, have, n int, baseMem []float64) {
	t.Helper()
	ctx := t.Context()
	ns := scaleNamespaceName
	start := time.Now()
	createSandboxes(t, kube, ns, tpl, have, n)
	created := time.Since(start)
	t.Logf("%d Sandboxes created (%d new) in %s", n, n-have, created.Round(time.Millisecond))
	run := waitAllRunning(t, kube, cs, cp, ns, n, 60*time.Minute)
	name := fmt.Sprintf("%d Sandboxes created to all Running", n)
	what := fmt.Sprintf("%d Sandboxes", n)
	if have > 0 {
		name = fmt.Sprintf("%d -> %d Sandboxes created to all Running", have, n)
		what = fmt.Sprintf("%d more Sandboxes beside %d idle ones", n-have, have)
	}
	fig := benchreport.Figure{
		Name: name, Unit: "s", Values: []float64{run.took.Seconds()},
		Note: fmt.Sprintf("kwok node: the controller's work only (cert, lease, claim, pod, status) for %s; creating the objects took %.1f s; "+
			"control plane peak working set meanwhile %.1f MiB; Running every 10 s: %s",
			what, created.Seconds(), run.peakMemMiB, run.timeline()),
	}
	if have == 0 && n == 1000 {
		fig.Target = fmt.Sprintf("<= %.0f s, no stall", scaleRunningMax.Seconds())
		fig.Met = benchreport.Bool(run.took <= scaleRunningMax)
	}
	benchreport.Record(t, fig)

	t.Logf("letting the controller settle for %s", scaleSettle)
	select {
	case <-ctx.Done():
		t.Fatal(ctx.Err())
	case <-time.After(scaleSettle):
	}
	want := map[string]string{
		"controller_runtime_reconcile_total":        "controller=" + controller.SandboxControllerName,
		"controller_runtime_reconcile_errors_total": "controller=" + controller.SandboxControllerName,
		"workqueue_adds_total":                      "name=" + controller.SandboxControllerName,
		"rest_client_requests_total":                "",
	}
	before, mErr := controllerMetrics(ctx, cs, cp, "8080", want)
	mem, cpu := sampleUsage(t, cs, cp, scaleSample, 5*time.Second)
	after, mErr2 := controllerMetrics(ctx, cs, cp, "8080", want)
	activity := "controller metrics unavailable"
	if err := errors.Join(mErr, mErr2); err != nil {
		t.Logf("controller metrics: %v", err)
	} else {
		delta := func(k string) float64 { return after[k] - before[k] }
		activity = fmt.Sprintf("during the %s window: %.0f sandbox reconciles (%.0f errors), %.0f queue adds, %.0f API requests",
			scaleSample, delta("controller_runtime_reconcile_total"), delta("controller_runtime_reconcile_errors_total"),
			delta("workqueue_adds_total"), delta("rest_client_requests_total"))
		t.Logf("%s; totals since start: %.0f reconciles, %.0f errors, %.0f API requests", activity,
			after["controller_runtime_reconcile_total"], after["controller_runtime_reconcile_errors_total"], after["rest_client_requests_total"])
	}
	logControllerErrors(t, cs, cp, scaleSample)
	p.heapProfile(t, fmt.Sprintf("heap-%d-idle", n))

	maxMem := slices.Max(mem)
	memFig := benchreport.Figure{
		Name: fmt.Sprintf("control plane memory, %d idle sandboxes", n), Unit: "MiB", Values: mem,
		Note: fmt.Sprintf("working set, max %.1f MiB, sampled over %s after %s settling; peak while they started %.1f MiB; baseline median %.1f MiB",
			maxMem, scaleSample, scaleSettle, run.peakMemMiB, benchreport.Percentile(baseMem, 50)),
	}
	if limit, ok := controlPlaneMemMax(n); ok {
		peak := max(maxMem, run.peakMemMiB)
		memFig.Target = fmt.Sprintf("<= %.0f MiB (peak)", limit)
		memFig.Met = benchreport.Bool(peak <= limit)
	}
	benchreport.Record(t, memFig)
	benchreport.Record(t, benchreport.Figure{
		Name: fmt.Sprintf("control plane CPU, %d idle sandboxes", n), Unit: "millicores", Values: cpu,
		Note: "between kubelet readings over the same window; " + activity,
	})
}

// scaleCountsFromEnv is EnvScaleSandboxes, or scaleCounts.
func scaleCountsFromEnv(t *testing.T) []int {
	t.Helper()
	v := os.Getenv(EnvScaleSandboxes)
	if v == "" {
		return scaleCounts
	}
	var counts []int
	for _, f := range strings.Split(v, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil || n <= 0 || (len(counts) > 0 && n <= counts[len(counts)-1]) {
			t.Fatalf("%s=%q: want increasing positive counts, such as 1000,5000", EnvScaleSandboxes, v)
		}
		counts = append(counts, n)
	}
	return counts
}

// createSandboxes creates Sandboxes from and to n-1 of template tpl, a
// few at a time.
func createSandboxes(t *testing.T, kube client.Client, ns, tpl string, from, n int) {
	t.Helper()
	next := atomic.Int64{}
	next.Store(int64(from))
	var wg sync.WaitGroup
	errs := make(chan error, 16)
	for range 16 {
		wg.Go(func() {
			for {
				i := int(next.Add(1)) - 1
				if i >= n {
					return
				}
				sbx := &v1alpha1.Sandbox{
					ObjectMeta: metav1.ObjectMeta{Name: fmt.Sprintf("sbx-%04d", i), Namespace: ns},
					Spec: v1alpha1.SandboxSpec{
						AgentID:     fmt.Sprintf("bench-agent-%04d", i),
						TemplateRef: v1alpha1.LocalObjectReference{Name: tpl},
					},
				}
				if err := kube.Create(t.Context(), sbx); err != nil {
					errs <- fmt.Errorf("create %s: %w", sbx.Name, err)
					return
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
}

// runningRun is how a wait for all sandboxes Running went.
type runningRun struct {
	took time.Duration
	// running is the Running count at each 10 s mark.
	running    []int
	peakMemMiB float64
}

func (r runningRun) timeline() string {
	parts := make([]string, len(r.running))
	for i, n := range r.running {
		parts[i] = strconv.Itoa(n)
	}
	return strings.Join(parts, ", ")
}

// waitAllRunning waits until the controller has reconciled every Sandbox in
// ns (status.observedGeneration current) and reports each Running. It
// returns how long that took, the Running count every 10 s, and the
// control plane's peak working set meanwhile (cp's kubelet readings).
func waitAllRunning(t *testing.T, kube client.Client, cs kubernetes.Interface, cp *corev1.Pod, ns string, n int, timeout time.Duration) runningRun {
	t.Helper()
	start := time.Now()
	var out runningRun
	nextMark := time.Duration(0)
	for {
		var list v1alpha1.SandboxList
		if err := kube.List(t.Context(), &list, client.InNamespace(ns)); err != nil {
			t.Fatal(err)
		}
		phases := map[string]int{}
		done := 0
		for _, s := range list.Items {
			ready := meta.FindStatusCondition(s.Status.Conditions, v1alpha1.ConditionReady)
			key := string(s.Status.Phase)
			if ready != nil {
				key += "/" + ready.Reason
			}
			phases[key]++
			if s.Status.ObservedGeneration == s.Generation && s.Status.Phase == v1alpha1.SandboxPhaseRunning {
				done++
			}
		}
		elapsed := time.Since(start)
		if elapsed >= nextMark {
			out.running = append(out.running, done)
			nextMark += 10 * time.Second
			if u, err := readUsage(t.Context(), cs, cp); err == nil {
				out.peakMemMiB = max(out.peakMemMiB, float64(u.workingSet)/(1<<20))
			}
			// Ready pods ahead of Running sandboxes is the controller
			// behind; the other way round, kwok.
			t.Logf("%s: %d of %d Running; %s; %s", elapsed.Round(time.Second), done, n, histogram(phases), readyPods(t, cs, ns))
		}
		if done == n && len(list.Items) == n {
			if u, err := readUsage(t.Context(), cs, cp); err == nil {
				out.peakMemMiB = max(out.peakMemMiB, float64(u.workingSet)/(1<<20))
			}
			out.took = elapsed
			out.running = append(out.running, done)
			t.Logf("all %d Sandboxes Running after %s", n, elapsed.Round(time.Millisecond))
			return out
		}
		if elapsed > timeout {
			t.Fatalf("after %s, %d of %d Sandboxes Running; phases %v", elapsed.Round(time.Second), done, n, phases)
		}
		select {
		case <-t.Context().Done():
			t.Fatal(t.Context().Err())
		case <-time.After(2 * time.Second):
		}
	}
}

// readyPods says how many of ns's pods kwok reports Ready.
func readyPods(t *testing.T, cs kubernetes.Interface, ns string) string {
	t.Helper()
	pods, err := cs.CoreV1().Pods(ns).List(t.Context(), metav1.ListOptions{ResourceVersion: "0"})
	if err != nil {
		return fmt.Sprintf("pods: %v", err)
	}
	ready := 0
	for i := range pods.Items {
		for _, c := range pods.Items[i].Status.Conditions {
			if c.Type == corev1.PodReady && c.Status == corev1.ConditionTrue {
				ready++
			}
		}
	}
	return fmt.Sprintf("pods %d, ready %d", len(pods.Items), ready)
}

func histogram(m map[string]int) string {
	keys := slices.Sorted(maps.Keys(m))
	parts := make([]string, len(keys))
	for i, k := range keys {
		parts[i] = k + "=" + strconv.Itoa(m[k])
	}
	return strings.Join(parts, " ")
}

// logControllerErrors logs how many of the control plane's log lines of
// the sampling window are errors, and a few of them: a controller that
// fights its fake pods shows it there.
func logControllerErrors(t *testing.T, cs kubernetes.Interface, pod *corev1.Pod, window time.Duration) {
	t.Helper()
	raw, err := cs.CoreV1().Pods(pod.Namespace).GetLogs(pod.Name, &corev1.PodLogOptions{
		Container: pod.Spec.Containers[0].Name, SinceSeconds: ptr.To(int64(window.Seconds())),
	}).DoRaw(t.Context())
	if err != nil {
		t.Logf("control plane logs: %v", err)
		return
	}
	lines := strings.Split(strings.TrimSpace(string(raw)), "\n")
	var errs []string
	for _, l := range lines {
		if strings.Contains(l, `"level":"error"`) || strings.Contains(l, "level=ERROR") || strings.Contains(l, `"error"`) {
			errs = append(errs, l)
		}
	}
	t.Logf("control plane log, last %s: %d lines, %d mention an error", window, len(lines), len(errs))
	for _, l := range errs[:min(len(errs), 5)] {
		t.Logf("  %s", l)
	}
}

// scaleTFNamespace holds the Terraform scale benchmark's sandboxes.
const scaleTFNamespace = "agentbox-bench-tfscale"

// scaleRuntimeClass carries the fake node's selector and toleration: the
// provider's template has node_selector but no tolerations, and the API
// server adds a RuntimeClass's scheduling to every pod that names it.
const scaleRuntimeClass = "agentbox-bench-kwok"

// scaleTFConfig is var.n sandboxes of one template on the fake node.
const scaleTFConfig = configHeader + `
variable "n" {
  type    = number
  default = 0
}

resource "agentbox_sandbox_template" "kwok" {
  name               = "kwok"
  namespace          = "` + scaleTFNamespace + `"
  runtime_class_name = "` + scaleRuntimeClass + `"
  node_selector      = { "` + kwok.NodeLabel + `" = "` + kwok.NodeLabelValue + `" }
  workspace          = { size = "64Mi", storage_class_name = "` + kwok.StorageClass + `" }
}

resource "agentbox_sandbox" "s" {
  count          = var.n
  name           = format("sbx-%04d", count.index)
  namespace      = "` + scaleTFNamespace + `"
  agent_id       = format("bench-agent-%04d", count.index)
  template       = agentbox_sandbox_template.kwok.name
  wait_for_ready = false
}
`

// TestBenchTerraformScale times terraform apply, plan and refresh of a
// configuration with 50 and then 200 sandboxes; a plan right after an apply
// must find nothing to change.
func TestBenchTerraformScale(t *testing.T) {
	p := platform(t)
	cs, _, kubeconfig := scaleClient(t)
	fakeNode(t, cs, kubeconfig)
	if err := kwok.EnsureRuntimeClass(t.Context(), cs, scaleRuntimeClass); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = cs.NodeV1().RuntimeClasses().Delete(context.Background(), scaleRuntimeClass, metav1.DeleteOptions{})
	})
	scaleNamespace(t, cs, scaleTFNamespace)
	dir := p.workspace(t, scaleTFConfig)
	vars := func(n int) []string {
		return []string{"-input=false", "-no-color", "-var", "kubeconfig=" + p.kubeconfig, "-var", "image_tag=" + p.imageTag, "-var", "n=" + strconv.Itoa(n)}
	}
	timed := func(args ...string) (float64, int, string) {
		t.Helper()
		start := time.Now()
		code, out, err := tfRun(p.tf, dir, args...)
		secs := time.Since(start).Seconds()
		if err != nil {
			t.Fatal(err)
		}
		return secs, code, out
	}

	plans := map[int][]float64{}
	refreshes := map[int][]float64{}
	prev := 0
	for _, n := range []int{50, 200} {
		secs, code, out := timed(append([]string{"apply", "-auto-approve"}, vars(n)...)...)
		if code != 0 {
			t.Fatalf("apply with %d sandboxes: exit %d\n%s", n, code, lastLines(out, 40))
		}
		name := fmt.Sprintf("terraform apply, %d sandboxes", n)
		note := "wait_for_ready = false; creates the template and the sandboxes"
		if prev > 0 {
			name = fmt.Sprintf("terraform apply, %d -> %d sandboxes", prev, n)
			note = fmt.Sprintf("wait_for_ready = false; creates %d more", n-prev)
		}
		benchreport.Record(t, benchreport.Figure{Name: name, Unit: "s", Values: []float64{secs}, Note: note})
		for i := range 3 {
			secs, code, out := timed(append([]string{"plan", "-detailed-exitcode"}, vars(n)...)...)
			if code != 0 {
				t.Errorf("plan %d with %d sandboxes right after apply: exit %d, want 0 (no changes)\n%s", i+1, n, code, lastLines(out, 40))
			}
			plans[n] = append(plans[n], secs)
			secs, code, out = timed(append([]string{"apply", "-refresh-only", "-auto-approve"}, vars(n)...)...)
			if code != 0 {
				t.Errorf("refresh %d with %d sandboxes: exit %d\n%s", i+1, n, code, lastLines(out, 40))
			}
			refreshes[n] = append(refreshes[n], secs)
		}
		t.Logf("%d sandboxes: plan %v s, refresh %v s", n, plans[n], refreshes[n])
		prev = n
	}

	const target = "report; growth 50->200"
	for _, n := range []int{50, 200} {
		benchreport.Record(t, benchreport.Figure{
			Name: fmt.Sprintf("terraform plan, %d sandboxes", n), Unit: "s", Values: plans[n], Target: target,
			Note: "plan -detailed-exitcode (refreshes every resource), default -parallelism=10",
		})
		benchreport.Record(t, benchreport.Figure{
			Name: fmt.Sprintf("terraform refresh, %d sandboxes", n), Unit: "s", Values: refreshes[n], Target: target,
			Note: "apply -refresh-only -auto-approve",
		})
	}
	growth := func(m map[int][]float64) float64 {
		return benchreport.Percentile(m[200], 50) / benchreport.Percentile(m[50], 50)
	}
	benchreport.Record(t, benchreport.Figure{
		Name: "plan time growth 50 -> 200", Unit: "x", Values: []float64{growth(plans)}, Target: target,
		Note: fmt.Sprintf("median plan time ratio; linear would be 4x; refresh grows %.2fx", growth(refreshes)),
	})
}
