package main

import (
	"bytes"
	"context"
	"crypto/tls"
	"errors"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	nodev1 "k8s.io/api/node/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	kruntime "k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/envtest"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	apiclient "github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
	"github.com/agentbox/terraform-provider-agentbox/internal/pki"
	"github.com/agentbox/terraform-provider-agentbox/internal/store"
	"github.com/agentbox/terraform-provider-agentbox/internal/testenv/toolchain"
)

// TestBinaryAgainstAPIServer runs the real binary against a private
// kube-apiserver (envtest: apiserver and etcd only, no node, so it does not
// touch the machine's one shared cluster). It checks the wiring the unit
// tests cannot: start-up order, the serving certificate's names, readiness,
// the API answering from the cache, and a clean exit on SIGTERM. Calls that
// reach a sandbox need a node and are covered by the quickstart tests.
func TestBinaryAgainstAPIServer(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a kube-apiserver")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	metricsAddr := freeAddr(t)
	cp := startControlPlane(ctx, t, "--metrics-listen", metricsAddr)
	kube, svc, exited := cp.kube, cp.svc, cp.exited

	pool, err := pki.CertPoolFromPEM(cp.caPEM)
	if err != nil {
		t.Fatal(err)
	}
	conn, err := tls.Dial("tcp", cp.apiAddr, &tls.Config{RootCAs: pool, ServerName: "agentbox-api.agentbox-system.svc"})
	if err != nil {
		t.Fatalf("the API's certificate is not valid for its Service name: %v", err)
	}
	leaf := conn.ConnectionState().PeerCertificates[0]
	conn.Close()
	if err := kube.Get(ctx, client.ObjectKeyFromObject(svc), svc); err != nil {
		t.Fatal(err)
	}
	if err := leaf.VerifyHostname(svc.Spec.ClusterIP); err != nil {
		t.Errorf("the API's certificate does not name the Service's ClusterIP: %v", err)
	}

	c := cp.client(t, "admin-token")
	req := apiclient.RunCommandRequest{Command: []string{"true"}}
	bad := cp.client(t, "wrong")
	if _, err := bad.RunCommand(ctx, "agent-1", req); apiclient.CodeOf(err) != apiclient.CodeUnauthenticated {
		t.Errorf("wrong token: %v", err)
	}
	if _, err := c.RunCommand(ctx, "agent-1", req); apiclient.CodeOf(err) != apiclient.CodeSandboxNotFound {
		t.Errorf("no sandbox yet: %v", err)
	}

	// A sandbox whose template does not exist stays Pending; the reconciler
	// running in the binary labels it and writes that status, and the API
	// then reports it as not ready.
	sb := &v1alpha1.Sandbox{ObjectMeta: metav1.ObjectMeta{Namespace: "team-a", Name: "sb-1"},
		Spec: v1alpha1.SandboxSpec{AgentID: "agent-1", TemplateRef: v1alpha1.LocalObjectReference{Name: "missing"}}}
	if err := kube.Create(ctx, sb); err != nil {
		t.Fatal(err)
	}
	var lastErr error
	waitFor(t, exited, "the API to report the sandbox not ready", func() bool {
		_, lastErr = c.RunCommand(ctx, "agent-1", req)
		return apiclient.CodeOf(lastErr) == apiclient.CodeSandboxNotReady
	})
	var e *apiclient.Error
	if errors.As(lastErr, &e) && e.Details["reason"] != v1alpha1.ReasonTemplateNotFound {
		t.Errorf("not-ready reason %q, want %s", e.Details["reason"], v1alpha1.ReasonTemplateNotFound)
	}
	// A run is recorded (and fails, the sandbox not serving); its start is
	// counted with the run as the sample's exemplar.
	run, _, err := c.StartRun(ctx, apiclient.StartRunRequest{AgentID: "agent-1", Command: []string{"true"}, RequestID: "metrics-run"})
	if err != nil {
		t.Fatal(err)
	}

	// The exclusive lease end to end: a hold taken through the API and
	// then abandoned is reclaimed by the controller at its expiry, and the
	// next holder gets the sandbox. Once the template exists the controller
	// creates the sandbox's Lease (its pod, with no node to run on, stays
	// pending); the ServiceAccount and RuntimeClass let that pod through
	// admission on an API server without a controller manager.
	for _, o := range []client.Object{
		&corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: "default", Namespace: "team-a"}},
		&nodev1.RuntimeClass{ObjectMeta: metav1.ObjectMeta{Name: v1alpha1.DefaultRuntimeClassName}, Handler: "runsc"},
		&v1alpha1.SandboxTemplate{ObjectMeta: metav1.ObjectMeta{Name: "missing", Namespace: "team-a"}},
	} {
		if err := kube.Create(ctx, o); err != nil {
			t.Fatal(err)
		}
	}
	var held *apiclient.Lease
	waitFor(t, exited, "the sandbox's lease to be acquirable", func() bool {
		held, lastErr = c.AcquireLease(ctx, "agent-1", apiclient.AcquireLeaseRequest{Holder: "run-1", RequestID: "req-1", TTLSeconds: 2})
		return lastErr == nil
	})
	next := apiclient.AcquireLeaseRequest{Holder: "run-2", RequestID: "req-2"}
	if _, err := c.AcquireLease(ctx, "agent-1", next); !errors.Is(err, apiclient.ErrLeaseHeld) {
		t.Errorf("acquire while run-1 holds the lease: %v, want lease_held", err)
	}
	waitFor(t, exited, "the controller to reclaim the expired hold", func() bool {
		var l coordinationv1.Lease
		if err := kube.Get(ctx, types.NamespacedName{Namespace: "team-a", Name: v1alpha1.LeaseName("sb-1")}, &l); err != nil {
			return false
		}
		return l.Spec.HolderIdentity == nil
	})
	t.Logf("the expired hold was reclaimed %s after it expired", time.Since(held.ExpiresAt).Round(time.Millisecond))
	waitFor(t, exited, "the Leased condition to say Expired", func() bool {
		if err := kube.Get(ctx, client.ObjectKeyFromObject(sb), sb); err != nil {
			return false
		}
		cond := meta.FindStatusCondition(sb.Status.Conditions, v1alpha1.ConditionLeased)
		return cond != nil && cond.Status == metav1.ConditionFalse && cond.Reason == v1alpha1.ReasonLeaseExpired
	})
	if l, err := c.AcquireLease(ctx, "agent-1", next); err != nil || l.Holder != "run-2" {
		t.Errorf("acquire after the reclaim: %+v, %v", l, err)
	}
	// The metrics endpoint speaks OpenMetrics to a scraper that asks for
	// it, which carries the exemplars; the state metrics count the hold.
	exemplarOf := func(text, sample string) string {
		for _, line := range strings.Split(text, "\n") {
			if rest, ok := strings.CutPrefix(line, sample+" # {"); ok {
				labels, _, _ := strings.Cut(rest, "}")
				return labels
			}
		}
		return ""
	}
	var scraped string
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("last scrape of the metrics:\n%s", scraped)
		}
	})
	waitFor(t, exited, "the metrics to show the hold and the run", func() bool {
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+metricsAddr+"/metrics", nil)
		req.Header.Set("Accept", "application/openmetrics-text; version=1.0.0")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			return false
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		scraped = string(b)
		if !strings.HasPrefix(resp.Header.Get("Content-Type"), "application/openmetrics-text") {
			return false
		}
		ex := strings.Split(exemplarOf(scraped, `agentbox_runs_started_total{mode="agent"} 1.0`), ",")
		slices.Sort(ex)
		return strings.Contains(scraped, "\n"+`agentbox_sandbox_holds_active{namespace="team-a"} 1.0`+"\n") &&
			slices.Equal(ex, []string{`agent="agent-1"`, `request_id="metrics-run"`, `run_id="` + run.ID + `"`})
	})

	// Tokens from the SQLite store: an agent token reaches its own agent
	// only, and every call so far is in a verifiable audit chain.
	tok, err := c.CreateToken(ctx, apiclient.CreateTokenRequest{Kind: apiclient.TokenKindAgent, AgentID: "agent-1"})
	if err != nil {
		t.Fatal(err)
	}
	agent := cp.client(t, tok.Token)
	if _, err := agent.AcquireLease(ctx, "agent-1", apiclient.AcquireLeaseRequest{Holder: "run-3", RequestID: "req-3"}); !errors.Is(err, apiclient.ErrLeaseHeld) {
		t.Errorf("agent token on its own agent: %v, want lease_held (run-2 holds it)", err)
	}
	if _, err := agent.RunCommand(ctx, "agent-2", req); apiclient.CodeOf(err) != apiclient.CodePermissionDenied {
		t.Errorf("agent token on another agent: %v", err)
	}
	v, err := c.VerifyAudit(ctx)
	if err != nil || !v.OK || v.Records == 0 {
		t.Errorf("audit verification through the API: %+v, %v", v, err)
	}

	if err := cp.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	select {
	case <-exited:
		if cp.waitErr != nil {
			t.Errorf("exit after SIGTERM: %v", cp.waitErr)
		}
	case <-time.After(40 * time.Second):
		t.Fatal("did not exit within 40s of SIGTERM")
	}

	// The calls made just before SIGTERM were written before the exit.
	st := cp.openStore(ctx, t)
	rep, err := st.VerifyAudit(ctx)
	if err != nil || !rep.OK() {
		t.Fatalf("audit chain after exit: %+v, %v", rep, err)
	}
	page, err := st.QueryAudit(ctx, store.AuditQuery{Newest: true, Limit: 1})
	if err != nil || len(page.Records) != 1 || page.Records[0].Operation != "verify_audit" {
		t.Errorf("newest audit record after exit: %+v, %v; want the verify_audit call", page.Records, err)
	}
	t.Logf("audit chain after exit: %d records, head %s", rep.Records, rep.Head)
}

// controlPlane is the real binary running against a private kube-apiserver
// (envtest: apiserver and etcd only, no node), with the chart's CRDs, the
// platform namespace, a team namespace, the API's Service and a SQLite
// store.
type controlPlane struct {
	// kube is an admin client of the apiserver.
	kube client.Client
	svc  *corev1.Service
	cmd  *exec.Cmd
	// exited is closed when the binary has exited; waitErr is then its
	// exit.
	exited  chan struct{}
	waitErr error
	logs    *lockedBuffer
	caPEM   []byte
	apiAddr string
	// endpoint is the API's URL; the admin token is "admin-token".
	endpoint string
	dataDir  string
}

// startControlPlane starts envtest and the binary with extraArgs, and
// returns once /readyz answers 200. The binary is killed at the test's
// end if it is still running; its output is logged when the test fails
// or runs verbose.
func startControlPlane(ctx context.Context, t *testing.T, extraArgs ...string) *controlPlane {
	t.Helper()
	bin := envtestAssets(t)
	env := &envtest.Environment{
		BinaryAssetsDirectory: bin,
		CRDDirectoryPaths:     []string{filepath.Join(repoRoot(t), "charts", "agentbox", "crds")},
		ErrorIfCRDPathMissing: true,
	}
	cfg, err := env.Start()
	if err != nil {
		t.Fatalf("start envtest: %v", err)
	}
	t.Cleanup(func() { _ = env.Stop() })
	user, err := env.AddUser(envtest.User{Name: "controlplane", Groups: []string{"system:masters"}}, nil)
	if err != nil {
		t.Fatal(err)
	}
	kubeconfig, err := user.KubeConfig()
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	kubeconfigPath := filepath.Join(dir, "kubeconfig")
	tokenPath := filepath.Join(dir, "token")
	if err := os.WriteFile(kubeconfigPath, kubeconfig, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(tokenPath, []byte("admin-token\n"), 0o600); err != nil {
		t.Fatal(err)
	}

	scheme := kruntime.NewScheme()
	_ = clientgoscheme.AddToScheme(scheme)
	_ = v1alpha1.AddToScheme(scheme)
	cp := &controlPlane{exited: make(chan struct{}), logs: &lockedBuffer{}, dataDir: t.TempDir()}
	if cp.kube, err = client.New(cfg, client.Options{Scheme: scheme}); err != nil {
		t.Fatal(err)
	}
	cp.svc = &corev1.Service{ObjectMeta: metav1.ObjectMeta{Namespace: platformNamespace, Name: "agentbox-api"},
		Spec: corev1.ServiceSpec{Ports: []corev1.ServicePort{{Port: 443}}}}
	for _, o := range []client.Object{
		&corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: platformNamespace}},
		&corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "team-a"}},
		cp.svc,
	} {
		if err := cp.kube.Create(ctx, o); err != nil {
			t.Fatal(err)
		}
	}

	caDir := writeCA(t)
	if cp.caPEM, err = os.ReadFile(filepath.Join(caDir, "tls.crt")); err != nil {
		t.Fatal(err)
	}
	cp.apiAddr = freeAddr(t)
	cp.endpoint = "https://127.0.0.1:" + cp.apiAddr[strings.LastIndexByte(cp.apiAddr, ':')+1:]
	healthAddr := freeAddr(t)
	args := append([]string{"--kubeconfig", kubeconfigPath, "--namespace", platformNamespace, "--ca-dir", caDir,
		"--admin-token-file", tokenPath, "--api-listen", cp.apiAddr, "--health-listen", healthAddr,
		"--metrics-listen", "0", "--sandbox-image", "example.invalid/sandbox:test"}, extraArgs...)
	cp.cmd = exec.Command(buildBinary(t), args...)
	// The store's directory comes from the variable the chart sets.
	cp.cmd.Env = []string{"HOME=" + dir, "PATH=" + os.Getenv("PATH"), "AGENTBOX_DATA_DIR=" + cp.dataDir}
	cp.cmd.Stdout, cp.cmd.Stderr = cp.logs, cp.logs
	if err := cp.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { cp.waitErr = cp.cmd.Wait(); close(cp.exited) }()
	t.Cleanup(func() {
		select {
		case <-cp.exited:
		default:
			_ = cp.cmd.Process.Kill()
			<-cp.exited
		}
		if t.Failed() || testing.Verbose() {
			t.Logf("control plane output:\n%s", cp.logs.String())
		}
	})

	waitFor(t, cp.exited, "/readyz to answer 200", func() bool {
		resp, err := http.Get("http://" + healthAddr + "/readyz")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK
	})
	return cp
}

// client is an API client with token.
func (cp *controlPlane) client(t *testing.T, token string) *apiclient.Client {
	t.Helper()
	c, err := apiclient.New(cp.endpoint, token, cp.caPEM)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// openStore opens the binary's SQLite store, once it has exited; the
// test's end closes it.
func (cp *controlPlane) openStore(ctx context.Context, t *testing.T) *store.Store {
	t.Helper()
	st, err := store.OpenSQLite(ctx, filepath.Join(cp.dataDir, "agentbox.db"), store.Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	return st
}

// platformNamespace is the platform namespace the tests run the binary in.
const platformNamespace = "agentbox-system"

// envtestAssets returns the folder holding kube-apiserver and etcd as built
// by `make testenv`, or skips when they have not been built.
func envtestAssets(t *testing.T) string {
	t.Helper()
	dir, err := toolchain.DefaultDir()
	if err != nil {
		t.Skip(err)
	}
	bin := toolchain.BinDir(dir)
	for _, b := range []string{"kube-apiserver", "etcd"} {
		if _, err := os.Stat(filepath.Join(bin, b)); err != nil {
			if os.Getenv("CI") != "" {
				t.Fatalf("%s is not built; run `make testenv`", b)
			}
			t.Skipf("%s is not built; run `make testenv`", b)
		}
	}
	return bin
}

func repoRoot(t *testing.T) string {
	t.Helper()
	_, file, _, ok := runtime.Caller(0)
	if !ok {
		t.Fatal("no caller information")
	}
	return filepath.Join(filepath.Dir(file), "..", "..", "..")
}

func freeAddr(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().String()
}

// waitFor polls cond for up to a minute, failing early if the binary exits.
func waitFor(t *testing.T, exited <-chan struct{}, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(time.Minute)
	for !cond() {
		select {
		case <-exited:
			t.Fatalf("the control plane exited while waiting for %s", what)
		case <-time.After(200 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
	}
}

// lockedBuffer collects the binary's output, written from the exec
// package's copying goroutines and read by the test.
type lockedBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *lockedBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *lockedBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}
