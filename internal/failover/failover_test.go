package failover

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/go-logr/logr"
	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/rest"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"
	ctrllog "sigs.k8s.io/controller-runtime/pkg/log"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	"github.com/agentbox/terraform-provider-agentbox/internal/benchreport"
	"github.com/agentbox/terraform-provider-agentbox/internal/chart"
	apiclient "github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
	"github.com/agentbox/terraform-provider-agentbox/internal/testenv"
	"github.com/agentbox/terraform-provider-agentbox/internal/testenv/postgres"
	"github.com/agentbox/terraform-provider-agentbox/internal/testenv/s3server"
)

// EnvImageTag is the tag of the platform images imported into the test
// cluster; `make test` imports "dev".
const EnvImageTag = "AGENTBOX_TEST_IMAGE_TAG"

// leaderLease is the Lease the control plane replicas elect their leader
// through, in the release namespace.
const leaderLease = "agentbox-controlplane.agentbox.dev"

// convergeBound is how long the platform gets, after the load stops, to
// bring every sandbox and the pool back where they belong. A leased pool
// sandbox whose hold was lost ends after its TTL or PoolLeaseGrace.
const convergeBound = 4 * time.Minute

const poolReplicas = 3

// env is one installed platform and the workload the test runs on it.
type env struct {
	t        *testing.T
	cs       kubernetes.Interface
	kube     client.Client
	releaseN string // the release namespace
	workN    string // templates, pool and sandboxes
	api      *apiclient.Client
	access   chart.Access
	replicas int
	// variant names the platform in the figures.
	variant string
}

// EnvBench turns the failover tests on; `make bench` sets it. They take
// several minutes each (installs, idle stops, the waits for the platform to
// come back), too long for `make test`.
const EnvBench = "AGENTBOX_BENCH"

func requireBench(t *testing.T) {
	t.Helper()
	if os.Getenv(EnvBench) == "" {
		t.Skipf("%s is not set: the failover tests run with `make bench`", EnvBench)
	}
}

// TestBenchFailoverHA runs a load on a highly available platform (two control
// plane replicas on PostgreSQL, snapshots in S3) while it kills the
// leader, restarts the kube-apiserver and pauses the database, then checks
// the invariants.
func TestBenchFailoverHA(t *testing.T) {
	requireBench(t)
	cluster := testenv.AttachShared(t)
	if !cluster.HasNode() {
		t.Skip("the failover tests need a cluster with a node")
	}
	ctx := t.Context()
	pg, err := postgres.StartWith(ctx, postgres.Options{Listen: testenv.NodeIP, Trust: testenv.TestRange})
	if errors.Is(err, postgres.ErrNotInstalled) && os.Getenv("CI") == "" {
		t.Skip(err)
	}
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = pg.Stop() })
	if _, err := pg.CreateDatabase(ctx, "agentbox"); err != nil {
		t.Fatal(err)
	}
	s3 := s3server.StartOn(t, testenv.NodeIP)

	e := newEnv(t, "failover-ha", "HA, PostgreSQL", 2)
	secret := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: "failover-s3", Namespace: e.releaseN},
		StringData: map[string]string{"AWS_ACCESS_KEY_ID": s3.AccessKeyID, "AWS_SECRET_ACCESS_KEY": s3.SecretAccessKey}}
	if err := e.kube.Create(ctx, secret); err != nil {
		t.Fatal(err)
	}
	e.install(fmt.Sprintf(`replicaCount: 2
store: {dsn: %q}
snapshot:
  archive: {endpoint: %q, bucket: %s, region: %s, credentialsSecret: failover-s3, allowHTTP: true}
`, pg.TCPDSN("agentbox"), s3.Endpoint, s3.Bucket, s3.Region))
	e.workload()

	faults := []struct {
		name   string
		inject func(l *load) string
	}{
		{"leader killed", func(l *load) string {
			old := e.leader()
			// SIGKILL, not a pod deletion: a deleted pod's process gets
			// SIGTERM first and hands the Lease over; a killed one cannot.
			restarts := e.restarts(podOf(old))
			killed := e.killControlPlane(podOf(old))
			lease := e.waitNewLeader(old, 2*time.Minute)
			observed := time.Since(killed)
			took := lease.Spec.AcquireTime.Sub(killed)
			e.waitRestarted(podOf(old), restarts, 3*time.Minute)
			benchreport.Record(t, benchreport.Figure{Name: "failover: new leader after the leader's kill (" + e.variant + ")", Unit: "s",
				Values: []float64{took.Seconds()}, Note: "the leader election Lease's acquireTime after the SIGKILL of the leader's process"})
			e.waitControlPlane(3 * time.Minute)
			return fmt.Sprintf("leader %s's process killed (SIGKILL); %s took over %s after the kill (Lease acquireTime; seen after %s), transitions %d",
				podOf(old), podOf(ptr.Deref(lease.Spec.HolderIdentity, "")), took.Round(time.Millisecond), observed.Round(time.Millisecond),
				ptr.Deref(lease.Spec.LeaseTransitions, 0))
		}},
		{"kube-apiserver restarted", func(l *load) string {
			before := e.leader()
			start := time.Now()
			down, err := cluster.RestartAPIServer(ctx)
			if err != nil {
				t.Fatalf("restart kube-apiserver: %v", err)
			}
			sleep(ctx, 15*time.Second)
			after := e.leader()
			e.waitControlPlane(3 * time.Minute)
			change := "kept"
			if after != before {
				// The leader could not renew while the API server was away.
				lease := e.waitNewLeader(before, time.Minute)
				change = fmt.Sprintf("changed, the new one took over %s after the restart began", lease.Spec.AcquireTime.Sub(start).Round(time.Millisecond))
			}
			return fmt.Sprintf("kube-apiserver down %s; leader before %s, after %s (%s)", down.Round(time.Millisecond), podOf(before), podOf(after), change)
		}},
		{"PostgreSQL paused 10s", func(l *load) string {
			if err := pg.Pause(); err != nil {
				t.Fatal(err)
			}
			sleep(ctx, 10*time.Second)
			if err := pg.Resume(); err != nil {
				t.Fatal(err)
			}
			e.waitControlPlane(3 * time.Minute)
			return "PostgreSQL stopped (SIGSTOP) for 10s, then continued"
		}},
	}
	l := e.startLoad()
	sleep(ctx, 15*time.Second)
	for _, f := range faults {
		l.fault(f.name, func() string { return f.inject(l) })
		sleep(ctx, 15*time.Second)
	}
	e.finish(l)
}

// TestBenchFailoverSQLite runs the load on a single-replica platform on SQLite
// and deletes its only control plane pod under it.
func TestBenchFailoverSQLite(t *testing.T) {
	requireBench(t)
	cluster := testenv.AttachShared(t)
	if !cluster.HasNode() {
		t.Skip("the failover tests need a cluster with a node")
	}
	ctx := t.Context()
	e := newEnv(t, "failover-sqlite", "SQLite", 1)
	e.install("")
	e.workload()
	l := e.startLoad()
	sleep(ctx, 15*time.Second)
	l.fault("control plane pod deleted", func() string {
		pods := e.controlPlanePods()
		if len(pods) != 1 {
			t.Fatalf("%d control plane pods, want 1", len(pods))
		}
		if err := e.cs.CoreV1().Pods(e.releaseN).Delete(ctx, pods[0], metav1.DeleteOptions{GracePeriodSeconds: ptr.To[int64](0)}); err != nil {
			t.Fatal(err)
		}
		killed := time.Now()
		e.waitReplaced(pods[0], 4*time.Minute)
		return fmt.Sprintf("pod %s deleted (grace 0); a new one ready after %s", pods[0], time.Since(killed).Round(time.Millisecond))
	})
	sleep(ctx, 15*time.Second)
	e.finish(l)
}

func newEnv(t *testing.T, prefix, variant string, replicas int) *env {
	ctrllog.SetLogger(logr.Discard())
	cfg, _ := testenv.Shared(t)
	cs, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
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
	suffix := newID("")[1:7]
	e := &env{t: t, cs: cs, kube: kube, releaseN: prefix + "-" + suffix, workN: prefix + "-work-" + suffix, replicas: replicas, variant: variant}
	labels := chart.RestrictedNamespaceLabels()
	labels[chart.LabelManagedBy] = chart.ManagedByValue
	for _, ns := range []*corev1.Namespace{
		{ObjectMeta: metav1.ObjectMeta{Name: e.releaseN, Labels: labels}},
		{ObjectMeta: metav1.ObjectMeta{Name: e.workN}},
	} {
		if err := kube.Create(t.Context(), ns); err != nil {
			t.Fatal(err)
		}
	}
	// Cleanups run last first: the workload goes while the control plane
	// is there to take its finalizers off, then the platform.
	t.Cleanup(func() { e.deleteNamespace(e.releaseN) })
	return e
}

func (e *env) deleteNamespace(name string) {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	if err := e.cs.CoreV1().Namespaces().Delete(ctx, name, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
		e.t.Logf("delete namespace %s: %v", name, err)
		return
	}
	for ctx.Err() == nil {
		if _, err := e.cs.CoreV1().Namespaces().Get(ctx, name, metav1.GetOptions{}); apierrors.IsNotFound(err) {
			return
		}
		sleep(ctx, time.Second)
	}
	e.t.Logf("namespace %s still there after 3m", name)
}

// install installs the chart with the images under test and extra values.
func (e *env) install(raw string) {
	t := e.t
	tag := os.Getenv(EnvImageTag)
	if tag == "" {
		t.Skipf("%s is not set: the failover tests run the platform images `make test` imports", EnvImageTag)
	}
	c := chart.New(e.kubeConfig())
	c.Log = func(format string, args ...any) { t.Logf("helm: "+format, args...) }
	start := time.Now()
	// The workload has a namespace of its own, which the platform serves
	// as a user's would.
	raw = fmt.Sprintf("sandboxNamespaces: [%q]\n", e.workN) + raw
	rel, err := c.Install(t.Context(), chart.Options{Namespace: e.releaseN, ReleaseName: chart.DefaultReleaseName, Wait: true,
		Values: chart.Values{ImageTag: tag, ImagePullPolicy: "Never", Raw: raw}})
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
		defer cancel()
		if err := c.Uninstall(ctx, e.releaseN, chart.DefaultReleaseName, 2*time.Minute, true); err != nil {
			t.Logf("uninstall: %v", err)
		}
	})
	if err != nil {
		t.Fatalf("install: %v", err)
	}
	access, err := chart.ReadAccess(t.Context(), e.cs, rel)
	if err != nil {
		t.Fatal(err)
	}
	e.access = access
	e.api = e.newClient()
	t.Logf("platform installed in %s (%d replicas) after %s", e.releaseN, e.replicas, time.Since(start).Round(time.Second))
}

// newClient returns a Compute API client with connections of its own:
// the Service spreads connections, not calls, over the replicas, so each
// worker of the load has its own to reach either.
func (e *env) newClient() *apiclient.Client {
	api, err := apiclient.New(e.access.Endpoint, e.access.AdminToken, []byte(e.access.CACertificate))
	if err != nil {
		e.t.Fatal(err)
	}
	hc := api.HTTPClient()
	hc.Transport = idTransport{base: hc.Transport}
	e.t.Cleanup(api.CloseIdleConnections)
	return api
}

func (e *env) kubeConfig() *rest.Config {
	cfg, _ := testenv.Shared(e.t)
	return cfg
}

// workload creates a small gVisor template, a warm pool of it, two agent
// sandboxes and one that idles out after 20 s, and waits until they serve.
func (e *env) workload() {
	t := e.t
	ctx := t.Context()
	tmpl := &v1alpha1.SandboxTemplate{
		ObjectMeta: metav1.ObjectMeta{Name: "small", Namespace: e.workN},
		Spec: v1alpha1.SandboxTemplateSpec{
			RuntimeClassName: testenv.RuntimeClass,
			Resources: corev1.ResourceRequirements{
				Requests: corev1.ResourceList{corev1.ResourceCPU: resource.MustParse("10m"), corev1.ResourceMemory: resource.MustParse("64Mi")},
				Limits:   corev1.ResourceList{corev1.ResourceMemory: resource.MustParse("256Mi")},
			},
			Workspace: v1alpha1.WorkspaceSpec{Size: resource.MustParse("64Mi")},
		},
	}
	objs := []client.Object{tmpl,
		&v1alpha1.SandboxWarmPool{ObjectMeta: metav1.ObjectMeta{Name: "warm", Namespace: e.workN},
			Spec: v1alpha1.SandboxWarmPoolSpec{TemplateRef: v1alpha1.LocalObjectReference{Name: "small"}, Replicas: poolReplicas}},
	}
	for _, name := range []string{"agent-a", "agent-b", "idler"} {
		sb := &v1alpha1.Sandbox{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: e.workN},
			Spec: v1alpha1.SandboxSpec{AgentID: e.agent(name), TemplateRef: v1alpha1.LocalObjectReference{Name: "small"}}}
		if name == "idler" {
			sb.Spec.IdleTimeout = &metav1.Duration{Duration: 20 * time.Second}
		}
		objs = append(objs, sb)
	}
	for _, o := range objs {
		if err := e.kube.Create(ctx, o); err != nil {
			t.Fatal(err)
		}
	}
	// The workload goes before the platform (cleanups run last first).
	t.Cleanup(func() { e.deleteNamespace(e.workN) })
	start := time.Now()
	if msg := e.poll(5*time.Minute, func(ctx context.Context) string {
		for _, name := range []string{"agent-a", "agent-b", "idler"} {
			// The idler may idle out before the others are ready.
			if msg := e.sandboxState(ctx, name, name == "idler"); msg != "" {
				return msg
			}
		}
		return e.poolState(ctx, false)
	}); msg != "" {
		t.Fatalf("the workload is not ready after 5m: %s", msg)
	}
	t.Logf("workload ready after %s", time.Since(start).Round(time.Second))
}

func (e *env) agent(name string) string { return e.workN + "-" + name }

// sandboxState is "" when the sandbox is where it should be: Running and
// Ready, or for the idler also Stopped when stopped is allowed.
func (e *env) sandboxState(ctx context.Context, name string, stoppedOK bool) string {
	var sb v1alpha1.Sandbox
	if err := e.kube.Get(ctx, client.ObjectKey{Namespace: e.workN, Name: name}, &sb); err != nil {
		return err.Error()
	}
	ready := meta.IsStatusConditionTrue(sb.Status.Conditions, v1alpha1.ConditionReady)
	switch {
	case sb.Status.Phase == v1alpha1.SandboxPhaseRunning && ready:
		return ""
	case stoppedOK && sb.Status.Phase == v1alpha1.SandboxPhaseStopped:
		return ""
	}
	reason := ""
	if c := meta.FindStatusCondition(sb.Status.Conditions, v1alpha1.ConditionReady); c != nil {
		reason = c.Reason + ": " + c.Message
	}
	return fmt.Sprintf("sandbox %s is %s (%s)", name, sb.Status.Phase, reason)
}

// poolState is "" when the pool has all its replicas ready and, when
// noLeased, no leased sandbox is left.
func (e *env) poolState(ctx context.Context, noLeased bool) string {
	var pool v1alpha1.SandboxWarmPool
	if err := e.kube.Get(ctx, client.ObjectKey{Namespace: e.workN, Name: "warm"}, &pool); err != nil {
		return err.Error()
	}
	if pool.Status.ReadyReplicas != poolReplicas {
		return fmt.Sprintf("pool has %d ready replicas, want %d", pool.Status.ReadyReplicas, poolReplicas)
	}
	if !noLeased {
		return ""
	}
	var list v1alpha1.SandboxList
	if err := e.kube.List(ctx, &list, client.InNamespace(e.workN)); err != nil {
		return err.Error()
	}
	for i := range list.Items {
		if sb := &list.Items[i]; v1alpha1.PoolLeased(sb) {
			return fmt.Sprintf("pool sandbox %s is still leased (holder %q, request %q, leased at %s)", sb.Name,
				sb.Annotations[v1alpha1.AnnotationPoolLeaseHolder], sb.Annotations[v1alpha1.AnnotationPoolLeaseRequestID], sb.Annotations[v1alpha1.AnnotationPoolLeasedAt])
		}
	}
	return ""
}

// poll calls check every second until it returns "" or bound passes, and
// returns its last answer. Errors of the kube-apiserver while it restarts
// are answers like any other.
func (e *env) poll(bound time.Duration, check func(ctx context.Context) string) string {
	deadline := time.Now().Add(bound)
	for {
		ctx, cancel := context.WithTimeout(e.t.Context(), 10*time.Second)
		msg := check(ctx)
		cancel()
		if msg == "" || time.Now().After(deadline) || e.t.Context().Err() != nil {
			return msg
		}
		sleep(e.t.Context(), time.Second)
	}
}

// leader is the holder identity of the leader election Lease.
func (e *env) leader() string {
	var holder string
	if msg := e.poll(time.Minute, func(ctx context.Context) string {
		var l coordinationv1.Lease
		if err := e.kube.Get(ctx, client.ObjectKey{Namespace: e.releaseN, Name: leaderLease}, &l); err != nil {
			return err.Error()
		}
		holder = ptr.Deref(l.Spec.HolderIdentity, "")
		if holder == "" {
			return "no holder"
		}
		return ""
	}); msg != "" {
		e.t.Fatalf("leader election Lease: %s", msg)
	}
	return holder
}

func (e *env) waitNewLeader(old string, bound time.Duration) *coordinationv1.Lease {
	var l coordinationv1.Lease
	if msg := e.poll(bound, func(ctx context.Context) string {
		if err := e.kube.Get(ctx, client.ObjectKey{Namespace: e.releaseN, Name: leaderLease}, &l); err != nil {
			return err.Error()
		}
		if h := ptr.Deref(l.Spec.HolderIdentity, ""); h == "" || h == old {
			return "still held by " + old
		}
		return ""
	}); msg != "" {
		e.t.Fatalf("no new leader within %s: %s", bound, msg)
	}
	return &l
}

// podOf is the pod name in a leader election holder identity
// (<pod>_<uuid>).
func podOf(holder string) string {
	for i := 0; i < len(holder); i++ {
		if holder[i] == '_' {
			return holder[:i]
		}
	}
	return holder
}

func (e *env) controlPlanePods() []string {
	var pods corev1.PodList
	if err := e.kube.List(e.t.Context(), &pods, client.InNamespace(e.releaseN),
		client.MatchingLabels{"app.kubernetes.io/component": "controlplane"}); err != nil {
		e.t.Fatal(err)
	}
	var names []string
	for _, p := range pods.Items {
		if p.DeletionTimestamp.IsZero() {
			names = append(names, p.Name)
		}
	}
	return names
}

// restarts is the control plane container's restart count in pod.
func (e *env) restarts(pod string) int32 {
	p, err := e.cs.CoreV1().Pods(e.releaseN).Get(e.t.Context(), pod, metav1.GetOptions{})
	if err != nil {
		e.t.Fatal(err)
	}
	var n int32
	for _, c := range p.Status.ContainerStatuses {
		n += c.RestartCount
	}
	return n
}

// killControlPlane sends SIGKILL to the control plane process of pod: the
// processes on this host whose cgroup is the pod's and whose command is the
// control plane binary. It returns when.
func (e *env) killControlPlane(pod string) time.Time {
	p, err := e.cs.CoreV1().Pods(e.releaseN).Get(e.t.Context(), pod, metav1.GetOptions{})
	if err != nil {
		e.t.Fatal(err)
	}
	pids := podProcesses(string(p.UID), "agentbox-controlplane")
	if len(pids) == 0 {
		e.t.Fatalf("no control plane process of pod %s (uid %s) on this host", pod, p.UID)
	}
	for _, pid := range pids {
		if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
			e.t.Fatalf("kill %d: %v", pid, err)
		}
	}
	return time.Now()
}

// podProcesses lists the processes in the cgroup of the pod with uid whose
// command line starts with a path ending in command.
func podProcesses(uid, command string) []int {
	forms := []string{"pod" + uid, "pod" + strings.ReplaceAll(uid, "-", "_")}
	entries, _ := os.ReadDir("/proc")
	var pids []int
	for _, ent := range entries {
		pid, err := strconv.Atoi(ent.Name())
		if err != nil {
			continue
		}
		cg, err := os.ReadFile(filepath.Join("/proc", ent.Name(), "cgroup"))
		if err != nil || !(strings.Contains(string(cg), forms[0]) || strings.Contains(string(cg), forms[1])) {
			continue
		}
		cmdline, err := os.ReadFile(filepath.Join("/proc", ent.Name(), "cmdline"))
		if err != nil {
			continue
		}
		argv0, _, _ := strings.Cut(string(cmdline), "\x00")
		if filepath.Base(argv0) == command {
			pids = append(pids, pid)
		}
	}
	return pids
}

// waitRestarted waits until pod's control plane container has restarted
// (its count past before) and every replica is ready again.
func (e *env) waitRestarted(pod string, before int32, bound time.Duration) {
	if msg := e.poll(bound, func(ctx context.Context) string {
		p, err := e.cs.CoreV1().Pods(e.releaseN).Get(ctx, pod, metav1.GetOptions{})
		if err != nil {
			return err.Error()
		}
		var n int32
		for _, c := range p.Status.ContainerStatuses {
			n += c.RestartCount
		}
		if n <= before {
			return fmt.Sprintf("pod %s not restarted yet", pod)
		}
		return e.readyState(ctx, "")
	}); msg != "" {
		e.t.Fatalf("control plane not back within %s: %s", bound, msg)
	}
}

// waitReplaced waits until pod is gone and the replicas are ready without it.
func (e *env) waitReplaced(pod string, bound time.Duration) {
	if msg := e.poll(bound, func(ctx context.Context) string { return e.readyState(ctx, pod) }); msg != "" {
		e.t.Fatalf("control plane not back within %s: %s", bound, msg)
	}
}

// readyState is "" when as many control plane pods as replicas are ready,
// none of them gone.
func (e *env) readyState(ctx context.Context, gone string) string {
	var pods corev1.PodList
	if err := e.kube.List(ctx, &pods, client.InNamespace(e.releaseN),
		client.MatchingLabels{"app.kubernetes.io/component": "controlplane"}); err != nil {
		return err.Error()
	}
	ready := 0
	for _, p := range pods.Items {
		if p.Name == gone {
			return fmt.Sprintf("pod %s still there", gone)
		}
		for _, c := range p.Status.Conditions {
			if c.Type == corev1.PodReady && c.Status == corev1.ConditionTrue && p.DeletionTimestamp.IsZero() {
				ready++
			}
		}
	}
	if ready != e.replicas {
		return fmt.Sprintf("%d of %d control plane pods ready", ready, e.replicas)
	}
	return ""
}

// waitControlPlane waits until the Deployment has all its replicas ready.
func (e *env) waitControlPlane(bound time.Duration) {
	if msg := e.poll(bound, func(ctx context.Context) string {
		d, err := e.cs.AppsV1().Deployments(e.releaseN).Get(ctx, chart.ControlPlaneDeployment, metav1.GetOptions{})
		if err != nil {
			return err.Error()
		}
		if int(d.Status.ReadyReplicas) != e.replicas || int(d.Status.Replicas) != e.replicas {
			return fmt.Sprintf("%d of %d replicas ready (%d in all)", d.Status.ReadyReplicas, e.replicas, d.Status.Replicas)
		}
		return e.readyState(ctx, "")
	}); msg != "" {
		e.t.Fatalf("control plane not back within %s: %s", bound, msg)
	}
}

// load is the running load and what it recorded.
type load struct {
	e      *env
	rec    *recorder
	cancel context.CancelFunc
	wg     sync.WaitGroup
	start  time.Time
	faults []fault
	notes  []string

	mu        sync.Mutex
	lost      []string
	idleStops int
	resumes   []time.Time
}

// startLoad starts two pool lease workers, a command loop on each of the
// two agent sandboxes and one on the idler, which waits for each idle stop
// before its next call.
func (e *env) startLoad() *load {
	ctx, cancel := context.WithCancel(e.t.Context())
	l := &load{e: e, rec: &recorder{}, cancel: cancel, start: time.Now()}
	run := func(fn func()) {
		l.wg.Add(1)
		go func() { defer l.wg.Done(); fn() }()
	}
	for _, h := range []string{"holder-1", "holder-2"} {
		api := e.newClient()
		run(func() { poolWorker(ctx, l.rec, api, e.workN, "warm", h) })
	}
	for _, name := range []string{"agent-a", "agent-b"} {
		api := e.newClient()
		run(func() {
			agentWorker(ctx, l.rec, api, e.agent(name), 300*time.Millisecond, commandTimeout, &l.lost, &l.mu)
		})
	}
	idlerAPI := e.newClient()
	run(func() { l.idler(ctx, idlerAPI) })
	return l
}

// idler waits for the idler sandbox to be stopped, then resumes it with a
// call that checks that its workspace kept what earlier calls wrote.
func (l *load) idler(ctx context.Context, api *apiclient.Client) {
	e := l.e
	want := 0
	var lastOK time.Time
	for ctx.Err() == nil {
		stopped := false
		deadline := time.Now().Add(2 * time.Minute)
		for !stopped && ctx.Err() == nil && time.Now().Before(deadline) {
			var sb v1alpha1.Sandbox
			cctx, cancel := context.WithTimeout(ctx, 10*time.Second)
			err := e.kube.Get(cctx, client.ObjectKey{Namespace: e.workN, Name: "idler"}, &sb)
			cancel()
			if err == nil && sb.Status.Phase == v1alpha1.SandboxPhaseStopped {
				stopped = true
				l.mu.Lock()
				l.idleStops++
				l.mu.Unlock()
				continue
			}
			sleep(ctx, time.Second)
		}
		// The call that wakes it is retried until it succeeds, so that
		// each round is one stop and one resume.
		var res *apiclient.CommandResult
		for ctx.Err() == nil {
			err := l.rec.do(ctx, "idle_resume_command", e.agent("idler"), resumeTimeout, func(ctx context.Context) error {
				var err error
				res, err = api.RunCommand(ctx, e.agent("idler"), apiclient.RunCommandRequest{Command: []string{"sh", "-c", "echo x >> failover.log && wc -l < failover.log"}})
				return err
			})
			if err == nil {
				break
			}
			res = nil
			sleep(ctx, 2*time.Second)
		}
		if res == nil {
			return
		}
		var n int
		_, _ = fmt.Sscanf(res.Stdout, "%d", &n)
		l.mu.Lock()
		if n < want+1 {
			l.lost = append(l.lost, fmt.Sprintf("idler: %d lines after the resume answered at %s, want at least %d (the last good call answered at %s)",
				n, time.Now().UTC().Format(time.RFC3339Nano), want+1, lastOK.UTC().Format(time.RFC3339Nano)))
		}
		want, lastOK = n, time.Now()
		if stopped {
			l.resumes = append(l.resumes, time.Now())
		}
		l.mu.Unlock()
	}
}

// fault injects one fault while the load runs and records when.
func (l *load) fault(name string, inject func() string) {
	at := time.Now()
	l.faults = append(l.faults, fault{Name: name, At: at})
	note := inject()
	l.notes = append(l.notes, note)
	l.e.t.Logf("FAULT %s at +%s: %s", name, at.Sub(l.start).Round(time.Millisecond), note)
}

// finish keeps the load up until the idler has been resumed after the last
// fault, stops it, and checks the invariants.
func (e *env) finish(l *load) {
	t := e.t
	last := l.faults[len(l.faults)-1].At
	deadline := time.Now().Add(3 * time.Minute)
	for time.Now().Before(deadline) {
		l.mu.Lock()
		done := len(l.resumes) > 0 && l.resumes[len(l.resumes)-1].After(last)
		l.mu.Unlock()
		if done {
			break
		}
		sleep(t.Context(), time.Second)
	}
	l.cancel()
	l.wg.Wait()
	end := time.Now()
	t.Logf("FIGURE load ran %s", end.Sub(l.start).Round(time.Second))
	e.logRestarts()

	calls := l.rec.calls
	checkCalls(t, calls)
	for i, f := range l.faults {
		to := end
		if i+1 < len(l.faults) {
			to = l.faults[i+1].At
		}
		d, n := unavailability(calls, f.At, to)
		shown := 0
		for _, c := range calls {
			if c.Start.Before(f.At) || !c.Start.Before(to) || !c.down() {
				continue
			}
			if shown++; shown > 10 {
				break
			}
			t.Logf("after %q: %s %s started +%s, failed after %s: %s", f.Name, c.Op, c.Agent,
				c.Start.Sub(f.At).Round(time.Millisecond), c.End.Sub(c.Start).Round(time.Millisecond), c.Code)
		}
		if d < 0 {
			t.Errorf("INVARIANT the API never answered again after %q (%d failed calls)", f.Name, n)
			continue
		}
		benchreport.Record(t, benchreport.Figure{Name: "failover: API unavailable after " + f.Name + " (" + e.variant + ")", Unit: "s",
			Values: []float64{d.Seconds()}, Note: fmt.Sprintf("first failed call to the first success after it; %d calls failed", n)})
	}
	checkGrants(t, l.rec.grants, end)

	l.mu.Lock()
	t.Logf("FIGURE idler: %d idle stops seen, %d resuming calls succeeded", l.idleStops, len(l.resumes))
	if l.idleStops == 0 || len(l.resumes) == 0 {
		t.Errorf("INVARIANT the idler was not idle-stopped and resumed (stops %d, resumes %d)", l.idleStops, len(l.resumes))
	} else if !l.resumes[len(l.resumes)-1].After(last) {
		t.Errorf("INVARIANT the idler was not resumed after the last fault")
	}
	for _, s := range l.lost {
		t.Errorf("INVARIANT workspace lost a write: %s", s)
	}
	lost := len(l.lost) > 0
	l.mu.Unlock()
	if lost || os.Getenv("AGENTBOX_FAILOVER_STORY") != "" {
		e.logIdlerStory()
	}

	start := time.Now()
	msg := e.poll(convergeBound, func(ctx context.Context) string {
		for _, name := range []string{"agent-a", "agent-b", "idler"} {
			if msg := e.sandboxState(ctx, name, name == "idler"); msg != "" {
				return msg
			}
		}
		return e.poolState(ctx, true)
	})
	if msg != "" {
		t.Errorf("INVARIANT not converged within %s after the load: %s", convergeBound, msg)
	} else {
		t.Logf("FIGURE converged %s after the load stopped", time.Since(start).Round(time.Second))
	}
	checkAudit(t, t.Context(), e.api, calls, l.start.Add(-time.Minute))
}
