package computeapi

import (
	"context"
	"encoding/json"
	"net/url"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	clocktesting "k8s.io/utils/clock/testing"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	api "github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/pyenv"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/pyenv/pyenvtest"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"
)

// The environment inventory in front of the real supervisor and its real
// builds: envs create, execute, delete and list keep the sandbox's
// annotations what the supervisor has, under the key the API computes
// from the template's package index without asking the sandbox.
func TestEnvInventory(t *testing.T) {
	py, err := exec.LookPath("python3")
	if err != nil || exec.Command(py, "-c", "import venv, ensurepip").Run() != nil {
		t.Skip("no python3 with venv and ensurepip")
	}
	ix := pyenvtest.NewIndex(t, pyenvtest.Package{Name: "agentbox-greet", Version: "1.0", Files: map[string][]byte{
		"agentbox_greet.py": []byte("def hello(who):\n    return 'hello ' + who\n"),
	}})
	tpl := &v1alpha1.SandboxTemplate{ObjectMeta: metav1.ObjectMeta{Namespace: "team-a", Name: "python"},
		Spec: v1alpha1.SandboxTemplateSpec{Python: v1alpha1.PythonPolicy{IndexURL: ix.URL}}}
	var kube client.Client
	c := realSupervisorAPIWith(t, apiSetup{pushDelay: -1, extra: []client.Object{tpl},
		configure: func(cfg *supervisor.Config) {
			cfg.Python = py
			cfg.Execute.Envs = &pyenv.Config{Dir: t.TempDir(), IndexURL: ix.URL, TTL: 0}
		},
		started: func(k client.Client, _ *clocktesting.FakeClock) { kube = k },
	})(adminToken)
	ctx := context.Background()
	inventory := func() map[string]string {
		t.Helper()
		var sb v1alpha1.Sandbox
		if err := kube.Get(ctx, types.NamespacedName{Namespace: "team-a", Name: "sb-1"}, &sb); err != nil {
			t.Fatal(err)
		}
		out := map[string]string{}
		for k, v := range sb.Annotations {
			if name, ok := cutInventory(k); ok {
				out[name] = v
			}
		}
		return out
	}

	reqs := []string{"agentbox-greet"}
	key, err := pyenv.RequirementsKey(reqs, ix.URL, nil)
	if err != nil {
		t.Fatal(err)
	}
	res, err := c.CreateEnv(ctx, "agent-1", api.EnvRequest{Requirements: reqs})
	if err != nil {
		t.Fatal(err)
	}
	if res.Name != key {
		t.Fatalf("the supervisor named the environment %q; the API's key is %q", res.Name, key)
	}
	if inv := inventory(); len(inv) != 1 || inv[key] != v1alpha1.PythonEnvBuilt {
		t.Fatalf("inventory after envs create: %v", inv)
	}

	// An execute that builds another set records it; one using a cached
	// set writes nothing new.
	other := []string{"agentbox-greet==1.0"}
	otherKey, _ := pyenv.RequirementsKey(other, ix.URL, nil)
	raw, err := c.Execute(ctx, "agent-1", supervisorapi.ExecuteRequest{Code: "import agentbox_greet; print(agentbox_greet.hello('x'))", Requirements: other})
	if err != nil {
		t.Fatal(err)
	}
	var out supervisorapi.ExecuteResult
	if err := json.Unmarshal(raw, &out); err != nil || out.Env == nil || out.Env.Name != otherKey || !out.Env.Created {
		t.Fatalf("execute: %s, %v", raw, err)
	}
	if inv := inventory(); len(inv) != 2 || inv[otherKey] != v1alpha1.PythonEnvBuilt || inv[key] != v1alpha1.PythonEnvBuilt {
		t.Fatalf("inventory after execute: %v", inv)
	}

	if _, err := c.DeleteEnv(ctx, "agent-1", otherKey); err != nil {
		t.Fatal(err)
	}
	if inv := inventory(); len(inv) != 1 || inv[key] != v1alpha1.PythonEnvBuilt {
		t.Fatalf("inventory after delete: %v", inv)
	}

	// An environment the inventory has and the supervisor lost (evicted)
	// goes at the next list.
	var sb v1alpha1.Sandbox
	if err := kube.Get(ctx, types.NamespacedName{Namespace: "team-a", Name: "sb-1"}, &sb); err != nil {
		t.Fatal(err)
	}
	patch := client.MergeFrom(sb.DeepCopy())
	sb.Annotations[v1alpha1.AnnotationPythonEnvPrefix+"reqs-0000000000000000"] = v1alpha1.PythonEnvBuilt
	if err := kube.Patch(ctx, &sb, patch); err != nil {
		t.Fatal(err)
	}
	if _, err := c.ListEnvs(ctx, "agent-1"); err != nil {
		t.Fatal(err)
	}
	if inv := inventory(); len(inv) != 1 || inv[key] != v1alpha1.PythonEnvBuilt {
		t.Fatalf("inventory after list: %v", inv)
	}
}

func cutInventory(annotation string) (string, bool) {
	p := v1alpha1.AnnotationPythonEnvPrefix
	if len(annotation) > len(p) && annotation[:len(p)] == p {
		return annotation[len(p):], true
	}
	return "", false
}

// Pool leases naming an environment go to a free sandbox holding it, then
// to one building it, then the oldest; the answer, the metric and the
// audit say which. A sandbox still building its pool's environments is
// not leased.
func TestPoolLeaseRoutesByEnvironment(t *testing.T) {
	f := poolFixture(t, "w-1", "w-2", "w-3", "w-4", "w-5")
	ctx := context.Background()
	tpl := &v1alpha1.SandboxTemplate{ObjectMeta: metav1.ObjectMeta{Namespace: "team-a", Name: "python"},
		Spec: v1alpha1.SandboxTemplateSpec{Python: v1alpha1.PythonPolicy{IndexURL: "http://127.0.0.1:9/simple/"}}}
	if err := f.kube.Create(ctx, tpl); err != nil {
		t.Fatal(err)
	}
	reqs := []string{"pandas>=2", "numpy"}
	key, err := pyenv.RequirementsKey(reqs, tpl.Spec.Python.IndexURL, nil)
	if err != nil {
		t.Fatal(err)
	}
	annotate := func(name string, kv map[string]string) {
		t.Helper()
		sb := f.sandboxNamed(t, name)
		patch := client.MergeFrom(sb.DeepCopy())
		if sb.Annotations == nil {
			sb.Annotations = map[string]string{}
		}
		for k, v := range kv {
			sb.Annotations[k] = v
		}
		if err := f.kube.Patch(ctx, sb, patch); err != nil {
			t.Fatal(err)
		}
	}
	// w-1 (the oldest) holds nothing; w-2 builds the set; w-4 and w-3
	// hold it; w-5 holds it but is still pre-warming, so is not free.
	annotate("w-2", map[string]string{v1alpha1.AnnotationPythonEnvPrefix + key: v1alpha1.PythonEnvBuilding})
	annotate("w-3", map[string]string{v1alpha1.AnnotationPythonEnvPrefix + key: v1alpha1.PythonEnvBuilt})
	annotate("w-4", map[string]string{v1alpha1.AnnotationPythonEnvPrefix + key: v1alpha1.PythonEnvBuilt, v1alpha1.AnnotationPythonEnvPrefix + "named": v1alpha1.PythonEnvBuilt})
	annotate("w-5", map[string]string{v1alpha1.AnnotationPythonEnvPrefix + key: v1alpha1.PythonEnvBuilt,
		v1alpha1.AnnotationPrewarmEnvs: `[{"requirements":["numpy"]}]`})

	c := f.client(t, adminToken)
	hits := testutil.ToFloat64(metricPoolLeaseEnvRouting.WithLabelValues(api.RoutingHit))
	acquire := func(id string, req api.AcquireLeaseRequest) *api.PoolLease {
		t.Helper()
		req.Holder, req.RequestID = "h-"+id, "r-"+id
		got, err := c.AcquirePoolLease(ctx, "team-a", "p", req)
		if err != nil {
			t.Fatal(err)
		}
		return got
	}
	want := func(got *api.PoolLease, sandbox, result, envKey string) {
		t.Helper()
		if got.Sandbox != sandbox || got.Routing == nil || got.Routing.Result != result || got.Routing.EnvKey != envKey {
			t.Errorf("lease went to %s with routing %+v; want %s, %s %s", got.Sandbox, got.Routing, sandbox, result, envKey)
		}
	}
	want(acquire("1", api.AcquireLeaseRequest{EnvName: "named"}), "w-4", api.RoutingHit, "named")
	want(acquire("2", api.AcquireLeaseRequest{Requirements: reqs}), "w-3", api.RoutingHit, key)
	// The same set spelled otherwise is the same key.
	want(acquire("3", api.AcquireLeaseRequest{Requirements: []string{"NumPy", "pandas >= 2"}}), "w-2", api.RoutingBuilding, key)
	want(acquire("4", api.AcquireLeaseRequest{Requirements: reqs}), "w-1", api.RoutingMiss, key)
	if got := testutil.ToFloat64(metricPoolLeaseEnvRouting.WithLabelValues(api.RoutingHit)) - hits; got != 2 {
		t.Errorf("hits counted: %v, want 2", got)
	}
	// The audit record of each says how it was routed.
	var routed []string
	deadline := time.Now().Add(10 * time.Second)
	for len(routed) < 4 && time.Now().Before(deadline) {
		page, err := c.QueryAudit(ctx, url.Values{"operation": {"acquire_pool_lease"}, "limit": {"100"}})
		if err != nil {
			t.Fatal(err)
		}
		routed = routed[:0]
		for _, rec := range page.Records {
			if strings.Contains(rec.Detail, `"routing"`) {
				routed = append(routed, rec.Detail)
			}
		}
		time.Sleep(20 * time.Millisecond)
	}
	if len(routed) != 4 || !strings.Contains(strings.Join(routed, " "), `"result":"building"`) {
		t.Errorf("audit details of the routed leases: %q", routed)
	}
	// w-5 is not done pre-warming: nothing is free.
	_, err = c.AcquirePoolLease(ctx, "team-a", "p", api.AcquireLeaseRequest{Holder: "h-5", RequestID: "r-5", Requirements: reqs})
	wantAPIError(t, err, api.CodePoolExhausted, 503)

	_, err = c.AcquirePoolLease(ctx, "team-a", "p", api.AcquireLeaseRequest{Holder: "h-6", RequestID: "r-6", Requirements: reqs, EnvName: "x"})
	wantAPIError(t, err, api.CodeInvalidArgument, 400)
	_, err = c.AcquireLease(ctx, "agent-1", api.AcquireLeaseRequest{Holder: "h-7", RequestID: "r-7", EnvName: "x"})
	wantAPIError(t, err, api.CodeInvalidArgument, 400)
}

// A pool-mode run names its environment as a pool lease does, and its
// lease is routed (and counted) the same way; other modes refuse it.
func TestPoolRunRoutesByEnvironment(t *testing.T) {
	ctx := context.Background()
	f := servedPoolFixture(t)
	sb := f.sandboxNamed(t, "w-1")
	patch := client.MergeFrom(sb.DeepCopy())
	sb.Annotations = map[string]string{v1alpha1.AnnotationPythonEnvPrefix + "data": v1alpha1.PythonEnvBuilt}
	if err := f.kube.Patch(ctx, sb, patch); err != nil {
		t.Fatal(err)
	}
	c := f.client(t, adminToken)
	hits := testutil.ToFloat64(metricPoolLeaseEnvRouting.WithLabelValues(api.RoutingHit))
	run, created, err := c.StartRun(ctx, api.StartRunRequest{Mode: api.RunModePool, Pool: "team-a/p", PoolEnvName: "data", Command: []string{"true"}})
	if err != nil || !created {
		t.Fatalf("start: %+v, %v", run, err)
	}
	// (The fixture's supervisor runs no commands: the lease is what counts.)
	if done := waitRun(t, c, run.ID); done.Sandbox != "team-a/w-1" {
		t.Fatalf("pool run ended %+v", done)
	}
	if got := testutil.ToFloat64(metricPoolLeaseEnvRouting.WithLabelValues(api.RoutingHit)) - hits; got != 1 {
		t.Errorf("routing hits counted for the run: %v", got)
	}
	for _, req := range []api.StartRunRequest{
		{AgentID: "agent-1", PoolEnvName: "data", Command: []string{"true"}},
		{Mode: api.RunModePool, Pool: "team-a/p", PoolEnvName: "data", PoolRequirements: []string{"numpy"}, Command: []string{"true"}},
		{Mode: api.RunModePool, Pool: "team-a/p", PoolRequirements: []string{"x @ https://example.invalid/x.whl"}, Command: []string{"true"}},
	} {
		if _, _, err := c.StartRun(ctx, req); api.CodeOf(err) != api.CodeInvalidArgument {
			t.Errorf("%+v: %v, want invalid_argument", req, err)
		}
	}
}
