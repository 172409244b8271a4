package computeapi

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/json"
	"encoding/pem"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	clocktesting "k8s.io/utils/clock/testing"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/client/fake"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	api "github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
	"github.com/agentbox/terraform-provider-agentbox/internal/pki"
	"github.com/agentbox/terraform-provider-agentbox/internal/store"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor"
)

// realSupervisorAPI serves the API in front of the real supervisor (its
// HTTP handler over mutual TLS with the sandbox's identity), so that the
// forwarded operations meet the real file, tool and execute code. The
// pushes into the filespace after calls are off, so that only a test's own
// syncs change the filespace.
func realSupervisorAPI(t *testing.T, st *store.Store, configure func(*supervisor.Config), extra ...client.Object) func(token string) *api.Client {
	t.Helper()
	return realSupervisorAPIWith(t, apiSetup{store: st, configure: configure, extra: extra, pushDelay: -1})
}

// tempStore is a SQLite store in the test's temporary directory.
func tempStore(t *testing.T) *store.Store {
	t.Helper()
	st, err := store.OpenSQLite(context.Background(), filepath.Join(t.TempDir(), "agentbox.db"), store.Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	return st
}

type apiSetup struct {
	store     *store.Store
	configure func(*supervisor.Config)
	extra     []client.Object
	pushDelay time.Duration
	// noContract serves the API without contractCheck, whose recorder
	// holds a response until it is complete: for tests of streaming.
	noContract bool
	// renewInterval is the API's LeaseRenewInterval (0: the default).
	renewInterval time.Duration
	// started, if set, gets the fake cluster and the API's clock.
	started func(kube client.Client, clk *clocktesting.FakeClock)
	// server, if set, gets the Server.
	server func(*Server)
	// options, if set, changes the API's options.
	options func(*Options)
	// wrapSupervisor, if set, wraps the supervisor's handler.
	wrapSupervisor func(http.Handler) http.Handler
}

func realSupervisorAPIWith(t *testing.T, o apiSetup) func(token string) *api.Client {
	t.Helper()
	st, configure, extra := o.store, o.configure, o.extra
	ca, err := pki.NewCA("ops test CA")
	if err != nil {
		t.Fatal(err)
	}
	cfg := supervisor.Config{Workspace: t.TempDir(), Logger: slog.New(slog.DiscardHandler)}
	if configure != nil {
		configure(&cfg)
	}
	sup, err := supervisor.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { sup.Close() })
	leaf, err := ca.Issue(pki.LeafOptions{ID: pki.SandboxID(testTrustDomain, "team-a", "sb-1"), Usage: pki.UsageServer})
	if err != nil {
		t.Fatal(err)
	}
	cert, err := leaf.TLSCertificate()
	if err != nil {
		t.Fatal(err)
	}
	var supHandler http.Handler = sup
	if o.wrapSupervisor != nil {
		supHandler = o.wrapSupervisor(sup)
	}
	ss := httptest.NewUnstartedServer(supHandler)
	ss.TLS = pki.ServerTLS(cert, ca.Pool(), pki.ControlPlaneID(testTrustDomain, platformNS).String())
	ss.StartTLS()
	t.Cleanup(ss.Close)

	scheme := runtime.NewScheme()
	if err := clientgoscheme.AddToScheme(scheme); err != nil {
		t.Fatal(err)
	}
	if err := v1alpha1.AddToScheme(scheme); err != nil {
		t.Fatal(err)
	}
	clk := clocktesting.NewFakeClock(time.Now())
	kube := fake.NewClientBuilder().WithScheme(scheme).WithObjects(append([]client.Object{
		readySandbox("team-a", "sb-1", "agent-1", ss.URL), lease("team-a", "sb-1", clk.Now()),
	}, extra...)...).WithStatusSubresource(&v1alpha1.Sandbox{}).Build()
	pool := controlPlanePool(t, ca)
	admin, err := NewAdminTokenAuthenticator(HashToken(adminToken))
	if err != nil {
		t.Fatal(err)
	}
	auth := ChainAuthenticators(admin, agentToken{})
	if st != nil {
		auth = ChainAuthenticators(auth, NewStoreAuthenticator(st))
	}
	opts := Options{Sandboxes: kube, Leases: kube, Supervisors: pool, TrustDomain: testTrustDomain, Clock: clk,
		Authenticator: auth, Store: st, FilespacePushDelay: o.pushDelay, LeaseRenewInterval: o.renewInterval}
	if o.options != nil {
		o.options(&opts)
	}
	srv, err := NewServer(opts)
	if err != nil {
		t.Fatal(err)
	}
	if o.started != nil {
		o.started(kube, clk)
	}
	if o.server != nil {
		o.server(srv)
	}
	handler := srv.Handler()
	if !o.noContract {
		handler = contractCheck(t, handler)
	}
	ts := httptest.NewTLSServer(handler)
	t.Cleanup(func() { ts.Close(); srv.Close() })
	caPEM := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: ts.Certificate().Raw})
	return func(token string) *api.Client {
		c, err := api.New(ts.URL, token, caPEM)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(c.CloseIdleConnections)
		return c
	}
}

func TestStatusAndDeployOrResume(t *testing.T) {
	c := realSupervisorAPI(t, nil, nil)(adminToken)
	ctx := context.Background()
	for name, call := range map[string]func(context.Context, string) (*api.SandboxStatus, error){
		"status": c.Status,
		"deploy_or_resume": func(ctx context.Context, agent string) (*api.SandboxStatus, error) {
			return c.DeployOrResume(ctx, agent, api.DeployRequest{})
		},
	} {
		st, err := call(ctx, "agent-1")
		if err != nil || st.Phase != "Running" || !st.Ready || st.Name != "sb-1" || st.Namespace != "team-a" {
			t.Errorf("%s: %+v, %v", name, st, err)
		}
	}
	_, err := c.Status(ctx, "agent-404")
	wantAPIError(t, err, api.CodeSandboxNotFound, http.StatusNotFound)
}

func TestFilesThroughTheAPI(t *testing.T) {
	clients := realSupervisorAPI(t, nil, nil)
	c := clients(adminToken)
	ctx := context.Background()
	blob := make([]byte, 3<<20)
	if _, err := rand.Read(blob); err != nil {
		t.Fatal(err)
	}
	fi, err := c.PutFile(ctx, "agent-1", "data/blob.bin", bytes.NewReader(blob), 0o600)
	if err != nil || fi.Size != int64(len(blob)) || fi.Mode != "0600" || fi.Path != "data/blob.bin" {
		t.Fatalf("put: %+v, %v", fi, err)
	}
	rc, err := c.GetFile(ctx, "agent-1", "data/blob.bin")
	if err != nil {
		t.Fatal(err)
	}
	got, err := io.ReadAll(rc)
	rc.Close()
	if err != nil || !bytes.Equal(got, blob) {
		t.Fatalf("get: %d bytes (want %d identical), %v", len(got), len(blob), err)
	}
	_, err = c.GetFile(ctx, "agent-1", "data/missing")
	wantAPIError(t, err, api.CodeFileNotFound, http.StatusNotFound)
	// A path with ".." is refused by the API itself, before any routing
	// could clean it into another path (another agent's, say); the
	// supervisor's own refusals (symlinks out, absolute paths) are tested
	// on the supervisor.
	for _, p := range []string{"../outside", "sub/../../../agent-2/files/x", "a/./b"} {
		_, err = clients("agent-token:agent-1").PutFile(ctx, "agent-1", p, bytes.NewReader([]byte("x")), 0)
		wantAPIError(t, err, api.CodeInvalidArgument, http.StatusBadRequest)
	}
	if err := c.DeleteFile(ctx, "agent-1", "data", false); api.CodeOf(err) == "" {
		t.Errorf("deleting a non-empty directory without recursive: %v", err)
	}
	if err := c.DeleteFile(ctx, "agent-1", "data", true); err != nil {
		t.Fatal(err)
	}
	_, err = c.GetFile(ctx, "agent-1", "data/blob.bin")
	wantAPIError(t, err, api.CodeFileNotFound, http.StatusNotFound)

	// Another agent's token reaches none of it.
	other := clients("agent-token:agent-2")
	_, err = other.GetFile(ctx, "agent-1", "anything")
	wantAPIError(t, err, api.CodePermissionDenied, http.StatusForbidden)
	_, err = other.PutFile(ctx, "agent-1", "x", bytes.NewReader(nil), 0)
	wantAPIError(t, err, api.CodePermissionDenied, http.StatusForbidden)
}

func TestToolRequestAndExecute(t *testing.T) {
	c := realSupervisorAPI(t, nil, nil)(adminToken)
	ctx := context.Background()
	if _, err := c.ToolRequest(ctx, "agent-1", "create_file", map[string]any{"path": "notes.txt", "content": "hello"}); err != nil {
		t.Fatal(err)
	}
	out, err := c.ToolRequest(ctx, "agent-1", "read_file", map[string]any{"path": "notes.txt"})
	if err != nil || !bytes.Contains(out, []byte(`"hello"`)) {
		t.Fatalf("read_file: %s, %v", out, err)
	}
	_, err = c.ToolRequest(ctx, "agent-1", "create_file", map[string]any{"path": "x", "contents": "typo"})
	wantAPIError(t, err, api.CodeInvalidArgument, http.StatusBadRequest)

	if _, err := exec.LookPath("python3"); err != nil {
		t.Skip("no python3 for execute")
	}
	raw, err := c.Execute(ctx, "agent-1", map[string]any{
		"code":  "print(open('in.txt').read().upper()); open('out.txt','w').write('made')",
		"files": map[string][]byte{"in.txt": []byte("inline")},
	})
	if err != nil {
		t.Fatal(err)
	}
	var res struct {
		Status        string            `json:"status"`
		Output        string            `json:"output"`
		FilesProduced map[string][]byte `json:"files_produced"`
	}
	if err := json.Unmarshal(raw, &res); err != nil || res.Status != "success" || res.Output != "INLINE\n" || string(res.FilesProduced["out.txt"]) != "made" {
		t.Fatalf("execute: %s (%v)", raw, err)
	}
}

// The status view tells which driver took the snapshot, and why a sandbox
// that should have stopped is still running.
func TestStatusShowsSnapshotDriverAndBlockedStops(t *testing.T) {
	sb := readySandbox("team-a", "sb-2", "agent-2", "https://127.0.0.1:1")
	ready := metav1.NewTime(time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC))
	sb.Status.Snapshot = &v1alpha1.SandboxSnapshot{Name: "sb-2-1893553445", SizeBytes: 4096, ReadyTime: &ready, Driver: "archive/embedded"}
	next := metav1.NewTime(ready.Add(time.Minute))
	sb.Status.IdleStopRetry = &v1alpha1.IdleStopRetry{Failures: 2, NextAttemptTime: next}
	sb.Status.Conditions = append(sb.Status.Conditions, metav1.Condition{Type: v1alpha1.ConditionIdleStopBlocked, Status: metav1.ConditionTrue,
		Reason: v1alpha1.ReasonSnapshotFailed, Message: "idle stop abandoned: the store is full", LastTransitionTime: ready})
	f := newFixture(t, "", sb)
	st, err := f.client(t, adminToken).Status(context.Background(), "agent-2")
	if err != nil {
		t.Fatal(err)
	}
	if st.Snapshot == nil || st.Snapshot.Driver != "archive/embedded" || !st.Snapshot.ReadyAt.Equal(ready.Time) {
		t.Errorf("snapshot %+v", st.Snapshot)
	}
	b := st.IdleStopBlocked
	if b == nil || b.Reason != v1alpha1.ReasonSnapshotFailed || b.Message != "idle stop abandoned: the store is full" || b.Failures != 2 || !b.NextAttemptAt.Equal(next.Time) {
		t.Errorf("idle_stop_blocked %+v", b)
	}
	if !st.Ready || st.Phase != "Running" {
		t.Errorf("a sandbox whose stops are blocked serves: %+v", st)
	}
	// A running sandbox without the condition has none.
	if st, err := f.client(t, adminToken).Status(context.Background(), "agent-1"); err != nil || st.IdleStopBlocked != nil {
		t.Errorf("agent-1: %+v, %v", st, err)
	}
}

// A call that waits for a resume longer than the resume timeout gets an
// answer that says what the sandbox was still doing and how long the call
// waited.
func TestResumeTimeoutSaysWhatTheSandboxWasDoing(t *testing.T) {
	sb := readySandbox("team-a", "sb-3", "agent-3", "")
	sb.Status.Phase = v1alpha1.SandboxPhaseResuming
	sb.Status.Conditions[0].Status, sb.Status.Conditions[0].Reason = metav1.ConditionFalse, v1alpha1.ReasonResuming
	f := newFixture(t, "", sb, lease("team-a", "sb-3", time.Now()))
	start := time.Now()
	_, err := f.client(t, adminToken).RunCommand(context.Background(), "agent-3", api.RunCommandRequest{Command: []string{"true"}})
	e := wantAPIError(t, err, api.CodeSandboxNotReady, http.StatusConflict)
	if !strings.Contains(e.Message, "workspace was being restored") || !strings.Contains(e.Message, "retry") || e.Details["waited"] != "2s" ||
		e.Details["phase"] != "Resuming" {
		t.Errorf("after %s: %+v", time.Since(start).Round(time.Millisecond), e)
	}
}
