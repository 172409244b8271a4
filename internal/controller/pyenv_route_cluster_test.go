package controller

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	crcache "sigs.k8s.io/controller-runtime/pkg/cache"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	"github.com/agentbox/terraform-provider-agentbox/internal/benchreport"
	"github.com/agentbox/terraform-provider-agentbox/internal/computeapi"
	apiclient "github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
	"github.com/agentbox/terraform-provider-agentbox/internal/store"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/pyenv"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/pyenv/pyenvtest"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"
)

// serveTestIndex serves a package index of pkgs on the sandbox's own
// loopback (pyenvIndexPort), from a static tree in /tmp, with the image's
// python3: the sandbox installs from it and nothing leaves the pod.
func serveTestIndex(t *testing.T, ctx context.Context, sup *supervisorapi.Client, pkgs ...pyenvtest.Package) {
	t.Helper()
	tree, err := pyenvtest.StaticTree(pkgs...)
	must(t, err)
	for p, data := range tree {
		_, err := sup.PutFile(ctx, path.Join("pyindex", p), bytes.NewReader(data), 0o644)
		must(t, err)
	}
	run(t, ctx, sup, "rm -rf /tmp/pyindex && mv /workspace/pyindex /tmp/pyindex")
	_, err = sup.StartProcess(ctx, supervisorapi.ProcessRequest{Command: []string{"python3", "-m", "http.server", pyenvIndexPort,
		"--bind", "127.0.0.1", "--directory", "/tmp/pyindex"}, Cwd: "/tmp"})
	must(t, err)
	run(t, ctx, sup, `for i in $(seq 100); do python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:`+pyenvIndexPort+`/simple/`+pkgs[0].Name+`/')" 2>/dev/null && exit 0; sleep 0.2; done; exit 1`)
}

// routeEnv is a cluster with the controllers, a store deciding warm takes
// and the Compute API over it, a template "warm" whose package index is
// the sandbox's loopback, and a warm pool "envs" of it.
type routeEnv struct {
	*clusterEnv
	api  *apiclient.Client
	pkgs []pyenvtest.Package
	// indexed are the sandboxes serving the index.
	indexed map[string]bool
}

func newRouteEnv(t *testing.T, replicas int32, pkgs ...pyenvtest.Package) *routeEnv {
	t.Helper()
	return newRouteEnvWith(t, replicas, nil, nil, pkgs...)
}

// newRouteEnvWith is newRouteEnv whose template tweak changes and whose
// API configure configures.
func newRouteEnvWith(t *testing.T, replicas int32, tweak func(*v1alpha1.SandboxTemplate), configure func(*computeapi.Options), pkgs ...pyenvtest.Package) *routeEnv {
	t.Helper()
	image := os.Getenv(EnvSandboxImage)
	if image == "" {
		t.Skipf("%s is not set: environments need the standard sandbox image's python3 with venv and pip", EnvSandboxImage)
	}
	var supervisors *computeapi.SupervisorPool
	st, err := store.Open(context.Background(), filepath.Join(t.TempDir(), "agentbox.db"), store.Options{})
	must(t, err)
	t.Cleanup(func() { st.Close() })
	e := newClusterEnv(t, withSnapshots(t, nil, &supervisors), func(r *SandboxReconciler) { r.WarmTakes = st })
	var configs []func(*computeapi.Options)
	if configure != nil {
		configs = append(configs, configure)
	}
	api := e.computeAPIWithStore(supervisors, st, configs...)
	e.template("warm", func(tpl *v1alpha1.SandboxTemplate) {
		tpl.Spec.Image = image
		tpl.Spec.IdleTimeout = metav1.Duration{Duration: time.Hour}
		tpl.Spec.Python.IndexURL = "http://127.0.0.1:" + pyenvIndexPort + "/simple/"
		if tweak != nil {
			tweak(tpl)
		}
	})
	must(t, e.c.Create(e.ctx, &v1alpha1.SandboxWarmPool{
		ObjectMeta: metav1.ObjectMeta{Name: "envs", Namespace: e.ns},
		Spec:       v1alpha1.SandboxWarmPoolSpec{TemplateRef: v1alpha1.LocalObjectReference{Name: "warm"}, Replicas: replicas},
	}))
	return &routeEnv{clusterEnv: e, api: api, pkgs: pkgs, indexed: map[string]bool{}}
}

// index serves the test's index in the sandbox, once.
func (e *routeEnv) index(sbx *v1alpha1.Sandbox) {
	e.t.Helper()
	if !e.indexed[sbx.Name] {
		serveTestIndex(e.t, e.ctx, e.supervisor(e.t, sbx), e.pkgs...)
		e.indexed[sbx.Name] = true
	}
}

// free lists the pool's sandboxes a pool lease may take now.
func (e *routeEnv) free() []v1alpha1.Sandbox {
	e.t.Helper()
	var list v1alpha1.SandboxList
	must(e.t, e.c.List(e.ctx, &list, client.InNamespace(e.ns), client.MatchingLabels{v1alpha1.LabelWarmPool: "envs"}))
	var out []v1alpha1.Sandbox
	for _, s := range list.Items {
		if s.DeletionTimestamp.IsZero() && !v1alpha1.PoolLeased(&s) && s.Annotations[v1alpha1.AnnotationAdoptedBy] == "" &&
			s.Status.Workload == "" && sandboxReady(&s) && v1alpha1.PrewarmSettled(&s) {
			out = append(out, s)
		}
	}
	return out
}

// declare sets the pool's pythonEnvironments.
func (e *routeEnv) declare(envs ...v1alpha1.WarmPythonEnvironment) {
	e.t.Helper()
	var pool v1alpha1.SandboxWarmPool
	must(e.t, e.get("envs", &pool))
	patch := client.MergeFrom(pool.DeepCopy())
	pool.Spec.PythonEnvironments = envs
	must(e.t, e.c.Patch(e.ctx, &pool, patch))
}

// waitPrewarmed waits until n ready warm sandboxes hold the environment
// key by their inventory and conditions, and the pool says so; it returns
// them. Meanwhile the pool's readyReplicas, once its status describes the
// spec declaring the environment, never counts more sandboxes than have
// settled their pre-warm (built the environment, or recorded a failure):
// readiness waits for the build. It fails the test if the pool never
// counted fewer than n ready during the build, which would mean it did
// not wait for it.
func (e *routeEnv) waitPrewarmed(key string, n int) []v1alpha1.Sandbox {
	e.t.Helper()
	var held []v1alpha1.Sandbox
	minReady := int32(n)
	e.eventually(fmt.Sprintf("%d warm sandboxes to hold %s", n, key), func() error {
		// The pool first: sandboxes only settle, so those listed after it
		// are at least as many as the pool can have counted.
		var pool v1alpha1.SandboxWarmPool
		if err := e.get("envs", &pool); err != nil {
			return err
		}
		var list v1alpha1.SandboxList
		if err := e.c.List(e.ctx, &list, client.InNamespace(e.ns), client.MatchingLabels{v1alpha1.LabelWarmPool: "envs"}); err != nil {
			return err
		}
		settled := int32(0)
		for _, s := range list.Items {
			if v1alpha1.PythonEnvState(&s, key) == v1alpha1.PythonEnvBuilt || s.Annotations[v1alpha1.AnnotationPrewarmFailed] != "" {
				settled++
			}
		}
		if pool.Status.ObservedGeneration == pool.Generation && len(pool.Spec.PythonEnvironments) > 0 {
			if pool.Status.ReadyReplicas > settled {
				e.t.Errorf("the pool counts %d ready while %d warm sandboxes have settled their pre-warm", pool.Status.ReadyReplicas, settled)
			}
			minReady = min(minReady, pool.Status.ReadyReplicas)
		}
		held = held[:0]
		for _, s := range e.free() {
			c := meta.FindStatusCondition(s.Status.Conditions, v1alpha1.ConditionPythonEnvironmentsReady)
			if v1alpha1.PythonEnvState(&s, key) == v1alpha1.PythonEnvBuilt && c != nil && c.Reason == v1alpha1.ReasonPrewarmed {
				held = append(held, s)
			}
		}
		c := meta.FindStatusCondition(pool.Status.Conditions, v1alpha1.ConditionPythonEnvironmentsReady)
		if len(held) != n || c == nil || c.Reason != v1alpha1.ReasonPrewarmed || pool.Status.ReadyReplicas != int32(n) {
			return fmt.Errorf("%d hold it; the pool counts %d ready; its condition %+v", len(held), pool.Status.ReadyReplicas, c)
		}
		return nil
	})
	if minReady >= int32(n) {
		e.t.Errorf("the pool never counted fewer than %d ready while its sandboxes built %s", n, key)
	}
	return held
}

// execute runs code with requirements in the agent's sandbox through the
// Compute API, and returns the result and how long the call took.
func (e *routeEnv) execute(agent string, requirements []string, code string) (*supervisorapi.ExecuteResult, time.Duration) {
	e.t.Helper()
	start := time.Now()
	raw, err := e.api.Execute(e.ctx, agent, supervisorapi.ExecuteRequest{Requirements: requirements, Code: code})
	took := time.Since(start)
	must(e.t, err)
	var res supervisorapi.ExecuteResult
	must(e.t, json.Unmarshal(raw, &res))
	if res.Status != supervisorapi.ExecuteSuccess || res.Env == nil {
		e.t.Fatalf("execute in %s: %s", agent, raw)
	}
	return &res, took
}

// TestPoolLeaseEnvRoutingOnCluster, on the real cluster (gVisor sandboxes,
// the real supervisor building real environments from a package index on
// each sandbox's loopback): a warm pool of 3 that declares environment E
// has every ready sandbox build and hold it before it is leased; ten pool
// leases asking for E, each released in between (its sandbox recycled and
// replaced), go to a sandbox holding E whenever one is free, and an
// execute with E's requirements there starts without installing. The
// replacements, whose loopback serves no index when they pre-warm, fail
// their build (PrewarmFailed) and are leased all the same; the test then
// builds E in every free one at once through the Compute API, which
// records it.
func TestPoolLeaseEnvRoutingOnCluster(t *testing.T) {
	t.Parallel()
	greet := pyenvtest.Package{Name: "agentbox-greet", Version: "1.0", Files: map[string][]byte{
		"agentbox_greet/__init__.py": []byte("def hello(who):\n    return 'hello ' + who\n"),
	}}
	began := time.Now()
	e := newRouteEnv(t, 3, greet)
	ctx := e.ctx
	warm := e.waitPoolFull("envs", 3)
	for _, s := range e.free() {
		e.index(&s)
	}
	requirements := []string{"agentbox-greet==1.0"}
	key, err := pyenv.RequirementsKey(requirements, "http://127.0.0.1:"+pyenvIndexPort+"/simple/", nil)
	must(t, err)
	e.declare(v1alpha1.WarmPythonEnvironment{Requirements: requirements})
	held := e.waitPrewarmed(key, 3)
	for _, s := range held {
		if _, ok := warm[s.Name]; !ok {
			t.Fatalf("pre-warmed sandbox %s is not one of the pool's %v", s.Name, warm)
		}
		list, err := e.supervisor(t, &s).ListEnvs(ctx)
		must(t, err)
		if len(list.Environments) != 1 || list.Environments[0].Name != key {
			t.Fatalf("sandbox %s's supervisor has %+v; its inventory says %s", s.Name, list.Environments, key)
		}
	}

	const code = "import agentbox_greet, sys; print(agentbox_greet.hello('routed'), sys.prefix)"
	var hits, prewarmFailed int
	var setup []float64
	for i := range 10 {
		// A free sandbox holding E, or one made so through the API.
		var free []v1alpha1.Sandbox
		e.eventually("a free sandbox in the pool", func() error {
			if free = e.free(); len(free) == 0 {
				return fmt.Errorf("none free")
			}
			return nil
		})
		holders := map[string]bool{}
		for _, s := range free {
			if v1alpha1.PythonEnvState(&s, key) == v1alpha1.PythonEnvBuilt {
				holders[s.Name] = true
			}
		}
		if len(holders) == 0 {
			// E is built in every free sandbox at once, so that the next
			// leases find holders free without a build of their own
			// between them (serial builds were most of this test's time).
			for _, s := range free {
				if c := meta.FindStatusCondition(s.Status.Conditions, v1alpha1.ConditionPythonEnvironmentsReady); c != nil && c.Reason == v1alpha1.ReasonPrewarmFailed {
					prewarmFailed++
				}
				e.index(&s)
			}
			errs := make(chan error, len(free))
			for _, s := range free {
				go func(agent string) {
					built, err := e.api.CreateEnv(ctx, agent, apiclient.EnvRequest{Requirements: requirements})
					if err == nil && built.Name != key {
						err = fmt.Errorf("the supervisor named E %q; the API's key is %q", built.Name, key)
					}
					errs <- err
				}(s.Spec.AgentID)
			}
			for range free {
				must(t, <-errs)
			}
			for _, s := range free {
				e.eventually("the inventory to record E in "+s.Name, func() error {
					var sb v1alpha1.Sandbox
					if err := e.get(s.Name, &sb); err != nil {
						return err
					}
					if v1alpha1.PythonEnvState(&sb, key) != v1alpha1.PythonEnvBuilt {
						return fmt.Errorf("annotations %v", sb.Annotations)
					}
					return nil
				})
				holders[s.Name] = true
			}
		}
		l, err := e.api.AcquirePoolLease(ctx, e.ns, "envs", apiclient.AcquireLeaseRequest{Holder: "router", RequestID: fmt.Sprintf("lease-%d", i),
			TTLSeconds: 120, WaitSeconds: 120, Requirements: requirements})
		must(t, err)
		if l.Routing == nil || l.Routing.EnvKey != key {
			t.Fatalf("lease %d: routing %+v", i, l.Routing)
		}
		// The inventory is a hint: a sandbox whose build the API saw start
		// but not end is marked building though it holds E, and is tried
		// right after the marked holders. What must hold is where the
		// lease went.
		if !holders[l.Sandbox] {
			t.Errorf("lease %d went to %s (%s) while %v held E", i, l.Sandbox, l.Routing.Result, holders)
		} else {
			hits++
		}
		res, took := e.execute(l.AgentID, requirements, code)
		if res.Env.Created || res.Env.Name != key {
			t.Errorf("lease %d: the execute in %s installed (env %+v)", i, l.Sandbox, res.Env)
		}
		setup = append(setup, float64(res.EnvSetupMS))
		t.Logf("lease %d: %s, %s; execute %s (env setup %d ms, cached %v)", i, l.Sandbox, l.Routing.Result, took.Round(time.Millisecond), res.EnvSetupMS, !res.Env.Created)
		must(t, e.api.ReleaseLease(ctx, l.AgentID, apiclient.ReleaseLeaseRequest{Holder: "router", LeaseID: l.LeaseID}))
	}
	if prewarmFailed == 0 {
		t.Errorf("no replacement showed PrewarmFailed, though none had an index when it pre-warmed")
	}
	t.Logf("%d of 10 leases routed to a holder of E; env setup of the routed executes p50 %.0f ms; %d replacements failed their pre-warm and were leased all the same; %s in all",
		hits, benchreport.Percentile(setup, 50), prewarmFailed, time.Since(began).Round(time.Second))
}

// TestPoolEnvRoutingBench prints the first execute with a 5-package
// requirement set on a sandbox a pool lease routed to (it pre-warmed the
// set) beside the same first execute on a fresh sandbox of the same
// template (it builds the set), in one run on the same node.
func TestPoolEnvRoutingBench(t *testing.T) {
	if os.Getenv(EnvBench) == "" {
		t.Skipf("%s is not set: the benchmarks run only on request", EnvBench)
	}
	var pkgs []pyenvtest.Package
	var requirements []string
	var imports string
	for i := range 5 {
		name := fmt.Sprintf("agentbox-bench%d", i)
		mod := fmt.Sprintf("agentbox_bench%d", i)
		pkgs = append(pkgs, pyenvtest.Package{Name: name, Version: "1.0", Files: map[string][]byte{
			mod + "/__init__.py": []byte(fmt.Sprintf("N = %d\n", i)),
		}})
		requirements = append(requirements, name+"==1.0")
		imports += mod + ".N+"
	}
	code := "import " + joinModules(5) + "; print(" + imports + "0)"
	const rounds = 3
	e := newRouteEnv(t, rounds, pkgs...)
	// The fresh side's template is the pool's twin: a Sandbox of the
	// pool's own would adopt a warm (pre-warmed) one.
	var pool v1alpha1.SandboxWarmPool
	must(t, e.get("envs", &pool))
	var tpl v1alpha1.SandboxTemplate
	must(t, e.get("warm", &tpl))
	e.template("fresh", func(f *v1alpha1.SandboxTemplate) { f.Spec = *tpl.Spec.DeepCopy() })
	e.waitPoolFull("envs", rounds)
	for _, s := range e.free() {
		e.index(&s)
	}
	key, err := pyenv.RequirementsKey(requirements, "http://127.0.0.1:"+pyenvIndexPort+"/simple/", nil)
	must(t, err)
	e.declare(v1alpha1.WarmPythonEnvironment{Requirements: requirements})
	e.waitPrewarmed(key, rounds)

	var routed, fresh []float64
	for i := range rounds {
		l, err := e.api.AcquirePoolLease(e.ctx, e.ns, "envs", apiclient.AcquireLeaseRequest{Holder: "bench", RequestID: fmt.Sprintf("bench-%d", i),
			TTLSeconds: 300, Requirements: requirements})
		must(t, err)
		if l.Routing == nil || l.Routing.Result != apiclient.RoutingHit {
			t.Fatalf("bench lease %d: routing %+v", i, l.Routing)
		}
		res, took := e.execute(l.AgentID, requirements, code)
		if res.Env.Created {
			t.Fatalf("the routed execute installed: %+v", res.Env)
		}
		routed = append(routed, float64(took.Milliseconds()))

		name := fmt.Sprintf("fresh-%d", i)
		e.sandbox(name, "fresh")
		sbx, _ := e.waitPhase(name, v1alpha1.SandboxPhaseRunning, v1alpha1.ReasonRunning)
		e.index(sbx)
		res, took = e.execute(sbx.Spec.AgentID, requirements, code)
		if !res.Env.Created {
			t.Fatalf("the fresh sandbox's execute found the set cached: %+v", res.Env)
		}
		fresh = append(fresh, float64(took.Milliseconds()))
		must(t, e.api.ReleaseLease(e.ctx, l.AgentID, apiclient.ReleaseLeaseRequest{Holder: "bench", LeaseID: l.LeaseID}))
	}
	ratio := benchreport.Percentile(fresh, 50) / benchreport.Percentile(routed, 50)
	met := ratio >= 10
	benchreport.Record(t, benchreport.Figure{Name: "first execute with a 5-package requirement set, routed pool lease (pre-warmed)", Unit: "ms",
		Values: routed, Note: fmt.Sprintf("fresh sandbox p50 %.0f ms beside it", benchreport.Percentile(fresh, 50))})
	benchreport.Record(t, benchreport.Figure{Name: "first execute with a 5-package requirement set, fresh sandbox (builds it)", Unit: "ms",
		Values: fresh})
	benchreport.Record(t, benchreport.Figure{Name: "first execute, fresh / routed (p50)", Unit: "x", Values: []float64{ratio},
		Target: ">= 10x", Met: &met, Note: "the package index is on each sandbox's loopback: a remote index makes the fresh side slower still"})
}

// joinModules is "agentbox_bench0, agentbox_bench1, ..." for n modules.
func joinModules(n int) string {
	s := ""
	for i := range n {
		if i > 0 {
			s += ", "
		}
		s += fmt.Sprintf("agentbox_bench%d", i)
	}
	return s
}

// watchWarm feeds the API's keeper of warm connections from an informer of
// its own, as the control plane's Sandbox informer does
// (Server.WarmPoolEvents): its keep-alive health calls are what bring a
// free warm sandbox's evictions to its inventory.
func (e *routeEnv) watchWarm() {
	e.t.Helper()
	c, err := crcache.New(e.cfg, crcache.Options{Scheme: e.scheme, DefaultNamespaces: map[string]crcache.Config{e.ns: {}}})
	must(e.t, err)
	inf, err := c.GetInformer(e.ctx, &v1alpha1.Sandbox{})
	must(e.t, err)
	_, err = inf.AddEventHandler(e.apiServer.WarmPoolEvents())
	must(e.t, err)
	go func() { _ = c.Start(e.ctx) }()
}

// buildInYoungest builds the environment of requirements (key key) through
// the Compute API in the youngest free warm sandbox, the one an adoption
// by age would take last, waits for its inventory to record it, and
// returns its name.
func (e *routeEnv) buildInYoungest(requirements []string, key string) string {
	e.t.Helper()
	var free []v1alpha1.Sandbox
	e.eventually("two free warm sandboxes", func() error {
		if free = e.free(); len(free) < 2 {
			return fmt.Errorf("%d free", len(free))
		}
		return nil
	})
	youngest := free[0]
	for _, s := range free[1:] {
		if youngest.CreationTimestamp.Before(&s.CreationTimestamp) {
			youngest = s
		}
	}
	for _, s := range free {
		if s.Name != youngest.Name && v1alpha1.PythonEnvState(&s, key) != "" {
			e.t.Fatalf("warm sandbox %s records %s already: %v", s.Name, key, s.Annotations)
		}
	}
	e.index(&youngest)
	built, err := e.api.CreateEnv(e.ctx, youngest.Spec.AgentID, apiclient.EnvRequest{Requirements: requirements})
	must(e.t, err)
	if built.Name != key {
		e.t.Fatalf("the supervisor named the environment %q; the key is %q", built.Name, key)
	}
	e.eventually("the inventory of "+youngest.Name+" to record "+key, func() error {
		var sb v1alpha1.Sandbox
		if err := e.get(youngest.Name, &sb); err != nil {
			return err
		}
		if v1alpha1.PythonEnvState(&sb, key) != v1alpha1.PythonEnvBuilt {
			return fmt.Errorf("annotations %v", sb.Annotations)
		}
		return nil
	})
	return youngest.Name
}

// TestAdoptionEnvRoutingOnCluster, on the real cluster (gVisor sandboxes,
// real builds from a package index on each sandbox's loopback), with a
// warm pool of 2 whose younger sandbox alone holds environment E:
//
//   - a new Sandbox that names E (python-requirements annotation) adopts
//     the holder rather than the older one, says so (python-env-routing:
//     hit), takes its inventory over, and its execute with E's
//     requirements installs nothing;
//   - a job-mode run naming E (pool_requirements) gets a sandbox that
//     adopts the holder the same way;
//   - an environment the supervisor evicts (the template's 1-minute
//     time-to-live) from a free warm sandbox leaves its inventory with no
//     list call: the API's keep-alive health call brings it.
func TestAdoptionEnvRoutingOnCluster(t *testing.T) {
	t.Parallel()
	greet := pyenvtest.Package{Name: "agentbox-greet", Version: "1.0", Files: map[string][]byte{
		"agentbox_greet/__init__.py": []byte("def hello(who):\n    return 'hello ' + who\n"),
	}}
	e := newRouteEnvWith(t, 2, func(tpl *v1alpha1.SandboxTemplate) {
		tpl.Spec.Python.Environments = &v1alpha1.PythonEnvironments{TTL: &metav1.Duration{Duration: time.Minute}}
	}, func(o *computeapi.Options) { o.WarmKeepAlive = 3 * time.Second }, greet)
	e.watchWarm()
	ctx := e.ctx
	requirements := []string{"agentbox-greet==1.0"}
	key, err := pyenv.RequirementsKey(requirements, "http://127.0.0.1:"+pyenvIndexPort+"/simple/", nil)
	must(t, err)
	e.waitPoolFull("envs", 2)

	// A Sandbox naming E.
	holder := e.buildInYoungest(requirements, key)
	must(t, e.c.Create(ctx, &v1alpha1.Sandbox{
		ObjectMeta: metav1.ObjectMeta{Name: "adopter", Namespace: e.ns,
			Annotations: map[string]string{v1alpha1.AnnotationPythonRequirements: strings.Join(requirements, " ")}},
		Spec: v1alpha1.SandboxSpec{AgentID: "adopter-agent", TemplateRef: v1alpha1.LocalObjectReference{Name: "warm"}},
	}))
	// An adopter stays Ready with reason AdoptedFromWarmPool.
	adopter, took := e.waitPhase("adopter", v1alpha1.SandboxPhaseRunning, v1alpha1.ReasonAdoptedFromWarmPool)
	if adopter.Status.Workload != holder || adopter.Annotations[v1alpha1.AnnotationPythonEnvRouting] != apiclient.RoutingHit {
		t.Fatalf("the adopter took %q (routing %q); %s held E", adopter.Status.Workload, adopter.Annotations[v1alpha1.AnnotationPythonEnvRouting], holder)
	}
	if v1alpha1.PythonEnvState(adopter, key) != v1alpha1.PythonEnvBuilt {
		t.Errorf("the adopter's inventory misses E: %v", adopter.Annotations)
	}
	const code = "import agentbox_greet; print(agentbox_greet.hello('adopted'))"
	if res, _ := e.execute(adopter.Spec.AgentID, requirements, code); res.Env.Created || res.Env.Name != key {
		t.Errorf("the adopter's execute installed: %+v", res.Env)
	}
	t.Logf("adopted %s (hit) in %s", holder, took.Round(time.Millisecond))

	// A job run naming E.
	e.waitPoolFull("envs", 2)
	holder = e.buildInYoungest(requirements, key)
	run, created, err := e.api.StartRun(ctx, apiclient.StartRunRequest{Mode: apiclient.RunModeJob, Template: e.ns + "/warm",
		PoolRequirements: requirements, TimeoutSeconds: 60, Command: []string{"sleep", "5"}})
	if err != nil || !created {
		t.Fatalf("start the job run: %+v, %v", run, err)
	}
	e.eventually("the job run's sandbox to adopt", func() error {
		var sb v1alpha1.Sandbox
		if err := e.get(run.ID, &sb); err != nil {
			return err
		}
		if sb.Status.Workload == "" {
			return fmt.Errorf("not adopted yet (phase %s)", sb.Status.Phase)
		}
		if sb.Status.Workload != holder || sb.Annotations[v1alpha1.AnnotationPythonEnvRouting] != apiclient.RoutingHit {
			t.Fatalf("the job run's sandbox took %q (routing %q); %s held E", sb.Status.Workload, sb.Annotations[v1alpha1.AnnotationPythonEnvRouting], holder)
		}
		return nil
	})
	wctx, cancel := context.WithTimeout(ctx, 2*waitTimeout)
	defer cancel()
	done, err := e.api.WaitRun(wctx, run.ID, 200*time.Millisecond)
	must(t, err)
	if done.Status != apiclient.RunSucceeded {
		t.Errorf("the job run ended %+v", done)
	}

	// An eviction.
	e.waitPoolFull("envs", 2)
	var target v1alpha1.Sandbox
	e.eventually("a free warm sandbox", func() error {
		free := e.free()
		if len(free) == 0 {
			return fmt.Errorf("none free")
		}
		target = free[0]
		return nil
	})
	_, err = e.api.CreateEnv(ctx, target.Spec.AgentID, apiclient.EnvRequest{Name: "scratch"})
	must(t, err)
	built := time.Now()
	e.eventually("the inventory of "+target.Name+" to record scratch", func() error {
		var sb v1alpha1.Sandbox
		if err := e.get(target.Name, &sb); err != nil {
			return err
		}
		if v1alpha1.PythonEnvState(&sb, "scratch") != v1alpha1.PythonEnvBuilt {
			return fmt.Errorf("annotations %v", sb.Annotations)
		}
		return nil
	})
	for {
		var sb v1alpha1.Sandbox
		must(t, e.get(target.Name, &sb))
		if v1alpha1.PoolLeased(&sb) || sb.Annotations[v1alpha1.AnnotationAdoptedBy] != "" || !sb.DeletionTimestamp.IsZero() {
			t.Fatalf("warm sandbox %s was taken before the eviction: %v", sb.Name, sb.Annotations)
		}
		if v1alpha1.PythonEnvState(&sb, "scratch") == "" {
			break
		}
		if time.Since(built) > waitTimeout {
			t.Fatalf("the evicted environment is still in %s's inventory %s after it was built", target.Name, time.Since(built).Round(time.Second))
		}
		time.Sleep(time.Second)
	}
	t.Logf("the evicted environment left %s's inventory %s after its build (time-to-live 1m)", target.Name, time.Since(built).Round(time.Second))
}
