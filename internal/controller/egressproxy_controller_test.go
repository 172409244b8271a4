package controller

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/go-logr/logr/funcr"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/client-go/kubernetes"
	"k8s.io/utils/ptr"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/cache"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/config"
	metricsserver "sigs.k8s.io/controller-runtime/pkg/metrics/server"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"
	"github.com/agentbox/terraform-provider-agentbox/internal/testenv"
	"github.com/agentbox/terraform-provider-agentbox/internal/testenv/toolchain"
)

// EnvEgressProxyImage names the egress proxy image imported into the test
// node; it defaults to the one `make images` builds.
const EnvEgressProxyImage = "AGENTBOX_TEST_EGRESS_PROXY_IMAGE"

// testEgressReconciler is the EgressProxy reconciler of the tests whose
// proxy pods serve: the proxy image under test (the default one when
// EnvEgressProxyImage is unset), loopback and link-local denied, gVisor.
func testEgressReconciler() *EgressProxyReconciler {
	image := os.Getenv(EnvEgressProxyImage)
	if image == "" {
		image = DefaultEgressProxyImage
	}
	return &EgressProxyReconciler{
		Namespace:        testPlatformNamespace,
		Image:            image,
		BaseDeniedCIDRs:  []string{"127.0.0.0/8", "169.254.0.0/16", "::1/128"},
		RuntimeClassName: testenv.RuntimeClass,
	}
}

// startEgressManager runs an EgressProxyReconciler for the test's
// namespace beside the Sandbox controller's manager, as the control plane
// runs both, until the test ends or the returned stop is called; stop
// returns once the manager has.
func (e *clusterEnv) startEgressManager(r *EgressProxyReconciler) (stop func()) {
	t := e.t
	var logMu sync.Mutex
	var logBuf bytes.Buffer
	logger := funcr.New(func(prefix, args string) {
		logMu.Lock()
		defer logMu.Unlock()
		fmt.Fprintln(&logBuf, time.Now().Format("15:04:05.000"), prefix, args)
	}, funcr.Options{Verbosity: 1})
	mgr, err := ctrl.NewManager(e.cfg, ctrl.Options{
		Scheme:                 e.scheme,
		Logger:                 logger,
		Cache:                  cache.Options{DefaultNamespaces: map[string]cache.Config{e.ns: {}}},
		Metrics:                metricsserver.Options{BindAddress: "0"},
		HealthProbeBindAddress: "0",
		Controller:             config.Controller{SkipNameValidation: ptr.To(true)},
	})
	must(t, err)
	must(t, r.SetupWithManager(mgr))
	ctx, cancel := context.WithCancel(e.ctx)
	done := make(chan error, 1)
	go func() { done <- mgr.Start(ctx) }()
	var once sync.Once
	stop = func() {
		once.Do(func() {
			cancel()
			if err := <-done; err != nil {
				t.Errorf("egress manager: %v", err)
			}
		})
	}
	t.Cleanup(func() {
		stop()
		if t.Failed() {
			logMu.Lock()
			t.Logf("egress controller log:\n%s", logBuf.String())
			logMu.Unlock()
		}
	})
	return stop
}

// egressProbe runs inside the sandbox, through the supervisor. It uses
// the proxy variables the pod was given (urllib reads them like curl and
// pip do), fetches the allowed URL once and then repeatedly for a latency
// figure, and tries the URL that is not allowed.
const egressProbe = `
import json, os, sys, time, urllib.request, urllib.error
allowed, denied = sys.argv[1], sys.argv[2]
out = {"proxy": os.environ.get("HTTP_PROXY", ""), "https_proxy": os.environ.get("https_proxy", "")}
t = time.perf_counter()
out["body"] = urllib.request.urlopen(allowed, timeout=20).read().decode()
out["first_ms"] = (time.perf_counter() - t) * 1000
lat = []
for _ in range(20):
    t = time.perf_counter()
    urllib.request.urlopen(allowed, timeout=20).read()
    lat.append((time.perf_counter() - t) * 1000)
lat.sort()
out["p50_ms"], out["max_ms"] = lat[len(lat) // 2], lat[-1]
try:
    urllib.request.urlopen(denied, timeout=20).read()
    out["denied_status"] = 200
except urllib.error.HTTPError as e:
    out["denied_status"] = e.code
    out["denied_reason"] = e.headers.get("X-Agentbox-Egress-Denied", "")
print(json.dumps(out))
`

type egressProbeResult struct {
	Proxy        string  `json:"proxy"`
	HTTPSProxy   string  `json:"https_proxy"`
	Body         string  `json:"body"`
	FirstMS      float64 `json:"first_ms"`
	P50MS        float64 `json:"p50_ms"`
	MaxMS        float64 `json:"max_ms"`
	DeniedStatus int     `json:"denied_status"`
	DeniedReason string  `json:"denied_reason"`
}

// TestEgressProxyPerAgent runs a sandbox whose template names a PerAgent
// proxy on the local cluster: the proxy pod (on gVisor) becomes ready, and
// a request from inside the sandbox through HTTP_PROXY reaches an allowed
// server while a name off the allowlist gets the proxy's 403.
//
// Every destination is a pod this test creates: the "internet" is a
// busybox httpd in the test namespace, allowed by its pod IP (the test
// cluster has no DNS). The proxy's built-in denial of private ranges would
// refuse that IP, so the test replaces the base ranges with loopback and
// link-local only; the name that is refused is under .invalid and is
// refused by the allowlist before any lookup or connection. The pod's
// address is also in allowedCIDRs: on a node that enforces NetworkPolicy
// the proxy pods' policy keeps them out of the private ranges, the test
// cluster's included, except for those.
//
// TestSandboxFence shows, under enforcement, that the sandbox reaches
// nothing but its proxy.
func TestEgressProxyPerAgent(t *testing.T) {
	t.Parallel()
	image := os.Getenv(EnvSandboxImage)
	if image == "" {
		t.Skipf("%s is not set: the test runs commands through the real sandbox image's supervisor", EnvSandboxImage)
	}
	e := newClusterEnv(t)
	e.startEgressManager(testEgressReconciler())
	cs, err := kubernetes.NewForConfig(e.cfg)
	must(t, err)

	targetIP := e.startEgressTarget()

	proxy := &v1alpha1.EgressProxy{
		ObjectMeta: metav1.ObjectMeta{Name: "egress", Namespace: e.ns},
		Spec: v1alpha1.EgressProxySpec{
			Mode:           v1alpha1.EgressProxyModePerAgent,
			AllowedDomains: []v1alpha1.Domain{v1alpha1.Domain(targetIP)},
			AllowedCIDRs:   []v1alpha1.AllowedCIDR{v1alpha1.AllowedCIDR(targetIP + "/32")},
		},
	}
	must(t, e.c.Create(e.ctx, proxy))
	e.template("tpl", func(tpl *v1alpha1.SandboxTemplate) {
		tpl.Spec.Image = image
		tpl.Spec.EgressProxyRef = &v1alpha1.LocalObjectReference{Name: "egress"}
	})
	start := time.Now()
	e.sandbox("agent", "tpl")

	var proxyReadyAfter time.Duration
	var proxyPod corev1.Pod
	e.eventually("the proxy pod to be ready", func() error {
		if err := e.get(EgressServiceName("agent"), &proxyPod); err != nil {
			return err
		}
		if !podReady(&proxyPod) {
			return fmt.Errorf("proxy pod is %s: %+v", proxyPod.Status.Phase, proxyPod.Status.ContainerStatuses)
		}
		proxyReadyAfter = time.Since(start)
		return nil
	})
	if ptr.Deref(proxyPod.Spec.RuntimeClassName, "") != testenv.RuntimeClass {
		t.Errorf("proxy pod runtime class %v", proxyPod.Spec.RuntimeClassName)
	}
	endpoint := egressProxyEndpoint(EgressServiceName("agent"), e.ns)
	e.eventually("the EgressProxy to report its endpoint", func() error {
		if err := e.get("egress", proxy); err != nil {
			return err
		}
		c := meta.FindStatusCondition(proxy.Status.Conditions, v1alpha1.ConditionReady)
		if c == nil || c.Reason != v1alpha1.ReasonProxyAvailable || len(proxy.Status.ReadyEndpoints) != 1 || proxy.Status.ReadyEndpoints[0] != endpoint {
			return fmt.Errorf("Ready %+v, endpoints %v", c, proxy.Status.ReadyEndpoints)
		}
		return nil
	})

	sbx := e.waitReason("agent", v1alpha1.ReasonRunning)
	sandboxReadyAfter := time.Since(start)
	sup := e.supervisor(t, sbx)

	allowedURL := "http://" + targetIP + ":8080/index.html"
	got, err := e.runEgressProbe(sup, allowedURL)
	if err != nil {
		t.Fatal(err)
	}
	var svc corev1.Service
	must(t, e.get(EgressServiceName("agent"), &svc))
	wantProxy := fmt.Sprintf("http://%s:%d", svc.Spec.ClusterIP, EgressProxyPort)
	if got.Proxy != wantProxy || got.HTTPSProxy != wantProxy {
		t.Errorf("the sandbox's HTTP_PROXY %q, https_proxy %q; want %q", got.Proxy, got.HTTPSProxy, wantProxy)
	}
	if strings.TrimSpace(got.Body) != "hello-from-egress-target" {
		t.Errorf("allowed request returned %q", got.Body)
	}
	if got.DeniedStatus != 403 || got.DeniedReason != "not_allowed" {
		t.Errorf("request to a name off the allowlist: status %d, reason %q; want 403 not_allowed from the proxy", got.DeniedStatus, got.DeniedReason)
	}

	// The proxy, not a direct connection, carried both: its access log has
	// the allowed request and the refusal.
	var logs []byte
	e.eventually("the proxy's access log", func() error {
		logs, err = cs.CoreV1().Pods(e.ns).GetLogs(proxyPod.Name, &corev1.PodLogOptions{Container: egressContainerName}).DoRaw(e.ctx)
		if err != nil {
			return err
		}
		if !bytes.Contains(logs, []byte(`"host":"`+targetIP+`"`)) || !bytes.Contains(logs, []byte(`"host":"not-allowed.invalid"`)) {
			return errors.New("the access log lacks the requests")
		}
		return nil
	})
	for _, line := range bytes.Split(logs, []byte("\n")) {
		if bytes.Contains(line, []byte("not-allowed.invalid")) && !bytes.Contains(line, []byte(`"decision":"deny"`)) {
			t.Errorf("the refused request is logged as %s", line)
		}
	}

	t.Logf("proxy pod ready %s after the Sandbox was created (sandbox Running after %s)",
		proxyReadyAfter.Round(time.Millisecond), sandboxReadyAfter.Round(time.Millisecond))
	t.Logf("GET through the proxy from inside the sandbox: first %.1f ms, p50 %.1f ms, max %.1f ms over 20 (python urllib, new connection each)",
		got.FirstMS, got.P50MS, got.MaxMS)
}

// runEgressProbe runs egressProbe in the sandbox against allowedURL and a
// name off the allowlist.
func (e *clusterEnv) runEgressProbe(sup *supervisorapi.Client, allowedURL string) (*egressProbeResult, error) {
	res, err := sup.RunCommand(e.ctx, supervisorapi.CommandRequest{
		Command: []string{"python3", "-c", egressProbe, allowedURL, "http://not-allowed.invalid/"},
		Cwd:     "/tmp",
	})
	if err != nil {
		return nil, fmt.Errorf("run the probe in the sandbox: %w", err)
	}
	if res.ExitCode != 0 {
		return nil, fmt.Errorf("probe exited %d: %s", res.ExitCode, res.Stderr)
	}
	var got egressProbeResult
	if err := json.Unmarshal([]byte(strings.TrimSpace(res.Stdout)), &got); err != nil {
		return nil, fmt.Errorf("probe output %q: %w", res.Stdout, err)
	}
	return &got, nil
}

// TestEgressProxyShared runs a Shared proxy (one Deployment) for a sandbox
// on the local cluster. The sandbox authenticates with its own
// credentials, which the proxy's access log shows as the agent. The
// destinations and the caveats are those of TestEgressProxyPerAgent.
func TestEgressProxyShared(t *testing.T) {
	t.Parallel()
	image := os.Getenv(EnvSandboxImage)
	if image == "" {
		t.Skipf("%s is not set: the test runs commands through the real sandbox image's supervisor", EnvSandboxImage)
	}
	e := newClusterEnv(t)
	e.startEgressManager(testEgressReconciler())
	cs, err := kubernetes.NewForConfig(e.cfg)
	must(t, err)
	targetIP := e.startEgressTarget()

	proxy := &v1alpha1.EgressProxy{
		ObjectMeta: metav1.ObjectMeta{Name: "shared", Namespace: e.ns},
		Spec: v1alpha1.EgressProxySpec{
			Mode:           v1alpha1.EgressProxyModeShared,
			AllowedDomains: []v1alpha1.Domain{v1alpha1.Domain(targetIP)},
			AllowedCIDRs:   []v1alpha1.AllowedCIDR{v1alpha1.AllowedCIDR(targetIP + "/32")},
		},
	}
	must(t, e.c.Create(e.ctx, proxy))
	e.template("tpl", func(tpl *v1alpha1.SandboxTemplate) {
		tpl.Spec.Image = image
		tpl.Spec.EgressProxyRef = &v1alpha1.LocalObjectReference{Name: "shared"}
	})
	start := time.Now()
	e.sandbox("agent", "tpl")
	endpoint := egressProxyEndpoint(egressSharedName("shared"), e.ns)
	var proxyReadyAfter time.Duration
	e.eventually("the shared proxy to be available", func() error {
		if err := e.get("shared", proxy); err != nil {
			return err
		}
		c := meta.FindStatusCondition(proxy.Status.Conditions, v1alpha1.ConditionReady)
		if c == nil || c.Reason != v1alpha1.ReasonProxyAvailable || len(proxy.Status.ReadyEndpoints) != 1 || proxy.Status.ReadyEndpoints[0] != endpoint {
			return fmt.Errorf("Ready %+v, endpoints %v", c, proxy.Status.ReadyEndpoints)
		}
		proxyReadyAfter = time.Since(start)
		return nil
	})
	sbx := e.waitReason("agent", v1alpha1.ReasonRunning)
	sup := e.supervisor(t, sbx)

	// The proxy learns the sandbox's credentials when the controller has
	// written them into its client list and the proxy has reloaded it (it
	// polls every few seconds); until then it answers 407.
	var got *egressProbeResult
	probeStart := time.Now()
	e.eventually("a request through the shared proxy", func() error {
		got, err = e.runEgressProbe(sup, "http://"+targetIP+":8080/index.html")
		return err
	})
	var svc corev1.Service
	must(t, e.get(egressSharedName("shared"), &svc))
	if !strings.HasPrefix(got.Proxy, "http://agent:") || !strings.HasSuffix(got.Proxy, "@"+svc.Spec.ClusterIP+":3128") ||
		strings.Contains(got.Proxy, "$(") {
		t.Errorf("HTTP_PROXY in the sandbox is %q; want the sandbox's expanded credentials and the shared Service", got.Proxy)
	}
	if strings.TrimSpace(got.Body) != "hello-from-egress-target" {
		t.Errorf("allowed request returned %q", got.Body)
	}
	if got.DeniedStatus != 403 || got.DeniedReason != "not_allowed" {
		t.Errorf("request to a name off the allowlist: status %d, reason %q; want 403 not_allowed", got.DeniedStatus, got.DeniedReason)
	}
	var pods corev1.PodList
	must(t, e.c.List(e.ctx, &pods, client.InNamespace(e.ns), client.MatchingLabels{labelEgressShared: "true"}))
	var logs []byte
	for _, p := range pods.Items {
		b, err := cs.CoreV1().Pods(e.ns).GetLogs(p.Name, &corev1.PodLogOptions{Container: egressContainerName}).DoRaw(e.ctx)
		must(t, err)
		logs = append(logs, b...)
	}
	if !bytes.Contains(logs, []byte(`"agent":"agent","method":"GET","host":"`+targetIP+`"`)) {
		t.Errorf("the shared proxy's log does not attribute the request to the sandbox:\n%s", logs)
	}
	t.Logf("shared proxy available %s after the Sandbox was created; first request accepted %s after the probe started",
		proxyReadyAfter.Round(time.Millisecond), time.Since(probeStart).Round(time.Millisecond))
	t.Logf("GET through the shared proxy from inside the sandbox: first %.1f ms, p50 %.1f ms, max %.1f ms over 20", got.FirstMS, got.P50MS, got.MaxMS)
}

// startEgressTarget runs the test's "internet": a busybox web server in the
// test's namespace. It returns the pod's IP.
func (e *clusterEnv) startEgressTarget() string {
	e.t.Helper()
	target := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "egress-target", Namespace: e.ns, Labels: map[string]string{"app": "egress-target"}},
		Spec: corev1.PodSpec{
			TerminationGracePeriodSeconds: ptr.To[int64](0),
			Containers: []corev1.Container{{
				Name: "httpd", Image: toolchain.BusyboxImage, ImagePullPolicy: corev1.PullNever,
				Command: []string{"/bin/sh", "-c", "mkdir -p /tmp/www && echo hello-from-egress-target > /tmp/www/index.html && exec httpd -f -p 8080 -h /tmp/www"},
			}},
		},
	}
	must(e.t, e.c.Create(e.ctx, target))
	e.eventually("the target pod to run", func() error {
		if err := e.get(target.Name, target); err != nil {
			return err
		}
		if target.Status.Phase != corev1.PodRunning || target.Status.PodIP == "" {
			return fmt.Errorf("target pod is %s", target.Status.Phase)
		}
		return nil
	})
	return target.Status.PodIP
}

// TestEgressProxyUpstreamPolicy: the controller, against the real API
// server, lets proxy pods out to an in-cluster upstream (the pods behind
// its Service, on the Service's named target port) and to an upstream
// given as a private IP (that one address), and the API server accepts
// those policies. No traffic is sent: the local cluster does not enforce
// NetworkPolicy, so the policies are checked as objects.
func TestEgressProxyUpstreamPolicy(t *testing.T) {
	t.Parallel()
	e := newClusterEnv(t)
	e.startEgressManager(&EgressProxyReconciler{Namespace: testPlatformNamespace, Image: DefaultEgressProxyImage})
	for _, ep := range []*v1alpha1.EgressProxy{
		{ObjectMeta: metav1.ObjectMeta{Name: "by-service", Namespace: e.ns}, Spec: v1alpha1.EgressProxySpec{
			AllowedDomains: []v1alpha1.Domain{"pypi.org"},
			Upstream:       &v1alpha1.EgressUpstream{URL: "http://corp-proxy." + e.ns + ".svc:8080"},
		}},
		{ObjectMeta: metav1.ObjectMeta{Name: "by-ip", Namespace: e.ns}, Spec: v1alpha1.EgressProxySpec{
			AllowedDomains: []v1alpha1.Domain{"pypi.org"},
			Upstream:       &v1alpha1.EgressUpstream{URL: "http://[fd00::5]:3128"},
		}},
	} {
		must(t, e.c.Create(e.ctx, ep))
	}
	// The Service comes after its proxy; its watch brings the rule.
	must(t, e.c.Create(e.ctx, &corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Name: "corp-proxy", Namespace: e.ns},
		Spec: corev1.ServiceSpec{
			Selector: map[string]string{"app": "corp-proxy"},
			Ports:    []corev1.ServicePort{{Name: "proxy", Port: 8080, TargetPort: intstr.FromString("squid")}},
		},
	}))
	want := map[string]string{
		"by-service": fmt.Sprintf("to pods app=corp-proxy in %s on TCP squid", e.ns),
		"by-ip":      "to fd00::5/128 on TCP 3128",
	}
	for name, rule := range want {
		e.eventually("the proxy policy of "+name+" to allow its upstream", func() error {
			var np networkingv1.NetworkPolicy
			if err := e.get(egressProxyNetworkPolicyName(name), &np); err != nil {
				return err
			}
			if len(np.Spec.Egress) != 3 {
				return fmt.Errorf("%d egress rules: %+v", len(np.Spec.Egress), np.Spec.Egress)
			}
			r := np.Spec.Egress[2]
			if len(r.To) != 1 || len(r.Ports) != 1 {
				return fmt.Errorf("upstream rule %+v", r)
			}
			got := "to "
			if b := r.To[0].IPBlock; b != nil {
				got += b.CIDR
			} else {
				got += fmt.Sprintf("pods %s in %s", labels.Set(r.To[0].PodSelector.MatchLabels), r.To[0].NamespaceSelector.MatchLabels["kubernetes.io/metadata.name"])
			}
			got += fmt.Sprintf(" on %s %s", ptr.Deref(r.Ports[0].Protocol, ""), r.Ports[0].Port.String())
			if got != rule {
				return fmt.Errorf("upstream rule %q, want %q", got, rule)
			}
			return nil
		})
	}
}
