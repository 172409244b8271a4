package computeapi

import (
	"context"
	"encoding/pem"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	api "github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
)

// These tests run deploy_or_resume and the pool lease's waits against the
// fake cluster, with a stand-in for the controller where a sandbox must
// come up; the cluster tests in internal/controller run them for real.

// staffToken authenticates "staff-token", a principal that may address no
// agent.
type staffToken struct{}

func (staffToken) Authenticate(_ context.Context, token string) (*Principal, error) {
	if token == "staff-token" {
		return &Principal{Name: "staff:s", Kind: "staff", Subject: "s"}, nil
	}
	return nil, ErrInvalidToken
}

// deployAPI serves the fixture's cluster with defaultTemplate, to the admin
// token, "agent-token:<agent>" tokens and "staff-token".
func deployAPI(t *testing.T, f *fixture, defaultTemplate types.NamespacedName) func(token string) *api.Client {
	t.Helper()
	return apiWith(t, f, func(o *Options) { o.DefaultTemplate = defaultTemplate })
}

// apiWith serves a second Compute API on f's cluster, with the admin,
// agent and staff tokens and the options that set changes, and returns
// its clients by token.
func apiWith(t *testing.T, f *fixture, set func(*Options)) func(token string) *api.Client {
	t.Helper()
	admin, err := NewAdminTokenAuthenticator(HashToken(adminToken))
	if err != nil {
		t.Fatal(err)
	}
	opts := Options{Sandboxes: f.kube, Leases: f.kube, Supervisors: f.services.supervisors, Clock: f.clock,
		Authenticator: ChainAuthenticators(admin, agentToken{}, staffToken{}), TrustDomain: testTrustDomain,
		ResumeTimeout: 2 * time.Second}
	set(&opts)
	srv, err := NewServer(opts)
	if err != nil {
		t.Fatal(err)
	}
	ts := httptest.NewTLSServer(contractCheck(t, srv.Handler()))
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

func template(ns, name string) *v1alpha1.SandboxTemplate {
	return &v1alpha1.SandboxTemplate{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name}}
}

// standIn does what the API server and the controller would for every
// sandbox that has no status yet: gives it a UID and a Lease and reports it
// Running and Ready.
func standIn(t *testing.T, f *fixture) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		for ctx.Err() == nil {
			var list v1alpha1.SandboxList
			_ = f.kube.List(ctx, &list)
			for i := range list.Items {
				sb := &list.Items[i]
				if sb.Status.Phase != "" {
					continue
				}
				if sb.UID == "" {
					// The fake API server gives objects none.
					sb.UID = types.UID("uid-" + sb.Name)
					if f.kube.Update(ctx, sb) != nil {
						continue
					}
				}
				_ = f.kube.Create(ctx, lease(sb.Namespace, sb.Name, f.clock.Now()))
				sb.Status = readySandbox(sb.Namespace, sb.Name, sb.Spec.AgentID, "https://127.0.0.1:1").Status
				_ = f.kube.Status().Update(ctx, sb)
			}
			time.Sleep(20 * time.Millisecond)
		}
	}()
	t.Cleanup(func() { cancel(); <-done })
}

func (f *fixture) sandboxesOf(t *testing.T, agentID string) []v1alpha1.Sandbox {
	t.Helper()
	var list v1alpha1.SandboxList
	if err := f.kube.List(context.Background(), &list, client.MatchingLabels{v1alpha1.LabelAgentIDHash: v1alpha1.AgentIDHash(agentID)}); err != nil {
		t.Fatal(err)
	}
	return list.Items
}

func TestDeployOrResumeCreates(t *testing.T) {
	f := newFixture(t, "", template("team-a", "python"))
	clients := deployAPI(t, f, types.NamespacedName{Namespace: "team-a", Name: "python"})
	standIn(t, f)
	ctx := context.Background()
	const agent = "Agent:New@example.com"
	c := clients("agent-token:" + agent)

	st, err := c.DeployOrResume(ctx, agent, api.DeployRequest{RequestID: "r1"})
	if err != nil {
		t.Fatal(err)
	}
	name := agentSandboxName(agent)
	if !strings.HasPrefix(name, "agent-new-example-com-") || len(name) != len("agent-new-example-com-")+16 {
		t.Errorf("sandbox name %q", name)
	}
	if st.Name != name || st.Namespace != "team-a" || st.AgentID != agent || !st.Ready || st.Phase != "Running" || !st.Created {
		t.Fatalf("deploy_or_resume of a new agent = %+v", st)
	}
	sbs := f.sandboxesOf(t, agent)
	if len(sbs) != 1 {
		t.Fatalf("%d sandboxes for the agent", len(sbs))
	}
	if sb := sbs[0]; sb.Spec.AgentID != agent || sb.Spec.TemplateRef.Name != "python" || sb.Annotations[v1alpha1.AnnotationCreatedByRequest] != "r1" {
		t.Errorf("created sandbox: spec %+v, annotations %v", sb.Spec, sb.Annotations)
	}

	// A retry of the create is told so; another call is not.
	again, err := c.DeployOrResume(ctx, agent, api.DeployRequest{RequestID: "r1"})
	if err != nil || again.Name != name || !again.Created {
		t.Errorf("retry with the same request ID = %+v, %v", again, err)
	}
	other, err := c.DeployOrResume(ctx, agent, api.DeployRequest{RequestID: "r2"})
	if err != nil || other.Name != name || other.Created {
		t.Errorf("a later call = %+v, %v", other, err)
	}
	// The default template, named, is the agent's to use.
	named, err := c.DeployOrResume(ctx, agent, api.DeployRequest{Template: "team-a/python"})
	if err != nil || named.Name != name {
		t.Errorf("naming the default template = %+v, %v", named, err)
	}
	if n := len(f.sandboxesOf(t, agent)); n != 1 {
		t.Errorf("%d sandboxes after four calls", n)
	}

	// Concurrent first calls make one sandbox.
	const racer = "racer"
	var wg sync.WaitGroup
	names := make([]string, 4)
	for i := range names {
		wg.Add(1)
		go func() {
			defer wg.Done()
			st, err := clients(adminToken).DeployOrResume(ctx, racer, api.DeployRequest{})
			if err != nil {
				t.Errorf("concurrent call %d: %v", i, err)
				return
			}
			names[i] = st.Name
		}()
	}
	wg.Wait()
	for _, n := range names {
		if n != agentSandboxName(racer) {
			t.Errorf("concurrent calls answered %v", names)
			break
		}
	}
	if n := len(f.sandboxesOf(t, racer)); n != 1 {
		t.Errorf("%d sandboxes after concurrent calls", n)
	}
}

func TestDeployOrResumeRefusals(t *testing.T) {
	f := newFixture(t, "", template("team-a", "python"), template("team-b", "gpu"))
	clients := deployAPI(t, f, types.NamespacedName{Namespace: "team-a", Name: "python"})
	ctx := context.Background()
	for _, tc := range []struct {
		name, token, agent string
		req                api.DeployRequest
		code               api.Code
		status             int
	}{
		{"another agent's token", "agent-token:agent-2", "agent-new", api.DeployRequest{}, api.CodePermissionDenied, http.StatusForbidden},
		{"a staff token", "staff-token", "agent-new", api.DeployRequest{}, api.CodePermissionDenied, http.StatusForbidden},
		{"agent token, other template", "agent-token:agent-new", "agent-new", api.DeployRequest{Template: "team-b/gpu"}, api.CodePermissionDenied, http.StatusForbidden},
		// Refused even where the agent has a sandbox, which the template
		// would not be used for: the answer must not tell.
		{"agent token, other template, existing sandbox", "agent-token:agent-1", "agent-1", api.DeployRequest{Template: "team-b/gpu"}, api.CodePermissionDenied, http.StatusForbidden},
		{"template without namespace", adminToken, "agent-new", api.DeployRequest{Template: "python"}, api.CodeInvalidArgument, http.StatusBadRequest},
		{"template that does not exist", adminToken, "agent-new", api.DeployRequest{Template: "team-b/nope"}, api.CodeInvalidArgument, http.StatusBadRequest},
	} {
		_, err := clients(tc.token).DeployOrResume(ctx, tc.agent, tc.req)
		e := wantAPIError(t, err, tc.code, tc.status)
		t.Logf("%s: %s", tc.name, e.Message)
	}
	if n := len(f.sandboxesOf(t, "agent-new")); n != 0 {
		t.Errorf("refused calls made %d sandboxes", n)
	}

	// Without a default template, only a call naming one can create.
	noDefault := deployAPI(t, f, types.NamespacedName{})
	_, err := noDefault("agent-token:agent-new").DeployOrResume(ctx, "agent-new", api.DeployRequest{})
	e := wantAPIError(t, err, api.CodeSandboxNotFound, http.StatusNotFound)
	if !strings.Contains(e.Message, "template") {
		t.Errorf("sandbox_not_found does not say how to create one: %s", e.Message)
	}
	_, err = noDefault("agent-token:agent-new").DeployOrResume(ctx, "agent-new", api.DeployRequest{Template: "team-a/python"})
	wantAPIError(t, err, api.CodePermissionDenied, http.StatusForbidden)

	// An admin may name any template. Nothing brings the sandbox up here,
	// so the call answers sandbox_not_ready after the resume timeout; the
	// sandbox stays, in the template's namespace.
	_, err = noDefault(adminToken).DeployOrResume(ctx, "agent-new", api.DeployRequest{Template: "team-b/gpu", RequestID: "r"})
	e = wantAPIError(t, err, api.CodeSandboxNotReady, http.StatusConflict)
	if !strings.Contains(e.Message, "retry") {
		t.Errorf("sandbox_not_ready after the wait: %s", e.Message)
	}
	if sbs := f.sandboxesOf(t, "agent-new"); len(sbs) != 1 || sbs[0].Namespace != "team-b" || sbs[0].Spec.TemplateRef.Name != "gpu" {
		t.Errorf("sandboxes after the admin's create: %+v", sbs)
	}
}

// TestDuplicateSandboxesServeTheOlder: an agent with two live sandboxes
// (one made by kubectl beside the other) is served from the older, which
// the controller lets keep the agent; it is never an internal error.
func TestDuplicateSandboxesServeTheOlder(t *testing.T) {
	now := time.Now()
	older := readySandbox("team-z", "first", "agent-dup", "https://127.0.0.1:1")
	older.CreationTimestamp = metav1.NewTime(now.Add(-time.Hour))
	newer := readySandbox("team-0", "second", "agent-dup", "https://127.0.0.1:1")
	newer.CreationTimestamp = metav1.NewTime(now.Add(time.Hour))
	// Same second as the older: the namespace, then the name decide.
	tie := readySandbox("team-z", "a-tie", "agent-dup", "https://127.0.0.1:1")
	tie.CreationTimestamp = older.CreationTimestamp
	f := newFixture(t, "", older, newer)
	c := f.client(t, adminToken)
	st, err := c.Status(context.Background(), "agent-dup")
	if err != nil || st.Namespace != "team-z" || st.Name != "first" {
		t.Fatalf("status of an agent with two sandboxes = %+v, %v; want team-z/first", st, err)
	}
	if err := f.kube.Create(context.Background(), tie); err != nil {
		t.Fatal(err)
	}
	st, err = c.Status(context.Background(), "agent-dup")
	if err != nil || st.Name != "a-tie" {
		t.Fatalf("status with a tie = %+v, %v; want team-z/a-tie", st, err)
	}
}

// TestAgentsAreThePlatformsOwn: on a cluster that two platforms share, the
// Compute API serves only the sandboxes in its platform's namespaces. An
// older sandbox of the same agent ID elsewhere is the other platform's and
// does not take the agent over; an agent found only elsewhere is answered
// NamespaceNotServed.
func TestAgentsAreThePlatformsOwn(t *testing.T) {
	now := time.Now()
	theirs := readySandbox("team-z", "theirs", "agent-dup", "https://127.0.0.1:1")
	theirs.CreationTimestamp = metav1.NewTime(now.Add(-time.Hour))
	ours := readySandbox("team-a", "ours", "agent-dup", "https://127.0.0.1:1")
	ours.CreationTimestamp = metav1.NewTime(now)
	far := readySandbox("team-z", "far", "agent-far", "https://127.0.0.1:1")
	f := newFixture(t, "", theirs, ours, far)
	c := apiWith(t, f, func(o *Options) { o.Serves = func(ns string) bool { return ns == "team-a" } })(adminToken)
	st, err := c.Status(context.Background(), "agent-dup")
	if err != nil || st.Namespace != "team-a" || st.Name != "ours" {
		t.Fatalf("status of an agent with an older sandbox on another platform = %+v, %v; want team-a/ours", st, err)
	}
	_, err = c.Status(context.Background(), "agent-far")
	e := wantAPIError(t, err, api.CodeSandboxNotReady, http.StatusConflict)
	if e.Details["reason"] != v1alpha1.ReasonNamespaceNotServed || !strings.Contains(e.Message, `"team-z"`) {
		t.Errorf("an agent only in a namespace not served: %s %v; want reason %s naming team-z", e.Message, e.Details, v1alpha1.ReasonNamespaceNotServed)
	}
	// Serving every namespace, the older one keeps the agent.
	st, err = f.client(t, adminToken).Status(context.Background(), "agent-dup")
	if err != nil || st.Name != "theirs" {
		t.Errorf("status serving every namespace = %+v, %v; want team-z/theirs", st, err)
	}
}

func TestAgentSandboxName(t *testing.T) {
	for id, prefix := range map[string]string{
		"alice":                           "alice-",
		"Alice@Example.COM":               "alice-example-com-",
		"...":                             "agent-",
		"a:b::c":                          "a-b-c-",
		strings.Repeat("x", 200):          strings.Repeat("x", 30) + "-",
		"0123456789012345678901234567890": "012345678901234567890123456789-",
	} {
		name := agentSandboxName(id)
		if !strings.HasPrefix(name, prefix) || len(name) != len(prefix)+16 || len(name) > 47 {
			t.Errorf("agentSandboxName(%q) = %q, want %q and 16 hex digits", id, name, prefix)
		}
	}
	if agentSandboxName("Alice") == agentSandboxName("alice") {
		t.Error("agent IDs that differ in case get one name")
	}
}
