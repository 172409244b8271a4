package controller

import (
	"bytes"
	"crypto/rand"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/client-go/kubernetes"
	"k8s.io/utils/ptr"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	"github.com/agentbox/terraform-provider-agentbox/internal/pki"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"
)

// httpsTargetServer is the test's HTTPS destination: Python's http.server
// with the certificate mounted at /tls. It prints the Authorization header
// it receives to its log, where the test (not the sandbox) reads it.
const httpsTargetServer = `
import http.server, ssl
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        print("PATH=" + self.path + " AUTHORIZATION=" + self.headers.get("Authorization", "<none>"), flush=True)
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"hello-from-https-target\n")
srv = http.server.HTTPServer(("", 8443), H)
ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
ctx.load_cert_chain("/tls/tls.crt", "/tls/tls.key")
srv.socket = ctx.wrap_socket(srv.socket, server_side=True)
srv.serve_forever()
`

// credentialProbe runs in the sandbox: an HTTPS request through the
// proxy with a placeholder Authorization header, verified by the trust
// store the pod was given.
const credentialProbe = `
import json, os, sys, urllib.request
req = urllib.request.Request(sys.argv[1], headers={"Authorization": "Bearer PLACEHOLDER"})
out = {k: os.environ.get(k, "") for k in ["SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "NODE_EXTRA_CA_CERTS"]}
out["body"] = urllib.request.urlopen(req, timeout=20).read().decode()
print(json.dumps(out))
`

// plainProbe runs in the sandbox: an HTTPS request through the proxy
// with a placeholder Authorization header to a destination whose
// certificate the sandbox cannot verify (it is tunnelled, not
// intercepted), printing the body.
const plainProbe = `
import ssl, sys, urllib.request
ctx = ssl.create_default_context()
ctx.check_hostname = False
ctx.verify_mode = ssl.CERT_NONE
req = urllib.request.Request(sys.argv[1], headers={"Authorization": "Bearer PLACEHOLDER"})
print(urllib.request.urlopen(req, timeout=20, context=ctx).read().decode())
`

// secretSearch runs in the sandbox and looks for a string in every
// process's environment and in every file outside /proc, /sys and /dev,
// and with a third argument "mem" in every process's memory it may read
// (/proc/PID/mem, its readable mappings) but its own, which holds the
// string to look for. With a fourth, a URL, the process holding the
// control first GETs it with a placeholder Authorization, so that the
// memory of a process that used a credentialed destination is searched. The string arrives reversed and base64-encoded, so
// that the command line the supervisor runs (and may record) does not
// hold it; the second argument is a control the search must find, in a
// file and, for "mem", in the memory of a process that holds it nowhere
// else, to show it looks where it says.
const secretSearch = `
import base64, json, os, subprocess, sys
def dec(a): return base64.b64decode(a)[::-1]
needle, control = dec(sys.argv[1]), dec(sys.argv[2])
search_mem = len(sys.argv) > 3 and sys.argv[3] == "mem"
open("/tmp/search-control", "wb").write(control)
hits, control_hits, files = [], [], 0
mem = {"procs": 0, "pids": 0, "bytes": 0, "control_pid": False}
holder = None
if search_mem:
    open("/tmp/search-control-mem", "wb").write(control[::-1])
    holder = subprocess.Popen([sys.executable, "-c",
        "import os, sys, time, urllib.request\n"
        "b = bytes(reversed(open('/tmp/search-control-mem', 'rb').read()))\n"
        "os.remove('/tmp/search-control-mem')\n"
        "if len(sys.argv) > 1:\n"
        "    req = urllib.request.Request(sys.argv[1], headers={'Authorization': 'Bearer PLACEHOLDER'})\n"
        "    body = urllib.request.urlopen(req, timeout=20).read()\n"
        "sys.stdout.write('ready\\n'); sys.stdout.flush(); time.sleep(600)\n"] + sys.argv[4:5], stdout=subprocess.PIPE)
    if holder.stdout.readline() != b"ready\n":
        sys.exit("the process holding the control failed")
def scan_mem(pid):
    try:
        maps = open("/proc/%s/maps" % pid).read().splitlines()
        f = open("/proc/%s/mem" % pid, "rb", 0)
    except OSError:
        return None
    found, ctl, n = False, False, 0
    with f:
        for line in maps:
            parts = line.split()
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if "r" not in parts[1] or hi - lo > 256 << 20:
                continue
            try:
                f.seek(lo)
                b = f.read(hi - lo)
            except (OSError, ValueError, OverflowError):
                continue
            n += len(b)
            found = found or needle in b
            ctl = ctl or control in b
    return found, ctl, n
for pid in os.listdir("/proc"):
    if pid.isdigit():
        try:
            env = open("/proc/%s/environ" % pid, "rb").read()
        except OSError:
            env = b""
        if needle in env: hits.append("environ of pid " + pid)
        if search_mem and int(pid) != os.getpid():
            mem["procs"] += 1
            r = scan_mem(pid)
            if r is not None and r[2] > 0:
                mem["pids"] += 1
                mem["bytes"] += r[2]
                if r[0]: hits.append("memory of pid " + pid)
                if r[1] and holder is not None and int(pid) == holder.pid: mem["control_pid"] = True
if holder is not None:
    holder.kill()
for root, dirs, names in os.walk("/"):
    if root == "/":
        dirs[:] = [d for d in dirs if d not in ("proc", "sys", "dev")]
    for n in names:
        p = os.path.join(root, n)
        try:
            if os.path.islink(p) or not os.path.isfile(p) or os.path.getsize(p) > 64 << 20:
                continue
            b = open(p, "rb").read()
        except OSError:
            continue
        files += 1
        if needle in b: hits.append(p)
        if control in b: control_hits.append(p)
print(json.dumps({"hits": hits, "control_hits": control_hits, "files": files, "mem": mem}))
`

// TestEgressProxyCredentials: an EgressProxy declares a credential for an
// HTTPS destination; a sandbox of a template naming it calls that
// destination through its proxy with a placeholder header, and the
// destination receives the secret while nothing in the sandbox (its
// processes' environments, its files) holds it.
//
// The destination is a pod the test creates (Python's HTTPS server, from
// the sandbox image) behind a Service, with a certificate from a CA of the
// test's own for the Service's ClusterIP; the EgressProxy trusts that CA
// through destinationCABundle. As in TestEgressProxyPerAgent the address
// is allowed by IP, with allowedCIDRs for the NetworkPolicy.
func TestEgressProxyCredentials(t *testing.T) {
	t.Parallel()
	image := os.Getenv(EnvSandboxImage)
	if image == "" {
		t.Skipf("%s is not set: the test runs commands through the real sandbox image's supervisor", EnvSandboxImage)
	}
	e := newClusterEnv(t)
	e.startEgressManager(testEgressReconciler())
	cs, err := kubernetes.NewForConfig(e.cfg)
	must(t, err)

	// The CRD refuses a credential with both a header and basic auth.
	bad := &v1alpha1.EgressProxy{
		ObjectMeta: metav1.ObjectMeta{Name: "bad", Namespace: e.ns},
		Spec: v1alpha1.EgressProxySpec{Credentials: []v1alpha1.EgressCredential{{
			Name: "both", Hosts: []v1alpha1.Domain{"api.example.com"},
			SecretRef: v1alpha1.SecretKeySelector{Name: "s", Key: "k"},
			Header:    &v1alpha1.EgressCredentialHeader{Name: "X-Key", ValueTemplate: "no placeholder"},
			BasicAuth: &v1alpha1.EgressCredentialBasicAuth{},
		}}},
	}
	if err := e.c.Create(e.ctx, bad); !apierrors.IsInvalid(err) ||
		!strings.Contains(err.Error(), "exactly one of header and basicAuth") || !strings.Contains(err.Error(), "must contain {{secret}}") {
		t.Errorf("an EgressProxy with a malformed credential: %v", err)
	}

	target := e.startHTTPSTarget(image)
	secretBytes := make([]byte, 16)
	_, _ = rand.Read(secretBytes)
	secret := "sk-test-" + hex.EncodeToString(secretBytes)
	must(t, e.c.Create(e.ctx, &corev1.Secret{
		ObjectMeta: metav1.ObjectMeta{Name: "api-token", Namespace: e.ns},
		Data:       map[string][]byte{"token": []byte(secret)},
	}))
	proxy := &v1alpha1.EgressProxy{
		ObjectMeta: metav1.ObjectMeta{Name: "egress", Namespace: e.ns},
		Spec: v1alpha1.EgressProxySpec{
			AllowedDomains: []v1alpha1.Domain{v1alpha1.Domain(target.clusterIP), v1alpha1.Domain(target.podIP)},
			AllowedCIDRs:   []v1alpha1.AllowedCIDR{v1alpha1.AllowedCIDR(target.clusterIP + "/32"), v1alpha1.AllowedCIDR(target.podIP + "/32")},
			Credentials: []v1alpha1.EgressCredential{{
				Name:      "api-token",
				Hosts:     []v1alpha1.Domain{v1alpha1.Domain(target.clusterIP)},
				SecretRef: v1alpha1.SecretKeySelector{Name: "api-token", Key: "token"},
				Header:    &v1alpha1.EgressCredentialHeader{Name: "Authorization", ValueTemplate: "Bearer {{secret}}"},
			}},
			DestinationCABundle: string(target.caPEM),
		},
	}
	must(t, e.c.Create(e.ctx, proxy))
	e.template("tpl", func(tpl *v1alpha1.SandboxTemplate) {
		tpl.Spec.Image = image
		tpl.Spec.EgressProxyRef = &v1alpha1.LocalObjectReference{Name: "egress"}
	})
	e.sandbox("agent", "tpl")
	e.eventually("the EgressProxy to be available", func() error {
		if err := e.get("egress", proxy); err != nil {
			return err
		}
		if c := meta.FindStatusCondition(proxy.Status.Conditions, v1alpha1.ConditionReady); c == nil || c.Reason != v1alpha1.ReasonProxyAvailable {
			return fmt.Errorf("Ready %+v", c)
		}
		return nil
	})
	sbx := e.waitReason("agent", v1alpha1.ReasonRunning)
	sup := e.supervisor(t, sbx)

	url := "https://" + net.JoinHostPort(target.clusterIP, "8443") + "/v1/check"
	res, err := sup.RunCommand(e.ctx, supervisorapi.CommandRequest{Command: []string{"python3", "-c", credentialProbe, url}, Cwd: "/tmp"})
	must(t, err)
	if res.ExitCode != 0 {
		t.Fatalf("the probe exited %d: %s", res.ExitCode, res.Stderr)
	}
	var probe map[string]string
	must(t, json.Unmarshal([]byte(strings.TrimSpace(res.Stdout)), &probe))
	if strings.TrimSpace(probe["body"]) != "hello-from-https-target" {
		t.Errorf("the HTTPS request returned %q", probe["body"])
	}
	for _, kv := range egressTrustEnv {
		if probe[kv[0]] != kv[1] {
			t.Errorf("%s in the sandbox is %q, want %q", kv[0], probe[kv[0]], kv[1])
		}
	}

	// The destination received the secret in place of the placeholder.
	e.eventually("the destination to log the request", func() error {
		logs, err := cs.CoreV1().Pods(e.ns).GetLogs(target.pod, &corev1.PodLogOptions{}).DoRaw(e.ctx)
		if err != nil {
			return err
		}
		if !bytes.Contains(logs, []byte("AUTHORIZATION=Bearer "+secret+"\n")) {
			return fmt.Errorf("the destination's log lacks the injected credential:\n%s", bytes.ReplaceAll(logs, []byte(secret), []byte("<secret>")))
		}
		return nil
	})

	// A second allowed destination, which no credential names (the same
	// server at its pod address), gets the request as the sandbox sent it,
	// through a tunnel: the placeholder, no secret. The sandbox does not
	// trust the test's CA (only the proxy does), so it does not verify
	// that certificate.
	plainURL := "https://" + net.JoinHostPort(target.podIP, "8443") + "/v1/plain"
	res, err = sup.RunCommand(e.ctx, supervisorapi.CommandRequest{Command: []string{"python3", "-c", plainProbe, plainURL}, Cwd: "/tmp"})
	must(t, err)
	if res.ExitCode != 0 || strings.TrimSpace(res.Stdout) != "hello-from-https-target" {
		t.Fatalf("the request to the destination without a credential exited %d: %s %s", res.ExitCode, res.Stdout, res.Stderr)
	}
	e.eventually("the destination to log the request without a credential", func() error {
		logs, err := cs.CoreV1().Pods(e.ns).GetLogs(target.pod, &corev1.PodLogOptions{}).DoRaw(e.ctx)
		if err != nil {
			return err
		}
		if !bytes.Contains(logs, []byte("PATH=/v1/plain AUTHORIZATION=Bearer PLACEHOLDER\n")) {
			return fmt.Errorf("the destination's log lacks the uncredentialed request with its placeholder:\n%s", bytes.ReplaceAll(logs, []byte(secret), []byte("<secret>")))
		}
		return nil
	})

	// The proxy logged the injection by name, never the value.
	proxyLogs, err := cs.CoreV1().Pods(e.ns).GetLogs(EgressServiceName("agent"), &corev1.PodLogOptions{Container: egressContainerName}).DoRaw(e.ctx)
	must(t, err)
	if !bytes.Contains(proxyLogs, []byte(`"credential":"api-token","intercepted":true`)) {
		t.Errorf("the proxy's log has no intercepted request with the credential:\n%s", proxyLogs)
	}
	if bytes.Contains(proxyLogs, []byte(secret)) {
		t.Error("the proxy's log holds the secret")
	}

	// Nothing in the sandbox holds the secret.
	enc := func(s string) string {
		b := []byte(s)
		for i, j := 0, len(b)-1; i < j; i, j = i+1, j-1 {
			b[i], b[j] = b[j], b[i]
		}
		return base64.StdEncoding.EncodeToString(b)
	}
	control := "control-" + hex.EncodeToString(secretBytes[:8])
	searchStart := time.Now()
	res, err = sup.RunCommand(e.ctx, supervisorapi.CommandRequest{
		Command: []string{"python3", "-c", secretSearch, enc(secret), enc(control), "mem", url}, Cwd: "/tmp", TimeoutSeconds: 300,
	})
	must(t, err)
	if res.ExitCode != 0 {
		t.Fatalf("the search exited %d: %s", res.ExitCode, res.Stderr)
	}
	var search struct {
		Hits        []string `json:"hits"`
		ControlHits []string `json:"control_hits"`
		Files       int      `json:"files"`
		Mem         struct {
			Procs      int   `json:"procs"`
			PIDs       int   `json:"pids"`
			Bytes      int64 `json:"bytes"`
			ControlPID bool  `json:"control_pid"`
		} `json:"mem"`
	}
	must(t, json.Unmarshal([]byte(strings.TrimSpace(res.Stdout)), &search))
	if len(search.Hits) != 0 {
		t.Errorf("the secret is in the sandbox: %v", search.Hits)
	}
	if len(search.ControlHits) == 0 || search.Files < 100 {
		t.Errorf("the search did not find its control file (%v) or read few files (%d): it proves nothing", search.ControlHits, search.Files)
	}
	// Processes of other users (the supervisor's) are not readable to
	// the agent's commands, and so cannot leak to them this way either.
	if !search.Mem.ControlPID {
		t.Errorf("the memory search (%d of %d processes readable) did not find its control in the process holding it: it proves nothing",
			search.Mem.PIDs, search.Mem.Procs)
	}
	t.Logf("searched %d files, every process's environment and the memory of the %d of %d other processes the agent can read (%d MiB) in the sandbox in %s; the secret is in none",
		search.Files, search.Mem.PIDs, search.Mem.Procs, search.Mem.Bytes>>20, time.Since(searchStart).Round(time.Millisecond))

	// The proxy reads destinationCABundle only as it starts, so a new
	// bundle must replace its pod. A bundle of an unrelated CA alone makes
	// the destination's certificate fail verification at the new pod;
	// adding the destination's CA back makes the request go through again.
	unrelated, err := pki.NewCA("unrelated CA")
	must(t, err)
	probeWith := func(bundle string) (*supervisorapi.CommandResult, error) {
		var before corev1.Pod
		must(t, e.get(EgressServiceName("agent"), &before))
		must(t, e.get("egress", proxy))
		proxy.Spec.DestinationCABundle = bundle
		must(t, e.c.Update(e.ctx, proxy))
		want := egressPodAnnotations(proxy)[annotationEgressDestinationCAHash]
		restartStart := time.Now()
		e.eventually("the proxy pod to be replaced for the new bundle", func() error {
			var pod corev1.Pod
			if err := e.get(EgressServiceName("agent"), &pod); err != nil {
				return err
			}
			if pod.UID == before.UID || pod.Annotations[annotationEgressDestinationCAHash] != want {
				return fmt.Errorf("pod %s has bundle hash %q, want %q", pod.UID, pod.Annotations[annotationEgressDestinationCAHash], want)
			}
			if !podReady(&pod) {
				return fmt.Errorf("pod %s not ready", pod.UID)
			}
			return nil
		})
		t.Logf("proxy pod replaced and ready for the new bundle in %s", time.Since(restartStart).Round(time.Millisecond))
		return sup.RunCommand(e.ctx, supervisorapi.CommandRequest{Command: []string{"python3", "-c", credentialProbe, url}, Cwd: "/tmp"})
	}
	res, err = probeWith(string(unrelated.CertPEM))
	must(t, err)
	if res.ExitCode == 0 {
		t.Errorf("with a bundle lacking the destination's CA the request went through: %s", res.Stdout)
	}
	res, err = probeWith(string(unrelated.CertPEM) + string(target.caPEM))
	must(t, err)
	if res.ExitCode != 0 || !strings.Contains(res.Stdout, "hello-from-https-target") {
		t.Errorf("with the destination's CA back in the bundle: exit %d, stdout %q, stderr %q", res.ExitCode, res.Stdout, res.Stderr)
	}
}

type httpsTarget struct {
	pod, clusterIP, podIP string
	caPEM                 []byte
}

// startHTTPSTarget runs httpsTargetServer behind a Service, with a
// certificate for the Service's address from a CA made here.
func (e *clusterEnv) startHTTPSTarget(image string) *httpsTarget {
	e.t.Helper()
	labels := map[string]string{"app": "https-target"}
	svc := &corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Name: "https-target", Namespace: e.ns},
		Spec: corev1.ServiceSpec{Selector: labels, Ports: []corev1.ServicePort{{
			Port: 8443, TargetPort: intstr.FromInt32(8443), Protocol: corev1.ProtocolTCP,
		}}},
	}
	must(e.t, e.c.Create(e.ctx, svc))
	ca, err := pki.NewCA("test destination CA")
	must(e.t, err)
	leaf, err := ca.Issue(pki.LeafOptions{
		ID: pki.SandboxID("", e.ns, "https-target"), Usage: pki.UsageServer,
		IPAddresses: []net.IP{net.ParseIP(svc.Spec.ClusterIP)},
	})
	must(e.t, err)
	must(e.t, e.c.Create(e.ctx, &corev1.Secret{
		ObjectMeta: metav1.ObjectMeta{Name: "https-target-tls", Namespace: e.ns},
		Type:       corev1.SecretTypeTLS,
		Data:       map[string][]byte{corev1.TLSCertKey: leaf.CertPEM, corev1.TLSPrivateKeyKey: leaf.KeyPEM},
	}))
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "https-target", Namespace: e.ns, Labels: labels},
		Spec: corev1.PodSpec{
			TerminationGracePeriodSeconds: ptr.To[int64](0),
			Volumes: []corev1.Volume{{Name: "tls", VolumeSource: corev1.VolumeSource{Secret: &corev1.SecretVolumeSource{
				SecretName: "https-target-tls", DefaultMode: ptr.To[int32](0o444),
			}}}},
			Containers: []corev1.Container{{
				Name: "https", Image: image, ImagePullPolicy: corev1.PullNever,
				Command:      []string{"python3", "-u", "-c", httpsTargetServer},
				VolumeMounts: []corev1.VolumeMount{{Name: "tls", MountPath: "/tls", ReadOnly: true}},
				ReadinessProbe: &corev1.Probe{
					ProbeHandler:  corev1.ProbeHandler{TCPSocket: &corev1.TCPSocketAction{Port: intstr.FromInt32(8443)}},
					PeriodSeconds: 1,
				},
			}},
		},
	}
	must(e.t, e.c.Create(e.ctx, pod))
	e.eventually("the HTTPS target to be ready", func() error {
		if err := e.get(pod.Name, pod); err != nil {
			return err
		}
		if !podReady(pod) || pod.Status.PodIP == "" {
			return fmt.Errorf("HTTPS target pod is %s: %+v", pod.Status.Phase, pod.Status.ContainerStatuses)
		}
		return nil
	})
	return &httpsTarget{pod: pod.Name, clusterIP: svc.Spec.ClusterIP, podIP: pod.Status.PodIP, caPEM: ca.CertPEM}
}
