package testenv_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/agentbox/terraform-provider-agentbox/internal/testenv"
	"github.com/agentbox/terraform-provider-agentbox/internal/testenv/toolchain"
)

// Chains and ipsets the NetworkPolicy enforcer makes.
var netpolChainPrefixes = []string{"KUBE-ROUTER-", "KUBE-NWPLCY-", "KUBE-POD-FW-"}
var netpolSetPrefixes = []string{"KUBE-SRC-", "KUBE-DST-"}

const (
	serverNS  = "np-server"
	clientNS  = "np-client"
	httpPort  = 8080
	serveBody = "hello-from-np-server"
)

// TestNetworkPolicyEnforced starts a cluster whose node enforces
// NetworkPolicies and shows, with gVisor pods as the sandboxes are, that
// ingress and egress policies (pod and namespace selectors, a named port,
// an ipBlock with an exception) let through exactly what they allow; then
// that `agentbox-testenv down`'s teardown leaves none of the enforcer's
// chains or ipsets. All traffic is between pods the test made.
func TestNetworkPolicyEnforced(t *testing.T) {
	requireRoot(t)
	dir := cacheDir(t)
	if _, err := os.Stat(filepath.Join(toolchain.BinDir(dir), toolchain.KubeRouter)); err != nil {
		if os.Getenv("CI") != "" {
			t.Fatalf("the NetworkPolicy enforcer is not built (%v): CI must run `make testenv` first", err)
		}
		t.Skipf("the NetworkPolicy enforcer is not built (%v): run `make testenv`", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	c := startOwnCluster(ctx, t, testenv.Options{Dir: dir, Node: true, NetworkPolicy: true, Log: testWriter{t}})
	stopped := false
	t.Cleanup(func() {
		if !stopped {
			_ = c.Stop(context.Background())
		}
	})
	cs := kubernetes.NewForConfigOrDie(c.Config)
	for _, ns := range []string{serverNS, clientNS} {
		if _, err := cs.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	server := busyboxPod("server", serverNS, fmt.Sprintf("mkdir -p /tmp/www && echo %s > /tmp/www/index.html && exec httpd -f -p %d -h /tmp/www", serveBody, httpPort))
	server.Spec.Containers[0].Ports = []corev1.ContainerPort{{Name: "http", ContainerPort: httpPort, Protocol: corev1.ProtocolTCP}}
	srv := runPod(ctx, t, cs, server)
	allowed := busyboxPod("client-a", clientNS, "sleep 3600")
	allowed.Labels["role"] = "allowed"
	a := runPod(ctx, t, cs, allowed)
	runPod(ctx, t, cs, busyboxPod("client-b", clientNS, "sleep 3600"))
	probe := prober{ctx: ctx, cfg: c.Config, cs: cs, server: srv.Status.PodIP}
	// The proof is about gVisor pods, as the sandboxes are.
	if out, errOut, err := execIn(ctx, c.Config, cs, clientNS, "client-a", "uname", "-r"); err != nil || !strings.Contains(out, "gvisor") {
		t.Fatalf("client-a does not run in gVisor: uname -r = %q, %v (stderr %q)", out, err, errOut)
	}

	t.Run("EgressFenceAheadOfEnforcer", func(t *testing.T) {
		// kube-router ACCEPTs allowed traffic in its filter FORWARD chain,
		// which comes first; the fence that keeps pods inside the test
		// range must come before that, in mangle FORWARD. Checked by its
		// rules only: no test sends traffic outside the range.
		if first := firstRule(t, "filter", "FORWARD"); !strings.Contains(first, "-j KUBE-ROUTER-FORWARD") {
			t.Errorf("first filter FORWARD rule is %q, want the jump to KUBE-ROUTER-FORWARD (is the enforcer running?)", first)
		}
		if first := firstRule(t, "mangle", "FORWARD"); first != "-A FORWARD -j AGENTBOX-FENCE" {
			t.Errorf("first mangle FORWARD rule is %q, want the jump to the fence", first)
		}
		out, err := exec.Command("iptables", "-w", "-t", "mangle", "-S", "AGENTBOX-FENCE").Output()
		if want := fmt.Sprintf("-A AGENTBOX-FENCE -s %s ! -d %s -j DROP", testenv.PodCIDR, testenv.TestRange); err != nil || !strings.Contains(string(out), want) {
			t.Errorf("mangle AGENTBOX-FENCE = %q (%v), want %q", out, err, want)
		}
	})

	// Without a policy every pod reaches the server.
	eventually(t, time.Minute, func() error { return probe.reach("client-a") })
	eventually(t, time.Minute, func() error { return probe.reach("client-b") })

	t.Run("DefaultDenyIngress", func(t *testing.T) {
		deny := &networkingv1.NetworkPolicy{
			ObjectMeta: metav1.ObjectMeta{Name: "default-deny-ingress", Namespace: serverNS},
			Spec: networkingv1.NetworkPolicySpec{
				PodSelector: metav1.LabelSelector{},
				PolicyTypes: []networkingv1.PolicyType{networkingv1.PolicyTypeIngress},
			},
		}
		applyAndTime(ctx, t, cs, deny, func() error { return probe.blocked("client-a") })
		probe.mustBeBlocked(t, "client-b")
	})

	t.Run("AllowBySelectorsAndNamedPort", func(t *testing.T) {
		allow := &networkingv1.NetworkPolicy{
			ObjectMeta: metav1.ObjectMeta{Name: "allow-role-allowed", Namespace: serverNS},
			Spec: networkingv1.NetworkPolicySpec{
				PodSelector: metav1.LabelSelector{MatchLabels: map[string]string{"app": "server"}},
				PolicyTypes: []networkingv1.PolicyType{networkingv1.PolicyTypeIngress},
				Ingress: []networkingv1.NetworkPolicyIngressRule{{
					From: []networkingv1.NetworkPolicyPeer{{
						NamespaceSelector: &metav1.LabelSelector{MatchLabels: map[string]string{"kubernetes.io/metadata.name": clientNS}},
						PodSelector:       &metav1.LabelSelector{MatchLabels: map[string]string{"role": "allowed"}},
					}},
					Ports: []networkingv1.NetworkPolicyPort{{Port: ptr(intstr.FromString("http"))}},
				}},
			},
		}
		applyAndTime(ctx, t, cs, allow, func() error { return probe.reach("client-a") })
		probe.mustBeBlocked(t, "client-b")
		deletePolicy(ctx, t, cs, allow)
	})

	t.Run("AllowIPBlockWithExcept", func(t *testing.T) {
		// The whole pod range but client-a: client-b gets in, client-a not.
		block := &networkingv1.NetworkPolicy{
			ObjectMeta: metav1.ObjectMeta{Name: "allow-pod-range-but-a", Namespace: serverNS},
			Spec: networkingv1.NetworkPolicySpec{
				PodSelector: metav1.LabelSelector{},
				PolicyTypes: []networkingv1.PolicyType{networkingv1.PolicyTypeIngress},
				Ingress: []networkingv1.NetworkPolicyIngressRule{{
					From: []networkingv1.NetworkPolicyPeer{{IPBlock: &networkingv1.IPBlock{
						CIDR: testenv.PodCIDR, Except: []string{a.Status.PodIP + "/32"},
					}}},
					Ports: []networkingv1.NetworkPolicyPort{{Port: ptr(intstr.FromInt32(httpPort))}},
				}},
			},
		}
		applyAndTime(ctx, t, cs, block, func() error { return probe.reach("client-b") })
		probe.mustBeBlocked(t, "client-a")
		deletePolicy(ctx, t, cs, block)
	})

	t.Run("DefaultDenyEgress", func(t *testing.T) {
		// The server takes everyone again; then client-a may send nothing.
		if err := cs.NetworkingV1().NetworkPolicies(serverNS).DeleteCollection(ctx, metav1.DeleteOptions{}, metav1.ListOptions{}); err != nil {
			t.Fatal(err)
		}
		eventually(t, time.Minute, func() error { return probe.reach("client-a") })
		egress := &networkingv1.NetworkPolicy{
			ObjectMeta: metav1.ObjectMeta{Name: "deny-egress-a", Namespace: clientNS},
			Spec: networkingv1.NetworkPolicySpec{
				PodSelector: metav1.LabelSelector{MatchLabels: map[string]string{"app": "client-a"}},
				PolicyTypes: []networkingv1.PolicyType{networkingv1.PolicyTypeEgress},
			},
		}
		applyAndTime(ctx, t, cs, egress, func() error { return probe.blocked("client-a") })
		if err := probe.reach("client-b"); err != nil {
			t.Errorf("client-b, which no egress policy selects: %v", err)
		}
	})

	// Proof that the teardown check below is not vacuous: the enforcer's
	// chains and sets exist now.
	if chains := netpolChains(t); len(chains) == 0 {
		t.Errorf("no chains with prefixes %v while the enforcer runs", netpolChainPrefixes)
	}
	sets := netpolSets(t)
	if len(sets) == 0 {
		t.Errorf("no ipsets with prefixes %v while policies with selectors exist", netpolSetPrefixes)
	}
	t.Logf("the enforcer's ipsets before teardown: %v", sets)

	// `agentbox-testenv down`: the teardown from the state on disk, as for a
	// cluster another process started.
	logDir := c.LogDir()
	if err := testenv.StopDir(ctx, dir, testWriter{t}); err != nil {
		t.Fatalf("down: %v", err)
	}
	stopped = true
	assertClean(t, logDir)
	if chains := netpolChains(t); len(chains) > 0 {
		t.Errorf("chains left behind: %v", chains)
	}
	if sets := netpolSets(t); len(sets) > 0 {
		t.Errorf("ipsets left behind: %v", sets)
	}
}

// startOwnCluster starts the test's own cluster. Under `agentbox-testenv
// exec` (the cluster-test wrapper) the running cluster was started for this
// very command, which its kubeconfig in the environment shows; it is
// replaced. Any other running cluster is somebody else's and fails the test.
func startOwnCluster(ctx context.Context, t *testing.T, opts testenv.Options) *testenv.Cluster {
	t.Helper()
	c, err := testenv.Start(ctx, opts)
	if errors.Is(err, testenv.ErrRunning) {
		running, aerr := testenv.Attach(opts.Dir, nil)
		if aerr != nil || running.Kubeconfig != os.Getenv(testenv.EnvKubeconfig) {
			t.Fatalf("%v: this test starts its own node and there can be one per machine", err)
		}
		t.Logf("replacing the cluster started for this command with one that enforces NetworkPolicies")
		if err := running.Stop(ctx); err != nil {
			t.Fatalf("stop the cluster started for this command: %v", err)
		}
		c, err = testenv.Start(ctx, opts)
	}
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// prober opens HTTP connections from a client pod to the server pod.
type prober struct {
	ctx    context.Context
	cfg    *rest.Config
	cs     kubernetes.Interface
	server string
}

// get fetches the server's page from pod client with a 2 s connect and
// idle timeout, the exec itself bounded at 15 s.
func (p prober) get(client string) (string, error) {
	ctx, cancel := context.WithTimeout(p.ctx, 15*time.Second)
	defer cancel()
	req := fmt.Sprintf(`printf 'GET /index.html HTTP/1.0\r\n\r\n' | nc -w 2 %s %d`, p.server, httpPort)
	out, errOut, err := execIn(ctx, p.cfg, p.cs, clientNS, client, "sh", "-c", req)
	if err != nil {
		return out, fmt.Errorf("%w (stderr %q)", err, errOut)
	}
	return out, nil
}

func (p prober) reach(client string) error {
	out, err := p.get(client)
	if err != nil || !strings.Contains(out, serveBody) {
		return fmt.Errorf("%s to the server: %v, got %q", client, err, out)
	}
	return nil
}

// blocked is nil when the connection fails, as a policy makes it: a
// command that exited with a failure and without the page.
func (p prober) blocked(client string) error {
	out, err := p.get(client)
	if strings.Contains(out, serveBody) {
		return fmt.Errorf("%s still reaches the server", client)
	}
	if err == nil {
		return fmt.Errorf("%s: nc succeeded without the page (%q)", client, out)
	}
	return nil
}

// mustBeBlocked checks twice, a second apart, so that a single lost
// packet cannot pass for a policy.
func (p prober) mustBeBlocked(t *testing.T, client string) {
	t.Helper()
	for i := range 2 {
		if i > 0 {
			time.Sleep(time.Second)
		}
		if err := p.blocked(client); err != nil {
			t.Fatal(err)
		}
	}
}

// applyAndTime creates a policy, waits until effect says it acts, and logs
// how long that took after the create returned. Probes take up to a few
// seconds each, which bounds the resolution; the time is reported, not
// asserted.
func applyAndTime(ctx context.Context, t *testing.T, cs kubernetes.Interface, np *networkingv1.NetworkPolicy, effect func() error) {
	t.Helper()
	if _, err := cs.NetworkingV1().NetworkPolicies(np.Namespace).Create(ctx, np, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	probes := 0
	eventually(t, time.Minute, func() error { probes++; return effect() })
	t.Logf("NetworkPolicy %s/%s enforced %s after its creation (%d probes)", np.Namespace, np.Name, time.Since(start).Round(time.Millisecond), probes)
}

func deletePolicy(ctx context.Context, t *testing.T, cs kubernetes.Interface, np *networkingv1.NetworkPolicy) {
	t.Helper()
	if err := cs.NetworkingV1().NetworkPolicies(np.Namespace).Delete(ctx, np.Name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
}

// firstRule is the first rule of a chain as `iptables -S` prints it.
func firstRule(t *testing.T, table, chain string) string {
	t.Helper()
	out, err := exec.Command("iptables", "-w", "-t", table, "-S", chain).Output()
	if err != nil {
		t.Fatalf("iptables -t %s -S %s: %v", table, chain, err)
	}
	for _, line := range strings.Split(string(out), "\n") {
		if strings.HasPrefix(line, "-A ") {
			return line
		}
	}
	return ""
}

func netpolChains(t *testing.T) []string {
	t.Helper()
	out, err := exec.Command("iptables", "-w", "-t", "filter", "-S").Output()
	if err != nil {
		t.Fatalf("iptables -S: %v", err)
	}
	var chains []string
	for _, line := range strings.Split(string(out), "\n") {
		if f := strings.Fields(line); len(f) == 2 && f[0] == "-N" && hasAnyPrefix(f[1], netpolChainPrefixes) {
			chains = append(chains, f[1])
		}
	}
	return chains
}

func netpolSets(t *testing.T) []string {
	t.Helper()
	out, err := exec.Command("ipset", "list", "-n").Output()
	if err != nil {
		t.Fatalf("ipset list -n: %v", err)
	}
	var sets []string
	for _, name := range strings.Fields(string(out)) {
		if hasAnyPrefix(strings.TrimPrefix(name, "inet6:"), netpolSetPrefixes) {
			sets = append(sets, name)
		}
	}
	return sets
}

func hasAnyPrefix(s string, prefixes []string) bool {
	for _, p := range prefixes {
		if strings.HasPrefix(s, p) {
			return true
		}
	}
	return false
}

func ptr[T any](v T) *T { return &v }
