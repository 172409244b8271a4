package chart

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/netip"
	"os"
	"strings"
	"testing"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/remotecommand"
	utilexec "k8s.io/client-go/util/exec"
	"k8s.io/utils/ptr"

	"github.com/agentbox/terraform-provider-agentbox/internal/testenv"
	"github.com/agentbox/terraform-provider-agentbox/internal/testenv/toolchain"
)

// envImageTag names the tag of the platform images the test cluster has
// imported (make test-on-cluster sets it).
const envImageTag = "AGENTBOX_TEST_IMAGE_TAG"

// The control plane's ports, as the chart's Deployment names them.
const (
	apiPort     = 8443
	metricsPort = 8080
	healthPort  = 8081
)

// netpolValues admit the metrics port only from pods labelled scraper=yes
// and the Compute API only from pods labelled caller=yes, both in the
// release namespace (a podSelector alone selects there). Leader election
// is on so that the test can keep the controllers from starting (see
// holdLeaderLease); the store and the snapshot archive need no volume
// beyond the embedded store's claim.
const netpolValues = `leaderElection: {enabled: true}
store: {persistence: {enabled: false}}
networkPolicy:
  api: {from: [{podSelector: {matchLabels: {caller: "yes"}}}]}
  metrics: {from: [{podSelector: {matchLabels: {scraper: "yes"}}}]}
`

// TestControlPlaneNetworkPolicy installs the chart with the images under
// test on a node that enforces NetworkPolicy and shows, from pods of its
// own, that the control plane's policy admits what its values allow and
// nothing else: the metrics port only from the scraper, the Compute API
// only from the caller, the health port from both; and that the policy is
// what refuses the others, since deleting it lets them in.
//
// The control plane runs with leader election and never becomes leader (a
// Lease the test holds), so its controllers never start: it serves its
// API, metrics and health ports, as every replica does, and reconciles
// nothing that other packages' tests make at the same time on the shared
// cluster.
func TestControlPlaneNetworkPolicy(t *testing.T) {
	testenv.RequireNetworkPolicy(t)
	tag := os.Getenv(envImageTag)
	if tag == "" {
		t.Skipf("%s is not set: this test runs the platform images `make test` imports", envImageTag)
	}
	start := time.Now()
	cfg, cs := clusterClients(t)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	ns := testNamespaceFor(t, cs, "chart-netpol")
	nsObj := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns, Labels: RestrictedNamespaceLabels()}}
	if _, err := cs.CoreV1().Namespaces().Create(ctx, nsObj, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	holdLeaderLease(ctx, t, cs, ns)

	c := testClient(t, cfg)
	opts := Options{Namespace: ns, ReleaseName: DefaultReleaseName, Values: Values{ImageTag: tag, ImagePullPolicy: "Never", Raw: netpolValues}}
	if _, err := c.Install(ctx, opts); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		defer cancel()
		if err := c.Uninstall(ctx, ns, DefaultReleaseName, time.Minute, true); err != nil {
			t.Errorf("uninstall: %v", err)
		}
	})

	// The probe pods start while the control plane does.
	p := &prober{t: t, ctx: ctx, cfg: cfg, cs: cs, ns: ns}
	scraper := p.pod("scraper", map[string]string{"scraper": "yes"})
	caller := p.pod("caller", map[string]string{"caller": "yes"})
	cp := p.controlPlanePod()
	t.Logf("control plane pod %s at %s; probe pods running after %s", cp.Name, cp.Status.PodIP, time.Since(start).Round(time.Second))
	ip := cp.Status.PodIP
	metrics := target{name: "metrics", ip: ip, port: metricsPort, path: "/metrics", answer: "go_goroutines"}
	health := target{name: "health", ip: ip, port: healthPort, path: "/healthz", answer: "ok"}
	// Go's TLS server answers a plain HTTP request with this 400: the
	// Compute API itself answered.
	api := target{name: "Compute API", ip: ip, port: apiPort, path: "/", answer: "Client sent an HTTP request to an HTTPS server"}

	// Allowed first: each answer also shows the control plane listens and
	// that the enforcer knows the probe pods, so a refusal below is the
	// policy's and not a port that is not open yet.
	p.answers(scraper, metrics)
	p.answers(scraper, health)
	p.answers(caller, api)
	p.answers(caller, health)
	p.refused(caller, metrics)
	p.refused(scraper, api)

	// The mutation check: without the policy the same pods get in.
	if err := cs.NetworkingV1().NetworkPolicies(ns).Delete(ctx, "agentbox-controlplane", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	p.answers(caller, metrics)
	p.answers(scraper, api)
	// The control plane never led, so none of its controllers ran: the
	// only Lease in the namespace is the test's, still held by it (a
	// renamed leader election ID would show as a second Lease).
	leases, err := cs.CoordinationV1().Leases(ns).List(ctx, metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range leases.Items {
		if h := ptr.Deref(l.Spec.HolderIdentity, ""); l.Name != leaderLease || h != leaseHolder {
			t.Errorf("Lease %s held by %q: the control plane led and ran its controllers; the test's Lease %s must keep it from leading", l.Name, h, leaderLease)
		}
	}
	t.Logf("checked: with the NetworkPolicy deleted, the pods it refused reach the metrics port and the Compute API, so the policy is what refused them (%s in all)",
		time.Since(start).Round(time.Second))
}

// The control plane's leader election Lease, and the holder the test puts
// in it.
const (
	leaderLease = "agentbox-controlplane.agentbox.dev"
	leaseHolder = "chart-netpol-test"
)

// holdLeaderLease takes the control plane's leader election Lease in ns
// for a holder that never lets it go, so that the control plane never
// becomes leader and starts no controller.
func holdLeaderLease(ctx context.Context, t *testing.T, cs kubernetes.Interface, ns string) {
	t.Helper()
	now := metav1.NewMicroTime(time.Now())
	lease := &coordinationv1.Lease{
		ObjectMeta: metav1.ObjectMeta{Name: leaderLease, Namespace: ns},
		Spec: coordinationv1.LeaseSpec{
			HolderIdentity:       ptr.To(leaseHolder),
			LeaseDurationSeconds: ptr.To[int32](3600),
			AcquireTime:          &now,
			RenewTime:            &now,
		},
	}
	if _, err := cs.CoordinationV1().Leases(ns).Create(ctx, lease, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
}

// target is a port of the control plane pod and what it answers to a
// plain HTTP GET of path.
type target struct {
	name   string
	ip     string
	port   int
	path   string
	answer string
}

func (tg target) String() string { return fmt.Sprintf("%s (%s:%d)", tg.name, tg.ip, tg.port) }

type prober struct {
	t   *testing.T
	ctx context.Context
	cfg *rest.Config
	cs  kubernetes.Interface
	ns  string
}

// probeTimeout bounds each connection attempt (busybox nc's -w: connect
// and the final read); a port the policy refuses drops the SYN, so the
// attempt ends there.
const probeTimeout = 3

// waitBudget bounds each wait for the enforcer to catch up with a change
// (a new pod, a deleted policy); it syncs within seconds.
const waitBudget = 90 * time.Second

// pod starts a busybox pod labelled lbls under gVisor, as the platform's
// sandboxes run, meeting the restricted Pod Security Standard the release
// namespace enforces, and returns its name once it runs.
func (p *prober) pod(name string, lbls map[string]string) string {
	p.t.Helper()
	rc := testenv.RuntimeClass
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: p.ns, Labels: lbls},
		Spec: corev1.PodSpec{
			RuntimeClassName:              &rc,
			TerminationGracePeriodSeconds: ptr.To[int64](0),
			SecurityContext: &corev1.PodSecurityContext{
				RunAsNonRoot: ptr.To(true), RunAsUser: ptr.To[int64](65534), RunAsGroup: ptr.To[int64](65534),
				SeccompProfile: &corev1.SeccompProfile{Type: corev1.SeccompProfileTypeRuntimeDefault},
			},
			Containers: []corev1.Container{{
				Name: "main", Image: toolchain.BusyboxImage, ImagePullPolicy: corev1.PullNever,
				Command: []string{"sleep", "3600"},
				SecurityContext: &corev1.SecurityContext{
					AllowPrivilegeEscalation: ptr.To(false),
					Capabilities:             &corev1.Capabilities{Drop: []corev1.Capability{"ALL"}},
				},
			}},
		},
	}
	if _, err := p.cs.CoreV1().Pods(p.ns).Create(p.ctx, pod, metav1.CreateOptions{}); err != nil {
		p.t.Fatal(err)
	}
	p.waitRunning(func() (*corev1.Pod, error) { return p.cs.CoreV1().Pods(p.ns).Get(p.ctx, name, metav1.GetOptions{}) })
	return name
}

// controlPlanePod waits for the release's control plane pod to run, with
// an IP, and returns it.
func (p *prober) controlPlanePod() *corev1.Pod {
	p.t.Helper()
	return p.waitRunning(func() (*corev1.Pod, error) {
		pods, err := p.cs.CoreV1().Pods(p.ns).List(p.ctx, metav1.ListOptions{LabelSelector: "app.kubernetes.io/component=controlplane"})
		if err != nil {
			return nil, err
		}
		if len(pods.Items) != 1 {
			return nil, fmt.Errorf("%d control plane pods, want 1", len(pods.Items))
		}
		return &pods.Items[0], nil
	})
}

func (p *prober) waitRunning(get func() (*corev1.Pod, error)) *corev1.Pod {
	p.t.Helper()
	deadline := time.Now().Add(2 * time.Minute)
	for {
		pod, err := get()
		if err == nil && pod.Status.Phase == corev1.PodRunning && pod.Status.PodIP != "" {
			return pod
		}
		if err == nil {
			err = fmt.Errorf("pod %s is %s: %+v", pod.Name, pod.Status.Phase, pod.Status.ContainerStatuses)
		}
		if time.Now().After(deadline) || p.ctx.Err() != nil {
			p.t.Fatalf("waiting for a pod to run: %v", err)
		}
		time.Sleep(time.Second)
	}
}

// probe sends a plain HTTP GET to tg from the pod. It returns what came
// back, or that nc got no connection (refused, or no answer to its SYN
// within probeTimeout).
func (p *prober) probe(from string, tg target) (answer string, connected bool, detail string) {
	// Only the control plane pod the test installed, inside the test
	// cluster's range: never any other address, not even to show it is
	// refused.
	if a, err := netip.ParseAddr(tg.ip); err != nil || !netip.MustParsePrefix(testenv.PodCIDR).Contains(a) {
		p.t.Fatalf("refusing to probe %s: not a pod address of the test cluster (%s)", tg, testenv.PodCIDR)
	}
	ctx, cancel := context.WithTimeout(p.ctx, 30*time.Second)
	defer cancel()
	script := fmt.Sprintf(`printf 'GET %s HTTP/1.0\r\n\r\n' | nc -w %d %s %d`, tg.path, probeTimeout, tg.ip, tg.port)
	req := p.cs.CoreV1().RESTClient().Post().Resource("pods").Namespace(p.ns).Name(from).SubResource("exec").
		VersionedParams(&corev1.PodExecOptions{Container: "main", Command: []string{"sh", "-c", script}, Stdout: true, Stderr: true}, scheme.ParameterCodec)
	exe, err := remotecommand.NewSPDYExecutor(p.cfg, http.MethodPost, req.URL())
	if err != nil {
		p.t.Fatal(err)
	}
	var stdout, stderr bytes.Buffer
	err = exe.StreamWithContext(ctx, remotecommand.StreamOptions{Stdout: &stdout, Stderr: &stderr})
	var exit utilexec.ExitError
	switch {
	case errors.As(err, &exit):
		return "", false, fmt.Sprintf("nc exited %d: %s", exit.ExitStatus(), strings.TrimSpace(stderr.String()))
	case err != nil:
		// The exec itself failed, which proves nothing about the policy.
		p.t.Fatalf("exec the probe in %s: %v (stderr %q)", from, err, stderr.String())
	}
	return stdout.String(), true, ""
}

// answers waits until tg answers from the pod as it should.
func (p *prober) answers(from string, tg target) {
	p.t.Helper()
	start := time.Now()
	for {
		out, connected, detail := p.probe(from, tg)
		if connected && strings.Contains(out, tg.answer) {
			status, _, _ := strings.Cut(out, "\n")
			p.t.Logf("%s → %s answered as it should: %s", from, tg, strings.TrimSpace(status))
			return
		}
		if connected {
			detail = fmt.Sprintf("answer %q does not contain %q", out, tg.answer)
		}
		if time.Since(start) > waitBudget || p.ctx.Err() != nil {
			p.t.Fatalf("%s → %s: %s; it must answer", from, tg, detail)
		}
		time.Sleep(time.Second)
	}
}

// refused checks that the pod cannot connect to tg: two probes in a row
// that get no connection. A connection is tolerated only while the
// enforcer may not have caught up with the pods the test just made, and
// only within waitBudget.
func (p *prober) refused(from string, tg target) {
	p.t.Helper()
	start := time.Now()
	fails := 0
	for {
		out, connected, detail := p.probe(from, tg)
		if !connected {
			if fails++; fails == 2 {
				p.t.Logf("%s → %s refused as it should be: %s", from, tg, detail)
				return
			}
			continue
		}
		fails = 0
		if time.Since(start) > waitBudget || p.ctx.Err() != nil {
			status, _, _ := strings.Cut(out, "\n")
			p.t.Fatalf("POLICY BREACH: %s → %s connected (answer %q) for %s; the NetworkPolicy must refuse it",
				from, tg, strings.TrimSpace(status), waitBudget)
		}
		time.Sleep(time.Second)
	}
}
