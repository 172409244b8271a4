package computeapi

import (
	"context"
	"crypto/tls"
	"encoding/json"
	"encoding/pem"
	"errors"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	clocktesting "k8s.io/utils/clock/testing"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/client/fake"
	"sigs.k8s.io/controller-runtime/pkg/client/interceptor"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	api "github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
	"github.com/agentbox/terraform-provider-agentbox/internal/pki"
	"github.com/agentbox/terraform-provider-agentbox/internal/store"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"
)

const (
	testTrustDomain = "agentbox.local"
	platformNS      = "agentbox-system"
	adminToken      = "s3cret-admin-token"
)

// fakeSupervisor is an HTTPS server with the supervisor's mTLS setup: it
// presents a certificate for identity and accepts only the control plane.
type fakeSupervisor struct {
	srv        *httptest.Server
	handshakes atomic.Int32
	// handshakeDelay, when set, holds each handshake back, as a pod under
	// load would.
	handshakeDelay atomic.Int64
	healthCalls    atomic.Int32
	// envs, when set, are the environments health answers list.
	envs atomic.Pointer[[]supervisorapi.EnvInfo]

	mu       sync.Mutex
	requests []supervisorapi.CommandRequest
	// reply, when set, answers instead of the default echo.
	reply func(w http.ResponseWriter, req supervisorapi.CommandRequest)
	// stream, when set, answers streamed commands; without it they are
	// refused as unknown.
	stream func(w http.ResponseWriter, r *http.Request, req supervisorapi.CommandRequest)
}

func newFakeSupervisor(t *testing.T, ca *pki.CA, identity string) *fakeSupervisor {
	t.Helper()
	id, err := pki.ParseID(identity)
	if err != nil {
		t.Fatal(err)
	}
	leaf, err := ca.Issue(pki.LeafOptions{ID: id, Usage: pki.UsageServer})
	if err != nil {
		t.Fatal(err)
	}
	cert, err := leaf.TLSCertificate()
	if err != nil {
		t.Fatal(err)
	}
	fs := &fakeSupervisor{}
	fs.srv = httptest.NewUnstartedServer(http.HandlerFunc(fs.serve))
	cfg := pki.ServerTLS(cert, ca.Pool(), pki.ControlPlaneID(testTrustDomain, platformNS).String())
	verify := cfg.VerifyConnection
	cfg.VerifyConnection = func(cs tls.ConnectionState) error {
		fs.handshakes.Add(1)
		time.Sleep(time.Duration(fs.handshakeDelay.Load()))
		return verify(cs)
	}
	fs.srv.TLS = cfg
	fs.srv.StartTLS()
	t.Cleanup(fs.srv.Close)
	return fs
}

func (fs *fakeSupervisor) serve(w http.ResponseWriter, r *http.Request) {
	if r.URL.Path == supervisorapi.PathHealth && r.Method == http.MethodGet {
		fs.healthCalls.Add(1)
		w.Header().Set("Content-Type", "application/json")
		h := supervisorapi.Health{Status: "ok"}
		if envs := fs.envs.Load(); envs != nil {
			h.Environments = *envs
		}
		_ = json.NewEncoder(w).Encode(h)
		return
	}
	fs.mu.Lock()
	stream := fs.stream
	fs.mu.Unlock()
	streamed := r.URL.Path == supervisorapi.PathCommandsStream && stream != nil
	if r.Method != http.MethodPost || (r.URL.Path != supervisorapi.PathCommands && !streamed) {
		http.NotFound(w, r)
		return
	}
	var req supervisorapi.CommandRequest
	if err := json.NewDecoder(r.Body).Decode(&req); err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	fs.mu.Lock()
	fs.requests = append(fs.requests, req)
	reply := fs.reply
	fs.mu.Unlock()
	if streamed {
		stream(w, r, req)
		return
	}
	if reply != nil {
		reply(w, req)
		return
	}
	res := supervisorapi.CommandResult{Stdout: strings.Join(req.Command, " ") + "\n", Stderr: "from " + req.Cwd, DurationMS: 7}
	if req.Command[0] == "false" {
		res.ExitCode = 1
	}
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(res)
}

func (fs *fakeSupervisor) count() int {
	fs.mu.Lock()
	defer fs.mu.Unlock()
	return len(fs.requests)
}

func (fs *fakeSupervisor) lastRequest(t *testing.T) supervisorapi.CommandRequest {
	t.Helper()
	fs.mu.Lock()
	defer fs.mu.Unlock()
	if len(fs.requests) == 0 {
		t.Fatal("the supervisor received no request")
	}
	return fs.requests[len(fs.requests)-1]
}

type fixture struct {
	ca       *pki.CA
	kube     client.Client
	clock    *clocktesting.FakeClock
	api      *httptest.Server
	caPEM    []byte
	sup      *fakeSupervisor
	patches  atomic.Int32
	services *Server
}

func readySandbox(ns, name, agentID, endpoint string) *v1alpha1.Sandbox {
	return &v1alpha1.Sandbox{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name,
			Labels: map[string]string{v1alpha1.LabelAgentIDHash: v1alpha1.AgentIDHash(agentID)}},
		Spec: v1alpha1.SandboxSpec{AgentID: agentID, TemplateRef: v1alpha1.LocalObjectReference{Name: "python"}},
		Status: v1alpha1.SandboxStatus{
			Phase:           v1alpha1.SandboxPhaseRunning,
			ServiceEndpoint: endpoint,
			Conditions: []metav1.Condition{{Type: v1alpha1.ConditionReady, Status: metav1.ConditionTrue,
				Reason: v1alpha1.ReasonRunning, LastTransitionTime: metav1.Now()}},
		},
	}
}

func lease(ns, name string, renew time.Time) *coordinationv1.Lease {
	t := metav1.NewMicroTime(renew)
	return &coordinationv1.Lease{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name},
		Spec: coordinationv1.LeaseSpec{RenewTime: &t}}
}

// controlPlanePool is the API's supervisor pool with the control plane's
// client identity from ca.
func controlPlanePool(t *testing.T, ca *pki.CA) *SupervisorPool {
	t.Helper()
	leaf, err := ca.Issue(pki.LeafOptions{ID: pki.ControlPlaneID(testTrustDomain, platformNS), Usage: pki.UsageClient})
	if err != nil {
		t.Fatal(err)
	}
	cert, err := leaf.TLSCertificate()
	if err != nil {
		t.Fatal(err)
	}
	pool, err := NewSupervisorPool(StaticCertificate(cert), ca.Pool())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool
}

// newFixture starts the API over TLS in front of a fake cluster holding
// agent-1's ready sandbox team-a/sb-1 (served by a fake supervisor with the
// right identity) plus extra objects.
func newFixture(t *testing.T, supervisorIdentity string, extra ...client.Object) *fixture {
	t.Helper()
	return newFixtureWith(t, nil, supervisorIdentity, extra...)
}

// newFixtureWith is newFixture with a store behind the API (nil for none).
// The store's filespace pushes are off.
func newFixtureWith(t *testing.T, st *store.Store, supervisorIdentity string, extra ...client.Object) *fixture {
	t.Helper()
	ca, err := pki.NewCA("test CA")
	if err != nil {
		t.Fatal(err)
	}
	f := &fixture{ca: ca, clock: clocktesting.NewFakeClock(time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC))}
	if supervisorIdentity == "" {
		supervisorIdentity = pki.SandboxID(testTrustDomain, "team-a", "sb-1").String()
	}
	f.sup = newFakeSupervisor(t, ca, supervisorIdentity)

	scheme := runtime.NewScheme()
	if err := clientgoscheme.AddToScheme(scheme); err != nil {
		t.Fatal(err)
	}
	if err := v1alpha1.AddToScheme(scheme); err != nil {
		t.Fatal(err)
	}
	objs := append([]client.Object{
		readySandbox("team-a", "sb-1", "agent-1", f.sup.srv.URL),
		lease("team-a", "sb-1", f.clock.Now().Add(-time.Hour)),
	}, extra...)
	f.kube = fake.NewClientBuilder().WithScheme(scheme).WithObjects(objs...).
		WithStatusSubresource(&v1alpha1.Sandbox{}).
		WithInterceptorFuncs(interceptPatches(&f.patches)).Build()

	pool := controlPlanePool(t, ca)
	auth, err := NewAdminTokenAuthenticator(HashToken(adminToken))
	if err != nil {
		t.Fatal(err)
	}
	f.services, err = NewServer(Options{
		Sandboxes:     f.kube,
		Leases:        f.kube,
		Supervisors:   pool,
		Authenticator: auth,
		TrustDomain:   testTrustDomain,
		Clock:         f.clock,
		// Long enough for TestStoppedSandboxIsWokenAndServed's stand-in
		// controller, short enough for the tests that expect not_ready.
		ResumeTimeout:      2 * time.Second,
		Store:              st,
		FilespacePushDelay: -1,
	})
	if err != nil {
		t.Fatal(err)
	}
	f.api = httptest.NewTLSServer(contractCheck(t, f.services.Handler()))
	t.Cleanup(func() { f.api.Close(); f.services.Close() })
	f.caPEM = pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: f.api.Certificate().Raw})
	return f
}

func (f *fixture) client(t *testing.T, token string) *api.Client {
	t.Helper()
	c, err := api.New(f.api.URL, token, f.caPEM)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.CloseIdleConnections)
	return c
}

func (f *fixture) leaseRenewTime(t *testing.T) time.Time {
	t.Helper()
	var l coordinationv1.Lease
	if err := f.kube.Get(context.Background(), types.NamespacedName{Namespace: "team-a", Name: "sb-1"}, &l); err != nil {
		t.Fatal(err)
	}
	return l.Spec.RenewTime.Time
}

func interceptPatches(n *atomic.Int32) interceptor.Funcs {
	return interceptor.Funcs{Patch: func(ctx context.Context, c client.WithWatch, obj client.Object, patch client.Patch, opts ...client.PatchOption) error {
		n.Add(1)
		return c.Patch(ctx, obj, patch, opts...)
	}}
}

func wantAPIError(t *testing.T, err error, code api.Code, status int) *api.Error {
	t.Helper()
	var e *api.Error
	if !errors.As(err, &e) {
		t.Fatalf("error = %v, want an API error %s", err, code)
	}
	if e.Code != code || e.Status != status {
		t.Fatalf("error = %v, want code %s status %d", e, code, status)
	}
	return e
}

func TestRunCommandSuccess(t *testing.T) {
	f := newFixture(t, "")
	c := f.client(t, adminToken)
	res, err := c.RunCommand(context.Background(), "agent-1", api.RunCommandRequest{
		Command: []string{"echo", "hello"}, Cwd: "/workspace/src", Env: map[string]string{"A": "1"},
		Stdin: "input", TimeoutSeconds: 12,
	})
	if err != nil {
		t.Fatal(err)
	}
	if res.Stdout != "echo hello\n" || res.Stderr != "from /workspace/src" || res.ExitCode != 0 || res.DurationMS != 7 {
		t.Errorf("result = %+v", res)
	}
	got := f.sup.lastRequest(t)
	if got.Cwd != "/workspace/src" || got.Env["A"] != "1" || got.Stdin != "input" || got.TimeoutSeconds != 12 {
		t.Errorf("supervisor received %+v", got)
	}

	res, err = c.RunCommand(context.Background(), "agent-1", api.RunCommandRequest{Command: []string{"false"}})
	if err != nil {
		t.Fatal(err)
	}
	if res.ExitCode != 1 {
		t.Errorf("exit code = %d, want 1 (a failing command is a result, not an error)", res.ExitCode)
	}
}

func TestAuthentication(t *testing.T) {
	f := newFixture(t, "")
	_, err := f.client(t, "wrong-token").RunCommand(context.Background(), "agent-1", api.RunCommandRequest{Command: []string{"true"}})
	wantAPIError(t, err, api.CodeUnauthenticated, http.StatusUnauthorized)

	for name, header := range map[string]string{
		"missing":     "",
		"wrong token": "Bearer nope",
		"basic":       "Basic " + adminToken,
		"empty":       "Bearer ",
	} {
		req, _ := http.NewRequest(http.MethodPost, f.api.URL+"/v1/agents/agent-1/run_command", strings.NewReader(`{"command":["true"]}`))
		if header != "" {
			req.Header.Set("Authorization", header)
		}
		resp, err := f.api.Client().Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusUnauthorized || !strings.HasPrefix(resp.Header.Get("WWW-Authenticate"), "Bearer") {
			t.Errorf("%s: status %d, WWW-Authenticate %q", name, resp.StatusCode, resp.Header.Get("WWW-Authenticate"))
		}
	}
	if n := f.sup.count(); n != 0 {
		t.Errorf("unauthenticated calls reached the supervisor %d times", n)
	}

	// The scheme name is case-insensitive.
	req, _ := http.NewRequest(http.MethodPost, f.api.URL+"/v1/agents/agent-1/run_command", strings.NewReader(`{"command":["true"]}`))
	req.Header.Set("Authorization", "bearer "+adminToken)
	resp, err := f.api.Client().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Errorf("lower-case bearer: status %d", resp.StatusCode)
	}
}

func TestUnknownAgent(t *testing.T) {
	other := readySandbox("team-b", "secret-sandbox", "agent-2", "https://127.0.0.1:1")
	f := newFixture(t, "", other)
	_, err := f.client(t, adminToken).RunCommand(context.Background(), "agent-404", api.RunCommandRequest{Command: []string{"true"}})
	e := wantAPIError(t, err, api.CodeSandboxNotFound, http.StatusNotFound)
	for _, leak := range []string{"team-a", "sb-1", "agent-1", "team-b", "secret-sandbox", "agent-2"} {
		if strings.Contains(e.Message, leak) {
			t.Errorf("message %q reveals %q", e.Message, leak)
		}
	}
}

// An agent whose ID hashes like another's label (which the label alone
// cannot rule out) is still told apart by spec.agentID.
func TestLabelIsNotTrustedAlone(t *testing.T) {
	impostor := readySandbox("team-b", "impostor", "agent-1", "https://127.0.0.1:1")
	impostor.Spec.AgentID = "agent-9"
	f := newFixture(t, "")
	if err := f.kube.Create(context.Background(), impostor); err != nil {
		t.Fatal(err)
	}
	if _, err := f.client(t, adminToken).RunCommand(context.Background(), "agent-1", api.RunCommandRequest{Command: []string{"true"}}); err != nil {
		t.Fatal(err)
	}
	_, err := f.client(t, adminToken).RunCommand(context.Background(), "agent-9", api.RunCommandRequest{Command: []string{"true"}})
	wantAPIError(t, err, api.CodeSandboxNotFound, http.StatusNotFound)
}

func TestNotReady(t *testing.T) {
	pending := readySandbox("team-b", "sb-2", "agent-2", "")
	pending.Status.Phase = v1alpha1.SandboxPhasePending
	pending.Status.Conditions[0].Status = metav1.ConditionFalse
	pending.Status.Conditions[0].Reason = v1alpha1.ReasonCreating
	pending.Status.Conditions[0].Message = "pod not ready"
	f := newFixture(t, "", pending)
	_, err := f.client(t, adminToken).RunCommand(context.Background(), "agent-2", api.RunCommandRequest{Command: []string{"true"}})
	e := wantAPIError(t, err, api.CodeSandboxNotReady, http.StatusConflict)
	if e.Details["phase"] != "Pending" || e.Details["reason"] != v1alpha1.ReasonCreating ||
		!strings.Contains(e.Message, "Pending") || !strings.Contains(e.Message, "Creating") {
		t.Errorf("error = %+v", e)
	}
}

// A call on a stopped sandbox renews its Lease even within the renewal
// throttle (the wake-up signal), waits while the controller resumes it, and
// is served: the caller sees a slower call, not an error.
func TestStoppedSandboxIsWokenAndServed(t *testing.T) {
	f := newFixture(t, "")
	ctx := context.Background()
	c := f.client(t, adminToken)
	if _, err := c.RunCommand(ctx, "agent-1", api.RunCommandRequest{Command: []string{"true"}}); err != nil {
		t.Fatal(err)
	}
	key := client.ObjectKey{Namespace: "team-a", Name: "sb-1"}
	var sb v1alpha1.Sandbox
	if err := f.kube.Get(ctx, key, &sb); err != nil {
		t.Fatal(err)
	}
	running := *sb.Status.DeepCopy()
	sb.Status.Phase = v1alpha1.SandboxPhaseStopped
	sb.Status.Conditions[0].Status = metav1.ConditionFalse
	sb.Status.Conditions[0].Reason = v1alpha1.ReasonStopped
	sb.Status.ServiceEndpoint = ""
	if err := f.kube.Status().Update(ctx, &sb); err != nil {
		t.Fatal(err)
	}
	var before coordinationv1.Lease
	if err := f.kube.Get(ctx, key, &before); err != nil {
		t.Fatal(err)
	}
	// The fake clock has not moved since the first call's renewal, so
	// only the wake-up bypasses the throttle; move it a little anyway so
	// the renewal is visible as a new renewTime.
	f.clock.Step(time.Second)

	// The stand-in controller: it resumes the sandbox when the Lease moves.
	resumed := make(chan error, 1)
	go func() {
		deadline := time.Now().Add(2 * time.Second)
		for time.Now().Before(deadline) {
			var l coordinationv1.Lease
			if err := f.kube.Get(ctx, key, &l); err != nil {
				resumed <- err
				return
			}
			if l.Spec.RenewTime.After(before.Spec.RenewTime.Time) {
				var cur v1alpha1.Sandbox
				if err := f.kube.Get(ctx, key, &cur); err != nil {
					resumed <- err
					return
				}
				cur.Status = running
				resumed <- f.kube.Status().Update(ctx, &cur)
				return
			}
			time.Sleep(20 * time.Millisecond)
		}
		resumed <- errors.New("the call never renewed the stopped sandbox's Lease")
	}()
	res, err := c.RunCommand(ctx, "agent-1", api.RunCommandRequest{Command: []string{"true"}})
	if rerr := <-resumed; rerr != nil {
		t.Fatal(rerr)
	}
	if err != nil {
		t.Fatalf("call on a stopped sandbox: %v; want it served after the resume", err)
	}
	if res.ExitCode != 0 {
		t.Fatalf("result = %+v", res)
	}
}

func TestSupervisorWithWrongIdentityIsRefused(t *testing.T) {
	// The supervisor at sb-1's endpoint proves to be another sandbox, e.g.
	// because the pod IP was reused.
	f := newFixture(t, pki.SandboxID(testTrustDomain, "team-a", "sb-other").String())
	_, err := f.client(t, adminToken).RunCommand(context.Background(), "agent-1", api.RunCommandRequest{Command: []string{"true"}})
	e := wantAPIError(t, err, api.CodeSupervisorUnavailable, http.StatusBadGateway)
	if want := "want " + pki.SandboxID(testTrustDomain, "team-a", "sb-1").String(); !strings.Contains(e.Message, want) {
		t.Errorf("message %q does not say the identity check failed", e.Message)
	}
	if f.sup.count() != 0 {
		t.Error("the request reached a supervisor with the wrong identity")
	}
}

func TestLeaseRenewedAtMostEvery30s(t *testing.T) {
	f := newFixture(t, "")
	c := f.client(t, adminToken)
	run := func() {
		t.Helper()
		if _, err := c.RunCommand(context.Background(), "agent-1", api.RunCommandRequest{Command: []string{"true"}}); err != nil {
			t.Fatal(err)
		}
	}
	t0 := f.clock.Now()
	run()
	if got := f.leaseRenewTime(t); !got.Equal(t0) {
		t.Fatalf("renewTime = %s after the first call, want %s", got, t0)
	}
	f.clock.Step(10 * time.Second)
	run()
	if got := f.leaseRenewTime(t); !got.Equal(t0) {
		t.Errorf("renewTime = %s after a second call 10s later, want it unchanged at %s", got, t0)
	}
	if n := f.patches.Load(); n != 1 {
		t.Errorf("%d lease writes for two calls within 30s, want 1", n)
	}
	f.clock.Step(25 * time.Second)
	run()
	if got, want := f.leaseRenewTime(t), t0.Add(35*time.Second); !got.Equal(want) {
		t.Errorf("renewTime = %s after 35s, want %s", got, want)
	}
	if n := f.patches.Load(); n != 2 {
		t.Errorf("%d lease writes, want 2", n)
	}
	var sb v1alpha1.Sandbox
	if err := f.kube.Get(context.Background(), types.NamespacedName{Namespace: "team-a", Name: "sb-1"}, &sb); err != nil {
		t.Fatal(err)
	}
	if sb.Generation > 1 {
		t.Errorf("the sandbox's spec was written (generation %d)", sb.Generation)
	}
}

func TestMissingLeaseDoesNotFailTheCall(t *testing.T) {
	f := newFixture(t, "")
	if err := f.kube.Delete(context.Background(), lease("team-a", "sb-1", time.Time{})); err != nil {
		t.Fatal(err)
	}
	if _, err := f.client(t, adminToken).RunCommand(context.Background(), "agent-1", api.RunCommandRequest{Command: []string{"true"}}); err != nil {
		t.Fatal(err)
	}
	// A failed renewal is not remembered as done: the next call tries again.
	if _, err := f.client(t, adminToken).RunCommand(context.Background(), "agent-1", api.RunCommandRequest{Command: []string{"true"}}); err != nil {
		t.Fatal(err)
	}
	if n := f.patches.Load(); n != 2 {
		t.Errorf("%d lease writes, want 2", n)
	}
}

func TestSupervisorConnectionsAreReused(t *testing.T) {
	f := newFixture(t, "")
	c := f.client(t, adminToken)
	for range 3 {
		if _, err := c.RunCommand(context.Background(), "agent-1", api.RunCommandRequest{Command: []string{"true"}}); err != nil {
			t.Fatal(err)
		}
	}
	if n := f.sup.handshakes.Load(); n != 1 {
		t.Errorf("%d TLS handshakes with the supervisor for three calls, want 1", n)
	}
}

func TestBadRequests(t *testing.T) {
	f := newFixture(t, "")
	for name, tc := range map[string]struct {
		method, path, body string
		status             int
		code               api.Code
	}{
		"empty command":    {"POST", "/v1/agents/agent-1/run_command", `{"command":[]}`, 400, api.CodeInvalidArgument},
		"unknown field":    {"POST", "/v1/agents/agent-1/run_command", `{"command":["true"],"timeout":5}`, 400, api.CodeInvalidArgument},
		"negative timeout": {"POST", "/v1/agents/agent-1/run_command", `{"command":["true"],"timeout_seconds":-1}`, 400, api.CodeInvalidArgument},
		"not json":         {"POST", "/v1/agents/agent-1/run_command", `command=true`, 400, api.CodeInvalidArgument},
		"empty body":       {"POST", "/v1/agents/agent-1/run_command", ``, 400, api.CodeInvalidArgument},
		"wrong method":     {"GET", "/v1/agents/agent-1/run_command", ``, 405, api.CodeMethodNotAllowed},
		"unknown path":     {"POST", "/v1/agents/agent-1/launch_rockets", `{}`, 404, api.CodeNotFound},
	} {
		req, _ := http.NewRequest(tc.method, f.api.URL+tc.path, strings.NewReader(tc.body))
		req.Header.Set("Authorization", "Bearer "+adminToken)
		resp, err := f.api.Client().Do(req)
		if err != nil {
			t.Fatal(err)
		}
		var body api.ErrorBody
		err = json.NewDecoder(resp.Body).Decode(&body)
		resp.Body.Close()
		if err != nil || body.Error == nil {
			t.Errorf("%s: status %d, undecodable error body: %v", name, resp.StatusCode, err)
			continue
		}
		if resp.StatusCode != tc.status || body.Error.Code != tc.code {
			t.Errorf("%s: status %d code %s (%s), want %d %s", name, resp.StatusCode, body.Error.Code, body.Error.Message, tc.status, tc.code)
		}
	}
}

func TestSupervisorErrorsAreMapped(t *testing.T) {
	f := newFixture(t, "")
	c := f.client(t, adminToken)
	for _, tc := range []struct {
		code   supervisorapi.Code
		want   api.Code
		status int
	}{
		{supervisorapi.CodeNotFound, api.CodeInvalidArgument, 400},
		{supervisorapi.CodeInvalidArgument, api.CodeInvalidArgument, 400},
		{supervisorapi.CodeResourceExhausted, api.CodeResourceExhausted, 429},
		{supervisorapi.CodeInternal, api.CodeSupervisorUnavailable, 502},
		{supervisorapi.CodeTimeout, api.CodeTimeout, 504},
	} {
		f.sup.mu.Lock()
		f.sup.reply = func(w http.ResponseWriter, _ supervisorapi.CommandRequest) {
			e := supervisorapi.Errorf(tc.code, "supervisor says %s", tc.code)
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(e.Status)
			_ = json.NewEncoder(w).Encode(supervisorapi.ErrorBody{Error: e})
		}
		f.sup.mu.Unlock()
		_, err := c.RunCommand(context.Background(), "agent-1", api.RunCommandRequest{Command: []string{"x"}})
		e := wantAPIError(t, err, tc.want, tc.status)
		if !strings.Contains(e.Message, "supervisor says") {
			t.Errorf("%s: message %q lost the supervisor's", tc.code, e.Message)
		}
	}
}

// agentToken is the shape of the per-agent tokens to come: it may act on
// one agent only.
type agentToken struct{}

func (agentToken) Authenticate(_ context.Context, token string) (*Principal, error) {
	if id, ok := strings.CutPrefix(token, "agent-token:"); ok {
		return &Principal{Name: "agent " + id, AgentID: id}, nil
	}
	return nil, ErrInvalidToken
}

func TestAgentMayNotReachAnotherAgentsSandbox(t *testing.T) {
	f := newFixture(t, "", readySandbox("team-b", "sb-2", "agent-2", "https://127.0.0.1:1"))
	srv, err := NewServer(Options{Sandboxes: f.kube, Leases: f.kube, Authenticator: agentToken{},
		Supervisors: f.services.supervisors, Clock: f.clock})
	if err != nil {
		t.Fatal(err)
	}
	ts := httptest.NewTLSServer(srv.Handler())
	defer ts.Close()
	caPEM := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: ts.Certificate().Raw})
	c, err := api.New(ts.URL, "agent-token:agent-2", caPEM)
	if err != nil {
		t.Fatal(err)
	}
	defer c.CloseIdleConnections()
	for _, agent := range []string{"agent-1", "agent-404"} {
		_, err = c.RunCommand(context.Background(), agent, api.RunCommandRequest{Command: []string{"true"}})
		// The same answer whether or not the other agent has a sandbox.
		wantAPIError(t, err, api.CodePermissionDenied, http.StatusForbidden)
	}
}

func TestNewAdminTokenAuthenticatorRefusesZeroHash(t *testing.T) {
	if _, err := NewAdminTokenAuthenticator(TokenHash{}); err == nil {
		t.Error("accepted a zero hash")
	}
}
