package controller

import (
	"bytes"
	"context"
	"encoding/json"
	"encoding/pem"
	"errors"
	"fmt"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	"github.com/agentbox/terraform-provider-agentbox/internal/computeapi"
	apiclient "github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
	"github.com/agentbox/terraform-provider-agentbox/internal/store"
)

// Behaviours that used to stop halfway, on real gVisor sandboxes through
// the real Compute API and controllers: deploy_or_resume for an agent
// without a sandbox creates one, a second sandbox of an agent is refused,
// and a drained warm pool makes a lease wait for the refill or starts a
// sandbox for it.

const createTestToken = "create-test-admin-token"

// computeAPIWithOptions is computeAPIWithStore with configure applied to
// the API's options.
func (e *clusterEnv) computeAPIWithOptions(pool *computeapi.SupervisorPool, st *store.Store, configure func(*computeapi.Options)) *apiclient.Client {
	e.t.Helper()
	admin, err := computeapi.NewAdminTokenAuthenticator(computeapi.HashToken(createTestToken))
	must(e.t, err)
	opts := computeapi.Options{
		Sandboxes: e.r.Client, Leases: e.c, Supervisors: pool, TrustDomain: testTrustDomain,
		Authenticator: computeapi.ChainAuthenticators(admin, computeapi.NewStoreAuthenticator(st)),
		ResumeTimeout: waitTimeout, Store: st, FilespacePushDelay: -1,
	}
	if configure != nil {
		configure(&opts)
	}
	srv, err := computeapi.NewServer(opts)
	must(e.t, err)
	hs := httptest.NewTLSServer(srv.Handler())
	e.t.Cleanup(func() {
		hs.Close()
		srv.Close()
	})
	e.apiCAPEM = pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: hs.Certificate().Raw})
	return e.apiClient(hs.URL, createTestToken)
}

// apiEnv is a cluster environment with a store and the supervisor pool,
// a template "tpl" of the real sandbox image, and the Compute API with
// that template as its default.
func apiEnv(t *testing.T) (*clusterEnv, *store.Store, *apiclient.Client) {
	t.Helper()
	image := os.Getenv(EnvSandboxImage)
	if image == "" {
		t.Skipf("%s is not set: the sandboxes must serve commands", EnvSandboxImage)
	}
	st, err := store.Open(context.Background(), filepath.Join(t.TempDir(), "agentbox.db"), store.Options{})
	must(t, err)
	t.Cleanup(func() { st.Close() })
	var supervisors *computeapi.SupervisorPool
	e := newClusterEnv(t, withSnapshots(t, nil, &supervisors), func(r *SandboxReconciler) { r.WarmTakes = st })
	e.template("tpl", func(tpl *v1alpha1.SandboxTemplate) {
		tpl.Spec.Image = image
		tpl.Spec.IdleTimeout = metav1.Duration{Duration: time.Hour}
	})
	api := e.computeAPIWithOptions(supervisors, st, func(o *computeapi.Options) {
		o.DefaultTemplate = types.NamespacedName{Namespace: e.ns, Name: "tpl"}
	})
	return e, st, api
}

// agentSandboxes lists the live Sandboxes of agent in the test's namespace.
func (e *clusterEnv) agentSandboxes(agent string) []v1alpha1.Sandbox {
	e.t.Helper()
	var list v1alpha1.SandboxList
	must(e.t, e.c.List(e.ctx, &list, client.InNamespace(e.ns)))
	var out []v1alpha1.Sandbox
	for _, s := range list.Items {
		if s.Spec.AgentID == agent && s.DeletionTimestamp.IsZero() {
			out = append(out, s)
		}
	}
	return out
}

// TestDeployOrResumeCreatesOnCluster: an agent without a sandbox gets one
// from its own token's deploy_or_resume, made from the platform's default
// template, and runs a command in it; a retry with the request ID is the
// same sandbox, created for it; two first calls at once make one sandbox;
// tokens that may not create are refused.
func TestDeployOrResumeCreatesOnCluster(t *testing.T) {
	t.Parallel()
	e, _, admin := apiEnv(t)
	ctx := e.ctx
	// Unique to the namespace: the API looks agents up in all of them.
	agent := "agent:deploy@" + e.ns + ".example.com"
	tok, err := admin.CreateToken(ctx, apiclient.CreateTokenRequest{Kind: apiclient.TokenKindAgent, AgentID: agent})
	must(t, err)
	own, other := agentClients(e, admin, agent)

	// The first call through the CLI, with the agent's own token.
	cli := goBuild(t, "../cmd/agentbox", "agentbox")
	start := time.Now()
	st := cliJSON[apiclient.SandboxStatus](t, e.cliEnv(admin.Endpoint(), tok.Token), cli, "deploy", "--request-id", "create-1", "--json", agent)
	t.Logf("agentbox deploy created %s/%s and answered ready in %s", st.Namespace, st.Name, time.Since(start).Round(time.Millisecond))
	if !st.Created || !st.Ready || st.Phase != string(v1alpha1.SandboxPhaseRunning) || st.Namespace != e.ns || st.AgentID != agent {
		t.Fatalf("deploy_or_resume = %+v", st)
	}
	sbs := e.agentSandboxes(agent)
	if len(sbs) != 1 || sbs[0].Name != st.Name || sbs[0].Spec.TemplateRef.Name != "tpl" {
		t.Fatalf("sandboxes of the agent: %+v", sbs)
	}
	// The pod's hostname is its name, the sandbox's.
	res, err := own.RunCommand(ctx, agent, apiclient.RunCommandRequest{Command: []string{"cat", "/etc/hostname"}})
	if err != nil || res.ExitCode != 0 || res.Stdout != st.Name+"\n" {
		t.Fatalf("run_command in the created sandbox: %+v, %v", res, err)
	}

	again, err := own.DeployOrResume(ctx, agent, apiclient.DeployRequest{RequestID: "create-1"})
	if err != nil || again.Name != st.Name || !again.Created {
		t.Errorf("retry with the same request ID: %+v, %v", again, err)
	}
	later, err := own.DeployOrResume(ctx, agent, apiclient.DeployRequest{RequestID: "create-2"})
	if err != nil || later.Name != st.Name || later.Created {
		t.Errorf("a later call: %+v, %v", later, err)
	}
	if n := len(e.agentSandboxes(agent)); n != 1 {
		t.Errorf("%d sandboxes after three calls", n)
	}

	// Refusals: another agent's token, and the agent's own naming a
	// template other than the default.
	e.template("other", nil)
	_, err = other.DeployOrResume(ctx, agent, apiclient.DeployRequest{})
	if apiclient.CodeOf(err) != apiclient.CodePermissionDenied {
		t.Errorf("another agent's token: %v, want permission_denied", err)
	}
	_, err = own.DeployOrResume(ctx, agent+".2", apiclient.DeployRequest{})
	if apiclient.CodeOf(err) != apiclient.CodePermissionDenied {
		t.Errorf("the token of %s for another agent: %v, want permission_denied", agent, err)
	}
	_, err = own.DeployOrResume(ctx, agent, apiclient.DeployRequest{Template: e.ns + "/other"})
	if apiclient.CodeOf(err) != apiclient.CodePermissionDenied {
		t.Errorf("the agent's token naming another template: %v, want permission_denied", err)
	}

	// Two first calls at once, with their own request IDs: one sandbox,
	// created for exactly one of them.
	racer := "agent:racer@" + e.ns + ".example.com"
	var wg sync.WaitGroup
	answers := make([]*apiclient.SandboxStatus, 2)
	for i := range answers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			st, err := admin.DeployOrResume(ctx, racer, apiclient.DeployRequest{RequestID: fmt.Sprintf("race-%d", i)})
			if err != nil {
				t.Errorf("concurrent deploy_or_resume %d: %v", i, err)
				return
			}
			answers[i] = st
		}()
	}
	wg.Wait()
	if t.Failed() {
		return
	}
	if answers[0].Name != answers[1].Name || answers[0].Created == answers[1].Created {
		t.Errorf("concurrent calls: %+v and %+v; want one sandbox, created for one of them", answers[0], answers[1])
	}
	if sbs := e.agentSandboxes(racer); len(sbs) != 1 {
		t.Errorf("%d sandboxes after concurrent calls", len(sbs))
	}
}

// TestDuplicateAgentOnCluster: a second Sandbox for an agent, made with
// the Kubernetes API as kubectl would, is refused with DuplicateAgent (a
// condition, an event, no pod) while the Compute API keeps serving the
// agent's sandbox; once that one is deleted, the second starts by itself
// and the API serves it.
func TestDuplicateAgentOnCluster(t *testing.T) {
	t.Parallel()
	e, _, api, first := apiSandbox(t, "dup", nil)
	agent := first.Spec.AgentID
	twin := &v1alpha1.Sandbox{
		ObjectMeta: metav1.ObjectMeta{Name: "dup-twin", Namespace: e.ns},
		Spec:       v1alpha1.SandboxSpec{AgentID: agent, TemplateRef: v1alpha1.LocalObjectReference{Name: "tpl"}},
	}
	must(t, e.c.Create(e.ctx, twin))
	refused := e.waitReason("dup-twin", v1alpha1.ReasonDuplicateAgent)
	if refused.Status.Phase != v1alpha1.SandboxPhaseError || refused.Status.PodName != "" {
		t.Errorf("the twin: phase %s, pod %q", refused.Status.Phase, refused.Status.PodName)
	}
	e.checkEvent(twin, EventDuplicateAgent)
	if err := e.get(PodName("dup-twin"), &corev1.Pod{}); err == nil {
		t.Error("the twin has a pod")
	}
	st, err := api.Status(e.ctx, agent)
	if err != nil || st.Name != "dup" {
		t.Fatalf("status with a twin: %+v, %v; want dup", st, err)
	}
	res, err := api.RunCommand(e.ctx, agent, apiclient.RunCommandRequest{Command: []string{"cat", "/etc/hostname"}})
	if err != nil || res.Stdout != "dup\n" {
		t.Fatalf("run_command with a twin: %+v, %v", res, err)
	}
	// Still refused a while later: the refusal is not a passing state.
	var again v1alpha1.Sandbox
	must(t, e.get("dup-twin", &again))
	if readyReason(&again) != v1alpha1.ReasonDuplicateAgent {
		t.Errorf("the twin moved on to %s while dup exists", readyReason(&again))
	}

	must(t, e.c.Delete(e.ctx, first))
	e.waitPhase("dup-twin", v1alpha1.SandboxPhaseRunning, v1alpha1.ReasonRunning)
	res, err = api.RunCommand(e.ctx, agent, apiclient.RunCommandRequest{Command: []string{"cat", "/etc/hostname"}})
	if err != nil || res.Stdout != "dup-twin\n" {
		t.Fatalf("run_command after dup was deleted: %+v, %v", res, err)
	}
}

// TestPoolLeaseWaitsAndColdStartsOnCluster: a pool of one, leased out; a
// second lease with wait_seconds gets the sandbox the pool refills with.
// Then, with coldStartWhenExhausted and nothing warm, a lease gets a
// sandbox started for it, which runs a command and is deleted on release.
func TestPoolLeaseWaitsAndColdStartsOnCluster(t *testing.T) {
	t.Parallel()
	e, _, api := apiEnv(t)
	ctx := e.ctx
	must(t, e.c.Create(ctx, &v1alpha1.SandboxWarmPool{
		ObjectMeta: metav1.ObjectMeta{Name: "pool", Namespace: e.ns},
		Spec:       v1alpha1.SandboxWarmPoolSpec{TemplateRef: v1alpha1.LocalObjectReference{Name: "tpl"}, Replicas: 1},
	}))
	e.waitPoolFull("pool", 1)

	a, err := api.AcquirePoolLease(ctx, e.ns, "pool", apiclient.AcquireLeaseRequest{Holder: "run-a", RequestID: "req-a", TTLSeconds: 900})
	must(t, err)
	// The pool is drained: without a wait, refused at once.
	_, err = api.AcquirePoolLease(ctx, e.ns, "pool", apiclient.AcquireLeaseRequest{Holder: "run-x", RequestID: "req-x"})
	if !errors.Is(err, &apiclient.Error{Code: apiclient.CodePoolExhausted}) {
		t.Fatalf("a lease of the drained pool without a wait: %v", err)
	}
	start := time.Now()
	b, err := api.AcquirePoolLease(ctx, e.ns, "pool", apiclient.AcquireLeaseRequest{Holder: "run-b", RequestID: "req-b",
		TTLSeconds: 900, WaitSeconds: apiclient.MaxPoolLeaseWaitSeconds})
	if err != nil {
		t.Fatalf("a lease waiting for the refill: %v", err)
	}
	t.Logf("the waiting lease got %s %s after asking", b.Sandbox, time.Since(start).Round(time.Millisecond))
	var refill v1alpha1.Sandbox
	must(t, e.get(b.Sandbox, &refill))
	if b.Sandbox == a.Sandbox || refill.Annotations[v1alpha1.AnnotationPoolColdStart] != "" || !refill.CreationTimestamp.After(start.Add(-time.Minute)) {
		t.Fatalf("the waiting lease got %s (annotations %v, created %s); want the pool's refill after %s", b.Sandbox,
			refill.Annotations, refill.CreationTimestamp, a.Sandbox)
	}
	if out := e.runVia(api, b.AgentID, "echo refilled"); out != "refilled\n" {
		t.Errorf("run in the refilled sandbox printed %q", out)
	}
	for _, l := range []*apiclient.PoolLease{a, b} {
		must(t, api.ReleaseLease(ctx, l.AgentID, apiclient.ReleaseLeaseRequest{Holder: l.Holder, LeaseID: l.LeaseID}))
	}

	// Cold starts: no warm sandbox at all, so the lease must start one.
	// A merge patch, as kubectl or Terraform would: the pool's controller
	// writes its status meanwhile, which an update of a copy read before
	// would conflict with.
	var pool v1alpha1.SandboxWarmPool
	must(t, e.get("pool", &pool))
	base := pool.DeepCopy()
	pool.Spec.Replicas, pool.Spec.ColdStartWhenExhausted = 0, true
	must(t, e.c.Patch(ctx, &pool, client.MergeFrom(base)))
	e.eventually("the pool to empty", func() error {
		var list v1alpha1.SandboxList
		if err := e.c.List(ctx, &list, client.InNamespace(e.ns), client.MatchingLabels{v1alpha1.LabelWarmPool: "pool"}); err != nil {
			return err
		}
		if len(list.Items) != 0 {
			return fmt.Errorf("%d sandboxes left", len(list.Items))
		}
		return nil
	})
	// Through the CLI, whose --wait is wait_seconds.
	cli := goBuild(t, "../cmd/agentbox", "agentbox")
	start = time.Now()
	c := cliJSON[apiclient.PoolLease](t, e.cliEnv(api.Endpoint(), createTestToken), cli, "leases", "acquire-pool",
		"--holder", "run-c", "--request-id", "req-c", "--ttl", "15m", "--wait", "5m", "--json", e.ns, "pool")
	t.Logf("the cold-starting lease got %s %s after asking", c.Sandbox, time.Since(start).Round(time.Millisecond))
	req := apiclient.AcquireLeaseRequest{Holder: "run-c", RequestID: "req-c", TTLSeconds: 900, WaitSeconds: apiclient.MaxPoolLeaseWaitSeconds}
	var cold v1alpha1.Sandbox
	must(t, e.get(c.Sandbox, &cold))
	if cold.Annotations[v1alpha1.AnnotationPoolColdStart] != "true" || !strings.Contains(c.Sandbox, "-cold-") || !cold.Spec.Ephemeral {
		t.Fatalf("the cold-started sandbox %s: annotations %v, spec %+v", c.Sandbox, cold.Annotations, cold.Spec)
	}
	again, err := api.AcquirePoolLease(ctx, e.ns, "pool", req)
	if err != nil || again.LeaseID != c.LeaseID || again.Sandbox != c.Sandbox {
		t.Errorf("a retry of the cold-starting lease: %+v, %v; want %+v", again, err, c)
	}
	if out := e.runVia(api, c.AgentID, "echo cold > /workspace/f && cat /workspace/f"); out != "cold\n" {
		t.Errorf("run in the cold-started sandbox printed %q", out)
	}
	e.eventually("the pool to count the cold start as leased", func() error {
		must(t, e.get("pool", &pool))
		if pool.Status.LeasedReplicas != 1 || pool.Status.Replicas != 0 {
			return fmt.Errorf("replicas %d, leased %d", pool.Status.Replicas, pool.Status.LeasedReplicas)
		}
		return nil
	})
	must(t, api.ReleaseLease(ctx, c.AgentID, apiclient.ReleaseLeaseRequest{Holder: c.Holder, LeaseID: c.LeaseID}))
	e.gone(&v1alpha1.Sandbox{}, c.Sandbox)
}

// cliJSON runs the agentbox CLI with env and decodes what it prints.
func cliJSON[T any](t *testing.T, env []string, cli string, args ...string) *T {
	t.Helper()
	cmd := exec.CommandContext(t.Context(), cli, args...)
	cmd.Env = env
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		t.Fatalf("agentbox %s: %v\nstderr %s", strings.Join(args, " "), err, stderr.String())
	}
	var v T
	if err := json.Unmarshal(stdout.Bytes(), &v); err != nil {
		t.Fatalf("agentbox %s printed %q: %v", strings.Join(args, " "), stdout.String(), err)
	}
	return &v
}
