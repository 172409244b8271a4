package provider

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/terraform-plugin-testing/helper/resource"
	"github.com/hashicorp/terraform-plugin-testing/knownvalue"
	"github.com/hashicorp/terraform-plugin-testing/plancheck"
	"github.com/hashicorp/terraform-plugin-testing/statecheck"
	"github.com/hashicorp/terraform-plugin-testing/terraform"
	"github.com/hashicorp/terraform-plugin-testing/tfjsonpath"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	agentboxv1alpha1 "github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	apiclient "github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
	"github.com/agentbox/terraform-provider-agentbox/internal/testenv/toolchain"
)

// egressAccProbe runs in the sandbox through the Compute API. urllib takes
// the proxy from the pod's HTTP_PROXY, as curl and pip do. It fetches the
// allowed URL, then each refused URL, and reports the proxy's status and
// reason for those.
const egressAccProbe = `
import json, os, sys, urllib.request, urllib.error
out = {"http_proxy": os.environ.get("HTTP_PROXY", ""), "refused": {}}
try:
    out["body"] = urllib.request.urlopen(sys.argv[1], timeout=30).read().decode()
except urllib.error.HTTPError as e:
    sys.exit("allowed fetch refused: %d %s" % (e.code, e.headers.get("X-Agentbox-Egress-Denied", "")))
for url in sys.argv[2:]:
    try:
        urllib.request.urlopen(url, timeout=30).read()
        out["refused"][url] = [200, ""]
    except urllib.error.HTTPError as e:
        out["refused"][url] = [e.code, e.headers.get("X-Agentbox-Egress-Denied", "")]
print(json.dumps(out))
`

// TestAccEgressSandboxThroughProxy applies, with the real terraform CLI,
// the platform, a PerAgent egress proxy running under gVisor, a template
// using it and an agent's sandbox, and then has the agent fetch from an
// "internet" the test made itself: a busybox web server pod in the test's
// namespace. The in-cluster controller (the platform's image) runs
// everything; the test only reads what it made.
//
// Network safety: every destination is a pod this test created. The test
// cluster has no DNS, so the allowlist names the web server by its pod IP,
// and allowed_cidrs opens exactly that /32 in the private ranges the proxy
// denies by default. Two requests must be refused before any connection:
// a name off the allowlist (under .invalid, never looked up), and a second
// web server pod whose IP is allowlisted but outside allowed_cidrs, so the
// proxy refuses its address after parsing it; that server logs every
// connection, and its log must stay empty.
//
// The NetworkPolicies are checked as objects only: the local cluster does
// not enforce NetworkPolicy.
func TestAccEgressSandboxThroughProxy(t *testing.T) {
	t.Parallel()
	tag := testAccPlatformImageTag(t)
	c, ns := testAccCluster(t)
	cfg, err := clientcmd.BuildConfigFromFlags("", os.Getenv(testAccKubeconfigEnv))
	if err != nil {
		t.Fatal(err)
	}
	cs, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Minute)
	defer cancel()

	web := startWebPod(ctx, t, c, ns, "web", "hello-through-the-proxy")
	unreached := startWebPod(ctx, t, c, ns, "unreached", "must-not-be-served")
	const agent, proxy = "egress-agent", "web"
	allowedURL := "http://" + web + ":8080/index.html"
	offAllowlist := "http://not-allowed.invalid/"
	outsideHole := "http://" + unreached + ":8080/index.html"

	config := testAccProviderConfig() + fmt.Sprintf(`
resource "agentbox_platform" "this" {
  namespace    = %[1]q
  release_name = "acc-egress"
  image_tag    = %[2]q
}

resource "agentbox_egress_proxy" "web" {
  name               = %[3]q
  namespace          = agentbox_platform.this.namespace
  mode               = "PerAgent"
  allowed_domains    = [%[4]q, %[5]q]
  allowed_cidrs      = ["%[4]s/32"]
  runtime_class_name = "gvisor"
}

resource "agentbox_sandbox_template" "python" {
  name               = "python"
  namespace          = agentbox_platform.this.namespace
  runtime_class_name = "gvisor"
  egress_proxy       = agentbox_egress_proxy.web.name
  workspace = {
    size = "256Mi"
  }
}

resource "agentbox_sandbox" "agent" {
  name     = %[6]q
  namespace = agentbox_platform.this.namespace
  agent_id = %[6]q
  template = agentbox_sandbox_template.python.name
}
`, ns, tag, proxy, web, unreached, agent)

	addr := "agentbox_egress_proxy.web"
	str := knownvalue.StringExact
	var probe egressProbeOutput
	start := time.Now()
	resource.Test(t, resource.TestCase{
		ProtoV6ProviderFactories: testAccProtoV6ProviderFactories,
		Steps: []resource.TestStep{
			{
				Config: config,
				ConfigStateChecks: []statecheck.StateCheck{
					statecheck.ExpectKnownValue(addr, tfjsonpath.New("mode"), str("PerAgent")),
					statecheck.ExpectKnownValue(addr, tfjsonpath.New("allowed_cidrs"), knownvalue.SetExact([]knownvalue.Check{str(web + "/32")})),
					statecheck.ExpectKnownValue(addr, tfjsonpath.New("runtime_class_name"), str("gvisor")),
					statecheck.ExpectKnownValue(addr, tfjsonpath.New("status").AtMapKey("ready"), knownvalue.Bool(true)),
					statecheck.ExpectKnownValue("agentbox_sandbox_template.python", tfjsonpath.New("egress_proxy"), str(proxy)),
					statecheck.ExpectKnownValue("agentbox_sandbox.agent", tfjsonpath.New("agent_id"), str(agent)),
				},
				Check: resource.ComposeTestCheckFunc(
					func(*terraform.State) error {
						t.Logf("apply (platform, proxy, template, sandbox running): %s", time.Since(start).Round(time.Millisecond))
						return nil
					},
					func(s *terraform.State) error {
						out, err := runEgressAccProbe(ctx, s, agent, allowedURL, offAllowlist, outsideHole)
						if err != nil {
							return err
						}
						probe = *out
						return nil
					},
				),
			},
			{
				// The controller's report, refreshed into state, names the
				// sandbox's proxy; nothing else changes.
				Config:           config,
				ConfigPlanChecks: resource.ConfigPlanChecks{PreApply: []plancheck.PlanCheck{plancheck.ExpectEmptyPlan()}},
				ConfigStateChecks: []statecheck.StateCheck{
					statecheck.ExpectKnownValue(addr, tfjsonpath.New("status").AtMapKey("ready_endpoints"), knownvalue.ListExact([]knownvalue.Check{
						knownvalue.StringRegexp(regexp.MustCompile(`^http://[a-z0-9-]+-egress\.` + ns + `\.svc:3128$`)),
					})),
				},
				Check: func(*terraform.State) error { return checkEgressAcc(ctx, t, c, cs, ns, proxy, web, unreached, &probe) },
			},
		},
	})
}

type egressProbeOutput struct {
	HTTPProxy string                        `json:"http_proxy"`
	Body      string                        `json:"body"`
	Refused   map[string][2]json.RawMessage `json:"refused"`
}

// runEgressAccProbe runs egressAccProbe in the agent's sandbox through the
// Compute API that agentbox_platform reports, and requires the allowed
// fetch to return the web server's page and each refused one a 403 from
// the proxy with a reason.
func runEgressAccProbe(ctx context.Context, s *terraform.State, agent, allowed string, refused ...string) (*egressProbeOutput, error) {
	platform, ok := s.RootModule().Resources["agentbox_platform.this"]
	if !ok {
		return nil, fmt.Errorf("agentbox_platform.this not in state")
	}
	attrs := platform.Primary.Attributes
	api, err := apiclient.New(attrs["api_endpoint"], attrs["admin_token"], []byte(attrs["ca_certificate"]))
	if err != nil {
		return nil, err
	}
	defer api.CloseIdleConnections()
	ctx, cancel := context.WithTimeout(ctx, 3*time.Minute)
	defer cancel()
	res, err := api.RunCommand(ctx, agent, apiclient.RunCommandRequest{
		Command: append([]string{"python3", "-c", egressAccProbe, allowed}, refused...),
	})
	if err != nil {
		return nil, fmt.Errorf("run_command: %w", err)
	}
	if res.ExitCode != 0 {
		return nil, fmt.Errorf("probe in the sandbox: exit %d, stdout %q, stderr %q", res.ExitCode, res.Stdout, strings.TrimSpace(res.Stderr))
	}
	var out egressProbeOutput
	if err := json.Unmarshal([]byte(strings.TrimSpace(res.Stdout)), &out); err != nil {
		return nil, fmt.Errorf("probe output %q: %w", res.Stdout, err)
	}
	if strings.TrimSpace(out.Body) == "" {
		return nil, fmt.Errorf("the allowed fetch returned nothing: %+v", out)
	}
	return &out, nil
}

// checkEgressAcc checks what the probe saw against the cluster: the
// sandbox's proxy variable is its proxy's Service, the allowed fetch
// returned the web server's page, the refusals came from the proxy for the
// right reasons, the proxy runs under gVisor, and its access log and
// metrics have both decisions. The second web server never saw a
// connection.
func checkEgressAcc(ctx context.Context, t *testing.T, c client.Client, cs kubernetes.Interface, ns, proxy, web, unreached string, probe *egressProbeOutput) error {
	if got := strings.TrimSpace(probe.Body); got != "hello-through-the-proxy" {
		return fmt.Errorf("allowed fetch returned %q", got)
	}
	wantRefused := map[string]string{
		"http://not-allowed.invalid/":              "not_allowed",
		"http://" + unreached + ":8080/index.html": "denied_ip",
	}
	for url, reason := range wantRefused {
		got, ok := probe.Refused[url]
		if !ok || string(got[0]) != "403" || string(got[1]) != fmt.Sprintf("%q", reason) {
			return fmt.Errorf("%s: got %s %s, want 403 from the proxy with reason %s", url, got[0], got[1], reason)
		}
	}

	sel := client.MatchingLabels{agentboxv1alpha1.LabelEgressProxy: proxy}
	var svcs corev1.ServiceList
	if err := c.List(ctx, &svcs, client.InNamespace(ns), sel); err != nil {
		return err
	}
	if len(svcs.Items) != 1 {
		return fmt.Errorf("%d proxy Services, want the sandbox's one", len(svcs.Items))
	}
	if want := fmt.Sprintf("http://%s:3128", svcs.Items[0].Spec.ClusterIP); probe.HTTPProxy != want {
		return fmt.Errorf("HTTP_PROXY in the sandbox is %q, want its proxy Service %s", probe.HTTPProxy, want)
	}
	var pods corev1.PodList
	if err := c.List(ctx, &pods, client.InNamespace(ns), sel); err != nil {
		return err
	}
	if len(pods.Items) != 1 {
		return fmt.Errorf("%d proxy pods, want the sandbox's one", len(pods.Items))
	}
	pod := pods.Items[0]
	if rc := ptr.Deref(pod.Spec.RuntimeClassName, ""); rc != "gvisor" || pod.Status.Phase != corev1.PodRunning {
		return fmt.Errorf("proxy pod %s: runtime class %q, phase %s; want gvisor, Running", pod.Name, rc, pod.Status.Phase)
	}

	// Both decisions in the access log, which the proxy writes as the
	// request ends; polled, as the log reaches the kubelet a little later.
	var logs []byte
	err := wait.PollUntilContextTimeout(ctx, time.Second, time.Minute, true, func(ctx context.Context) (bool, error) {
		var err error
		logs, err = cs.CoreV1().Pods(ns).GetLogs(pod.Name, &corev1.PodLogOptions{Container: "proxy"}).DoRaw(ctx)
		if err != nil {
			return false, nil
		}
		return bytes.Contains(logs, []byte(`"host":"`+unreached+`"`)), nil
	})
	if err != nil {
		return fmt.Errorf("the proxy's access log lacks the requests: %w\n%s", err, logs)
	}
	decisions := map[string]string{web: `"decision":"allow"`, "not-allowed.invalid": `"decision":"deny"`, unreached: `"decision":"deny"`}
	for host, decision := range decisions {
		found := false
		for _, line := range bytes.Split(logs, []byte("\n")) {
			if bytes.Contains(line, []byte(`"host":"`+host+`"`)) && bytes.Contains(line, []byte(decision)) {
				found = true
			}
		}
		if !found {
			return fmt.Errorf("no access log line for %s with %s:\n%s", host, decision, logs)
		}
	}

	// The metrics, read through the API server's pod proxy.
	metrics, err := cs.CoreV1().Pods(ns).ProxyGet("http", pod.Name, "9090", "/metrics", nil).DoRaw(ctx)
	if err != nil {
		return fmt.Errorf("proxy metrics: %w", err)
	}
	for _, series := range []string{
		`agentbox_egress_requests_total{decision="allow",reason=""} 1`,
		`agentbox_egress_requests_total{decision="deny",reason="not_allowed"} 1`,
		`agentbox_egress_requests_total{decision="deny",reason="denied_ip"} 1`,
	} {
		if !bytes.Contains(metrics, []byte(series)) {
			return fmt.Errorf("the proxy's metrics lack %s:\n%s", series, grepLines(metrics, "agentbox_egress_requests_total"))
		}
	}

	// The refused server saw no connection: busybox httpd -vv logs each.
	served, err := cs.CoreV1().Pods(ns).GetLogs("unreached", &corev1.PodLogOptions{}).DoRaw(ctx)
	if err != nil {
		return fmt.Errorf("logs of the unreached server: %w", err)
	}
	if len(bytes.TrimSpace(served)) != 0 {
		return fmt.Errorf("the server outside allowed_cidrs was reached:\n%s", served)
	}
	webLog, err := cs.CoreV1().Pods(ns).GetLogs("web", &corev1.PodLogOptions{}).DoRaw(ctx)
	if err != nil {
		return fmt.Errorf("logs of the web server: %w", err)
	}
	if len(bytes.TrimSpace(webLog)) == 0 {
		return fmt.Errorf("the web server that was fetched logged nothing, so an empty log proves nothing about the other")
	}

	// The proxy pods' NetworkPolicy opens the same /32 and nothing else of
	// the private ranges (not enforced here; checked as an object).
	var np networkingv1.NetworkPolicy
	if err := c.Get(ctx, client.ObjectKey{Namespace: ns, Name: proxy + "-egress-proxy"}, &np); err != nil {
		return fmt.Errorf("proxy NetworkPolicy: %w", err)
	}
	if len(np.Spec.Egress) < 2 {
		return fmt.Errorf("proxy NetworkPolicy egress %+v lacks the DNS and public rules", np.Spec.Egress)
	}
	var holes []string
	for _, r := range np.Spec.Egress[2:] {
		for _, p := range r.To {
			if p.IPBlock != nil {
				holes = append(holes, p.IPBlock.CIDR)
			}
		}
	}
	if len(holes) != 1 || holes[0] != web+"/32" {
		return fmt.Errorf("proxy NetworkPolicy opens %v, want only %s/32", holes, web)
	}
	t.Logf("through the proxy (%s, gVisor) from the sandbox: allowed %s, refused %v; metrics and access log agree",
		pod.Name, web, wantRefused)
	return nil
}

func grepLines(b []byte, s string) string {
	var out []string
	for _, l := range strings.Split(string(b), "\n") {
		if strings.Contains(l, s) {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}

// startWebPod runs a busybox web server serving body at /index.html on
// port 8080, logging every connection, and returns its pod IP.
func startWebPod(ctx context.Context, t *testing.T, c client.Client, ns, name, body string) string {
	t.Helper()
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns, Labels: map[string]string{"app": name}},
		Spec: corev1.PodSpec{
			TerminationGracePeriodSeconds: ptr.To[int64](0),
			Containers: []corev1.Container{{
				Name: "httpd", Image: toolchain.BusyboxImage, ImagePullPolicy: corev1.PullNever,
				Command: []string{"/bin/sh", "-c", "mkdir -p /tmp/www && echo " + body + " > /tmp/www/index.html && exec httpd -f -vv -p 8080 -h /tmp/www"},
			}},
		},
	}
	if err := c.Create(ctx, pod); err != nil {
		t.Fatal(err)
	}
	err := wait.PollUntilContextTimeout(ctx, 500*time.Millisecond, 2*time.Minute, true, func(ctx context.Context) (bool, error) {
		if err := c.Get(ctx, client.ObjectKeyFromObject(pod), pod); err != nil {
			return false, nil
		}
		return pod.Status.Phase == corev1.PodRunning && pod.Status.PodIP != "", nil
	})
	if err != nil {
		t.Fatalf("web server pod %s: %v (phase %s)", name, err, pod.Status.Phase)
	}
	return pod.Status.PodIP
}
