package controller

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"net/http"
	"net/netip"
	"os"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	networkingv1 "k8s.io/api/networking/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/tools/remotecommand"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"
	"github.com/agentbox/terraform-provider-agentbox/internal/testenv"
)

// The sandbox fence under real enforcement: the node runs a NetworkPolicy
// enforcer, the controllers write the policies, and connections are made
// from inside real gVisor sandboxes through their supervisors, as an agent
// makes them. Every blocked connection is also made, and must succeed,
// from a pod no policy selects, so that the policy is what stops it; and
// the policies are then deleted to show the same connections go through.
//
// Network safety: every address probed is checked to lie in the test
// cluster's own range (pods, Services and the node address testenv puts on
// loopback) before any packet is sent.

// fenceConnectTimeout bounds each probe's connect: a blocked connection
// fails within it, refused or dropped.
const fenceConnectTimeout = 3

// fenceProbe is a Python script that opens raw TCP connections, ignoring
// HTTP_PROXY, to every target in argv[1] at once, and prints for each
// "connected" or why not.
const fenceProbe = `
import json, socket, sys, threading
targets, timeout = json.loads(sys.argv[1]), float(sys.argv[2])
out = {}
def one(t):
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect((t["host"], t["port"]))
        out[t["name"]] = "connected"
    except Exception as e:
        out[t["name"]] = "%s: %s" % (type(e).__name__, e)
    finally:
        s.close()
threads = [threading.Thread(target=one, args=(t,)) for t in targets]
for th in threads: th.start()
for th in threads: th.join()
print(json.dumps(out))
`

// fenceTarget is one connection a probe makes.
type fenceTarget struct {
	Name string `json:"name"`
	Host string `json:"host"`
	Port int    `json:"port"`
}

func (ft fenceTarget) String() string {
	return fmt.Sprintf("%s (%s)", ft.Name, netip.AddrPortFrom(netip.MustParseAddr(ft.Host), uint16(ft.Port)))
}

// fence is one fence test's cluster-side helpers.
type fence struct {
	e  *clusterEnv
	cs kubernetes.Interface
}

// fromSandbox runs the probe inside a sandbox through its supervisor.
func (f *fence) fromSandbox(sup *supervisorapi.Client, targets []fenceTarget) map[string]string {
	f.e.t.Helper()
	got, err := f.probeSandbox(sup, targets)
	if err != nil {
		f.e.t.Fatal(err)
	}
	return got
}

// fromPod runs the probe in the container "main" of a pod the test made,
// through the API server's exec.
func (f *fence) fromPod(ns, pod string, targets []fenceTarget) map[string]string {
	f.e.t.Helper()
	got, err := f.probePod(ns, pod, targets)
	if err != nil {
		f.e.t.Fatal(err)
	}
	return got
}

// probeSandbox is fromSandbox for any goroutine.
func (f *fence) probeSandbox(sup *supervisorapi.Client, targets []fenceTarget) (map[string]string, error) {
	arg, err := probeArg(targets)
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithTimeout(f.e.ctx, time.Minute)
	defer cancel()
	res, err := sup.RunCommand(ctx, supervisorapi.CommandRequest{
		Command: []string{"python3", "-c", fenceProbe, arg, strconv.Itoa(fenceConnectTimeout)},
		Cwd:     "/tmp", TimeoutSeconds: 30,
	})
	if err != nil {
		return nil, fmt.Errorf("run the connection probe in the sandbox: %w", err)
	}
	if res.ExitCode != 0 {
		return nil, fmt.Errorf("the connection probe exited %d in the sandbox: %s", res.ExitCode, res.Stderr)
	}
	return decodeProbe(res.Stdout)
}

// probePod is fromPod for any goroutine.
func (f *fence) probePod(ns, pod string, targets []fenceTarget) (map[string]string, error) {
	arg, err := probeArg(targets)
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithTimeout(f.e.ctx, time.Minute)
	defer cancel()
	stdout, stderr, err := f.exec(ctx, ns, pod, "python3", "-c", fenceProbe, arg, strconv.Itoa(fenceConnectTimeout))
	if err != nil {
		return nil, fmt.Errorf("run the connection probe in pod %s/%s: %w (stderr %q)", ns, pod, err, stderr)
	}
	return decodeProbe(stdout)
}

// probeArg is the probe's target list, once every target is checked to be
// an address of the test cluster: nothing is probed outside it, not even
// to show it is denied.
func probeArg(targets []fenceTarget) (string, error) {
	r := netip.MustParsePrefix(testenv.TestRange)
	for _, ft := range targets {
		a, err := netip.ParseAddr(ft.Host)
		if err != nil || !r.Contains(a) {
			return "", fmt.Errorf("refusing to probe %s %q: not an address of the test cluster (%s)", ft.Name, ft.Host, testenv.TestRange)
		}
	}
	b, err := json.Marshal(targets)
	return string(b), err
}

func decodeProbe(stdout string) (map[string]string, error) {
	var got map[string]string
	if err := json.Unmarshal([]byte(strings.TrimSpace(stdout)), &got); err != nil {
		return nil, fmt.Errorf("connection probe output %q: %w", stdout, err)
	}
	return got, nil
}

func (f *fence) exec(ctx context.Context, ns, pod string, cmd ...string) (string, string, error) {
	req := f.cs.CoreV1().RESTClient().Post().Resource("pods").Namespace(ns).Name(pod).SubResource("exec").
		VersionedParams(&corev1.PodExecOptions{Container: "main", Command: cmd, Stdout: true, Stderr: true}, scheme.ParameterCodec)
	exe, err := remotecommand.NewSPDYExecutor(f.e.cfg, http.MethodPost, req.URL())
	if err != nil {
		return "", "", err
	}
	var stdout, stderr bytes.Buffer
	err = exe.StreamWithContext(ctx, remotecommand.StreamOptions{Stdout: &stdout, Stderr: &stderr})
	return stdout.String(), stderr.String(), err
}

// blocked fails the test for every target that from reached.
func (f *fence) blocked(from string, got map[string]string, targets []fenceTarget) {
	t := f.e.t
	t.Helper()
	for _, ft := range targets {
		switch r, ok := got[ft.Name]; {
		case !ok:
			t.Errorf("%s → %s: no result from the probe", from, ft)
		case r == "connected":
			t.Errorf("FENCE BREACH: %s connected to %s; the NetworkPolicy should have blocked it", from, ft)
		default:
			t.Logf("blocked as it should be: %s → %s: %s", from, ft, r)
		}
	}
}

// connected fails the test for every target that from did not reach.
func (f *fence) connected(from, why string, got map[string]string, targets []fenceTarget) {
	t := f.e.t
	t.Helper()
	for _, ft := range targets {
		if r := got[ft.Name]; r != "connected" {
			t.Errorf("%s → %s failed (%s), but it must connect: %s", from, ft, r, why)
		} else {
			t.Logf("connected as it should: %s → %s", from, ft)
		}
	}
}

// helperPod runs a pod that sleeps, in the sandbox image (for its Python)
// under gVisor, for probing from; it returns the pod once it runs.
func (f *fence) helperPod(ns, name string, lbls map[string]string) *corev1.Pod {
	e := f.e
	e.t.Helper()
	rc := testenv.RuntimeClass
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns, Labels: lbls},
		Spec: corev1.PodSpec{
			RuntimeClassName:              &rc,
			TerminationGracePeriodSeconds: ptr.To[int64](0),
			Containers: []corev1.Container{{
				Name: "main", Image: os.Getenv(EnvSandboxImage), ImagePullPolicy: corev1.PullNever,
				Command: []string{"sleep", "3600"},
			}},
		},
	}
	must(e.t, e.c.Create(e.ctx, pod))
	return pod
}

// waitPodRunning waits for a pod the test made to run, with an IP.
func (f *fence) waitPodRunning(pod *corev1.Pod) *corev1.Pod {
	e := f.e
	e.t.Helper()
	var got corev1.Pod
	e.eventually("pod "+pod.Namespace+"/"+pod.Name+" to run", func() error {
		if err := e.c.Get(e.ctx, client.ObjectKeyFromObject(pod), &got); err != nil {
			return err
		}
		if got.Status.Phase != corev1.PodRunning || got.Status.PodIP == "" {
			return fmt.Errorf("pod is %s: %+v", got.Status.Phase, got.Status.ContainerStatuses)
		}
		return nil
	})
	return &got
}

// clusterTargets are the API server through its Service, and the node's
// address: testenv's node address, which it adds to the host's loopback
// for the node (never a real interface's), with the kubelet's port and
// the API server's.
func (f *fence) clusterTargets() []fenceTarget {
	t := f.e.t
	t.Helper()
	ctx := f.e.ctx
	svc, err := f.cs.CoreV1().Services(metav1.NamespaceDefault).Get(ctx, "kubernetes", metav1.GetOptions{})
	must(t, err)
	eps, err := f.cs.DiscoveryV1().EndpointSlices(metav1.NamespaceDefault).List(ctx, metav1.ListOptions{LabelSelector: discoveryv1.LabelServiceName + "=kubernetes"})
	must(t, err)
	apiPort := 0
	for _, s := range eps.Items {
		for _, p := range s.Ports {
			if p.Port != nil && ptr.Deref(p.Name, "") == "https" {
				apiPort = int(*p.Port)
			}
		}
	}
	node, err := f.cs.CoreV1().Nodes().Get(ctx, testenv.NodeName, metav1.GetOptions{})
	must(t, err)
	nodeIP := ""
	for _, a := range node.Status.Addresses {
		if a.Type == corev1.NodeInternalIP {
			nodeIP = a.Address
		}
	}
	if nodeIP != testenv.NodeIP {
		t.Fatalf("the node's address is %q, not testenv's loopback node address %s: not probing it", nodeIP, testenv.NodeIP)
	}
	kubeletPort := int(node.Status.DaemonEndpoints.KubeletEndpoint.Port)
	if apiPort == 0 || kubeletPort == 0 {
		t.Fatalf("API server port %d, kubelet port %d", apiPort, kubeletPort)
	}
	return []fenceTarget{
		{Name: "the kubernetes Service (API server)", Host: svc.Spec.ClusterIP, Port: 443},
		{Name: "the node's address, API server port", Host: nodeIP, Port: apiPort},
		{Name: "the node's address, kubelet port", Host: nodeIP, Port: kubeletPort},
	}
}

// newFenceEnv starts the controllers with a platform namespace of the
// test's own, so that a pod standing in for the control plane (the peer
// the sandboxes' ingress rule names) lives in a namespace nobody else
// uses. It returns the env, the platform namespace and the egress
// manager's stop.
func newFenceEnv(t *testing.T) (*clusterEnv, *fence, string, func()) {
	t.Helper()
	b := make([]byte, 4)
	_, _ = rand.Read(b)
	platformNS := "fence-cp-" + hex.EncodeToString(b)
	e := newClusterEnv(t, func(r *SandboxReconciler) { r.Namespace = platformNS })
	must(t, e.c.Create(e.ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: platformNS}}))
	t.Cleanup(func() {
		_ = e.c.Delete(context.Background(), &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: platformNS}})
	})
	er := testEgressReconciler()
	er.Namespace = platformNS
	stopEgress := e.startEgressManager(er)
	cs, err := kubernetes.NewForConfig(e.cfg)
	must(t, err)
	return e, &fence{e: e, cs: cs}, platformNS, stopEgress
}

// fenceProxy is a PerAgent proxy that lets the sandboxes reach the test's
// web pod (by its IP, the test cluster has no DNS): allowed by name, and
// its address in allowedCIDRs so that the proxy pods' policy lets them out
// to it inside the private ranges.
func (f *fence) fenceProxy(targetIP string) {
	f.e.t.Helper()
	must(f.e.t, f.e.c.Create(f.e.ctx, &v1alpha1.EgressProxy{
		ObjectMeta: metav1.ObjectMeta{Name: "egress", Namespace: f.e.ns},
		Spec: v1alpha1.EgressProxySpec{
			Mode:           v1alpha1.EgressProxyModePerAgent,
			AllowedDomains: []v1alpha1.Domain{v1alpha1.Domain(targetIP)},
			AllowedCIDRs:   []v1alpha1.AllowedCIDR{v1alpha1.AllowedCIDR(targetIP + "/32")},
		},
	}))
}

// TestSandboxFence runs two agents' sandboxes behind PerAgent proxies on a
// node that enforces NetworkPolicy and shows that from inside sandbox A
// (raw TCP, HTTP_PROXY ignored) none of these connect, while a pod no
// policy selects reaches each of them:
//   - the API server through the kubernetes Service, and the node's address;
//   - agent B's sandbox: its supervisor port and a port B listens on;
//   - agent B's egress proxy, its pod and its Service;
//   - the allowlisted web pod, directly.
//
// Through its own proxy, A reaches the allowlisted pod and is refused a
// name off the list. A's supervisor port takes connections from a pod
// standing in for the control plane, and none from another pod of the
// namespace. Then, with the controllers stopped, the sandboxes'
// NetworkPolicies are deleted and every connection that was blocked goes
// through: the policies are what held them.
func TestSandboxFence(t *testing.T) {
	testenv.RequireNetworkPolicy(t)
	t.Parallel()
	image := os.Getenv(EnvSandboxImage)
	if image == "" {
		t.Skipf("%s is not set: the probes run inside the real sandbox image", EnvSandboxImage)
	}
	start := time.Now()
	e, f, platformNS, stopEgress := newFenceEnv(t)

	// The pods the test probes from, started first: they start while the
	// sandboxes do.
	//   - outside: a pod no policy selects. It carries the sandbox label
	//     of a Sandbox that does not exist, because the proxy pods' policy
	//     admits only sandbox pods: it is a sandbox pod without a fence.
	//   - neighbour: a plain pod of the sandboxes' namespace.
	//   - control plane: a pod with the control plane's label in its
	//     namespace, the only peer the sandboxes' ingress rule names.
	outside := f.helperPod(e.ns, "outside", map[string]string{"app": "fence-outside", v1alpha1.LabelSandbox: "no-such-sandbox"})
	neighbour := f.helperPod(e.ns, "neighbour", map[string]string{"app": "fence-neighbour"})
	controlPlane := f.helperPod(platformNS, "controlplane", map[string]string{controlPlaneComponentLabel: controlPlaneComponent})
	targetIP := e.startEgressTarget()
	f.fenceProxy(targetIP)
	e.template("tpl", func(tpl *v1alpha1.SandboxTemplate) {
		tpl.Spec.Image = image
		tpl.Spec.IdleTimeout = metav1.Duration{Duration: time.Hour}
		tpl.Spec.EgressProxyRef = &v1alpha1.LocalObjectReference{Name: "egress"}
	})
	e.sandbox("a", "tpl")
	e.sandbox("b", "tpl")
	sbxA := e.waitReason("a", v1alpha1.ReasonRunning)
	sbxB := e.waitReason("b", v1alpha1.ReasonRunning)
	for _, p := range []*corev1.Pod{outside, neighbour, controlPlane} {
		f.waitPodRunning(p)
	}
	t.Logf("sandboxes a and b and the helper pods running %s after the start", time.Since(start).Round(time.Millisecond))
	supA := e.supervisorAs(t, sbxA, platformNS)
	supB := e.supervisorAs(t, sbxB, platformNS)

	// No policy selects the pods the positive controls run in.
	var nps networkingv1.NetworkPolicyList
	must(t, e.c.List(e.ctx, &nps, client.InNamespace(e.ns)))
	for _, np := range nps.Items {
		if selects(t, &np.Spec.PodSelector, outside.Labels) || selects(t, &np.Spec.PodSelector, neighbour.Labels) {
			t.Fatalf("NetworkPolicy %s selects a pod the test uses as unconfined", np.Name)
		}
	}

	// B listens on a second port; B itself reaching it at its pod address
	// shows the listener is up.
	const listenPort = 9000
	res, err := supB.RunCommand(e.ctx, supervisorapi.CommandRequest{
		Command: []string{"sh", "-c", fmt.Sprintf("nohup python3 -m http.server %d --bind 0.0.0.0 --directory /tmp >/tmp/listener.log 2>&1 </dev/null &", listenPort)},
		Cwd:     "/tmp",
	})
	if err != nil || res.ExitCode != 0 {
		t.Fatalf("start a listener in sandbox b: %v %+v", err, res)
	}
	listener := fenceTarget{Name: "sandbox b's listener", Host: sbxB.Status.PodIP, Port: listenPort}
	e.eventually("sandbox b to reach its own listener at its pod address", func() error {
		if r := f.fromSandbox(supB, []fenceTarget{listener})[listener.Name]; r != "connected" {
			return fmt.Errorf("b → %s: %s", listener, r)
		}
		return nil
	})

	var proxyB corev1.Pod
	must(t, e.get(EgressServiceName("b"), &proxyB))
	var svcB corev1.Service
	must(t, e.get(EgressServiceName("b"), &svcB))
	cluster := f.clusterTargets()
	supervisorB := fenceTarget{Name: "sandbox b's supervisor", Host: sbxB.Status.PodIP, Port: v1alpha1.SupervisorPort}
	proxyTargets := []fenceTarget{
		{Name: "sandbox b's egress proxy pod", Host: proxyB.Status.PodIP, Port: EgressProxyPort},
		{Name: "sandbox b's egress proxy Service", Host: svcB.Spec.ClusterIP, Port: EgressProxyPort},
	}
	web := fenceTarget{Name: "the allowlisted web pod, directly", Host: targetIP, Port: 8080}
	fromA := append(append(append([]fenceTarget{}, cluster...), supervisorB, listener, web), proxyTargets...)
	supervisorA := fenceTarget{Name: "sandbox a's supervisor", Host: sbxA.Status.PodIP, Port: v1alpha1.SupervisorPort}

	// All probes at once: each is bounded by fenceConnectTimeout.
	probeStart := time.Now()
	var gotOutside, gotCP, gotNeighbour map[string]string
	var errOutside, errCP, errNeighbour error
	var egress *egressProbeResult
	var egressErr error
	var wg sync.WaitGroup
	wg.Add(4)
	go func() {
		defer wg.Done()
		egress, egressErr = e.runEgressProbe(supA, "http://"+targetIP+":8080/index.html")
	}()
	go func() {
		defer wg.Done()
		gotOutside, errOutside = f.probePod(e.ns, outside.Name, append(append(append([]fenceTarget{}, cluster...), web), proxyTargets...))
	}()
	go func() {
		defer wg.Done()
		gotCP, errCP = f.probePod(platformNS, controlPlane.Name, []fenceTarget{supervisorA, supervisorB})
	}()
	go func() {
		defer wg.Done()
		gotNeighbour, errNeighbour = f.probePod(e.ns, neighbour.Name, []fenceTarget{supervisorA})
	}()
	gotA, errA := f.probeSandbox(supA, fromA)
	wg.Wait()
	for _, err := range []error{errA, errOutside, errCP, errNeighbour} {
		if err != nil {
			t.Fatal(err)
		}
	}
	t.Logf("all probes ran in %s", time.Since(probeStart).Round(time.Millisecond))

	// 1. The API server and the node.
	f.blocked("sandbox a", gotA, cluster)
	f.connected("the unconfined pod", "so the sandbox's policy is what blocks it", gotOutside, cluster)
	// 2. Another agent's sandbox and proxy.
	f.blocked("sandbox a", gotA, append([]fenceTarget{supervisorB, listener}, proxyTargets...))
	f.connected("the control plane pod", "the sandboxes' ingress rule admits it", gotCP, []fenceTarget{supervisorB})
	f.connected("the unconfined pod", "the proxy admits sandbox pods, so a's policy is what blocks a", gotOutside, proxyTargets)
	// 3. The allowlisted pod, not through the proxy.
	f.blocked("sandbox a", gotA, []fenceTarget{web})
	f.connected("the unconfined pod", "so the sandbox's policy is what blocks it", gotOutside, []fenceTarget{web})
	// 4. Through its own proxy.
	if egressErr != nil {
		t.Errorf("sandbox a through its proxy: %v", egressErr)
	} else {
		if strings.TrimSpace(egress.Body) != "hello-from-egress-target" {
			t.Errorf("sandbox a → the allowlisted web pod through its proxy (%s): got %q", egress.Proxy, egress.Body)
		}
		if egress.DeniedStatus != http.StatusForbidden || egress.DeniedReason != "not_allowed" {
			t.Errorf("sandbox a → a name off the allowlist through its proxy: status %d, reason %q; want 403 not_allowed", egress.DeniedStatus, egress.DeniedReason)
		}
		t.Logf("through its own proxy %s, sandbox a got the allowlisted page and a 403 %s for a name off the list", egress.Proxy, egress.DeniedReason)
	}
	// 5. The supervisor port takes the control plane only.
	f.blocked("the neighbour pod in the sandbox's namespace", gotNeighbour, []fenceTarget{supervisorA})
	f.connected("the control plane pod", "the sandboxes' ingress rule admits it", gotCP, []fenceTarget{supervisorA})
	if t.Failed() {
		return
	}

	// 6. The mutation check: without their NetworkPolicies the same
	// sandboxes reach everything above. The controllers are stopped first,
	// or they would put the policies back.
	e.stop()
	stopEgress()
	for _, name := range []string{"a", "b"} {
		must(t, e.c.Delete(e.ctx, &networkingv1.NetworkPolicy{ObjectMeta: metav1.ObjectMeta{Name: SandboxNetworkPolicyName(name), Namespace: e.ns}}))
	}
	deleted := time.Now()
	probes := 0
	e.eventually("sandbox a to reach the web pod directly once its policy is gone", func() error {
		probes++
		got, err := f.probeSandbox(supA, []fenceTarget{web})
		if err != nil {
			return err
		}
		if r := got[web.Name]; r != "connected" {
			return fmt.Errorf("a → %s: %s", web, r)
		}
		return nil
	})
	t.Logf("the enforcer lifted the fence %s after the policies were deleted (%d probes)", time.Since(deleted).Round(time.Millisecond), probes)
	f.connected("sandbox a without its policy", "the mutation check: nothing but the policy stopped it", f.fromSandbox(supA, fromA), fromA)
	f.connected("the neighbour pod", "the mutation check: nothing but a's policy stopped it",
		f.fromPod(e.ns, neighbour.Name, []fenceTarget{supervisorA}), []fenceTarget{supervisorA})
	if !t.Failed() {
		t.Logf("mutation check ran: with the sandboxes' NetworkPolicies deleted, all %d connections they had blocked went through", len(fromA)+1)
	}
	t.Logf("TestSandboxFence took %s", time.Since(start).Round(time.Millisecond))
}

// fenceLoop runs in a warm sandbox, in the background, until the file
// argv[4] exists: every 100 ms it starts a connection to the web pod
// directly and one to the sandbox's proxy Service, each in its own thread
// with a 2 s timeout (so that a slow success is never counted as a
// failure), and appends "<unix time> <direct|proxy> OK|FAIL <why>" to the
// file argv[3].
const fenceLoop = `
import os, socket, sys, threading, time
web, proxy, out, stop = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
f = open(out, "a", buffering=1)
lock = threading.Lock()
def one(kind, host, port):
    t = time.time()
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.settimeout(2)
    try:
        s.connect((host, port))
        r = "OK"
    except Exception as e:
        r = "FAIL " + type(e).__name__
    finally:
        s.close()
    with lock:
        f.write("%.3f %s %s\n" % (t, kind, r))
threads = []
while not os.path.exists(stop):
    for a in (("direct", web, 8080), ("proxy", proxy, 3128)):
        th = threading.Thread(target=one, args=a)
        th.start()
        threads.append(th)
    threads = [th for th in threads if th.is_alive()]
    time.sleep(0.1)
for th in threads: th.join()
with lock:
    f.write("done\n")
`

// fenceLine is one line of fenceLoop's file.
type fenceLine struct {
	at     time.Time
	kind   string
	ok     bool
	result string
}

func parseFenceLog(t *testing.T, log string) (lines []fenceLine, done bool) {
	t.Helper()
	for _, l := range strings.Split(strings.TrimSpace(log), "\n") {
		if l == "" {
			continue
		}
		if l == "done" {
			done = true
			continue
		}
		f := strings.SplitN(l, " ", 3)
		if len(f) != 3 {
			t.Fatalf("probe loop line %q", l)
		}
		sec, err := strconv.ParseFloat(f[0], 64)
		if err != nil {
			t.Fatalf("probe loop line %q: %v", l, err)
		}
		lines = append(lines, fenceLine{at: time.UnixMilli(int64(sec * 1000)), kind: f[1], ok: f[2] == "OK", result: f[2]})
	}
	sort.SliceStable(lines, func(i, j int) bool { return lines[i].at.Before(lines[j].at) })
	return lines, done
}

// TestSandboxFenceWarmAdoption: a warm sandbox behind a PerAgent proxy is
// adopted by an agent's new Sandbox while a loop inside it keeps trying to
// reach the allowlisted web pod directly. Adoption relabels the pod for
// the adopter (whose NetworkPolicy must select it before the warm one's
// stops) and replaces the proxy pod, whose agent changes; not one direct
// connection may get through, before, during or after. The loop's
// connections to its own proxy show the loop was live throughout and how
// long the sandbox was without a proxy.
func TestSandboxFenceWarmAdoption(t *testing.T) {
	testenv.RequireNetworkPolicy(t)
	t.Parallel()
	image := os.Getenv(EnvSandboxImage)
	if image == "" {
		t.Skipf("%s is not set: the probe loop runs inside the real sandbox image", EnvSandboxImage)
	}
	start := time.Now()
	e, f, platformNS, _ := newFenceEnv(t)
	outside := f.helperPod(e.ns, "outside", map[string]string{"app": "fence-outside"})
	targetIP := e.startEgressTarget()
	f.fenceProxy(targetIP)
	e.template("tpl", func(tpl *v1alpha1.SandboxTemplate) {
		tpl.Spec.Image = image
		tpl.Spec.IdleTimeout = metav1.Duration{Duration: time.Hour}
		tpl.Spec.EgressProxyRef = &v1alpha1.LocalObjectReference{Name: "egress"}
	})
	must(t, e.c.Create(e.ctx, &v1alpha1.SandboxWarmPool{
		ObjectMeta: metav1.ObjectMeta{Name: "pool", Namespace: e.ns},
		Spec:       v1alpha1.SandboxWarmPoolSpec{TemplateRef: v1alpha1.LocalObjectReference{Name: "tpl"}, Replicas: 1},
	}))
	var warmName string
	for name := range e.waitPoolFull("pool", 1) {
		warmName = name
	}
	f.waitPodRunning(outside)
	var warm v1alpha1.Sandbox
	must(t, e.get(warmName, &warm))
	var warmProxy corev1.Pod
	must(t, e.get(EgressServiceName(warmName), &warmProxy))
	if !podReady(&warmProxy) {
		t.Fatalf("the warm sandbox is ready and its proxy pod %s is not: %+v", warmProxy.Name, warmProxy.Status)
	}
	var svc corev1.Service
	must(t, e.get(EgressServiceName(warmName), &svc))
	t.Logf("warm sandbox %s and its proxy ready %s after the start", warmName, time.Since(start).Round(time.Millisecond))
	if _, err := probeArg([]fenceTarget{{Name: "the web pod", Host: targetIP}, {Name: "the proxy Service", Host: svc.Spec.ClusterIP}}); err != nil {
		t.Fatal(err)
	}

	sup := e.supervisorAs(t, &warm, platformNS)
	const logFile, stopFile = "/tmp/fence-loop.log", "/tmp/fence-loop.stop"
	res, err := sup.RunCommand(e.ctx, supervisorapi.CommandRequest{
		Command: []string{"sh", "-c", `nohup python3 -c "$0" "$@" >/tmp/fence-loop.err 2>&1 </dev/null &`,
			fenceLoop, targetIP, svc.Spec.ClusterIP, logFile, stopFile},
		Cwd: "/tmp",
	})
	if err != nil || res.ExitCode != 0 {
		t.Fatalf("start the probe loop in the warm sandbox: %v %+v", err, res)
	}
	readLog := func() string {
		t.Helper()
		res, err := sup.RunCommand(e.ctx, supervisorapi.CommandRequest{Command: []string{"sh", "-c", "touch " + logFile + " && cat " + logFile + " && cat /tmp/fence-loop.err >&2"}, Cwd: "/tmp"})
		if err != nil || res.ExitCode != 0 {
			t.Fatalf("read the probe loop's file: %v %+v", err, res)
		}
		if res.Stderr != "" {
			t.Logf("probe loop stderr: %s", res.Stderr)
		}
		return res.Stdout
	}
	// A second of the loop before the adoption, and its proxy reached.
	e.eventually("the probe loop to reach the proxy before the adoption", func() error {
		lines, _ := parseFenceLog(t, readLog())
		for _, l := range lines {
			if l.kind == "proxy" && l.ok && time.Since(l.at) > time.Second {
				return nil
			}
		}
		return fmt.Errorf("%d lines, none a proxy connection over a second old", len(lines))
	})

	adoptStart := time.Now()
	sbx := &v1alpha1.Sandbox{
		ObjectMeta: metav1.ObjectMeta{Name: "adopter", Namespace: e.ns},
		Spec:       v1alpha1.SandboxSpec{AgentID: "agent:adopter@" + e.ns + ".example.com", TemplateRef: v1alpha1.LocalObjectReference{Name: "tpl"}},
	}
	must(t, e.c.Create(e.ctx, sbx))
	adopter := e.waitReason("adopter", v1alpha1.ReasonAdoptedFromWarmPool)
	e.eventually("the adopter to run", func() error {
		if err := e.get("adopter", adopter); err != nil {
			return err
		}
		if adopter.Status.Phase != v1alpha1.SandboxPhaseRunning || adopter.Status.Workload != warmName {
			return fmt.Errorf("phase %s, workload %q", adopter.Status.Phase, adopter.Status.Workload)
		}
		return nil
	})
	adopted := time.Now()
	var pod corev1.Pod
	must(t, e.get(PodName(warmName), &pod))
	if pod.Labels[v1alpha1.LabelSandbox] != "adopter" {
		t.Fatalf("the adopted pod's labels %v", pod.Labels)
	}
	// The adopter's proxy pod: the warm one's, replaced for the new agent.
	var newProxy corev1.Pod
	e.eventually("the adopter's proxy pod to be ready", func() error {
		if err := e.get(EgressServiceName(warmName), &newProxy); err != nil {
			return err
		}
		if newProxy.UID == warmProxy.UID || !podReady(&newProxy) || newProxy.Labels[v1alpha1.LabelSandbox] != "adopter" {
			return fmt.Errorf("proxy pod %s (uid %s, labels %v) ready %v", newProxy.Name, newProxy.UID, newProxy.Labels, podReady(&newProxy))
		}
		return nil
	})
	// Probing on until the loop has reached the new proxy for a while.
	e.eventually("the probe loop to reach the adopter's proxy", func() error {
		lines, _ := parseFenceLog(t, readLog())
		for _, l := range lines {
			if l.kind == "proxy" && l.ok && l.at.After(adopted) && time.Since(l.at) > 2*time.Second {
				return nil
			}
		}
		return fmt.Errorf("%d lines, no proxy connection 2 s after the adoption", len(lines))
	})
	res, err = sup.RunCommand(e.ctx, supervisorapi.CommandRequest{Command: []string{"touch", stopFile}, Cwd: "/tmp"})
	if err != nil || res.ExitCode != 0 {
		t.Fatalf("stop the probe loop: %v %+v", err, res)
	}
	var lines []fenceLine
	e.eventually("the probe loop to finish", func() error {
		var done bool
		lines, done = parseFenceLog(t, readLog())
		if !done {
			return fmt.Errorf("%d lines, not done", len(lines))
		}
		return nil
	})

	// The web pod was there to be reached all along: an unconfined pod
	// reaches it now, after the loop.
	web := fenceTarget{Name: "the allowlisted web pod, directly", Host: targetIP, Port: 8080}
	f.connected("the unconfined pod", "so the sandbox's policy is what blocked the loop", f.fromPod(e.ns, outside.Name, []fenceTarget{web}), []fenceTarget{web})

	var direct, directBefore, directAfter, proxyOK int
	var breaches []string
	var gapStart, gapEnd time.Time
	var longest time.Duration
	var lastProxyOK time.Time
	for _, l := range lines {
		switch l.kind {
		case "direct":
			direct++
			if l.at.Before(adoptStart) {
				directBefore++
			}
			if l.at.After(adopted) {
				directAfter++
			}
			if l.ok {
				breaches = append(breaches, fmt.Sprintf("%s (%+.3fs from the adoption's start)", l.at.Format("15:04:05.000"), l.at.Sub(adoptStart).Seconds()))
			}
		case "proxy":
			if !l.ok {
				continue
			}
			proxyOK++
			if !lastProxyOK.IsZero() && l.at.Sub(lastProxyOK) > longest {
				longest, gapStart, gapEnd = l.at.Sub(lastProxyOK), lastProxyOK, l.at
			}
			lastProxyOK = l.at
		}
	}
	t.Logf("probe loop: %d direct connection attempts (%d before the adoption started, %d after the adopter ran), %d proxy connections made",
		direct, directBefore, directAfter, proxyOK)
	if len(breaches) > 0 {
		t.Errorf("FENCE BREACH: %d direct connections from the sandbox to the web pod %s:8080 got through around the adoption: %v",
			len(breaches), targetIP, breaches)
	}
	if directBefore < 5 || directAfter < 5 {
		t.Errorf("the probe loop did not run through the adoption: %d direct attempts before it, %d after", directBefore, directAfter)
	}
	t.Logf("the adoption started at %s, the adopter ran %s later; the longest time without a proxy connection was %s, from %+.3fs to %+.3fs relative to the adoption's start (the proxy pod is replaced for the new agent)",
		adoptStart.Format("15:04:05.000"), adopted.Sub(adoptStart).Round(time.Millisecond), longest.Round(time.Millisecond),
		gapStart.Sub(adoptStart).Seconds(), gapEnd.Sub(adoptStart).Seconds())
	// The adopter serves only once its own proxy pod is ready, so the
	// loop's first proxy connection after the gap comes at most one probe
	// round (about 0.2 s, a slack of 1 s on a loaded node) after Running.
	if late := gapEnd.Sub(adopted); late > time.Second {
		t.Errorf("the adopter reported Running %s before its proxy answered again: an agent's fetch in that window is refused",
			late.Round(time.Millisecond))
	}
	t.Logf("TestSandboxFenceWarmAdoption took %s", time.Since(start).Round(time.Millisecond))
}
